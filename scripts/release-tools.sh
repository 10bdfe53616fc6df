#!/usr/bin/env bash
# Usage: scripts/release-tools.sh [rpm]
# Installs what a release build needs beyond the Rust toolchain, inside the checkout:
#   a. zig (PyPI package ziglang, in its own venv .cache/zig-venv): cargo-zigbuild links with
#      it against glibc 2.28's symbol versions, whatever glibc this build host has
#   b. cargo-zigbuild, into .tools/ (cargo install --root)
# and with `rpm`:
#   c. cargo-generate-rpm, into .tools/ (writes the RPM itself: no rpmbuild, no spec file)
#   d. the `rpm` tool, to query the result (apt-get when root on Debian/Ubuntu)
# Versions are pinned so two builds of one commit use the same tools. Each step is skipped
# when its output is already there. Runnable from any directory.
set -euo pipefail

ZIGLANG_VERSION=0.15.2
CARGO_ZIGBUILD_VERSION=0.24.1
CARGO_GENERATE_RPM_VERSION=0.21.1

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TOOLS=.tools
ZIG_VENV=.cache/zig-venv

log() { printf 'release-tools: %s\n' "$*"; }
die() { printf 'release-tools: ERROR: %s\n' "$*" >&2; exit 1; }

# cargo_tool NAME VERSION: cargo install --locked, unless that version is in .tools/bin.
cargo_tool() {
    local name=$1 version=$2
    if [[ $("$TOOLS/bin/$name" --version 2>/dev/null) == "$name $version" ]]; then
        log "$name: skipped ($TOOLS/bin/$name $version)"
    else
        log "$name: installing $version into $TOOLS/ (a few minutes) ..."
        cargo install --quiet --locked --force --root "$TOOLS" "$name" --version "$version"
        log "$name: done"
    fi
}

# --- a. zig ----------------------------------------------------------------------------------
if [[ $("$ZIG_VENV/bin/python" -m ziglang version 2>/dev/null) == "$ZIGLANG_VERSION" ]]; then
    log "zig: skipped ($ZIG_VENV, zig $ZIGLANG_VERSION)"
else
    command -v python3 >/dev/null || die "python3 not found"
    python3 -m venv "$ZIG_VENV"
    "$ZIG_VENV/bin/python" -m pip install --quiet "ziglang==$ZIGLANG_VERSION"
    log "zig: done ($ZIG_VENV, zig $("$ZIG_VENV/bin/python" -m ziglang version))"
fi

# --- b. cargo-zigbuild -------------------------------------------------------------------------
cargo_tool cargo-zigbuild "$CARGO_ZIGBUILD_VERSION"

[[ ${1:-} == rpm ]] || exit 0

# --- c. cargo-generate-rpm ---------------------------------------------------------------------
cargo_tool cargo-generate-rpm "$CARGO_GENERATE_RPM_VERSION"

# --- d. rpm (queries only) ---------------------------------------------------------------------
if command -v rpm >/dev/null; then
    log "rpm: skipped ($(command -v rpm))"
elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends rpm >/dev/null
    log "rpm: done ($(command -v rpm))"
else
    die "the rpm tool is needed to check the package: install the 'rpm' package"
fi
