#!/usr/bin/env bash
# `make test`: the whole suite on this checkout, as CI runs it on a fresh clone.
#   1. the set-up (scripts/setup.sh: .venv, ONNX Runtime, the default model) and the test
#      system packages (scripts/test-deps.sh), while the tests build: the set-up waits on
#      PyPI and Debian's mirrors, the build on the CPU, and neither needs the other;
#   2. every test (unit and integration, the real release binary), with cargo-nextest where
#      the toolchain has it (each test in a process of its own, files overlapping:
#      .config/nextest.toml), else with cargo test (one file at a time);
#   3. the request parsers' lint (clippy::arithmetic_side_effects denied);
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

if $nextest; then
    $CARGO nextest run "${features[@]}"
else
    echo "test: cargo-nextest not found: running the suite with cargo test (slower: one file at a time)"
    $CARGO test "${features[@]}"
fi
# The request parsers deny unchecked arithmetic (clippy::arithmetic_side_effects).
$CARGO clippy --release --locked -p inferd-worker --all-features -- -D warnings
# Every request parser's fuzz target, 10 s each, from its seed corpus (fuzz/, docs/guards.md).
scripts/fuzz.sh 10
