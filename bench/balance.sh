#!/usr/bin/env bash
# Connection balance on and off (server.balance_connections; docs/tuning.md, "Connection
# balance"), the default plan and model, in one sitting: the two alternate, ROUNDS times. For
# each, at 16 and 32 keep-alive connections (`inferd-bench http`, the 17-token sentence, 6 s):
# throughput, p99, p99 over Little's-law mean (connections / throughput), how the port's
# connections sat on the workers halfway through (`ss`), and how many the workers accepted in
# all (the reconnections the balance costs).
#
#   bench/balance.sh                 # ~3 minutes on 2 cores
#   ROUNDS=5 PRECISION=fp32 bench/balance.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
PORT=${PORT:-18510}
ROUNDS=${ROUNDS:-3}
PRECISION=${PRECISION:-int8}

cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-balance.XXXXXX)
trap 'pkill -f "inferd serve --config $work/" 2>/dev/null || true; rm -rf "$work"' EXIT
echo "$TEXT" >"$work/text.txt"

# Passive opens: connections accepted by anyone on this host (loopback: the pool's).
accepted() { awk '/^Tcp:/ { if (++n == 2) print $7 }' /proc/net/snmp; }

measure() { # on|off
    local config=$work/$1.toml
    default_pool_config "$config" "$PORT" "$PWD/.cache/inferd"
    sed -i "s/^\[server\]/[server]\nbalance_connections = $([[ $1 == on ]] && echo true || echo false)/" "$config"
    (cd "$work" && exec "$OLDPWD/target/release/inferd" serve --config "$config" --precision "$PRECISION" >"$work/log" 2>&1) &
    local pid=$!
    wait_http "http://127.0.0.1:$PORT/health" && wait_pool "$work/control.sock"
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 4 --seconds 2 --texts "$work/text.txt" >/dev/null
    for c in 16 32; do
        local before spread line
        before=$(accepted)
        (sleep 3; ss -tnpH state established "( sport = :$PORT )" | grep -o 'pid=[0-9]*' | sort | uniq -c |
            awk '{ print $1 }' | paste -sd/ >"$work/spread") &
        local sampler=$!
        line=$(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$c" --seconds 6 \
            --texts "$work/text.txt" 2>/dev/null | grep '^{')
        wait "$sampler"
        echo "$line" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read()); c, mode, spread, accepted = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
rate, p99, errors = r["throughput"], r["p99_ms"], r["errors"]
mean = 1000 * c / rate
print(f"{mode:4} c={c:<3} {rate:7.0f} req/s  p99 {p99:6.1f} ms  mean {mean:5.1f} ms  p99/mean {p99 / mean:4.2f}  "
      f"connections per worker {spread:7}  accepted {accepted}  errors {errors}")
' "$c" "$1" "$(cat "$work/spread")" "$(($(accepted) - before))"
    done
    kill -TERM "$pid" && wait "$pid" || true
}

for _ in $(seq 1 "$ROUNDS"); do
    measure on
    measure off
done
