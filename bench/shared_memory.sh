#!/usr/bin/env bash
# What Triton's system shared memory saves (docs/protocol.md, "Triton's system shared memory"):
# one `cnn` request (tests/models/cnn) of BATCH 32x32 RGB images in FP32, sent as binary tensor
# data, then the same tensor read from a registered region, alternating, ROUNDS of each, over
# one tritonclient.http connection to a pool of WORKERS; medians and their ratio, one sitting.
#
#   bench/shared_memory.sh            # ~10 s on 2 cores
#   BATCH=256 ROUNDS=100 bench/shared_memory.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-60}
BATCH=${BATCH:-64}
WORKERS=${WORKERS:-2}
PORT=${PORT:-18592}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-shm-bench.XXXXXX)
sup=""
trap '[[ -n $sup ]] && kill -- -$sup 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/inferd.toml" <<TOML
[server]
listen = "127.0.0.1:$PORT"
workers = $WORKERS
threads = 1
control_socket = "control.sock"
[admin]
listen = ""
[models]
repository = "$PWD/tests/models"
default = "cnn"
TOML
binary=$PWD/target/release/inferd
(cd "$work" && exec setsid "$binary" serve --config inferd.toml >"$work/log" 2>&1) &
sup=$!
wait_pool "$work/control.sock"
echo "$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date +%F); $WORKERS workers"
.venv/bin/python - "127.0.0.1:$PORT" "$ROUNDS" "$BATCH" <<'PY'
import os, statistics, sys, time
import numpy as np
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

addr, rounds, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = httpclient.InferenceServerClient(addr)
pixels = np.random.default_rng(0).random((batch, 3, 32, 32), dtype=np.float32)
key = f"/inferd-bench-{os.getpid()}"
handle = shm.create_shared_memory_region("bench", key, pixels.nbytes)
try:
    shm.set_shared_memory_region(handle, [pixels])
    client.register_system_shared_memory("bench", key, pixels.nbytes)
    sent = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    sent.set_data_from_numpy(pixels)
    shared = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
    shared.set_shared_memory("bench", pixels.nbytes)
    same = client.infer("cnn", [sent]).as_numpy("logits"), client.infer("cnn", [shared]).as_numpy("logits")
    assert np.array_equal(*same), "the answers differ"
    times = {"binary data": [], "shared memory": []}
    for _ in range(rounds):
        for name, tensor in (("binary data", sent), ("shared memory", shared)):
            started = time.perf_counter()
            client.infer("cnn", [tensor])
            times[name].append(time.perf_counter() - started)
    print(f"{pixels.nbytes / 1e3:.0f} KB in per request, {rounds} requests each")
    for name, ts in times.items():
        print(f"  {name:>13}: median {statistics.median(ts) * 1e3:.2f} ms")
    ratio = statistics.median(times["binary data"]) / statistics.median(times["shared memory"])
    print(f"  binary data / shared memory: {ratio:.2f}x")
    client.unregister_system_shared_memory()
finally:
    shm.destroy_shared_memory_region(handle)
PY
