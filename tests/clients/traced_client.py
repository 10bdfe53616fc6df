#!/usr/bin/env python3
"""Real clients whose traces continue into inferd: the OpenTelemetry Python SDK, exporting to
an OTLP/HTTP receiver, with its `requests` instrumentation calling TEI's POST /embed and its
gRPC client instrumentation around tritonclient.grpc's ModelInfer of the `typed` model. The
instrumentations put the client span's `traceparent` on the call (a header, gRPC metadata).

    .venv/bin/python tests/clients/traced_client.py HTTP_ADDR GRPC_ADDR OTLP_HTTP_ENDPOINT

Prints one JSON line, {"embed": TRACE_ID, "grpc": TRACE_ID}: the client spans' trace ids,
which tests/traces.rs follows to inferd's spans in the receiver. Exits 1 if a call fails.
"""

import json
import sys

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

http_addr, grpc_addr, endpoint = sys.argv[1:4]
provider = TracerProvider(resource=Resource.create({"service.name": "traced-client"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))
trace.set_tracer_provider(provider)
RequestsInstrumentor().instrument()
GrpcInstrumentorClient().instrument()
tracer = trace.get_tracer("traced-client")
ids = {}

with tracer.start_as_current_span("embed a sentence") as span:
    answer = requests.post(f"http://{http_addr}/embed", json={"inputs": "a traced sentence"}, timeout=60)
    answer.raise_for_status()
    ids["embed"] = format(span.get_span_context().trace_id, "032x")

with tracer.start_as_current_span("infer over grpc") as span:
    client = grpcclient.InferenceServerClient(url=grpc_addr)
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = []
    typed = [("f32_in", "FP32", np.float32), ("f64_in", "FP64", np.float64), ("i32_in", "INT32", np.int32),
             ("i64_in", "INT64", np.int64), ("bool_in", "BOOL", np.bool_), ("f16_in", "FP16", np.float16)]
    for name, dtype, np_type in typed:
        tensor = grpcclient.InferInput(name, [1, 4], dtype)
        tensor.set_data_from_numpy(data.astype(np_type))
        inputs.append(tensor)
    client.infer("typed", inputs)
    ids["grpc"] = format(span.get_span_context().trace_id, "032x")

provider.shutdown()
print(json.dumps(ids))
