#!/usr/bin/env bash
# A model over 2 GB with its weights in external data (scripts/gen_large_model.py: 8 MatMuls
# of 8192 x 8192, 2.15 GB in model.onnx_data, generated into .cache/models/large when
# missing) served by 2 workers of one thread, first with each session holding its own
# weights (runtime.cache_dir = ""), then with shared weights (every session maps one prepared
# copy). For each: the time to a ready pool, whether one v2 request answers what numpy
# computes, the pool's memory (sum of PSS; the memory cgroup's own count where it can make
# one, page cache included) and, shared, how much of the prepared data file each worker maps.
#
#   bench/large_model.sh        # ~3 minutes on 2 cores, ~7 GB of memory at its peak
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
MODEL=.cache/models/large
PORT=${PORT:-18450}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd 2>&1 | tail -n 1
[[ -f $MODEL/model.onnx_data ]] || .venv/bin/python scripts/gen_large_model.py "$MODEL"
work=$(mktemp -d /tmp/inferd-large.XXXXXX)
cgroup=/sys/fs/cgroup/memory/inferd-large-bench
trap 'pkill -f "inferd serve --config $work" 2>/dev/null || true; rmdir $cgroup 2>/dev/null || true; rm -rf "$work"' EXIT
mkdir -p "$work/repo" && ln -s "$(realpath "$MODEL")" "$work/repo/large"
use_cgroup=0
if [[ -w /sys/fs/cgroup/memory ]] && mkdir -p "$cgroup" 2>/dev/null; then use_cgroup=1; fi

# The request and the check of its answer against numpy's.
.venv/bin/python - "$MODEL/expected.json" "$work/request.json" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
json.dump({"inputs": [{"name": "x", "shape": [1, len(e["x"])], "datatype": "FP32", "data": e["x"]}]}, open(sys.argv[2], "w"))
PY
check() {
    .venv/bin/python - "$MODEL/expected.json" "$1" <<'PY'
import json, sys
import numpy as np
want = np.array(json.load(open(sys.argv[1]))["y"])
got = np.array(json.load(open(sys.argv[2]))["outputs"][0]["data"])
print(f"{np.abs(got - want).max() / np.abs(want).max():.1e}")
PY
}

printf '%-8s %10s %20s %14s %14s %s\n' weights "ready (s)" "max rel. error" "PSS (MiB)" "cgroup (MiB)" "prepared data mapped per worker (MiB, Rss/Pss)"
for mode in private shared; do
    cache='""'; [[ $mode == shared ]] && cache="\"$work/cache\""
    cat >"$work/inferd.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
workers = 2
threads = 1
control_socket = "control.sock"
boot_timeout_secs = 600
[admin]
listen = ""
[models]
repository = "$work/repo"
default = "large"
[runtime]
cache_dir = $cache
EOF
    started=$(date +%s.%N)
    if [[ $use_cgroup == 1 ]]; then
        sync && echo 1 >/proc/sys/vm/drop_caches
        sh -c "echo \$\$ >$cgroup/cgroup.procs; exec target/release/inferd serve --config $work/inferd.toml" 2>"$work/log" &
    else
        target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
    fi
    sup=$!
    for _ in $(seq 1 3000); do
        target/release/inferd status --control-socket "$work/control.sock" 2>/dev/null | head -1 | grep -q ' ready on ' && break
        kill -0 "$sup" 2>/dev/null || { cat "$work/log" >&2; exit 1; }
        sleep 0.2
    done
    ready=$(python3 -c "import sys; print('%.1f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$started" "$(date +%s.%N)")
    curl -sf -H 'content-type: application/json' --data-binary @"$work/request.json" \
        "http://127.0.0.1:$PORT/v2/models/large/infer" >"$work/answer.json"
    err=$(check "$work/answer.json")
    pss=$(pss_mib "$sup")
    cg=-; [[ $use_cgroup == 1 ]] && cg=$(( $(cat $cgroup/memory.usage_in_bytes) / 1048576 ))
    mapped=-
    if [[ $mode == shared ]]; then
        mapped=$(for pid in $(pgrep -P "$sup"); do
            awk '/^[0-9a-f]+-[0-9a-f]+ / { on = ($6 ~ /model\.onnx\.data$/) } on && /^Rss:/ { r += $2 } on && /^Pss:/ { p += $2 }
                 END { printf "%d/%d ", r / 1024, p / 1024 }' "/proc/$pid/smaps"
        done)
    fi
    printf '%-8s %10s %20s %14s %14s %s\n' "$mode" "$ready" "$err" "$pss" "$cg" "$mapped"
    kill -TERM "$sup"; wait "$sup" 2>/dev/null || true
done
du -b "$work/cache"/*/model.onnx.data 2>/dev/null | awk '{ printf "prepared data file: %.2f GB\n", $1 / 1e9 }' || true
echo "model: $(du -b "$MODEL/model.onnx_data" | awk '{ printf "%.2f GB", $1 / 1e9 }') of external data; $(nproc) cores"
