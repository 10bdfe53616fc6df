#!/usr/bin/env bash
# Many models within one memory budget (docs/configuration.md, "Models on demand"): COUNT
# generated models of 5 to 30 MiB (`inferd-bench models`, distinct weights, in
# .cache/many-models), served on demand by the default plan's workers within BUDGET, under the
# same Zipf-distributed trace (`inferd-bench trace`: CLIENTS keep-alive clients, exponent
# ZIPF, every answer checked against its model's reference) for SECONDS, in one sitting:
#
#   - every model loaded (a budget that holds them all, each loaded once before the trace):
#     the memory baseline, every request warm;
#   - models.eviction = "lru";
#   - models.eviction = "sieve";
#   - models.eviction = "lru" with models.placement = "pool": a worker without room for a
#     model a sibling holds sends the request there instead of loading a second copy;
#   - a load storm: one client of a pinned model alone, then beside CLIENTS clients asking
#     for models drawn uniformly (nearly every request a cold model): the pinned model's
#     latency both times, and how the storm was answered (503s and how fast).
#
# For each: the hit ratio (requests that did not wait for a load), loads and evictions (from
# /metrics), p50/p99 of cold and warm requests, 503s and failures, and the pool's PSS
# (sampled every 100 ms: mean and peak). The baseline runs first, so that every model's
# shared weights are prepared before the runs compared.
#
#   bench/many_models.sh                # ~5 minutes on 2 cores
#   SECONDS_PER=30 ZIPF=0.8 bench/many_models.sh
#   ONLY=storm bench/many_models.sh     # the load storm alone
#   ONLY=placement bench/many_models.sh # every model loaded, lru, and lru with pool placement
#   ONLY=tight bench/many_models.sh     # the tight row alone: TIGHT_BUDGET (160MiB: shares of
#                                       # 80 MiB for the default plan's two workers, beside
#                                       # models of up to 30 MiB)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
COUNT=${COUNT:-90}
BUDGET=${BUDGET:-360MiB}
SECONDS_PER=${SECONDS_PER:-60}
CLIENTS=${CLIENTS:-8}
ZIPF=${ZIPF:-1.0}
PORT=${PORT:-18470}
TIGHT_BUDGET=${TIGHT_BUDGET:-160MiB}
INFERD=${INFERD:-target/release/inferd} # the server under test (another build: a baseline)
ONLY=${ONLY:-all}   # storm: the load storm alone; placement: per-worker against pool placement alone; tight: the tight budget alone
RECORD=${RECORD:-0} # 1 (make bench): the tables replace the record in docs/benchmarks.md

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
repo=.cache/many-models
if [[ ! -f $repo/m$(printf '%02d' $((COUNT - 1)))/model.onnx ]]; then
    rm -rf "$repo" && mkdir -p "$repo"
    target/release/inferd-bench models --out "$repo" --count "$COUNT"
fi
rm -rf "$repo/typed" && cp -r tests/models/typed "$repo/typed"
work=$(mktemp -d /tmp/inferd-many.XXXXXX)
trap 'pkill -f "inferd serve --config $work" 2>/dev/null || true; rm -rf "$work"' EXIT

# start NAME BUDGET EVICTION PINNED [PLACEMENT]: a server of the models within BUDGET, PINNED
# (a TOML list) in models.load, its log in $work/NAME.log; sets $pid, once it is ready.
start() {
    cat >"$work/inferd.toml" <<TOML
[server]
listen = "127.0.0.1:$PORT"
control_socket = "control.sock"
[admin]
listen = "127.0.0.1:$((PORT + 1))"
[runtime]
cache_dir = "$PWD/.cache/inferd"
[models]
repository = "$PWD/$repo"
default = "typed"
load = $4
on_demand = true
memory_budget = "$2"
eviction = "$3"
placement = "${5:-worker}"
TOML
    "$INFERD" serve --config "$work/inferd.toml" >"$work/$1.log" 2>&1 &
    pid=$!
    wait_pool "$work/control.sock"
}

# run NAME BUDGET EVICTION WARM [PLACEMENT]: one server, the trace against it, one row.
run() {
    local name=$1 warm=$4 admin=$((PORT + 1))
    start "$name" "$2" "$3" "[]" "${5:-worker}"
    if [[ $warm == 1 ]]; then
        # Every worker loads every model: each model asked for 8 times, 4 requests at a time
        # (the port spreads them over the workers).
        local body='{"inputs":[{"name":"x","shape":[1,16],"datatype":"FP32","data":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}]}'
        for _ in 1 2 3 4 5 6 7 8; do seq 0 $((COUNT - 1)); done | xargs -P 4 -I{} sh -c \
            "curl -s -o /dev/null -X POST 127.0.0.1:$PORT/v2/models/m\$(printf '%02d' {})/infer -d '$body'"
    fi
    local before
    before=$(curl -s "127.0.0.1:$admin/metrics")
    local json
    json=$(target/release/inferd-bench trace --addr "127.0.0.1:$PORT" --count "$COUNT" --concurrency "$CLIENTS" \
        --seconds "$SECONDS_PER" --zipf "$ZIPF" --pool-pid "$pid" | tail -n 1)
    local after
    after=$(curl -s "127.0.0.1:$admin/metrics")
    kill "$pid" && wait "$pid" 2>/dev/null || true
    python3 - "$name" "$json" "$before" "$after" "$2" <<'PY'
import json, re, sys
name, summary, before, after, budget = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
number, unit = re.fullmatch(r"(\d+)([MG])iB", budget).groups()
budget_mib = int(number) * (1024 if unit == "G" else 1)
def total(text, metric, labels=""):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(metric + "{") and labels in l)
loads = total(after, "inferd_model_loads_total", 'reason="on_demand"') - total(before, "inferd_model_loads_total", 'reason="on_demand"')
evictions = total(after, "inferd_model_evictions_total") - total(before, "inferd_model_evictions_total")
forwarded = total(after, "inferd_model_forwards_total", 'outcome="forwarded"') - total(before, "inferd_model_forwards_total", 'outcome="forwarded"')
s = summary
ms = lambda v: "-" if v is None else "%.1f" % v
# The pool's growth above its PSS when the trace started (the workers warm, with their pinned
# models), against the budget: the budget holds where this stays at or under 1.
grown = s["pss_peak_mib"] - s["pss_start_mib"]
print("| %s | %d | %.3f | %d | %d | %d | %s / %s | %s / %s | %d / %d | %.0f / %.0f / %.0f | %.0f (%.2fx) |" % (
    name, s["requests"], s["hit_ratio"], loads, evictions, forwarded, ms(s["warm_p50_ms"]), ms(s["warm_p99_ms"]),
    ms(s["cold_p50_ms"]), ms(s["cold_p99_ms"]), s["busy_503"], s["failed"], s["pss_start_mib"], s["pss_mean_mib"],
    s["pss_peak_mib"], grown, grown / budget_mib))
if s["first_failure"]:
    print("  first failure: %s" % s["first_failure"])
PY
}

# storm: m00 pinned (models.load), one client on it alone, then the same client while
# CLIENTS others each ask for a model drawn uniformly from all COUNT (a load storm: nearly
# every request for a model not loaded); the warm client's latency both times, and how the
# storm was answered.
storm() {
    start storm "$BUDGET" lru '["m00"]'
    local alone during flood
    alone=$(target/release/inferd-bench trace --addr "127.0.0.1:$PORT" --count 1 --concurrency 1 --seconds "$SECONDS_PER" | tail -n 1)
    target/release/inferd-bench trace --addr "127.0.0.1:$PORT" --count "$COUNT" --concurrency "$CLIENTS" \
        --seconds "$SECONDS_PER" --zipf 0 >"$work/flood.json" &
    local flooding=$!
    during=$(target/release/inferd-bench trace --addr "127.0.0.1:$PORT" --count 1 --concurrency 1 --seconds "$SECONDS_PER" | tail -n 1)
    wait "$flooding"
    flood=$(tail -n 1 "$work/flood.json")
    kill "$pid" && wait "$pid" 2>/dev/null || true
    python3 - "$alone" "$during" "$flood" <<'PY'
import json, sys
alone, during, flood = (json.loads(a) for a in sys.argv[1:])
ms = lambda v: "-" if v is None else "%.1f" % v
print("| the pinned model's client, alone | %d | %s / %s | %d / %d |" % (
    alone["requests"], ms(alone["p50_ms"]), ms(alone["p99_ms"]), alone["busy_503"], alone["failed"]))
print("| the same, during the storm | %d | %s / %s | %d / %d |" % (
    during["requests"], ms(during["p50_ms"]), ms(during["p99_ms"]), during["busy_503"], during["failed"]))
print("| the storm (uniform over all models) | %d | %s / %s (503s: p99 %s) | %d / %d |" % (
    flood["requests"], ms(flood["p50_ms"]), ms(flood["p99_ms"]), ms(flood["busy_p99_ms"]), flood["busy_503"], flood["failed"]))
PY
}

# The tables, as docs/benchmarks.md records them.
report() {
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F); $COUNT models of 5-30 MiB" \
        "($(du -sm "$repo" | cut -f1) MiB), budget $BUDGET; $CLIENTS clients, Zipf $ZIPF, $SECONDS_PER s each."
    if [[ $ONLY != storm ]]; then
        echo
        echo "| run | requests | hit ratio | loads | evictions | forwarded | warm p50 / p99 (ms) | cold p50 / p99 (ms) | 503 / failed | pool PSS start / mean / peak (MiB) | peak above start (of the budget) |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|"
        if [[ $ONLY != tight ]]; then
            run "every model loaded" 64GiB sieve 1
            run "lru" "$BUDGET" lru 0
            [[ $ONLY == placement ]] || run "sieve" "$BUDGET" sieve 0
            run "lru, placement = pool" "$BUDGET" lru 0 pool
        fi
        [[ $ONLY == placement ]] || run "lru, tight: budget $TIGHT_BUDGET" "$TIGHT_BUDGET" lru 0
    fi
    [[ $ONLY == placement || $ONLY == tight ]] && return 0
    echo
    echo "A load storm within the same budget ($CLIENTS clients, every model equally likely), beside one client of a pinned model:"
    echo
    echo "| client | requests | answered p50 / p99 (ms) | 503 / failed |"
    echo "|---|---|---|---|"
    storm
}
report | tee "$work/record.md"

if [[ $RECORD == 1 && $ONLY == all ]]; then
    record_block many-models "$work/record.md"
fi
