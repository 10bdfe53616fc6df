#!/usr/bin/env bash
# Where a worker's memory goes between runs, and what it costs (docs/configuration.md,
# "Memory"): the default model and plan under each `runtime.allocator` choice, side by side in
# one sitting, ROUNDS rounds in turn. Each round of a choice: a lone client (p50), 16 clients
# with the 17-token sentence (req/s, p99) and the pool's PSS right after them ("after short"),
# 16 clients where every 8th text has 256 tokens (req/s, p99 of the short ones), the PSS
# right after that load ("after work"), after 4 clients of short texts that follow it ("after
# the fall": the load has fallen, but no worker idles a second) and after 3 s idle; then
# sparse traffic, one request every 1.5 s (p50 of 8 requests' time, curl's own; the worker is
# idle between them). Prints every round and the medians. The figures are all processes of
# the pool (PSS, MiB).
#
#   bench/allocator.sh                  # ~8 minutes on 2 cores
#   ROUNDS=5 SECONDS_PER=10 bench/allocator.sh
#   ONLY="malloc shared-arena" bench/allocator.sh   # only these runtime.allocator values
#   PRECISION=int8 bench/allocator.sh   # serve the default model in int8 (--precision)
#   BASELINE=target/inferd-before ONLY=shared-arena bench/allocator.sh
#       # also the default allocator with another build of inferd (kept inside the repository:
#       # it finds ONNX Runtime beside it), e.g. one from before a change to the allocator
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-6}
PORT=${PORT:-18520}
# name | runtime.allocator | GLIBC_TUNABLES
CHOICES=(
    "malloc, trimmed past 64 MiB free|malloc|"
    "malloc, fixed 256 KiB mmap threshold|malloc|glibc.malloc.mmap_threshold=262144"
    "ORT arena + memory patterns|arena|"
    "ORT arena, shrunk after every run|arena-shrink|"
    "one ORT arena per worker, shared by its sessions (default)|shared-arena|"
)
ONLY=${ONLY:-}
PRECISION=${PRECISION:-fp32}
BASELINE=${BASELINE:-}
# name | runtime.allocator | GLIBC_TUNABLES | binary (default: this build)
[[ -n $BASELINE ]] && CHOICES+=("the default, served by $BASELINE|shared-arena||$BASELINE")

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-allocator.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "$TEXT" >"$work/short.txt"
mixed_texts "$work/mixed.txt"
load() { # $1 concurrency, $2 texts, [$3 --short-below N]: inferd-bench's JSON lines, as a list
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$1" --seconds "$SECONDS_PER" \
        --warmup 1 --texts "$2" ${3:-} | grep '^{' | paste -sd, | sed 's/^/[/; s/$/]/'
}

for round in $(seq 1 "$ROUNDS"); do
    for choice in "${CHOICES[@]}"; do
        IFS='|' read -r name allocator tunables binary <<<"$choice"
        [[ -z $ONLY || " $ONLY " == *" $allocator "* ]] || continue
        default_pool_config "$work/inferd.toml" "$PORT" "$work/cache" "$allocator"
        if [[ -n $tunables ]]; then export GLIBC_TUNABLES=$tunables; else unset GLIBC_TUNABLES; fi
        setsid "${binary:-target/release/inferd}" serve --config "$work/inferd.toml" --precision "$PRECISION" \
            2>"$work/log" &
        sup=$!
        unset GLIBC_TUNABLES
        wait_pool "$work/control.sock"
        ready=$(pss_mib "$sup")
        c1=$(load 1 "$work/short.txt")
        c16=$(load 16 "$work/short.txt")
        short=$(pss_mib "$sup")
        mixed=$(load 16 "$work/mixed.txt" "--short-below 200")
        after=$(pss_mib "$sup")
        load 4 "$work/short.txt" >/dev/null
        fell=$(pss_mib "$sup")
        sleep 3
        idle=$(pss_mib "$sup")
        sparse=$(for _ in 1 2 3 4 5 6 7 8; do
            sleep 1.5
            curl -s -o /dev/null -w '%{time_total}\n' -H 'content-type: application/json' \
                -d "{\"inputs\": \"$TEXT\"}" "http://127.0.0.1:$PORT/embed"
        done | sort -n | sed -n 4p)
        kill -- -"$sup"; wait "$sup" 2>/dev/null || true; sup=""
        python3 - "$work/results.jsonl" "$name" "$round" "$ready" "$c1" "$c16" "$mixed" "$short" "$after" "$fell" \
            "$idle" "$sparse" <<'PY'
import json, sys
out, name, rnd, ready, c1, c16, mixed, short, after, fell, idle, sparse = sys.argv[1:]
r = {"name": name, "round": int(rnd), "ready": int(ready), "c1": json.loads(c1), "c16": json.loads(c16),
     "mixed": json.loads(mixed), "short": int(short), "after": int(after), "fell": int(fell), "idle": int(idle),
     "sparse_ms": float(sparse) * 1e3}
open(out, "a").write(json.dumps(r) + "\n")
print(f"round {rnd}: {name}: c=1 p50 {r['c1'][0]['p50_ms']:.2f} ms, c=16 {r['c16'][0]['throughput']:.0f}/s, "
      f"mixed {r['mixed'][0]['throughput']:.0f}/s, PSS after short {short} MiB, after work {after} MiB, "
      f"after the fall {fell} MiB, idle {idle} MiB; sparse p50 {r['sparse_ms']:.2f} ms", flush=True)
PY
    done
done

python3 - "$work/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = list(dict.fromkeys(r["name"] for r in rows))
med = lambda xs: statistics.median(xs)
print(f"\nmedians of {max(r['round'] for r in rows)} rounds (MiB: PSS of all the pool's processes)")
print(f"| allocator | c=1 p50 ms | c=16 req/s | c=16 p99 ms | mixed req/s | mixed: short p99 ms | PSS ready | "
      f"PSS after short | PSS after work | after the fall | PSS idle 3 s | sparse p50 ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in names:
    rs = [r for r in rows if r["name"] == n]
    print(f"| {n} | {med([r['c1'][0]['p50_ms'] for r in rs]):.2f} | {med([r['c16'][0]['throughput'] for r in rs]):.0f} | "
          f"{med([r['c16'][0]['p99_ms'] for r in rs]):.1f} | {med([r['mixed'][0]['throughput'] for r in rs]):.0f} | "
          f"{med([r['mixed'][-1]['p99_ms'] for r in rs]):.1f} | {med([r['ready'] for r in rs]):.0f} | "
          f"{med([r['short'] for r in rs]):.0f} | {med([r['after'] for r in rs]):.0f} | "
          f"{med([r['fell'] for r in rs]):.0f} | {med([r['idle'] for r in rs]):.0f} | "
          f"{med([r['sparse_ms'] for r in rs]):.2f} |")
PY
