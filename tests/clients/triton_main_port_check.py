#!/usr/bin/env python3
"""Checks Triton's statistics and repository index on inferd's main port, over HTTP and gRPC,
with NVIDIA's tritonclient, against what the admin listener answers for the same pool.

    .venv/bin/python tests/clients/triton_main_port_check.py ADMIN_ADDR HTTP_ADDR GRPC_ADDR [control TOKEN]

With `control`, the admin listener is asked with the admin token TOKEN.

The server must serve `typed` (the default), `classifier` and `slow` from a repository that
also holds `reranker` (not loaded), and have answered nothing yet. The calls are those of
Triton's own client examples and QA tests with one URL (simple_http_*/simple_grpc_* examples'
get_inference_statistics and get_model_repository_index; qa/L0_http and qa/L0_grpc's
statistics checks):
  - after 3 `typed` requests, tritonclient.http's get_inference_statistics() on the main port
    equals the admin listener's, every model and one; a model's statistics count the 3 and their rows;
  - tritonclient.grpc's (protobuf) carry the same counts, field for field;
  - the repository index, over HTTP and gRPC, equals the admin listener's (ready=True too);
  - an unknown model or version is refused naming it, over both;
  - shared memory, over both, before any region: unregistering succeeds, a named region's
    status is not found, a key that does not exist and CUDA memory are refused with the reason,
    every status empty (triton_shm_check.py registers and infers);
  - without `control`: load and unload are refused (403 / UNAVAILABLE, in Triton's words) naming
    admin.model_control_on_main_port; with it (the server has that switch on), the model
    control examples' calls (simple_http_model_control.py, simple_grpc_model_control.py):
    load `reranker` over HTTP, unload `classifier` over gRPC, each seen at once in
    readiness and the index; a load with a Triton configuration sets `typed`'s max_batch_size
    until a load without one; refusals that name the problem, as on the admin listener.
Prints `main port: all checks passed` and exits 0, or the failed check and exits 1.
"""

import json
import sys
import traceback
import urllib.request
from pathlib import Path

import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_repository_check import CheckFailed, refused, require, typed_inputs  # noqa: E402


ADMIN_HEADERS = {}


def admin_get(admin, path):
    req = urllib.request.Request(f"http://{admin}{path}", headers=ADMIN_HEADERS)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def admin_index(admin, ready):
    body = json.dumps({"ready": ready}).encode()
    req = urllib.request.Request(f"http://{admin}/v2/repository/index", data=body, method="POST",
                                 headers=ADMIN_HEADERS)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def counts(stats):
    """What a statistics answer counts, per model, from Triton's JSON."""
    out = {}
    for m in stats["model_stats"]:
        i = m["inference_stats"]
        out[m["name"]] = (m["version"], int(m["inference_count"]), int(m["execution_count"]),
                          int(i["success"]["count"]), int(i["fail"]["count"]), int(i["success"]["ns"]))
    return out


def grpc_counts(stats):
    """The same from tritonclient.grpc's protobuf answer."""
    return {m.name: (m.version, m.inference_count, m.execution_count, m.inference_stats.success.count,
                     m.inference_stats.fail.count, m.inference_stats.success.ns)
            for m in stats.model_stats}


def main(admin, http_addr, grpc_addr):
    http = httpclient.InferenceServerClient(http_addr)
    grpc = grpcclient.InferenceServerClient(grpc_addr)
    for _ in range(3):
        http.infer("typed", typed_inputs())

    # Statistics: the main port's equal the admin listener's, with no traffic in between.
    every = http.get_inference_statistics()
    require(every == admin_get(admin, "/v2/models/stats"), f"HTTP statistics differ: {every}")
    names = sorted(counts(every))
    require(names == ["classifier", "slow", "typed"], f"models: {names}")
    typed = http.get_inference_statistics("typed")
    require(typed == admin_get(admin, "/v2/models/typed/stats"), f"typed: {typed}")
    version, rows, calls, ok, failed, ns = counts(typed)["typed"]
    per_request = typed_inputs()[0].shape()[0]  # rows in each request
    require((rows, ok, failed) == (3 * per_request, 3, 0) and calls >= 1 and ns > 0, f"typed: {counts(typed)}")
    require(http.get_inference_statistics("typed", version) == typed, "the versioned route differs")

    # The same counts over gRPC, in Triton's protobuf messages.
    require(grpc_counts(grpc.get_inference_statistics()) == counts(every), "gRPC statistics differ")
    one = grpc.get_inference_statistics("typed", version)
    require(grpc_counts(one) == counts(typed), f"gRPC typed: {one}")
    as_json = grpc.get_inference_statistics("typed", as_json=True)
    require(int(as_json["model_stats"][0]["inference_count"]) == rows, f"gRPC as JSON: {as_json}")

    # The repository index, over both, as the admin listener gives it.
    want = admin_index(admin, False)
    got = http.get_model_repository_index()
    require(got == want, f"HTTP index: {got} != {want}")
    index = grpc.get_model_repository_index()
    rows = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models]
    require(rows == want, f"gRPC index: {rows} != {want}")
    states = {m["name"]: m["state"] for m in admin_index(admin, False)}
    require(states == {"typed": "READY", "classifier": "READY", "slow": "READY", "reranker": "UNAVAILABLE"},
            f"index states: {states}")
    # ready=True (tritonclient sends no body; Triton's HTTP API takes {"ready": true}).
    req = urllib.request.Request(f"http://{http_addr}/v2/repository/index", data=b'{"ready": true}', method="POST")
    ready = json.loads(urllib.request.urlopen(req, timeout=30).read())
    require(ready == admin_index(admin, True), f"ready only: {ready}")
    require([m["name"] for m in ready] == ["typed", "classifier", "slow"], f"ready only: {ready}")

    # Refusals name the model (or the version).
    refused(lambda: http.get_inference_statistics("nosuch"), "unknown model: 'nosuch'")
    refused(lambda: http.get_inference_statistics("typed", "77"), "no version '77'")
    refused(lambda: grpc.get_inference_statistics("nosuch"), "unknown model: 'nosuch'")


def shared_memory(http, grpc):
    """Triton's shared-memory extensions, the calls the shm examples and
    qa/L0_http/python_http_aio_test.py, qa/L0_grpc/python_grpc_aio_test.py make before their
    own regions (tests/clients/triton_shm_check.py registers and infers): statuses, unregister
    all, a region that does not exist, CUDA memory refused."""
    for client in (http, grpc):
        # Nothing to drop: success, as Triton's for a region it does not hold.
        client.unregister_system_shared_memory()
        client.unregister_system_shared_memory("output_data")
        client.unregister_cuda_shared_memory()
        refused(lambda: client.get_system_shared_memory_status("input_data"),
                "Unable to find system shared memory region: 'input_data'")
        refused(lambda: client.get_cuda_shared_memory_status("input_data"),
                "Unable to find cuda shared memory region: 'input_data'")
        refused(lambda: client.register_system_shared_memory("input_data", "/inferd-no-such-key", 64),
                "Unable to open shared memory region: '/inferd-no-such-key'")
        refused(lambda: client.register_cuda_shared_memory("input_data", b"\0" * 64, 0, 64),
                "cannot register cuda shared memory region 'input_data'", "inferd runs on CPUs")
    require(http.get_system_shared_memory_status() == [], "HTTP system status is not []")
    require(http.get_cuda_shared_memory_status() == [], "HTTP CUDA status is not []")
    require(len(grpc.get_system_shared_memory_status().regions) == 0, "gRPC system status lists regions")
    require(len(grpc.get_cuda_shared_memory_status().regions) == 0, "gRPC CUDA status lists regions")


def without_control(http, grpc):
    # Triton's words for it (its aio QA tests match them, and gRPC's UNAVAILABLE), then why.
    triton = "explicit model load / unload is not allowed if polling is enabled"
    refused(lambda: http.load_model("reranker"), triton, "admin.model_control_on_main_port", status="403")
    refused(lambda: grpc.unload_model("classifier"), triton, "admin.model_control_on_main_port",
            status="StatusCode.UNAVAILABLE")
    require(not http.is_model_ready("reranker"), "reranker loaded all the same")


def with_control(http, grpc, http_addr):
    require(not http.is_model_ready("reranker"), "reranker is ready before its load")
    http.load_model("reranker")
    require(http.is_model_ready("reranker") and grpc.is_model_ready("reranker"), "reranker not ready after its load")
    states = {m["name"]: m["state"] for m in http.get_model_repository_index()}
    require(states["reranker"] == "READY", f"index after the load: {states}")
    grpc.unload_model("classifier")
    require(not http.is_model_ready("classifier"), "classifier still ready after its unload")
    # Triton's simple_grpc_model_control asks gRPC after an unload: False, not an error.
    require(grpc.is_model_ready("classifier") is False, "gRPC: classifier still ready after its unload")
    states = {m.name: m.state for m in grpc.get_model_repository_index().models}
    require(states["classifier"] == "UNAVAILABLE", f"index after the unload: {states}")
    refused(lambda: http.unload_model("typed"), "default model")
    refused(lambda: grpc.load_model("no_such_model"), "no_such_model", "no folder")
    # Triton's simple_*_model_control: a load's configuration sets max_batch_size until the next
    # load; what inferd does not apply is named, and the malformed is refused.
    before = http.get_model_config("typed")["max_batch_size"]
    http.load_model("typed", config='{"max_batch_size":"3"}')
    config = http.get_model_config("typed")
    require(config["max_batch_size"] == 3, f"HTTP: max_batch_size after a load with config, {before} before: {config}")
    require(grpc.get_model_config("typed").config.max_batch_size == 3, "gRPC: max_batch_size after a load with config")
    answer = http.infer("typed", typed_inputs())
    require(answer.as_numpy("f32_out") is not None, "typed after a load with config")
    grpc.load_model("typed")
    after = http.get_model_config("typed")["max_batch_size"]
    require(after == before, f"max_batch_size {after} after a load without config, {before} before")
    instances = '{"instance_group": [{"count": 2}]}'
    refused(lambda: grpc.load_model("slow", config=instances), "failed to load 'slow'", "not 'instance_group'")
    refused(lambda: http.load_model("slow", config='{"max_batch_size": }'), "failed to load 'slow'", "parameters.config")
    # A load whose body is past server.max_body_bytes (the test's 1 MiB), as Triton's L0_http
    # test_loading_large_invalid_model sends one with `requests` (which reads an answer given
    # before its body is all sent): 400, in Triton's words, and nothing loaded.
    big = {"parameters": {"config": "{}", "file:1/model.onnx": "A" * (2 << 20)}}
    answer = requests.post(f"http://{http_addr}/v2/repository/models/typed/load", json=big, timeout=60)
    said = answer.json().get("error", "")
    require(answer.status_code == 400 and "request JSON size of " in said, f"a load past the body limit: {answer.status_code} {said}")
    require(" exceeds the maximum allowed input size of 1048576" in said, said)


if __name__ == "__main__":
    try:
        if sys.argv[4:5] == ["control"]:
            ADMIN_HEADERS["Authorization"] = f"Bearer {sys.argv[5]}"
        main(*sys.argv[1:4])
        http, grpc = httpclient.InferenceServerClient(sys.argv[2]), grpcclient.InferenceServerClient(sys.argv[3])
        with_control(http, grpc, sys.argv[2]) if sys.argv[4:5] == ["control"] else without_control(http, grpc)
        shared_memory(http, grpc)
    except (CheckFailed, InferenceServerException, AssertionError) as e:
        traceback.print_exc()
        print(f"main port check failed: {e}")
        sys.exit(1)
    print("main port: all checks passed")
