#!/usr/bin/env python3
"""Checks a running inferd with NVIDIA's own KServe v2 client, tritonclient.http.

    .venv/bin/python tests/clients/tritonclient_check.py 127.0.0.1:8123
    .venv/bin/python tests/clients/tritonclient_check.py --binary 127.0.0.1:8123

The URL is host:port without a scheme, as tritonclient wants it. The server
must serve the `typed` test model (tests/models/typed, made by
scripts/gen_test_models.py). Every tensor goes as JSON (binary_data=False on
all inputs and requested outputs). Prints `tritonclient: all checks passed` and
exits 0, or prints each failed check and exits 1.

--binary checks the binary tensor extension instead, and needs the
`classifier` test model too:
  - `typed`, every input and requested output binary (binary_data=True), all
    six datatypes; then binary inputs with JSON outputs; then binary inputs
    and no `outputs` at all (tritonclient then asks for binary_data_output).
  - `classifier` through its text pipeline: one BYTES input `text` [2] with
    two sentences, asking for `label` (BYTES [2], the top label of each) and
    `probabilities` (FP32 [2, 3]), checked against
    tests/fixtures/classifier_reference.json (labels exactly, probabilities
    within 1e-4): all binary, all JSON, and binary input with JSON outputs.
"""

import json
import sys
import traceback
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

MODEL = "typed"
UNKNOWN_MODEL = "no_such_model_4f2a"
REQUEST_ID = "tritonclient-check-42"
CLASSIFIER = "classifier"
CLASSIFIER_REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "classifier_reference.json"
# Which reference sentences the BYTES checks send (different lengths, so the server pads).
CLASSIFIER_CASES = [0, 2]
PROBABILITY_TOLERANCE = 1e-4

# name -> (KServe datatype, batch-2 data)
INPUTS = {
    "f32_in": ("FP32", np.array([[1.5, -2.0, 0.0, 3.25], [10.0, -0.5, 7.0, 100.0]], np.float32)),
    "f64_in": ("FP64", np.array([[1.0, -3.0, 0.25, 1e10], [2.0, 5.5, -8.0, 0.0]], np.float64)),
    "i32_in": ("INT32", np.array([[0, -7, 100, 2147483640], [1, 2, 3, -2147483648]], np.int32)),
    "i64_in": ("INT64", np.array([[1, -2, 0, 1 << 40], [5, 6, -7, 8]], np.int64)),
    "bool_in": ("BOOL", np.array([[True, False, True, False], [False, False, True, True]], np.bool_)),
    "f16_in": ("FP16", np.array([[0.5, -1.0, 2.0, 1000.0], [3.0, 0.0, -0.25, 7.0]], np.float16)),
}


def expected_outputs():
    d = {name: data for name, (_, data) in INPUTS.items()}
    # name -> (KServe datatype, expected array)
    return {
        "f32_out": ("FP32", d["f32_in"] * np.float32(2) + np.float32(1)),
        "f64_out": ("FP64", d["f64_in"] * 0.5),
        "i32_out": ("INT32", d["i32_in"] + np.int32(7)),
        "i64_out": ("INT64", d["i64_in"] * np.int64(-3)),
        "bool_out": ("BOOL", np.logical_not(d["bool_in"])),
        "f16_out": ("FP16", d["f16_in"] * np.float16(2)),
        "f32_sum": ("FP32", d["f32_in"].sum(axis=1, dtype=np.float32)),
    }


class CheckFailed(Exception):
    pass


def require(cond, what):
    if not cond:
        raise CheckFailed(what)


def make_inputs(binary=False):
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        inp = httpclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data, binary_data=binary)
        inputs.append(inp)
    return inputs


def compare(result, name, datatype, want):
    out = result.get_output(name)
    require(out is not None, f"output {name} missing from the response")
    require(out.get("datatype") == datatype, f"{name}: datatype {out.get('datatype')!r}, expected {datatype!r}")
    require(list(out.get("shape", [])) == list(want.shape), f"{name}: shape {out.get('shape')}, expected {list(want.shape)}")
    require("data" in out, f"{name}: no JSON 'data' (binary_data=False was asked for): {out}")
    compare_values(result, name, want)


def compare_values(result, name, want):
    """The decoded output equals `want`: exactly, or within 1e-6 relative for floats."""
    got = result.as_numpy(name)
    require(got.dtype == want.dtype, f"{name}: numpy dtype {got.dtype}, expected {want.dtype}")
    if np.issubdtype(want.dtype, np.floating):
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6, atol=0)
    else:
        ok = np.array_equal(got, want)
    require(ok, f"{name}: got {got.tolist()}, expected {want.tolist()}")


def check_health(client):
    require(client.is_server_live(), "is_server_live() is False (GET /v2/health/live not 200)")
    require(client.is_server_ready(), "is_server_ready() is False (GET /v2/health/ready not 200)")
    require(client.is_model_ready(MODEL), f"is_model_ready({MODEL!r}) is False")
    require(
        not client.is_model_ready(UNKNOWN_MODEL),
        f"is_model_ready({UNKNOWN_MODEL!r}) is True for a model that does not exist",
    )


def check_server_metadata(client):
    meta = client.get_server_metadata()
    require(isinstance(meta, dict), f"server metadata is not a JSON object: {meta!r}")
    require(isinstance(meta.get("name"), str) and meta["name"], f"server metadata has no name: {meta}")


def check_model_metadata(client):
    meta = client.get_model_metadata(MODEL)
    require(meta.get("name") == MODEL, f"model metadata name {meta.get('name')!r}, expected {MODEL!r}")
    inputs = {i.get("name"): i for i in meta.get("inputs", [])}
    require(set(inputs) == set(INPUTS), f"model metadata inputs {sorted(inputs)}, expected {sorted(INPUTS)}")
    for name, (datatype, _) in INPUTS.items():
        require(inputs[name].get("datatype") == datatype, f"metadata {name}: {inputs[name]}, expected datatype {datatype}")
        require(inputs[name].get("shape") == [-1, 4], f"metadata {name}: {inputs[name]}, expected shape [-1, 4]")
    outputs = {o.get("name"): o for o in meta.get("outputs", [])}
    want = expected_outputs()
    require(set(outputs) == set(want), f"model metadata outputs {sorted(outputs)}, expected {sorted(want)}")
    for name, (datatype, _) in want.items():
        require(outputs[name].get("datatype") == datatype, f"metadata {name}: {outputs[name]}, expected datatype {datatype}")


def check_infer_all(client):
    want = expected_outputs()
    requested = [httpclient.InferRequestedOutput(name, binary_data=False) for name in want]
    result = client.infer(MODEL, make_inputs(), outputs=requested, request_id=REQUEST_ID)
    response = result.get_response()
    require(response.get("id") == REQUEST_ID, f"response id {response.get('id')!r}, expected {REQUEST_ID!r}")
    require(response.get("model_name") == MODEL, f"response model_name {response.get('model_name')!r}, expected {MODEL!r}")
    names = [o.get("name") for o in response.get("outputs", [])]
    require(sorted(names) == sorted(want), f"response outputs {names}, expected {sorted(want)}")
    for name, (datatype, array) in want.items():
        compare(result, name, datatype, array)


def check_infer_one_output(client):
    datatype, want = expected_outputs()["f32_sum"]
    requested = [httpclient.InferRequestedOutput("f32_sum", binary_data=False)]
    result = client.infer(MODEL, make_inputs(), outputs=requested)
    names = [o.get("name") for o in result.get_response().get("outputs", [])]
    require(names == ["f32_sum"], f"asked only for f32_sum, got outputs {names}")
    compare(result, "f32_sum", datatype, want)


def check_unknown_model(client):
    requested = [httpclient.InferRequestedOutput("f32_sum", binary_data=False)]
    try:
        client.infer(UNKNOWN_MODEL, make_inputs(), outputs=requested)
    except InferenceServerException as e:
        msg = e.message() or ""
        require(UNKNOWN_MODEL in msg, f"error for an unknown model does not name it: status {e.status()}, message {msg!r}")
        return
    raise CheckFailed(f"infer on unknown model {UNKNOWN_MODEL!r} did not raise InferenceServerException")


CHECKS = [
    ("health", check_health),
    ("server metadata", check_server_metadata),
    ("model metadata", check_model_metadata),
    ("infer typed, all outputs", check_infer_all),
    ("infer typed, f32_sum only", check_infer_one_output),
    ("infer unknown model", check_unknown_model),
]


# --- --binary: the binary tensor extension -----------------------------------------


def compare_binary(result, name, datatype, want):
    """Like compare(), but the output must have come as binary data of the right size."""
    out = result.get_output(name)
    require(out is not None, f"output {name} missing from the response")
    params = out.get("parameters") or {}
    require("data" not in out, f"{name}: JSON 'data' in the response, binary_data=True was asked for: {out}")
    size = params.get("binary_data_size")
    require(size == want.nbytes, f"{name}: binary_data_size {size!r}, expected {want.nbytes} ({want.dtype} x {want.size})")
    require(out.get("datatype") == datatype, f"{name}: datatype {out.get('datatype')!r}, expected {datatype!r}")
    require(list(out.get("shape", [])) == list(want.shape), f"{name}: shape {out.get('shape')}, expected {list(want.shape)}")
    compare_values(result, name, want)


def check_binary_typed(client):
    want = expected_outputs()
    requested = [httpclient.InferRequestedOutput(name, binary_data=True) for name in want]
    result = client.infer(MODEL, make_inputs(binary=True), outputs=requested, request_id=REQUEST_ID)
    response = result.get_response()
    require(response.get("id") == REQUEST_ID, f"response id {response.get('id')!r}, expected {REQUEST_ID!r}")
    names = [o.get("name") for o in response.get("outputs", [])]
    require(names == list(want), f"response outputs {names}, expected {list(want)} in the order asked")
    for name, (datatype, array) in want.items():
        compare_binary(result, name, datatype, array)


def check_binary_in_json_out_typed(client):
    want = expected_outputs()
    requested = [httpclient.InferRequestedOutput(name, binary_data=False) for name in reversed(list(want))]
    result = client.infer(MODEL, make_inputs(binary=True), outputs=requested)
    names = [o.get("name") for o in result.get_response().get("outputs", [])]
    require(names == list(reversed(list(want))), f"response outputs {names}, expected {list(reversed(list(want)))}")
    for name, (datatype, array) in want.items():
        compare(result, name, datatype, array)


def check_binary_default_outputs(client):
    # No `outputs`: tritonclient sets the request parameter binary_data_output=true,
    # so every output must come back, as binary data.
    want = expected_outputs()
    result = client.infer(MODEL, make_inputs(binary=True))
    names = [o.get("name") for o in result.get_response().get("outputs", [])]
    require(sorted(names) == sorted(want), f"response outputs {names}, expected {sorted(want)}")
    for name, (datatype, array) in want.items():
        compare_binary(result, name, datatype, array)


def classifier_cases():
    doc = json.loads(CLASSIFIER_REFERENCE.read_text(encoding="utf-8"))
    return doc["labels"], [doc["cases"][i] for i in CLASSIFIER_CASES]


def classifier_infer(client, binary_in, binary_out):
    labels, cases = classifier_cases()
    text = np.array([c["text"].encode("utf-8") for c in cases], dtype=np.object_)
    inp = httpclient.InferInput("text", [len(cases)], "BYTES")
    inp.set_data_from_numpy(text, binary_data=binary_in)
    requested = [
        httpclient.InferRequestedOutput("label", binary_data=binary_out),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary_out),
    ]
    result = client.infer(CLASSIFIER, [inp], outputs=requested)
    names = [o.get("name") for o in result.get_response().get("outputs", [])]
    require(names == ["label", "probabilities"], f"response outputs {names}, expected ['label', 'probabilities']")

    for name, datatype, shape in (("label", "BYTES", [len(cases)]), ("probabilities", "FP32", [len(cases), len(labels)])):
        out = result.get_output(name)
        require(out.get("datatype") == datatype, f"{name}: datatype {out.get('datatype')!r}, expected {datatype!r}")
        require(list(out.get("shape", [])) == shape, f"{name}: shape {out.get('shape')}, expected {shape}")
        has_size = "binary_data_size" in (out.get("parameters") or {})
        if binary_out:
            require(has_size and "data" not in out, f"{name}: binary_data=True was asked for, got {out}")
        else:
            require("data" in out and not has_size, f"{name}: binary_data=False was asked for, got {out}")

    got_labels = result.as_numpy("label")
    # Binary BYTES elements come back as bytes, JSON ones as str.
    got_labels = [v.decode("utf-8") if isinstance(v, bytes) else v for v in got_labels.reshape(-1).tolist()]
    want_labels = [c["ranking"][0] for c in cases]
    require(got_labels == want_labels, f"label: got {got_labels}, expected {want_labels}")

    probs = result.as_numpy("probabilities")
    require(probs.dtype == np.float32, f"probabilities: numpy dtype {probs.dtype}, expected float32")
    want_probs = np.array([c["probabilities"] for c in cases], np.float64)
    diff = np.abs(probs.astype(np.float64) - want_probs).max()
    require(diff <= PROBABILITY_TOLERANCE, f"probabilities: got {probs.tolist()}, expected {want_probs.tolist()} (max diff {diff:.2e})")


def check_bytes_binary(client):
    classifier_infer(client, binary_in=True, binary_out=True)


def check_bytes_json(client):
    classifier_infer(client, binary_in=False, binary_out=False)


def check_bytes_binary_in_json_out(client):
    classifier_infer(client, binary_in=True, binary_out=False)


BINARY_CHECKS = [
    ("health", check_health),
    ("infer typed, binary inputs and outputs", check_binary_typed),
    ("infer typed, binary inputs, JSON outputs", check_binary_in_json_out_typed),
    ("infer typed, binary inputs, no outputs asked (binary_data_output)", check_binary_default_outputs),
    ("infer classifier, BYTES text, binary in and out", check_bytes_binary),
    ("infer classifier, BYTES text, JSON in and out", check_bytes_json),
    ("infer classifier, BYTES text, binary in, JSON out", check_bytes_binary_in_json_out),
]


def main(argv):
    args = argv[1:]
    binary = "--binary" in args
    args = [a for a in args if a != "--binary"]
    if len(args) != 1 or "://" in args[0] or args[0].startswith("-"):
        print(f"usage: {argv[0]} [--binary] HOST:PORT   (no scheme, e.g. 127.0.0.1:8123)", file=sys.stderr)
        return 2
    checks = BINARY_CHECKS if binary else CHECKS
    failures = 0
    with httpclient.InferenceServerClient(args[0], connection_timeout=10.0, network_timeout=30.0) as client:
        for label, check in checks:
            try:
                check(client)
            except CheckFailed as e:
                failures += 1
                print(f"tritonclient: FAILED {label}: {e}")
            except Exception as e:  # a transport error or an unexpected exception from the client
                failures += 1
                print(f"tritonclient: FAILED {label}: {type(e).__name__}: {e}")
                traceback.print_exc(file=sys.stdout)
            else:
                print(f"tritonclient: ok {label}")
    if failures:
        print(f"tritonclient: {failures} of {len(checks)} checks failed")
        return 1
    print("tritonclient: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
