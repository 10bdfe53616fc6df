#!/usr/bin/env python3
"""The embedding of texts longer than the default model takes, computed here as inferd's
`long_texts = "chunk"` says it computes them (docs/models.md, "Long texts"), with the model's
own tokenizer and onnxruntime: the text's tokens without special tokens in windows of
max_length minus the special tokens, each starting `size - overlap` tokens after the one before,
each window's text from its first token's start to its last token's end; every window embedded
(mean of last_hidden_state over its tokens, not normalized); the windows pooled (mean weighted
by each window's tokens, or the largest value of each dimension) and normalized after.

    .venv/bin/python tests/clients/chunk_reference.py OVERLAP POOLING TEXT...

Prints a JSON list: per text, its windows, tokens and embedding.
"""

import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from references import one_thread_session, whole_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_LENGTH = 256  # models/minilm/model.toml's [tokenizer] max_length
overlap, pooling, texts = int(sys.argv[1]), sys.argv[2], sys.argv[3:]

plain = whole_tokenizer(ROOT / "models/minilm/tokenizer.json")
cut = Tokenizer.from_file(str(ROOT / "models/minilm/tokenizer.json"))
cut.no_padding()
cut.enable_truncation(max_length=MAX_LENGTH)
session = one_thread_session(ROOT / "models/minilm/model.onnx")
size = MAX_LENGTH - plain.post_processor.num_special_tokens_to_add(False)


def windows(text):
    offsets = plain.encode(text, add_special_tokens=False).offsets
    if len(offsets) <= size:
        return [(text, len(offsets))]
    out, start = [], 0
    while start < len(offsets):
        end = min(start + size, len(offsets))
        out.append((text[offsets[start][0]:offsets[end - 1][1]], end - start))
        if end == len(offsets):
            break
        start += size - overlap
    return out


def embed(text):
    ids = np.asarray([cut.encode(text).ids], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    (hidden,) = session.run(["last_hidden_state"], feeds)
    return hidden[0].astype(np.float64).mean(axis=0)


answers = []
for text in texts:
    parts = windows(text)
    vectors = np.stack([embed(w) for w, _ in parts])
    weights = np.asarray([n for _, n in parts], np.float64)
    pooled = (vectors * weights[:, None]).sum(axis=0) / weights.sum() if pooling == "mean" else vectors.max(axis=0)
    pooled /= max(np.linalg.norm(pooled), 1e-12)
    answers.append({"windows": len(parts), "tokens": int(weights.sum()), "embedding": pooled.tolist()})
print(json.dumps(answers))
