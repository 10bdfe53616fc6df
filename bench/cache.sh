#!/usr/bin/env bash
# The cache of answers ([cache]; docs/configuration.md, "The cache of answers") on retrieval
# traffic: the default model and plan (2 workers here), POST /embed by CONCURRENCY clients of
# a Zipf-distributed stream (exponent ZIPF) over DISTINCT texts of mixed lengths (70% of 5-20
# words, 25% of 40-80, 5% of 150-250: queries and passages), with the cache off and on at
# BUDGET (the pool's, split between the workers). ROUNDS rounds in turn, one sitting; prints
# req/s, p50/p99, the hit ratio (inferd_cache_* on /metrics) and the pool's PSS, then the
# medians, and what one cache of the whole budget shared by the workers would have hit on the
# same stream (an LRU of the same entries, simulated): what a shared cache would gain.
#
#   bench/cache.sh                     # ~5 minutes on 2 cores
#   RECORD=1 bench/cache.sh            # (make bench) the table replaces the record in
#                                      # docs/benchmarks.md ("The cache of answers")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-15}
CONCURRENCY=${CONCURRENCY:-8}
BUDGET=${BUDGET:-4MiB}
DISTINCT=${DISTINCT:-5000}
ZIPF=${ZIPF:-1.0}
RECORD=${RECORD:-0}
PORT=${PORT:-18560}
ADMIN_PORT=${ADMIN_PORT:-18564}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-cache.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT

# The stream: 200000 draws, more than any run sends, so that no run wraps around to its start.
.venv/bin/python - "$work/stream.txt" "$DISTINCT" "$ZIPF" <<'PY'
import sys
import numpy as np
out, distinct, zipf = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(20261204)
words = ("model serve worker core request batch token embed query passage search index vector "
         "latency memory cache answer retrieval document collection popular repeat cluster node "
         "server client traffic shard replica score rank text long short window").split()
def text(i):
    kind = rng.random()
    n = rng.integers(5, 21) if kind < 0.70 else rng.integers(40, 81) if kind < 0.95 else rng.integers(150, 251)
    return f"{i} " + " ".join(rng.choice(words, n))
texts = [text(i) for i in range(distinct)]
ranks = np.arange(1, distinct + 1, dtype=np.float64)
p = ranks ** -zipf
p /= p.sum()
with open(out, "w") as f:
    for i in rng.choice(distinct, 200000, p=p):
        f.write(texts[i] + "\n")
PY

machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
echo "Machine: $machine; $ROUNDS rounds of $SECONDS_PER s, $CONCURRENCY clients, $DISTINCT texts, Zipf $ZIPF, budget $BUDGET"
metric() { curl -s "127.0.0.1:$ADMIN_PORT/metrics" | awk -v m="$1{model=\"minilm\"}" '$1 == m { print $2 }'; }
for round in $(seq 1 "$ROUNDS"); do
    for choice in off on; do
        default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
        sed -i "s/^listen = \"\"$/listen = \"127.0.0.1:$ADMIN_PORT\"/" "$work/inferd.toml"
        [[ $choice == on ]] && printf '[cache]\nmax_bytes = "%s"\n' "$BUDGET" >>"$work/inferd.toml"
        setsid target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
        sup=$!
        wait_pool "$work/control.sock"
        summary=$(target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$CONCURRENCY" \
            --seconds "$SECONDS_PER" --warmup 0 --texts "$work/stream.txt" | bench_summary)
        hits=$(metric inferd_cache_hits_total) misses=$(metric inferd_cache_misses_total)
        bytes=$(metric inferd_cache_bytes)
        echo "round $round | cache $choice | $summary | ${hits:-0} ${misses:-0} ${bytes:-0} | $(pss_mib "$sup")" \
            | tee -a "$work/results"
        kill -- -"$sup"; wait "$sup" 2>/dev/null || true; sup=""
    done
done
{
    echo "\`bench/cache.sh\` ($machine; medians of $ROUNDS rounds of $SECONDS_PER s; $CONCURRENCY clients;"
    echo "$DISTINCT texts of mixed lengths drawn by Zipf $ZIPF; cache.max_bytes = $BUDGET over 2 workers):"
    .venv/bin/python - "$work/results" "$work/stream.txt" "$BUDGET" <<'PY'
import collections, statistics, sys
results, stream, budget = sys.argv[1], sys.argv[2], sys.argv[3]
runs = {}
for line in open(results):
    _, name, summary, cache, pss = [p.strip() for p in line.split("|")]
    runs.setdefault(name, []).append([float(x) for x in summary.split() + cache.split() + [pss]])
print()
print("| run | req/s | p50 / p99 (ms) | hit ratio | cache bytes held | pool PSS (MiB) | req/s against off |")
print("|---|---|---|---|---|---|---|")
off = statistics.median(r[0] for r in runs["cache off"])
sent = 0
for name, rows in runs.items():
    med = lambda k: statistics.median(r[k] for r in rows)
    lookups = med(3) + med(4)
    ratio = f"{med(3) / lookups:.3f}" if lookups else "-"
    sent = max(sent, int(lookups))
    print(f"| {name} | {med(0):.0f} | {med(1):.2f} / {med(2):.2f} | {ratio} | {med(5) / 2**20:.1f} MiB | {med(6):.0f} | {med(0) / off:.3f} |")
# One LRU of the whole budget over the same stream (what a cache shared by the workers would
# hold): entries cost as the server counts them (96 bytes and 384 floats).
units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
size = next((float(budget[:-3]) * u for s, u in units.items() if budget.endswith(s)), None) or float(budget)
capacity = int(size // (96 + 384 * 4))
texts = [l.rstrip("\n") for _, l in zip(range(sent), open(stream))]
def lru(texts, capacity):
    held, hits = collections.OrderedDict(), 0
    for t in texts:
        if t in held:
            hits += 1
            held.move_to_end(t)
        else:
            held[t] = None
            if len(held) > capacity:
                held.popitem(last=False)
    return hits / max(len(texts), 1)
print()
print(f"Simulated on the first {sent} texts of the stream: one LRU of the whole budget ({capacity} entries, a cache "
      f"shared by the workers) hits {lru(texts, capacity):.3f}; two of half of it, each taking every other text, "
      f"{(lru(texts[0::2], capacity // 2) + lru(texts[1::2], capacity // 2)) / 2:.3f}.")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 ]]; then
    record_block cache "$work/record.md"
fi
