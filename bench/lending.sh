#!/usr/bin/env bash
# Two workers that lend each other idle cores against one worker of two threads (docs/tuning.md,
# "Lent cores"), on the default model, in one sitting: the two plans alternate, ROUNDS times
# per precision. For each: a lone client's p50 (c=1) and the throughput at c=4 and c=32 (5 s
# each, `inferd-bench http`, the 17-token sentence), the pool's PSS after them, and how many
# runs borrowed a core or waited for one; then 8 clients for 6 s while worker 0 is SIGKILLed
# after 2: what was answered and what failed while the slot was being replaced. Meant for a
# 2-core host, where the first plan is the default.
#
#   bench/lending.sh                       # ~5 minutes on 2 cores
#   ROUNDS=3 PRECISIONS="int8" bench/lending.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
PORT=${PORT:-18500}
ADMIN=${ADMIN:-18501}
ROUNDS=${ROUNDS:-2}
PRECISIONS=${PRECISIONS:-int8 fp32}

cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-lending.XXXXXX)
trap 'pkill -f "inferd serve --config inferd.toml --listen 127.0.0.1:$PORT" 2>/dev/null || true; rm -rf "$work"' EXIT
echo "$TEXT" >"$work/text.txt"

load() { # CONCURRENCY SECONDS: one line of inferd-bench's summary
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$1" --seconds "$2" --warmup 1 \
        --texts "$work/text.txt" 2>&1 | grep -v '^{' | tail -n 1
}

measure() { # PRECISION LABEL ARGS...
    local precision=$1 label=$2; shift 2
    target/release/inferd serve --config inferd.toml --listen "127.0.0.1:$PORT" --admin-listen "127.0.0.1:$ADMIN" \
        --control-socket "$work/control.sock" --precision "$precision" "$@" >"$work/log" 2>&1 &
    local pid=$!
    wait_http "http://127.0.0.1:$PORT/health" && wait_pool "$work/control.sock"
    sleep 1
    local c1 c4 c32 lending pss
    c1=$(load 1 5 | sed -n 's/.*: \([0-9.]*\) seq\/s, p50 \([0-9.]*\) ms.*/\2 ms (\1 req\/s)/p')
    c4=$(load 4 5 | sed -n 's/.*: \([0-9.]*\) seq\/s.*/\1/p')
    c32=$(load 32 5 | sed -n 's/.*: \([0-9.]*\) seq\/s.*/\1/p')
    pss=$(pool_pss "$pid" | cut -d' ' -f1-2)
    lending=$(curl -s "http://127.0.0.1:$ADMIN/metrics" | sed -n 's/^inferd_core_lending_total{event="\(.*\)"} \(.*\)/\1 \2/p' | paste -sd' ')
    printf '%-5s %-26s %-22s %8s %8s %9s  %s\n' "$precision" "$label" "$c1" "$c4" "$c32" "$pss" "${lending:--}"
    # The crash: 8 clients, worker 0 killed after 2 s of 6.
    (sleep 3; kill -KILL "$(target/release/inferd status --control-socket "$work/control.sock" --json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["workers"][0]["pid"])')") &
    local killer=$! crash
    crash=$(load 8 6 | sed -n 's/.*: \([0-9.]*\) seq\/s.*, \([0-9]*\) requests, \([0-9]*\) errors.*/\2 answered, \3 failed/p')
    wait "$killer"
    printf '%-5s %-26s SIGKILL of worker 0 under c=8: %s\n' "$precision" "$label" "$crash"
    kill -TERM "$pid" && wait "$pid" || true
}

printf '%-5s %-26s %-22s %8s %8s %9s  %s\n' prec plan "c=1 p50 (req/s)" "c=4" "c=32" "PSS" "core lending"
for precision in $PRECISIONS; do
    for _ in $(seq 1 "$ROUNDS"); do
        measure "$precision" "1 worker x 2 threads" --workers 1 --threads 2
        measure "$precision" "2 workers x 1, lending" --workers 2 --threads 1
    done
done
