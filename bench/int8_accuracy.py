#!/usr/bin/env python3
"""The int8 model inferd prepared, against the fp32 model it came from, on held-out texts:
texts of 1 to 256 tokens in 20 languages that Faker writes (none of them among the guard's
calibration texts), embedded by onnxruntime with the model's own pooling (mean over the
attention mask, L2-normalised), one text at a time on one thread; and the median time of a
call of each, in the same sitting.

    .venv/bin/pip install faker   # once; not needed by make test
    .venv/bin/python bench/int8_accuracy.py FP32.onnx INT8.onnx TOKENIZER.json [N]

INT8.onnx is `model.onnx` in the model's `<name>-int8-...` folder of runtime.cache_dir.
Prints the least, 1st-percentile and mean cosine, the same per token-length band, and the
speed-up.
"""

import random
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from faker import Faker
from tokenizers import Tokenizer

LOCALES = ["en_US", "de_DE", "fr_FR", "es_ES", "it_IT", "pt_BR", "nl_NL", "ru_RU", "ja_JP", "zh_CN",
           "ko_KR", "ar_AA", "hi_IN", "tr_TR", "pl_PL", "sv_SE", "cs_CZ", "el_GR", "he_IL", "uk_UA"]
MAX_TOKENS = 256


def texts(n, tokenizer):
    rng = random.Random(20261201)
    fakers = {loc: Faker(loc) for loc in LOCALES}
    for f in fakers.values():
        f.seed_instance(rng.randrange(1 << 30))
    out = []
    while len(out) < n:
        fake = fakers[LOCALES[len(out) % len(LOCALES)]]
        # Lengths spread over 1..256 tokens: a word, a sentence, or paragraphs.
        want = int(round(MAX_TOKENS ** rng.random()))
        text = fake.word()
        while len(tokenizer.encode(text).ids) < want:
            text = f"{text} {fake.sentence(nb_words=rng.randint(3, 15))}"
        out.append(text)
    return out


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def embed(sess, tokenizer, text):
    enc = tokenizer.encode(text)
    ids = np.array([enc.ids[:MAX_TOKENS]], dtype=np.int64)
    mask = np.ones_like(ids)
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    feed = {i.name: feed[i.name] for i in sess.get_inputs()}
    started = time.perf_counter()
    hidden = sess.run(None, feed)[0]
    took = time.perf_counter() - started
    v = hidden[0].mean(axis=0)
    return v / np.linalg.norm(v), ids.shape[1], took


def main():
    fp32_path, int8_path, tokenizer_path = sys.argv[1:4]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 520
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    held_out = texts(n, tokenizer)
    fp32, int8 = session(fp32_path), session(int8_path)
    rows, t32, t8 = [], [], []
    for text in held_out:
        a, tokens, ta = embed(fp32, tokenizer, text)
        b, _, tb = embed(int8, tokenizer, text)
        rows.append((tokens, float(a @ b)))
        t32.append(ta)
        t8.append(tb)
    cos = np.array([c for _, c in rows])
    print(f"held-out texts: {len(rows)} in {len(LOCALES)} languages, tokens {min(t for t, _ in rows)}-{max(t for t, _ in rows)}")
    print(f"cosine int8 vs fp32: min {cos.min():.4f}, p1 {np.percentile(cos, 1):.4f}, mean {cos.mean():.4f}")
    for lo, hi in [(1, 8), (9, 32), (33, 128), (129, 256)]:
        band = np.array([c for t, c in rows if lo <= t <= hi])
        if len(band):
            print(f"  {lo:>3}-{hi:<3} tokens: {len(band):>3} texts, min {band.min():.4f}, mean {band.mean():.4f}")
    m32, m8 = statistics.median(t32) * 1e3, statistics.median(t8) * 1e3
    print(f"median call, one thread: fp32 {m32:.2f} ms, int8 {m8:.2f} ms ({m32 / m8:.2f}x)")


if __name__ == "__main__":
    main()
