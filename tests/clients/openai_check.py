#!/usr/bin/env python3
"""Checks a running inferd serving the default model (minilm) with the clients users already
run: the `openai` package and LangChain's OpenAIEmbeddings (`/v1/embeddings`) and
huggingface_hub's InferenceClient (TEI's `POST /`), against
tests/fixtures/minilm_embed_reference.json (onnxruntime in Python).

    .venv/bin/python tests/clients/openai_check.py 127.0.0.1:8123

Prints `clients: all checks passed` and exits 0, or prints each failed check and exits 1.
"""

import json
import sys
from pathlib import Path

import numpy as np
import openai
from huggingface_hub import InferenceClient
from langchain_openai import OpenAIEmbeddings

ROOT = Path(__file__).resolve().parents[2]
reference = json.loads((ROOT / "tests/fixtures/minilm_embed_reference.json").read_text())
cases = [c for c in reference["cases"] if not c["truncated"]]
addr = sys.argv[1]
failures = []


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def close(a, b):
    return np.allclose(np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32), atol=1e-4)


client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)
texts = [c["text"] for c in cases]
expected = [c["embedding"] for c in cases]

# The client's default: base64 (numpy is installed), a model name the server does not load.
r = client.embeddings.create(input=texts, model="text-embedding-3-small")
check("base64: rows", len(r.data) == len(texts), f"{len(r.data)} rows")
check("base64: values", all(close(d.embedding, e) for d, e in zip(r.data, expected)))
check("base64: order", [d.index for d in r.data] == list(range(len(texts))))
check("model answered", r.model == "minilm", r.model)
tokens = sum(c["tokens"] for c in cases)
check("usage", r.usage.prompt_tokens == tokens and r.usage.total_tokens == tokens, f"{r.usage} vs {tokens}")

r = client.embeddings.create(input=texts[0], model="minilm", encoding_format="float")
check("float: one text", len(r.data) == 1 and close(r.data[0].embedding, expected[0]))

# Token ids of the model's own vocabulary, special tokens included: the same vectors.
r = client.embeddings.create(input=[c["ids"] for c in cases], model="minilm", encoding_format="float")
check("token ids", all(close(d.embedding, e) for d, e in zip(r.data, expected)))
r = client.embeddings.create(input=cases[0]["ids"], model="minilm", encoding_format="float")
check("one list of token ids", len(r.data) == 1 and close(r.data[0].embedding, expected[0]))

# Asking for all dimensions is fine; fewer is refused for a model not trained for it, in
# OpenAI's error shape, which the client raises as BadRequestError.
r = client.embeddings.create(input="x", model="minilm", dimensions=384, encoding_format="float")
check("dimensions = all", len(r.data[0].embedding) == 384)
try:
    client.embeddings.create(input="x", model="minilm", dimensions=128)
    check("dimensions < all", False, "no error")
except openai.BadRequestError as e:
    check("dimensions < all: message", "matryoshka" in str(e), str(e))
    check("dimensions < all: shape", e.body.get("type") == "invalid_request_error", repr(e.body))
try:
    client.embeddings.create(input=[], model="minilm")
    check("empty input", False, "no error")
except openai.BadRequestError as e:
    check("empty input: message", "empty" in str(e), str(e))

# LangChain, as it is configured for a server that is not OpenAI's: texts, not tiktoken ids
# of OpenAI's vocabulary (check_embedding_ctx_length=False).
chain = OpenAIEmbeddings(base_url=f"http://{addr}/v1", api_key="unused", model="minilm", check_embedding_ctx_length=False)
documents = chain.embed_documents(texts)
check("LangChain embed_documents", len(documents) == len(texts) and all(close(d, e) for d, e in zip(documents, expected)))
check("LangChain embed_query", close(chain.embed_query(texts[0]), expected[0]))

# huggingface_hub's client posts TEI's body to the server's root.
hub = InferenceClient(model=f"http://{addr}")
vectors = hub.feature_extraction(texts[0])
check("InferenceClient.feature_extraction", close(np.asarray(vectors).reshape(-1), expected[0]))

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("clients: all checks passed")
