#!/usr/bin/env python3
"""Checks a running inferd serving the `reranker` test model (a cross-encoder) through Cohere's
rerank API with the clients users run: the `cohere` SDK's v1 client (`POST /v1/rerank`, with
documents as objects and `return_documents`) and v2 client (`POST /v2/rerank`), and LangChain's
CohereRerank (langchain-cohere, on the v2 client). Every score is compared with what
onnxruntime gives for the same (query, document) pairs here; a document longer than the model
takes beside the query is compared with the best of its windows, cut here as the server says it
cuts them (the document's tokens without special tokens, in runs of the tokens that fit beside
the query, each run's text from its first token's start to its last token's end).

    .venv/bin/python tests/clients/cohere_check.py 127.0.0.1:8123

Prints `cohere: all checks passed` and exits 0, or prints each failed check and exits 1.
"""

import math
import sys
from pathlib import Path

import cohere
import numpy as np
from langchain_cohere import CohereRerank
from langchain_core.documents import Document

from references import one_thread_session, whole_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/models/reranker"
MAX_LENGTH = 128  # tests/models/reranker/model.toml's [tokenizer] max_length
addr = sys.argv[1]
failures = []

tokenizer = whole_tokenizer(ROOT / "models/minilm/tokenizer.json")
session = one_thread_session(MODEL / "model.onnx")


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def score(query, text):
    """onnxruntime's sigmoid of the cross-encoder's logit for (query, text), cut at MAX_LENGTH."""
    encoding = tokenizer.encode(query, text)
    if len(encoding.ids) > MAX_LENGTH:
        encoding.truncate(MAX_LENGTH)  # not expected: windows fit
    ids = np.asarray([encoding.ids], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.asarray([encoding.type_ids], np.int64)}
    (logits,) = session.run(["logits"], feeds)
    return 1 / (1 + math.exp(-float(logits[0][0])))


def windows(query, text, max_windows=None, max_tokens=None):
    """The document's windows, as the server cuts them (see the module's docs)."""
    size = MAX_LENGTH - len(tokenizer.encode(query, add_special_tokens=False).ids) - 3
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    if max_tokens is not None:
        offsets = offsets[:max_tokens]
    cut = [text[offsets[s][0]:offsets[min(s + size, len(offsets)) - 1][1]] for s in range(0, len(offsets), size)]
    return cut[:max_windows] if max_windows else cut


def best(query, text, **limits):
    return max(score(query, w) for w in windows(query, text, **limits))


QUERY = "How do I serve a model on many cores?"
DOCS = [
    "Start one worker process per core and pin each to its own CPUs.",
    "The weather was lovely on the first day of spring.",
    "Models are served by workers",
    "I absolutely love this, it works wonderfully!",
]
expected = [score(QUERY, d) for d in DOCS]
order = sorted(range(len(DOCS)), key=lambda i: -expected[i])


def agree(name, results, top_n, texts=None):
    got = [(r.index, r.relevance_score) for r in results]
    check(f"{name}: order", [i for i, _ in got] == order[:top_n], f"{got} against {order[:top_n]}")
    for i, s in got:
        check(f"{name}: score of {i}", abs(s - expected[i]) < 1e-5, f"{s} against onnxruntime's {expected[i]}")
    if texts is not None:
        for r in results:
            check(f"{name}: document {r.index}", texts(r) == DOCS[r.index], texts(r))


# v1: documents as objects, their other fields returned with return_documents.
v1 = cohere.Client(base_url=f"http://{addr}", api_key="unused")
objects = [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(DOCS)]
r = v1.rerank(model="reranker", query=QUERY, documents=objects, top_n=3, return_documents=True)
agree("v1", r.results, 3, texts=lambda res: res.document.text)
check("v1: fields kept", all(getattr(res.document, "id", None) == f"doc-{res.index}" for res in r.results), r.results)
check("v1: api version", r.meta.api_version.version == "1", r.meta)
r = v1.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS)
agree("v1, a model it does not serve: its cross-encoder", r.results, len(DOCS))
check("v1: no documents unless asked", all(res.document is None for res in r.results), r.results)

# v2: documents as texts.
v2 = cohere.ClientV2(base_url=f"http://{addr}", api_key="unused")
r = v2.rerank(model="reranker", query=QUERY, documents=DOCS, top_n=2)
agree("v2", r.results, 2)
check("v2: api version", r.meta.api_version.version == "2", r.meta)

# LangChain's CohereRerank (the v2 client): compress_documents keeps the best top_n.
reranker = CohereRerank(client=v2, model="reranker", top_n=2)
kept = reranker.compress_documents([Document(page_content=d) for d in DOCS], QUERY)
check("langchain: documents", [d.page_content for d in kept] == [DOCS[i] for i in order[:2]], kept)
for d in kept:
    i = DOCS.index(d.page_content)
    s = d.metadata.get("relevance_score")
    check("langchain: score", s is not None and abs(s - expected[i]) < 1e-5, f"{s} against {expected[i]}")

# A long document, scored by its best window: 1, 2.5 and 10 times what fits.
sentence = "The weather was lovely on the first day of spring, and nobody served any model. "
long_docs = [DOCS[0] + " " + sentence * n for n in (6, 15, 60)]
long_docs[1] = sentence * 7 + DOCS[0] + " " + sentence * 8  # the relevant part in the middle
for name, client, limits in (
    ("v1, max_chunks_per_doc=20", lambda docs: v1.rerank(model="reranker", query=QUERY, documents=docs, max_chunks_per_doc=20), {"max_windows": 20}),
    ("v2, max_tokens_per_doc=700", lambda docs: v2.rerank(model="reranker", query=QUERY, documents=docs, max_tokens_per_doc=700), {"max_tokens": 700}),
):
    results = client(long_docs).results
    for res in results:
        text = long_docs[res.index]
        want = best(QUERY, text, **limits)
        check(f"{name}: document {res.index} ({len(windows(QUERY, text, **limits))} windows)", abs(res.relevance_score - want) < 1e-5, f"{res.relevance_score} against {want}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("cohere: all checks passed")
