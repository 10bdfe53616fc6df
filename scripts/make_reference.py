#!/usr/bin/env python3
"""Writes tests/fixtures/minilm_reference.json: what onnxruntime's Python API
computes for two fixed sentences with the default model, so inferd's tests can
compare the server's output with it.

Run after scripts/setup.sh:

    .venv/bin/python scripts/make_reference.py

The inputs are tokenised with models/minilm/tokenizer.json (its own padding and
truncation turned off), padded by hand to the longer sentence with id 0,
attention_mask 1 for tokens and 0 for padding, token_type_ids all 0. The model
runs on the CPU execution provider with one intra-op thread.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "minilm"
OUT = REPO / "tests" / "fixtures" / "minilm_reference.json"

SENTENCES = [
    "inferd serves ONNX models from supervised worker processes.",
    "Hello!",
]
PAD_ID = 0


def tokenise(sentences):
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ids = [tok.encode(s).ids for s in sentences]
    length = max(len(i) for i in ids)
    input_ids = np.full((len(ids), length), PAD_ID, dtype=np.int64)
    attention_mask = np.zeros((len(ids), length), dtype=np.int64)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    token_type_ids = np.zeros((len(ids), length), dtype=np.int64)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
    }


def tensor_json(name, array, datatype):
    if datatype == "FP32":
        # float() of a float32 is exact, and json writes the shortest repr
        # that reads back as the same double (hence the same float32).
        data = [float(v) for v in array.reshape(-1)]
    else:
        data = [int(v) for v in array.reshape(-1)]
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def main():
    for f in ("model.onnx", "tokenizer.json"):
        if not (MODEL_DIR / f).exists():
            sys.exit(f"{MODEL_DIR / f} is missing: run scripts/setup.sh first")

    feeds = tokenise(SENTENCES)

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(MODEL_DIR / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    input_names = [i.name for i in sess.get_inputs()]
    assert input_names == list(feeds), input_names
    (output,) = sess.run(["last_hidden_state"], feeds)
    assert output.dtype == np.float32 and output.shape == (*feeds["input_ids"].shape, 384), output.shape
    assert np.isfinite(output).all()

    doc = {
        "model": "minilm",
        "sentences": SENTENCES,
        "inputs": [tensor_json(name, arr, "INT64") for name, arr in feeds.items()],
        "output": tensor_json("last_hidden_state", output, "FP32"),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_name(".tmp-" + OUT.name)
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, OUT)
    print(f"{OUT.relative_to(REPO)}: shape {list(output.shape)}, {OUT.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
