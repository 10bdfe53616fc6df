#!/usr/bin/env bash
# The performance record (docs/benchmarks.md): in one sitting on this machine, following
# ../shared/BENCHMARKING.md,
#   (a) the raw ONNX Runtime ceiling, at the start and at the end of the sitting: the
#       single-thread call time, and sequences/s with one session per core at batch 1, 8, 16
#       and 32 (inferd-bench ort: no server), for the file as it is (fp32) and for inferd's
#       int8 rewrite of it (prepared once, with its accuracy guard, into .cache/inferd); the
#       mean of the two is the reference, and a sitting whose fp32 references (single-thread
#       call, best batch) differ by more than 10% is void (the machine was busy);
#   (b) inferd with its default plan under oha: closed loop at 1, 4, 16 and 32 keep-alive
#       connections, then open loop at 50% of its best throughput; in fp32, and again with
#       `--precision int8` (the guard's figures as the server reports them go into the table);
#   (c) the seeds' recipe (gunicorn + uvicorn + FastAPI + onnxruntime, bench/seeds/app.py, its
#       own virtualenv): one worker per core, one intra-op thread each, under the same load;
#   (d) the RSS and PSS of every process of each server after the 17-token load of (b) (for
#       inferd int8 also 2 s later, once its workers are idle), and again after (e), whose
#       stream includes 256-token texts;
#   (e) inferd's token budget: p99 of short texts at 16 connections alone, and in a stream
#       where every 8th request is a 256-token text;
#   (f) inferd over HTTP (/embed) and over gRPC (ModelInfer, the text as a raw BYTES tensor) with
#       one load generator for both (inferd-bench, one connection per client) at 1 and 16.
# (b), (c), (e) and (f) run ROUNDS times (default 3), each server alone; the report takes medians.
# (e) and (d) are measured for inferd int8 too; (f) in fp32 only.
# Every request embeds the same 17-token sentence with POST /embed. The load generator (oha,
# one worker thread) runs on the same cores as the server. Prints the table and the ratios, draws
# docs/benchmarks-latest.svg and rewrites the record blocks of docs/benchmarks.md and
# README.md (RECORD=0: print only).
#
#   bench/compare.sh                    # ~15 minutes on 2 cores
#   ROUNDS=5 SECONDS_PER=10 bench/compare.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
SECONDS_PER=${SECONDS_PER:-8}
ROUNDS=${ROUNDS:-3}
RECORD=${RECORD:-1}
CORES=$(nproc)

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd -p inferd-bench 2>&1 | tail -n 1
OHA_BIN=.tools/bin/oha
if [[ ! -x $OHA_BIN ]]; then
    echo "installing oha (load generator) into .tools/ ..."
    cargo install oha --version 1.16.0 --locked --root .tools >/dev/null 2>&1
fi
OHA="$OHA_BIN --worker-threads 1 --no-tui"
SEEDS=.cache/seeds-venv
if [[ ! -x $SEEDS/bin/gunicorn ]]; then
    echo "setting up the seeds' recipe in $SEEDS ..."
    python3 -m venv "$SEEDS"
    "$SEEDS/bin/pip" install -q -r bench/seeds/requirements.txt
fi

work=$(mktemp -d)
server=""
cleanup() {
    [[ -n $server ]] && kill -- -"$server" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
results=$work/results.jsonl
printf '%s\n' "$TEXT" >"$work/text.txt"
body=$(python3 -c 'import json,sys; print(json.dumps({"inputs": sys.argv[1]}))' "$TEXT")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# (a) the ceiling, no server
LIB=$(ls vendor/onnxruntime/lib/libonnxruntime.so.* | head -n 1)
ort_run() {
    target/release/inferd-bench ort --model models/minilm --ort-library "$LIB" --seconds "$SECONDS_PER" \
        --texts "$work/text.txt" "$@" | tail -n 1
}
ceiling() {
    echo "== raw ONNX Runtime ($1 of the sitting)"
    ort_run --parallel 1 --threads 1 --batch 1 | python3 bench/record.py add ort single "$1" | tee -a "$results"
    for b in 1 8 16 32; do
        ort_run --parallel "$CORES" --batch "$b" | python3 bench/record.py add ort "batch=$b" "$1" | tee -a "$results"
    done
    ort_run --precision int8 --parallel 1 --threads 1 --batch 1 | python3 bench/record.py add ort-int8 single "$1" | tee -a "$results"
    # A lone request's best on these cores: one call on two threads, as a worker's wide session.
    ort_run --precision int8 --parallel 1 --threads 2 --spin --batch 1 | python3 bench/record.py add ort-int8 wide "$1" | tee -a "$results"
    for b in 1 8 16 32; do
        ort_run --precision int8 --parallel "$CORES" --batch "$b" | python3 bench/record.py add ort-int8 "batch=$b" "$1" | tee -a "$results"
    done
}
ceiling start

# Closed loop at each concurrency, then open loop at 50% of the best. $1: contender name,
# $2: port, $3: round.
load() {
    local name=$1 url="http://127.0.0.1:$2/embed" round=$3 best=0
    $OHA -z 3s -c 4 -m POST -H 'content-type: application/json' -d "$body" "$url" >/dev/null
    for c in 1 4 16 32; do
        $OHA -z "${SECONDS_PER}s" -c "$c" --output-format json -m POST \
            -H 'content-type: application/json' -d "$body" "$url" |
            python3 bench/record.py add "$name" "c=$c" "$round" | tee -a "$results"
    done
    best=$(python3 bench/record.py best "$results" "$name" "$round")
    rate=$(python3 -c "print(max(1, int(0.5 * $best)))")
    $OHA -z "${SECONDS_PER}s" -q "$rate" -c 64 --latency-correction --output-format json -m POST \
        -H 'content-type: application/json' -d "$body" "$url" |
        python3 bench/record.py add "$name" open "$round" | tee -a "$results"
}

# (e) short texts alone, then in a stream where every 8th request is a 256-token text
# (inferd-bench reports the short ones apart); then (d), memory after work that included long
# inputs. $1: contender name, $2: port, $3: round.
mixed() {
    local name=$1 port=$2 round=$3
    for stream in short-only short-in-mix; do
        texts=$work/text.txt
        [[ $stream == short-in-mix ]] && texts=$work/mixed.txt
        target/release/inferd-bench http --addr "127.0.0.1:$port" --concurrency 16 --seconds "$SECONDS_PER" \
            --warmup 1 --short-below 200 --texts "$texts" | grep '^{' | tail -n 1 |
            python3 bench/record.py add "$name" "$stream" "$round" | tee -a "$results"
    done
    python3 bench/record.py memory "$name" memory "$round" $(pgrep -g "$server") | tee -a "$results"
}
# (f) $1: HTTP port, $2: gRPC port, $3: round.
protocols() {
    for c in 1 16; do
        target/release/inferd-bench http --addr "127.0.0.1:$1" --concurrency "$c" --seconds "$SECONDS_PER" \
            --warmup 1 --texts "$work/text.txt" | grep '^{' | python3 bench/record.py add inferd-http "c=$c" "$3" | tee -a "$results"
        target/release/inferd-bench grpc --addr "127.0.0.1:$2" --concurrency "$c" --seconds "$SECONDS_PER" \
            --warmup 1 --texts "$work/text.txt" | grep '^{' | python3 bench/record.py add inferd-grpc "c=$c" "$3" | tee -a "$results"
    done
}
mixed_texts "$work/mixed.txt"

for round in $(seq 1 "$ROUNDS"); do
    # (b) inferd, default plan
    echo "== round $round: inferd"
    port=$(free_port)
    gport=$(free_port)
    setsid target/release/inferd serve --listen "127.0.0.1:$port" --grpc-listen "127.0.0.1:$gport" --admin-listen "" \
        --control-socket "$work/ctl.sock" 2>"$work/inferd.log" &
    server=$!
    wait_http "http://127.0.0.1:$port/v2/health/ready"
    target/release/inferd status --control-socket "$work/ctl.sock" | sed -n 2p
    load inferd "$port" "$round"
    python3 bench/record.py memory inferd memory-short "$round" $(pgrep -g "$server") | tee -a "$results"
    mixed inferd "$port" "$round"
    protocols "$port" "$gport" "$round"
    target/release/inferd status --control-socket "$work/ctl.sock" | grep '^batches' || true
    kill -- -"$server"; wait "$server" 2>/dev/null || true; server=""

    # (b) again in int8: the same plan, the preparation found in .cache/inferd
    echo "== round $round: inferd, --precision int8"
    port=$(free_port)
    setsid target/release/inferd serve --precision int8 --listen "127.0.0.1:$port" --admin-listen "" \
        --control-socket "$work/ctl.sock" 2>"$work/inferd-int8.log" &
    server=$!
    wait_http "http://127.0.0.1:$port/v2/health/ready"
    target/release/inferd status --json --control-socket "$work/ctl.sock" |
        python3 bench/record.py guard inferd-int8 "$round" | tee -a "$results"
    load inferd-int8 "$port" "$round"
    python3 bench/record.py memory inferd-int8 memory-short "$round" $(pgrep -g "$server") | tee -a "$results"
    sleep 2
    python3 bench/record.py memory inferd-int8 memory-idle "$round" $(pgrep -g "$server") | tee -a "$results"
    mixed inferd-int8 "$port" "$round"
    kill -- -"$server"; wait "$server" 2>/dev/null || true; server=""

    # (c) the seeds' recipe
    echo "== round $round: gunicorn + uvicorn + FastAPI + onnxruntime ($CORES workers x 1 thread)"
    port=$(free_port)
    SEEDS_MODEL_DIR=$PWD/models/minilm OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
        setsid "$SEEDS/bin/gunicorn" -w "$CORES" -k uvicorn.workers.UvicornWorker -b "127.0.0.1:$port" \
        --chdir bench/seeds --log-level warning app:app 2>"$work/seeds.log" &
    server=$!
    wait_http "http://127.0.0.1:$port/health"
    sleep 2 # every worker imports, loads and warms up on its own
    load python "$port" "$round"
    python3 bench/record.py memory python memory-short "$round" $(pgrep -g "$server") | tee -a "$results"
    mixed python "$port" "$round"
    kill -- -"$server"; wait "$server" 2>/dev/null || true; server=""
done
ceiling end

python3 bench/record.py report "$results" --record "$RECORD" --seconds "$SECONDS_PER" --rounds "$ROUNDS"
