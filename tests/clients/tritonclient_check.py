#!/usr/bin/env python3
"""Checks a running inferd with NVIDIA's own KServe v2 client, tritonclient.http.

    .venv/bin/python tests/clients/tritonclient_check.py 127.0.0.1:8123

The URL is host:port without a scheme, as tritonclient wants it. The server
must serve the `typed` test model (tests/models/typed, made by
scripts/gen_test_models.py). Every tensor goes as JSON (binary_data=False on
all inputs and requested outputs). Prints `tritonclient: all checks passed` and
exits 0, or prints each failed check and exits 1.
"""

import sys
import traceback

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

MODEL = "typed"
UNKNOWN_MODEL = "no_such_model_4f2a"
REQUEST_ID = "tritonclient-check-42"

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


def make_inputs():
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        inp = httpclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data, binary_data=False)
        inputs.append(inp)
    return inputs


def compare(result, name, datatype, want):
    out = result.get_output(name)
    require(out is not None, f"output {name} missing from the response")
    require(out.get("datatype") == datatype, f"{name}: datatype {out.get('datatype')!r}, expected {datatype!r}")
    require(list(out.get("shape", [])) == list(want.shape), f"{name}: shape {out.get('shape')}, expected {list(want.shape)}")
    require("data" in out, f"{name}: no JSON 'data' (binary_data=False was asked for): {out}")
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


def main(argv):
    if len(argv) != 2 or "://" in argv[1]:
        print(f"usage: {argv[0]} HOST:PORT   (no scheme, e.g. 127.0.0.1:8123)", file=sys.stderr)
        return 2
    failures = 0
    with httpclient.InferenceServerClient(argv[1], connection_timeout=10.0, network_timeout=30.0) as client:
        for label, check in CHECKS:
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
        print(f"tritonclient: {failures} of {len(CHECKS)} checks failed")
        return 1
    print("tritonclient: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
