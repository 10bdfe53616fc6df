#!/usr/bin/env python3
"""Optional inputs as Triton's own client sees them (server qa/L0_input_validation,
`test_input_validation_optional*`, written here for inferd's `echo`: tests/fixtures/
prompt_echo.onnx with `optional_inputs = ["input_ids"]`).

    .venv/bin/python tests/clients/triton_optional_check.py 127.0.0.1:8123

tritonclient.http: the model's configuration marks `input_ids` optional; a request with only
the required inputs is answered with the initializer's sum (7), one with `input_ids` with its
own; one with no input is refused in Triton's words. Prints `optional ok` and exits 0.
"""

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def inputs(with_ids):
    prompt = httpclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([["hello"]], dtype=object))
    stream = httpclient.InferInput("STREAM", [1, 1], "BOOL")
    stream.set_data_from_numpy(np.array([[False]]))
    given = [prompt, stream]
    if with_ids:
        ids = httpclient.InferInput("input_ids", [1, 2], "INT32")
        ids.set_data_from_numpy(np.array([[100, 200]], dtype=np.int32))
        given.append(ids)
    return given


def main(url):
    client = httpclient.InferenceServerClient(url)
    config = client.get_model_config("echo")
    marked = {i["name"]: i.get("optional", False) for i in config["input"]}
    assert marked == {"PROMPT": False, "STREAM": False, "input_ids": True}, config
    for with_ids, want in [(False, 7), (True, 300)]:
        answer = client.infer("echo", inputs(with_ids))
        assert answer.as_numpy("TEXT").tolist() == [[b"hello"]], answer.get_response()
        assert answer.as_numpy("IDS").tolist() == [[want]], answer.get_response()
    try:
        client.infer("echo", [])
    except InferenceServerException as e:
        said = str(e)
        assert "expected number of inputs between 2 and 3 but got 0 inputs for model 'echo'" in said, said
    else:
        raise AssertionError("a request without its required inputs was answered")
    print("optional ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
