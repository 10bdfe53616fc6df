#!/usr/bin/env python3
"""Deadlines on every protocol under load, with NVIDIA's own clients where Triton has one.

    .venv/bin/python tests/clients/deadline_check.py HTTP_ADDR GRPC_ADDR

The server must serve the test model `slow` and `minilm` from one worker of one lane
(`threads = 1`). While one long `slow` run holds that lane, each of these is queued with 50 ms
to live and must come back timed out while the long run still goes on (answered at its
deadline, not when the lane reaches it), in its protocol's shape:
  - KServe over REST, tritonclient.http's `timeout` (parameters.timeout, microseconds): 504;
  - KServe over gRPC, tritonclient.grpc's `timeout` (the same parameter): DEADLINE_EXCEEDED;
  - TEI's /embed with `x-inferd-deadline-ms`: 504;
  - OpenAI's /v1/embeddings with `x-inferd-deadline-ms`: 504.
Then a `timeout` that is not a whole number of microseconds (a word, a negative number, a
fraction) is a 400 / INVALID_ARGUMENT naming it, and one of 60 s is run and answered.
The Rust test reads the run counters: none of the timed-out requests ran.
Prints `deadlines: all checks passed` and exits 0, or raises.
"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

LONG = 1_000_000  # iterations of `slow`: seconds of one lane's time on any of our CPUs
DEADLINE_US = 50_000


def slow_inputs(module, iterations):
    x = module.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy((np.arange(256, dtype=np.float32) / 256).reshape(1, 256))
    n = module.InferInput("iterations", [1], "INT64")
    n.set_data_from_numpy(np.array([iterations], dtype=np.int64))
    return [x, n]


def post(http_addr, path, body, headers=None):
    request = urllib.request.Request(
        f"http://{http_addr}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def timed_out(name, call, expect):
    """`call` must fail with `expect` (an HTTP status or a gRPC code's name); prints its wait."""
    begun = time.monotonic()
    try:
        got = call()
        raise AssertionError(f"{name}: answered {got!r}, not timed out")
    except InferenceServerException as e:
        status, message = str(e.status()), e.message()
    except grpc.RpcError as e:
        status, message = e.code().name, e.details()
    waited = (time.monotonic() - begun) * 1e3
    assert expect in status, f"{name}: {status} {message}"
    assert "deadline" in message, f"{name}: {message}"
    print(f"{name}: {status} after {waited:.0f} ms: {message}")


def http_status(status, text):
    if status != 200:
        raise InferenceServerException(msg=text, status=str(status))
    return status


def main():
    http_addr, grpc_addr = sys.argv[1:3]
    http = httpclient.InferenceServerClient(http_addr)
    grpc_client = grpcclient.InferenceServerClient(grpc_addr)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_addr))

    long_http = httpclient.InferenceServerClient(http_addr, network_timeout=300, connection_timeout=300)
    long = threading.Thread(target=lambda: long_http.infer("slow", slow_inputs(httpclient, LONG)))
    long.start()
    time.sleep(0.5)

    timed_out(
        "REST parameters.timeout",
        lambda: http.infer("slow", slow_inputs(httpclient, 1), timeout=DEADLINE_US),
        "504",
    )
    timed_out(
        "gRPC parameters.timeout",
        lambda: grpc_client.infer("slow", slow_inputs(grpcclient, 1), timeout=DEADLINE_US),
        "DEADLINE_EXCEEDED",
    )
    ms = {"x-inferd-deadline-ms": str(DEADLINE_US // 1000)}
    timed_out(
        "TEI /embed",
        lambda: http_status(*post(http_addr, "/embed", {"inputs": "a short text"}, ms)),
        "504",
    )
    timed_out(
        "OpenAI /v1/embeddings",
        lambda: http_status(*post(http_addr, "/v1/embeddings", {"input": "a short text", "model": "minilm"}, ms)),
        "504",
    )
    assert long.is_alive(), "the long run ended before the timed-out requests were answered"
    long.join()

    x = (np.arange(256, dtype=np.float32) / 256).tolist()
    body = lambda timeout: {  # noqa: E731
        "inputs": [
            {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": x},
            {"name": "iterations", "shape": [1], "datatype": "INT64", "data": [1]},
        ],
        "parameters": {"timeout": timeout},
    }
    for bad in ["soon", -5, 1.5, True]:
        status, text = post(http_addr, "/v2/models/slow/infer", body(bad))
        assert status == 400 and "'timeout'" in text, (bad, status, text)
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.parameters["timeout"].string_param = "soon"
    try:
        stub.ModelInfer(request)
        raise AssertionError("a gRPC timeout of 'soon' was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "'timeout'" in e.details(), e
    result = grpc_client.infer("slow", slow_inputs(grpcclient, 1), timeout=60_000_000)
    assert result.as_numpy("y").shape == (1, 256), result.get_response()
    status, text = post(http_addr, "/v2/models/slow/infer", body(60_000_000))
    assert status == 200, text
    print("deadlines: all checks passed")


if __name__ == "__main__":
    main()
