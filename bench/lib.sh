# Helpers the benchmark scripts share; `source bench/lib.sh` from the repository root.

# The sentence every benchmark sends (17 tokens for MiniLM's tokenizer; `inferd tune` uses it too).
TEXT="The quick brown fox jumps over the lazy dog while the cat sleeps."

# mixed_texts FILE: the mixed stream: seven times $TEXT, then one text of 256 tokens.
mixed_texts() {
    { for _ in 1 2 3 4 5 6 7; do printf '%s\n' "$TEXT"; done; printf 'model %.0s' $(seq 1 254); echo; } >"$1"
}

# wait_http URL: waits until `curl URL` answers 200, at most 120 s.
wait_http() {
    for _ in $(seq 1 600); do
        if curl -sf -o /dev/null "$1"; then return 0; fi
        sleep 0.2
    done
    echo "server at $1 did not come up" >&2
    return 1
}

# wait_pool SOCKET: waits until `inferd status` on the control socket says every worker is
# ready, at most 120 s.
wait_pool() {
    for _ in $(seq 1 600); do
        target/release/inferd status --control-socket "$1" 2>/dev/null | head -1 | grep -q ' ready on ' && return 0
        sleep 0.2
    done
    echo "the pool behind $1 did not become ready" >&2
    return 1
}

# bench_summary: "THROUGHPUT P50 P99" (requests or sequences/s, ms) from the JSON line
# inferd-bench prints last, read from stdin.
bench_summary() {
    python3 -c 'import json,sys; d=json.loads(sys.stdin.readlines()[-1]); print("%.0f %.2f %.2f" % (d["throughput"], d["p50_ms"], d["p99_ms"]))'
}

# pool_pss PID: "TOTAL MiB (pid: MiB, ...)", the PSS of PID and its children
# (/proc/PID/smaps_rollup; bench/record.py's `memory` is the same sum for the record).
pool_pss() {
    local total=0 parts=() kb pid
    for pid in "$1" $(pgrep -P "$1"); do
        kb=$(awk '/^Pss:/ { print $2 }' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0)
        total=$((total + kb)); parts+=("$pid: $((kb / 1024))")
    done
    echo "$((total / 1024)) MiB ($(IFS=,; echo "${parts[*]}"))"
}

# pss_mib PID: the total of pool_pss alone (MiB).
pss_mib() { pool_pss "$1" | cut -d' ' -f1; }

# default_pool_config FILE PORT CACHE [ALLOCATOR]: an inferd.toml serving the default model
# with the default plan on 127.0.0.1:PORT, its control socket beside FILE, shared weights in
# CACHE, no metrics listener; runtime.allocator when given.
default_pool_config() {
    cat >"$1" <<TOML
[server]
listen = "127.0.0.1:$2"
control_socket = "control.sock"
[admin]
listen = ""
[models]
repository = "$PWD/models"
default = "minilm"
[runtime]
cache_dir = "$3"
${4:+allocator = \"$4\"}
TOML
}

# record_block NAME FILE: replaces what lies between `<!-- NAME:begin -->` and
# `<!-- NAME:end -->` in docs/benchmarks.md with FILE (a benchmark's record, RECORD=1).
record_block() {
    python3 - "$1" "$2" docs/benchmarks.md <<'PY'
import sys
name, record, path = sys.argv[1], open(sys.argv[2]).read().strip(), sys.argv[3]
text = open(path).read()
begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
head, rest = text.split(begin, 1)
open(path, "w").write(head + begin + "\n" + record + "\n" + end + rest.split(end, 1)[1])
PY
    echo "docs/benchmarks.md: the $1 record rewritten"
}
