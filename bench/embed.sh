#!/usr/bin/env bash
# /embed on the default model (all-MiniLM-L6-v2 int8): latency at concurrency 1 and throughput
# at concurrency 8 through inferd, against the raw ONNX Runtime loop (same tokenizer, model
# and pooling code, no server) in the same run. Prints every round, then medians and ratios.
#
#   bench/embed.sh                 # 3 rounds of 10 s each
#   ROUNDS=5 SECONDS_PER=20 bench/embed.sh
#
# The load generator runs on the same machine and takes CPU from the workers: on a small
# machine the HTTP figures are a lower bound.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-10}
TEXTS=bench/texts.txt

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
BENCH=target/release/inferd-bench
INFERD=target/release/inferd
LIB=$(ls vendor/onnxruntime/lib/libonnxruntime.so.* | head -n 1)
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
results=$work/results.jsonl

$INFERD serve --listen 127.0.0.1:$port --admin-listen "" --control-socket $work/ctl.sock 2>$work/inferd.log &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 300); do
    if $INFERD status --json --control-socket $work/ctl.sock 2>/dev/null | grep -q '"phase": "ready"'; then break; fi
    sleep 0.2
done
workers=$($INFERD status --json --control-socket $work/ctl.sock | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["workers"]))')
echo "inferd: $workers workers on 127.0.0.1:$port; $ROUNDS rounds of ${SECONDS_PER}s each"

for round in $(seq 1 "$ROUNDS"); do
    for c in 1 8; do
        $BENCH http --addr 127.0.0.1:$port --path /embed --concurrency $c --seconds "$SECONDS_PER" --texts $TEXTS | tee -a /dev/stderr | tail -n 1 >>"$results"
    done
done 2> >(grep -v '^{' >&2)
kill $server; wait $server 2>/dev/null || true

for round in $(seq 1 "$ROUNDS"); do
    for p in 1 "$workers"; do
        $BENCH ort --model models/minilm --ort-library "$LIB" --parallel $p --seconds "$SECONDS_PER" --texts $TEXTS | tee -a /dev/stderr | tail -n 1 >>"$results"
    done
done 2> >(grep -v '^{' >&2)

python3 - "$results" "$workers" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
workers = sys.argv[2]
def med(label, key):
    vals = [r[key] for r in rows if r["label"] == label and r[key] is not None]
    return statistics.median(vals) if vals else float("nan")
h1, h8 = "http /embed c=1", "http /embed c=8"
o1, ok = "ort tokenize+run+pool parallel=1", f"ort tokenize+run+pool parallel={workers}"
print()
print(f"medians over {len([r for r in rows if r['label'] == h1])} rounds")
print(f"{'':44} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
for label in (h1, o1, h8, ok):
    print(f"{label:44} {med(label,'throughput'):8.1f} {med(label,'p50_ms'):8.2f} {med(label,'p95_ms'):8.2f} {med(label,'p99_ms'):8.2f}")
print(f"latency c=1: inferd p50 / raw ORT p50 = {med(h1,'p50_ms') / med(o1,'p50_ms'):.2f}x")
print(f"throughput: inferd c=8 / raw ORT x{workers} = {med(h8,'throughput') / med(ok,'throughput'):.2f}")
print(f"tokenising: {100 * med(h1,'prepare_share'):.1f}% of a request at c=1, {100 * med(h8,'prepare_share'):.1f}% at c=8")
PY
