#!/usr/bin/env bash
# Short requests beside long ones (docs/tuning.md, "The background lane"), in one sitting:
# the default pool with its background lane, the same pool without it
# (server.background_lane = false), and one worker of two threads (workers = 1, threads = 2,
# the default plan before two workers), alternating ROUNDS times. For each, 16 keep-alive
# connections (`inferd-bench http`, 6 s): the 17-token sentence alone, then a stream where
# every 8th request is a 256-token text (the record's mix, bench/lib.sh), then 256-token texts
# alone; the short texts' p99 in the mix over their p99 alone (the record's token-budget
# target: at most 2), the long texts' p50 and p99 in the mix, the throughput of each stream,
# and the pool's PSS after all three.
#
#   bench/token_budget.sh                  # ~6 minutes on 2 cores
#   ROUNDS=5 PRECISION=int8 bench/token_budget.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
PORT=${PORT:-18520}
ROUNDS=${ROUNDS:-3}
PRECISION=${PRECISION:-fp32}
SECONDS_PER=${SECONDS_PER:-6}

cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-token-budget.XXXXXX)
trap 'pkill -f "inferd serve --config $work/" 2>/dev/null || true; rm -rf "$work"' EXIT
echo "$TEXT" >"$work/short.txt"
mixed_texts "$work/mixed.txt"
tail -n 1 "$work/mixed.txt" >"$work/long.txt"
# One line per server: $1 mode, $2 the short stream's summary, $3 the mix's (all, long,
# short, joined by |), $4 the long stream's, $5 PSS.
cat >"$work/summary.py" <<'PY'
import json, sys
mode, alone, lines, longs, pss = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
everything, long, short = [json.loads(l) for l in lines.split("|")]
a, s = alone["p99_ms"], short["p99_ms"]
errors = alone["errors"] + everything["errors"] + longs["errors"]
print(f"{mode:8} short p99 alone {a:6.1f} ms, in the mix {s:6.1f} ms (x{s / a:.2f}); "
      f"long in the mix p50 {long['p50_ms']:6.1f} p99 {long['p99_ms']:6.1f} ms; req/s short {alone['throughput']:4.0f}, "
      f"mix {everything['throughput']:4.0f}, long {longs['throughput']:5.1f}; errors {errors}; PSS {pss}")
PY

# The JSON lines of one load: $1 texts file.
load() {
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 16 --seconds "$SECONDS_PER" \
        --warmup 1 --short-below 200 --texts "$1" 2>/dev/null | grep '^{'
}

measure() { # lane|no-lane|1x2
    local config=$work/$1.toml
    default_pool_config "$config" "$PORT" "$PWD/.cache/inferd"
    case $1 in
    no-lane) sed -i 's/^\[server\]/[server]\nbackground_lane = false/' "$config" ;;
    1x2) sed -i 's/^\[server\]/[server]\nworkers = 1\nthreads = 2/' "$config" ;;
    esac
    (cd "$work" && exec "$OLDPWD/target/release/inferd" serve --config "$config" --precision "$PRECISION" >"$work/log" 2>&1) &
    local pid=$!
    wait_http "http://127.0.0.1:$PORT/health" && wait_pool "$work/control.sock"
    load "$work/short.txt" >/dev/null # warm-up
    local alone mixed longs
    alone=$(load "$work/short.txt" | tail -n 1)
    mixed=$(load "$work/mixed.txt" | tail -n 3 | paste -sd'|')
    longs=$(load "$work/long.txt" | head -n 1)
    python3 "$work/summary.py" "$1" "$alone" "$mixed" "$longs" "$(pool_pss "$pid" | cut -d' ' -f1-2)"
    kill -TERM "$pid" && wait "$pid" || true
}

for _ in $(seq 1 "$ROUNDS"); do
    measure lane
    measure no-lane
    measure 1x2
done
