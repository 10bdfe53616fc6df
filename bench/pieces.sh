#!/usr/bin/env bash
# A request in pieces (docs/configuration.md, batching): an identity over BYTES
# (tests/fixtures/bytes_identity.onnx) with `[batching] max_batch_size = 1`, so a request of N
# elements runs as N one-row pieces, against onnxruntime running the same N one-element
# pieces in a loop (Python, one thread) and, with BASELINE=path/to/another/inferd, that binary
# (only up to BASELINE_MAX elements: before the fix a request cost N squared). One sitting,
# each server alone; ROUNDS rounds, medians; seconds per request (binary tensors over HTTP).
#
#   bench/pieces.sh                                  # ~1 minute on 2 cores
#   BASELINE=target/inferd-before bench/pieces.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-"10000 30000 100000 300000"}
BASELINE=${BASELINE:+$(realpath "$BASELINE")}
BASELINE_MAX=${BASELINE_MAX:-30000}
PORT=${PORT:-18590}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-pieces.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
mkdir -p "$work/models/identity"
cat >"$work/models/identity/model.toml" <<TOML
name = "identity"
version = "1"
file = "$PWD/tests/fixtures/bytes_identity.onnx"
[batching]
max_batch_size = 1
TOML
cat >"$work/inferd.toml" <<TOML
[server]
listen = "127.0.0.1:$PORT"
workers = 1
threads = 1
control_socket = "control.sock"
request_timeout_secs = 600
[admin]
listen = ""
[models]
repository = "$work/models"
default = "identity"
TOML
# time_requests SIZE...: seconds per request of each size, ROUNDS medians.
time_requests() {
    python3 - "$PORT" "$ROUNDS" "$@" <<'PY'
import json, statistics, struct, sys, time, urllib.request
port, rounds, sizes = sys.argv[1], int(sys.argv[2]), [int(n) for n in sys.argv[3:]]
out = []
for n in sizes:
    data = b"".join(struct.pack("<I", 5) + b"hello" for _ in range(n))
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [n], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(data)}}],
                       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    times = []
    for _ in range(rounds):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/identity/infer", data=head + data,
                                     headers={"Inference-Header-Content-Length": str(len(head))})
        started = time.perf_counter()
        body = urllib.request.urlopen(req, timeout=900).read()
        times.append(time.perf_counter() - started)
        assert body[len(body) - len(data):] == data, "the answer differs"
    out.append(f"{statistics.median(times):.3f}")
print(" ".join(out))
PY
}
# serve BINARY SIZE...: that binary's pool, the sizes timed, stopped.
serve() {
    local binary=$1
    shift
    (cd "$work" && exec setsid "$binary" serve --config inferd.toml >"$work/log" 2>&1) &
    sup=$!
    wait_pool "$work/control.sock"
    time_requests "$@"
    kill -- -"$sup"
    wait "$sup" 2>/dev/null || true
    sup=""
}
read -r -a sizes <<<"$SIZES"
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F)"
ort=$(.venv/bin/python - "$ROUNDS" "${sizes[@]}" <<'PY'
import statistics, sys, time
import numpy as np, onnxruntime as ort
rounds, sizes = int(sys.argv[1]), [int(n) for n in sys.argv[2:]]
o = ort.SessionOptions()
o.intra_op_num_threads = o.inter_op_num_threads = 1
s = ort.InferenceSession("tests/fixtures/bytes_identity.onnx", o, providers=["CPUExecutionProvider"])
out = []
for n in sizes:
    x = np.array(["hello"] * n, dtype=object)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(n):
            s.run(None, {"INPUT0": x[i:i + 1]})
        times.append(time.perf_counter() - started)
    out.append(f"{statistics.median(times):.3f}")
print(" ".join(out))
PY
)
this=$(serve "$PWD/target/release/inferd" "${sizes[@]}")
baseline=""
if [[ -n $BASELINE ]]; then
    small=()
    for n in "${sizes[@]}"; do ((n <= BASELINE_MAX)) && small+=("$n"); done
    baseline=$(serve "$BASELINE" "${small[@]}")
fi
echo "\`bench/pieces.sh\` ($machine; medians of $ROUNDS; one request of N BYTES elements in N one-row pieces;"
echo "seconds per request):"
echo
python3 - "$SIZES" "$ort" "$this" "$baseline" <<'PY'
import sys
sizes, ort, this, base = (s.split() for s in sys.argv[1:5])
print("| elements | onnxruntime, the same pieces | inferd | inferd against onnxruntime |" + (" before |" if base else ""))
print("|---|---|---|---|" + ("---|" if base else ""))
for i, n in enumerate(sizes):
    row = f"| {n} | {ort[i]} | {this[i]} | {float(this[i]) / float(ort[i]):.2f}x |"
    if base:
        row += f" {base[i]} |" if i < len(base) else " (not run) |"
    print(row)
PY
