#!/usr/bin/env python3
"""A gRPC call that hits a bug in the worker (the test switch INFERD_TEST_PANIC=grpc:3) is
answered INTERNAL, naming the bug, and calls before and after it are answered as usual.

    .venv/bin/python tests/clients/grpc_panic.py GRPC_ADDR

The server must serve the test model `typed` with INFERD_TEST_PANIC=grpc:3 set. A worker
that died of the panic instead would end the call with UNAVAILABLE (the connection reset).
Prints `grpc panic: all checks passed` and exits 0, or the failed check and exits 1.
"""

import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tritonclient_check import INPUTS  # noqa: E402 (the typed model's inputs)


def fail(what):
    print(f"FAILED: {what}")
    sys.exit(1)


def inputs(rows):
    made = []
    for name, (datatype, data) in INPUTS.items():
        data = np.resize(data, (rows, data.shape[1]))
        inp = grpcclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data)
        made.append(inp)
    return made


def main():
    client = grpcclient.InferenceServerClient(sys.argv[1])
    client.infer("typed", inputs(2), client_timeout=30)
    try:
        client.infer("typed", inputs(3), client_timeout=30)
        fail("the call of 3 rows was answered, not refused by the test switch")
    except InferenceServerException as e:
        status, message = str(e.status()), e.message() or ""
        if status != "StatusCode.INTERNAL" or "bug" not in message:
            fail(f"the call of 3 rows ended with {status}: {message!r}, not INTERNAL naming the bug")
    # The worker that panicked is replaced gap-free; every later call is answered.
    for i in range(20):
        try:
            client.infer("typed", inputs(2), client_timeout=30)
        except InferenceServerException as e:
            fail(f"call {i} after the bug: {e.status()}: {e.message()}")
    print("grpc panic: all checks passed")


if __name__ == "__main__":
    main()
