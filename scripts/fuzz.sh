#!/usr/bin/env bash
# Builds the fuzz targets (fuzz/) with libFuzzer's coverage instrumentation on the stable
# toolchain and runs each for SECONDS on a copy of its committed seed corpus; a crash, a leak
# or a timeout fails the run and leaves its input in fuzz/artifacts/<target>/.
#   scripts/fuzz.sh [SECONDS] [TARGET...]   (default 10 s each, every target)
#   scripts/fuzz.sh build                   (only the build)
# `make test` builds while the suite runs, then runs the default; a long run:
# scripts/fuzz.sh 3600 kserve_json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../fuzz"
seconds=${1:-10}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kserve_json binary_tensor grpc_infer image_decode tei_openai tokenizer handoff grpc_frames)
host=$(rustc -vV | sed -n 's/^host: //p')
# cargo-fuzz's flags, without the sanitizer (which needs a nightly toolchain). --target keeps
# them off build scripts.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
cargo build --release --locked --target "$host" --bins
[ "$seconds" != build ] || exit 0
# One target per core at a time: each still runs for SECONDS on a core of its own.
jobs=$(nproc)
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
run() {
    local target=$1 work status=0
    work=$(mktemp -d)
    cp -r "corpus/$target/." "$work/"
    mkdir -p "artifacts/$target"
    "target/$host/release/$target" "$work" -max_total_time="$seconds" -max_len=65536 -timeout=10 \
        -rss_limit_mb=2048 -artifact_prefix="artifacts/$target/" -print_final_stats=1 >"$work.log" 2>&1 || status=$?
    {
        echo "fuzz: $target for $seconds s"
        grep -E "DONE|stat::(number_of_executed_units|new_units_added|peak_rss_mb)|panicked|deadly|SUMMARY|Test unit" "$work.log" || true
    } >"$results/$target.out"
    echo "$status" >"$results/$target.status"
    rm -rf "$work" "$work.log"
}
for target in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
        wait -n || true
    done
    run "$target" &
done
wait
failed=0
for target in "${targets[@]}"; do
    cat "$results/$target.out"
    status=$(cat "$results/$target.status")
    if [ "$status" -ne 0 ]; then
        echo "fuzz: $target FAILED (exit $status); the input is in fuzz/artifacts/$target/" >&2
        failed=1
    fi
done
exit "$failed"
