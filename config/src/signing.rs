//! Which models may be served: `[models] signatures` ("off", "verify", "required"), and what
//! OpenSSF model-signing signatures must verify against: a public key
//! (`[models] signature_public_key`, a PEM file as the `model_signing` CLI's `key` method takes)
//! or certificate authorities (`signature_certificate_chain`, PEM files, for its `certificate`
//! method: the bundle's signing certificate must chain to one of them, as of the time it was
//! issued, and be meant for signing: key usage digitalSignature or extended key usage
//! codeSigning, as the CLI's verifier asks; [`Trust::certificate`]).
//! The supervisor reads the key at start and at every reload ([`Trust`], in every worker's
//! spec beside the API keys and TLS files); what a signature holds and how a model's folder is
//! checked against it is the worker's loader's (`load/signature`).
//!
//! model-signing signs with elliptic-curve keys on P-256, P-384 or P-521, each with the SHA-2
//! of its size (SHA-256, SHA-384, SHA-512), the signature DER-encoded; a bundle names its key
//! by a hint, the SHA-256 of the public key's PEM text ([`PublicKey::hint`]).

use std::path::{Path, PathBuf};

use p256::pkcs8::{DecodePublicKey, EncodePublicKey, LineEnding};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// `[models] signatures`: whether a model folder's signature is checked before it is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Signatures {
    /// Signatures are not read (the default).
    #[default]
    Off,
    /// A folder with a signature is served only if it verifies; one without is served.
    Verify,
    /// Only folders whose signature verifies are served.
    Required,
}

/// The signature policy every worker of a generation loads models under: the mode, the
/// public key's PEM text and the authorities' certificates, as the supervisor read them
/// (workers read no key file of their own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trust {
    pub mode: Signatures,
    pub public_key: Option<String>,
    /// Each authority's certificate, PEM.
    #[serde(default)]
    pub certificate_chain: Vec<String>,
}

impl Trust {
    /// Reads `key_file` and `chain_files` for `mode`: a mode other than off needs a key or an
    /// authority, each of which parses.
    pub(crate) fn load(mode: Signatures, key_file: Option<&Path>, chain_files: &[PathBuf]) -> Result<Trust, KeyError> {
        if mode == Signatures::Off {
            return Ok(Trust::default());
        }
        if key_file.is_none() && chain_files.is_empty() {
            return Err(KeyError::NoKey);
        }
        let read = |path: &Path| {
            crate::tls::read(path, false)
                .map_err(|e| KeyError::Read { path: path.to_path_buf(), message: e.to_string() })
        };
        let public_key = match key_file {
            None => None,
            Some(path) => {
                let pem = read(path)?;
                PublicKey::from_pem(&pem).map_err(|e| within(path, e))?;
                Some(pem)
            }
        };
        let mut certificate_chain = Vec::new();
        for path in chain_files {
            let pem = read(path)?;
            let certificates = authorities(&pem).map_err(|e| within(path, e))?;
            if certificates.is_empty() {
                return Err(within(path, KeyError::NoCertificate));
            }
            for certificate in &certificates {
                webpki::anchor_from_trusted_cert(certificate)
                    .map_err(|e| within(path, KeyError::NotAnAuthority(format!("{e:?}"))))?;
            }
            certificate_chain.push(pem);
        }
        Ok(Trust { mode, public_key, certificate_chain })
    }

    /// The signer of a bundle signed with a certificate: `chain` (DER, the signing
    /// certificate first, then the intermediates the bundle carries) must lead to one of the
    /// configured authorities as of the signing certificate's start of validity (the CLI's
    /// rule: a signature made while the certificate was valid stays valid), and the signing
    /// certificate be meant for signing. Its key and its subject.
    pub fn certificate(&self, chain: &[Vec<u8>]) -> Result<(PublicKey, String), CertificateError> {
        use x509_cert::der::{Decode, Encode};
        let roots: Vec<CertificateDer<'static>> =
            self.certificate_chain.iter().flat_map(|pem| authorities(pem).unwrap_or_default()).collect();
        if roots.is_empty() {
            return Err(CertificateError::NoAuthorities);
        }
        let anchors: Vec<_> = roots.iter().filter_map(|c| webpki::anchor_from_trusted_cert(c).ok()).collect();
        let Some((signer, rest)) = chain.split_first() else { return Err(CertificateError::Empty) };
        let parsed =
            x509_cert::Certificate::from_der(signer).map_err(|e| CertificateError::Unreadable(e.to_string()))?;
        let tbs = &parsed.tbs_certificate;
        let issued = tbs.validity.not_before.to_unix_duration();
        let signer_der = CertificateDer::from(signer.as_slice());
        let intermediates: Vec<_> = rest.iter().map(|c| CertificateDer::from(c.as_slice())).collect();
        let end_entity =
            webpki::EndEntityCert::try_from(&signer_der).map_err(|e| CertificateError::Unreadable(format!("{e:?}")))?;
        end_entity
            .verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &anchors,
                &intermediates,
                UnixTime::since_unix_epoch(issued),
                webpki::KeyUsage::required_if_present(CODE_SIGNING),
                None,
                None,
            )
            .map_err(|e| CertificateError::NotTrusted(format!("{e:?}")))?;
        if !meant_for_signing(tbs) {
            return Err(CertificateError::NotForSigning);
        }
        let spki = tbs.subject_public_key_info.to_der().map_err(|e| CertificateError::Unreadable(e.to_string()))?;
        let key = PublicKey::from_spki(&spki).map_err(|_| CertificateError::NotAnEcKey)?;
        Ok((key, tbs.subject.to_string()))
    }

    /// The key signatures must verify against (None with signatures off).
    pub fn key(&self) -> Result<Option<PublicKey>, KeyError> {
        self.public_key.as_deref().map(PublicKey::from_pem).transpose()
    }
}

/// `error`, about file `path`.
fn within(path: &Path, error: KeyError) -> KeyError {
    KeyError::In { path: path.to_path_buf(), error: Box::new(error) }
}

/// The codeSigning extended key usage (1.3.6.1.5.5.7.3.3), as webpki takes an OID.
const CODE_SIGNING: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x03];

/// Whether a signing certificate may sign: key usage digitalSignature, or extended key usage
/// codeSigning (what the model_signing CLI's verifier accepts).
fn meant_for_signing(tbs: &x509_cert::TbsCertificate) -> bool {
    use x509_cert::der::oid::db::rfc5280::{ID_CE_EXT_KEY_USAGE, ID_CE_KEY_USAGE, ID_KP_CODE_SIGNING};
    use x509_cert::der::Decode;
    use x509_cert::ext::pkix::{ExtendedKeyUsage, KeyUsage};
    tbs.extensions.iter().flatten().any(|e| match e.extn_id {
        id if id == ID_CE_KEY_USAGE => KeyUsage::from_der(e.extn_value.as_bytes()).is_ok_and(|u| u.digital_signature()),
        id if id == ID_CE_EXT_KEY_USAGE => {
            ExtendedKeyUsage::from_der(e.extn_value.as_bytes()).is_ok_and(|u| u.0.contains(&ID_KP_CODE_SIGNING))
        }
        _ => false,
    })
}

/// The certificates of a PEM file.
fn authorities(pem: &str) -> Result<Vec<CertificateDer<'static>>, KeyError> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| KeyError::NotACertificate(e.to_string()))
}

/// Why a bundle's signing certificate does not name a signer.
#[derive(Debug, thiserror::Error)]
pub enum CertificateError {
    #[error(
        "it is signed with a certificate, and [models] signature_certificate_chain names no authority to check it \
         against"
    )]
    NoAuthorities,
    #[error("its certificate chain is empty")]
    Empty,
    #[error("its signing certificate cannot be read: {0}")]
    Unreadable(String),
    #[error("its signing certificate is not from [models] signature_certificate_chain's authorities ({0})")]
    NotTrusted(String),
    #[error("its signing certificate is not meant for signing (no digitalSignature key usage or codeSigning extended key usage)")]
    NotForSigning,
    #[error("its signing certificate's key is not an elliptic-curve key on P-256, P-384 or P-521")]
    NotAnEcKey,
}

/// Why `signature_public_key` or `signature_certificate_chain` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "signature_public_key or signature_certificate_chain is needed with signatures = \"verify\" or \
         \"required\" (the PEM public key model folders are signed with, or the authorities of the certificates \
         they are signed with; keyless Sigstore signatures are not verified)"
    )]
    NoKey,
    #[error("not a PEM certificate: {0}")]
    NotACertificate(String),
    #[error("holds no CERTIFICATE block")]
    NoCertificate,
    #[error("a certificate that cannot be an authority: {0}")]
    NotAnAuthority(String),
    #[error("{}: {message}", path.display())]
    Read { path: PathBuf, message: String },
    #[error("{}: {error}", path.display())]
    In { path: PathBuf, error: Box<KeyError> },
    #[error(
        "holds no elliptic-curve public key on P-256, P-384 or P-521 (a PEM `PUBLIC KEY` block, as \
         `openssl ec -pubout` writes; model-signing signs with no other kind)"
    )]
    NotAnEcKey,
}

/// A public key model folders are signed for.
#[derive(Clone)]
pub struct PublicKey {
    key: Curve,
    hint: String,
}

#[derive(Clone)]
enum Curve {
    P256(p256::ecdsa::VerifyingKey),
    P384(p384::ecdsa::VerifyingKey),
    P521(p521::ecdsa::VerifyingKey),
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicKey").field("curve", &self.curve()).field("hint", &self.hint).finish()
    }
}

impl PublicKey {
    /// The key in a PEM `PUBLIC KEY` block (SubjectPublicKeyInfo).
    pub fn from_pem(pem: &str) -> Result<PublicKey, KeyError> {
        let der = p256::pkcs8::Document::from_pem(pem).map_err(|_| KeyError::NotAnEcKey)?.1;
        PublicKey::from_spki(der.as_bytes())
    }

    /// The key of a DER SubjectPublicKeyInfo.
    fn from_spki(der: &[u8]) -> Result<PublicKey, KeyError> {
        if let Ok(key) = p256::PublicKey::from_public_key_der(der) {
            let hint = hint(key.to_public_key_pem(LineEnding::LF))?;
            return Ok(PublicKey { key: Curve::P256(key.into()), hint });
        }
        if let Ok(key) = p384::PublicKey::from_public_key_der(der) {
            let hint = hint(key.to_public_key_pem(LineEnding::LF))?;
            return Ok(PublicKey { key: Curve::P384(key.into()), hint });
        }
        if let Ok(key) = p521::PublicKey::from_public_key_der(der) {
            let hint = hint(key.to_public_key_pem(LineEnding::LF))?;
            let key =
                p521::ecdsa::VerifyingKey::from_sec1_bytes(&key.to_sec1_bytes()).map_err(|_| KeyError::NotAnEcKey)?;
            return Ok(PublicKey { key: Curve::P521(key), hint });
        }
        Err(KeyError::NotAnEcKey)
    }

    /// The SHA-256 of the key's PEM text (64-column base64, LF line ends), in hex: what a
    /// model-signing bundle records as `verificationMaterial.publicKey.hint`.
    pub fn hint(&self) -> &str {
        &self.hint
    }

    pub fn curve(&self) -> &'static str {
        match self.key {
            Curve::P256(_) => "P-256",
            Curve::P384(_) => "P-384",
            Curve::P521(_) => "P-521",
        }
    }

    /// Whether `signature` (DER) is this key's ECDSA signature of `message`, hashed with the
    /// SHA-2 of the curve's size.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        use p256::ecdsa::signature::Verifier;
        match &self.key {
            Curve::P256(key) => {
                p256::ecdsa::Signature::from_der(signature).is_ok_and(|s| key.verify(message, &s).is_ok())
            }
            Curve::P384(key) => {
                p384::ecdsa::Signature::from_der(signature).is_ok_and(|s| key.verify(message, &s).is_ok())
            }
            Curve::P521(key) => {
                p521::ecdsa::Signature::from_der(signature).is_ok_and(|s| key.verify(message, &s).is_ok())
            }
        }
    }
}

/// The hint of a key whose PEM text, written as the CLI writes it, is `canonical`.
fn hint<E>(canonical: Result<String, E>) -> Result<String, KeyError> {
    canonical.map(|text| hex(&Sha256::digest(text.as_bytes()))).map_err(|_| KeyError::NotAnEcKey)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys made with Python's `cryptography`, each with the hint the model_signing CLI records
    /// for it and its signature of b"inferd" (ECDSA with the curve's SHA-2, DER), in hex.
    const KEYS: [(&str, &str, &str, &str); 3] = [
        (
            "P-256",
            "-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEdGs8sdxFtHHbSpypHTfxdzSn/moD
8R4GREgZ4ffeOC3GyAeN6ueQmcbXC3J01sDhZd8tsxBCdS7S/mwnJw5K3w==
-----END PUBLIC KEY-----
",
            "4560325c28429762dce6c57d8f9ad65ecf8a972dfe8e03a92669eec41decf165",
            "30450221009bdefce97aafb10bf94f0ed65bd9714170400fa1545f63b6b1743d11f68b682302200102744509569162c4363919f73680927cc4e3515529a4dd471abbd06709d4c3",
        ),
        (
            "P-384",
            "-----BEGIN PUBLIC KEY-----
MHYwEAYHKoZIzj0CAQYFK4EEACIDYgAE6K1eJo9BcDFx46A5NQ0yS40pMJuTy041
U7nWKsuo1jlkmA9/i2QH9NKlr0Bn17bvEEt8HGDyh8EQTrUbJBhAXvCwH7GQMGtd
+1kv9ZJhMgXtltUYybVInVevQx4S3zho
-----END PUBLIC KEY-----
",
            "5a66b0a9132587622b28259070bd5f82ea66bbfa07de218696f320a73e67758d",
            "306402304451df2eb212f32d4acbd1da4088999f5454e647e5557cf2d5d53b0e626f16a4a2da3d7266cab32e9f5c4be82da0451b023032ff4c9ad2361dd566ba91709efc9a2b7266174aad908f770ad592aa53cbb5e664bc062156ac636ddf5f66f23cb5cd92",
        ),
        (
            "P-521",
            "-----BEGIN PUBLIC KEY-----
MIGbMBAGByqGSM49AgEGBSuBBAAjA4GGAAQA/LsHuD8ZgPrGSgOwuEWTj5/fH2I8
Dj2T0W9QFhdpuaCju87GTmqKLWOgFHfu59ZDIrIxTHpiJKyWlZrLpDUT2GIA1kKX
ecpaC36tV0Dn/B0Pg21++kptBCkh6PJbLvvJg3RHkT4UJ22qARZwhAaY97ka1ONu
ywAQ9AulyclK3/E3oVQ=
-----END PUBLIC KEY-----
",
            "ffcc3e0ca5c2f03f7acba58304169197267769824c7eedbe322fddf579a057f9",
            "308188024200c7cde3680b3f610ae05b9cc3dfc9174b5d55a146e8194998b6159d1c72e67c447166603268bafcce118095617e87068d317aad791ecd32d7c524545caf1838698e0242011b19c337e9b7d3daf14ee0860a9637e1de6ccbb70d07fc6a0f58546b1a1e2190e0e1e2cafc61fd4037ead2acbaebeac2a07c2660225c2b080005ffdbf88c753265",
        ),
    ];

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn each_curve_gives_the_cli_s_hint_and_verifies_its_own_signature_only() {
        for (curve, pem, hint, signature) in KEYS {
            let key = PublicKey::from_pem(pem).unwrap();
            assert_eq!((key.curve(), key.hint()), (curve, hint));
            let signature = unhex(signature);
            assert!(key.verifies(b"inferd", &signature), "{curve}");
            assert!(!key.verifies(b"inferD", &signature), "{curve}: another message");
            assert!(!key.verifies(b"inferd", &signature[..signature.len() - 1]), "{curve}: a cut signature");
            for (other, other_pem, ..) in KEYS.iter().filter(|k| k.0 != curve) {
                assert!(!PublicKey::from_pem(other_pem).unwrap().verifies(b"inferd", &signature), "{curve} by {other}");
            }
        }
    }

    #[test]
    fn a_key_that_is_not_an_ec_public_key_is_refused() {
        let ed25519 = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAEOcdZJfc8dYuhrnvqTOHFc+smiX8AimkMUoVLdukU/0=\n-----END PUBLIC KEY-----\n";
        for pem in [ed25519, "not pem", ""] {
            assert!(matches!(PublicKey::from_pem(pem), Err(KeyError::NotAnEcKey)), "{pem}");
        }
    }

    #[test]
    fn off_needs_no_key_and_the_others_do() {
        assert_eq!(Trust::load(Signatures::Off, None, &[]).unwrap(), Trust::default());
        assert!(matches!(Trust::load(Signatures::Required, None, &[]), Err(KeyError::NoKey)));
        assert!(matches!(Trust::load(Signatures::Verify, None, &[]), Err(KeyError::NoKey)));
    }
}
