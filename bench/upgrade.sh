#!/usr/bin/env bash
# Upgrading inferd under load (docs/operations.md, "Upgrading inferd"): the default model and
# plan, two open-loop loads at once (keep-alive clients, and clients that open a connection
# per request), and `inferd upgrade` RUNS seconds into each round. Every answer's send time
# and latency are kept, and cut into periods: before the upgrade, the overlap (from the
# command to the old supervisor's exit) and after. Prints p50/p99 per period and the overlap's
# p99 against before's, and the failed requests (there must be none).
#
# The new binary is this same build: the hand-over, the new workers' warm-up beside the old
# ones and the old ones' drain cost the same whatever the version (tests/upgrade.rs checks the
# versions).
#
#   bench/upgrade.sh                  # ~2 minutes on 2 cores
#   RECORD=1 bench/upgrade.sh         # (make bench) the table replaces the record in
#                                     # docs/benchmarks.md ("Upgrade")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-30}
AT=${AT:-10}
KEEP_RATE=${KEEP_RATE:-100}
NEW_RATE=${NEW_RATE:-50}
RECORD=${RECORD:-0}
PORT=${PORT:-18590}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-upgrade.XXXXXX)
sup="" loads=()
trap 'for p in "${loads[@]}"; do kill "$p" 2>/dev/null; done; [[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "$TEXT" >"$work/short.txt"

default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
# Its own session and process group: every supervisor the upgrades start stays in it.
setsid target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
sup=$!
wait_pool "$work/control.sock"
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
echo "Machine: $machine; $ROUNDS rounds of $SECONDS_PER s, the upgrade at ${AT} s;" \
    "keep-alive: $KEEP_RATE req/s on 4 connections; a connection per request: $NEW_RATE req/s"
now_ms() { date +%s%3N; }
supervisor_pid() { target/release/inferd status --control-socket "$work/control.sock" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])'; }
for round in $(seq 1 "$ROUNDS"); do
    old=$(supervisor_pid)
    start=$(now_ms)
    loads=()
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 4 --seconds "$SECONDS_PER" --warmup 0 \
        --texts "$work/short.txt" --rate "$KEEP_RATE" --timeline "$work/keep.$round" >"$work/keep.out.$round" &
    loads+=($!)
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 4 --seconds "$SECONDS_PER" --warmup 0 \
        --texts "$work/short.txt" --rate "$NEW_RATE" --new-connection --timeline "$work/new.$round" >"$work/new.out.$round" &
    loads+=($!)
    sleep "$AT"
    up=$(now_ms)
    target/release/inferd upgrade --control-socket "$work/control.sock" >"$work/upgrade.$round"
    done_at=$(now_ms)
    while kill -0 "$old" 2>/dev/null && [ "$(ps -o stat= -p "$old" | cut -c1)" != Z ]; do sleep 0.02; done
    gone=$(now_ms)
    wait "${loads[@]}"
    loads=()
    echo "$round $start $up $done_at $gone" >>"$work/rounds"
    echo "round $round: upgrade command $((done_at - up)) ms, old supervisor gone after $((gone - up)) ms: $(tail -1 "$work/upgrade.$round")"
done
{
    echo "\`bench/upgrade.sh\` ($machine; $ROUNDS rounds of $SECONDS_PER s, \`inferd upgrade\` at ${AT} s; open loops:"
    echo "keep-alive clients at $KEEP_RATE req/s on 4 connections, and $NEW_RATE req/s, each request on a new connection; latency"
    echo "counted from each request's time on the schedule; medians over the rounds):"
    python3 - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
rounds = [list(map(int, l.split())) for l in open(f"{work}/rounds")]
def pct(v, p):
    v = sorted(v)
    return v[round((len(v) - 1) * p)] if v else float("nan")
rows = {}
failed = 0
overlap_s = []
for r, start, up, done, gone in rounds:
    overlap_s.append((gone - up) / 1e3)
    for kind in ("keep", "new"):
        failed += json.loads(open(f"{work}/{kind}.out.{r}").readlines()[-1])["errors"]
        samples = [tuple(map(float, l.split())) for l in open(f"{work}/{kind}.{r}")]
        # The first second is the clients' own start.
        periods = {
            "before": [l for t, l in samples if start + 1000 <= t < up],
            "overlap": [l for t, l in samples if up <= t <= gone],
            "after": [l for t, l in samples if t > gone],
        }
        for name, lat in periods.items():
            rows.setdefault((kind, name), []).append((pct(lat, 0.5), pct(lat, 0.99), len(lat)))
print()
print(f"Overlap (the command to the old supervisor's exit): {statistics.median(overlap_s):.1f} s (median); failed requests: {failed}.")
print()
print("| clients | period | requests | p50 / p99 (ms) | p99 against before |")
print("|---|---|---|---|---|")
for kind, label in (("keep", "keep-alive"), ("new", "a connection per request")):
    before = statistics.median(p99 for _, p99, _ in rows[(kind, "before")])
    for name in ("before", "overlap", "after"):
        vals = rows[(kind, name)]
        p50 = statistics.median(v[0] for v in vals)
        p99 = statistics.median(v[1] for v in vals)
        n = sum(v[2] for v in vals)
        print(f"| {label} | {name} | {n} | {p50:.2f} / {p99:.2f} | {p99 / before:.2f} |")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 ]]; then
    record_block upgrade "$work/record.md"
fi
