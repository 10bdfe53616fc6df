"""A small PKI for tests/signatures.rs, made with `cryptography` (model-signing's own
dependency): two certificate authorities, and a signing certificate issued by each, as
`model_signing sign certificate` takes them.

    .venv/bin/python tests/clients/signing_pki.py OUT_DIR

Writes into OUT_DIR, all PEM:
  ca.pem, other-ca.pem           self-signed P-256 authorities (CA:TRUE, keyCertSign)
  signer.pem, signer.key         issued by ca.pem: CN=model-publisher, O=inferd tests,
                                 digitalSignature and codeSigning, valid from a day ago
  outsider.pem, outsider.key     the same, issued by other-ca.pem (CN=outsider)
"""

import datetime
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.timezone.utc)


def name(common_name):
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "inferd tests"),
        ]
    )


def certificate(subject, key, issuer, issuer_key, authority):
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(days=1))
        .not_valid_after(NOW + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not authority,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=authority,
                crl_sign=authority,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if not authority:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
        ).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def write(out, stem, cert, key=None):
    (out / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (out / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for authority, signer, common_name in (("ca", "signer", "model-publisher"), ("other-ca", "outsider", "outsider")):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = name(f"{authority} root")
        ca = certificate(ca_name, ca_key, ca_name, ca_key, True)
        write(out, authority, ca)
        key = ec.generate_private_key(ec.SECP256R1())
        write(out, signer, certificate(name(common_name), key, ca_name, ca_key, False), key)


if __name__ == "__main__":
    main()
