"""A BERT-base-shaped text embedding model with random weights, for memory benchmarks.

    .venv/bin/python scripts/gen_bert_base.py [OUT_DIR]     # default .cache/models/bertbase

12 layers, hidden 768, 12 heads, feed-forward 3072, vocabulary 30522 (the default model's
tokenizer, copied beside it): about 110 M fp32 weights, ~440 MB, as BERT-base. The weights
are seeded random numbers (N(0, 0.02)): the answers mean nothing, the memory and the compute
are those of the real thing. Not committed; bench/weights.sh generates it when missing.

    input_ids, attention_mask INT64 [batch, sequence] -> last_hidden_state FLOAT [batch, sequence, 768]
"""

import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, HEADS, FFN, LAYERS, VOCAB, POSITIONS = 768, 12, 3072, 12, 30522, 512
HEAD = HIDDEN // HEADS


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, ".cache/models/bertbase")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20261130)
    inits, nodes = [], []

    def weight(name, *shape, value=None):
        array = value if value is not None else rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        inits.append(numpy_helper.from_array(array, name))
        return name

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def layer_norm(x, name):
        g = weight(f"{name}.gamma", value=np.ones(HIDDEN, np.float32))
        b = weight(f"{name}.beta", value=np.zeros(HIDDEN, np.float32))
        return node("LayerNormalization", [x, g, b], f"{name}.out", axis=-1, epsilon=1e-12)

    def dense(x, name, n_in, n_out):
        w = weight(f"{name}.weight", n_in, n_out)
        b = weight(f"{name}.bias", value=np.zeros(n_out, np.float32))
        return node("Add", [node("MatMul", [x, w], f"{name}.mm"), b], f"{name}.out")

    # Embeddings: words + positions (first `sequence` rows), then LayerNorm.
    words = node("Gather", [weight("embeddings.word", VOCAB, HIDDEN), "input_ids"], "embeddings.words", axis=0)
    shape = node("Shape", ["input_ids"], "embeddings.shape")
    seq = node("Gather", [shape, const("one", np.array([1], np.int64))], "embeddings.seq", axis=0)
    positions = node(
        "Slice",
        [weight("embeddings.position", POSITIONS, HIDDEN), const("zero", np.array([0], np.int64)), seq],
        "embeddings.positions",
    )
    x = layer_norm(node("Add", [words, positions], "embeddings.sum"), "embeddings.norm")

    # Attention mask -> additive bias [batch, 1, 1, sequence]: 0 where 1, -10000 where 0.
    mask = node("Cast", ["attention_mask"], "mask.float", to=TensorProto.FLOAT)
    mask = node("Unsqueeze", [mask, const("mask.axes", np.array([1, 2], np.int64))], "mask.4d")
    bias = node("Mul", [node("Sub", [const("one.f", np.array(1.0, np.float32)), mask], "mask.inv"),
                        const("neg", np.array(-10000.0, np.float32))], "mask.bias")

    split_shape = const("split.shape", np.array([0, 0, HEADS, HEAD], np.int64))
    merge_shape = const("merge.shape", np.array([0, 0, HIDDEN], np.int64))
    scale = const("scale", np.array(1.0 / np.sqrt(HEAD), np.float32))
    for i in range(LAYERS):
        p = f"layer{i}"

        def heads(t, perm):
            return node("Transpose", [node("Reshape", [t, split_shape], f"{t}.split")], f"{t}.heads", perm=perm)

        q = heads(dense(x, f"{p}.q", HIDDEN, HIDDEN), [0, 2, 1, 3])
        k = heads(dense(x, f"{p}.k", HIDDEN, HIDDEN), [0, 2, 3, 1])
        v = heads(dense(x, f"{p}.v", HIDDEN, HIDDEN), [0, 2, 1, 3])
        scores = node("Add", [node("Mul", [node("MatMul", [q, k], f"{p}.qk"), scale], f"{p}.scaled"), bias], f"{p}.scores")
        probs = node("Softmax", [scores], f"{p}.probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctx.t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, merge_shape], f"{p}.ctx.merged")
        x = layer_norm(node("Add", [x, dense(ctx, f"{p}.o", HIDDEN, HIDDEN)], f"{p}.res1"), f"{p}.norm1")
        hidden = node("Gelu", [dense(x, f"{p}.ffn1", HIDDEN, FFN)], f"{p}.gelu")
        x = layer_norm(node("Add", [x, dense(hidden, f"{p}.ffn2", FFN, HIDDEN)], f"{p}.res2"), f"{p}.norm2")
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="output"))

    graph = helper.make_graph(
        nodes,
        "bertbase",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], producer_name="inferd")
    model.ir_version = 9
    onnx.save(model, os.path.join(out, "model.onnx"))
    shutil.copy(os.path.join(root, "models/minilm/tokenizer.json"), os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "model.toml"), "w") as f:
        f.write(
            'name = "bertbase"\nversion = "random-1"\nfile = "model.onnx"\ntask = "embedding"\n'
            '[tokenizer]\nfile = "tokenizer.json"\nmax_length = 128\n'
            '[embedding]\npooling = "mean"\nnormalize = true\n'
            '[warmup]\nbatch_sizes = [1]\ndynamic_dim = 16\n'
        )
    size = os.path.getsize(os.path.join(out, "model.onnx"))
    print(f"wrote {out}/model.onnx ({size / 1e6:.0f} MB, {sum(np.prod(t.dims) for t in inits) / 1e6:.1f} M weights)")


if __name__ == "__main__":
    main()
