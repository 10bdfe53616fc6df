# inferd: the two commands of the README, and the set-up they share.
#   make run    set up (idempotent), build release, serve the default model on 127.0.0.1:8000
#   make test   set up (idempotent) while the tests build, then the whole test suite (unit +
#               integration, real binary), the parsers' lint and a bounded run of every fuzz target
#   make setup  only the set-up: .venv tooling, ONNX Runtime library, default model
#   make rpm    the CentOS/RHEL 8/9 package (glibc 2.28 binary) in target/rpm/ (docs/rhel.md)

CARGO ?= cargo
ARGS ?=

.PHONY: setup build run test check bench fixtures release rpm clean

setup:
	scripts/setup.sh

build:
	$(CARGO) build --release --locked

run: setup build
	target/release/inferd serve $(ARGS)

check: setup build
	target/release/inferd check $(ARGS)

# The integration tests run the release binary, so `make run` and `make test` share one build.
# scripts/test.sh: the set-up while the tests build, the suite (cargo-nextest where the
# toolchain has it), the parsers' lint and a bounded run of every fuzz target.
test:
	CARGO=$(CARGO) scripts/test.sh

# The performance record: inferd against the raw ONNX Runtime ceiling and the Python stack,
# in one sitting; rewrites the record in README.md and docs/benchmarks.md (docs/benchmarks.md);
# then many models within one memory budget (docs/benchmarks.md, "Many models"), what
# tracing costs ("Traces"), what the cache of answers gains ("The cache of answers"), what
# compact embedding codes change ("Compact codes") and what
# priorities do for an interactive client beside a bulk one ("Priorities") and what an upgrade
# of inferd under load costs ("Upgrade").
bench: setup
	bench/compare.sh
	RECORD=1 bench/many_models.sh
	RECORD=1 bench/traces.sh
	RECORD=1 bench/cache.sh
	RECORD=1 bench/codes.sh
	RECORD=1 bench/priority.sh
	RECORD=1 bench/upgrade.sh

# Regenerates the committed test models and the default model's reference output.
fixtures: setup
	.venv/bin/python scripts/gen_test_models.py
	.venv/bin/python scripts/make_reference.py

# Release builds for CentOS/RHEL 8+ (glibc 2.28, zig as the linker), in target/rhel/; each
# installs its own tools first (scripts/release-tools.sh: zig, cargo-zigbuild, cargo-generate-rpm,
# rpm). `release` stops at the checked binary, `rpm` packs it into target/rpm/ (docs/rhel.md).
release: setup
	scripts/release.sh

rpm: setup
	scripts/release.sh rpm

clean:
	$(CARGO) clean
