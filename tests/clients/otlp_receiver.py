#!/usr/bin/env python3
"""A test receiver for OTLP traces, built on OpenTelemetry's own protocol definitions (the
`opentelemetry-proto` package): OTLP/HTTP (protobuf, POST /v1/traces) and OTLP/gRPC
(TraceService/Export), as a collector takes them. Every span received is written as one JSON
line to OUT: its trace and span ids, parent, name, kind, start and end (ns), attributes, links
and its resource's attributes.

    .venv/bin/python tests/clients/otlp_receiver.py OUT HTTP_PORT GRPC_PORT [--hang | --discard]
        [--tls CERT KEY [--client-ca CA]]

With --tls both ports take TLS only, with that certificate and key (PEM), and with --client-ca
they ask for a client certificate that CA signed (mTLS), refusing a client without one. With
--hang it accepts every export and never answers (a collector that hangs); with
--discard it answers every export without reading its spans (a collector whose work happens
elsewhere: bench/traces.sh), counting only the exports in OUT's first line. Prints
`listening` once both ports are open; runs until killed. Used by tests/traces.rs.
"""

import http.server
import json
import sys
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

out_path, http_port, grpc_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hang = "--hang" in sys.argv[4:]
discard = "--discard" in sys.argv[4:]


def option(name, n=1):
    args = sys.argv[4:]
    if name not in args:
        return None
    at = args.index(name)
    return args[at + 1:at + 1 + n]


tls = option("--tls", 2)
client_ca = option("--client-ca")
lock = threading.Lock()
exports = 0


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


def record(request, protocol):
    lines = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                lines.append(json.dumps({
                    "protocol": protocol,
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": span.kind,
                    "start": span.start_time_unix_nano,
                    "end": span.end_time_unix_nano,
                    "status": span.status.code,
                    "attributes": attributes(span.attributes),
                    "links": [{"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()} for l in span.links],
                    "resource": resource,
                }))
    with lock, open(out_path, "a") as f:
        for line in lines:
            f.write(line + "\n")


class Http(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if hang:
            time.sleep(3600)
        if discard:
            global exports
            with lock:
                exports += 1
                with open(out_path, "w") as f:
                    f.write(f"{exports} exports\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path != "/v1/traces":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        record(request, "http/protobuf")
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        if hang:
            time.sleep(3600)
        record(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
if tls:
    def read(path):
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_server_credentials(
        [(read(tls[1]), read(tls[0]))],
        root_certificates=read(client_ca[0]) if client_ca else None,
        require_client_auth=bool(client_ca),
    )
    server.add_secure_port(f"127.0.0.1:{grpc_port}", credentials)
else:
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
server.start()
httpd = http.server.ThreadingHTTPServer(("127.0.0.1", http_port), Http)
if tls:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls[0], tls[1])
    if client_ca:
        context.load_verify_locations(client_ca[0])
        context.verify_mode = ssl.CERT_REQUIRED
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
print("listening", flush=True)
httpd.serve_forever()
