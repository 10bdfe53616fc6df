//! Int8 execution with an accuracy guard (`precision = "int8"` or `"auto"` in model.toml).
//!
//! inferd rewrites the model itself ([`rewrite`]: every fp32 MatMul or Gemm with a weight matrix
//! becomes ONNX Runtime's DynamicQuantizeMatMul, weights int8 per output column; fused Attention
//! becomes QAttention), with no Python on the serving host. Before serving it, the guard runs the
//! fp32 and the int8 model side by side on calibration inputs, each alone, and measures what the
//! task cares about: the cosine of each embedding to fp32 (least and mean), for a classifier the
//! largest probability difference and top-1 agreement, for a raw model the relative error of
//! each float output. The inputs are built in for each kind of model (texts of 1 to
//! `max_length` tokens in several languages; generated images; for raw models with float
//! inputs, generated tensors at scales from 0.1 to 10), plus `[quantization] calibration`, the
//! user's own. When the guard fails with every node in int8, the nodes that cost the most
//! accuracy (each measured alone) are kept in fp32, one by one, until it passes; past half of
//! them int8 is refused with the figures (`int8`: the model does not load; `auto`: it is served
//! in fp32). `auto` also keeps fp32 when int8 is not faster on this CPU (measured on the
//! calibration inputs); `int8` is then served with a warning.
//!
//! The outcome is prepared once per model content, settings, runtime and CPU: the int8 file
//! and its report are kept in `runtime.cache_dir` (one process prepares, the others wait on a
//! lock and read it). Without a cache_dir, each worker prepares its own at boot.

pub mod rewrite;

mod calibration;
mod error;
mod guard;
mod report;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use inferd_config::model::{ModelEntry, Precision};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::runtime::model::Runtime;
pub use error::Int8Error;
pub use report::Report;

/// Changes whenever what the preparation writes or how it measures changes.
const FORMAT: &str = "q6";

/// Preparations made without a cache_dir, by folder: the report and the int8 file's bytes.
type Memo = HashMap<PathBuf, (Report, Option<Arc<Vec<u8>>>)>;
static MEMO: Mutex<Option<Memo>> = Mutex::new(None);

/// The file to load for `entry` and what the guard measured; `None` for fp32 as written.
pub struct Prepared {
    pub path: PathBuf,
    pub report: Report,
    /// Made without a cache_dir: to be removed once the session has loaded it ([`remove`]).
    pub scratch: Option<PathBuf>,
}

/// Prepares (or finds prepared) the int8 form of `entry`'s model. `Ok(Some)`: serve that file;
/// `Ok(None)` with a report: serve fp32 (`auto` whose guard failed); `Err`: `int8` refused.
pub fn prepare(runtime: &Runtime, entry: &ModelEntry, sha256: &[u8]) -> Result<(Option<Prepared>, Report), Int8Error> {
    let settings = format!(
        "{FORMAT} {:?} {} {} {} {:?} {:?}",
        entry.precision,
        entry.quantization.min_cosine,
        entry.quantization.max_probability_error,
        entry.quantization.max_relative_error,
        entry.quantization.calibration.as_ref().map(|c| std::fs::read(c).unwrap_or_default()),
        crate::runtime::cpu::Class::detect(),
    );
    // What the calibration inputs and the guard's measure depend on: the task and its head,
    // the tokenizer (its file's text and max_length), the image settings, generated tensors'
    // free dimensions.
    let pipeline = format!(
        "{:?} {:?} {:?} {:?} {:?} {}",
        entry.task,
        entry.tokenizer.as_ref().map(|t| t.max_length),
        entry.embedding.as_ref().map(|e| (e.pooling, &e.output)),
        entry.classification,
        entry.image,
        entry.warmup.dynamic_dim,
    );
    let tokenizer = entry.tokenizer.as_ref().map(|t| std::fs::read(&t.path).unwrap_or_default()).unwrap_or_default();
    let key: String = Sha256::new()
        .chain_update(sha256)
        .chain_update(settings)
        .chain_update(pipeline)
        .chain_update(Sha256::digest(tokenizer))
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let (dir, scratch) = match runtime.cache_root() {
        Some((root, host)) => {
            let dir = root.join(format!("{}-int8-{key}-{host}", entry.name));
            std::fs::create_dir_all(&dir).map_err(|error| Int8Error::File {
                action: "create",
                path: dir.clone(),
                error,
            })?;
            // A preparation someone else could have written is not read.
            crate::runtime::weights::ours(&dir)?;
            (dir, None)
        }
        None => {
            // In the shared temporary folder: a name no one else can predict (the same for this
            // process's sessions, which find what the first wrote), made by this process.
            static NONCE: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
            let nonce = std::hash::BuildHasher::hash_one(NONCE.get_or_init(Default::default), key.as_str());
            let dir =
                std::env::temp_dir().join(format!("inferd-int8-{}-{}-{nonce:016x}", entry.name, std::process::id()));
            match crate::runtime::weights::private_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => crate::runtime::weights::ours(&dir)?,
                Err(error) => return Err(Int8Error::File { action: "create", path: dir, error }),
            }
            (dir.clone(), Some(dir))
        }
    };
    // One process prepares; the others wait here, then read what it wrote.
    let unlocked = |error| Int8Error::File { action: "lock", path: dir.clone(), error };
    let lock = std::fs::File::create(dir.join("lock")).map_err(unlocked)?;
    lock.lock().map_err(unlocked)?;
    let (model, report) = (dir.join("model.onnx"), dir.join("report.json"));
    // Without a cache_dir the folder goes once a session has loaded the file: this process's
    // later sessions (a worker has several) write it again from memory instead of measuring.
    let mut memo = MEMO.lock().unwrap_or_else(|e| e.into_inner());
    let memo = memo.get_or_insert_with(HashMap::new);
    if let Some((r, bytes)) = memo.get(&dir).filter(|_| scratch.is_some()) {
        if let Some(bytes) = bytes {
            std::fs::write(&model, &bytes[..]).map_err(|error| Int8Error::File {
                action: "write",
                path: model.clone(),
                error,
            })?;
        }
        std::fs::write(&report, serde_json::to_vec_pretty(r).expect("json")).map_err(Int8Error::Report)?;
    }
    let found = std::fs::read(&report).ok().and_then(|r| serde_json::from_slice::<Report>(&r).ok());
    let report =
        match found {
            Some(r) if !r.int8 || model.is_file() => {
                info!(model = entry.name, "int8 preparation found in {}", dir.display());
                r
            }
            _ => {
                let started = Instant::now();
                info!(model = entry.name, "preparing int8: rewriting the MatMuls and measuring them against fp32");
                let (bytes, r) = match guard::measure(runtime, entry, sha256, &dir) {
                    Ok(measured) => measured,
                    // Not kept in the cache: the cause may pass (a full disk), and a fixed model is
                    // another preparation anyway.
                    Err(e) if entry.precision == Precision::Auto => {
                        let report = Report::refused(0, format!("the int8 preparation failed: {e}"));
                        warn!(model = entry.name, "precision = \"auto\": serving fp32: {}", report.summary());
                        remove(scratch);
                        return Ok((None, report));
                    }
                    Err(e) => return Err(e),
                };
                if scratch.is_some() {
                    memo.insert(dir.clone(), (r.clone(), bytes.clone().map(Arc::new)));
                }
                if let Some(bytes) = bytes {
                    let tmp = dir.join("model.onnx.tmp");
                    std::fs::write(&tmp, bytes)
                        .and_then(|()| std::fs::rename(&tmp, &model))
                        .map_err(|error| Int8Error::File { action: "write", path: model.clone(), error })?;
                }
                std::fs::write(&report, serde_json::to_vec_pretty(&r).expect("json"))
                    .map_err(|error| Int8Error::File { action: "write", path: report.clone(), error })?;
                info!(model = entry.name, "int8 prepared in {:.1} s: {}", started.elapsed().as_secs_f64(), r.summary());
                if scratch.is_none() {
                    remove_older(&dir, &entry.name);
                }
                r
            }
        };
    match (report.int8, entry.precision) {
        (true, _) => Ok((Some(Prepared { path: model, report: report.clone(), scratch }), report)),
        (false, Precision::Auto) => {
            warn!(model = entry.name, "precision = \"auto\": serving fp32: {}", report.summary());
            remove(scratch);
            Ok((None, report))
        }
        (false, _) => {
            remove(scratch);
            Err(Int8Error::Refused(report.summary()))
        }
    }
}

/// Removes this model's other int8 preparations (earlier contents or settings) from the cache,
/// as shared weights do: a session that loaded one does not need it any more. One being
/// prepared right now (its lock held) is left alone.
fn remove_older(dir: &Path, name: &str) {
    let (Some(root), Some(this)) = (dir.parent(), dir.file_name()) else { return };
    let prefix = format!("{name}-int8-");
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for other in entries.flatten() {
        let file_name = other.file_name();
        if file_name == this || !file_name.to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let free = std::fs::File::open(other.path().join("lock")).is_ok_and(|lock| lock.try_lock().is_ok());
        if free {
            info!(model = name, "removing an earlier int8 preparation: {}", other.path().display());
            let _ = std::fs::remove_dir_all(other.path());
        }
    }
}

/// Removes a preparation made without a cache_dir, once loaded (or refused).
pub fn remove(scratch: Option<PathBuf>) {
    if let Some(dir) = scratch {
        let _ = std::fs::remove_dir_all(dir);
    }
}
