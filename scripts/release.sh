#!/usr/bin/env bash
# Usage: scripts/release.sh [rpm]
# Builds the release binary for CentOS/RHEL 8 and 9 and any other x86_64 Linux with glibc
# >= 2.28, checks that it needs nothing newer (scripts/check-glibc.sh), and with `rpm` packs it
# with ONNX Runtime, the systemd units and the config into target/rpm/ (docs/rhel.md).
# Expects `make setup` to have run (vendor/onnxruntime/lib). Runnable from any directory.
set -euo pipefail

TARGET=x86_64-unknown-linux-gnu
GLIBC=2.28  # CentOS/RHEL 8
# A target dir of its own: `make build` keeps target/release, and the two builds (different
# linker, different target) would otherwise wait on each other's cargo lock.
TARGET_DIR=target/rhel
RPM_DIR=target/rpm

cd "$(dirname "${BASH_SOURCE[0]}")/.."
log() { printf 'release: %s\n' "$*"; }
die() { printf 'release: ERROR: %s\n' "$*" >&2; exit 1; }

scripts/release-tools.sh "${1:-}"
export PATH="$PWD/.tools/bin:$PATH"
# cargo-zigbuild runs `python -m ziglang` with this interpreter: the venv release-tools made.
export CARGO_ZIGBUILD_PYTHON_PATH="$PWD/.cache/zig-venv/bin/python"

# --- the binary ------------------------------------------------------------------------------
# The .2.28 suffix makes zig link against glibc 2.28's symbol versions; the output folder drops
# it ($TARGET_DIR/$TARGET/release). ONNX Runtime is dlopen'ed at run time (ort's load-dynamic),
# and onig's C code builds with zig cc as is, so no other library or flag is involved.
bin=$TARGET_DIR/$TARGET/release/inferd
start=$SECONDS
cargo zigbuild --release --locked --target "$TARGET.$GLIBC" --target-dir "$TARGET_DIR" -p inferd
log "built $bin in $((SECONDS - start)) s"
scripts/check-glibc.sh "$bin" "$GLIBC"
log "$("$bin" --version)"

[[ ${1:-} == rpm ]] || exit 0

# --- ONNX Runtime's license, shipped with its library ----------------------------------------
# From the wheel setup.sh took the library from (fetched again if the cache was cleared).
ort_lib=$(find vendor/onnxruntime/lib -name 'libonnxruntime.so.*' -printf '%f\n' | sort -V | tail -n1)
[[ -n $ort_lib ]] || die "no vendor/onnxruntime/lib/libonnxruntime.so.*: run make setup"
ort_version=${ort_lib#libonnxruntime.so.}
licenses=vendor/onnxruntime/licenses
stamp=vendor/onnxruntime/.licenses-version  # outside $licenses: the RPM takes all of it
if [[ -f $stamp && $(<"$stamp") == "$ort_version" ]]; then
    log "onnxruntime $ort_version license: skipped ($licenses)"
else
    wheels=.cache/wheels/onnxruntime-$ort_version
    compgen -G "$wheels/*.whl" >/dev/null ||
        .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
            "onnxruntime==$ort_version" -d "$wheels"
    rm -rf "$licenses" && mkdir -p "$licenses"
    .venv/bin/python - "$licenses" "$wheels"/*.whl <<'EOF'
import os, sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
zf = zipfile.ZipFile(wheel)
names = [n for n in zf.namelist() if n in ("onnxruntime/LICENSE", "onnxruntime/ThirdPartyNotices.txt")]
if len(names) != 2:
    sys.exit(f"release: ERROR: LICENSE and ThirdPartyNotices.txt not both in {wheel}: {names}")
for n in names:
    with open(os.path.join(dest, os.path.basename(n)), "wb") as f:
        f.write(zf.read(n))
EOF
    printf '%s\n' "$ort_version" >"$stamp"
    log "onnxruntime $ort_version license: done ($licenses)"
fi

# --- the RPM ---------------------------------------------------------------------------------
# auto-req reads only executable files; shared libraries are 0755 on RHEL anyway. This way
# the RPM requires the libstdc++ and libgcc_s symbol versions ONNX Runtime was built against.
chmod 0755 vendor/onnxruntime/lib/libonnxruntime.so.*
# [package.metadata.generate-rpm] in Cargo.toml lists the files; --target/--target-dir point
# its target/release/ at the zigbuild output. --auto-req builtin: the versioned sonames from
# the ELF files (ldd), the same on any build host (auto would switch to
# /usr/lib/rpm/find-requires where one is installed). gzip: a payload every rpm reads.
# SOURCE_DATE_EPOCH (the commit's time) makes file times and the build time repeatable.
version=$("$bin" --version | cut -d' ' -f2)
mkdir -p "$RPM_DIR"
rm -f "$RPM_DIR/inferd-$version"-*.rpm  # so the one found below is this build's
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)} \
    cargo generate-rpm --target "$TARGET" --target-dir "$TARGET_DIR" --auto-req builtin \
    --payload-compress gzip -o "$RPM_DIR"
rpm_file=$(echo "$RPM_DIR/inferd-$version"-*.x86_64.rpm)
log "built $rpm_file ($(du -h "$rpm_file" | cut -f1))"
rpm -qip "$rpm_file"
rpm -qlvp "$rpm_file"
log "requires: $(rpm -qRp "$rpm_file" | sort -u | tr '\n' ' ')"
