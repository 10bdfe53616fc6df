#!/usr/bin/env python3
"""Hostile gRPC clients against a running inferd, while well-behaved ones load it.

    .venv/bin/python tests/clients/grpc_hostile.py GRPC_ADDR IDLE_SECONDS

The server must serve the test model `typed` (the default) with max_body_bytes = 65536 and
server.idle_timeout_secs = IDLE_SECONDS.

  - ModelInferRequests under the size limit whose entries are empty (an input tensor, a
    bytes_contents entry in 2 bytes of wire each, a parameter in 9, each decoding to a struct
    of its own) are refused with RESOURCE_EXHAUSTED naming the decoded size and the limit, many at
    once, while 4 threads of ordinary ModelInfer calls see no failure;
  - a message that is not a ModelInferRequest is INVALID_ARGUMENT;
  - a connection that has had no call open for IDLE_SECONDS is closed by the server (the
    channel goes from READY to IDLE with no call of its own), and the next call reconnects.

Prints `grpc hostile: all checks passed` and exits 0, or prints each failed check and exits 1.
"""

import sys
import threading
import time
from pathlib import Path

import grpc
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tritonclient_check import INPUTS  # noqa: E402 (the typed model's inputs)

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def fail(what):
    print(f"FAILED: {what}")
    sys.exit(1)


def raw_call(channel):
    """ModelInfer with the message given as bytes, as a hostile client would write it."""
    return channel.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def key(field, wire):
    return bytes([field << 3 | wire])


def length_delimited(field, payload):
    n, out = len(payload), bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            break
    return key(field, 2) + bytes(out) + payload


def amplifying_messages():
    """Messages of ~60 KB that decode to far more than the 64 KiB limit."""
    empty_inputs = length_delimited(5, b"") * 30_000
    empty_bytes = length_delimited(8, b"") * 29_000
    one_input = length_delimited(1, b"text") + length_delimited(2, b"BYTES") + length_delimited(5, empty_bytes)
    bytes_entries = length_delimited(1, b"typed") + length_delimited(5, one_input)
    parameters = b"".join(length_delimited(4, length_delimited(1, f"{i:05}".encode())) for i in range(6_600))
    return {"empty inputs": empty_inputs, "empty bytes_contents": bytes_entries, "parameters without values": parameters}


def load(addr, stop, counts, errors, lock, answered):
    """Ordinary calls until `stop`; `answered` is set after this client's first answer."""
    client = grpcclient.InferenceServerClient(addr)
    inputs = []
    for name, (datatype, data) in INPUTS.items():
        inp = grpcclient.InferInput(name, list(data.shape), datatype)
        inp.set_data_from_numpy(data)
        inputs.append(inp)
    while not stop.is_set():
        try:
            client.infer("typed", inputs, client_timeout=30)
            with lock:
                counts["ok"] += 1
            answered.set()
        except Exception as e:  # every failure counts
            with lock:
                counts["failed"] += 1
                errors.append(repr(e)[:300])


def check_amplification(addr):
    channel = grpc.insecure_channel(addr)
    call = raw_call(channel)
    for name, message in amplifying_messages().items():
        if len(message) >= 65536:
            fail(f"{name}: the test message is {len(message)} bytes, not under the limit")
        try:
            call(message, timeout=30)
            fail(f"{name}: accepted")
        except grpc.RpcError as e:
            details = e.details() or ""
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "decodes to about" not in details or "65536" not in details:
                fail(f"{name}: {e.code()} {details!r}, expected RESOURCE_EXHAUSTED naming the decoded size and the limit")
    try:
        call(b"\x2a\xff\xff\x03", timeout=30)
        fail("a cut-off message was accepted")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "runs past the end" not in (e.details() or ""):
            fail(f"a cut-off message: {e.code()} {e.details()!r}, expected INVALID_ARGUMENT")
    # Many at once, from 8 threads.
    outcomes, lock = [], threading.Lock()

    def burst():
        for message in list(amplifying_messages().values()) * 4:
            try:
                call(message, timeout=60)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                outcomes.append(code)

    threads = [threading.Thread(target=burst) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [c for c in outcomes if c != "RESOURCE_EXHAUSTED"]
    if len(outcomes) != 96 or wrong:
        fail(f"burst: {len(outcomes)} answers, not RESOURCE_EXHAUSTED: {wrong[:5]}")
    channel.close()
    return len(outcomes) + 4


def check_idle_close(addr, idle):
    channel = grpc.insecure_channel(addr)
    states, lock = [], threading.Lock()

    def seen(state):
        with lock:
            states.append(state)

    channel.subscribe(seen, try_to_connect=False)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    if not stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live:
        fail("ServerLive said not live")
    deadline = time.monotonic() + idle * 4 + 10
    while time.monotonic() < deadline:
        with lock:
            if states and states[-1] == grpc.ChannelConnectivity.IDLE and grpc.ChannelConnectivity.READY in states:
                break
        time.sleep(0.1)
    else:
        fail(f"the idle connection was not closed within {idle * 4 + 10} s: states {states}")
    # The next call reconnects.
    if not stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live:
        fail("ServerLive after the idle close said not live")
    channel.close()


def main():
    addr, idle = sys.argv[1], float(sys.argv[2])
    stop, counts, errors, lock = threading.Event(), {"ok": 0, "failed": 0}, [], threading.Lock()
    answered = [threading.Event() for _ in range(4)]
    clients = [threading.Thread(target=load, args=(addr, stop, counts, errors, lock, a)) for a in answered]
    for t in clients:
        t.start()
    # The hostile calls start once every well-behaved client is being answered, and the load
    # goes on a while after them: the clients are loading the server throughout.
    for a in answered:
        if not a.wait(timeout=120):
            stop.set()
            fail(f"a well-behaved client got no answer within 120 s: {counts}, {errors[:3]}")
    refused = check_amplification(addr)
    time.sleep(1)
    stop.set()
    for t in clients:
        t.join()
    print(f"hostile: {refused} refused; load: {counts['ok']} requests, {counts['failed']} failed")
    if counts["failed"] or not counts["ok"]:
        fail(f"the well-behaved clients: {counts}, {errors[:3]}")
    check_idle_close(addr, idle)
    print("grpc hostile: all checks passed")


if __name__ == "__main__":
    main()
