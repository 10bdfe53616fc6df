#!/usr/bin/env bash
# Memory under a long mixed load (docs/configuration.md, "Memory"): the default model
# served by the default plan, and `POST /embed` requests of 1 to 8 texts of 1 to 300 words
# (truncated to the model's max_length) from 4 clients for SOAK_SECONDS; every 30 s, and at
# the end, the PSS of each process of the pool and their sum. Memory that keeps growing past
# the first minute would be a leak; the buffers of the runs in progress and what the allocator
# keeps (up to 64 MiB free after a run, nothing after a second idle) are the plateau. Prints
# one line per sample, the answered and failed counts, and the memory once the pool has been
# idle for 3 s.
#
#   bench/soak.sh                      # 4 minutes
#   SOAK_SECONDS=60 bench/soak.sh
#   ALLOCATOR=shared-arena bench/soak.sh   # another runtime.allocator
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/lib.sh
SOAK_SECONDS=${SOAK_SECONDS:-240}
ALLOCATOR=${ALLOCATOR:-}  # empty: the default (shared-arena)
PORT=${PORT:-18500}

scripts/setup.sh >/dev/null
cargo build --release --locked -p inferd 2>&1 | tail -n 1
work=$(mktemp -d /tmp/inferd-soak.XXXXXX)
trap 'kill $sup 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
default_pool_config "$work/inferd.toml" "$PORT" "$work/cache" "$ALLOCATOR"
target/release/inferd serve --config "$work/inferd.toml" 2>"$work/log" &
sup=$!
wait_pool "$work/control.sock"

.venv/bin/python - "$PORT" "$SOAK_SECONDS" "$work/counts" <<'EOF' &
import http.client, json, random, sys, threading, time
port, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
words = ("the quick brown fox jumps over a lazy dog while servers answer requests about models "
         "memory threads batches tokens embeddings and other things people write").split()
end = time.time() + seconds
counts = {"ok": 0, "failed": 0}
lock = threading.Lock()
def client(seed):
    rnd = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.time() < end:
        texts = [" ".join(rnd.choice(words) for _ in range(rnd.randint(1, 300))) for _ in range(rnd.randint(1, 8))]
        body = json.dumps({"inputs": texts, "truncate": True})
        try:
            conn.request("POST", "/embed", body, {"Content-Type": "application/json"})
            r = conn.getresponse(); r.read()
            ok = r.status == 200
        except Exception:
            ok = False
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        with lock:
            counts["ok" if ok else "failed"] += 1
threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
open(out, "w").write(json.dumps(counts))
EOF
load=$!
echo "t=0s: $(pool_pss "$sup")"
for ((t = 30; t <= SOAK_SECONDS; t += 30)); do
    sleep 30
    echo "t=${t}s: $(pool_pss "$sup")"
done
wait "$load"
echo "at the end of the load: $(pool_pss "$sup"); requests: $(cat "$work/counts")"
sleep 3
echo "idle 3 s later: $(pool_pss "$sup")"
