#!/usr/bin/env python3
"""Generates the small ONNX models that inferd's tests load.

Run with the tooling venv (scripts/setup.sh makes it):

    .venv/bin/python scripts/gen_test_models.py          # write, then check with onnxruntime
    .venv/bin/python scripts/gen_test_models.py --bench  # also time the `slow` model

It writes tests/models/<name>/model.onnx and tests/models/<name>/model.toml
(docs/configuration.md describes model.toml; the classification models'
[tokenizer], [classification] and [image] sections come from here too).
The output is byte-for-byte the same on every run (no timestamps, fixed names,
constants stored as raw little-endian bytes), so regenerating leaves no git diff.

Models:

typed  Every input has shape ["batch", 4].
         f32_in FLOAT    -> f32_out  = f32_in * 2 + 1     FLOAT   [batch, 4]
         f64_in DOUBLE   -> f64_out  = f64_in * 0.5       DOUBLE  [batch, 4]
         i32_in INT32    -> i32_out  = i32_in + 7         INT32   [batch, 4]
         i64_in INT64    -> i64_out  = i64_in * -3        INT64   [batch, 4]
         bool_in BOOL    -> bool_out = not bool_in        BOOL    [batch, 4]
         f16_in FLOAT16  -> f16_out  = f16_in * 2         FLOAT16 [batch, 4]
         f32_in          -> f32_sum  = sum over axis 1    FLOAT   [batch]

slow   x FLOAT ["batch", 256], iterations INT64 [1] -> y FLOAT ["batch", 256].
       A Loop runs iterations[0] times: x = tanh(x @ W). W (256x256) is built
       inside the graph as 0.06 * sin(0, 1, ..., 65535) so the file stays tiny.
       With iterations = [0], y == x. The cost grows linearly with iterations.

classifier  task = "classification", a text model (tokenizer: the default
       model's, models/minilm/tokenizer.json, max_length 128).
         input_ids, attention_mask, token_type_ids INT64 ["batch", "sequence"]
         -> logits FLOAT ["batch", 3], labels negative, neutral, positive (softmax).
       A hashed bag of words: each token id picks row (id mod 1000) of a 1000x16
       table built inside the graph as sin(row * freq[col]); the rows are averaged
       over attention_mask (masked mean pooling), then logits = pooled @ W + b
       with W 16x3 and b 3 stored in the file. token_type_ids enter as
       0 * their sum, so they are a real input that changes nothing. W was
       fitted once (least squares, rounded to 2 decimals) so that the four
       CLASSIFIER_SENTENCES rank their labels in four different orders.

classifier_probs  the classifier as exporters such as tf2onnx write one: its graph ends in its
       own Softmax (then an Identity), -> probs FLOAT ["batch", 3]; its model.toml names
       no activation, so inferd must read from the graph that the scores are probabilities.

reranker  task = "classification" with one label, "score" (sigmoid): a cross-encoder
       for /rerank. The classifier's graph with the positive column of W alone
       (logit = pooled @ W[:, 2:3] + b[2]) over the (query, text) pair, so a
       text's score depends on the query and on the text.

pixels task = "classification" of images whose "scores" are the model's input itself:
         pixel_values FLOAT ["batch", 3, 6, 8] -> Flatten -> pixels FLOAT ["batch", 144],
         labels p0..p143, activation none. Its model.toml resizes as Hugging Face's
       image processors do (shortest edge to 10, bicubic, centre crop 8x6), so a test
       can compare the pixels inferd fed it with Pillow's.

published/  model folders laid out as their publishers lay them out, without model.toml
       (inferd reads config.json, modules.json, 1_Pooling/config.json, ... instead):
       colbert       a PyLate ColBERT folder: st-embedder's graph and tokenizer with the
                     markers "[Q] " and "[D] " added, a pylate Dense module (16 -> 8, no
                     bias), query_length 12 (expanded with [MASK]), document_length 16,
                     punctuation skipped in documents
       bge-m3        a BGE-M3 folder: st-embedder's graph and tokenizer with FlagEmbedding's
                     heads as safetensors (colbert_linear 16 -> 16, sparse_linear 16 -> 1,
                     each with a bias), max_seq_length 24
       st-dense      st-embedder with two Dense modules (Tanh with a bias, Identity in F16)
                     between Pooling and Normalize, their weights in model.safetensors
       st-embedder   sentence-transformers with onnx/model.onnx: mean pooling, Normalize,
                     max_seq_length 32, prompts "query: "/"passage: " (default "query")
       st-lasttoken  optimum layout (model.onnx at the top): last-token pooling, no
                     Normalize, the length limit from config.json's max_position_embeddings
       text-classifier   BertForSequenceClassification, id2label NEG/NEU/POS (logits)
       text-multilabel   the same with problem_type multi_label_classification
       external-data a raw model (x FLOAT ["batch", 8] -> y = x @ W + b) whose weights are in
                     model.onnx_data beside it, as exporters write models over 2 GB
       splade        a sentence-transformers SparseEncoder (MLMTransformer + SpladePooling) over
                     a masked-LM head: logits [batch, sequence, vocabulary]
       image-classifier  ViTForImageClassification over the pixels model, 144 labels, with a
                     preprocessor_config.json (shortest edge 10, bicubic, crop 8x6, ImageNet
                     mean/std)
       Their tokenizer.json is a small WordPiece vocabulary made here (PUBLISHED_WORDS).
       The text models' token vectors depend on the token and on every token before it
       (a running sum), so mean, max, first and last token all differ.

tests/fixtures/strings.onnx  custom operators of onnxruntime-extensions (domain ai.onnx.contrib):
         text STRING ["n"] -> StringLower -> lower STRING ["n"]
                           -> StringLength -> length INT64 ["n"]
       (no model.toml: the library's path is the machine's, so tests/published.rs writes it)

mlp    a raw model with the two kinds of weighted node the int8 rewrite quantises:
         x FLOAT ["batch", 16] -> MatMul W1 [16, 64] -> Add b1 -> Relu
           -> Gemm (W2 [4, 64], transB = 1, bias b2 [4]) -> y FLOAT ["batch", 4]
       W1, W2, b1, b2 are fixed sine patterns (MLP_W1, ... below), so y = relu(x W1 + b1) W2^T + b2.

cnn    task = "classification", an image model (32x32 RGB, NCHW, (x/255 - 0.5) / 0.5).
         pixel_values FLOAT ["batch", 3, 32, 32] -> logits FLOAT ["batch", 4],
         labels red, green, blue, gray (softmax).
       Conv 3->3 (3x3, pad 1: each output channel is a blur of its own input
       channel plus a little of the others, bias +1 so the normalised -1..1
       values stay positive) -> Relu -> GlobalAveragePool -> Flatten -> Gemm 3->4.
       The Gemm scores colour c as CNN_GAIN * (mean of c - mean of the three)
       and gray as the constant CNN_GRAY_BIAS: a dominant channel wins clearly,
       and gray wins when the channels are about equal.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "models"

SLOW_DIM = 256
SLOW_SCALE = 0.06

CLASSIFIER_LABELS = ["negative", "neutral", "positive"]
CLASSIFIER_BUCKETS = 1000
CLASSIFIER_DIM = 16
# Column j of the hashed embedding table is sin(row * CLASSIFIER_FREQ[j]).
CLASSIFIER_FREQ = [0.5 + (j + 1) * 0.6180339887 for j in range(CLASSIFIER_DIM)]
# Fitted once by least squares so that the sentences below get the logits
# (-2, 0, 2), (2.5, 0, -2), (-1, 2, 0) and (0.5, 1.5, -1), then rounded.
CLASSIFIER_W = [
    [1.96, -0.16, -1.59],
    [0.65, -0.81, -0.04],
    [-0.90, 1.48, -0.02],
    [0.85, -1.14, -0.47],
    [-1.23, -0.10, 1.05],
    [-2.34, -0.13, 2.05],
    [2.68, 0.19, -2.36],
    [-0.20, 0.71, -0.39],
    [2.24, -0.41, -1.62],
    [-1.35, 0.29, 0.99],
    [0.22, -0.03, -0.15],
    [1.36, -0.88, -0.65],
    [-1.02, 0.02, 1.19],
    [0.93, -0.12, -0.96],
    [-2.14, -0.56, 1.76],
    [1.47, -1.43, -0.55],
]
CLASSIFIER_B = [0.0, 0.1, -0.1]
# scripts/make_reference.py writes tests/fixtures/classifier_reference.json for these.
CLASSIFIER_SENTENCES = [
    "I absolutely love this, it works wonderfully!",
    "This is the worst purchase I have ever made.",
    "The package arrived on Tuesday afternoon.",
    "Not bad, but the battery could be better.",
]
CLASSIFIER_RANKINGS = [
    ["positive", "neutral", "negative"],
    ["negative", "neutral", "positive"],
    ["neutral", "positive", "negative"],
    ["neutral", "negative", "positive"],
]
TOKENIZER = REPO / "models" / "minilm" / "tokenizer.json"

CNN_LABELS = ["red", "green", "blue", "gray"]
CNN_SIZE = 32
PIXELS_W, PIXELS_H, PIXELS_EDGE = 8, 6, 10
CNN_OWN = 0.9     # weight of a channel's own 3x3 blur in its conv output
CNN_CROSS = 0.05  # weight of each other channel's centre pixel
CNN_GAIN = 10.0
CNN_GRAY_BIAS = 3.0


def const(name, value, dtype):
    """An initializer holding `value` as a tensor of numpy `dtype` (raw bytes)."""
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name=name)


def make_model(graph):
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="inferd-gen-test-models",
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def typed_model():
    dims = ["batch", 4]
    inputs = [
        helper.make_tensor_value_info("f32_in", TensorProto.FLOAT, dims),
        helper.make_tensor_value_info("f64_in", TensorProto.DOUBLE, dims),
        helper.make_tensor_value_info("i32_in", TensorProto.INT32, dims),
        helper.make_tensor_value_info("i64_in", TensorProto.INT64, dims),
        helper.make_tensor_value_info("bool_in", TensorProto.BOOL, dims),
        helper.make_tensor_value_info("f16_in", TensorProto.FLOAT16, dims),
    ]
    outputs = [
        helper.make_tensor_value_info("f32_out", TensorProto.FLOAT, dims),
        helper.make_tensor_value_info("f64_out", TensorProto.DOUBLE, dims),
        helper.make_tensor_value_info("i32_out", TensorProto.INT32, dims),
        helper.make_tensor_value_info("i64_out", TensorProto.INT64, dims),
        helper.make_tensor_value_info("bool_out", TensorProto.BOOL, dims),
        helper.make_tensor_value_info("f16_out", TensorProto.FLOAT16, dims),
        helper.make_tensor_value_info("f32_sum", TensorProto.FLOAT, ["batch"]),
    ]
    initializers = [
        const("f32_two", 2.0, np.float32),
        const("f32_one", 1.0, np.float32),
        const("f64_half", 0.5, np.float64),
        const("i32_seven", 7, np.int32),
        const("i64_minus_three", -3, np.int64),
        const("f16_two", 2.0, np.float16),
        const("sum_axes", [1], np.int64),
    ]
    nodes = [
        helper.make_node("Mul", ["f32_in", "f32_two"], ["f32_doubled"], name="f32_mul"),
        helper.make_node("Add", ["f32_doubled", "f32_one"], ["f32_out"], name="f32_add"),
        helper.make_node("Mul", ["f64_in", "f64_half"], ["f64_out"], name="f64_mul"),
        helper.make_node("Add", ["i32_in", "i32_seven"], ["i32_out"], name="i32_add"),
        helper.make_node("Mul", ["i64_in", "i64_minus_three"], ["i64_out"], name="i64_mul"),
        helper.make_node("Not", ["bool_in"], ["bool_out"], name="bool_not"),
        helper.make_node("Mul", ["f16_in", "f16_two"], ["f16_out"], name="f16_mul"),
        helper.make_node(
            "ReduceSum", ["f32_in", "sum_axes"], ["f32_sum"], name="f32_reduce_sum", keepdims=0
        ),
    ]
    graph = helper.make_graph(nodes, "typed", inputs, outputs, initializer=initializers)
    return make_model(graph)


def slow_model():
    n = SLOW_DIM
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n]),
        helper.make_tensor_value_info("iterations", TensorProto.INT64, [1]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])]
    initializers = [
        const("w_start", 0.0, np.float32),
        const("w_limit", float(n * n), np.float32),
        const("w_delta", 1.0, np.float32),
        const("w_shape", [n, n], np.int64),
        const("w_scale", SLOW_SCALE, np.float32),
        const("trip_axes", [0], np.int64),
    ]

    # Loop body: (iteration number, condition, x) -> (condition, tanh(x @ W)).
    # W comes from the outer graph.
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
            helper.make_node("MatMul", ["x_in", "w"], ["xw"], name="body_matmul"),
            helper.make_node("Tanh", ["xw"], ["x_out"], name="body_tanh"),
        ],
        "slow_body",
        [
            helper.make_tensor_value_info("iter_num", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["batch", n]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, ["batch", n]),
        ],
    )
    nodes = [
        helper.make_node("Range", ["w_start", "w_limit", "w_delta"], ["w_index"], name="w_range"),
        helper.make_node("Sin", ["w_index"], ["w_sin"], name="w_sin"),
        helper.make_node("Reshape", ["w_sin", "w_shape"], ["w_square"], name="w_reshape"),
        helper.make_node("Mul", ["w_square", "w_scale"], ["w"], name="w_mul"),
        # Loop wants a scalar trip count; iterations has shape [1].
        helper.make_node("Squeeze", ["iterations", "trip_axes"], ["trip_count"], name="trip_squeeze"),
        helper.make_node("Loop", ["trip_count", "", "x"], ["y"], name="loop", body=body),
    ]
    graph = helper.make_graph(nodes, "slow", inputs, outputs, initializer=initializers)
    return make_model(graph)


def hashed_lookup(gathered):
    """The hashed embedding table both text graphs start with: initializers and nodes giving
    `gathered` = table[input_ids mod 1000], [batch, sequence, 16], with table[r, j] =
    sin(r * CLASSIFIER_FREQ[j]); also the axis constants `axis_1` and `axis_2` they share."""
    initializers = [
        const("rows_start", 0.0, np.float32),
        const("rows_limit", float(CLASSIFIER_BUCKETS), np.float32),
        const("rows_delta", 1.0, np.float32),
        const("freq", CLASSIFIER_FREQ, np.float32),
        const("buckets", CLASSIFIER_BUCKETS, np.int64),
        const("axis_1", [1], np.int64),
        const("axis_2", [2], np.int64),
    ]
    nodes = [
        helper.make_node("Range", ["rows_start", "rows_limit", "rows_delta"], ["rows"], name="table_range"),
        helper.make_node("Unsqueeze", ["rows", "axis_1"], ["rows_column"], name="table_unsqueeze"),
        helper.make_node("Mul", ["rows_column", "freq"], ["table_angles"], name="table_mul"),
        helper.make_node("Sin", ["table_angles"], ["table"], name="table_sin"),
        helper.make_node("Mod", ["input_ids", "buckets"], ["bucket_ids"], name="hash_mod"),
        helper.make_node("Gather", ["table", "bucket_ids"], [gathered], name="embed_gather", axis=0),
    ]
    return initializers, nodes


def classifier_model(w=CLASSIFIER_W, b=CLASSIFIER_B, name="classifier", softmax=False):
    text_dims = ["batch", "sequence"]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, text_dims),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, text_dims),
        helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, text_dims),
    ]
    outputs = [
        helper.make_tensor_value_info("probs" if softmax else "logits", TensorProto.FLOAT, ["batch", len(b)])
    ]
    initializers, nodes = hashed_lookup("token_vectors")
    initializers += [
        const("min_count", 1e-9, np.float32),
        const("zero", 0.0, np.float32),
        const("w", w, np.float32),
        const("b", b, np.float32),
    ]
    nodes += [
        # Masked mean over the sequence.
        helper.make_node("Cast", ["attention_mask"], ["mask"], name="mask_cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask", "axis_2"], ["mask_3d"], name="mask_unsqueeze"),
        helper.make_node("Mul", ["token_vectors", "mask_3d"], ["masked_vectors"], name="mask_mul"),
        helper.make_node("ReduceSum", ["masked_vectors", "axis_1"], ["vector_sum"], name="pool_sum", keepdims=0),
        helper.make_node("ReduceSum", ["mask", "axis_1"], ["token_count"], name="pool_count", keepdims=1),
        helper.make_node("Max", ["token_count", "min_count"], ["safe_count"], name="pool_clamp"),
        helper.make_node("Div", ["vector_sum", "safe_count"], ["pooled_text"], name="pool_div"),
        # token_type_ids: + 0 * their sum, so the input is used but changes nothing.
        helper.make_node("Cast", ["token_type_ids"], ["types"], name="types_cast", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["types", "axis_1"], ["types_sum"], name="types_sum", keepdims=1),
        helper.make_node("Mul", ["types_sum", "zero"], ["types_zero"], name="types_mul"),
        helper.make_node("Add", ["pooled_text", "types_zero"], ["pooled"], name="types_add"),
        # Linear head.
        helper.make_node("MatMul", ["pooled", "w"], ["scores"], name="head_matmul"),
        helper.make_node("Add", ["scores", "b"], ["logits"], name="head_add"),
    ]
    if softmax:
        nodes += [
            helper.make_node("Softmax", ["logits"], ["probabilities"], name="head_softmax", axis=-1),
            helper.make_node("Identity", ["probabilities"], ["probs"], name="head_identity"),
        ]
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    return make_model(graph)


def cnn_conv_weights():
    """[3, 3, 3, 3]: output channel c = CNN_OWN * 3x3 blur of channel c
    + CNN_CROSS * the centre pixel of each other channel."""
    blur = np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]], np.float64) / 16.0
    w = np.zeros((3, 3, 3, 3), np.float64)
    for out in range(3):
        for inp in range(3):
            if out == inp:
                w[out, inp] = CNN_OWN * blur
            else:
                w[out, inp, 1, 1] = CNN_CROSS
    return w


def cnn_gemm_weights():
    """[3, 4]: colour c scores CNN_GAIN * (x_c - mean(x)); gray scores nothing (its bias wins)."""
    w = np.zeros((3, len(CNN_LABELS)), np.float64)
    for c in range(3):
        w[:, c] = -CNN_GAIN / 3.0
        w[c, c] += CNN_GAIN
    return w


def cnn_model():
    n = CNN_SIZE
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, n, n])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", len(CNN_LABELS)])]
    initializers = [
        const("conv_w", cnn_conv_weights(), np.float32),
        const("conv_b", [1.0, 1.0, 1.0], np.float32),
        const("fc_w", cnn_gemm_weights(), np.float32),
        const("fc_b", [0.0, 0.0, 0.0, CNN_GRAY_BIAS], np.float32),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["pixel_values", "conv_w", "conv_b"],
            ["conv"],
            name="conv",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1),
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(nodes, "cnn", inputs, outputs, initializer=initializers)
    return make_model(graph)


MLP_IN, MLP_HIDDEN, MLP_OUT = 16, 64, 4


def mlp_weights():
    """W1 [16, 64], b1 [64], W2 [4, 64] (stored transposed, as Gemm's transB reads it), b2 [4]."""
    i = np.arange(MLP_IN)[:, None]
    h = np.arange(MLP_HIDDEN)[None, :]
    w1 = 0.3 * np.sin(0.7 * i + 1.3 * h + 0.1)
    b1 = 0.05 * np.cos(np.arange(MLP_HIDDEN))
    o = np.arange(MLP_OUT)[:, None]
    # Mostly positive, so the outputs are not small differences of large terms (where any
    # rounding is a large relative error).
    w2 = 0.2 * (1.5 + np.cos(0.9 * o + 0.4 * h))
    b2 = np.array([0.1, -0.2, 0.3, 0.0])
    return w1, b1, w2, b2


def mlp_model():
    w1, b1, w2, b2 = mlp_weights()
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", MLP_IN])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", MLP_OUT])]
    initializers = [
        const("w1", w1, np.float32),
        const("b1", b1, np.float32),
        const("w2", w2, np.float32),
        const("b2", b2, np.float32),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["xw1"], name="hidden"),
        helper.make_node("Add", ["xw1", "b1"], ["pre"], name="hidden_bias"),
        helper.make_node("Relu", ["pre"], ["h"], name="relu"),
        helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], name="out", transB=1),
    ]
    return make_model(helper.make_graph(nodes, "mlp", inputs, outputs, initializer=initializers))


def classifier_probs_model():
    return classifier_model(name="classifier_probs", softmax=True)


def pixels_model():
    n = 3 * PIXELS_H * PIXELS_W
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, PIXELS_H, PIXELS_W])]
    outputs = [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", n])]
    nodes = [helper.make_node("Flatten", ["pixel_values"], ["pixels"], name="flatten", axis=1)]
    return make_model(helper.make_graph(nodes, "pixels", inputs, outputs))


def reranker_model():
    return classifier_model([row[2:3] for row in CLASSIFIER_W], CLASSIFIER_B[2:3], "reranker")


MODELS = {
    "typed": typed_model,
    "slow": slow_model,
    "classifier": classifier_model,
    "classifier_probs": classifier_probs_model,
    "reranker": reranker_model,
    "cnn": cnn_model,
    "pixels": pixels_model,
    "mlp": mlp_model,
}


def write_if_changed(path, data):
    """Writes bytes to path through a temporary file; leaves an identical file alone."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def toml_list(values):
    return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in values) + "]"


def pipeline_toml(name):
    """The model.toml lines after `file`: the task and its sections ("" for raw models)."""
    if name in ("classifier", "classifier_probs", "reranker"):
        labels, activation = (["score"], "sigmoid") if name == "reranker" else (CLASSIFIER_LABELS, "softmax")
        # classifier_probs: no activation (read from the graph), as a published model's.
        head = 'output = "probs"\n' if name == "classifier_probs" else f'activation = "{activation}"\noutput = "logits"\n'
        return (
            f'task = "classification"\n'
            f"\n"
            f"[tokenizer]\n"
            f"# Relative to this folder: the default model's tokenizer (scripts/setup.sh fetches it).\n"
            f'file = "../../../models/minilm/tokenizer.json"\n'
            f"max_length = 128\n"
            f"\n"
            f"[classification]\n"
            f"labels = {toml_list(labels)}\n"
            f"{head}"
        )
    if name == "pixels":
        return (
            f'task = "classification"\n'
            f"\n"
            f"[classification]\n"
            f"labels = {toml_list([f'p{i}' for i in range(3 * PIXELS_H * PIXELS_W)])}\n"
            f'activation = "none"\n'
            f'output = "pixels"\n'
            f"\n"
            f"[image]\n"
            f"width = {PIXELS_W}\n"
            f"height = {PIXELS_H}\n"
            f'resize = "shortest_edge"\n'
            f"shortest_edge = {PIXELS_EDGE}\n"
            f'resample = "bicubic"\n'
        )
    if name == "cnn":
        return (
            f'task = "classification"\n'
            f"\n"
            f"[classification]\n"
            f"labels = {toml_list(CNN_LABELS)}\n"
            f'activation = "softmax"\n'
            f'output = "logits"\n'
            f"\n"
            f"[image]\n"
            f'input = "pixel_values"\n'
            f"width = {CNN_SIZE}\n"
            f"height = {CNN_SIZE}\n"
            f'channels = "RGB"\n'
            f'layout = "NCHW"\n'
            f"scale = {1 / 255!r}\n"
            f"mean = {toml_list([0.5, 0.5, 0.5])}\n"
            f"std = {toml_list([0.5, 0.5, 0.5])}\n"
            f"max_pixels = 40000000\n"
        )
    return ""


def model_toml(name):
    return (
        f"# Test model generated by scripts/gen_test_models.py; do not edit.\n"
        f'name = "{name}"\n'
        f'version = "1"\n'
        f'file = "model.onnx"\n'
        f"{pipeline_toml(name)}"
    ).encode()


def session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def check_typed(path):
    sess = session(path)
    feeds = {
        "f32_in": np.array([[1.5, -2.0, 0.0, 3.25], [10.0, -0.5, 7.0, 100.0]], np.float32),
        "f64_in": np.array([[1.0, -3.0, 0.25, 1e10], [2.0, 5.5, -8.0, 0.0]], np.float64),
        "i32_in": np.array([[0, -7, 100, 2147483640], [1, 2, 3, -2147483648]], np.int32),
        "i64_in": np.array([[1, -2, 0, 1 << 40], [5, 6, -7, 8]], np.int64),
        "bool_in": np.array([[True, False, True, False], [False, False, True, True]], np.bool_),
        "f16_in": np.array([[0.5, -1.0, 2.0, 1000.0], [3.0, 0.0, -0.25, 7.0]], np.float16),
    }
    want = {
        "f32_out": feeds["f32_in"] * np.float32(2) + np.float32(1),
        "f64_out": feeds["f64_in"] * 0.5,
        "i32_out": feeds["i32_in"] + np.int32(7),
        "i64_out": feeds["i64_in"] * np.int64(-3),
        "bool_out": np.logical_not(feeds["bool_in"]),
        "f16_out": feeds["f16_in"] * np.float16(2),
        "f32_sum": feeds["f32_in"].sum(axis=1, dtype=np.float32),
    }
    names = [o.name for o in sess.get_outputs()]
    assert names == list(want), names
    got = dict(zip(names, sess.run(names, feeds)))
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype, (name, actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        if np.issubdtype(expected.dtype, np.floating):
            assert np.allclose(actual, expected, rtol=1e-6, atol=0), (name, actual, expected)
        else:
            assert np.array_equal(actual, expected), (name, actual, expected)
    # A batch of one works too.
    one = {k: v[:1] for k, v in feeds.items()}
    assert sess.run(["f32_sum"], one)[0].shape == (1,)


def check_slow(path):
    sess = session(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, SLOW_DIM)).astype(np.float32)
    (y0,) = sess.run(["y"], {"x": x, "iterations": np.array([0], np.int64)})
    assert np.array_equal(y0, x), "iterations=0 must return x unchanged"

    w = (np.sin(np.arange(SLOW_DIM * SLOW_DIM, dtype=np.float32)) * np.float32(SLOW_SCALE)).reshape(
        SLOW_DIM, SLOW_DIM
    )
    expected = x
    for _ in range(3):
        expected = np.tanh(expected @ w)
    (y3,) = sess.run(["y"], {"x": x, "iterations": np.array([3], np.int64)})
    assert y3.shape == x.shape
    assert np.allclose(y3, expected, rtol=1e-4, atol=1e-5), np.abs(y3 - expected).max()
    assert np.isfinite(y3).all()


def softmax(logits):
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def text_feeds(id_rows, type_value=0):
    """Pads token id lists with 0 to the longest, as the server does."""
    length = max(len(r) for r in id_rows)
    input_ids = np.zeros((len(id_rows), length), np.int64)
    attention_mask = np.zeros((len(id_rows), length), np.int64)
    for row, ids in enumerate(id_rows):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    token_type_ids = np.full((len(id_rows), length), type_value, np.int64)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def check_classifier(path):
    sess = session(path)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    freq = np.asarray(CLASSIFIER_FREQ, np.float32)
    table = np.sin(np.arange(CLASSIFIER_BUCKETS, dtype=np.float32)[:, None] * freq[None, :])
    w = np.asarray(CLASSIFIER_W, np.float32)
    b = np.asarray(CLASSIFIER_B, np.float32)

    def expected(id_rows):
        return np.stack([table[np.asarray(ids) % CLASSIFIER_BUCKETS].mean(axis=0) @ w + b for ids in id_rows])

    # Ids past the table wrap around; padding and token_type_ids change nothing.
    rows = [[101, 7592, 999, 102], [101, 2023, 2003, 1037, 3231, 1012, 30521, 102]]
    (logits,) = sess.run(["logits"], text_feeds(rows))
    assert logits.shape == (2, len(CLASSIFIER_LABELS)), logits.shape
    assert np.allclose(logits, expected(rows), rtol=1e-4, atol=1e-4), (logits, expected(rows))
    (alone,) = sess.run(["logits"], text_feeds(rows[:1]))
    assert np.allclose(alone[0], logits[0], rtol=1e-5, atol=1e-6), "padding changed the logits"
    (typed,) = sess.run(["logits"], text_feeds(rows, type_value=1))
    assert np.array_equal(typed, logits), "token_type_ids changed the logits"

    if not TOKENIZER.exists():
        print(f"classifier: {TOKENIZER.relative_to(REPO)} is missing (run scripts/setup.sh); rankings not checked")
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.no_truncation()
    for sentence, ranking in zip(CLASSIFIER_SENTENCES, CLASSIFIER_RANKINGS):
        (logits,) = sess.run(["logits"], text_feeds([tok.encode(sentence).ids]))
        got = [CLASSIFIER_LABELS[i] for i in np.argsort(-logits[0], kind="stable")]
        assert got == ranking, (sentence, got, ranking, logits)


def cnn_pixels(rgb_images):
    """uint8 [batch, 32, 32, 3] -> the model's normalised NCHW input."""
    x = np.asarray(rgb_images, np.float32) * np.float32(1 / 255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def check_cnn(path):
    sess = session(path)
    n = CNN_SIZE
    cases = [
        ("red", (220, 30, 40)),
        ("green", (50, 200, 30)),
        ("blue", (20, 60, 230)),
        ("gray", (128, 128, 128)),
        ("gray", (200, 205, 195)),
        ("gray", (10, 10, 10)),
        ("red", (255, 120, 120)),
    ]
    images = np.stack([np.broadcast_to(np.asarray(rgb, np.uint8), (n, n, 3)) for _, rgb in cases])
    (logits,) = sess.run(["logits"], {"pixel_values": cnn_pixels(images)})
    assert logits.shape == (len(cases), len(CNN_LABELS)), logits.shape
    probs = softmax(logits.astype(np.float64))
    for (label, rgb), p in zip(cases, probs):
        order = np.argsort(-p, kind="stable")
        assert CNN_LABELS[order[0]] == label, (rgb, label, dict(zip(CNN_LABELS, p.round(3))))
        assert p[order[0]] - p[order[1]] > 0.3, (rgb, "margin too small", dict(zip(CNN_LABELS, p.round(3))))
    # One image alone gives what it gave in the batch.
    (one,) = sess.run(["logits"], {"pixel_values": cnn_pixels(images[:1])})
    assert np.allclose(one[0], logits[0], rtol=1e-5, atol=1e-5)


def check_mlp(path):
    w1, b1, w2, b2 = (w.astype(np.float32) for w in mlp_weights())
    x = np.sin(np.arange(3 * MLP_IN, dtype=np.float32)).reshape(3, MLP_IN) * np.float32(2)
    (y,) = session(path).run(["y"], {"x": x})
    want = np.maximum(x @ w1 + b1, 0) @ w2.T + b2
    assert y.shape == (3, MLP_OUT) and np.allclose(y, want, rtol=1e-5, atol=1e-5), (y, want)


def check_classifier_probs(path):
    """onnxruntime's own output: the classifier's logits, softmaxed once."""
    rows = [[101, 7592, 999, 102], [101, 2023, 2003, 1037, 3231, 1012, 30521, 102]]
    (probs,) = session(path).run(["probs"], text_feeds(rows))
    (logits,) = session(path.parent.parent / "classifier" / "model.onnx").run(["logits"], text_feeds(rows))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    assert np.allclose(probs, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6), (probs, logits)


def check_reranker(path):
    sess = session(path)
    rows = [[101, 7592, 102, 2088, 102], [101, 7592, 102, 3231, 1012, 102]]
    (logits,) = sess.run(["logits"], text_feeds(rows))
    assert logits.shape == (2, 1), logits.shape
    assert logits[0, 0] != logits[1, 0], "the text does not change the score"


def check_pixels(path):
    x = np.random.default_rng(0).random((2, 3, PIXELS_H, PIXELS_W), dtype=np.float32)
    (out,) = session(path).run(["pixels"], {"pixel_values": x})
    assert np.array_equal(out, x.reshape(2, -1))


CHECKS = {
    "typed": check_typed,
    "slow": check_slow,
    "classifier": check_classifier,
    "classifier_probs": check_classifier_probs,
    "reranker": check_reranker,
    "cnn": check_cnn,
    "pixels": check_pixels,
    "mlp": check_mlp,
}


def bench_slow(path):
    import onnxruntime as ort

    for threads in (1, 0):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        for batch in (1, 32):
            x = np.ones((batch, SLOW_DIM), np.float32)
            feeds = {"x": x, "iterations": np.array([100], np.int64)}
            sess.run(["y"], feeds)  # warm up
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                sess.run(["y"], feeds)
                runs.append(time.perf_counter() - start)
            label = "default" if threads == 0 else str(threads)
            print(
                f"slow: intra_op_num_threads={label} batch={batch}: "
                f"{min(runs) * 1000:.2f} ms per 100 iterations (min of 5, median "
                f"{sorted(runs)[2] * 1000:.2f} ms)"
            )


# --- published/: folders as exporters lay them out ------------------------------------------

PUBLISHED_DIR = OUT_DIR / "published"
# The token vectors are the hashed table's rows (hashed_lookup).
PUBLISHED_DIM = CLASSIFIER_DIM
SPLADE_BIAS = 8.0
PUBLISHED_WORDS = (
    "the a an is are was of to and in on for with this that it at by from as be or not but "
    "query passage search document question answer cat dog sat mat sun moon rain snow city river "
    "quick brown fox jumps over lazy good bad great terrible love hate weather today tomorrow "
    "package arrived battery could better worst purchase ever made works wonderfully absolutely "
    "i you we they he she what where when how why which who"
)


def published_vocab():
    vocab = {}
    for token in (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?:;'-")
        + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
        + PUBLISHED_WORDS.split()
    ):
        vocab.setdefault(token, len(vocab))
    return vocab


def published_tokenizer():
    """A BERT-style WordPiece tokenizer.json over a small vocabulary (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = published_vocab()
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return tok.to_str(pretty=True).encode() + b"\n"


def token_vectors_model(output="last_hidden_state", vocab=0):
    """input_ids, attention_mask, token_type_ids -> [batch, sequence, 16]: each token's table
    row plus 0.3 x the running sum of the rows up to it. With `vocab`, a masked-LM head on
    top: -> [batch, sequence, vocab] logits = hidden @ W - SPLADE_BIAS with
    W[j, v] = sin(0.37 v + 1.3 j) (mostly negative, so SPLADE's relu leaves a sparse vector)."""
    hidden = "hidden" if vocab else output
    text_dims = ["batch", "sequence"]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, text_dims)
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", "sequence", vocab or PUBLISHED_DIM])]
    initializers, nodes = hashed_lookup("own")
    initializers += [
        const("axis_scalar_1", 1, np.int64),
        const("carry", 0.3, np.float32),
        const("zero", 0.0, np.float32),
    ]
    nodes += [
        helper.make_node("CumSum", ["own", "axis_scalar_1"], ["running"], name="running_sum"),
        helper.make_node("Mul", ["running", "carry"], ["carried"], name="running_scale"),
        helper.make_node("Add", ["own", "carried"], ["vectors"], name="vectors_add"),
        # attention_mask and token_type_ids: + 0 x their sum, used but changing nothing.
        helper.make_node("Add", ["attention_mask", "token_type_ids"], ["other_ids"], name="other_add"),
        helper.make_node("Cast", ["other_ids"], ["other"], name="other_cast", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["other", "axis_1"], ["other_sum"], name="other_sum", keepdims=1),
        helper.make_node("Mul", ["other_sum", "zero"], ["other_zero"], name="other_mul"),
        helper.make_node("Unsqueeze", ["other_zero", "axis_2"], ["other_zero_3d"], name="other_unsqueeze"),
        helper.make_node("Add", ["vectors", "other_zero_3d"], [hidden], name="output_add"),
    ]
    if vocab:
        j, v = np.meshgrid(np.arange(PUBLISHED_DIM), np.arange(vocab), indexing="ij")
        initializers.append(const("mlm_w", np.sin(0.37 * v + 1.3 * j), np.float32))
        initializers.append(const("mlm_b", -SPLADE_BIAS, np.float32))
        nodes.append(helper.make_node("MatMul", [hidden, "mlm_w"], ["mlm_scores"], name="mlm_head"))
        nodes.append(helper.make_node("Add", ["mlm_scores", "mlm_b"], [output], name="mlm_bias"))
    return make_model(helper.make_graph(nodes, "token_vectors", inputs, outputs, initializer=initializers))


def json_bytes(value):
    import json

    return (json.dumps(value, indent=2) + "\n").encode()


def st_modules(normalize):
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    return modules


def safetensors_bytes(tensors):
    """A safetensors file of {name: array} (F32 or F16), written by hand: an 8-byte little-endian
    header length, the JSON header (padded with spaces to 8 bytes), then the tensors' bytes."""
    import json
    import struct

    header, data = {}, b""
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        dtype = {np.float32: "F32", np.float16: "F16"}[array.dtype.type]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def st_dense_folder(base):
    """st-embedder with two Dense modules between Pooling and Normalize: Tanh with a bias
    (PUBLISHED_DIM -> 12, F32), then Identity without one (12 -> 8, F16)."""
    rng = np.random.default_rng(20261206)
    first = {
        "linear.weight": (rng.standard_normal((12, PUBLISHED_DIM)) * 0.3).astype(np.float32),
        "linear.bias": (rng.standard_normal(12) * 0.1).astype(np.float32),
    }
    second = {"linear.weight": (rng.standard_normal((8, 12)) * 0.4).astype(np.float16)}
    folder = dict(base)
    folder["modules.json"] = json_bytes(
        st_modules(False)
        + [
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
    )
    folder["2_Dense/config.json"] = json_bytes(
        {"in_features": PUBLISHED_DIM, "out_features": 12, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"}
    )
    folder["2_Dense/model.safetensors"] = safetensors_bytes(first)
    folder["3_Dense/config.json"] = json_bytes(
        {"in_features": 12, "out_features": 8, "bias": False, "activation_function": "torch.nn.modules.linear.Identity"}
    )
    folder["3_Dense/model.safetensors"] = safetensors_bytes(second)
    return folder


def colbert_folder(base):
    """A PyLate ColBERT folder as PyLate saves one: the transformer, then PyLate's Dense
    module projecting each token's vector (PUBLISHED_DIM -> 8, no bias); the markers PyLate
    adds to the tokenizer ("[Q] ", "[D] "); its recipe in config_sentence_transformers.json."""
    import string

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(base["tokenizer.json"].decode())
    tok.add_tokens(["[Q] ", "[D] "])
    rng = np.random.default_rng(20261208)
    return {
        "onnx/model.onnx": base["onnx/model.onnx"],
        "tokenizer.json": tok.to_str(pretty=True).encode() + b"\n",
        "tokenizer_config.json": json_bytes({"model_max_length": 512, "mask_token": "[MASK]", "pad_token": "[MASK]"}),
        "config.json": base["config.json"],
        "modules.json": json_bytes(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
            ]
        ),
        "1_Dense/config.json": json_bytes(
            {
                "in_features": PUBLISHED_DIM,
                "out_features": 8,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
                "use_residual": False,
            }
        ),
        "1_Dense/model.safetensors": safetensors_bytes(
            {"linear.weight": (rng.standard_normal((8, PUBLISHED_DIM)) * 0.4).astype(np.float32)}
        ),
        "config_sentence_transformers.json": json_bytes(
            {
                "model_type": "ColBERT",
                "prompts": {},
                "default_prompt_name": None,
                "similarity_fn_name": "MaxSim",
                "query_prefix": "[Q] ",
                "document_prefix": "[D] ",
                "query_length": 12,
                "document_length": 16,
                "attend_to_expansion_tokens": False,
                "skiplist_words": list(string.punctuation),
                "do_query_expansion": True,
            }
        ),
    }


def bge_m3_folder(base):
    """A BGE-M3 folder as BAAI publishes it (sentence-transformers files: CLS pooling and
    Normalize), with FlagEmbedding's two heads (torch.nn.Linear state dicts: weight, bias)
    as safetensors instead of its colbert_linear.pt / sparse_linear.pt pickles."""
    rng = np.random.default_rng(20261209)
    folder = dict(base)
    folder["modules.json"] = json_bytes(st_modules(True))
    folder["1_Pooling/config.json"] = json_bytes(st_pooling("cls_token"))
    folder["sentence_bert_config.json"] = json_bytes({"max_seq_length": 24, "do_lower_case": False})
    folder["config_sentence_transformers.json"] = json_bytes({"prompts": {}, "similarity_fn_name": "cosine"})
    folder["special_tokens_map.json"] = json_bytes(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
    )
    folder["colbert_linear.safetensors"] = safetensors_bytes(
        {
            "weight": (rng.standard_normal((PUBLISHED_DIM, PUBLISHED_DIM)) * 0.3).astype(np.float32),
            "bias": (rng.standard_normal(PUBLISHED_DIM) * 0.1).astype(np.float32),
        }
    )
    folder["sparse_linear.safetensors"] = safetensors_bytes(
        {
            "weight": (rng.standard_normal((1, PUBLISHED_DIM)) * 0.3).astype(np.float32),
            "bias": np.array([0.05], np.float32),
        }
    )
    return folder


def st_pooling(mode):
    keys = ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken"]
    config = {"word_embedding_dimension": PUBLISHED_DIM}
    config.update({f"pooling_mode_{k}": k == mode for k in keys})
    config["include_prompt"] = True
    return config


def bert_config(architecture, max_positions, **extra):
    config = {
        "architectures": [architecture],
        "hidden_size": PUBLISHED_DIM,
        "max_position_embeddings": max_positions,
        "model_type": "bert",
        "vocab_size": CLASSIFIER_BUCKETS,
        "transformers_version": "4.57.1",
    }
    config.update(extra)
    return config


def published_folders():
    """{folder: {relative path: bytes}}."""
    tokenizer = published_tokenizer()
    vectors = token_vectors_model().SerializeToString()
    labels = {"0": "NEG", "1": "NEU", "2": "POS"}
    folders = {
        "st-embedder": {
            "onnx/model.onnx": vectors,
            "tokenizer.json": tokenizer,
            "tokenizer_config.json": json_bytes({"model_max_length": 512, "tokenizer_class": "BertTokenizer"}),
            "config.json": json_bytes(bert_config("BertModel", 64)),
            "modules.json": json_bytes(st_modules(True)),
            "1_Pooling/config.json": json_bytes(st_pooling("mean_tokens")),
            "sentence_bert_config.json": json_bytes({"max_seq_length": 32, "do_lower_case": False}),
            "config_sentence_transformers.json": json_bytes(
                {
                    "prompts": {"query": "query: ", "passage": "passage: "},
                    "default_prompt_name": "query",
                    "similarity_fn_name": "cosine",
                }
            ),
        },
        "st-lasttoken": {
            "model.onnx": vectors,
            "tokenizer.json": tokenizer,
            # transformers' "no limit": the model's positions bound the length.
            "tokenizer_config.json": json_bytes({"model_max_length": 1000000000000000019884624838656}),
            "config.json": json_bytes(bert_config("BertModel", 24)),
            "modules.json": json_bytes(st_modules(False)),
            "1_Pooling/config.json": json_bytes(st_pooling("lasttoken")),
        },
    }
    folders["st-dense"] = st_dense_folder(folders["st-embedder"])
    folders["colbert"] = colbert_folder(folders["st-embedder"])
    folders["bge-m3"] = bge_m3_folder(folders["st-embedder"])
    for name, problem in (("text-classifier", "single_label_classification"), ("text-multilabel", "multi_label_classification")):
        folders[name] = {
            "model.onnx": classifier_model(name=name).SerializeToString(),
            "tokenizer.json": tokenizer,
            "tokenizer_config.json": json_bytes({"model_max_length": 128}),
            # id2label as transformers writes it, listed out of id order here to show order is by id.
            "config.json": json_bytes(
                bert_config(
                    "BertForSequenceClassification",
                    512,
                    id2label={"2": labels["2"], "0": labels["0"], "1": labels["1"]},
                    label2id={v: int(k) for k, v in labels.items()},
                    problem_type=problem,
                )
            ),
        }
    folders["external-data"] = external_data_files()
    vocab = len(published_vocab())
    folders["splade"] = {
        "model.onnx": token_vectors_model("logits", vocab).SerializeToString(),
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": json_bytes({"model_max_length": 64}),
        "config.json": json_bytes(bert_config("BertForMaskedLM", 512, vocab_size=vocab)),
        "modules.json": json_bytes(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_SpladePooling",
                    "type": "sentence_transformers.sparse_encoder.models.SpladePooling",
                },
            ]
        ),
        "1_SpladePooling/config.json": json_bytes(
            {"pooling_strategy": "max", "activation_function": "relu", "word_embedding_dimension": vocab}
        ),
    }
    n = 3 * PIXELS_H * PIXELS_W
    folders["image-classifier"] = {
        "model.onnx": pixels_model().SerializeToString(),
        "config.json": json_bytes(
            {
                "architectures": ["ViTForImageClassification"],
                "id2label": {str(i): f"p{i}" for i in range(n)},
                "model_type": "vit",
                "image_size": PIXELS_W,
            }
        ),
        "preprocessor_config.json": json_bytes(
            {
                "do_center_crop": True,
                "crop_size": {"height": PIXELS_H, "width": PIXELS_W},
                "do_normalize": True,
                "do_rescale": True,
                "do_resize": True,
                "image_mean": [0.485, 0.456, 0.406],
                "image_processor_type": "ViTImageProcessor",
                "image_std": [0.229, 0.224, 0.225],
                "resample": 3,
                "rescale_factor": 0.00392156862745098,
                "size": {"shortest_edge": PIXELS_EDGE},
            }
        ),
    }
    return folders


def external_data_files():
    """{"model.onnx": graph, "model.onnx_data": W then b} (the weights outside the graph)."""
    import tempfile

    from onnx import external_data_helper

    j, i = np.meshgrid(np.arange(8), np.arange(8))
    initializers = [const("w", np.sin(i * 0.7 + j * 1.1), np.float32), const("b", np.arange(8) * 0.25, np.float32)]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "b"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializer=initializers,
    )
    model = make_model(graph)
    external_data_helper.convert_model_to_external_data(
        model, all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=0
    )
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save_model(model, os.path.join(tmp, "model.onnx"))
        return {name: Path(tmp, name).read_bytes() for name in ("model.onnx", "model.onnx_data")}


def check_published(folder, files):
    from tokenizers import Tokenizer

    if "tokenizer.json" in files:
        tok = Tokenizer.from_str(files["tokenizer.json"].decode())
        enc = tok.encode("Query: the quick brown fox")
        assert enc.tokens == ["[CLS]", "query", ":", "the", "quick", "brown", "fox", "[SEP]"], enc.tokens
    onnx_file = "onnx/model.onnx" if "onnx/model.onnx" in files else "model.onnx"
    sess = session(folder / onnx_file)
    if folder.name == "external-data":
        x = np.arange(16, dtype=np.float32).reshape(2, 8)
        (y,) = sess.run(None, {"x": x})
        j, i = np.meshgrid(np.arange(8), np.arange(8))
        assert np.allclose(y, x @ np.sin(i * 0.7 + j * 1.1).astype(np.float32) + np.arange(8) * 0.25, atol=1e-5)
    if folder.name == "splade":
        (out,) = sess.run(None, text_feeds([[2, 40, 41, 3]]))
        assert out.shape == (1, 4, len(published_vocab()))
        share = (out.max(axis=1) > 0).mean()
        assert 0.05 < share < 0.5, f"SPLADE test vector not sparse enough: {share}"
    if folder.name.startswith("st-"):
        feeds = text_feeds([[2, 40, 41, 3]])
        (out,) = sess.run(None, feeds)
        assert out.shape == (1, 4, PUBLISHED_DIM)
        assert not np.allclose(out[0, 0], out[0, 1])


def strings_model():
    contrib = "ai.onnx.contrib"
    nodes = [
        helper.make_node("StringLower", ["text"], ["lower"], name="lower", domain=contrib),
        helper.make_node("StringLength", ["text"], ["length"], name="length", domain=contrib),
    ]
    graph = helper.make_graph(
        nodes,
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])],
        [
            helper.make_tensor_value_info("lower", TensorProto.STRING, ["n"]),
            helper.make_tensor_value_info("length", TensorProto.INT64, ["n"]),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(contrib, 1)],
        producer_name="inferd-gen-test-models",
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    return model


def cumsum_model():
    """A running sum over a vector of any length: its first dimension ("n") is no batch, and
    a request cut in pieces would restart the sum at every piece."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])]
    nodes = [helper.make_node("CumSum", ["x", "axis"], ["y"], name="cumsum")]
    graph = helper.make_graph(nodes, "cumsum", inputs, outputs, initializer=[const("axis", 0, np.int64)])
    return make_model(graph)


def centered_model():
    """Rows less the mean of every row of the request: a graph that names its first dimension
    "batch" although each answer depends on every row (model.toml must say
    max_batch_size = 0)."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], name="mean", axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["y"], name="centre"),
    ]
    return make_model(helper.make_graph(nodes, "centered", inputs, outputs))


def check_order_dependent(cumsum, centered):
    x = np.arange(1, 41, dtype=np.float32)
    (y,) = session(cumsum).run(None, {"x": x})
    assert np.array_equal(y, np.cumsum(x)), y
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    (y,) = session(centered).run(None, {"x": rows})
    assert np.allclose(y, rows - rows.mean(axis=0)), y


ORDER_DEPENDENT = {"cumsum": cumsum_model, "centered": centered_model}


def bytes_identity_model():
    """BYTES in, the same BYTES out (Triton's `simple_identity` in ONNX): any byte, NUL
    included, must come back as it went in."""
    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["batch"])]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["batch"])]
    nodes = [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity")]
    return make_model(helper.make_graph(nodes, "bytes_identity", inputs, outputs))


def one_string_model():
    """One BYTES element a row in, the same out (Triton's `onnx_zero_1_object_1_element`):
    the one shape a raw binary request may fill with a string, the whole body."""
    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["batch", 1])]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["batch", 1])]
    nodes = [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity")]
    return make_model(helper.make_graph(nodes, "one_string", inputs, outputs))


def check_one_string(path):
    items = np.array([["4\x0027"]], dtype=object)
    (out,) = session(path).run(None, {"INPUT0": items})
    assert out.tolist() == items.tolist(), out


def prompt_echo_model():
    """Triton's `mock_llm` (qa/python_models/generate_models) in ONNX, as its generate tests
    call it without streaming: a prompt and a flag in, the prompt back as TEXT; `input_ids`, an
    input with an initializer ([[7]]), is optional (Triton's `optional: true`), its sum IDS."""
    inputs = [
        helper.make_tensor_value_info("PROMPT", TensorProto.STRING, [1, 1]),
        helper.make_tensor_value_info("STREAM", TensorProto.BOOL, [1, 1]),
        helper.make_tensor_value_info("input_ids", TensorProto.INT32, [1, "ids"]),
    ]
    outputs = [
        helper.make_tensor_value_info("TEXT", TensorProto.STRING, [1, 1]),
        helper.make_tensor_value_info("IDS", TensorProto.INT32, [1, 1]),
    ]
    nodes = [
        helper.make_node("Where", ["STREAM", "PROMPT", "PROMPT"], ["TEXT"], name="echo"),
        helper.make_node("ReduceSum", ["input_ids", "axes"], ["IDS"], name="ids", keepdims=1),
    ]
    initializer = [
        helper.make_tensor("input_ids", TensorProto.INT32, [1, 1], [7]),
        const("axes", [1], np.int64),
    ]
    return make_model(helper.make_graph(nodes, "prompt_echo", inputs, outputs, initializer=initializer))


def check_prompt_echo(path):
    feeds = {"PROMPT": np.array([["hello world"]], dtype=object), "STREAM": np.array([[False]])}
    sess = session(path)
    assert [o.name for o in sess.get_overridable_initializers()] == ["input_ids"]
    text, ids = sess.run(None, feeds)
    assert text.tolist() == [["hello world"]] and ids.tolist() == [[7]], (text, ids)
    _, ids = sess.run(None, {**feeds, "input_ids": np.array([[100, 200]], dtype=np.int32)})
    assert ids.tolist() == [[300]], ids


def digits_model():
    """Strings of digits cast to numbers (as Triton's `simple_string`): an empty string, the
    default warm-up's input, makes the run fail; `[warmup.inputs]` gives it digits."""
    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["batch", 16])]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", 16])]
    nodes = [helper.make_node("Cast", ["INPUT0"], ["OUTPUT0"], name="to_int", to=TensorProto.INT32)]
    return make_model(helper.make_graph(nodes, "digits", inputs, outputs))


def check_digits(path):
    sess = session(path)
    (out,) = sess.run(None, {"INPUT0": np.array([[str(i) for i in range(16)]], dtype=object)})
    assert out.tolist() == [list(range(16))], out
    try:
        sess.run(None, {"INPUT0": np.array([[""] * 16], dtype=object)})
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types
        return
    raise AssertionError("an empty string was cast")


def check_bytes_identity(path):
    items = np.array(["he\x00llo", "Wörld", ""], dtype=object)
    (out,) = session(path).run(None, {"INPUT0": items})
    assert list(out) == list(items), out


def check_strings(path):
    import onnxruntime as ort
    import onnxruntime_extensions

    opts = ort.SessionOptions()
    opts.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    lower, length = sess.run(None, {"text": np.array(["Hello Wörld", "ABC"], dtype=object)})
    assert list(lower) == ["hello wörld", "abc"] and list(length) == [11, 3], (lower, length)


def write_published():
    for name, files in published_folders().items():
        folder = PUBLISHED_DIR / name
        changed = False
        for rel, data in files.items():
            changed |= write_if_changed(folder / rel, data)
        print(f"{folder.relative_to(REPO)}/: {'written' if changed else 'unchanged'} ({len(files)} files)")
        yield folder, files


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="do not run the models with onnxruntime")
    parser.add_argument("--bench", action="store_true", help="time the slow model")
    args = parser.parse_args()

    for name, build in MODELS.items():
        model_dir = OUT_DIR / name
        model_path = model_dir / "model.onnx"
        changed = write_if_changed(model_path, build().SerializeToString())
        changed |= write_if_changed(model_dir / "model.toml", model_toml(name))
        rel = model_path.relative_to(REPO)
        print(f"{rel}: {'written' if changed else 'unchanged'} ({model_path.stat().st_size} bytes)")
        if not args.no_check:
            CHECKS[name](model_path)
            print(f"{rel}: onnxruntime check passed")

    strings = REPO / "tests" / "fixtures" / "strings.onnx"
    changed = write_if_changed(strings, strings_model().SerializeToString())
    print(f"{strings.relative_to(REPO)}: {'written' if changed else 'unchanged'}")
    if not args.no_check:
        check_strings(strings)
        print(f"{strings.relative_to(REPO)}: onnxruntime check passed (onnxruntime-extensions)")

    # Graphs whose rows are not a batch (tests/batching.rs): fixtures, not repository models.
    paths = []
    for name, build in ORDER_DEPENDENT.items():
        path = REPO / "tests" / "fixtures" / f"{name}.onnx"
        changed = write_if_changed(path, build().SerializeToString())
        print(f"{path.relative_to(REPO)}: {'written' if changed else 'unchanged'}")
        paths.append(path)
    if not args.no_check:
        check_order_dependent(*paths)
        print("tests/fixtures/cumsum.onnx, centered.onnx: onnxruntime check passed")
    for name, build, check in [
        ("bytes_identity", bytes_identity_model, check_bytes_identity),
        ("digits", digits_model, check_digits),
        ("one_string", one_string_model, check_one_string),
        ("prompt_echo", prompt_echo_model, check_prompt_echo),
    ]:
        path = REPO / "tests" / "fixtures" / f"{name}.onnx"
        changed = write_if_changed(path, build().SerializeToString())
        print(f"{path.relative_to(REPO)}: {'written' if changed else 'unchanged'}")
        if not args.no_check:
            check(path)
            print(f"{path.relative_to(REPO)}: onnxruntime check passed")

    for folder, files in write_published():
        if not args.no_check:
            check_published(folder, files)
            print(f"{folder.relative_to(REPO)}/: onnxruntime check passed")

    if args.bench:
        bench_slow(OUT_DIR / "slow" / "model.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
