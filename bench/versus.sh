#!/usr/bin/env bash
# Two inferd binaries side by side in one sitting: the default pool of each, serving the
# default model, alternated ROUNDS times, under oha's closed loop at 1, 16 and 32 keep-alive
# connections (the 17-token sentence, POST /embed, SECONDS_PER seconds each after a 3 s
# warm-up). Prints each round and the medians: req/s and p50 per concurrency, and the ratio
# of the two binaries' medians. What a refactoring costs or gains, without the whole record of
# bench/compare.sh.
#
#   BASELINE=target/inferd-before bench/versus.sh     # ~4 minutes on 2 cores
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
: "${BASELINE:?BASELINE=path/to/another/inferd}"
BASELINE=$(realpath "$BASELINE")
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-8}
PORT=${PORT:-18640}
OHA=".tools/bin/oha --worker-threads 1 --no-tui"
[[ -x .tools/bin/oha ]] || cargo install oha --version 1.16.0 --locked --root .tools >/dev/null 2>&1
cargo build --release --locked -p inferd 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-versus.XXXXXX)
server=""
trap '[[ -n $server ]] && kill -- -"$server" 2>/dev/null; rm -rf "$work"' EXIT
body="{\"inputs\": \"$TEXT\"}"
results="$work/results"
for round in $(seq 1 "$ROUNDS"); do
    for which in baseline current; do
        binary=$([[ $which == baseline ]] && echo "$BASELINE" || realpath target/release/inferd)
        default_pool_config "$work/inferd.toml" "$PORT" "$work/cache"
        setsid "$binary" serve --config "$work/inferd.toml" >"$work/$which.log" 2>&1 &
        server=$!
        wait_pool "$work/control.sock"
        url="http://127.0.0.1:$PORT/embed"
        $OHA -z 3s -c 4 -m POST -H 'content-type: application/json' -d "$body" "$url" >/dev/null
        for c in 1 16 32; do
            $OHA -z "${SECONDS_PER}s" -c "$c" --output-format json -m POST -H 'content-type: application/json' \
                -d "$body" "$url" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(sys.argv[1], sys.argv[2], sys.argv[3], "%.1f" % d["summary"]["requestsPerSec"],
      "%.2f" % (d["latencyPercentiles"]["p50"] * 1000))' "$round" "$which" "$c" | tee -a "$results"
        done
        kill -TERM -- -"$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
        server=""
    done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
med = {}
for which in ("baseline", "current"):
    for c in ("1", "16", "32"):
        picked = [r for r in rows if r[1] == which and r[2] == c]
        med[which, c] = (statistics.median(float(r[3]) for r in picked), statistics.median(float(r[4]) for r in picked))
print("\nmedians of %d rounds: req/s (p50 ms)" % len({r[0] for r in rows}))
print("%-4s %20s %20s %8s" % ("c", "baseline", "current", "ratio"))
for c in ("1", "16", "32"):
    (b, bp), (n, np_) = med["baseline", c], med["current", c]
    print("%-4s %12.1f (%5.2f) %12.1f (%5.2f) %8.3f" % (c, b, bp, n, np_, n / b))
best = lambda w: max(med[w, c][0] for c in ("1", "16", "32"))
print("best %12.1f %20.1f %8.3f" % (best("baseline"), best("current"), best("current") / best("baseline")))
PY
