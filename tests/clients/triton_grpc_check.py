#!/usr/bin/env python3
"""Checks a running inferd's gRPC port with NVIDIA's own KServe v2 gRPC client,
tritonclient.grpc, and with the raw stub generated from the protocol (for typed contents,
which tritonclient itself never sends).

    .venv/bin/python tests/clients/triton_grpc_check.py GRPC_ADDR HTTP_ADDR
    .venv/bin/python tests/clients/triton_grpc_check.py --load SECONDS GRPC_ADDR HTTP_ADDR

The server must serve the test models `typed` (the default), `classifier` and `slow`
(scripts/gen_test_models.py) and the default model `minilm`, with max_body_bytes = 65536 and
one worker busy for a while with `slow` before the deadline check gives up on it.

Checks, each against what the REST port or the Python onnxruntime references say:
  - health and metadata; an unknown model is NOT_FOUND and named;
  - `typed`, raw contents (tritonclient's way), every datatype, all outputs and one;
  - `minilm` through its text pipeline: BYTES in raw contents (tritonclient) and in typed
    bytes_contents (the stub), the embeddings equal to tests/fixtures/minilm_embed_reference.json
    and to HTTP /v2/models/minilm/embed within 1e-5; every answer in raw_output_contents,
    as Triton answers, whatever the request used;
  - `classifier`: BYTES labels out, probabilities against tests/fixtures/classifier_reference.json;
  - mistakes are INVALID_ARGUMENT naming the input; a message over the size limit is refused;
    a request queued past its gRPC deadline ends DEADLINE_EXCEEDED; the server then still
    answers;
  - ModelStreamInfer, which inferd does not serve, is UNIMPLEMENTED while the stream is open.

--load SECONDS instead runs 4 client threads of ModelInfer on `typed` for that long and prints
`load: N requests, F failed` (the Rust test reloads the pool meanwhile and wants F = 0).
Prints `grpc: all checks passed` and exits 0, or prints each failed check and exits 1.
"""

import json
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tritonclient_check import INPUTS, expected_outputs  # noqa: E402 (the same typed cases as over REST)

ROOT = Path(__file__).resolve().parents[2]
MINILM = json.loads((ROOT / "tests/fixtures/minilm_embed_reference.json").read_text())
CLASSIFIER = json.loads((ROOT / "tests/fixtures/classifier_reference.json").read_text())
UNKNOWN = "no_such_model_4f2a"


class CheckFailed(Exception):
    pass


def require(cond, what):
    if not cond:
        raise CheckFailed(what)


def typed_inputs():
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        inp = grpcclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data)
        inputs.append(inp)
    return inputs


def text_input(texts):
    inp = grpcclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return inp


def refused(call, code, *words):
    """`call` raises an error of status `code` whose message holds each of `words`."""
    try:
        call()
    except InferenceServerException as e:
        status, message = e.status(), e.message() or ""
    except grpc.RpcError as e:
        status, message = f"StatusCode.{e.code().name}", e.details() or ""
    else:
        raise CheckFailed(f"no error; expected {code}")
    require(status == f"StatusCode.{code}", f"status {status} ({message!r}), expected {code}")
    for word in words:
        require(word in message, f"{code} message {message!r} does not say {word!r}")


def http_embed(http_addr, texts):
    body = json.dumps({"inputs": texts}).encode()
    request = urllib.request.Request(f"http://{http_addr}/v2/models/minilm/embed", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return np.array(json.loads(r.read()), dtype=np.float32)


def check_health(client, stub, http_addr):
    require(client.is_server_live(), "is_server_live() is False")
    require(client.is_server_ready(), "is_server_ready() is False")
    require(client.is_model_ready("typed"), "is_model_ready('typed') is False")
    require(client.is_model_ready("typed", "1"), "is_model_ready('typed', '1') is False")
    # A model not served is not ready: an answer, not an error (Triton's ModelReady).
    require(client.is_model_ready(UNKNOWN) is False, "is_model_ready(UNKNOWN) is not False")
    require(client.is_model_ready("typed", "7") is False, "is_model_ready('typed', '7') is not False")


def check_metadata(client, stub, http_addr):
    meta = client.get_server_metadata()
    require(meta.name == "inferd" and meta.version, f"server metadata {meta}")
    meta = client.get_model_metadata("typed")
    require(meta.name == "typed" and list(meta.versions) == ["1"], f"model metadata {meta}")
    require(meta.platform == "onnxruntime_onnx", f"platform {meta.platform!r}")
    inputs = {i.name: (i.datatype, list(i.shape)) for i in meta.inputs}
    require(inputs == {n: (d, [-1, 4]) for n, (d, _) in INPUTS.items()}, f"inputs {inputs}")
    outputs = {o.name: o.datatype for o in meta.outputs}
    require(outputs == {n: d for n, (d, _) in expected_outputs().items()}, f"outputs {outputs}")
    # A pipelined model shows what a client sends it: one BYTES input, the pipeline's outputs.
    meta = client.get_model_metadata("minilm")
    require([(i.name, i.datatype) for i in meta.inputs] == [("text", "BYTES")], f"minilm inputs {meta.inputs}")
    require([(o.name, o.datatype) for o in meta.outputs] == [("embedding", "FP32")], f"minilm outputs {meta.outputs}")
    refused(lambda: client.get_model_metadata(UNKNOWN), "NOT_FOUND", UNKNOWN)


def compare(got, want, what):
    require(got is not None, f"{what}: missing")
    require(got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape}, expected {want.dtype}{want.shape}")
    if np.issubdtype(want.dtype, np.floating):
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6, atol=0)
    else:
        ok = np.array_equal(got, want)
    require(ok, f"{what}: got {got.tolist()}, expected {want.tolist()}")


def check_typed_raw(client, stub, http_addr):
    want = expected_outputs()
    result = client.infer("typed", typed_inputs(), request_id="grpc-check-7")
    response = result.get_response()
    require(response.id == "grpc-check-7", f"id {response.id!r}")
    require(response.model_name == "typed" and response.model_version == "1", f"{response.model_name} {response.model_version}")
    require(len(response.raw_output_contents) == len(want), "raw request, but the outputs are not raw")
    for name, (datatype, array) in want.items():
        require(result.get_output(name).datatype == datatype, f"{name}: datatype {result.get_output(name).datatype}")
        compare(result.as_numpy(name), array, name)
    result = client.infer("typed", typed_inputs(), outputs=[grpcclient.InferRequestedOutput("f32_sum")])
    require([o.name for o in result.get_response().outputs] == ["f32_sum"], "asked for f32_sum only")
    compare(result.as_numpy("f32_sum"), want["f32_sum"][1], "f32_sum")


def minilm_cases():
    cases = [c for c in MINILM["cases"] if not c["truncated"]]
    return [c["text"] for c in cases], np.array([c["embedding"] for c in cases], dtype=np.float32)


def check_text_raw(client, stub, http_addr):
    texts, reference = minilm_cases()
    result = client.infer("minilm", [text_input(texts)])
    got = result.as_numpy("embedding")
    require(got.shape == reference.shape, f"embedding shape {got.shape}, expected {reference.shape}")
    require(np.allclose(got, reference, atol=1e-5), f"embeddings differ from the reference by {np.abs(got - reference).max()}")
    rest = http_embed(http_addr, texts)
    require(np.allclose(got, rest, atol=1e-5), f"embeddings differ from /embed by {np.abs(got - rest).max()}")


def check_text_typed(client, stub, http_addr):
    texts, reference = minilm_cases()
    request = service_pb2.ModelInferRequest(model_name="minilm", id="typed-1")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    tensor.contents.bytes_contents.extend(t.encode() for t in texts)
    request.parameters["truncate"].bool_param = True
    response = stub.ModelInfer(request, timeout=30)
    require(response.id == "typed-1", f"id {response.id!r}")
    # Answered raw whatever the request used, as Triton answers.
    require(len(response.raw_output_contents) == 1, "typed request: the outputs are not in raw_output_contents")
    out = response.outputs[0]
    require(out.name == "embedding" and out.datatype == "FP32", f"output {out.name} {out.datatype}")
    got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(list(out.shape))
    require(np.allclose(got, reference, atol=1e-5), f"typed embeddings differ from the reference by {np.abs(got - reference).max()}")


def check_classifier(client, stub, http_addr):
    cases = CLASSIFIER["cases"][:3]
    inp = text_input([c["text"] for c in cases])
    result = client.infer("classifier", [inp], outputs=[grpcclient.InferRequestedOutput(n) for n in ("label", "probabilities")])
    labels = [x.decode() for x in result.as_numpy("label")]
    want = [c["ranking"][0] for c in cases]
    require(labels == want, f"labels {labels}, expected {want}")
    probabilities = result.as_numpy("probabilities")
    reference = np.array([c["probabilities"] for c in cases], dtype=np.float32)
    require(np.allclose(probabilities, reference, atol=1e-4), f"probabilities {probabilities.tolist()} vs {reference.tolist()}")


def check_mistakes(client, stub, http_addr):
    inputs = typed_inputs()
    wrong = grpcclient.InferInput("f32_in", [2, 4], "FP64")
    wrong.set_data_from_numpy(np.zeros((2, 4), np.float64))
    refused(lambda: client.infer("typed", [wrong] + inputs[1:]), "INVALID_ARGUMENT", "f32_in", "expected FP32")
    refused(lambda: client.infer("typed", inputs[1:]), "INVALID_ARGUMENT", "missing required input(s) ['f32_in']")
    refused(lambda: client.infer(UNKNOWN, inputs), "NOT_FOUND", UNKNOWN)
    refused(
        lambda: client.infer("typed", inputs, outputs=[grpcclient.InferRequestedOutput("nope")]),
        "INVALID_ARGUMENT",
        "unknown output 'nope'",
    )
    # Typed FP16 does not exist in the protocol; raw bytes that do not fit the shape.
    request = service_pb2.ModelInferRequest(model_name="typed")
    request.inputs.add(name="f16_in", datatype="FP16", shape=[1, 4]).contents.int_contents.extend([1, 2, 3, 4])
    refused(lambda: stub.ModelInfer(request, timeout=30), "INVALID_ARGUMENT", "f16_in", "raw_input_contents")
    request = service_pb2.ModelInferRequest(model_name="typed")
    request.inputs.add(name="f32_in", datatype="FP32", shape=[2, 4])
    request.raw_input_contents.append(b"\0" * 12)
    refused(lambda: stub.ModelInfer(request, timeout=30), "INVALID_ARGUMENT", "f32_in", "12 bytes")
    request = service_pb2.ModelInferRequest(model_name="minilm")
    request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"\xff\xfe")
    refused(lambda: stub.ModelInfer(request, timeout=30), "INVALID_ARGUMENT", "UTF-8")
    # Over max_body_bytes (65536 in the test's config): refused before it is decoded.
    big = grpcclient.InferInput("f32_in", [5000, 4], "FP32")
    big.set_data_from_numpy(np.zeros((5000, 4), np.float32))
    refused(lambda: client.infer("typed", [big] + inputs[1:]), "RESOURCE_EXHAUSTED", "65536", "server.max_body_bytes")


def check_compressed(client, stub, http_addr):
    # tritonclient's compression_algorithm: the message gzip- or deflate-compressed, answered
    # as the plain one is; 200 rows (about 21 kB), so that it is compressed for sure. The
    # answer (about 12 kB) comes compressed the same way (grpcio inflates it; the frames
    # themselves are checked in tests/grpc.rs).
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        rows = np.tile(data, (100, 1))
        inputs.append(grpcclient.InferInput(name, list(rows.shape), datatype))
        inputs[-1].set_data_from_numpy(rows)
    plain = client.infer("typed", inputs)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("typed", inputs, compression_algorithm=algorithm)
        for output in plain.get_response().outputs:
            compare(result.as_numpy(output.name), plain.as_numpy(output.name), f"{algorithm}: {output.name}")
    # 800 kB of zeros compress to about 1 kB: inflating stops at max_body_bytes (65536).
    big = grpcclient.InferInput("f32_in", [50000, 4], "FP32")
    big.set_data_from_numpy(np.zeros((50000, 4), np.float32))
    refused(
        lambda: client.infer("typed", [big] + typed_inputs()[1:], compression_algorithm="gzip"),
        "RESOURCE_EXHAUSTED",
        "inflates to more than the limit of 65536 bytes",
    )


def slow_inputs(iterations):
    x = grpcclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.linspace(0, 1, 256, dtype=np.float32).reshape(1, 256))
    n = grpcclient.InferInput("iterations", [1], "INT64")
    n.set_data_from_numpy(np.array([iterations], np.int64))
    return [x, n]


def check_deadline(client, stub, http_addr):
    # Keep the model threads busy (one long run per worker), then queue one with 0.3 s to live.
    busy = [threading.Thread(target=lambda: client.infer("slow", slow_inputs(400_000), client_timeout=60)) for _ in range(2)]
    for t in busy:
        t.start()
    time.sleep(0.3)
    refused(lambda: client.infer("slow", slow_inputs(1), client_timeout=0.3), "DEADLINE_EXCEEDED")
    for t in busy:
        t.join()
    result = client.infer("typed", typed_inputs(), outputs=[grpcclient.InferRequestedOutput("f32_sum")])
    compare(result.as_numpy("f32_sum"), expected_outputs()["f32_sum"][1], "f32_sum after the deadline")


def check_stream_unimplemented(client, stub, http_addr):
    """A streaming call inferd does not serve is answered UNIMPLEMENTED at once, while the
    client keeps its side of the stream open (as tritonclient's start_stream does), not when
    its deadline passes."""
    errors = []
    got = threading.Event()

    def callback(result, error):
        errors.append(error)
        got.set()

    started = time.monotonic()
    client.start_stream(callback, stream_timeout=30)
    try:
        # The answer needs no message: it may come before any is sent, and the stream is over.
        if not got.wait(2):
            inp = grpcclient.InferInput("f32_in", [1, 4], "FP32")
            inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
            client.async_stream_infer("typed", [inp])
        require(got.wait(10), "no answer to ModelStreamInfer within 10 s of an open stream")
    finally:
        client.stop_stream(cancel_requests=True)
    took = time.monotonic() - started
    error = errors[0]
    require(error is not None and error.status() == "StatusCode.UNIMPLEMENTED", f"stream answered {error}")
    require("ModelStreamInfer" in error.message(), f"stream error {error.message()!r}")
    print(f"      ModelStreamInfer: UNIMPLEMENTED after {took:.2f} s")


CHECKS = [check_health, check_metadata, check_typed_raw, check_text_raw, check_text_typed, check_classifier, check_mistakes, check_compressed, check_deadline, check_stream_unimplemented]


def load(grpc_addr, seconds):
    counts = {"ok": 0, "failed": 0}
    errors = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client_loop():
        client = grpcclient.InferenceServerClient(grpc_addr)
        want = expected_outputs()["f32_sum"][1]
        while time.monotonic() < stop:
            try:
                got = client.infer("typed", typed_inputs(), outputs=[grpcclient.InferRequestedOutput("f32_sum")], client_timeout=30).as_numpy("f32_sum")
                ok = np.allclose(got, want)
            except Exception as e:  # every failure counts, whatever its kind
                ok = False
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            with lock:
                counts["ok" if ok else "failed"] += 1

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"load: {counts['ok'] + counts['failed']} requests, {counts['failed']} failed")
    for e in errors[:5]:
        print(f"  {e}")
    return 0 if counts["ok"] > 0 else 1


def main():
    args = sys.argv[1:]
    if args[:1] == ["--load"]:
        return load(args[2], float(args[1]))
    grpc_addr, http_addr = args
    client = grpcclient.InferenceServerClient(grpc_addr)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_addr))
    failures = 0
    for check in CHECKS:
        try:
            check(client, stub, http_addr)
            print(f"ok    {check.__name__}")
        except Exception:
            failures += 1
            print(f"FAIL  {check.__name__}\n{traceback.format_exc()}")
    if failures:
        print(f"grpc: {failures} of {len(CHECKS)} checks failed")
        return 1
    print("grpc: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
