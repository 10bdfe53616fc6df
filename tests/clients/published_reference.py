"""What a published model folder should answer, computed in Python the way its publishers'
libraries do, from the folder's own files, with onnxruntime running the ONNX file:

    published_reference.py embed DIR TEXTS_JSON [PROMPT_NAME]
        sentence-transformers: the prompt (PROMPT_NAME, else default_prompt_name) before each
        text, tokenizer.json cut at max_seq_length, the Pooling module's mode over the
        model's first output, each Dense module after it (torch's Linear and its
        activation_function, weights read from its model.safetensors here, by the format's
        own layout), L2 normalisation when modules.json has Normalize.
    published_reference.py sparse DIR TEXTS_JSON
        sentence-transformers' SparseEncoder (SpladePooling): per vocabulary entry, the
        largest log(1 + relu(logit)) over the tokens; the dense vectors.
    published_reference.py classify DIR TEXTS_JSON
        transformers' text classification: labels from id2label in id order, softmax of the
        logits, or sigmoid for problem_type multi_label_classification.
    published_reference.py strings FILE TEXTS_JSON
        a graph of onnxruntime-extensions' operators run with that library registered; also
        prints the library's path and libpython's, for [custom_ops].
    published_reference.py image DIR
        transformers' image processor with Pillow (preprocessor_config.json: shortest edge
        resized with its filter, centre crop, rescale, normalise), then the model's raw output
        for two generated images.

Prints JSON. Each text runs alone (batch 1, no padding), as the libraries' reference.
"""

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image
from tokenizers import Tokenizer

# The gradient images and the shortest-edge resize and crop of the pixels model's reference
# (this script's folder is on sys.path when it runs).
from pixels_reference import image as gradient
from pixels_reference import resized_crop


def load(folder, name):
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def session(folder):
    for rel in ("model.onnx", "onnx/model.onnx"):
        if (folder / rel).is_file():
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            return ort.InferenceSession(str(folder / rel), opts, providers=["CPUExecutionProvider"])
    sys.exit(f"no ONNX file in {folder}")


def tokenizer(folder, max_length):
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length)
    return tok


def feeds(sess, enc):
    values = {
        "input_ids": enc.ids,
        "attention_mask": enc.attention_mask,
        "token_type_ids": enc.type_ids,
    }
    return {i.name: np.array([values[i.name]], np.int64) for i in sess.get_inputs()}


def safetensors(path):
    """{name: float64 array} of a safetensors file: an 8-byte header length, a JSON header of
    dtype, shape and data offsets, then the data."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    data = raw[8 + size :]
    types = {"F32": np.float32, "F16": np.float16}
    return {
        name: np.frombuffer(data[t["data_offsets"][0] : t["data_offsets"][1]], types[t["dtype"]]).reshape(t["shape"]).astype(np.float64)
        for name, t in header.items()
        if name != "__metadata__"
    }


ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}


def dense_layers(folder, modules):
    """Each Dense module as a function of the pooled vector."""
    layers = []
    for m in modules:
        if m["type"].endswith(".Dense"):
            weights = safetensors(folder / m["path"] / "model.safetensors")
            act = ACTIVATIONS[load(folder, f"{m['path']}/config.json")["activation_function"].rsplit(".", 1)[-1]]
            w, b = weights["linear.weight"], weights.get("linear.bias", 0.0)
            layers.append(lambda v, w=w, b=b, act=act: act(w @ v + b))
    return layers


def embed(folder, texts, prompt_name):
    st = load(folder, "config_sentence_transformers.json") or {}
    name = prompt_name or st.get("default_prompt_name")
    prompt = st["prompts"][name] if name else ""
    modules = load(folder, "modules.json")
    pooling_path = next(m["path"] for m in modules if m["type"].endswith(".Pooling"))
    pooling = load(folder, f"{pooling_path}/config.json")
    mode = next(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True)
    normalize = any(m["type"].endswith(".Normalize") for m in modules)
    bert = load(folder, "sentence_bert_config.json")
    config = load(folder, "config.json")
    max_length = bert["max_seq_length"] if bert else config["max_position_embeddings"]
    tok, sess = tokenizer(folder, max_length), session(folder)
    rows = []
    for text in texts:
        enc = tok.encode(prompt + text)
        (tokens,) = sess.run([sess.get_outputs()[0].name], feeds(sess, enc))
        tokens = tokens[0].astype(np.float64)
        vector = {
            "pooling_mode_mean_tokens": lambda: tokens.mean(axis=0),
            "pooling_mode_max_tokens": lambda: tokens.max(axis=0),
            "pooling_mode_cls_token": lambda: tokens[0],
            "pooling_mode_lasttoken": lambda: tokens[-1],
        }[mode]()
        for layer in dense_layers(folder, modules):
            vector = layer(vector)
        if normalize:
            vector = vector / np.linalg.norm(vector)
        rows.append(vector.tolist())
    return {"prompt": prompt, "mode": mode, "normalize": normalize, "embeddings": rows}


def sparse(folder, texts):
    tok = tokenizer(folder, load(folder, "tokenizer_config.json")["model_max_length"])
    sess = session(folder)
    rows = []
    for text in texts:
        (logits,) = sess.run(None, feeds(sess, tok.encode(text)))
        rows.append(np.log1p(np.maximum(logits[0].astype(np.float64), 0)).max(axis=0).tolist())
    return {"vectors": rows}


def classify(folder, texts):
    config = load(folder, "config.json")
    labels = [config["id2label"][str(i)] for i in range(len(config["id2label"]))]
    sigmoid = config.get("problem_type") == "multi_label_classification"
    tok, sess = tokenizer(folder, load(folder, "tokenizer_config.json")["model_max_length"]), session(folder)
    rows = []
    for text in texts:
        (logits,) = sess.run(None, feeds(sess, tok.encode(text)))
        z = logits[0].astype(np.float64)
        p = 1 / (1 + np.exp(-z)) if sigmoid else np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        rows.append(p.tolist())
    return {"labels": labels, "scores": rows}


def strings(path, texts):
    import os
    import sysconfig

    import onnxruntime_extensions

    opts = ort.SessionOptions()
    opts.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    outputs = sess.run(None, {"text": np.array(texts, dtype=object)})
    return {
        "library": onnxruntime_extensions.get_library_path(),
        "libpython": os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")),
        "outputs": {o.name: v.tolist() for o, v in zip(sess.get_outputs(), outputs)},
    }


def image(folder):
    p = load(folder, "preprocessor_config.json")
    filters = {0: Image.NEAREST, 1: Image.LANCZOS, 2: Image.BILINEAR, 3: Image.BICUBIC}
    sess = session(folder)
    cases = []
    for width, height in ((40, 20), (21, 45)):
        img = gradient(width, height)
        crop = resized_crop(
            img, p["size"]["shortest_edge"], p["crop_size"]["width"], p["crop_size"]["height"], filters[p["resample"]]
        )
        x = np.asarray(crop, np.float32) * p["rescale_factor"]
        x = (x - np.array(p["image_mean"], np.float32)) / np.array(p["image_std"], np.float32)
        pixel_values = x.transpose(2, 0, 1)[None].astype(np.float32)
        (out,) = sess.run(None, {sess.get_inputs()[0].name: pixel_values})
        buf = io.BytesIO()
        img.save(buf, "PNG")
        cases.append(
            {"size": f"{width}x{height}", "png": base64.b64encode(buf.getvalue()).decode(), "expected": out[0].tolist()}
        )
    return cases


def colbert(folder, texts, is_query):
    """PyLate's ColBERT.encode (pylate/models/colbert.py: tokenize, insert_prefix_token,
    skiplist_mask, encode) on the folder's files: each text cut to its length less the
    marker, queries padded with the mask token to that length (attended only with
    attend_to_expansion_tokens), the marker after the first token, the Dense modules on every
    token, documents' padding and skiplist tokens left out, each vector normalised."""
    st = load(folder, "config_sentence_transformers.json")
    modules = load(folder, "modules.json")
    length = st["query_length"] if is_query else st["document_length"]
    prefix = st["query_prefix"] if is_query else st["document_prefix"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    mask_token = load(folder, "tokenizer_config.json")["mask_token"]
    mask_id = tok.token_to_id(mask_token)
    # PyLate pads with the mask token: sentence-transformers' max_seq_length is length - 1.
    tok.enable_truncation(length - 1)
    expand = is_query and st["do_query_expansion"]
    if expand:
        tok.enable_padding(length=length - 1, pad_id=mask_id, pad_token=mask_token)
    else:
        tok.enable_padding(pad_id=mask_id, pad_token=mask_token)
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc], np.int64)
    attention = np.array([e.attention_mask for e in enc], np.int64)
    types = np.array([e.type_ids for e in enc], np.int64)
    insert = lambda a, v: np.concatenate([a[:, :1], np.full((a.shape[0], 1), v, np.int64), a[:, 1:]], axis=1)
    ids, attention, types = insert(ids, tok.token_to_id(prefix)), insert(attention, 1), insert(types, 0)
    if is_query and st["attend_to_expansion_tokens"]:
        attention[:] = 1
    sess = session(folder)
    values = {"input_ids": ids, "attention_mask": attention, "token_type_ids": types}
    hidden = sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()})[0].astype(np.float64)
    for layer in dense_layers(folder, modules):
        hidden = np.apply_along_axis(layer, 2, hidden)
    if is_query and expand:
        masks = np.ones_like(ids, bool)
    elif is_query:
        masks = attention.astype(bool)
    else:
        # transformers' convert_tokens_to_ids: a word that is not a token is the unknown one.
        unk = tok.token_to_id(json.loads((folder / "tokenizer.json").read_text())["model"]["unk_token"])
        skip = [tok.token_to_id(w) if tok.token_to_id(w) is not None else unk for w in st["skiplist_words"]]
        masks = attention.astype(bool) & ~np.isin(ids, skip)
    rows = []
    for h, m in zip(hidden, masks):
        kept = h[m]
        rows.append((kept / np.maximum(np.linalg.norm(kept, axis=1, keepdims=True), 1e-12)).tolist())
    return {"vectors": rows, "ids": [list(map(int, i[m])) for i, m in zip(ids, masks)]}


def bge_m3(folder, texts):
    """FlagEmbedding's BGEM3FlagModel.encode (inference/embedder/encoder_only/m3.py:
    _process_token_weights, _process_colbert_vecs; finetune/.../m3/modeling.py:
    _dense_embedding with cls pooling, _sparse_embedding, _colbert_embedding) on the folder's
    files, texts cut at sentence_bert_config.json's max_seq_length, normalize_embeddings on."""
    max_length = load(folder, "sentence_bert_config.json")["max_seq_length"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(max_length)
    names = load(folder, "special_tokens_map.json")
    pad = tok.token_to_id(names["pad_token"])
    tok.enable_padding(pad_id=pad, pad_token=names["pad_token"])
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc], np.int64)
    attention = np.array([e.attention_mask for e in enc], np.int64)
    types = np.array([e.type_ids for e in enc], np.int64)
    sess = session(folder)
    values = {"input_ids": ids, "attention_mask": attention, "token_type_ids": types}
    h = sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()})[0].astype(np.float64)
    normalize = lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    dense = normalize(h[:, 0])
    sparse = safetensors(folder / "sparse_linear.safetensors")
    weights = np.maximum(h @ sparse["weight"].T + sparse["bias"], 0)[..., 0]
    unused = {tok.token_to_id(names[k]) for k in ("cls_token", "eos_token", "pad_token", "unk_token") if k in names}
    lexical = []
    for w_row, id_row in zip(weights, ids.tolist()):
        result = {}
        for w, idx in zip(w_row, id_row):
            if idx not in unused and w > 0:
                result[str(idx)] = max(result.get(str(idx), 0), float(w))
        lexical.append(result)
    colbert = safetensors(folder / "colbert_linear.safetensors")
    vecs = (h[:, 1:] @ colbert["weight"].T + colbert["bias"]) * attention[:, 1:][:, :, None]
    vecs = normalize(vecs)
    colbert_vecs = [v[: int(m.sum()) - 1].tolist() for v, m in zip(vecs, attention)]
    return {"dense_vecs": dense.tolist(), "lexical_weights": lexical, "colbert_vecs": colbert_vecs}


def main():
    kind, folder = sys.argv[1], Path(sys.argv[2])
    if kind == "bge-m3":
        result = bge_m3(folder, json.loads(sys.argv[3]))
    elif kind == "colbert":
        result = colbert(folder, json.loads(sys.argv[3]), sys.argv[4] == "query")
    elif kind == "embed":
        result = embed(folder, json.loads(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif kind == "sparse":
        result = sparse(folder, json.loads(sys.argv[3]))
    elif kind == "strings":
        result = strings(folder, json.loads(sys.argv[3]))
    elif kind == "classify":
        result = classify(folder, json.loads(sys.argv[3]))
    else:
        result = image(folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
