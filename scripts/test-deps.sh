#!/usr/bin/env bash
# System packages the test suite needs beyond the Rust toolchain and scripts/setup.sh:
# a real Prometheus server (Debian package `prometheus`) that scrapes inferd in tests/metrics.rs.
# Idempotent; installs with apt-get when run as root, else says what to install.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    echo "test-deps: prometheus: skipped ($(command -v prometheus))"
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "test-deps: ERROR: the tests need a Prometheus server binary on PATH: install the 'prometheus' package" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start its own service where an init system runs; the tests start their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
fi
echo "test-deps: prometheus: done ($(command -v prometheus))"
