#!/usr/bin/env bash
# A bulk request (64 texts of ~250 tokens in one POST /embed, ~16,000 tokens) against the
# default pool, with and without its background lane (server.background_lane), in one
# sitting; with BASELINE=path/to/another/inferd, that binary's pool too, alternating, ROUNDS
# times (docs/tuning.md, "Bulk requests"). For each pool:
# - alone: the bulk request's time, the median of 3;
# - beside it: 20 short requests (the 17-token sentence) sent one by one, each on a new
#   connection (so they land on every worker), while a bulk request runs alone: their median
#   and largest latency;
# - under load: the bulk request's time while 16 keep-alive connections send short requests
#   (`inferd-bench http`, LOAD_SECONDS), and those short requests' p99 and slowest.
#
#   bench/bulk.sh                               # ~3 minutes a round on 2 cores
#   BASELINE=target/inferd-before ROUNDS=3 bench/bulk.sh   # a binary in the repository,
#                                                         # where it finds ONNX Runtime
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
PORT=${PORT:-18530}
ROUNDS=${ROUNDS:-2}
PRECISION=${PRECISION:-fp32}
LOAD_SECONDS=${LOAD_SECONDS:-30}
BASELINE=${BASELINE:+$(realpath "$BASELINE")}

cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-bulk.XXXXXX)
trap 'pkill -f "serve --config $work/" 2>/dev/null || true; rm -rf "$work"' EXIT
echo "$TEXT" >"$work/short.txt"

# The client: `alone`, `beside` or `under` (the last reads the load's summary on stdin).
cat >"$work/bulk.py" <<'PY'
import http.client, json, statistics, sys, threading, time
port, what, short = int(sys.argv[1]), sys.argv[2], sys.argv[3]
bulk = json.dumps({"inputs": [f"text {i} " + "model " * 248 for i in range(64)]})

def post(body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/embed", body, {"content-type": "application/json"})
    response = connection.getresponse()
    response.read()
    assert response.status == 200, response.status
    return time.perf_counter() - started

if what == "alone":
    print(f"alone {statistics.median(post(bulk) for _ in range(3)):.2f} s")
elif what == "beside":
    runner = threading.Thread(target=post, args=(bulk,))
    runner.start()
    time.sleep(0.3)  # under way
    latencies = [post(json.dumps({"inputs": short})) * 1e3 for _ in range(20)]
    runner.join()
    print(f"beside: short median {statistics.median(latencies):.0f} ms, max {max(latencies):.0f} ms")
else:
    time.sleep(2)  # the load is under way (1 s warm-up)
    took = post(bulk)
    load = json.loads(sys.stdin.read())
    # Past the load's end it finished alone: the figure is then a lower bound.
    outlasted = " (outlasted the load: at least)" if took > float(sys.argv[4]) - 2 else ""
    print(f"under load {took:.2f} s{outlasted} (short p99 {load['p99_ms']:.1f} ms, max {load['max_ms']:.0f} ms, {load['throughput']:.0f} req/s, errors {load['errors']})")
PY

measure() { # BINARY NAME lane|no-lane
    local config=$work/$2-$3.toml
    default_pool_config "$config" "$PORT" "$PWD/.cache/inferd"
    if [ "$3" = no-lane ]; then sed -i 's/^\[server\]/[server]\nbackground_lane = false/' "$config"; fi
    (cd "$work" && exec "$1" serve --config "$config" --precision "$PRECISION" >"$work/log" 2>&1) &
    local pid=$!
    wait_http "http://127.0.0.1:$PORT/health"
    wait_pool "$work/control.sock"
    local line
    line="$2 $3: $(python3 "$work/bulk.py" "$PORT" alone "$TEXT")"
    line+="; $(python3 "$work/bulk.py" "$PORT" beside "$TEXT")"
    line+="; $(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 16 --seconds "$LOAD_SECONDS" \
        --warmup 1 --texts "$work/short.txt" 2>/dev/null | grep '^{' | tail -n 1 |
        python3 "$work/bulk.py" "$PORT" under "$TEXT" "$LOAD_SECONDS")"
    echo "$line"
    kill -TERM "$pid" && wait "$pid" || true
}

for _ in $(seq 1 "$ROUNDS"); do
    for lane in lane no-lane; do
        measure "$PWD/target/release/inferd" this "$lane"
        if [ -n "$BASELINE" ]; then measure "$BASELINE" baseline "$lane"; fi
    done
done
