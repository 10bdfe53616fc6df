#!/usr/bin/env python3
"""Checks inferd's Cohere embed API with the clients users run: the `cohere` SDK's v1 client
(`POST /v1/embed`), its v2 client (`POST /v2/embed`) and LangChain's CohereEmbeddings, against
references computed here:

- float: the vectors of inferd's own `/embed` for the same texts (within 1e-5);
- int8 and uint8: the rule of docs/protocol.md ("Cohere's embed"), computed here in float64
  from those floats: each code must be the reference rounded (within 0.5 + 1e-3 of it, for
  values that fall on a rounding boundary in f32) and clamped; uint8 is int8 + 128 exactly;
- binary and ubinary: numpy.packbits of `x > 0`, bit for bit; binary is ubinary - 128;
- base64: the float vector's little-endian f32 bytes;
- truncation: a text past the model's 256 tokens, cut at its end (END) and at its start (START,
  and TEI's `truncation_direction: "Left"` on /embed), against onnxruntime on the model's own
  tokenizer truncating on that side (within 1e-5); NONE refuses it with 413.

    .venv/bin/python tests/clients/cohere_embed_check.py 127.0.0.1:8123

Prints `cohere embed: all checks passed` and exits 0, or prints each failed check and exits 1.
"""

import base64
import json
import sys
import urllib.request
from pathlib import Path

import cohere
import numpy as np
from langchain_cohere import CohereEmbeddings
from tokenizers import Tokenizer

from references import one_thread_session

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/minilm"
MAX_LENGTH = 256  # models/minilm/model.toml's [tokenizer] max_length
TEXTS = ["The quick brown fox jumps over the lazy dog", "where is the cat", "rain today, snow tomorrow!"]
addr = sys.argv[1]
failures = []


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def post(path, body):
    request = urllib.request.Request(
        f"http://{addr}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request) as r:
        return json.load(r)


def worst(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.abs(got - want).max())


def int8_reference(rows):
    """The int8 rule in float64, before rounding."""
    rows = np.asarray(rows, np.float64)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return unit * 127 * np.sqrt(rows.shape[1]) / 4


def check_codes(name, floats, by_type):
    floats = np.asarray(floats, np.float64)
    exact = int8_reference(floats)
    int8 = np.asarray(by_type["int8"], np.float64)
    within = np.abs(int8 - np.clip(exact, -128, 127)) <= 0.5 + 1e-3
    check(f"{name}: int8 is the rule's rounding", within.all(), f"{(~within).sum()} codes off, e.g. {int8[~within][:3]} vs {exact[~within][:3]}")
    check(f"{name}: int8 within -128..127", int8.min() >= -128 and int8.max() <= 127)
    check(f"{name}: uint8 = int8 + 128", np.array_equal(np.asarray(by_type["uint8"]), int8 + 128))
    ubinary = np.packbits(floats > 0, axis=1).astype(np.int64)
    check(f"{name}: ubinary bits", np.array_equal(np.asarray(by_type["ubinary"]), ubinary), f"{by_type['ubinary'][0][:4]} vs {ubinary[0][:4]}")
    check(f"{name}: binary = ubinary - 128", np.array_equal(np.asarray(by_type["binary"]), ubinary - 128))
    check(f"{name}: bytes per binary vector", len(by_type["ubinary"][0]) == floats.shape[1] // 8)
    if "base64" in by_type:
        # The floats' JSON is each f32's shortest text: read as f32 again, the very same values.
        decoded = np.stack([np.frombuffer(base64.b64decode(b), "<f4") for b in by_type["base64"]])
        same = np.array_equal(decoded, floats.astype(np.float32))
        check(f"{name}: base64 is the float vectors", same, str(worst(decoded, floats)))
    # What the codes keep: their cosine to the floats.
    cosine = (int8 * floats).sum(1) / np.linalg.norm(int8, axis=1) / np.linalg.norm(floats, axis=1)
    check(f"{name}: int8 cosine to float", cosine.min() > 0.999, str(cosine))


reference = post("/embed", {"inputs": TEXTS})

# The v1 client: floats without embedding_types, every type with them.
v1 = cohere.Client(base_url=f"http://{addr}", api_key="unused")
r = v1.embed(texts=TEXTS, model="embed-english-v3.0", input_type="search_document")
check("v1: floats response", r.response_type == "embeddings_floats", r.response_type)
check("v1: floats", worst(r.embeddings, reference) <= 1e-5, str(worst(r.embeddings, reference)))
check("v1: texts", r.texts == TEXTS, str(r.texts))
check("v1: billed tokens", (r.meta.billed_units.input_tokens or 0) > len(TEXTS), str(r.meta))
types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
r = v1.embed(texts=TEXTS, model="embed-english-v3.0", input_type="search_query", embedding_types=types)
check("v1 by type: response", r.response_type == "embeddings_by_type", r.response_type)
by_type = r.embeddings.dict(by_alias=True)
check("v1 by type: floats", worst(by_type["float"], reference) <= 1e-5, str(worst(by_type["float"], reference)))
check_codes("v1", reference, by_type)

# The v2 client, with the model named, and the codes of a second request alike.
v2 = cohere.ClientV2(base_url=f"http://{addr}", api_key="unused")
r = v2.embed(texts=TEXTS, model="minilm", input_type="search_document", embedding_types=["int8", "ubinary", "float", "uint8", "binary"])
by_type = r.embeddings.dict(by_alias=True)
check("v2: floats", worst(by_type["float"], reference) <= 1e-5, str(worst(by_type["float"], reference)))
check_codes("v2", reference, by_type)
r = v2.embed(texts=TEXTS, model="minilm", input_type="search_query")
check("v2: float by default", worst(r.embeddings.float_, reference) <= 1e-5 and r.embeddings.int8 is None)

# Truncation, against onnxruntime on the model's tokenizer cutting on each side.
session = one_thread_session(MODEL / "model.onnx")


def embedded(text, direction):
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_LENGTH, direction=direction)
    ids = np.asarray([tokenizer.encode(text).ids], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    (hidden,) = session.run(["last_hidden_state"], feeds)
    vector = hidden[0].astype(np.float64).mean(axis=0)
    return vector / np.linalg.norm(vector)


start = "The archive opened with a list of harbours and their tides. "
end = "At the very end the keeper wrote one line about the lighthouse and its lamp."
long_text = start * 40 + end
left, right = embedded(long_text, "left"), embedded(long_text, "right")
check("references differ by side", worst([left], [right]) > 1e-2)
r = v2.embed(texts=[long_text], model="minilm", input_type="search_document", embedding_types=["float"], truncate="START")
check("v2 START keeps the end", worst(r.embeddings.float_, [left]) <= 1e-5, str(worst(r.embeddings.float_, [left])))
r = v1.embed(texts=[long_text], truncate="END")
check("v1 END keeps the start", worst(r.embeddings, [right]) <= 1e-5, str(worst(r.embeddings, [right])))
tei_left = post("/embed", {"inputs": [long_text], "truncate": True, "truncation_direction": "Left"})
check("TEI Left keeps the end", worst(tei_left, [left]) <= 1e-5, str(worst(tei_left, [left])))
tei_right = post("/embed", {"inputs": [long_text], "truncate": True, "truncation_direction": "Right"})
check("TEI Right keeps the start", worst(tei_right, [right]) <= 1e-5, str(worst(tei_right, [right])))
try:
    v2.embed(texts=[long_text], model="minilm", input_type="search_document", embedding_types=["float"], truncate="NONE")
    check("NONE refuses a long text", False, "answered")
except cohere.core.api_error.ApiError as e:
    check("NONE refuses a long text with 413", e.status_code == 413, f"{e.status_code} {e.body}")
    check("NONE: the message says why", "truncate" in str(e.body) or "tokens" in str(e.body), str(e.body))

# LangChain's CohereEmbeddings (the v1 client, embedding_types ["float"]).
lc = CohereEmbeddings(base_url=f"http://{addr}", model="minilm", cohere_api_key="unused")
documents = lc.embed_documents(TEXTS)
check("langchain: documents", worst(documents, reference) <= 1e-5, str(worst(documents, reference)))
query = lc.embed_query(TEXTS[1])
check("langchain: query", worst([query], [reference[1]]) <= 1e-5, str(worst([query], [reference[1]])))

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("cohere embed: all checks passed")
