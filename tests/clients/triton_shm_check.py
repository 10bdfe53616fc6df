#!/usr/bin/env python3
"""Triton's system shared memory on a running inferd, with tritonclient's own shm utilities,
over HTTP and gRPC, the calls Triton's examples make (triton-inference-server/client,
src/python/examples: simple_http_shm_client.py, simple_grpc_shm_client.py,
simple_http_shm_string_client.py, simple_grpc_shm_string_client.py) and the refusals of its
shared-memory manager.

    .venv/bin/python tests/clients/triton_shm_check.py HTTP_ADDR GRPC_ADDR

The server serves `typed` and `classifier` (scripts/gen_test_models.py). Each protocol:
  - unregisters everything first (as the examples do), then registers an input region holding
    every `typed` input back to back and two output regions, each through a client of its own
    (a connection of its own: any worker may take it);
  - infers with every input from shared memory, two outputs into shared memory (one region
    holding both, at offsets) and one in the answer: outputs equal to the reference
    (tritonclient_check.expected_outputs), the answer naming the shm outputs without data;
  - BYTES through `classifier`: texts in shared memory, labels written into shared memory
    (Triton's length-prefixed layout), equal to an answer sent without shared memory;
  - the status lists each region with its key, offset and byte size, over the other protocol
    too; a second registration of a name, a key that does not exist, a region past its
    object's end, a request past its region, an unknown region and an output region too small
    are refused with Triton's words;
  - unregistering one region, then all: the statuses are empty.
Prints `shm: all checks passed` and exits 0, or prints the failed check and exits 1.
"""

import os
import sys
import traceback
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_repository_check import CheckFailed, refused, require  # noqa: E402
from tritonclient_check import INPUTS, expected_outputs  # noqa: E402

TEXTS = ["a fine day", "terrible, awful service", "ok"]


def statuses(client):
    """name -> (key, offset, byte_size), whichever the protocol."""
    got = client.get_system_shared_memory_status()
    if isinstance(got, list):
        return {r["name"]: (r["key"], int(r["offset"]), int(r["byte_size"])) for r in got}
    return {name: (r.key, r.offset, r.byte_size) for name, r in got.regions.items()}


def run(module, addr, other, tag):
    """The whole round on one protocol (`module`), its statuses read on `other` too."""
    client = lambda: module.InferenceServerClient(addr)  # noqa: E731 (a fresh connection each)
    client().unregister_system_shared_memory()
    require(statuses(client()) == {}, f"{tag}: regions left after unregistering all")

    keys = {name: f"/inferd-check-{os.getpid()}-{tag}-{name}" for name in ("in", "out", "text", "label")}
    arrays = [np.ascontiguousarray(data) for _, data in INPUTS.values()]
    sizes = [a.nbytes for a in arrays]
    handles = []
    try:
        inp = shm.create_shared_memory_region(f"{tag}_in", keys["in"], sum(sizes))
        handles.append(inp)
        shm.set_shared_memory_region(inp, arrays)
        want = expected_outputs()
        f32, i32 = want["f32_out"][1], want["i32_out"][1]
        out = shm.create_shared_memory_region(f"{tag}_out", keys["out"], f32.nbytes + i32.nbytes + 8)
        handles.append(out)
        client().register_system_shared_memory(f"{tag}_in", keys["in"], sum(sizes))
        client().register_system_shared_memory(f"{tag}_out", keys["out"], f32.nbytes + i32.nbytes + 8)
        for c in (client(), other):
            seen = statuses(c)
            require(seen.get(f"{tag}_in") == (keys["in"], 0, sum(sizes)), f"{tag}: status {seen}")
            require(seen.get(f"{tag}_out") == (keys["out"], 0, f32.nbytes + i32.nbytes + 8), f"{tag}: status {seen}")

        inputs, offset = [], 0
        for (name, (datatype, data)), size in zip(INPUTS.items(), sizes):
            i = module.InferInput(name, list(data.shape), datatype)
            i.set_shared_memory(f"{tag}_in", size, offset=offset)
            inputs.append(i)
            offset += size
        outputs = [module.InferRequestedOutput("f32_out"), module.InferRequestedOutput("i32_out"),
                   module.InferRequestedOutput("f64_out")]
        outputs[0].set_shared_memory(f"{tag}_out", f32.nbytes)
        outputs[1].set_shared_memory(f"{tag}_out", i32.nbytes, offset=f32.nbytes)
        result = client().infer("typed", inputs, outputs=outputs)
        got_f32 = shm.get_contents_as_numpy(out, np.float32, f32.shape)
        got_i32 = shm.get_contents_as_numpy(out, np.int32, i32.shape, offset=f32.nbytes)
        require(np.array_equal(got_f32, f32), f"{tag}: f32_out in shm {got_f32} != {f32}")
        require(np.array_equal(got_i32, i32), f"{tag}: i32_out in shm {got_i32} != {i32}")
        require(np.array_equal(result.as_numpy("f64_out"), want["f64_out"][1]), f"{tag}: f64_out in the answer")
        named = result.get_output("f32_out")
        shape = named["shape"] if isinstance(named, dict) else list(named.shape)
        require(list(shape) == list(f32.shape), f"{tag}: the answer's f32_out {named}")
        if isinstance(named, dict):
            require("data" not in named, f"{tag}: f32_out has data in the answer: {named}")

        # BYTES both ways: texts in, labels out (Triton's length-prefixed layout).
        texts = np.array([t.encode() for t in TEXTS], dtype=np.object_)
        serialized = utils.serialize_byte_tensor(texts)
        text_size = utils.serialized_byte_size(serialized)
        text = shm.create_shared_memory_region(f"{tag}_text", keys["text"], text_size)
        handles.append(text)
        shm.set_shared_memory_region(text, [serialized])
        label = shm.create_shared_memory_region(f"{tag}_label", keys["label"], 4096)
        handles.append(label)
        client().register_system_shared_memory(f"{tag}_text", keys["text"], text_size)
        client().register_system_shared_memory(f"{tag}_label", keys["label"], 4096)
        plain = module.InferInput("text", [len(TEXTS)], "BYTES")
        plain.set_data_from_numpy(texts)
        want_labels = client().infer("classifier", [plain]).as_numpy("label")
        i = module.InferInput("text", [len(TEXTS)], "BYTES")
        i.set_shared_memory(f"{tag}_text", text_size)
        o = module.InferRequestedOutput("label")
        o.set_shared_memory(f"{tag}_label", 4096)
        client().infer("classifier", [i], outputs=[o])
        got_labels = shm.get_contents_as_numpy(label, np.object_, [len(TEXTS)])
        text_of = lambda xs: [x.decode() if isinstance(x, bytes) else x for x in xs]  # noqa: E731
        require(text_of(got_labels) == text_of(want_labels), f"{tag}: labels in shm {got_labels} != {want_labels}")

        # Refusals, in Triton's words; none changes the registry.
        before = statuses(client())
        refused(lambda: client().register_system_shared_memory(f"{tag}_in", keys["in"], 8),
                f"shared memory region '{tag}_in' already in manager")
        refused(lambda: client().register_system_shared_memory("nowhere", "/inferd-no-such-object", 8),
                "Unable to open shared memory region: '/inferd-no-such-object'")
        refused(lambda: client().register_system_shared_memory("past", keys["in"], sum(sizes) + 1),
                "failed to register shared memory region 'past': invalid args")
        require(statuses(client()) == before, f"{tag}: a refused registration changed the registry")
        past = module.InferInput("f32_in", [2, 4], "FP32")
        past.set_shared_memory(f"{tag}_in", 32, offset=sum(sizes) - 16)
        rest = [i for i in inputs if i.name() != "f32_in"]
        refused(lambda: client().infer("typed", [past] + rest),
                f"Invalid offset + byte size for shared memory region: '{tag}_in'")
        unknown = module.InferInput("f32_in", [2, 4], "FP32")
        unknown.set_shared_memory("no_such_region", 32)
        refused(lambda: client().infer("typed", [unknown] + rest),
                "Unable to find system shared memory region: 'no_such_region'")
        small = module.InferRequestedOutput("f32_out")
        small.set_shared_memory(f"{tag}_out", 4)
        refused(lambda: client().infer("typed", inputs, outputs=[small]),
                "shared memory size specified with the request for output 'f32_out' (4 bytes) should be at least 32")

        client().unregister_system_shared_memory(f"{tag}_label")
        require(f"{tag}_label" not in statuses(other), f"{tag}: the unregistered region is listed")
        refused(lambda: client().get_system_shared_memory_status(f"{tag}_label"),
                f"Unable to find system shared memory region: '{tag}_label'")
        client().unregister_system_shared_memory()
        require(statuses(client()) == {} and statuses(other) == {}, f"{tag}: regions left after unregistering all")
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def main(http_addr, grpc_addr):
    run(httpclient, http_addr, grpcclient.InferenceServerClient(grpc_addr), "http")
    run(grpcclient, grpc_addr, httpclient.InferenceServerClient(http_addr), "grpc")


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    except (CheckFailed, InferenceServerException, AssertionError) as e:
        traceback.print_exc()
        print(f"shm check failed: {e}")
        sys.exit(1)
    print("shm: all checks passed")
