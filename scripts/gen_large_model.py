#!/usr/bin/env python3
"""Writes a model over 2 GB (ONNX's protobuf limit) as exporters write one: the graph in
model.onnx, every weight in model.onnx_data beside it (external data), for bench/large_model.sh.

    .venv/bin/python scripts/gen_large_model.py OUT_DIR [--layers 8] [--width 8192]

x FLOAT ["batch", W] -> LAYERS x (MatMul W x W, Add bias) -> y FLOAT ["batch", W]; the weights
are seeded N(0, 1 / W) so values stay near 1 through the chain. 8 layers of 8192 are 2^31 bytes
of matrices plus the biases: 2.15 GB. Also writes expected.json, y for a fixed x computed by
numpy, and model.toml (task = "raw").
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


def external(name, array, data, offset):
    """A TensorProto that points at `array`'s bytes, written to `data` at `offset`."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape)
    tensor.data_location = TensorProto.EXTERNAL
    raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    for key, value in (("location", "model.onnx_data"), ("offset", str(offset)), ("length", str(len(raw)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    data.write(raw)
    return tensor, offset + len(raw)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=8192)
    args = parser.parse_args()
    width = args.width
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, width), dtype=np.float32)
    y = x.copy()
    initializers, nodes, offset = [], [], 0
    value = "x"
    with open(args.out / "model.onnx_data", "wb") as data:
        for i in range(args.layers):
            w = (rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width)).astype(np.float32)
            b = np.full(width, 0.01 * (i + 1), np.float32)
            y = y @ w + b
            t, offset = external(f"w{i}", w, data, offset)
            initializers.append(t)
            t, offset = external(f"b{i}", b, data, offset)
            initializers.append(t)
            out = "y" if i == args.layers - 1 else f"h{i}"
            nodes.append(helper.make_node("MatMul", [value, f"w{i}"], [f"m{i}"], name=f"matmul{i}"))
            nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [out], name=f"add{i}"))
            value = out
            del w
    graph = helper.make_graph(
        nodes,
        "large",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="inferd-large")
    model.ir_version = 8
    onnx.save_model(model, args.out / "model.onnx")
    onnx.checker.check_model(str(args.out / "model.onnx"))
    (args.out / "model.toml").write_text('name = "large"\ntask = "raw"\n[warmup]\nbatch_sizes = [1]\n')
    (args.out / "expected.json").write_text(json.dumps({"x": x[0].tolist(), "y": y[0].tolist()}))
    print(f"{args.out}: model.onnx_data {offset / 1e9:.2f} GB ({offset} bytes), {args.layers} layers of {width}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
