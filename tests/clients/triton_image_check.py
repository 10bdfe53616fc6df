#!/usr/bin/env python3
"""Triton's image clients against an image classification model on a running inferd, over
HTTP and gRPC: the calls and checks of triton-inference-server/client's
src/python/examples/image_client.py and grpc_image_client.py (its parse_model, preprocess and
postprocess), written here.

    .venv/bin/python tests/clients/triton_image_check.py HTTP_ADDR GRPC_ADDR

The server serves `cnn` (scripts/gen_test_models.py: 32x32 RGB, NCHW, four labels) and the
text classifier `classifier`. Each protocol:
  - the metadata has one input and one FP32 output; the configuration's one input has the
    format FORMAT_NCHW and dims [3, 32, 32], and max_batch_size > 0 (parse_model's checks);
  - two PIL images, preprocessed as image_client does (RGB, bilinear resize, CHW, FP32),
    inferred with `class_count` 1 and 3: each row's classes are `value:index:label`, largest
    first, equal to the top values of the model's own logits for the same tensor (values
    written with six decimals, as Triton writes them);
  - classes of a BYTES output are refused naming why (classes into shared memory, which
    tritonclient itself refuses to send, are refused by the server: worker/src/kserve/json.rs).
Prints `image: all checks passed` and exits 0, or prints the failed check and exits 1.
"""

import sys
import traceback
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_repository_check import CheckFailed, refused, require  # noqa: E402

LABELS = ["red", "green", "blue", "gray"]


def layout(module, client):
    """image_client.parse_model's reading: (max_batch_size, input, output, c, h, w, format)."""
    if module is grpcclient:
        metadata = client.get_model_metadata("cnn")
        config = client.get_model_config("cnn").config
        inputs, outputs = metadata.inputs, metadata.outputs
        datatype = outputs[0].datatype
        shape, name, out = list(inputs[0].shape), inputs[0].name, outputs[0].name
        fmt, max_batch, config_inputs = config.input[0].format, config.max_batch_size, len(config.input)
        dims = list(config.input[0].dims)
    else:
        metadata = client.get_model_metadata("cnn")
        config = client.get_model_config("cnn")
        inputs, outputs = metadata["inputs"], metadata["outputs"]
        datatype = outputs[0]["datatype"]
        shape, name, out = inputs[0]["shape"], inputs[0]["name"], outputs[0]["name"]
        fmt = dict(mc.ModelInput.Format.items())[config["input"][0]["format"]]
        max_batch, config_inputs = config["max_batch_size"], len(config["input"])
        dims = config["input"][0]["dims"]
    require(len(inputs) == 1 and len(outputs) == 1, f"metadata: {len(inputs)} inputs, {len(outputs)} outputs")
    require(config_inputs == 1, f"config: {config_inputs} inputs")
    require(datatype == "FP32", f"output datatype {datatype}")
    require(max_batch > 0, f"max_batch_size {max_batch}")
    require(len(shape) == 4, f"input shape {shape}")
    require(fmt == mc.ModelInput.FORMAT_NCHW, f"format {mc.ModelInput.Format.Name(fmt)}")
    require(list(dims) == [3, 32, 32], f"config dims {dims}")
    return name, out, shape[1], shape[2], shape[3]


def images(c, h, w):
    """image_client.preprocess (scaling NONE) of two images."""
    batch = []
    for color in [(250, 10, 10), (20, 30, 240)]:
        img = Image.new("RGB", (64, 48), color)
        img.paste((120, 120, 120), (0, 0, 20, 20))
        resized = np.array(img.convert("RGB").resize((w, h), Image.BILINEAR)).astype(np.float32) / 255.0
        batch.append(np.transpose(resized, (2, 0, 1)))
    return np.stack(batch)


def expected(logits, k):
    rows = []
    for row in logits:
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        rows.append([f"{row[i]:.6f}:{i}:{LABELS[i]}" for i in order])
    return rows


def run(module, addr):
    client = module.InferenceServerClient(addr)
    name, out, c, h, w = layout(module, client)
    batch = images(c, h, w)
    tensor = module.InferInput(name, list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    logits = client.infer("cnn", [tensor]).as_numpy(out)
    require(logits.shape == (2, len(LABELS)), f"logits {logits.shape}")
    for k in (1, 3):
        result = client.infer("cnn", [tensor], outputs=[module.InferRequestedOutput(out, class_count=k)])
        classes = result.as_numpy(out)
        require(classes.shape == (2, k), f"class_count {k}: shape {classes.shape}")
        # postprocess's own reading of each class.
        got = [["".join(chr(x) for x in c) if isinstance(c, bytes) else c for c in row] for row in classes]
        require(all(len(c.split(":")) == 3 for row in got for c in row), f"classes {got}")
        require(got == expected(logits, k), f"class_count {k}: {got} != {expected(logits, k)}")
    # What cannot be classes is refused.
    text = module.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a fine day"], dtype=np.object_))
    refused(lambda: client.infer("classifier", [text], outputs=[module.InferRequestedOutput("label", class_count=1)]),
            "class result not available for output 'label' due to unsupported type 'BYTES'")


if __name__ == "__main__":
    try:
        run(httpclient, sys.argv[1])
        run(grpcclient, sys.argv[2])
    except (CheckFailed, InferenceServerException, AssertionError) as e:
        traceback.print_exc()
        print(f"image check failed: {e}")
        sys.exit(1)
    print("image: all checks passed")
