//! TLS for the public port (`[server] tls_cert`, `tls_key`, `tls_client_ca`) and the admin
//! listener (`[admin]`, the same keys): PEM files the supervisor reads at start and at every
//! reload, checked by building the rustls configuration they make (a key that does not match
//! its certificate, a file with no certificate, a CA file that is not one: refused then, with
//! the file named). Workers get the files' contents in their spec and read no file of their
//! own, so every worker of a generation serves the same certificate, and a reload that starts
//! workers with a new one is refused as a whole when the new files cannot be used.
//!
//! Certificates: a chain (the server's first, then intermediates); keys: PKCS#8, PKCS#1 or
//! SEC1, in a file only the service's user may read (as `[auth] api_keys_file`). With
//! `tls_client_ca`, every client must present a certificate that CA signed (mTLS).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// A certificate or key file larger than this is refused (a long chain is a few KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Why a PEM file, or the TLS configuration its contents make, cannot be used. Its messages
/// are what `inferd check` and a refused reload print, after the configuration key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "{} has mode {mode:o}: a private key must not be readable or writable by group or others (chmod 600, \
         owned by the service's user; Kubernetes: the Secret volume's defaultMode 0400)",
        path.display()
    )]
    KeyNotPrivate { path: PathBuf, mode: u32 },
    #[error("{} is {bytes} bytes; at most {MAX_FILE_BYTES} are read", path.display())]
    TooLarge { path: PathBuf, bytes: u64 },
    #[error("not a PEM certificate chain: {0}")]
    NotAChain(rustls::pki_types::pem::Error),
    #[error("not a PEM certificate: {0}")]
    NotACertificate(rustls::pki_types::pem::Error),
    #[error("holds no CERTIFICATE block")]
    NoCertificate,
    #[error("holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {0}")]
    NoPrivateKey(rustls::pki_types::pem::Error),
    #[error("holds no usable CA certificate")]
    NoUsableCa,
    /// One of the above, about the file `path` (whose name the error does not hold).
    #[error("{}: {error}", path.display())]
    In { path: PathBuf, error: Box<TlsError> },
    #[error("no certificate was given and no system CA bundle was found ({})", SYSTEM_CA_BUNDLES.join(", "))]
    NoSystemBundle,
    /// rustls refused the configuration (protocol versions, or a key that is not the
    /// certificate's).
    #[error("{0}")]
    Rustls(rustls::Error),
    #[error("client CA: {0}")]
    ClientCa(rustls::server::VerifierBuilderError),
    #[error("the client certificate and key cannot be used together: {0}")]
    ClientIdentity(rustls::Error),
}

/// For callers whose own errors are still text (the supervisor's admin listener, a worker's
/// boot): `?` turns the error into its message.
impl From<TlsError> for String {
    fn from(error: TlsError) -> String {
        error.to_string()
    }
}

/// ALPN for the HTTP/1.1 port and the gRPC (HTTP/2) port.
pub const ALPN_HTTP1: &[u8] = b"http/1.1";
pub const ALPN_H2: &[u8] = b"h2";

/// Where a listener's PEM files are: one of `[server]`'s and `[admin]`'s key sets, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsPaths {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
}

/// A listener's certificate chain, key and client CA, as PEM text: what a worker builds its
/// rustls configuration from. Its `Debug` leaves the key out.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tls {
    pub cert_chain: String,
    pub key: String,
    pub client_ca: Option<String>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("client_ca", &self.client_ca.is_some()).finish_non_exhaustive()
    }
}

impl TlsPaths {
    /// Checks the keys that belong together (`section`: "server" or "admin").
    pub fn validate(&self, section: &'static str) -> Result<(), ConfigError> {
        let key = keys(section);
        let invalid = |key, message: &str| Err(ConfigError::Invalid { key, message: message.into() });
        match (&self.cert, &self.key) {
            (Some(_), None) => return invalid(key[1], "is needed with tls_cert (the certificate's private key)"),
            (None, Some(_)) => return invalid(key[0], "is needed with tls_key (the certificate chain, PEM)"),
            (None, None) if self.client_ca.is_some() => {
                return invalid(key[2], "needs tls_cert and tls_key: client certificates are asked for over TLS")
            }
            _ => {}
        }
        Ok(())
    }

    /// The files, read and checked now; None without `tls_cert` (plain TCP).
    pub fn load(&self, section: &'static str) -> Result<Option<Tls>, ConfigError> {
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else { return Ok(None) };
        let invalid =
            |key: &'static str| move |error: TlsError| ConfigError::Invalid { key, message: error.to_string() };
        let [cert_key, key_key, ca_key] = keys(section);
        let tls = Tls {
            cert_chain: read(cert, false).map_err(invalid(cert_key))?,
            key: read(key, true).map_err(invalid(key_key))?,
            client_ca: self.client_ca.as_deref().map(|ca| read(ca, false)).transpose().map_err(invalid(ca_key))?,
        };
        tls.certificates().map_err(named(cert)).map_err(invalid(cert_key))?;
        tls.private_key().map_err(named(key)).map_err(invalid(key_key))?;
        if let (Some(path), Some(_)) = (&self.client_ca, &tls.client_ca) {
            tls.client_roots().map_err(named(path)).map_err(invalid(ca_key))?;
        }
        tls.server_config(&[]).map_err(|e| ConfigError::Invalid {
            key: key_key,
            message: format!("{} and {} cannot serve together: {e}", cert.display(), key.display()),
        })?;
        Ok(Some(tls))
    }
}

impl Tls {
    /// The rustls configuration of a listener that offers `alpn` (in order of preference).
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?;
        let builder = match self.client_ca.is_some() {
            true => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(self.client_roots()?),
                    provider,
                )
                .build()
                .map_err(TlsError::ClientCa)?;
                builder.with_client_cert_verifier(verifier)
            }
            false => builder.with_no_client_auth(),
        };
        // with_single_cert checks that the key is the certificate's.
        let mut config =
            builder.with_single_cert(self.certificates()?, self.private_key()?).map_err(TlsError::Rustls)?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(config))
    }

    /// Whether clients must present a certificate.
    pub fn mutual(&self) -> bool {
        self.client_ca.is_some()
    }

    fn certificates(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        certificates(&self.cert_chain)
    }

    fn private_key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        private_key(&self.key)
    }

    fn client_roots(&self) -> Result<rustls::RootCertStore, TlsError> {
        roots(self.client_ca.as_deref().unwrap_or_default())
    }
}

/// Where the system keeps its CA bundle (Debian and Ubuntu, RHEL and CentOS, others).
const SYSTEM_CA_BUNDLES: [&str; 3] =
    ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"];

/// A TLS client's side (the trace exporter's, to an https:// collector): the CAs it trusts and,
/// for mTLS, its own certificate chain and key; PEM text, checked when read.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    pub roots: String,
    pub identity: Option<(String, String)>,
}

impl ClientTls {
    /// Reads `roots` (None: the system's CA bundle) and `identity` (chain, key), and checks them
    /// by building the rustls configuration they make.
    pub fn load(roots: Option<&Path>, identity: Option<(&Path, &Path)>) -> Result<ClientTls, TlsError> {
        let roots = match roots {
            Some(path) => read(path, false)?,
            None => {
                SYSTEM_CA_BUNDLES.iter().find_map(|p| read(Path::new(p), false).ok()).ok_or(TlsError::NoSystemBundle)?
            }
        };
        let identity = match identity {
            Some((chain, key)) => {
                let pair = (read(chain, false)?, read(key, true)?);
                certificates(&pair.0).map_err(named(chain))?;
                private_key(&pair.1).map_err(named(key))?;
                Some(pair)
            }
            None => None,
        };
        let tls = ClientTls { roots, identity };
        tls.client_config()?;
        Ok(tls)
    }

    /// The rustls configuration of a client that trusts `roots` and presents `identity`.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .with_root_certificates(roots(&self.roots)?);
        let config = match &self.identity {
            Some((chain, key)) => builder
                .with_client_auth_cert(certificates(chain)?, private_key(key)?)
                .map_err(TlsError::ClientIdentity)?,
            None => builder.with_no_client_auth(),
        };
        Ok(Arc::new(config))
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("identity", &self.identity.is_some()).finish_non_exhaustive()
    }
}

/// `error` about the file `path`.
fn named(path: &Path) -> impl Fn(TlsError) -> TlsError + '_ {
    move |error| TlsError::In { path: path.to_path_buf(), error: Box::new(error) }
}

fn certificates(pem: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain =
        CertificateDer::pem_slice_iter(pem.as_bytes()).collect::<Result<Vec<_>, _>>().map_err(TlsError::NotAChain)?;
    match chain.is_empty() {
        true => Err(TlsError::NoCertificate),
        false => Ok(chain),
    }
}

fn private_key(pem: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(TlsError::NoPrivateKey)
}

/// CA certificates to trust. A system bundle may hold a few that webpki cannot use as trust
/// anchors: those are skipped, as long as one is usable.
fn roots(pem: &str) -> Result<rustls::RootCertStore, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsError::NotACertificate)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let mut roots = rustls::RootCertStore::empty();
    match roots.add_parsable_certificates(certs) {
        (0, _) => Err(TlsError::NoUsableCa),
        _ => Ok(roots),
    }
}

/// The configuration keys of `section`'s certificate, key and client CA.
fn keys(section: &'static str) -> [&'static str; 3] {
    match section {
        "server" => ["server.tls_cert", "server.tls_key", "server.tls_client_ca"],
        _ => ["admin.tls_cert", "admin.tls_key", "admin.tls_client_ca"],
    }
}

/// A PEM file: a regular file of at most 1 MiB; `private`: only its owner may read it.
pub(crate) fn read(path: &Path, private: bool) -> Result<String, TlsError> {
    use std::os::unix::fs::MetadataExt;
    let unreadable = |error| TlsError::Read { path: path.to_path_buf(), error };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(TlsError::NotAFile { path: path.to_path_buf() });
    }
    if private && meta.mode() & 0o077 != 0 {
        return Err(TlsError::KeyNotPrivate { path: path.to_path_buf(), mode: meta.mode() & 0o777 });
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(TlsError::TooLarge { path: path.to_path_buf(), bytes: meta.len() });
    }
    std::fs::read_to_string(path).map_err(unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Files(PathBuf);

    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn files(tag: &str) -> Files {
        let dir = std::env::temp_dir().join(format!("inferd-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Files(dir)
    }

    fn pair(name: &str) -> (String, String) {
        let cert = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        (cert.cert.pem(), cert.signing_key.serialize_pem())
    }

    #[test]
    fn a_matching_pair_loads_and_a_mismatched_one_is_refused() {
        let dir = files("pair");
        let (cert, key) = pair("localhost");
        let (_, other_key) = pair("other");
        let paths = |key_file: &str| TlsPaths {
            cert: Some(write(&dir.0, "cert.pem", &cert, 0o644)),
            key: Some(dir.0.join(key_file)),
            client_ca: None,
        };
        write(&dir.0, "key.pem", &key, 0o600);
        write(&dir.0, "other.pem", &other_key, 0o600);
        let tls = paths("key.pem").load("server").unwrap().expect("configured");
        assert!(!tls.mutual());
        assert!(!format!("{tls:?}").contains("PRIVATE"), "Debug shows no key");
        let err = paths("other.pem").load("server").unwrap_err().to_string();
        assert!(err.contains("server.tls_key") && err.contains("cannot serve together"), "{err}");
    }

    #[test]
    fn unusable_files_are_refused_with_the_key_and_file_named() {
        let dir = files("bad");
        let (cert, key) = pair("localhost");
        let cert_file = write(&dir.0, "cert.pem", &cert, 0o644);
        let key_file = write(&dir.0, "key.pem", &key, 0o600);
        let open_key = write(&dir.0, "open.pem", &key, 0o644);
        let not_pem = write(&dir.0, "junk.pem", "hello\n", 0o600);
        let load = |cert: &Path, key: &Path, ca: Option<&Path>| {
            TlsPaths { cert: Some(cert.into()), key: Some(key.into()), client_ca: ca.map(Path::to_path_buf) }
                .load("admin")
                .unwrap_err()
                .to_string()
        };
        let err = load(&cert_file, &open_key, None);
        assert!(err.contains("admin.tls_key") && err.contains("mode 644"), "{err}");
        let err = load(&not_pem, &key_file, None);
        assert!(err.contains("admin.tls_cert") && err.contains("junk.pem") && err.contains("no CERTIFICATE"), "{err}");
        let err = load(&cert_file, &not_pem, None);
        assert!(err.contains("admin.tls_key") && err.contains("no PEM private key"), "{err}");
        let err = load(&cert_file, &key_file, Some(&not_pem));
        assert!(err.contains("admin.tls_client_ca"), "{err}");
        let err = load(&cert_file, &dir.0.join("missing.pem"), None);
        assert!(err.contains("missing.pem"), "{err}");
        assert!(TlsPaths { cert: Some(cert_file), key: None, client_ca: None }.validate("server").is_err());
        assert!(TlsPaths { cert: None, key: None, client_ca: Some(key_file) }.validate("server").is_err());
    }
}
