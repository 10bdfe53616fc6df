#!/usr/bin/env python3
"""Rewrites a BERT-family text encoder so ONNX Runtime's CPU kernels run it in fewer, larger
operators: faster on one thread, and much faster on several (the small operators between the
matrix products do not parallelise, so they bound what a second thread can win).

    .venv/bin/python scripts/optimize_model.py IN.onnx OUT.onnx [--num-heads N]

Three passes, each ONNX Runtime's own operators:

1. ONNX Runtime's basic graph optimisation, saved: constant folding. A weight-quantised model
   (int8 initializers behind Cast and Mul) becomes its fp32 weights, which is what ONNX
   Runtime computes with anyway.
2. onnxruntime.transformers' BERT fusions: SkipLayerNormalization, BiasGelu, and the others
   its patterns find.
3. Attention as torch's exporter writes scaled_dot_product_attention, which pass 2 does not
   recognise (Q and K scaled apart, K transposed through reshapes, a key-padding mask built
   from attention_mask, NaN rows zeroed after the softmax): each such block becomes one
   com.microsoft Attention node with the Q, K and V projections in one matrix product and
   attention_mask as its key-padding mask.

The result is checked before it is written: both models run on padded batches of random
token ids, and every output must agree within --tolerance (default 1e-4, the tests' bound
against onnxruntime's reference); otherwise nothing is written and the exit status is 1.
Pass 3 needs the number of heads: read from the graph (the head split's reshape) when it is
a constant there, else give --num-heads. docs/tuning.md ("Text models") has the figures.
"""

import argparse
import collections
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MASK_INPUT = "attention_mask"


def fold_constants(src, dst):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = dst
    ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])


def transformer_fusions(path, num_heads):
    # Imported here: onnxruntime.transformers needs sympy, only this pass does.
    from onnxruntime.transformers.optimizer import optimize_model

    # opt_level 0: the fusions only; ONNX Runtime's own optimisations run when a session loads.
    fused = optimize_model(path, model_type="bert", num_heads=num_heads, hidden_size=0, opt_level=0)
    stats = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    return fused.model, stats


class Graph:
    """What the attention pass looks up: producers, consumers and constant values."""

    def __init__(self, model):
        self.graph = model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers = collections.defaultdict(list)
        for n in self.graph.node:
            for name in n.input:
                self.consumers[name].append(n)

    def op(self, name, *types):
        node = self.producer.get(name)
        if node is None or node.op_type not in types:
            raise LookupError(f"{name} is not made by {'/'.join(types)}")
        return node

    def const(self, name):
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        raise LookupError(f"{name} is not a constant")

    def only_consumer(self, name, op_type):
        users = [n for n in self.consumers[name] if n.op_type == op_type]
        if len(users) != 1:
            raise LookupError(f"{name} feeds {len(users)} {op_type} nodes")
        return users[0]

    def projection(self, name):
        """Walks up reshapes, transposes and scalings to `x @ W + b`: (x, W, b, scale, reshapes)."""
        scale, reshapes = 1.0, []
        while True:
            node = self.op(name, "Reshape", "Transpose", "Mul", "Div", "Add")
            if node.op_type in ("Reshape", "Transpose"):
                if node.op_type == "Reshape":
                    reshapes.append(node)
                name = node.input[0]
                continue
            const_at = [i for i, x in enumerate(node.input) if self._is_const(x)]
            if len(const_at) != 1:
                raise LookupError(f"{node.name}: expected one constant operand")
            value = self.const(node.input[const_at[0]])
            other = node.input[1 - const_at[0]]
            if node.op_type == "Add":
                matmul = self.op(other, "MatMul")
                weight = self.const(matmul.input[1])
                return matmul.input[0], weight, value, scale, reshapes
            if value.size != 1 or (node.op_type == "Div" and const_at[0] != 1):
                raise LookupError(f"{node.name}: not a scaling by one number")
            scale = scale * float(value) if node.op_type == "Mul" else scale / float(value)
            name = other

    def _is_const(self, name):
        try:
            self.const(name)
            return True
        except LookupError:
            return False

    def heads_from(self, reshapes, hidden):
        """The head count where a reshape splits the hidden size into (heads, head size): the
        target shape [batch, seq, heads, head size] may have -1 for one of the two."""
        for reshape in reshapes:
            try:
                shape = self.const(reshape.input[1]).reshape(-1)
            except LookupError:
                concat = self.producer.get(reshape.input[1])
                if concat is None or concat.op_type != "Concat" or len(concat.input) < 3:
                    continue
                try:  # the batch and sequence parts are the input's shape, the rest constants
                    shape = np.concatenate([[0, 0], *(self.const(i).reshape(-1) for i in concat.input[2:])])
                except LookupError:
                    continue
            if len(shape) != 4:
                continue
            heads, size = int(shape[2]), int(shape[3])
            if heads > 0 and (size <= 0 or heads * size == hidden):
                return heads
            if size > 0 and heads == -1 and hidden % size == 0:
                return hidden // size
        return None


def fuse_attention(model, num_heads):
    """Pass 3: returns the number of attention blocks replaced."""
    g = Graph(model)
    if MASK_INPUT not in {i.name for i in model.graph.input}:
        return 0, f"no {MASK_INPUT} input"
    mask = "optimize_model_mask_int32"
    replace, added = {}, []
    for softmax in [n for n in model.graph.node if n.op_type == "Softmax"]:
        try:
            add = g.op(softmax.input[0], "Add")  # scores + the mask's bias
            scores = g.op(add.input[0], "MatMul")
            xq, wq, bq, sq, rq = g.projection(scores.input[0])
            xk, wk, bk, sk, rk = g.projection(scores.input[1])
            probs = softmax.output[0]
            if any(n.op_type == "IsNaN" for n in g.consumers[probs]):
                probs = g.only_consumer(probs, "Where").output[0]
            context = g.only_consumer(probs, "MatMul")
            xv, wv, bv, _, rv = g.projection(context.input[1])
            merge = g.only_consumer(context.output[0], "Transpose")
            out = g.only_consumer(merge.output[0], "Reshape")
        except LookupError as e:
            return 0, str(e)
        if not (xq == xk == xv):
            return 0, "Q, K and V come from different inputs"
        heads = num_heads or g.heads_from(rq + rk + rv, wq.shape[1])
        if not heads:
            return 0, "the head count is not a constant in the graph: pass --num-heads"
        i = len(added)
        weights = numpy_helper.from_array(np.concatenate([wq, wk, wv], axis=1).astype(np.float32), f"attention_{i}_qkv_weight")
        bias = numpy_helper.from_array(np.concatenate([bq, bk, bv]).astype(np.float32), f"attention_{i}_qkv_bias")
        added += [weights, bias]
        replace[out.output[0]] = helper.make_node(
            "Attention", [xq, weights.name, bias.name, mask], [out.output[0]],
            name=f"attention_{i}", domain="com.microsoft", num_heads=heads, scale=sq * sk)
    if not replace:
        return 0, "no attention block found"

    nodes = [helper.make_node("Cast", [MASK_INPUT], [mask], name="attention_mask_int32", to=TensorProto.INT32)]
    nodes += [replace.get(n.output[0], n) if n.output else n for n in model.graph.node]
    # Keep only what the outputs still need: the old attention blocks and mask bias go.
    needed = {o.name for o in model.graph.output}
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    initializers = [i for i in list(model.graph.initializer) + added if i.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(replace), None


def sample_inputs(session, vocab, seed):
    """A padded batch of three random token sequences for every int64 [batch, seq] input."""
    rng = np.random.default_rng(seed)
    lengths = [5, 17, 40]
    width = max(lengths)
    ids = rng.integers(1000, vocab, size=(len(lengths), width), dtype=np.int64)
    ids[:, 0] = 101
    attention = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
        ids[row, n:] = 0
    feeds = {}
    for i in session.get_inputs():
        if i.name == MASK_INPUT:
            feeds[i.name] = attention
        elif "type" in i.name:
            feeds[i.name] = np.zeros_like(ids)
        else:
            feeds[i.name] = ids
    return feeds


def vocabulary(model):
    """Rows of the table input_ids index (the word embeddings); 1100 when there is none."""
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] in inits and "input_ids" in node.input[1:]:
            return int(inits[node.input[0]].dims[0])
    return 1100


def max_difference(original, optimized, vocab):
    sessions = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]) for p in (original, optimized)]
    worst = 0.0
    for seed in range(3):
        feeds = sample_inputs(sessions[0], vocab, seed)
        a, b = (s.run(None, feeds) for s in sessions)
        for x, y in zip(a, b):
            worst = max(worst, float(np.abs(x.astype(np.float64) - y).max()))
    return worst


def counts(model):
    return dict(collections.Counter(n.op_type for n in model.graph.node).most_common())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--num-heads", type=int, default=0, help="attention heads (default: read from the graph)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    before = onnx.load(args.input)
    with tempfile.TemporaryDirectory() as tmp:
        folded = os.path.join(tmp, "folded.onnx")
        fold_constants(args.input, folded)
        model, fusions = transformer_fusions(folded, args.num_heads)
        attention, why = fuse_attention(model, args.num_heads)
        candidate = os.path.join(tmp, "optimized.onnx")
        onnx.save(model, candidate)
        diff = max_difference(args.input, candidate, vocabulary(model))
        print(f"nodes: {len(before.graph.node)} -> {len(model.graph.node)}")
        print(f"fused: {fusions}; attention blocks: {attention}" + (f" ({why})" if why else ""))
        print(f"max abs difference from the original on padded batches: {diff:.2e}")
        print(f"operators: {counts(model)}")
        if not diff <= args.tolerance:
            sys.exit(f"optimize_model: outputs differ by {diff:.2e} > {args.tolerance:.0e}; {args.output} not written")
        tmp_out = args.output + ".tmp"
        onnx.save(model, tmp_out)
        os.replace(tmp_out, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
