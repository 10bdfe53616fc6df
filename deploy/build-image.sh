#!/usr/bin/env bash
# Builds inferd's runtime image from deploy/Containerfile with buildah (docs/kubernetes.md).
#
#   deploy/build-image.sh [--offline] [--check] [TAG]       TAG default inferd:<crate version>
#
# Needs `make setup` (ONNX Runtime, the default model) and a release build (make build, or
# INFERD_BIN=path). Runs as root; installs buildah (and with --offline debootstrap, with
# --check runc) with apt-get when missing.
#   --offline  no image registry: the base is Debian bookworm minbase made by debootstrap from
#              Debian's package mirror (once; cached in .cache/image-base and as the local image
#              localhost/inferd-base:bookworm), instead of docker.io/library/debian:bookworm-slim.
#   --check    then runs `inferd check` in a container of the image, as its own user, with the
#              image's configuration (tests/deploy.rs does this).
# Exit 77: this host cannot build images (not root), which tests/deploy.rs reports as a skip.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=$REPO/.cache/image-base
BASE_IMAGE=localhost/inferd-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BIN=${INFERD_BIN:-$REPO/target/release/inferd}

log() { echo "build-image: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

offline=0 check=0 tag=
for arg in "$@"; do
    case $arg in
    --offline) offline=1 ;;
    --check) check=1 ;;
    -*) die "unknown option $arg" ;;
    *) tag=$arg ;;
    esac
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/Cargo.toml" | head -n1)
tag=${tag:-inferd:$version}

[ "$(id -u)" = 0 ] || { log "cannot build here: buildah needs root on this host (rootless needs user namespaces)"; exit 77; }

need=()
command -v buildah >/dev/null || need+=(buildah)
[ $offline = 0 ] || command -v debootstrap >/dev/null || need+=(debootstrap)
# runc, not crun: crun refuses hosts with cgroup v1 and v2 controllers mounted side by side.
[ $check = 0 ] || command -v runc >/dev/null || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } \
        || die "apt-get could not install ${need[*]}"
fi

[ -x "$BIN" ] || die "no inferd binary at $BIN: run make build (or set INFERD_BIN)"
ls "$REPO"/vendor/onnxruntime/lib/libonnxruntime.so.* >/dev/null 2>&1 || die "no ONNX Runtime in vendor/onnxruntime/lib: run make setup"
[ -f "$REPO/models/minilm/model.onnx" ] || die "no default model in models/minilm: run make setup"

base_args=()
if [ $offline = 1 ]; then
    if ! buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
        if [ ! -e "$CACHE/.inferd-base" ]; then
            log "building Debian bookworm minbase in $CACHE (once; about a minute)"
            rm -rf "$CACHE.partial" && mkdir -p "$(dirname "$CACHE")"
            debootstrap --variant=minbase bookworm "$CACHE.partial" "$MIRROR" >"$CACHE.log" 2>&1 \
                || { tail -20 "$CACHE.log" >&2; die "debootstrap failed (log: $CACHE.log)"; }
            # What a runtime image does not need: apt's downloads and lists, docs, man pages.
            rm -rf "$CACHE.partial"/var/cache/apt/archives/*.deb "$CACHE.partial"/var/lib/apt/lists/* \
                "$CACHE.partial"/usr/share/doc/* "$CACHE.partial"/usr/share/man/*
            rm -rf "$CACHE" && mv "$CACHE.partial" "$CACHE"
            echo "debian bookworm minbase, $(date -u +%FT%TZ)" >"$CACHE/.inferd-base"
        fi
        log "importing $CACHE as $BASE_IMAGE"
        container=$(buildah from scratch)
        trap 'buildah rm "$container" >/dev/null 2>&1 || true' EXIT
        mount=$(buildah mount "$container")
        tar -C "$CACHE" --exclude=./.inferd-base -cf - . | tar -C "$mount" -xf -
        buildah umount "$container" >/dev/null
        buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
        buildah commit --quiet "$container" "$BASE_IMAGE" >/dev/null
        buildah rm "$container" >/dev/null && trap - EXIT
    fi
    base_args=(--build-arg "BASE=$BASE_IMAGE")
fi

# The binary may live outside the build context (INFERD_BIN): copy it in under target/.
rel=${BIN#"$REPO"/}
if [ "$rel" = "$BIN" ]; then
    mkdir -p "$REPO/target/image" && cp "$BIN" "$REPO/target/image/inferd" && rel=target/image/inferd
fi
log "building $tag"
buildah bud --quiet --layers=false "${base_args[@]}" --build-arg "INFERD_BIN=$rel" \
    -f "$REPO/deploy/Containerfile" -t "$tag" "$REPO" >/dev/null
log "built $tag ($(buildah inspect --type image --format '{{.FromImageID}}' "$tag" | cut -c1-12))"

if [ $check = 1 ]; then
    # As the image's own user, with its own configuration and model; no network needed.
    container=$(buildah from "$tag")
    trap 'buildah rm "$container" >/dev/null 2>&1 || true' EXIT
    buildah run --runtime "$(command -v runc)" --network none "$container" -- \
        /usr/bin/inferd check --config /etc/inferd/inferd.toml
    buildah run --runtime "$(command -v runc)" --network none "$container" -- id -u
fi
