#!/usr/bin/env bash
# A real systemd (Debian bookworm, systemd 252) in a systemd-nspawn container, to test
# systemd/inferd.service and systemd/inferd.socket as a packaged install would run them.
# Works on a host without systemd (a CI container), as root.
#
#   scripts/systemd-container.sh up           build the rootfs once (cached), install inferd, boot
#   scripts/systemd-container.sh exec CMD...  run CMD inside (nsenter into every namespace)
#   scripts/systemd-container.sh sync         reinstall the files below into a running container
#   scripts/systemd-container.sh down         power the container off
#   scripts/systemd-container.sh status       say whether it runs, and its PID 1 on the host
#
# `up` is idempotent: it reuses the rootfs in .cache/systemd-rootfs (gitignored) and a running
# container, and only copies what changed. Installed, as docs/systemd.md describes:
#   /usr/bin/inferd                         target/release/inferd
#   /usr/lib/inferd/libonnxruntime.so.*     vendor/onnxruntime/lib/
#   /var/lib/inferd/models/minilm           models/minilm (model.toml, model.onnx, tokenizer.json)
#   /etc/inferd/inferd.toml                 systemd/inferd.toml
#   /etc/systemd/system/inferd.{service,socket}, /etc/sysctl.d/99-inferd.conf
#   the system user and group `inferd`
#
# Environment:
#   INFERD_SYSTEMD_ROOT     rootfs folder (default .cache/systemd-rootfs)
#   INFERD_SYSTEMD_NETWORK  private (default: own network namespace with only loopback, so port
#                           8000 cannot collide with anything on the host, and the unit's
#                           sysctl of net.ipv4.tcp_migrate_req applies to that namespace) or
#                           host (share the host's network: the service is reachable from the
#                           host, and /proc/sys/net is read-only inside). Chosen at boot: `down`
#                           first to change it
#   INFERD_SYSTEMD_PORT     port for server.listen and inferd.socket (default 8000; another
#                           value is written into the config and a drop-in for the socket)
#   INFERD_SYSTEMD_WORKERS  server.workers in the installed config (default 0, the config's own:
#                           one worker per two usable cores; threads follow from the budget)
#   INFERD_BIN              the binary to install (default target/release/inferd)
#   DEBIAN_MIRROR           default http://deb.debian.org/debian
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=${INFERD_SYSTEMD_ROOT:-$REPO/.cache/systemd-rootfs}
STATE=$REPO/.cache/systemd-container
MACHINE=inferd-test
NETWORK=${INFERD_SYSTEMD_NETWORK:-private}
PORT=${INFERD_SYSTEMD_PORT:-8000}
WORKERS=${INFERD_SYSTEMD_WORKERS:-0}
BIN=${INFERD_BIN:-$REPO/target/release/inferd}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=systemd,dbus,systemd-sysv,curl,procps,iproute2

log() { echo "systemd-container: $*" >&2; }
die() { log "$*"; exit 1; }
# This host cannot run a systemd container (no root, no tools, no mirror, nspawn refused):
# exit 77, which scripts/systemd-e2e.sh and tests/systemd_unit.rs report as a skip, not a pass.
cannot() { log "cannot run a systemd container here: $*"; exit 77; }

[ "$(id -u)" = 0 ] || cannot "must run as root (debootstrap, systemd-nspawn, nsenter)"

need_tools() {
    local missing=()
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
    command -v nsenter >/dev/null || missing+=(util-linux)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; } \
            || cannot "apt-get could not install ${missing[*]}"
    fi
}

build_rootfs() {
    [ -e "$ROOT/.inferd-rootfs" ] && return 0
    local partial=$ROOT.partial start=$SECONDS
    rm -rf "$partial"
    mkdir -p "$(dirname "$ROOT")"
    log "building the Debian bookworm rootfs in $ROOT (once; about a minute)"
    debootstrap --variant=minbase --include=$PACKAGES bookworm "$partial" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 \
        || { tail -20 "$STATE/debootstrap.log" >&2; cannot "debootstrap failed (log: $STATE/debootstrap.log)"; }
    # A container needs no serial getty; journald keeps the journal in /run (volatile).
    chroot "$partial" systemctl mask console-getty.service getty@tty1.service >/dev/null 2>&1 || true
    echo "$MACHINE" >"$partial/etc/hostname"
    rm -rf "$ROOT"
    mv "$partial" "$ROOT"
    echo "debian bookworm minbase + $PACKAGES, $(date -u +%FT%TZ)" >"$ROOT/.inferd-rootfs"
    log "rootfs built in $((SECONDS - start)) s"
}

# put SRC DST MODE: copy when different, noting DST in CHANGED.
CHANGED=()
put() {
    local src=$1 dst=$ROOT$2 mode=$3
    if ! cmp -s "$src" "$dst"; then
        mkdir -p "$(dirname "$dst")"
        install -m "$mode" "$src" "$dst.new" && mv -f "$dst.new" "$dst"
        CHANGED+=("$2")
    fi
}

install_inferd() {
    [ -x "$BIN" ] || die "$BIN is missing: cargo build --release --locked -p inferd"
    local lib
    lib=$(ls "$REPO"/vendor/onnxruntime/lib/libonnxruntime.so.* 2>/dev/null | sort -V | tail -1)
    [ -n "$lib" ] || die "no vendor/onnxruntime/lib/libonnxruntime.so.*: run make setup"
    for f in model.toml model.onnx tokenizer.json; do
        [ -f "$REPO/models/minilm/$f" ] || die "models/minilm/$f is missing: run make setup"
    done
    chroot "$ROOT" sh -c 'getent group inferd >/dev/null || groupadd --system inferd
        getent passwd inferd >/dev/null || useradd --system --gid inferd --home-dir /var/lib/inferd \
            --no-create-home --shell /usr/sbin/nologin inferd'
    mkdir -p "$ROOT/usr/lib/inferd" "$ROOT/etc/inferd" "$ROOT/var/lib/inferd/models/minilm"
    put "$BIN" /usr/bin/inferd 0755
    put "$lib" "/usr/lib/inferd/$(basename "$lib")" 0644
    for f in model.toml model.onnx tokenizer.json; do
        put "$REPO/models/minilm/$f" "/var/lib/inferd/models/minilm/$f" 0644
    done
    local conf=$STATE/inferd.toml
    sed -e "s/^listen = \"0.0.0.0:8000\"/listen = \"0.0.0.0:$PORT\"/" \
        -e "s/^workers = 0$/workers = $WORKERS/" "$REPO/systemd/inferd.toml" >"$conf"
    put "$conf" /etc/inferd/inferd.toml 0644
    put "$REPO/systemd/99-inferd.conf" /etc/sysctl.d/99-inferd.conf 0644
    put "$REPO/systemd/inferd.service" /etc/systemd/system/inferd.service 0644
    put "$REPO/systemd/inferd.socket" /etc/systemd/system/inferd.socket 0644
    # systemd 252 knows the newer sandboxing options: the drop-in docs/systemd.md gives for it.
    put "$REPO/systemd/hardening.conf" /etc/systemd/system/inferd.service.d/hardening.conf 0644
    local dropin=$ROOT/etc/systemd/system/inferd.socket.d/port.conf
    if [ "$PORT" != 8000 ]; then
        mkdir -p "$(dirname "$dropin")"
        printf '[Socket]\nListenStream=\nListenStream=0.0.0.0:%s\n' "$PORT" >"$STATE/port.conf"
        put "$STATE/port.conf" /etc/systemd/system/inferd.socket.d/port.conf 0644
    elif [ -e "$dropin" ]; then
        rm -f "$dropin"
        CHANGED+=(/etc/systemd/system/inferd.socket.d/port.conf)
    fi
    [ ${#CHANGED[@]} -eq 0 ] || log "installed: ${CHANGED[*]}"
    echo "${#CHANGED[@]}"
}

nspawn_pid() {
    local pid
    pid=$(cat "$STATE/nspawn.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = systemd-nspawn ] \
        && echo "$pid"
}

# The container's PID 1 as the host sees it: the descendant of systemd-nspawn whose last
# NSpid is 1.
container_pid() {
    local nspawn queue p child
    nspawn=$(nspawn_pid) || return 1
    queue=("$nspawn")
    while [ ${#queue[@]} -gt 0 ]; do
        p=${queue[0]}
        queue=("${queue[@]:1}")
        for child in $(pgrep -P "$p" || true); do
            if awk '/^NSpid:/ { found = NF >= 3 && $NF == 1 } END { exit !found }' "/proc/$child/status" 2>/dev/null; then
                echo "$child"
                return 0
            fi
            queue+=("$child")
        done
    done
    return 1
}

inside() {
    local pid
    pid=$(container_pid) || die "the container is not running: $0 up"
    nsenter -t "$pid" -a env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 SYSTEMD_PAGER= SYSTEMD_COLORS=0 "$@"
}

boot() {
    # CAP_SYS_RESOURCE, which nspawn drops by default: the container's systemd then applies the
    # unit's Limit*= (LimitNICE=, LimitNOFILE=) above the host's limits, as on a real host.
    local args=(-D "$ROOT" --boot --register=no --keep-unit -M "$MACHINE" --console=read-only
        --bind-ro="$REPO:/src" --capability=CAP_SYS_RESOURCE)
    [ "$NETWORK" = host ] || args+=(--private-network)
    log "booting: systemd-nspawn ${args[*]}"
    local start=$SECONDS
    setsid systemd-nspawn "${args[@]}" >"$STATE/console.log" 2>&1 </dev/null &
    echo $! >"$STATE/nspawn.pid"
    local state=
    for _ in $(seq 1 300); do
        if container_pid >/dev/null; then
            state=$(inside systemctl is-system-running 2>/dev/null || true)
            case $state in running | degraded) break ;; esac
        fi
        nspawn_pid >/dev/null || { tail -30 "$STATE/console.log" >&2; cannot "systemd-nspawn exited"; }
        sleep 0.2
    done
    case $state in
        running | degraded) log "booted in $((SECONDS - start)) s ($state), container PID 1 = host pid $(container_pid)" ;;
        *) tail -30 "$STATE/console.log" >&2; cannot "the container did not finish booting (state: ${state:-unknown})" ;;
    esac
    if [ "$state" = degraded ]; then
        inside systemctl --failed --no-legend >&2 || true
    fi
}

up() {
    mkdir -p "$STATE"
    need_tools
    build_rootfs
    local changed
    changed=$(install_inferd)
    if container_pid >/dev/null; then
        if [ "$changed" != 0 ]; then
            inside systemctl daemon-reload
        fi
        log "running (container PID 1 = host pid $(container_pid))"
    else
        boot
    fi
}

down() {
    local pid
    pid=$(nspawn_pid) || { log "not running"; rm -f "$STATE/nspawn.pid"; return 0; }
    log "powering off"
    # systemd-nspawn turns SIGTERM into a clean poweroff of the container.
    kill -TERM "$pid"
    for _ in $(seq 1 150); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$STATE/nspawn.pid"; log "stopped"; return 0; }
        sleep 0.2
    done
    log "no clean poweroff within 30 s: killing systemd-nspawn ($pid)"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$STATE/nspawn.pid"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
    up) up ;;
    down) down ;;
    exec)
        [ $# -gt 0 ] || set -- bash -l
        inside "$@"
        ;;
    sync)
        mkdir -p "$STATE"
        [ "$(install_inferd)" = 0 ] || inside systemctl daemon-reload
        ;;
    status)
        if pid=$(container_pid); then
            echo "running: systemd-nspawn pid $(nspawn_pid), container PID 1 = host pid $pid, $(inside systemctl is-system-running || true)"
        else
            echo "not running"
            exit 1
        fi
        ;;
    *)
        sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
