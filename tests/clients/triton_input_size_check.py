"""The body limit as Triton's HTTP QA tests probe it (server qa/L0_http/
http_input_size_limit_test.py, with `requests` as they send): one byte past the limit is a 400
in Triton's words, the limit itself is served, for JSON, raw binary and gzip bodies.

usage: triton_input_size_check.py HOST:PORT LIMIT [--leak WORKER_PID]

The server serves `cumsum` (FP32 [n] -> its running sum) and `one_string` (one BYTES element a
row, echoed) with server.max_body_bytes = LIMIT. Prints "input size ok" when every check holds.
"""

import gzip
import json
import sys

import numpy as np
import requests

addr, limit = sys.argv[1], int(sys.argv[2])
leak_pid = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--leak" else None
URL = f"http://{addr}/v2/models/{{}}/infer"
HINT = "Use --http-max-input-size to increase the limit."


def refused(response, *says):
    assert response.status_code == 400, (response.status_code, response.content[:300])
    text = response.content.decode()
    for s in says:
        assert s in text, (s, text[:300])


def json_of_size(size):
    """A one_string request whose JSON is exactly `size` bytes (the QA test's
    _build_payload_of_json_size)."""
    payload = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": [""]}]}
    payload["inputs"][0]["data"] = ["A" * (size - len(json.dumps(payload)))]
    assert len(json.dumps(payload)) == size
    return payload


# Raw binary (Inference-Header-Content-Length: 0): the body is the input's bytes. Past the
# limit by 32 floats: refused; short of it by 32: served, the running sum of ones exact.
over = np.ones(limit // 4 + 32, dtype=np.float32).tobytes()
raw = {"Inference-Header-Content-Length": "0"}
refused(requests.post(URL.format("cumsum"), data=over, headers=raw), "exceeds the maximum allowed value", HINT)
under = np.ones(limit // 4 - 32, dtype=np.float32)
r = requests.post(URL.format("cumsum"), data=under.tobytes(), headers=raw)
assert r.status_code == 200, (r.status_code, r.content[:300])
sums = np.frombuffer(r.content[int(r.headers["Inference-Header-Content-Length"]) :], dtype=np.float32)
assert np.array_equal(sums, np.arange(1, len(under) + 1, dtype=np.float32)), sums[-4:]

# JSON: a tensor of more bytes than the limit, then one whose JSON is just under it.
n = limit // 4 + 32
payload = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [n], "data": [1.0] * n}]}
refused(
    requests.post(URL.format("cumsum"), json=payload),
    "request JSON size of ",
    " bytes exceeds the maximum allowed input size of ",
    HINT,
)
n = (limit // 4 - 32) * 4 // 5
payload = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [n], "data": [1.0] * n}]}
assert len(json.dumps(payload)) < limit
r = requests.post(URL.format("cumsum"), json=payload)
assert r.status_code == 200, (r.status_code, r.content[:300])
answer = r.json()["outputs"][0]
assert answer["shape"] == [n] and answer["data"][-1] == float(n), (answer["shape"], answer["data"][-1])

# A JSON body of one long string at the byte boundary.
refused(requests.post(URL.format("one_string"), json=json_of_size(limit + 1)), "request JSON size of ", HINT)
r = requests.post(URL.format("one_string"), json=json_of_size(limit))
assert r.status_code == 200, (r.status_code, r.content[:300])
assert len(r.json()["outputs"][0]["data"][0]) == len(json_of_size(limit)["inputs"][0]["data"][0])

# gzip: the limit applies to what the body inflates to, not to its size on the wire.
def padded(size):
    text = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1000], "data": [1.0] * 1000}]})
    return gzip.compress((text[:-1] + " " * (size - len(text)) + text[-1]).encode())


zipped = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
big = padded(limit + (1 << 20))
assert len(big) < limit
refused(requests.post(URL.format("cumsum"), data=big, headers=zipped), "exceeds the maximum allowed value", HINT)
r = requests.post(URL.format("cumsum"), data=padded(limit - (1 << 20)), headers=zipped)
assert r.status_code == 200 and r.json()["outputs"][0]["data"][-1] == 1000.0, (r.status_code, r.content[:300])

# A header length past the inflated body, 100 times on one connection: each a 400, and the
# worker does not grow (the QA test's bound: 32 MiB).
def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


bad = dict(zipped, **{"Inference-Header-Content-Length": "9999999"})
body = gzip.compress(b" " * (1 << 20))
with requests.Session() as session:
    refused(session.post(URL.format("cumsum"), data=body, headers=bad))
    before = rss(leak_pid) if leak_pid else 0
    for _ in range(100):
        refused(session.post(URL.format("cumsum"), data=body, headers=bad))
    if leak_pid:
        growth = rss(leak_pid) - before
        assert growth < 32 << 20, f"the worker grew by {growth} bytes"
        print(f"worker RSS growth over 100 refusals: {growth / 2**20:.1f} MiB")
print("input size ok")
