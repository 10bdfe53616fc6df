#!/usr/bin/env bash
# Priorities (docs/configuration.md, "Priorities"): one interactive client (one connection,
# closed loop, the 17-token sentence) alone; then beside a bulk client at full speed
# (BULK connections of a ~100-token passage) with no priorities; then with the bulk client at
# `x-inferd-priority: 9` and the interactive one at 0. The default model and plan, one
# sitting, ROUNDS rounds in turn; prints each run and the medians, and the interactive client's
# p99 against its p99 alone. With BASELINE=path/to/another/inferd, that binary's pool too in
# each round, one server at a time (its rows marked "baseline"): before and after a change.
#
#   bench/priority.sh                  # ~4 minutes on 2 cores
#   BASELINE=target/inferd-before bench/priority.sh
#   RECORD=1 bench/priority.sh         # (make bench) the table replaces the record in
#                                      # docs/benchmarks.md ("Priorities")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-12}
BULK=${BULK:-12}
RECORD=${RECORD:-0}
PORT=${PORT:-18570}
BASELINE=${BASELINE:+$(realpath "$BASELINE")}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-priority.XXXXXX)
sup="" bulk=""
trap '[[ -n $bulk ]] && kill $bulk 2>/dev/null; [[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "$TEXT" >"$work/short.txt"
for _ in 1 2 3 4 5 6; do printf '%s ' "A passage of a re-indexing run, one of very many documents sent at full speed."; done >"$work/bulk.txt"
echo >>"$work/bulk.txt"

default_pool_config "$work/inferd.toml" "$PORT" "$PWD/.cache/inferd"
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
echo "Machine: $machine; $ROUNDS rounds of $SECONDS_PER s; bulk: $BULK connections${BASELINE:+; baseline: $BASELINE}"
interactive() {
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency 1 --seconds "$SECONDS_PER" \
        --warmup 1 --texts "$work/short.txt" --priority 0 | bench_summary
}
bulk_load() {
    target/release/inferd-bench http --addr "127.0.0.1:$PORT" --concurrency "$BULK" \
        --seconds $((SECONDS_PER + 4)) --warmup 0 --texts "$work/bulk.txt" --priority "$1" >"$work/bulk.out"
}
# measure BINARY SUFFIX ROUND: the three runs on BINARY's pool, alone on the machine.
measure() {
    setsid "$1" serve --config "$work/inferd.toml" 2>"$work/log" &
    sup=$!
    wait_pool "$work/control.sock"
    for run in alone "beside bulk, no priorities" "beside bulk at priority 9"; do
        case $run in
            alone) ;;
            *"no priorities") bulk_load 0 & bulk=$! ;;
            *) bulk_load 9 & bulk=$! ;;
        esac
        [[ -n $bulk ]] && sleep 1
        summary=$(interactive)
        bulk_rps="-"
        if [[ -n $bulk ]]; then wait "$bulk"; bulk=""; bulk_rps=$(bench_summary <"$work/bulk.out" | cut -d' ' -f1); fi
        echo "round $3 | $run$2 | $summary | $bulk_rps" | tee -a "$work/results"
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
    echo "connection, the 17-token sentence; the bulk client: $BULK connections of a ~100-token passage):"
    python3 - "$work/results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    _, name, summary, bulk = [p.strip() for p in line.split("|")]
    runs.setdefault(name, []).append(([float(x) for x in summary.split()], bulk))
print()
print("| interactive client | its req/s | its p50 / p99 (ms) | its p99 against alone | bulk req/s |")
print("|---|---|---|---|---|")
for name, rows in runs.items():
    alone = statistics.median(r[0][2] for r in runs["alone" + (" (baseline)" if name.endswith("(baseline)") else "")])
    med = lambda k: statistics.median(r[0][k] for r in rows)
    bulks = [float(b) for _, b in rows if b != "-"]
    bulk = f"{statistics.median(bulks):.0f}" if bulks else "-"
    print(f"| {name} | {med(0):.0f} | {med(1):.2f} / {med(2):.2f} | {med(2) / alone:.2f} | {bulk} |")
PY
} | tee "$work/record.md"
if [[ $RECORD == 1 ]]; then
    record_block priority "$work/record.md"
fi
