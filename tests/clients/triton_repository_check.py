#!/usr/bin/env python3
"""Checks Triton's model repository and statistics extensions on inferd's admin listener
with NVIDIA's tritonclient.http, while the public port serves inference.

    .venv/bin/python tests/clients/triton_repository_check.py ADMIN_ADDR HTTP_ADDR [TOKEN]

With TOKEN (admin.token_file), every admin call sends `Authorization: Bearer TOKEN`.

The server must serve `typed` (the default), `classifier` and `slow` from a repository that
also holds `reranker` (not loaded), with admin.model_control = true, and have answered nothing
yet. In order:
  - the index lists the three READY and `reranker` UNAVAILABLE;
  - after 3 good and 1 bad `typed` requests and 2 `slow` ones on the public port, the
    statistics count them (success, fail, queue, compute, inference and execution counts, the
    time of the last inference);
  - load `reranker`: it answers /rerank on the public port like
    tests/fixtures/reranker_reference.json, and the index says READY;
  - unload `classifier`: the public port no longer knows it, the index says UNAVAILABLE, and
    the statistics of `typed` and `slow` (whose counter row moved) are what they were;
  - refusals name the problem: unloading the default model, loading a model that is not in
    the repository, a Triton model configuration, statistics of an unknown model.
Prints `repository: all checks passed` and exits 0, or the failed check and exits 1.
"""

import json
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tritonclient_check import INPUTS, expected_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RERANKER = json.loads((ROOT / "tests/fixtures/reranker_reference.json").read_text())


class CheckFailed(Exception):
    pass


def require(cond, what):
    if not cond:
        raise CheckFailed(what)


def refused(call, *words, status=None):
    """`call` fails, its message saying each of `words`, with `status` where given (tritonclient's:
    "403" over HTTP, "StatusCode.UNAVAILABLE" over gRPC)."""
    try:
        call()
    except InferenceServerException as e:
        message = e.message() or ""
        for word in words:
            require(word in message, f"error {message!r} does not say {word!r}")
        require(status is None or e.status() == status, f"error {message!r} has status {e.status()}, not {status}")
        return
    raise CheckFailed(f"no error; expected one saying {words}")


def typed_inputs(datatype_of_f32="FP32"):
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        if name == "f32_in":
            datatype, data = datatype_of_f32, data.astype(np.float64 if datatype_of_f32 == "FP64" else np.float32)
        inp = httpclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data)
        inputs.append(inp)
    return inputs


def slow_inputs():
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    n = httpclient.InferInput("iterations", [1], "INT64")
    n.set_data_from_numpy(np.array([10], np.int64))
    return [x, n]


def states(admin):
    return {m["name"]: (m["state"], m.get("reason", "")) for m in admin.get_model_repository_index()}


def stats_of(admin, name):
    stats = admin.get_inference_statistics(name)["model_stats"]
    require(len(stats) == 1 and stats[0]["name"] == name, f"statistics of {name}: {stats}")
    return stats[0]


def post(addr, path, body):
    request = urllib.request.Request(f"http://{addr}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


class WithToken:
    """The admin client, every call sending the admin token (tritonclient takes headers per call)."""

    def __init__(self, client, token):
        self.client, self.headers = client, {"Authorization": f"Bearer {token}"}

    def __getattr__(self, name):
        method = getattr(self.client, name)
        return lambda *args, **kwargs: method(*args, headers=dict(self.headers), **kwargs)


def main():
    admin_addr, http_addr = sys.argv[1:3]
    admin = httpclient.InferenceServerClient(admin_addr, network_timeout=120)
    if len(sys.argv) > 3:
        admin = WithToken(admin, sys.argv[3])
    public = httpclient.InferenceServerClient(http_addr)
    step = "index"
    try:
        index = states(admin)
        want = {"typed": "READY", "classifier": "READY", "slow": "READY", "reranker": "UNAVAILABLE"}
        require({n: s for n, (s, _) in index.items()} == want, f"index {index}, expected {want}")

        step = "statistics"
        before = time.time() * 1000
        for _ in range(3):
            public.infer("typed", typed_inputs())
        refused(lambda: public.infer("typed", typed_inputs("FP64")), "expected FP32")
        for _ in range(2):
            public.infer("slow", slow_inputs())
        typed = stats_of(admin, "typed")
        s = typed["inference_stats"]
        require(s["success"]["count"] == 3 and s["success"]["ns"] > 0, f"success {s['success']}")
        require(s["fail"]["count"] == 1 and s["fail"]["ns"] > 0, f"fail {s['fail']}")
        require(s["queue"]["count"] == 3 and s["compute_infer"]["count"] == 3, f"queue/compute {s}")
        require(s["compute_infer"]["ns"] <= s["success"]["ns"], f"compute longer than the requests: {s}")
        require(typed["inference_count"] == 6 and typed["execution_count"] == 3, f"counts {typed}")  # 3 x batch 2
        require(typed["last_inference"] >= before - 1000, f"last_inference {typed['last_inference']} before {before}")
        require(typed["version"] == "1", f"version {typed['version']!r}")
        every = admin.get_inference_statistics()["model_stats"]
        require(sorted(m["name"] for m in every) == ["classifier", "slow", "typed"], f"all statistics: {every}")
        slow_before = stats_of(admin, "slow")["inference_stats"]["success"]["count"]
        require(slow_before == 2, f"slow success {slow_before}")

        step = "load reranker"
        admin.load_model("reranker")
        require(public.is_model_ready("reranker"), "reranker is not ready on the public port after load")
        require(states(admin)["reranker"][0] == "READY", f"index after load: {states(admin)}")
        texts = [c["text"] for c in RERANKER["cases"]]
        answer = post(http_addr, "/v2/models/reranker/rerank", {"query": RERANKER["query"], "texts": texts})
        got = {a["index"]: a["score"] for a in answer}
        for i, case in enumerate(RERANKER["cases"]):
            require(abs(got[i] - case["score"]) < 1e-4, f"rerank score {i}: {got[i]} vs {case['score']}")

        step = "unload classifier"
        admin.unload_model("classifier")
        require(not public.is_model_ready("classifier"), "classifier is still ready on the public port after unload")
        require(states(admin)["classifier"] == ("UNAVAILABLE", "unloaded"), f"index after unload: {states(admin)}")
        after = stats_of(admin, "typed")["inference_stats"]
        require(after["success"]["count"] == 3 and after["fail"]["count"] == 1, f"typed after two reloads: {after}")
        slow_after = stats_of(admin, "slow")["inference_stats"]["success"]["count"]
        require(slow_after == 2, f"slow success {slow_after} after its counter row moved (was {slow_before})")

        step = "refusals"
        refused(lambda: admin.unload_model("typed"), "default model")
        refused(lambda: admin.load_model("no_such_model"), "no_such_model", "no folder")
        refused(lambda: admin.load_model("slow", config='{"instance_group": [{"count": 2}]}'), "failed to load 'slow'", "not 'instance_group'")
        refused(lambda: admin.get_inference_statistics("classifier"), "unknown model: 'classifier'")
    except Exception:
        print(f"FAIL  {step}\n{traceback.format_exc()}")
        return 1
    print("repository: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
