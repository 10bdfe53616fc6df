#!/usr/bin/env bash
# What the lookup tables hold of a worker's memory (docs/configuration.md, "Shared weights"):
# the default pool after the record's load, served by this build and by BASELINE (another build
# of inferd, kept inside the repository: it finds ONNX Runtime beside it), in fp32 and int8,
# ROUNDS rounds in turn. Before each start the artefacts' data files leave the page cache
# (POSIX_FADV_DONTNEED, while no process maps them), so that each build finds them as after a
# boot and the check it reads them through, not as the other build left them. Each round: 1,
# 4, 16 and 32 clients with the 17-token sentence, then an open loop at half the best
# throughput (inferd-bench, SECONDS_PER each); then the pool's PSS right after and 2 s later,
# and the Rss of each worker's mappings of the artefact's data file (weights and tables; every
# session maps it, so a page counts once per session that has it mapped). Prints every round
# and the medians (MiB).
#
#   BASELINE=target/inferd-b904089 bench/lookup_tables.sh     # ~4 minutes on 2 cores
#   ROUNDS=3 SECONDS_PER=4 PRECISIONS=int8 BASELINE=... bench/lookup_tables.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-2}
SECONDS_PER=${SECONDS_PER:-3}
PORT=${PORT:-18530}
PRECISIONS=${PRECISIONS:-"int8 fp32"}
BASELINE=${BASELINE:?"set BASELINE to another build of inferd inside the repository"}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-tables.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "$TEXT" >"$work/short.txt"
default_pool_config "$work/inferd.toml" "$PORT" "$work/cache"
load() { # $1 concurrency, [$2 --rate R]: the requests/s inferd-bench measured
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$1" --seconds "$SECONDS_PER" \
        --warmup 1 --texts "$work/short.txt" ${2:-} | bench_summary | cut -d' ' -f1
}
# The Rss (MiB) of the artefacts' data files in each process of pool $1, comma-separated.
artefact_rss() {
    for pid in $(pgrep -P "$1"); do
        awk -v cache="$work/cache" '/^[0-9a-f]+-[0-9a-f]+ / { on = index($0, cache) && $NF ~ /model\.onnx\.data$/ }
            on && /^Rss:/ { kb += $2 } END { printf "%.1f\n", kb / 1024 }' "/proc/$pid/smaps"
    done | paste -sd,
}
evict() {
    [[ -d $work/cache ]] || return 0
    find "$work/cache" -name model.onnx.data 2>/dev/null | while read -r f; do
        python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$f"
    done
}

results=$work/results
for round in $(seq 1 "$ROUNDS"); do
    for precision in $PRECISIONS; do
        for binary in target/release/inferd "$BASELINE"; do
            evict
            setsid "$binary" serve --config "$work/inferd.toml" --precision "$precision" 2>"$work/log" &
            sup=$!
            wait_http "http://127.0.0.1:$PORT/v2/health/ready" || { tail -n 20 "$work/log"; exit 1; }
            best=0
            for c in 1 4 16 32; do
                rps=$(load "$c")
                ((rps > best)) && best=$rps
            done
            load 64 "--rate $((best / 2))" >/dev/null
            after=$(pss_mib "$sup")
            tables=$(artefact_rss "$sup")
            sleep 2
            idle=$(pss_mib "$sup")
            kill -- -"$sup"; wait "$sup" 2>/dev/null || true; sup=""
            printf '%s|%s|%s|%s|%s|%s|%s\n' "$precision" "$binary" "$round" "$best" "$after" "$idle" "$tables" |
                tee -a "$results"
        done
    done
done

echo
echo "| precision | build | best req/s | PSS after the load, MiB | 2 s later | Rss of the artefact's mappings, per worker (each round), MiB |"
echo "|---|---|---:|---:|---:|---|"
python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    precision, binary, _, best, after, idle, tables = line.rstrip("\n").split("|")
    rows.setdefault((precision, binary), []).append((int(best), int(after), int(idle), tables))
for (precision, binary), rs in rows.items():
    med = lambda i: statistics.median(r[i] for r in rs)
    print(f"| {precision} | {binary} | {med(0):.0f} | {med(1):.0f} | {med(2):.0f} | {' / '.join(r[3] for r in rs)} |")
PY
