#!/usr/bin/env python3
"""Generates the small ONNX models that inferd's tests load.

Run with the tooling venv (scripts/setup.sh makes it):

    .venv/bin/python scripts/gen_test_models.py          # write, then check with onnxruntime
    .venv/bin/python scripts/gen_test_models.py --bench  # also time the `slow` model

It writes tests/models/<name>/model.onnx and tests/models/<name>/model.toml.
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


MODELS = {"typed": typed_model, "slow": slow_model}


def write_if_changed(path, data):
    """Writes bytes to path through a temporary file; leaves an identical file alone."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def model_toml(name):
    return (
        f"# Test model generated by scripts/gen_test_models.py; do not edit.\n"
        f'name = "{name}"\n'
        f'version = "1"\n'
        f'file = "model.onnx"\n'
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


CHECKS = {"typed": check_typed, "slow": check_slow}


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

    if args.bench:
        bench_slow(OUT_DIR / "slow" / "model.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
