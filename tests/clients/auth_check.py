#!/usr/bin/env python3
"""Checks API keys ([auth]) on a running inferd serving the default model (minilm) and the
`typed` test model, with the clients users run, each given the right key, a wrong one and none:
the `openai` package (api_key), LangChain's OpenAIEmbeddings, huggingface_hub's
InferenceClient (token), tritonclient.http (headers) and tritonclient.grpc (metadata).

    .venv/bin/python tests/clients/auth_check.py HTTP_ADDR GRPC_ADDR GOOD_KEY

Each right key must be served; each wrong or missing one refused with the client's own
authentication error (OpenAI's AuthenticationError, HTTP 401, gRPC UNAUTHENTICATED).
Prints `auth: all checks passed` and exits 0, or each failed check and exits 1.
"""

import sys

import numpy as np
import openai
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from huggingface_hub import InferenceClient
from langchain_openai import OpenAIEmbeddings
from tritonclient.utils import InferenceServerException

http_addr, grpc_addr, good = sys.argv[1:4]
bad = "not-the-key-0123456789abcdef"
failures = []


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def refused(name, call, is_auth_error):
    try:
        call()
    except Exception as e:  # each client raises its own type
        check(name, is_auth_error(e), f"{type(e).__name__}: {e}")
        return
    check(name, False, "was served")


# OpenAI and LangChain: /v1/embeddings with Authorization: Bearer.
client = openai.OpenAI(base_url=f"http://{http_addr}/v1", api_key=good, max_retries=0)
r = client.embeddings.create(input=["hello"], model="minilm", encoding_format="float")
check("openai: right key", len(r.data) == 1 and len(r.data[0].embedding) == 384)
# (No key at all is the raw HTTP test's: this client always sends one.)
wrong = openai.OpenAI(base_url=f"http://{http_addr}/v1", api_key=bad, max_retries=0)
refused(
    "openai: wrong key",
    lambda: wrong.embeddings.create(input=["hello"], model="minilm"),
    lambda e: isinstance(e, openai.AuthenticationError)
    and e.status_code == 401
    and (e.body or {}).get("code") == "invalid_api_key",
)
emb = OpenAIEmbeddings(model="minilm", base_url=f"http://{http_addr}/v1", api_key=good,
                       check_embedding_ctx_length=False, max_retries=0)
check("langchain: right key", len(emb.embed_query("hello")) == 384)
emb = OpenAIEmbeddings(model="minilm", base_url=f"http://{http_addr}/v1", api_key=bad,
                       check_embedding_ctx_length=False, max_retries=0)
refused("langchain: wrong key", lambda: emb.embed_query("hello"), lambda e: isinstance(e, openai.AuthenticationError))

# huggingface_hub: TEI's POST / with token=.
hf = InferenceClient(model=f"http://{http_addr}", token=good)
v = np.asarray(hf.feature_extraction("hello"))
check("huggingface_hub: right key", v.size == 384, f"shape {v.shape}")
for token in (bad, None):  # None: no saved token here, so no header
    hf = InferenceClient(model=f"http://{http_addr}", token=token)
    refused(
        f"huggingface_hub: token {token!r}",
        lambda: hf.feature_extraction("hello"),
        lambda e: getattr(getattr(e, "response", None), "status_code", None) == 401,
    )

# tritonclient over REST (headers) and gRPC (metadata): minilm's BYTES text input.
text = np.array([b"hello"], dtype=object)


def infer(module, addr, headers):
    c = module.InferenceServerClient(addr)
    i = module.InferInput("text", [1], "BYTES")
    i.set_data_from_numpy(text)
    # A copy: tritonclient.http adds its own entries to the dict it is given.
    return c.infer("minilm", [i], outputs=[module.InferRequestedOutput("embedding")], headers=dict(headers))


r = infer(httpclient, http_addr, {"Authorization": f"Bearer {good}"})
check("tritonclient.http: right key", r.as_numpy("embedding").shape == (1, 384))
r = infer(grpcclient, grpc_addr, {"authorization": f"Bearer {good}"})
check("tritonclient.grpc: right key", r.as_numpy("embedding").shape == (1, 384))
for headers in ({"Authorization": f"Bearer {bad}"}, {}):
    refused(
        f"tritonclient.http: {headers}",
        lambda: infer(httpclient, http_addr, headers),
        lambda e: isinstance(e, InferenceServerException) and "401" in str(e.status()),
    )
    grpc_headers = {k.lower(): v for k, v in headers.items()}
    refused(
        f"tritonclient.grpc: {grpc_headers}",
        lambda: infer(grpcclient, grpc_addr, grpc_headers),
        lambda e: isinstance(e, InferenceServerException) and "UNAUTHENTICATED" in str(e.status()),
    )
# Health stays open for probes (no [auth] protect_health).
check("tritonclient.grpc: live without a key", grpcclient.InferenceServerClient(grpc_addr).is_server_live())
check("tritonclient.http: ready without a key", httpclient.InferenceServerClient(http_addr).is_server_ready())

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("auth: all checks passed")
