#!/usr/bin/env python3
"""Checks TLS ([server] tls_cert, tls_key, tls_client_ca) on a running inferd serving the
default model (minilm), with the clients users run: the `openai` package (an httpx client that
trusts the test CA), tritonclient.http (ssl) and tritonclient.grpc (ssl, root certificates).

    .venv/bin/python tests/clients/tls_check.py HTTP_ADDR GRPC_ADDR CA_PEM [CLIENT_CERT CLIENT_KEY]

HTTP_ADDR and GRPC_ADDR are host:port with the host the certificate names (localhost). With a
client certificate (mTLS), each client must be served with it and fail without it.
Prints `tls: all checks passed` and exits 0, or each failed check and exits 1.
"""

import ssl
import sys

import gevent.ssl
import httpx
import numpy as np
import openai
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

http_addr, grpc_addr, ca = sys.argv[1:4]
client_cert = tuple(sys.argv[4:6]) or None
failures = []


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def attempt(name, call, served):
    """Runs `call`; it must succeed when `served`, else raise (a TLS or connection error)."""
    try:
        ok = call()
    except Exception as e:  # each client raises its own type
        check(name, not served, f"{type(e).__name__}: {e}")
        return
    check(name, served and ok, "was served without a client certificate" if not served else "wrong answer")


def context(factory, with_cert):
    c = factory(cafile=ca)
    if with_cert and client_cert:
        c.load_cert_chain(*client_cert)
    return c


text = np.array([b"hello"], dtype=object)
# Without a client certificate: served unless the server asks for one.
for with_cert in ([True, False] if client_cert else [True]):
    served = with_cert or not client_cert
    tag = "with a client certificate" if with_cert and client_cert else "without a client certificate"

    def openai_call():
        http = httpx.Client(verify=context(ssl.create_default_context, with_cert))
        client = openai.OpenAI(base_url=f"https://{http_addr}/v1", api_key="none", max_retries=0, http_client=http)
        r = client.embeddings.create(input=["hello"], model="minilm", encoding_format="float")
        return len(r.data) == 1 and len(r.data[0].embedding) == 384

    attempt(f"openai over https, {tag}", openai_call, served)

    def triton_http():
        c = httpclient.InferenceServerClient(
            http_addr, ssl=True, ssl_context_factory=lambda: context(gevent.ssl.create_default_context, with_cert)
        )
        i = httpclient.InferInput("text", [1], "BYTES")
        i.set_data_from_numpy(text)
        r = c.infer("minilm", [i], outputs=[httpclient.InferRequestedOutput("embedding")])
        return r.as_numpy("embedding").shape == (1, 384)

    attempt(f"tritonclient.http over https, {tag}", triton_http, served)

    def triton_grpc():
        key_file, cert_file = (client_cert[1], client_cert[0]) if with_cert and client_cert else (None, None)
        c = grpcclient.InferenceServerClient(
            grpc_addr, ssl=True, root_certificates=ca, private_key=key_file, certificate_chain=cert_file
        )
        i = grpcclient.InferInput("text", [1], "BYTES")
        i.set_data_from_numpy(text)
        r = c.infer("minilm", [i], outputs=[grpcclient.InferRequestedOutput("embedding")], client_timeout=30)
        return r.as_numpy("embedding").shape == (1, 384)

    attempt(f"tritonclient.grpc over TLS, {tag}", triton_grpc, served)

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("tls: all checks passed")
