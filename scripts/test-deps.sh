#!/usr/bin/env bash
# System packages the test suite needs beyond the Rust toolchain and scripts/setup.sh:
#   - a real Prometheus server (Debian package `prometheus`, with promtool) that scrapes inferd
#     in tests/metrics.rs and checks the deploy/ rules;
#   - qemu-user (`qemu-x86_64`), which runs `inferd check` on an emulated CPU without VNNI in
#     tests/quantize.rs, so that the int8 path of such CPUs runs on any host.
# Idempotent; installs with apt-get when run as root, else says what to install.
set -euo pipefail
missing=()
for need in prometheus:prometheus promtool:prometheus qemu-x86_64:qemu-user; do
    tool=${need%%:*} package=${need#*:}
    if command -v "$tool" >/dev/null 2>&1; then
        echo "test-deps: $tool: skipped ($(command -v "$tool"))"
    elif [[ " ${missing[*]} " != *" $package "* ]]; then
        missing+=("$package")
    fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "test-deps: ERROR: the tests need these Debian packages: ${missing[*]} (prometheus, promtool, qemu-x86_64 on PATH)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The package may start its own service where an init system runs; the tests start their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
fi
echo "test-deps: ${missing[*]}: done"
