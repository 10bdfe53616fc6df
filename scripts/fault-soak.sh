#!/usr/bin/env bash
# Runs tests/faults.rs with many seeds, one after another, and prints a line per seed.
#   scripts/fault-soak.sh [SEEDS] [STEPS] [FIRST_SEED]    (defaults: 50 seeds of 60 steps from 1000)
# Needs the release build of the tests (make test, or cargo test --release --features
# inferd/test-switches --no-run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seeds=${1:-50} steps=${2:-60} first=${3:-1000}
failed=0
for seed in $(seq "$first" $((first + seeds - 1))); do
    start=$(date +%s)
    if out=$(INFERD_FAULT_SEED=$seed INFERD_FAULT_STEPS=$steps cargo test --release --locked --features inferd/test-switches --test suite -- faults:: 2>&1); then
        echo "seed $seed: passed in $(($(date +%s) - start)) s: $(grep -o "[0-9]* steps {.*" <<<"$out" | head -1)"
    else
        failed=$((failed + 1))
        echo "seed $seed: FAILED in $(($(date +%s) - start)) s"
        grep -E "panicked|seed $seed step" <<<"$out" | head -5
    fi
done
echo "$seeds seeds x $steps steps: $failed failed"
[ "$failed" -eq 0 ]
