#!/usr/bin/env python3
"""Checks, with NVIDIA's tritonclient over HTTP and gRPC, Triton's restricted APIs, server name
and trace settings on inferd's main port.

    .venv/bin/python tests/clients/triton_restricted_check.py HTTP_ADDR GRPC_ADDR

The server must serve `typed` (the default), be named "triton" (server.name), trace nothing,
and restrict ([[auth.restricted]]) model-repository to `admin-key: admin-value` and inference
and health to `infer-key: infer-value`, as Triton's own QA runs do
(qa/L0_http/http_restricted_api_test.py, qa/L0_grpc/python_unit_test.py RestrictedProtocolTest,
started with --http-restricted-api / --grpc-restricted-protocol of those groups):
  - a restricted call without its header, or with another group's, is refused in Triton's
    words (HTTP 403 "This API is restricted, expecting header 'K'"; gRPC UNAVAILABLE "This
    protocol is restricted, expecting header 'triton-grpc-protocol-K'"), and served with it;
  - unrestricted categories (statistics, metadata) are served with or without headers;
  - the repository's unload with the admin header reaches the server's own refusal (model
    control is off): "explicit model load / unload is not allowed";
  - server metadata says "triton" over both (qa/L0_grpc/python_grpc_aio_test.py,
    qa/L0_http/python_http_aio_test.py, the simple_*_health_metadata examples);
  - trace settings (the aio tests' get_trace_settings and update_trace_settings): read over
    both, global and a model's; an update that changes nothing answers them; one that would
    change a setting is refused naming it; an unknown model is refused.
Prints `restricted: all checks passed` and exits 0, or the failed check and exits 1.
"""

import json
import sys
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_grpc_check import typed_inputs as grpc_typed_inputs  # noqa: E402
from triton_repository_check import CheckFailed, refused, require, typed_inputs  # noqa: E402
from tritonclient_check import expected_outputs  # noqa: E402


PREFIX = "triton-grpc-protocol-"


# Fresh dicts each time: tritonclient.http adds its own headers to the dict it is given.
def INFER():
    return {"infer-key": "infer-value"}


def ADMIN():
    return {"admin-key": "admin-value"}


def grpc_headers(headers):
    return {PREFIX + k: v for k, v in headers().items()}


def check_http(addr):
    client = httpclient.InferenceServerClient(addr)
    # Health and inference need infer-key.
    # tritonclient.http's health calls say False for any answer but 200: the words are read raw.
    require(not client.is_server_live(), "live without the header")
    require(not client.is_server_ready(headers=ADMIN()), "ready with another group's header")
    require(client.is_server_live(headers=INFER()), "live with the header")
    try:
        urllib.request.urlopen(f"http://{addr}/v2/health/live")
        raise CheckFailed("a raw live probe without the header was served")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        require(e.code == 403, f"status {e.code}")
        require(body["error"] == "This API is restricted, expecting header 'infer-key'", f"{body}")
    inputs = typed_inputs()
    refused(lambda: client.infer("typed", inputs, headers={"test": "1"}), "This API is restricted")
    answer = client.infer("typed", inputs, headers=INFER()).as_numpy("f32_out")
    require((answer == expected_outputs()["f32_out"][1]).all(), f"infer with the header: {answer}")
    # Unrestricted.
    client.get_inference_statistics("typed")
    client.get_inference_statistics("typed", headers=INFER())
    metadata = client.get_server_metadata()
    require(metadata["name"] == "triton", f"server metadata {metadata}")
    require("trace" in metadata["extensions"], f"extensions {metadata['extensions']}")
    # The repository needs admin-key; with it, the server's own answer.
    refused(lambda: client.unload_model("typed", headers=INFER()), "This API is restricted, expecting header 'admin-key'")
    refused(lambda: client.unload_model("typed", headers=ADMIN()), "explicit model load / unload is not allowed")
    # Trace settings: tracing is off.
    settings = client.get_trace_settings()
    require(settings["trace_level"] == ["OFF"] and settings["trace_mode"] == "opentelemetry", f"{settings}")
    require(client.update_trace_settings() == settings, "an empty update answers the settings")
    require(client.get_trace_settings(model_name="typed") == settings, "a model's settings are the global ones")
    same = client.update_trace_settings(model_name="typed", settings={"trace_level": ["OFF"], "trace_count": None})
    require(same == settings, f"an update that changes nothing: {same}")
    refused(lambda: client.update_trace_settings(settings={"trace_rate": "10"}), "'trace_rate'", "[tracing]", status="400")
    refused(lambda: client.update_trace_settings(settings={"trace_fil": "x"}), "unknown trace setting 'trace_fil'")
    refused(lambda: client.get_trace_settings(model_name="nosuch"), "nosuch")


def check_grpc(addr):
    client = grpcclient.InferenceServerClient(addr)
    header = "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
    refused(lambda: client.is_server_live(), header, status="StatusCode.UNAVAILABLE")
    refused(lambda: client.is_server_live(headers=INFER()), header)
    require(client.is_server_live(headers=grpc_headers(INFER)), "live with the header")
    inputs = grpc_typed_inputs()
    refused(lambda: client.infer("typed", inputs, headers={"test": "1"}), header)
    answer = client.infer("typed", inputs, headers=grpc_headers(INFER)).as_numpy("f32_out")
    require((answer == expected_outputs()["f32_out"][1]).all(), f"infer with the header over gRPC: {answer}")
    client.get_inference_statistics("typed")
    client.get_inference_statistics("typed", headers=grpc_headers(INFER))
    require(client.get_server_metadata().name == "triton", "server metadata's name over gRPC")
    require("trace" in client.get_server_metadata().extensions, "extensions over gRPC")
    admin = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
    refused(lambda: client.unload_model("typed", headers=grpc_headers(INFER)), admin)
    refused(lambda: client.unload_model("typed", headers=grpc_headers(ADMIN)), "explicit model load / unload is not allowed")
    settings = client.get_trace_settings(as_json=True)["settings"]
    require(settings["trace_level"]["value"] == ["OFF"], f"{settings}")
    updated = client.update_trace_settings(settings={"trace_rate": "0", "trace_count": None}, as_json=True)["settings"]
    require(updated == settings, f"an update that changes nothing: {updated}")
    refused(lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}), "'trace_level'", status="StatusCode.INVALID_ARGUMENT")
    refused(lambda: client.get_trace_settings(model_name="nosuch"), "nosuch", status="StatusCode.NOT_FOUND")


def main():
    http_addr, grpc_addr = sys.argv[1:3]
    try:
        check_http(http_addr)
        check_grpc(grpc_addr)
    except CheckFailed as e:
        traceback.print_exc()
        print(f"FAILED: {e}")
        return 1
    print("restricted: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
