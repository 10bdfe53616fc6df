#!/usr/bin/env bash
# Cohere's embed with compact codes against floats (docs/protocol.md, "Cohere embed"): the
# default model and plan, POST /v2/embed of PER_REQUEST texts a request (a bulk indexing job's
# shape) by CONCURRENCY clients, answering each embedding type in turn (float, int8, ubinary),
# ROUNDS rounds, one sitting; prints req/s, texts/s, p50/p99 and the answer's bytes, then the
# medians and each type's throughput against float's.
#
#   bench/codes.sh                     # ~3 minutes on 2 cores
#   RECORD=1 bench/codes.sh            # (make bench) the table replaces the record in
#                                      # docs/benchmarks.md ("Compact codes")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-15}
CONCURRENCY=${CONCURRENCY:-4}
PER_REQUEST=${PER_REQUEST:-16}
RECORD=${RECORD:-0}
PORT=${PORT:-18570}
TYPES=(float int8 ubinary)

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-codes.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT

# 500 distinct sentences of 8-20 words, so that a request's texts differ.
.venv/bin/python - "$work/texts.txt" <<'PY'
import random, sys
rng = random.Random(20261206)
words = ("model serve worker core request batch token embed query passage search index vector "
         "latency memory cache answer retrieval document collection harbour tide lamp keeper "
         "archive river morning evening market street garden letter winter summer").split()
with open(sys.argv[1], "w") as f:
    for _ in range(500):
        f.write(" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))).capitalize() + ".\n")
PY
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
setsid target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
sup=$!
wait_pool "$work/control.sock"
placeholders=$(python3 -c "print(', '.join(['\"{text}\"'] * $PER_REQUEST))")
for round in $(seq 1 "$ROUNDS"); do
    for type in "${TYPES[@]}"; do
        body="{\"model\": \"minilm\", \"texts\": [$placeholders], \"embedding_types\": [\"$type\"]}"
        bytes=$(curl -s "127.0.0.1:$PORT/v2/embed" -d "$(sed "s/\"{text}\"/\"a short text\"/g" <<<"$body")" | wc -c)
        summary=$(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --path /v2/embed --body "$body" \
            --concurrency "$CONCURRENCY" --seconds "$SECONDS_PER" --warmup 2 --texts "$work/texts.txt" \
            | python3 -c 'import json,sys; d=json.loads(sys.stdin.readlines()[-1]); print("%.2f %.2f %.2f" % (d["throughput"], d["p50_ms"], d["p99_ms"]))')
        echo "round $round | $type | $summary | $bytes" | tee -a "$work/results"
    done
done
{
    echo "\`bench/codes.sh\` ($machine; medians of $ROUNDS rounds of $SECONDS_PER s; $CONCURRENCY clients;"
    echo "POST /v2/embed of $PER_REQUEST texts of 8-20 words a request, one embedding type each, in turn):"
    .venv/bin/python - "$work/results" "$PER_REQUEST" <<'PY'
import statistics, sys
results, per = sys.argv[1], int(sys.argv[2])
runs = {}
for line in open(results):
    _, name, summary, size = [p.strip() for p in line.split("|")]
    runs.setdefault(name, []).append([float(x) for x in summary.split()] + [float(size)])
print()
print("| embedding_types | req/s | texts/s | p50 / p99 (ms) | answer bytes (16 texts) | req/s against float |")
print("|---|---|---|---|---|---|")
base = statistics.median(r[0] for r in runs["float"])
for name, rows in runs.items():
    med = lambda k: statistics.median(r[k] for r in rows)
    print(f"| `{name}` | {med(0):.2f} | {med(0) * per:.0f} | {med(1):.1f} / {med(2):.1f} | {med(3):.0f} | {med(0) / base:.3f} |")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 ]]; then
    record_block codes "$work/record.md"
fi
