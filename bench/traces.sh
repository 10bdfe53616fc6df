#!/usr/bin/env bash
# What tracing costs ([tracing]; docs/operations.md, "Traces"): the default model and plan,
# POST /embed of the 17-token sentence at 1 and 16 connections (inferd-bench http), with
# tracing off, on with every request sampled, and on with 1% sampled, exporting over
# OTLP/HTTP to a receiver on this machine (tests/clients/otlp_receiver.py --discard: it takes
# every export and decodes none, as a collector on another host would cost these cores
# nothing; RECEIVER_DECODES=1 decodes and writes every span, as a collector on the same host
# would). ROUNDS rounds in turn, one sitting; prints each run, then the medians and each
# one's throughput against tracing off.
#
#   bench/traces.sh                     # ~4 minutes on 2 cores
#   ROUNDS=5 SECONDS_PER=10 bench/traces.sh
#   RECORD=1 bench/traces.sh            # (make bench) the table replaces the record in
#                                       # docs/benchmarks.md ("Traces")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-8}
RECORD=${RECORD:-0}
PORT=${PORT:-18540}
OTLP_PORT=${OTLP_PORT:-18544}
# name | [tracing] settings
CHOICES=(
    "tracing off|enabled = false"
    "tracing on, every request sampled|endpoint = \"http://127.0.0.1:$OTLP_PORT\"
sample_ratio = 1.0"
    "tracing on, 1% sampled|endpoint = \"http://127.0.0.1:$OTLP_PORT\"
sample_ratio = 0.01"
)

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-traces.XXXXXX)
sup="" receiver=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; [[ -n $receiver ]] && kill $receiver 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
.venv/bin/python tests/clients/otlp_receiver.py "$work/spans.jsonl" "$OTLP_PORT" "$((OTLP_PORT + 1))" \
    $([[ ${RECEIVER_DECODES:-0} == 1 ]] || echo --discard) >"$work/receiver.out" &
receiver=$!
for _ in $(seq 1 100); do grep -q listening "$work/receiver.out" 2>/dev/null && break; sleep 0.1; done
printf '%s\n' "$TEXT" >"$work/short.txt"

machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F); medians of $ROUNDS rounds of $SECONDS_PER s"
echo "Machine: $machine"
for round in $(seq 1 "$ROUNDS"); do
    for choice in "${CHOICES[@]}"; do
        name=${choice%%|*}
        default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
        printf '[tracing]\n%s\n' "${choice#*|}" >>"$work/inferd.toml"
        setsid target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
        sup=$!
        wait_pool "$work/control.sock"
        for c in 1 16; do
            summary=$(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$c" \
                --seconds "$SECONDS_PER" --warmup 1 --texts "$work/short.txt" | bench_summary)
            echo "round $round | $name | c=$c | $summary" | tee -a "$work/results"
        done
        kill -- -"$sup"; wait "$sup" 2>/dev/null || true; sup=""
    done
done
if [[ ${RECEIVER_DECODES:-0} == 1 ]]; then
    received="the receiver decoded $(wc -l <"$work/spans.jsonl") spans"
else
    received="the receiver took $(head -n 1 "$work/spans.jsonl" 2>/dev/null || echo '0 exports')"
fi
echo "$received"
{
    echo "\`ROUNDS=$ROUNDS bench/traces.sh\` ($machine; $received):"
    python3 - "$work/results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    _, name, c, summary = [p.strip() for p in line.split("|")]
    runs.setdefault((name, c), []).append([float(x) for x in summary.split()])
print()
print("| run | connections | req/s (median) | p50 / p99 (ms) | req/s against tracing off |")
print("|---|---|---|---|---|")
for (name, c), rows in runs.items():
    rps = statistics.median(r[0] for r in rows)
    off = statistics.median(r[0] for r in runs[("tracing off", c)])
    p50, p99 = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
    print(f"| {name} | {c[2:]} | {rps:.0f} | {p50:.2f} / {p99:.2f} | {rps / off:.3f} |")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 && ${RECEIVER_DECODES:-0} == 0 ]]; then
    record_block traces "$work/record.md"
fi
