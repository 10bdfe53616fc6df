//! A model folder's OpenSSF model-signing signature, checked before the folder is loaded
//! ([`verify`]) and again once the load is done ([`Verified::unchanged`]).
//!
//! The signature (`model.sig` at the folder's root as the `model_signing` CLI writes it, or
//! the file model.toml names as `signature`) is a Sigstore bundle holding a DSSE envelope;
//! the envelope's payload is an in-toto statement whose predicate lists every file of the
//! folder (path and SHA-256), and its subject's
//! digest is the SHA-256 of those digests in order. A folder verifies when the envelope is
//! the configured key's signature ([`inferd_config::signing`]) and the folder holds exactly
//! the files listed (the statement's own ignored paths and the signature aside), each with
//! its digest; every file a load reads must be one of them.
//!
//! No window between the check and the load: each file's identity (device, inode, size,
//! modification and change times) is taken from the descriptor its digest was read through,
//! and compared with what the path names once the load is done. Any write or rename of a
//! file in between changes its change time (which no user can set back), so a load that read
//! other bytes than those hashed is refused. The settings the entry was made from are derived
//! again from the verified files and compared by digest. A verified digest is remembered
//! while a file's identity is unchanged, so a model loaded again (on demand, after an
//! eviction) is not hashed again.
//!
//! Bounded: the signature file is read only up to [`MAX_SIGNATURE_BYTES`], a statement
//! lists at most [`MAX_FILES`] files, a folder is walked at most [`MAX_DEPTH`] deep.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use base64::Engine as _;
use inferd_config::model::ModelEntry;
use inferd_config::signing::{Signatures, Trust};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A larger signature file is refused unread (a statement for a thousand files is ~150 KiB).
pub const MAX_SIGNATURE_BYTES: u64 = 8 << 20;
/// The most files a statement may list, or a folder hold.
pub const MAX_FILES: usize = 100_000;
/// The deepest a folder is walked.
pub const MAX_DEPTH: usize = 32;

const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";
const PREDICATE_TYPE_V0: &str = "https://model_signing/Digests/v0.1";

/// Why a model folder is not loaded. [`Refusal::reason`] names the kind (a metric label).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("no signature: {} is missing and [models] signatures = \"required\"", file.display())]
    NoSignature { file: PathBuf },
    #[error("signature {}: {bytes} bytes; at most {MAX_SIGNATURE_BYTES} are read", file.display())]
    SignatureTooLarge { file: PathBuf, bytes: u64 },
    #[error("signature {}: {message}", file.display())]
    Malformed { file: PathBuf, message: String },
    #[error("signature {}: {message}", file.display())]
    Unsupported { file: PathBuf, message: String },
    #[error("signed by another key: the signature names key {hint}, [models] signature_public_key is key {expected}")]
    UnknownKey { hint: String, expected: String },
    #[error("the signature does not verify with {signer}")]
    BadSignature { signer: String },
    #[error("signature {}: {error}", file.display())]
    Certificate { file: PathBuf, error: inferd_config::signing::CertificateError },
    #[error("{file}: its SHA-256 is not the signed one (the file was changed after signing)")]
    DigestMismatch { file: String },
    #[error("{file}: the folder holds a file the signature does not list")]
    Added { file: String },
    #[error("{file}: the signature lists a file the folder does not hold")]
    Missing { file: String },
    #[error("{file}: a symbolic link, and the signature was made without --allow_symlinks")]
    Symlink { file: String },
    #[error("{}: the model reads this file, which the signature does not cover ({why})", file.display())]
    NotCovered { file: PathBuf, why: &'static str },
    #[error("{file}: changed while the model was loaded; the next load checks it again")]
    Changed { file: String },
    #[error(
        "{file}: the signed settings are not the ones read at start or at the last reload (changed and signed \
         since?); `inferd reload` reads them again"
    )]
    SettingsChanged { file: String },
    #[error("{}: {error}", file.display())]
    Read { file: PathBuf, error: std::io::Error },
}

impl Refusal {
    /// The refusal's kind, as a metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NoSignature { .. } => "no_signature",
            Refusal::SignatureTooLarge { .. } | Refusal::Malformed { .. } => "malformed",
            Refusal::Unsupported { .. } => "unsupported",
            Refusal::UnknownKey { .. } => "unknown_key",
            Refusal::BadSignature { .. } => "bad_signature",
            Refusal::Certificate { .. } => "untrusted_certificate",
            Refusal::DigestMismatch { .. } => "digest_mismatch",
            Refusal::Added { .. } => "file_added",
            Refusal::Missing { .. } => "file_missing",
            Refusal::Symlink { .. } => "symlink",
            Refusal::NotCovered { .. } => "not_covered",
            Refusal::Changed { .. } | Refusal::SettingsChanged { .. } => "changed",
            Refusal::Read { .. } => "unreadable",
        }
    }
}

/// A folder whose signature verified: who signed it, and each file's identity as hashed.
#[derive(Debug)]
pub struct Verified {
    /// The signer: `key HINT (CURVE)`, HINT the SHA-256 of the key's PEM text, or
    /// `certificate SUBJECT (CURVE)`.
    pub signer: String,
    folder: PathBuf,
    files: BTreeMap<String, (Identity, [u8; 32])>,
    follow_symlinks: bool,
}

impl Verified {
    /// Whether the load read only what was verified: every file still is the one hashed.
    pub fn unchanged(&self) -> Result<(), Refusal> {
        for (name, (identity, _)) in &self.files {
            let now = stat(&self.folder.join(name), self.follow_symlinks).ok();
            if now.as_ref() != Some(identity) {
                return Err(Refusal::Changed { file: name.clone() });
            }
        }
        Ok(())
    }

    /// The verified SHA-256 of file `path`, one of the folder's.
    pub fn digest(&self, path: &Path) -> Option<[u8; 32]> {
        let name = name_of(path.strip_prefix(&self.folder).ok()?)?;
        self.files.get(&name).map(|(_, digest)| *digest)
    }

    /// Whether `path` (a file a load reads) is one of the verified files; `Err` says why not.
    pub fn covers(&self, path: &Path) -> Result<(), Refusal> {
        let not = |why| Err(Refusal::NotCovered { file: path.to_path_buf(), why });
        let Ok(inside) = path.strip_prefix(&self.folder) else { return not("it is outside the model's folder") };
        match name_of(inside) {
            Some(name) if self.files.contains_key(&name) => Ok(()),
            Some(_) => not("the signature leaves it out"),
            None => not("its path goes through `..`"),
        }
    }
}

/// Checks `entry`'s folder against `trust`: `Ok(None)` with signatures off, or with `verify`
/// and no signature file; `Ok(Some)` when the signature verifies and the folder is exactly
/// what it lists, the entry's files among them and its settings the verified ones.
pub fn verify(entry: &ModelEntry, trust: &Trust) -> Result<Option<Verified>, Refusal> {
    if trust.mode == Signatures::Off {
        return Ok(None);
    }
    let folder = match entry.folder.as_os_str().is_empty() {
        true => entry.path.parent().map(Path::to_path_buf).unwrap_or_default(),
        false => entry.folder.clone(),
    };
    let file = entry.signature_file();
    let bundle = match read_bounded(&file)? {
        None if trust.mode == Signatures::Verify => return Ok(None),
        None => return Err(Refusal::NoSignature { file }),
        Some(bytes) => bytes,
    };
    let (statement, signer) = open_envelope(&file, &bundle, trust)?;
    let mut manifest = Manifest::of(&file, statement)?;
    // The signature file is no file of the model, wherever it lies in the folder.
    manifest.ignored.extend(file.strip_prefix(&folder).ok().and_then(name_of));
    let found = walk(&folder, &manifest)?;
    if let Some(added) = found.keys().find(|name| !manifest.files.contains_key(*name)) {
        return Err(Refusal::Added { file: added.clone() });
    }
    if let Some(missing) = manifest.files.keys().find(|name| !found.contains_key(*name)) {
        return Err(Refusal::Missing { file: missing.clone() });
    }
    let mut files = BTreeMap::new();
    for (name, signed) in &manifest.files {
        let identity = hashed(&folder.join(name), manifest.follow_symlinks, signed, name)?;
        files.insert(name.clone(), (identity, *signed));
    }
    let verified = Verified { signer, folder, files, follow_symlinks: manifest.follow_symlinks };
    for path in entry.files() {
        verified.covers(path)?;
    }
    // The entry's settings, derived again from the files just verified.
    let settings = ModelEntry::settings_digest(&verified.folder, &entry.name).ok();
    if !entry.settings_sha256.is_empty() && settings.as_deref() != Some(entry.settings_sha256.as_str()) {
        return Err(Refusal::SettingsChanged { file: inferd_config::model::MODEL_CONFIG_FILE.into() });
    }
    Ok(Some(verified))
}

/// The signature file's bytes; None when there is none.
fn read_bounded(file: &Path) -> Result<Option<Vec<u8>>, Refusal> {
    let io = |error| Refusal::Read { file: file.to_path_buf(), error };
    let handle = match std::fs::File::open(file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        other => other.map_err(io)?,
    };
    let meta = handle.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(Refusal::Malformed { file: file.to_path_buf(), message: "is not a regular file".into() });
    }
    if meta.len() > MAX_SIGNATURE_BYTES {
        return Err(Refusal::SignatureTooLarge { file: file.to_path_buf(), bytes: meta.len() });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // Bounded again: a file that grows while read.
    handle.take(MAX_SIGNATURE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_SIGNATURE_BYTES {
        return Err(Refusal::SignatureTooLarge { file: file.to_path_buf(), bytes: bytes.len() as u64 });
    }
    Ok(Some(bytes))
}

/// The Sigstore bundle, as far as it is read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bundle {
    verification_material: Material,
    dsse_envelope: Option<Envelope>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Material {
    public_key: Option<KeyId>,
    certificate: Option<serde_json::Value>,
    x509_certificate_chain: Option<Chain>,
}

#[derive(Deserialize)]
struct Chain {
    certificates: Vec<RawBytes>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawBytes {
    raw_bytes: String,
}

#[derive(Deserialize)]
struct KeyId {
    #[serde(default)]
    hint: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    payload: String,
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Deserialize)]
struct EnvelopeSignature {
    sig: String,
}

/// The envelope's statement, once its signature verified with `key`.
fn open_envelope(file: &Path, bundle: &[u8], trust: &Trust) -> Result<(Statement, String), Refusal> {
    let malformed = |message: String| Refusal::Malformed { file: file.to_path_buf(), message };
    let unsupported = |message: &str| Refusal::Unsupported { file: file.to_path_buf(), message: message.into() };
    let bundle: Bundle =
        serde_json::from_slice(bundle).map_err(|e| malformed(format!("not a Sigstore bundle: {e}")))?;
    let material = &bundle.verification_material;
    let b64 = base64::engine::general_purpose::STANDARD;
    // Who must have signed: the certificate the bundle carries, if it chains to the configured
    // authorities, or the configured key. The supervisor parsed both before starting this
    // worker.
    let (key, signer) = match (&material.x509_certificate_chain, &material.certificate) {
        (_, Some(_)) => {
            return Err(unsupported(
                "a keyless Sigstore signature (`model_signing sign sigstore`): verifying it needs Sigstore's trust \
                 root and transparency log, which inferd does not read; sign with a key or a certificate",
            ))
        }
        (Some(chain), None) => {
            let chain = chain
                .certificates
                .iter()
                .map(|c| b64.decode(&c.raw_bytes))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| malformed(format!("certificate chain: not base64: {e}")))?;
            let (key, subject) =
                trust.certificate(&chain).map_err(|error| Refusal::Certificate { file: file.to_path_buf(), error })?;
            let signer = format!("certificate {subject} ({})", key.curve());
            (key, signer)
        }
        (None, None) => {
            let Some(key) = trust.key().ok().flatten() else {
                return Err(unsupported(
                    "signed with a key, and [models] signature_public_key names none (only certificate authorities)",
                ));
            };
            if let Some(hint) = material.public_key.as_ref().map(|k| k.hint.as_str()).filter(|h| !h.is_empty()) {
                if hint != key.hint() {
                    return Err(Refusal::UnknownKey { hint: hint.to_string(), expected: key.hint().to_string() });
                }
            }
            let signer = format!("key {} ({})", key.hint(), key.curve());
            (key, signer)
        }
    };
    let Some(envelope) = bundle.dsse_envelope else {
        return Err(malformed("the bundle holds no DSSE envelope".into()));
    };
    if envelope.payload_type != PAYLOAD_TYPE {
        return Err(malformed(format!("payload type '{}', not '{PAYLOAD_TYPE}'", envelope.payload_type)));
    }
    let payload = b64.decode(&envelope.payload).map_err(|e| malformed(format!("payload: not base64: {e}")))?;
    let [signature] = envelope.signatures.as_slice() else {
        return Err(malformed(format!("{} envelope signatures; one is read", envelope.signatures.len())));
    };
    let signature = b64.decode(&signature.sig).map_err(|e| malformed(format!("signature: not base64: {e}")))?;
    // DSSE's pre-authentication encoding of the payload is what was signed.
    let mut signed = format!("DSSEv1 {} {PAYLOAD_TYPE} {} ", PAYLOAD_TYPE.len(), payload.len()).into_bytes();
    signed.extend_from_slice(&payload);
    if !key.verifies(&signed, &signature) {
        return Err(Refusal::BadSignature { signer });
    }
    let statement =
        serde_json::from_slice(&payload).map_err(|e| malformed(format!("payload: not an in-toto statement: {e}")))?;
    Ok((statement, signer))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Statement {
    #[serde(rename = "_type")]
    kind: String,
    subject: Vec<Subject>,
    predicate_type: String,
    predicate: Option<Predicate>,
}

#[derive(Deserialize)]
struct Subject {
    digest: HashMap<String, String>,
}

#[derive(Deserialize)]
struct Predicate {
    serialization: Serialization,
    resources: Vec<Resource>,
}

#[derive(Deserialize)]
struct Serialization {
    method: String,
    hash_type: Option<String>,
    #[serde(default)]
    allow_symlinks: bool,
    #[serde(default)]
    ignore_paths: Vec<String>,
}

#[derive(Deserialize)]
struct Resource {
    name: String,
    algorithm: String,
    digest: String,
}

/// What a verified statement says of the folder: each file's SHA-256 by path, the paths left
/// out, and whether symbolic links were followed.
struct Manifest {
    files: BTreeMap<String, [u8; 32]>,
    ignored: Vec<String>,
    follow_symlinks: bool,
}

impl Manifest {
    fn of(file: &Path, statement: Statement) -> Result<Manifest, Refusal> {
        let malformed = |message: String| Refusal::Malformed { file: file.to_path_buf(), message };
        let unsupported = |message: String| Refusal::Unsupported { file: file.to_path_buf(), message };
        if statement.kind != STATEMENT_TYPE {
            return Err(malformed(format!("statement type '{}', not '{STATEMENT_TYPE}'", statement.kind)));
        }
        if statement.predicate_type == PREDICATE_TYPE_V0 {
            return Err(unsupported(
                "a model-signing v0.x signature (predicate Digests/v0.1): sign again with 1.0 or later".into(),
            ));
        }
        if statement.predicate_type != PREDICATE_TYPE {
            return Err(malformed(format!("predicate type '{}', not '{PREDICATE_TYPE}'", statement.predicate_type)));
        }
        let Some(predicate) = statement.predicate else {
            return Err(malformed("the statement has no predicate".into()));
        };
        let serialization = &predicate.serialization;
        if serialization.method != "files" {
            return Err(unsupported(format!(
                "serialization method '{}': inferd verifies 'files' (the CLI's default) only",
                serialization.method
            )));
        }
        if serialization.hash_type.as_deref().is_some_and(|h| h != "sha256") {
            return Err(unsupported(format!(
                "hash type '{}': inferd verifies sha256 only",
                serialization.hash_type.as_deref().unwrap_or("")
            )));
        }
        if predicate.resources.len() > MAX_FILES {
            return Err(malformed(format!("lists {} files; at most {MAX_FILES} are read", predicate.resources.len())));
        }
        let [subject] = statement.subject.as_slice() else {
            return Err(malformed(format!("{} subjects; a model signature has one", statement.subject.len())));
        };
        let mut root = Sha256::new();
        let mut files = BTreeMap::new();
        for resource in &predicate.resources {
            if resource.algorithm != "sha256" {
                return Err(unsupported(format!(
                    "{}: hashed with '{}', not sha256",
                    resource.name, resource.algorithm
                )));
            }
            let digest = unhex(&resource.digest).ok_or_else(|| {
                malformed(format!("{}: '{}' is not a SHA-256 in hex", resource.name, resource.digest))
            })?;
            let name = name_of(Path::new(&resource.name))
                .filter(|n| n == &resource.name)
                .ok_or_else(|| malformed(format!("'{}' is not a relative path inside the folder", resource.name)))?;
            root.update(digest);
            if files.insert(name, digest).is_some() {
                return Err(malformed(format!("'{}' is listed twice", resource.name)));
            }
        }
        let root: [u8; 32] = root.finalize().into();
        if subject.digest.get("sha256").and_then(|d| unhex(d)) != Some(root) {
            return Err(malformed("the subject's digest is not the digest of the files listed".into()));
        }
        let ignored = serialization.ignore_paths.iter().filter_map(|p| name_of(Path::new(p))).collect();
        Ok(Manifest { files, ignored, follow_symlinks: serialization.allow_symlinks })
    }

    /// Whether the folder's file `name` is left out of the signature.
    fn ignores(&self, name: &str) -> bool {
        self.ignored.iter().any(|i| name == i || name.strip_prefix(i.as_str()).is_some_and(|r| r.starts_with('/')))
    }
}

/// A relative path of plain components, as the statement names files (`a/b.json`); None for
/// one that is absolute, empty, or goes through `.` or `..`.
fn name_of(path: &Path) -> Option<String> {
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part.to_str()?),
            _ => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// The folder's files (relative names) that the signature must list: every regular file, less
/// what it ignores; a symbolic link is refused unless the signature followed them.
fn walk(folder: &Path, manifest: &Manifest) -> Result<BTreeMap<String, ()>, Refusal> {
    let mut found = BTreeMap::new();
    let mut pending = vec![(folder.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = pending.pop() {
        let io = |error| Refusal::Read { file: dir.clone(), error };
        for item in std::fs::read_dir(&dir).map_err(io)? {
            let item = item.map_err(io)?;
            let path = item.path();
            let Some(name) = path.strip_prefix(folder).ok().and_then(name_of) else {
                return Err(Refusal::Read { file: path, error: std::io::Error::other("a name that is not UTF-8") });
            };
            if manifest.ignores(&name) {
                continue;
            }
            let mut kind = item.file_type().map_err(|error| Refusal::Read { file: path.clone(), error })?;
            if kind.is_symlink() {
                if !manifest.follow_symlinks {
                    return Err(Refusal::Symlink { file: name });
                }
                kind =
                    std::fs::metadata(&path).map_err(|error| Refusal::Read { file: path.clone(), error })?.file_type();
            }
            if kind.is_dir() {
                if depth + 1 >= MAX_DEPTH {
                    return Err(Refusal::Read {
                        file: path,
                        error: std::io::Error::other(format!("more than {MAX_DEPTH} folders deep")),
                    });
                }
                pending.push((path, depth + 1));
            } else if kind.is_file() {
                found.insert(name, ());
                if found.len() > MAX_FILES {
                    return Err(Refusal::Read {
                        file: dir.clone(),
                        error: std::io::Error::other(format!("more than {MAX_FILES} files")),
                    });
                }
            }
        }
    }
    Ok(found)
}

/// A file's identity: what any write, rename or replacement of it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    device: u64,
    inode: u64,
    size: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Identity {
        Identity {
            device: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

fn stat(path: &Path, follow_symlinks: bool) -> std::io::Result<Identity> {
    let meta = if follow_symlinks { std::fs::metadata(path) } else { std::fs::symlink_metadata(path) }?;
    Ok(Identity::of(&meta))
}

/// Digests verified in this process, by path, while the file's identity stays the same.
static VERIFIED: Mutex<BTreeMap<PathBuf, (Identity, [u8; 32])>> = Mutex::new(BTreeMap::new());

/// Checks that file `path` (`name` in the statement) has the digest `signed`; its identity as
/// read. A digest verified before for the same identity is not read again.
fn hashed(path: &Path, follow_symlinks: bool, signed: &[u8; 32], name: &str) -> Result<Identity, Refusal> {
    let io = |error| Refusal::Read { file: path.to_path_buf(), error };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    if !follow_symlinks {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW);
    }
    let mut file = options.open(path).map_err(io)?;
    let before = Identity::of(&file.metadata().map_err(io)?);
    let remembered = VERIFIED.lock().unwrap_or_else(|p| p.into_inner()).get(path).cloned();
    let digest = match remembered {
        Some((identity, digest)) if identity == before => digest,
        _ => {
            let mut hasher = Sha256::new();
            std::io::copy(&mut file, &mut hasher).map_err(io)?;
            let digest: [u8; 32] = hasher.finalize().into();
            // Written to while it was read: what was hashed is not one file's bytes.
            if Identity::of(&file.metadata().map_err(io)?) != before {
                return Err(Refusal::Changed { file: name.to_string() });
            }
            digest
        }
    };
    if &digest != signed {
        return Err(Refusal::DigestMismatch { file: name.to_string() });
    }
    VERIFIED.lock().unwrap_or_else(|p| p.into_inner()).insert(path.to_path_buf(), (before.clone(), digest));
    Ok(before)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement listing `files` (name, SHA-256 hex), its subject the digest of theirs.
    fn statement(files: &[(&str, &str)]) -> Statement {
        let mut root = Sha256::new();
        for (_, digest) in files {
            root.update(unhex(digest).unwrap_or_default());
        }
        let root: String = root.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let resources: Vec<_> = files
            .iter()
            .map(|(name, digest)| serde_json::json!({"name": name, "algorithm": "sha256", "digest": digest}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "_type": STATEMENT_TYPE,
            "subject": [{"name": "m", "digest": {"sha256": root}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {
                "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": false, "ignore_paths": [".git"]},
                "resources": resources,
            },
        }))
        .unwrap()
    }

    const A: &str = "aad4db752ac308ac1861c753d7d0ad9bbbf13e8c6bf1b0c4049c854ac1097d77";

    #[test]
    fn paths_that_leave_the_folder_or_repeat_are_refused() {
        let file = Path::new("model.sig");
        let manifest = Manifest::of(file, statement(&[("model.onnx", A), ("1_Pooling/config.json", A)])).unwrap();
        assert_eq!(manifest.files.keys().collect::<Vec<_>>(), ["1_Pooling/config.json", "model.onnx"]);
        assert!(manifest.ignores(".git/HEAD") && manifest.ignores(".git") && !manifest.ignores(".github"));
        for bad in ["../model.onnx", "/etc/passwd", "a/../../b", "./model.onnx", "a//b", ""] {
            let refused = Manifest::of(file, statement(&[(bad, A)]));
            assert!(
                matches!(&refused, Err(Refusal::Malformed { message, .. }) if message.contains("is not a relative path")),
                "{bad}"
            );
        }
        let twice = Manifest::of(file, statement(&[("model.onnx", A), ("model.onnx", A)]));
        assert!(matches!(twice, Err(Refusal::Malformed { message, .. }) if message.contains("listed twice")));
        let short = Manifest::of(file, statement(&[("model.onnx", &A[..62])]));
        assert!(matches!(short, Err(Refusal::Malformed { message, .. }) if message.contains("is not a SHA-256")));
    }

    #[test]
    fn a_subject_that_is_not_the_files_digest_is_refused() {
        let mut forged = statement(&[("model.onnx", A)]);
        forged.subject[0].digest.insert("sha256".into(), A.into());
        let refused = Manifest::of(Path::new("model.sig"), forged);
        assert!(matches!(refused, Err(Refusal::Malformed { message, .. }) if message.contains("subject's digest")));
    }

    #[test]
    fn keyless_bundles_are_unsupported_certificates_need_authorities_and_a_foreign_key_is_named() {
        let pem = "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEdGs8sdxFtHHbSpypHTfxdzSn/moD\n\
                   8R4GREgZ4ffeOC3GyAeN6ueQmcbXC3J01sDhZd8tsxBCdS7S/mwnJw5K3w==\n-----END PUBLIC KEY-----\n";
        let trust = Trust { mode: Signatures::Required, public_key: Some(pem.into()), certificate_chain: Vec::new() };
        let envelope = r#""dsseEnvelope": {"payload": "", "payloadType": "application/vnd.in-toto+json", "signatures": [{"sig": ""}]}"#;
        let file = Path::new("model.sig");
        let open = |material: &str| {
            open_envelope(file, format!(r#"{{"verificationMaterial": {material}, {envelope}}}"#).as_bytes(), &trust)
                .err()
        };
        let keyless = open(r#"{"certificate": {"rawBytes": ""}, "tlogEntries": [{}]}"#);
        assert!(matches!(&keyless, Some(Refusal::Unsupported { message, .. }) if message.contains("keyless Sigstore")));
        let chain = open(r#"{"x509CertificateChain": {"certificates": [{"rawBytes": "AAAA"}]}}"#);
        assert!(matches!(
            chain,
            Some(Refusal::Certificate { error: inferd_config::signing::CertificateError::NoAuthorities, .. })
        ));
        let foreign = open(r#"{"publicKey": {"hint": "abc"}}"#);
        assert!(matches!(&foreign, Some(Refusal::UnknownKey { hint, .. }) if hint == "abc"));
        assert!(matches!(open("{}"), Some(Refusal::BadSignature { .. })));
    }
}
