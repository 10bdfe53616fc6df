#!/usr/bin/env bash
# Priorities (docs/configuration.md, "Priorities"): an interactive client (one keep-alive
# connection, the 17-token sentence, an open loop of RATE requests a second) and a bulk client
# (BULK connections of a ~100-token passage, a closed loop at full speed), each alone; then
# together with no priorities; then with the bulk client at `x-inferd-priority: 9` and the
# interactive one at 0, while a third client sends DEADLINE_RATE requests a second at priority 9
# with `x-inferd-deadline-ms: 20` (answered 504 at their deadline, or run if a lane reaches them
# first). The default model and plan, one sitting, ROUNDS rounds in turn; prints each run and
# the medians: the interactive client's p99 against its p99 alone, the bulk client's requests
# per second against alone, and how the deadline requests were answered. With
# BASELINE=path/to/another/inferd (under the repository, so it finds ONNX Runtime), that
# binary's pool too in each round, one server at a time (its rows marked "baseline").
#
#   bench/priority.sh                  # ~5 minutes on 2 cores
#   BASELINE=target/inferd-before bench/priority.sh
#   RECORD=1 bench/priority.sh         # (make bench) the table replaces the record in
#                                      # docs/benchmarks.md ("Priorities")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-12}
BULK=${BULK:-12}
RATE=${RATE:-50}
DEADLINE_RATE=${DEADLINE_RATE:-20}
RECORD=${RECORD:-0}
PORT=${PORT:-18570}
BASELINE=${BASELINE:+$(realpath "$BASELINE")}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-priority.XXXXXX)
sup="" bulk="" late=""
trap '[[ -n $bulk ]] && kill $bulk 2>/dev/null; [[ -n $late ]] && kill $late 2>/dev/null; [[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "$TEXT" >"$work/short.txt"
for _ in 1 2 3 4 5 6; do printf '%s ' "A passage of a re-indexing run, one of very many documents sent at full speed."; done >"$work/bulk.txt"
echo >>"$work/bulk.txt"

default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
echo "Machine: $machine; $ROUNDS rounds of $SECONDS_PER s; bulk: $BULK connections${BASELINE:+; baseline: $BASELINE}"
interactive() {
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 1 --seconds "$SECONDS_PER" \
        --warmup 1 --texts "$work/short.txt" --priority 0 --rate "$RATE" | bench_summary
}
bulk_load() {
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$BULK" \
        --seconds $((SECONDS_PER + 4)) --warmup 0 --texts "$work/bulk.txt" --priority "$1" >"$work/bulk.out"
}
# Requests at priority 9 with a 20 ms deadline, DEADLINE_RATE a second on one keep-alive
# connection, for SECONDS_PER: "SENT TIMED_OUT RUN P50 P99" (ms, over every answer).
deadline_load() {
    python3 - "$PORT" "$DEADLINE_RATE" "$SECONDS_PER" "$TEXT" >"$work/late.out" <<'PY'
import http.client, json, statistics, sys, time
port, rate, seconds, text = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
c = http.client.HTTPConnection("127.0.0.1", port)
body = json.dumps({"inputs": text})
headers = {"Content-Type": "application/json", "x-inferd-priority": "9", "x-inferd-deadline-ms": "20"}
codes, waits, due = {}, [], time.monotonic() + 1
end = due + seconds
while due < end:
    time.sleep(max(0, due - time.monotonic()))
    c.request("POST", "/embed", body, headers)
    r = c.getresponse()
    r.read()
    waits.append((time.monotonic() - due) * 1e3)
    codes[r.status] = codes.get(r.status, 0) + 1
    due += 1 / rate
q = statistics.quantiles(waits, n=100)
print(len(waits), codes.get(504, 0), codes.get(200, 0), "%.1f %.1f" % (q[49], q[98]))
PY
}
# measure BINARY SUFFIX ROUND: the runs on BINARY's pool, alone on the machine.
measure() {
    setsid "$1" serve --config "$work/inferd.toml" 2>"$work/log" &
    sup=$!
    wait_pool "$work/control.sock" || { tail -n 5 "$work/log" >&2; exit 1; }
    for run in "bulk alone" alone "beside bulk, no priorities" "beside bulk at priority 9"; do
        case $run in
            "bulk alone") bulk_load 9 & bulk=$! ;;
            alone) ;;
            *"no priorities") bulk_load 0 & bulk=$! ;;
            *) bulk_load 9 & bulk=$! ;;
        esac
        [[ -n $bulk ]] && sleep 1
        late_row="-"
        if [[ $run == "bulk alone" ]]; then
            summary="- - -"
        elif [[ $run == *"priority 9" ]]; then
            deadline_load & late=$!
            summary=$(interactive)
            wait "$late"; late=""; late_row=$(cat "$work/late.out")
        else
            summary=$(interactive)
        fi
        bulk_rps="-"
        if [[ -n $bulk ]]; then wait "$bulk"; bulk=""; bulk_rps=$(bench_summary <"$work/bulk.out" | cut -d' ' -f1); fi
        echo "round $3 | $run$2 | $summary | $bulk_rps | $late_row" | tee -a "$work/results"
    done
    kill -- -"$sup"
    wait "$sup" 2>/dev/null || true
    sup=""
}
for round in $(seq 1 "$ROUNDS"); do
    measure "$PWD/target/release/inferd" "" "$round"
    if [[ -n $BASELINE ]]; then measure "$BASELINE" " (baseline)" "$round"; fi
done
{
    echo "\`bench/priority.sh\` ($machine; medians of $ROUNDS rounds of $SECONDS_PER s; the interactive client: one"
    echo "connection, the 17-token sentence, $RATE requests a second; the bulk client: $BULK connections of a ~100-token"
    echo "passage at full speed; beside them at priority 9, $DEADLINE_RATE requests a second with a 20 ms deadline):"
    python3 - "$work/results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    _, name, summary, bulk, late = [p.strip() for p in line.split("|")]
    runs.setdefault(name, []).append((summary.split(), bulk, late.split()))
print()
print("| run | interactive p50 / p99 (ms) | its p99 against alone | bulk req/s | bulk against alone |")
print("|---|---|---|---|---|")
for name, rows in runs.items():
    suffix = " (baseline)" if name.endswith("(baseline)") else ""
    med = lambda k, rs=rows: statistics.median(float(r[0][k]) for r in rs)
    bulk_med = lambda rs: statistics.median(float(b) for _, b, _ in rs)
    alone = med(2, runs["alone" + suffix])
    bulk_alone = bulk_med(runs["bulk alone" + suffix])
    has_bulk = rows[0][1] != "-"
    interactive = f"{med(1):.2f} / {med(2):.2f}" if rows[0][0][0] != "-" else "-"
    against = f"{med(2) / alone:.2f}" if rows[0][0][0] != "-" else "-"
    bulk = f"{bulk_med(rows):.0f}" if has_bulk else "-"
    bulk_ratio = f"{bulk_med(rows) / bulk_alone:.2f}" if has_bulk else "-"
    print(f"| {name} | {interactive} | {against} | {bulk} | {bulk_ratio} |")
print()
for name, rows in runs.items():
    lates = [r[2] for r in rows if r[2] != ["-"]]
    if lates:
        sent = sum(int(l[0]) for l in lates)
        timed_out = sum(int(l[1]) for l in lates)
        ran = sum(int(l[2]) for l in lates)
        p99 = statistics.median(float(l[4]) for l in lates)
        p50 = statistics.median(float(l[3]) for l in lates)
        print(f"- 20 ms deadline, {name}: {sent} sent, {timed_out} answered 504, {ran} run and answered 200; "
              f"every answer's time p50 {p50:.1f} ms, p99 {p99:.1f} ms (medians of the rounds).")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 ]]; then
    record_block priority "$work/record.md"
fi
