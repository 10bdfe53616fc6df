"""The seeds' recipe, as a baseline for bench/compare.sh: FastAPI + onnxruntime behind
gunicorn with uvicorn workers, tuned as the seeds recommend: K workers, one intra-op thread
each, the model loaded once per worker at start (not per request, and not in a forked
master), a warm-up run before serving. Same model, tokenizer, padding, mean pooling and L2
normalisation as inferd's /embed, and the same request and response shapes.

    gunicorn -w 2 -k uvicorn.workers.UvicornWorker -b 127.0.0.1:8001 app:app
"""

import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer

MODEL_DIR = os.environ["SEEDS_MODEL_DIR"]

options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
session = ort.InferenceSession(os.path.join(MODEL_DIR, "model.onnx"), options, providers=["CPUExecutionProvider"])
tokenizer = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
tokenizer.no_truncation()
tokenizer.enable_padding()
feeds = [i.name for i in session.get_inputs()]


def embed(texts):
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    hidden = session.run(None, {k: v for k, v in inputs.items() if k in feeds})[0]
    weights = mask[:, :, None].astype(np.float32)
    pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
    return pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)


embed(["warm-up"])
app = FastAPI()


class EmbedRequest(BaseModel):
    inputs: str | list[str]


@app.post("/embed")
def embed_route(request: EmbedRequest):
    texts = [request.inputs] if isinstance(request.inputs, str) else request.inputs
    return embed(texts).tolist()


@app.get("/health")
def health():
    return {"ok": True}
