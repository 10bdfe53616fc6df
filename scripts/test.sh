#!/usr/bin/env bash
# `make test`: the whole suite on this checkout, as CI runs it on a fresh clone.
#   1. the set-up (scripts/setup.sh: .venv, ONNX Runtime, the default model) and the test
#      system packages (scripts/test-deps.sh), while the tests build: the set-up waits on
#      PyPI and Debian's mirrors, the build on the CPU, and neither needs the other;
#   2. every test (unit and integration, the real release binary), with cargo-nextest where
#      the toolchain has it (each test in a process of its own, files overlapping:
#      .config/nextest.toml), else with cargo test (one file at a time);
#   3. meanwhile, at the lowest priority, the request parsers' lint
#      (clippy::arithmetic_side_effects denied) and the fuzz targets' build;
#   4. a bounded run of every fuzz target from its seed corpus (scripts/fuzz.sh 10).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARGO=${CARGO:-cargo}
features=(--release --locked --workspace --features inferd/test-switches)
nextest=false
if $CARGO nextest --version >/dev/null 2>&1; then
    nextest=true
fi

setup_log=$(mktemp)
trap 'rm -f "$setup_log"' EXIT
(scripts/setup.sh && scripts/test-deps.sh) >"$setup_log" 2>&1 &
setup=$!
if $nextest; then
    build=(nextest run --no-run "${features[@]}")
else
    build=(test --no-run "${features[@]}")
fi
built=0
$CARGO "${build[@]}" || built=$?
status=0
wait "$setup" || status=$?
cat "$setup_log"
[ "$status" -eq 0 ] || { echo "test: the set-up failed (exit $status)" >&2; exit "$status"; }
[ "$built" -eq 0 ] || { echo "test: the build failed (exit $built)" >&2; exit "$built"; }

# The lint and the fuzz targets' build at the lowest priority while the suite runs: they take
# the CPU the suite leaves idle (its tests wait on their servers much of the time) and give
# it back whenever a test computes (nice 19 weighs 1.5% of a nice-0 task).
lint_log=$(mktemp)
trap 'rm -f "$setup_log" "$lint_log"' EXIT
# The request parsers deny unchecked arithmetic (clippy::arithmetic_side_effects). In a target
# folder of its own: cargo locks one while the suite's runner reads it.
(CARGO_TARGET_DIR=target/lint nice -n 19 $CARGO clippy --release --locked -p inferd-worker --all-features -- -D warnings &&
    nice -n 19 scripts/fuzz.sh build) >"$lint_log" 2>&1 &
lint=$!
tests=0
if $nextest; then
    $CARGO nextest run "${features[@]}" || tests=$?
else
    echo "test: cargo-nextest not found: running the suite with cargo test (slower: one file at a time)"
    $CARGO test "${features[@]}" || tests=$?
fi
linted=0
wait "$lint" || linted=$?
cat "$lint_log"
[ "$tests" -eq 0 ] || { echo "test: the suite failed (exit $tests)" >&2; exit "$tests"; }
[ "$linted" -eq 0 ] || { echo "test: the lint or the fuzz targets' build failed (exit $linted)" >&2; exit "$linted"; }
# Every request parser's fuzz target, 10 s each, from its seed corpus (fuzz/, docs/guards.md).
scripts/fuzz.sh 10
