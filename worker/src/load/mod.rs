//! Loading a model, above the runtime: its digest (the file and the external data it names),
//! its int8 form when model.toml asks (rewritten, measured against fp32 by the accuracy
//! guard and kept in the cache: [`int8`]), its sessions, one per lane
//! ([`crate::runtime::model`]), and its pipeline (tokenizer or image decoding in front,
//! pooling or scoring behind: [`crate::pipeline`]), built once for all of them. The runtime
//! knows a model by its sessions and tensors; the handlers by the [`Model`] made here
//! ([`model`], with its pipeline's building).
//!
//! Runs on the boot thread, before the worker serves, and on the request layer's loader
//! thread for models loaded on demand: loading a model takes ONNX Runtime seconds of CPU, and
//! the int8 guard many runs of the model.

pub mod int8;
pub mod model;
pub mod signature;

use std::path::Path;
use std::sync::Arc;

use inferd_config::model::{ModelEntry, Precision};
use inferd_config::signing::Trust;
use inferd_ipc::spec::Precision as Served;
use sha2::{Digest, Sha256};
use tracing::info;

use crate::pipeline::BuildError;
use crate::runtime::engine::Sessions;
use crate::runtime::model::{ModelError, ModelSession, Runtime, Threads};
pub use model::Model;

/// The sessions a worker runs a model on: one narrow session per lane, a wide one on the
/// worker's whole pool (more than one thread, or a core it may borrow), and the background
/// lane's (a worker of one thread).
#[derive(Debug, Clone, Copy)]
pub struct Lanes {
    pub narrow: usize,
    pub wide: Option<Threads>,
    pub background: bool,
}

/// Why a model was not loaded: ONNX Runtime or the pipeline could not make it, or its
/// folder's signature refused it.
#[derive(Debug, thiserror::Error)]
pub enum NotLoaded {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("model '{model}' refused by its signature: {refusal}")]
    Refused { model: String, refusal: signature::Refusal },
}

impl NotLoaded {
    /// The model and the refusal's kind ([`signature::Refusal::reason`]), for a refusal.
    pub fn refused(&self) -> Option<(&str, &'static str)> {
        match self {
            NotLoaded::Refused { model, refusal } => Some((model, refusal.reason())),
            NotLoaded::Model(_) => None,
        }
    }
}

/// Loads `entry` into the sessions `lanes` asks for, not yet warmed up, if its folder's
/// signature verifies as `trust` asks ([`signature`]).
pub fn load(
    runtime: &Runtime,
    entry: &ModelEntry,
    lanes: &Lanes,
    trust: &Trust,
) -> Result<(Model, Sessions), NotLoaded> {
    let source = Source::prepare(runtime, entry, trust)?;
    let first = source.session(runtime, Threads::Narrow)?;
    // Before the other sessions: a model.toml that does not fit the model fails at once.
    let model = source.model(&first)?;
    let mut narrow = vec![first];
    for _ in 1..lanes.narrow.max(1) {
        narrow.push(source.session(runtime, Threads::Narrow)?);
    }
    let wide = lanes.wide.map(|threads| source.session(runtime, threads)).transpose()?;
    let background = lanes.background.then(|| source.session(runtime, Threads::Narrow)).transpose()?;
    source.unchanged()?;
    Ok((model, Sessions { narrow, wide, background }))
}

/// Loads `entry` into one session on `threads` (`inferd check`, benchmarks), as [`load`].
pub fn one(
    runtime: &Runtime,
    entry: &ModelEntry,
    threads: Threads,
    trust: &Trust,
) -> Result<(Model, ModelSession), NotLoaded> {
    let source = Source::prepare(runtime, entry, trust)?;
    let session = source.session(runtime, threads)?;
    let model = source.model(&session)?;
    source.unchanged()?;
    Ok((model, session))
}

/// What a model's sessions are loaded from: its int8 form as the guard prepared it, or the
/// model as written. A preparation made without a cache_dir is removed when this goes, once
/// every session has read it.
struct Source<'a> {
    entry: &'a ModelEntry,
    /// The model's digest, and the loaded file's (its int8 form's, when int8 is served).
    sha256: Vec<u8>,
    file: ModelEntry,
    file_sha256: Vec<u8>,
    /// What status says of the precision served.
    precision: Served,
    scratch: Option<std::path::PathBuf>,
    /// The folder's signature, verified before anything was read.
    verified: Option<signature::Verified>,
}

/// Why a model's files were not made ready for ONNX Runtime (told as [`ModelError::Load`]'s
/// message).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot read {}: {error}", path.display())]
    Read { path: std::path::PathBuf, error: std::io::Error },
    #[error("the file is too large")]
    TooLarge,
    #[error("external data {} named by the model: {error}", path.display())]
    ExternalData { path: std::path::PathBuf, error: std::io::Error },
    #[error("model.toml: {0}")]
    Pipeline(#[from] BuildError),
    #[error("{0}")]
    Int8(#[from] int8::Int8Error),
}

impl<'a> Source<'a> {
    fn prepare(runtime: &Runtime, entry: &'a ModelEntry, trust: &Trust) -> Result<Source<'a>, NotLoaded> {
        let fail = |e: SourceError| load_error(entry, e.to_string());
        let refused = |refusal| NotLoaded::Refused { model: entry.name.clone(), refusal };
        let started = std::time::Instant::now();
        let verified = signature::verify(entry, trust).map_err(refused)?;
        let (sha256, external) = digest(&entry.path, verified.as_ref()).map_err(fail)?;
        if let Some(verified) = &verified {
            let folder = entry.path.parent().unwrap_or(Path::new("."));
            for location in &external {
                verified.covers(&folder.join(location)).map_err(refused)?;
            }
            let ms = started.elapsed().as_secs_f64() * 1e3;
            info!(model = entry.name, "signature verified in {ms:.0} ms: signed by {}", verified.signer);
        }
        let plain = ModelEntry { precision: Precision::Fp32, ..entry.clone() };
        let source = |file, file_sha256, precision, scratch| Source {
            entry,
            sha256: sha256.clone(),
            file,
            file_sha256,
            precision,
            scratch,
            verified: None,
        };
        let mut source = match entry.precision {
            Precision::Fp32 => source(plain, sha256.clone(), Served::FP32, None),
            _ => match int8::prepare(runtime, entry, &sha256).map_err(|e| fail(e.into()))? {
                (Some(prepared), report) => {
                    // Made before the digest, so that an error still removes the scratch copy.
                    let mut int8 = source(
                        ModelEntry { path: prepared.path, ..plain },
                        Vec::new(),
                        report.precision(),
                        prepared.scratch,
                    );
                    int8.file_sha256 = digest(&int8.file.path, None).map_err(fail)?.0;
                    int8
                }
                (None, report) => source(plain, sha256.clone(), report.precision(), None),
            },
        };
        source.verified = verified;
        Ok(source)
    }

    /// Once every session and the pipeline are made: the signed files they read were the
    /// verified ones ([`signature::Verified::unchanged`]).
    fn unchanged(&self) -> Result<(), NotLoaded> {
        match &self.verified {
            Some(verified) => {
                verified.unchanged().map_err(|refusal| NotLoaded::Refused { model: self.entry.name.clone(), refusal })
            }
            None => Ok(()),
        }
    }

    /// One session on `threads`, named as the model.
    fn session(&self, runtime: &Runtime, threads: Threads) -> Result<ModelSession, ModelError> {
        let mut session = ModelSession::load(runtime, &self.file, threads, &self.file_sha256)?;
        let signer = self.verified.as_ref().map(|v| v.signer.clone());
        session.stand_for(self.entry, &self.sha256, self.precision.clone(), signer);
        Ok(session)
    }

    /// The model as the handlers see it, with the pipeline built around `session`'s inputs
    /// and outputs.
    fn model(&self, session: &ModelSession) -> Result<Model, ModelError> {
        let pipeline = model::pipeline(self.entry, &session.meta)
            .map_err(|e| load_error(self.entry, SourceError::from(e).to_string()))?;
        Ok(Model { meta: session.meta.clone(), pipeline: Arc::new(pipeline) })
    }
}

impl Drop for Source<'_> {
    fn drop(&mut self) {
        int8::remove(self.scratch.take());
    }
}

fn load_error(entry: &ModelEntry, message: String) -> ModelError {
    ModelError::Load { model: entry.name.clone(), path: entry.path.display().to_string(), message }
}

/// The SHA-256 of a model: its file, then the name and content of each external data file the
/// graph names (`model.onnx_data`), so that new weights beside the same graph are a new
/// version (and a new shared artefact). Streamed through a small buffer, so that hashing adds
/// nothing to the worker's memory: a mapping of the whole file would count in its PSS (and
/// against its share of models.memory_budget) while it is read. The external files are then
/// found in a mapping of which only the graph's structure is read (a tensor's bytes are passed
/// over, never touched). With the folder's signature verified, the file's own SHA-256 is the
/// verified one, not read again. Returns the external files' locations too.
fn digest(path: &Path, verified: Option<&signature::Verified>) -> Result<(Vec<u8>, Vec<String>), SourceError> {
    let io = |error| SourceError::Read { path: path.to_path_buf(), error };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = usize::try_from(file.metadata().map_err(io)?.len()).map_err(|_| SourceError::TooLarge)?;
    let mut external = Vec::new();
    if len > 0 {
        use std::os::fd::AsRawFd;
        // SAFETY: a private read-only mapping of the whole file, unmapped below; a file
        // changed under it gives another list, not unsafety in a byte slice we only read.
        let at =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0) };
        if at == libc::MAP_FAILED {
            return Err(io(std::io::Error::last_os_error()));
        }
        let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
        // A file that does not parse is ONNX Runtime's to refuse, with its own message.
        external = crate::onnx::external_files(bytes).unwrap_or_default();
        unsafe { libc::munmap(at, len) };
    }
    if let (Some(known), true) = (verified.and_then(|v| v.digest(path)), external.is_empty()) {
        return Ok((known.to_vec(), external));
    }
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io)?;
    let folder = path.parent().unwrap_or(Path::new("."));
    for location in &external {
        let data = folder.join(location);
        let mut data_file =
            std::fs::File::open(&data).map_err(|error| SourceError::ExternalData { path: data.clone(), error })?;
        hasher.update(location.as_bytes());
        std::io::copy(&mut data_file, &mut hasher).map_err(io)?;
    }
    Ok((hasher.finalize().to_vec(), external))
}
