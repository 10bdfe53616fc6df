#!/usr/bin/env bash
# What shared weights save (docs/configuration.md, "Shared weights"): a BERT-base-shaped model
# (scripts/gen_bert_base.py, ~440 MB of random fp32 weights, generated into .cache/ when
# missing) served by K = 1, 2 and 4 workers of one thread, with runtime.cache_dir set (every
# session maps the one prepared copy) and empty (each session its own). For each: the memory
# of the whole pool after a short load, as the sum of PSS over its processes and as the
# kernel's own accounting (the memory cgroup the pool runs in, page cache included; needs
# root and cgroup v1), and the latency of one request at a time (median of 5 s at c=1).
# Prints a table; one sitting, one pool at a time.
#
#   bench/weights.sh                  # ~3 minutes on 2 cores
#   MODEL=models/minilm bench/weights.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
MODEL=${MODEL:-.cache/models/bertbase}
PORT=${PORT:-18400}
WORKERS=${WORKERS:-1 2 4}
SECONDS_PER=${SECONDS_PER:-5}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
if [[ ! -f $MODEL/model.onnx ]]; then
    [[ $MODEL == .cache/models/bertbase ]] || { echo "no $MODEL/model.onnx" >&2; exit 1; }
    .venv/bin/python scripts/gen_bert_base.py "$MODEL"
fi
name=$(sed -n 's/^name = "\(.*\)"/\1/p' "$MODEL/model.toml")
model_mb=$(( $(stat -c %s "$MODEL/model.onnx") / 1000000 ))
work=$(mktemp -d /tmp/inferd-weights.XXXXXX)
trap 'pkill -f "inferd serve --config $work" 2>/dev/null || true; rmdir /sys/fs/cgroup/memory/inferd-weights-bench 2>/dev/null || true; rm -rf "$work"' EXIT
mkdir -p "$work/repo" && ln -s "$(realpath "$MODEL")" "$work/repo/$name"
echo "A text that is about as long as a typical sentence in a search query or a chat message." >"$work/texts.txt"

cgroup=/sys/fs/cgroup/memory/inferd-weights-bench
use_cgroup=0
if [[ -w /sys/fs/cgroup/memory ]] && mkdir -p "$cgroup" 2>/dev/null; then use_cgroup=1; fi

printf '%-8s %-8s %14s %16s %14s\n' workers weights "PSS all (MiB)" "cgroup (MiB)" "p50 c=1 (ms)"
for k in $WORKERS; do
    for mode in private shared; do
        cache='""'; [[ $mode == shared ]] && cache="\"$work/cache\""
        cat >"$work/inferd.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
workers = $k
threads = 1
allow_oversubscription = true
control_socket = "control.sock"
[admin]
listen = ""
[models]
repository = "$work/repo"
default = "$name"
[runtime]
cache_dir = $cache
EOF
        if [[ $use_cgroup == 1 ]]; then
            sync && echo 1 >/proc/sys/vm/drop_caches  # the model's page cache is charged to the pool anew
            sh -c "echo \$\$ >$cgroup/cgroup.procs; exec target/release/inferd serve --config $work/inferd.toml" 2>"$work/log" &
        else
            target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
        fi
        sup=$!
        wait_pool "$work/control.sock"
        line=$(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --texts "$work/texts.txt" \
            --concurrency 1 --seconds "$SECONDS_PER" --warmup 1 | tail -n 1)
        p50=$(python3 -c 'import json,sys; print("%.1f" % json.loads(sys.argv[1])["p50_ms"])' "$line")
        pss=$(pss_mib "$sup")
        cg=-; [[ $use_cgroup == 1 ]] && cg=$(( $(cat $cgroup/memory.usage_in_bytes) / 1048576 ))
        printf '%-8s %-8s %14s %16s %14s\n' "$k" "$mode" "$pss" "$cg" "$p50"
        kill -TERM "$sup"; wait "$sup" 2>/dev/null || true
        rm -rf "$work/cache"
    done
done
echo "model: $MODEL ($model_mb MB file); $(nproc) cores; workers beyond the cores share them (allow_oversubscription)"
