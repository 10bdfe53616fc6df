#!/usr/bin/env python3
"""Writes the reference outputs inferd's tests compare the server with: what
onnxruntime's Python API (CPU execution provider, one intra-op thread) computes.

Run after scripts/setup.sh and scripts/gen_test_models.py:

    .venv/bin/python scripts/make_reference.py

It first runs scripts/gen_test_images.py (tests/fixtures/images/), then writes:

tests/fixtures/minilm_reference.json
    The default model's raw last_hidden_state for two fixed sentences in one
    batch. The inputs are tokenised with models/minilm/tokenizer.json (its own
    padding and truncation turned off), padded by hand to the longer sentence
    with id 0, attention_mask 1 for tokens and 0 for padding, token_type_ids
    all 0.

tests/fixtures/minilm_embed_reference.json
    {"model", "max_length", "pooling", "cases": [{"text", "tokens", "truncated",
    "ids", "embedding", "embedding_raw"}]}: sentence embeddings from the default
    model as the embedding pipeline computes them (mean of last_hidden_state
    over attention_mask; `embedding` L2-normalised, `embedding_raw` not).
    `tokens` is the token count with [CLS] and [SEP] and without truncation;
    `truncated` is tokens > max_length (256), and such a case's embeddings and
    `ids` come from the tokenizer's own truncation (enable_truncation(256):
    longest-first, right side, stride 0), as the Rust tokenizers crate does
    with the same tokenizer.json. Each case runs alone (batch of 1).

tests/fixtures/classifier_reference.json
    {"model", "labels", "cases": [{"text", "logits", "probabilities",
    "ranking"}]} for the `classifier` test model, each sentence alone;
    probabilities are the softmax of the logits, ranking the labels by
    decreasing score.

tests/fixtures/cnn_reference.json
    {"model", "labels", "cases": [{"file", "label", "logits", "probabilities",
    "margin"}]} for the `cnn` test model and each good test image: Pillow
    opens it, convert("RGB") (alpha dropped, gray expanded), resize((32, 32),
    BILINEAR), then (pixel / 255 - 0.5) / 0.5 in float32, NCHW. margin is the
    top probability minus the second. The label must also win, with a margin
    over 0.3, when the image is resized with NEAREST, BOX or BICUBIC instead,
    so a different bilinear implementation cannot flip it.

Every file is written through a temporary file and the same inputs give the
same bytes.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image
from tokenizers import Tokenizer

import gen_test_images
from gen_test_models import CLASSIFIER_LABELS, CLASSIFIER_SENTENCES, CNN_LABELS, CNN_SIZE

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "minilm"
FIXTURES = REPO / "tests" / "fixtures"
OUT = FIXTURES / "minilm_reference.json"
EMBED_OUT = FIXTURES / "minilm_embed_reference.json"
CLASSIFIER_DIR = REPO / "tests" / "models" / "classifier"
RERANKER_DIR = REPO / "tests" / "models" / "reranker"
RERANKER_OUT = FIXTURES / "reranker_reference.json"
RERANK_QUERY = "How do I serve a model on many cores?"
RERANK_TEXTS = [
    "Start one worker process per core and pin each to its own CPUs.",
    "The weather was lovely on the first day of spring.",
    "Models are served by workers",
    "I absolutely love this, it works wonderfully!",
]
CLASSIFIER_OUT = FIXTURES / "classifier_reference.json"
CNN_DIR = REPO / "tests" / "models" / "cnn"
CNN_OUT = FIXTURES / "cnn_reference.json"

SENTENCES = [
    "inferd serves ONNX models from supervised worker processes.",
    "Hello!",
]
PAD_ID = 0

# models/minilm/model.toml's [tokenizer] max_length.
EMBED_MAX_LENGTH = 256
LONG_TEXT = (
    "inferd is a production server for ONNX models, written in Rust. "
    "One supervisor process starts a fixed number of worker processes, and each worker holds its own "
    "ONNX Runtime session. "
    "Every worker is pinned to its own set of CPUs, so the workers never fight over cores and the "
    "operating system never has to migrate them. "
    "A worker warms its models up before it joins the listening port, which means the first real "
    "request is as fast as the thousandth. "
    "When a worker crashes, the supervisor replaces it in the same slot, waiting a little longer each "
    "time if the replacements keep dying. "
    "On SIGTERM every worker stops accepting new connections, finishes the requests it already has, "
    "and exits cleanly. "
    "Text models get their inputs tokenised inside the server: the client sends sentences, and the "
    "server pads, truncates and batches them. "
    "Image models accept PNG and JPEG files; the server decodes them, converts them to RGB, resizes "
    "them and normalises the pixels. "
    "Classification models return labels and probabilities, while embedding models return one "
    "normalised vector per input. "
    "The status command shows, for every worker, its process id, its CPU set, its threads, its memory, "
    "the requests it answered and how long it has been up. "
    "Operators on CentOS and RHEL install it as a systemd service with a sample configuration and a "
    "sysctl file. "
    "Benchmarks compare it with other servers on the same hardware, under the same load, with the "
    "same model. "
    "Long inputs like this one are cut to the model's maximum length when the request asks for "
    "truncation, and refused otherwise, so that nobody is surprised by a silently shortened text. "
    "Größe, café and naïve are lower-cased, and their accents are kept or stripped exactly as the "
    "tokenizer's normaliser says. "
    "The last sentences of this text only make it longer than the limit: they will never reach the "
    "model when truncation is on, and the embedding must not depend on them at all."
)
EMBED_TEXTS = [
    "Hello!",
    "inferd serves ONNX models from supervised worker processes, one pinned CPU set each.",
    "Größe, café, naïve — 日本語のテキスト 🙂",
    LONG_TEXT,
]


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


def session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def write_json(path, doc):
    """Writes doc as one line of UTF-8 JSON through a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_bytes((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
    os.replace(tmp, path)


def floats(array):
    # float() of a float32 is exact; json writes the shortest repr that reads back the same.
    return [float(v) for v in np.asarray(array, np.float32).reshape(-1)]


def softmax(logits):
    z = np.exp(np.asarray(logits, np.float64) - np.max(logits))
    return z / z.sum()


def write_minilm_reference():
    feeds = tokenise(SENTENCES)

    sess = session(MODEL_DIR / "model.onnx")
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


def text_tokenizer(path, max_length=None):
    """tokenizer.json with its own padding off, and truncation at max_length (or off)."""
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length=max_length)
    return tok


def single_feeds(ids):
    """One sequence, batch of 1: attention_mask all 1, token_type_ids all 0."""
    input_ids = np.asarray([ids], np.int64)
    return {
        "input_ids": input_ids,
        "attention_mask": np.ones_like(input_ids),
        "token_type_ids": np.zeros_like(input_ids),
    }


def boundary_text(tok, count):
    """The shortest word prefix of LONG_TEXT that has exactly `count` tokens."""
    words = LONG_TEXT.split(" ")
    for n in range(1, len(words) + 1):
        text = " ".join(words[:n])
        got = len(tok.encode(text).ids)
        if got == count:
            return text
        if got > count:
            break
    raise SystemExit(f"no word prefix of LONG_TEXT has exactly {count} tokens; edit LONG_TEXT")


def write_embed_reference():
    full = text_tokenizer(MODEL_DIR / "tokenizer.json")
    cut = text_tokenizer(MODEL_DIR / "tokenizer.json", EMBED_MAX_LENGTH)
    # The limit itself (not truncated) and one past it (truncated).
    texts = EMBED_TEXTS + [boundary_text(full, EMBED_MAX_LENGTH), boundary_text(full, EMBED_MAX_LENGTH + 1)]
    sess = session(MODEL_DIR / "model.onnx")
    cases = []
    for text in texts:
        tokens = len(full.encode(text).ids)
        truncated = tokens > EMBED_MAX_LENGTH
        ids = cut.encode(text).ids
        assert len(ids) == min(tokens, EMBED_MAX_LENGTH), (text[:40], len(ids), tokens)
        assert ids[0] == 101 and ids[-1] == 102, "[CLS] ... [SEP] expected, also after truncation"
        feeds = single_feeds(ids)
        (hidden,) = sess.run(["last_hidden_state"], feeds)
        assert hidden.shape == (1, len(ids), 384) and np.isfinite(hidden).all(), hidden.shape
        mask = feeds["attention_mask"][0].astype(np.float64)[:, None]
        raw = (hidden[0].astype(np.float64) * mask).sum(axis=0) / max(mask.sum(), 1e-9)
        unit = raw / max(np.linalg.norm(raw), 1e-12)
        cases.append(
            {
                "text": text,
                "tokens": tokens,
                "truncated": truncated,
                "ids": [int(i) for i in ids],
                "embedding": floats(unit),
                "embedding_raw": floats(raw),
            }
        )
    assert [c["truncated"] for c in cases] == [False, False, False, True, False, True], [c["tokens"] for c in cases]
    doc = {"model": "minilm", "max_length": EMBED_MAX_LENGTH, "pooling": "mean", "cases": cases}
    write_json(EMBED_OUT, doc)
    counts = ", ".join(f"{c['tokens']}{' (truncated)' if c['truncated'] else ''}" for c in cases)
    print(f"{EMBED_OUT.relative_to(REPO)}: {len(cases)} cases, tokens {counts}, {EMBED_OUT.stat().st_size} bytes")


def write_classifier_reference():
    tok = text_tokenizer(MODEL_DIR / "tokenizer.json")
    sess = session(CLASSIFIER_DIR / "model.onnx")
    cases = []
    for text in CLASSIFIER_SENTENCES:
        (logits,) = sess.run(["logits"], single_feeds(tok.encode(text).ids))
        logits = logits[0]
        probs = softmax(logits)
        order = np.argsort(-logits, kind="stable")
        cases.append(
            {
                "text": text,
                "logits": floats(logits),
                "probabilities": floats(probs),
                "ranking": [CLASSIFIER_LABELS[i] for i in order],
            }
        )
    rankings = [tuple(c["ranking"]) for c in cases]
    assert len(set(rankings)) == len(rankings), f"two sentences rank the labels alike: {rankings}"
    write_json(CLASSIFIER_OUT, {"model": "classifier", "labels": CLASSIFIER_LABELS, "cases": cases})
    print(f"{CLASSIFIER_OUT.relative_to(REPO)}: {len(cases)} cases, {CLASSIFIER_OUT.stat().st_size} bytes")
    for c in cases:
        probs = ", ".join(f"{label} {p:.3f}" for label, p in zip(CLASSIFIER_LABELS, c["probabilities"]))
        print(f"  {c['text']!r}: {' > '.join(c['ranking'])} ({probs})")


def write_reranker_reference():
    tok = text_tokenizer(MODEL_DIR / "tokenizer.json")
    sess = session(RERANKER_DIR / "model.onnx")
    cases = []
    for text in RERANK_TEXTS:
        encoding = tok.encode(RERANK_QUERY, text)
        feeds = single_feeds(encoding.ids)
        feeds["token_type_ids"] = np.asarray([encoding.type_ids], np.int64)
        (logits,) = sess.run(["logits"], feeds)
        logit = float(logits[0][0])
        cases.append({"text": text, "logit": logit, "score": float(1 / (1 + np.exp(-logit)))})
    scores = [c["score"] for c in cases]
    assert len(set(scores)) == len(scores), f"two texts score alike: {scores}"
    write_json(RERANKER_OUT, {"model": "reranker", "query": RERANK_QUERY, "cases": cases})
    print(f"{RERANKER_OUT.relative_to(REPO)}: {len(cases)} texts, scores {', '.join(f'{s:.4f}' for s in scores)}")


def cnn_input(path, resample):
    """What the server's image pipeline feeds the cnn model, computed with Pillow."""
    with Image.open(path) as im:
        rgb = im.convert("RGB").resize((CNN_SIZE, CNN_SIZE), resample)
    x = np.asarray(rgb, np.float32) * np.float32(1 / 255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def margin(probs):
    top, second = np.sort(probs)[::-1][:2]
    return float(top - second)


def write_cnn_reference():
    sess = session(CNN_DIR / "model.onnx")
    cases = []
    for name, label in gen_test_images.GOOD.items():
        path = gen_test_images.OUT_DIR / name
        (logits,) = sess.run(["logits"], {"pixel_values": cnn_input(path, Image.BILINEAR)})
        probs = softmax(logits[0])
        got = CNN_LABELS[int(np.argmax(probs))]
        assert got == label, (name, got, label, probs)
        assert margin(probs) > 0.3, (name, "margin", margin(probs))
        others = []
        for resample in (Image.NEAREST, Image.BOX, Image.BICUBIC):
            (alt,) = sess.run(["logits"], {"pixel_values": cnn_input(path, resample)})
            alt_probs = softmax(alt[0])
            assert CNN_LABELS[int(np.argmax(alt_probs))] == label, (name, resample, alt_probs)
            assert margin(alt_probs) > 0.3, (name, resample, "margin", margin(alt_probs))
            others.append(f"{Image.Resampling(resample).name.lower()} {margin(alt_probs):.3f}")
        cases.append(
            {
                "file": name,
                "label": label,
                "logits": floats(logits[0]),
                "probabilities": floats(probs),
                "margin": float(np.float32(margin(probs))),
            }
        )
        print(f"  {name}: {label}, margin {margin(probs):.3f} (bilinear; {', '.join(others)})")
    write_json(CNN_OUT, {"model": "cnn", "labels": CNN_LABELS, "cases": cases})
    print(f"{CNN_OUT.relative_to(REPO)}: {len(cases)} cases, {CNN_OUT.stat().st_size} bytes")


def main():
    needed = [MODEL_DIR / "model.onnx", MODEL_DIR / "tokenizer.json"]
    for f in needed:
        if not f.exists():
            sys.exit(f"{f} is missing: run scripts/setup.sh first")
    for f in (CLASSIFIER_DIR / "model.onnx", CNN_DIR / "model.onnx"):
        if not f.exists():
            sys.exit(f"{f} is missing: run scripts/gen_test_models.py first")

    gen_test_images.main()
    write_minilm_reference()
    write_embed_reference()
    write_classifier_reference()
    write_reranker_reference()
    write_cnn_reference()
    return 0


if __name__ == "__main__":
    sys.exit(main())
