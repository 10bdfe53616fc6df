#!/usr/bin/env bash
# Usage: scripts/check-glibc.sh BINARY [MAX=2.28]
#
# Fails (exit 1, naming the symbols) when BINARY or the bundled ONNX Runtime library
# (vendor/onnxruntime/lib/libonnxruntime.so.*, shipped beside it in the RPM) needs a newer
# glibc than MAX. 2.28 is CentOS/RHEL 8's glibc, the oldest host the RPM is for: the dynamic
# loader refuses a binary that asks for a symbol version the host's libc lacks, so this is the
# whole compatibility question, answered before shipping instead of on the host.
# Also checked, because a binary can pass the version test and still fail to start there:
#   - BINARY may link only glibc's libraries and libgcc_s (ONNX Runtime is dlopen'ed at run
#     time, so nothing else belongs in its DT_NEEDED);
#   - GLIBCXX_ (libstdc++, which ONNX Runtime needs) up to GLIBCXX_MAX, default 3.4.25:
#     RHEL 8's libstdc++ (GCC 8).
set -euo pipefail

[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: $0 BINARY [MAX_GLIBC=2.28]" >&2; exit 2; }
binary=$(realpath -- "$1")   # before the cd below, so a path relative to the caller works
max=${2:-2.28}
max_glibcxx=${GLIBCXX_MAX:-3.4.25}
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command -v objdump >/dev/null || { echo "check-glibc: ERROR: objdump not found (binutils)" >&2; exit 2; }

failed=0
log() { printf 'check-glibc: %s\n' "$*"; }

# newer A B: true when version A sorts after B.
newer() { [[ $1 != "$2" && $(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n1) == "$1" ]]; }

# check_versions FILE PREFIX MAX: every PREFIX_x.y symbol version FILE imports must be <= MAX.
check_versions() {
    local file=$1 prefix=$2 limit=$3 pairs versions v highest="" bad=()
    # objdump -T prints the version as GLIBC_2.28 or (GLIBC_2.28), the symbol name last.
    pairs=$(objdump -T "$file" | awk -v p="${prefix}_" '
        match($0, p "[0-9]+(\\.[0-9]+)+") { print substr($0, RSTART + length(p), RLENGTH - length(p)), $NF }')
    versions=$(cut -d' ' -f1 <<<"$pairs" | sed '/^$/d' | sort -uV)
    [[ -n $versions ]] || return 0
    highest=$(tail -n1 <<<"$versions")
    for v in $versions; do
        newer "$v" "$limit" && bad+=("$v")
    done
    if [[ ${#bad[@]} -eq 0 ]]; then
        log "$file: highest ${prefix}_$highest (max ${prefix}_$limit): ok"
        return 0
    fi
    log "$file: FAIL: needs ${prefix}_$highest, above ${prefix}_$limit; symbols:"
    for v in "${bad[@]}"; do
        awk -v v="$v" '$1 == v { printf "    %s@%s_%s\n", $2, p, v }' p="$prefix" <<<"$pairs" | sort -u
    done
    failed=1
}

# check_needed FILE: glibc's own libraries, the loader and libgcc_s (Rust's unwinder) only.
check_needed() {
    local file=$1 lib extra=()
    for lib in $(objdump -p "$file" | awk '$1 == "NEEDED" { print $2 }'); do
        case $lib in
            libc.so.6 | libm.so.6 | libdl.so.2 | libpthread.so.0 | librt.so.1 | libutil.so.1 | \
                ld-linux-x86-64.so.2 | ld-linux-aarch64.so.1 | libgcc_s.so.1) ;;
            *) extra+=("$lib") ;;
        esac
    done
    if [[ ${#extra[@]} -gt 0 ]]; then
        log "$file: FAIL: links libraries beyond glibc: ${extra[*]}"
        failed=1
    else
        log "$file: links glibc and libgcc_s only: ok"
    fi
}

[[ -f $binary ]] || { echo "check-glibc: ERROR: $binary does not exist" >&2; exit 2; }
check_needed "$binary"
check_versions "$binary" GLIBC "$max"

shopt -s nullglob
ort_libs=(vendor/onnxruntime/lib/libonnxruntime.so.*)
[[ ${#ort_libs[@]} -gt 0 ]] || log "no vendor/onnxruntime/lib/libonnxruntime.so.* to check (run make setup)"
for lib in "${ort_libs[@]}"; do
    check_versions "$lib" GLIBC "$max"
    check_versions "$lib" GLIBCXX "$max_glibcxx"
done

exit "$failed"
