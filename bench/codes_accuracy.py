"""What Cohere embed's compact codes keep of the float vectors (docs/protocol.md, "Cohere
embed"): 800 texts of 1-4 sentences in 8 languages that Faker writes, embedded by a running
inferd's /embed; the first 400 are the calibration set of the per-dimension ranges compared
with, the other 400 are measured. For each rule: the cosine of each code (read as a vector)
to its float vector, the largest error of a pair's cosine similarity, and of each text's 10
nearest neighbours by float cosine, the share the codes find.

    .venv/bin/pip install faker   # once; not needed by make test
    .venv/bin/python bench/codes_accuracy.py 127.0.0.1:8000

The int8 rule inferd ships is the `fixed R=4/sqrt(d)` row (pipeline/codes.rs).
"""

import json
import random
import sys
import urllib.request

import numpy as np
from faker import Faker

LOCALES = ["en_US", "de_DE", "fr_FR", "es_ES", "ja_JP", "zh_CN", "ru_RU", "ar_AA"]
addr = sys.argv[1]

rng = random.Random(7)
fakers = {locale: Faker(locale) for locale in LOCALES}
for f in fakers.values():
    f.seed_instance(rng.randrange(1 << 30))
texts = []
for i in range(800):
    f = fakers[LOCALES[i % len(LOCALES)]]
    texts.append(" ".join(f.sentence(nb_words=rng.randint(3, 25)) for _ in range(rng.randint(1, 4))))
vectors = []
for i in range(0, len(texts), 32):
    body = json.dumps({"inputs": texts[i : i + 32], "truncate": True}).encode()
    request = urllib.request.Request(f"http://{addr}/embed", body, {"content-type": "application/json"})
    vectors += json.load(urllib.request.urlopen(request))
X = np.array(vectors, dtype=np.float32)
d = X.shape[1]
calibration, held = X[:400], X[400:]


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def similarities(A):
    A = A / np.linalg.norm(A, axis=1, keepdims=True)
    return A @ A.T


S = similarities(held)


def report(name, codes):
    c, s = cosines(held, codes), similarities(codes)
    top = lambda M: np.argsort(-M, axis=1)[:, 1:11]
    a, b = top(S), top(s)
    kept = np.mean([len(set(a[i]) & set(b[i])) / 10 for i in range(len(a))])
    print(f"{name:34s} cosine min {c.min():.4f} mean {c.mean():.4f}  similarity error max {np.abs(S - s).max():.4f}  top-10 kept {kept:.3f}")


print(f"{len(held)} texts measured, {d} dimensions")
for k in [2, 3, 4, 5, 6, 8]:
    unit = held / np.linalg.norm(held, axis=1, keepdims=True)
    report(f"int8 fixed R={k}/sqrt(d)", np.clip(np.round(unit * 127 * np.sqrt(d) / k), -128, 127))
lo, hi = calibration.min(0), calibration.max(0)
report("int8 per-dimension ranges", np.clip(np.round((held - lo) / (hi - lo) * 255) - 128, -128, 127))
report("ubinary as +-1", np.where(held > 0, 1, -1))
