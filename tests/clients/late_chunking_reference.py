#!/usr/bin/env python3
"""Late chunking as its paper computes it (Günther et al., 2024; jina-ai/late-chunking): the
default model (models/minilm) runs once over the whole text, special tokens included; each
chunk's vector is the mean of the token states of the tokens whose characters overlap its
span `[start, end)` (character offsets, as Python counts them; special tokens belong to no
chunk), L2-normalised.

    .venv/bin/python tests/clients/late_chunking_reference.py TEXT SPANS_JSON

Prints a JSON list: per span, its embedding.
"""

import json
import sys
from pathlib import Path

import numpy as np

from references import one_thread_session, whole_tokenizer

ROOT = Path(__file__).resolve().parents[2]
text, spans = sys.argv[1], json.loads(sys.argv[2])

tokenizer = whole_tokenizer(ROOT / "models/minilm/tokenizer.json")
session = one_thread_session(ROOT / "models/minilm/model.onnx")

encoding = tokenizer.encode(text)
ids = np.asarray([encoding.ids], np.int64)
feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
(states,) = session.run(["last_hidden_state"], feeds)
states = states[0].astype(np.float64)

answers = []
for start, end in spans:
    covered = [
        i
        for i, ((a, b), special) in enumerate(zip(encoding.offsets, encoding.special_tokens_mask))
        if not special and a < end and b > start
    ]
    vector = states[covered].mean(axis=0)
    answers.append((vector / np.linalg.norm(vector)).tolist())
print(json.dumps(answers))
