//! One copy of a model's weights in memory, however many sessions and workers.
//!
//! Loaded from the plain file, every ONNX Runtime session optimises the graph again and keeps
//! its own weights (for the int8 MiniLM, fp32 after ORT folds the casts) and its own pre-packed
//! GEMM matrices: a worker with 2 threads holds three sessions, so three copies. Instead, the
//! first session of a model version prepares an *artefact* once: the optimised graph with its
//! initializers in an external data file, pre-packed weights included
//! (`session.save_external_prepacked_constant_initializers`). Sessions then load the artefact
//! with graph optimisation off, and ORT maps its data file read-only: the pages are the page
//! cache's, shared by every session of every worker.
//!
//! Artefacts live in `runtime.cache_dir`, one folder per model content (SHA-256), ONNX Runtime
//! version and CPU (the optimised graph may use the CPU's own layouts), written to a temporary
//! folder and renamed into place, with a manifest of the files' sizes and SHA-256: a folder
//! whose files do not match (truncated, corrupted) is rebuilt, never loaded. Preparing a new
//! version removes the model's older artefacts; a worker still running on one keeps its
//! mapping (the kernel frees the files once nobody maps them).
//!
//! The cache is trusted only when it is the service's own: the folder (and each artefact in
//! it) must belong to the process's user and not be writable by group or others, else every
//! session loads its own weights and `status` says why (someone who could write there could
//! plant an artefact whose manifest matches its own data). Temporary folders get names no one
//! can predict and are made with mkdir's exclusive semantics, mode 0700.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use inferd_config::model::ModelEntry;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

/// Changes whenever what an artefact holds or how it is written changes.
const FORMAT: &str = "v1";
const MODEL_FILE: &str = "model.onnx";
const DATA_FILE: &str = "model.onnx.data";
const MANIFEST: &str = "manifest";

/// Where artefacts go (`runtime.cache_dir`), and what names the runtime and the CPU; held by
/// the process's [`crate::runtime::model::Runtime`].
pub struct Cache {
    dir: PathBuf,
    runtime: String,
    cpu: String,
}

/// Artefacts this process has written ([`written`]).
static WRITTEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many artefacts this process has prepared and written: a load during which this grew
/// prepared its model's shared weights (an optimising session's peak, once per model version
/// and pool), where a later load maps them.
pub fn written() -> u64 {
    WRITTEN.load(std::sync::atomic::Ordering::Relaxed)
}

/// Artefacts this process has checked against their manifest already.
static VERIFIED: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);

impl Cache {
    /// The cache in `dir`. `ort_library`: its file name carries the runtime's version.
    pub fn new(dir: PathBuf, ort_library: &Path) -> Cache {
        let runtime =
            ort_library.file_name().map_or("ort".into(), |n| n.to_string_lossy().replace("libonnxruntime.so.", "ort"));
        Cache { dir, runtime, cpu: cpu_id() }
    }

    /// The folder and what names this runtime and CPU there, made and trusted first (the int8
    /// preparation keeps its files beside the artefacts); None (logged) when it cannot be used.
    pub(crate) fn root(&self) -> Option<(PathBuf, String)> {
        if let Err(e) = make_root(&self.dir) {
            warn!("runtime.cache_dir is not used: {e}");
            return None;
        }
        Some((self.dir.clone(), format!("{}-{}", self.runtime, self.cpu)))
    }
}

/// Why a model's weights are not shared (each session then loads its own copy, and the
/// report says why), or why a cache folder is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot {action} {}: {error}", path.display())]
    File { action: &'static str, path: PathBuf, error: std::io::Error },
    #[error("{}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{}: {error}", path.display())]
    Sync { path: PathBuf, error: std::io::Error },
    #[error("{error}")]
    Io { error: std::io::Error },
    #[error("{0}")]
    Advice(nix::errno::Errno),
    #[error("{0}")]
    Onnx(#[from] crate::onnx::OnnxError),
    #[error("{0}")]
    Session(#[from] ort::Error),
    #[error("{} belongs to uid {uid}, not this service's ({ours}): its artefacts are not trusted", path.display())]
    NotOurs { path: PathBuf, uid: u32, ours: u32 },
    #[error(
        "{} is writable by group or others (mode {mode:o}): its artefacts are not trusted (chmod go-w)",
        path.display()
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error("no manifest: {0}")]
    NoManifest(std::io::Error),
    #[error("manifest line {0:?}")]
    ManifestLine(String),
    #[error("manifest names {0:?}")]
    ManifestNames(String),
    #[error("{file} is {size} bytes with SHA-256 {sha}, the manifest says {listed_size} and {listed_sha}")]
    Changed { file: String, size: u64, sha: String, listed_size: String, listed_sha: String },
    #[error("the manifest lists no model")]
    NoModel,
}

impl From<std::io::Error> for WeightsError {
    fn from(error: std::io::Error) -> WeightsError {
        WeightsError::Io { error }
    }
}

/// The cache folder, made if missing (mode 0700, whatever the umask), and trusted ([`ours`]).
fn make_root(root: &Path) -> Result<(), WeightsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(root).map_err(|error| WeightsError::File {
        action: "create",
        path: root.to_path_buf(),
        error,
    })?;
    ours(root)
}

/// How a session gets its weights: from the shared artefact, or its own copy (and why).
pub enum Weights {
    Shared(PathBuf),
    Private(String),
}

/// The artefact for `entry`'s model file (SHA-256 `sha256`) in `cache`, prepared now if
/// needed; a session then loads `Shared(path)` with graph optimisation off.
pub fn artefact(
    cache: Option<&Cache>,
    entry: &ModelEntry,
    sha256: &[u8],
    build: impl Fn() -> ort::Result<ort::session::builder::SessionBuilder>,
) -> Weights {
    let name = entry.name.as_str();
    if !entry.share_weights {
        return Weights::Private("share_weights = false in model.toml".into());
    }
    let Some(cache) = cache else { return Weights::Private("runtime.cache_dir is not set".into()) };
    let hex: String = sha256.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let key = format!("{name}-{hex}-{}-{}-{FORMAT}", cache.runtime, cache.cpu);
    let dir = cache.dir.join(&key);
    match prepare(&cache.dir, &dir, name, &entry.path, build) {
        Ok(()) => Weights::Shared(dir.join(MODEL_FILE)),
        Err(e) => {
            warn!(model = name, "cannot share this model's weights ({e}); each session loads its own copy");
            Weights::Private(e.to_string())
        }
    }
}

fn prepare(
    root: &Path,
    dir: &Path,
    name: &str,
    source: &Path,
    build: impl Fn() -> ort::Result<ort::session::builder::SessionBuilder>,
) -> Result<(), WeightsError> {
    let mut verified = VERIFIED.lock().unwrap_or_else(|e| e.into_inner());
    let verified = verified.get_or_insert_with(HashSet::new);
    if verified.contains(dir) {
        return Ok(());
    }
    make_root(root)?;
    // Held until the artefact is in place: a sibling preparing the same one waits, then maps it.
    let _turn = turn(root, dir)?;
    if dir.exists() {
        ours(dir)?;
        // Before the check reads the data file through (see `settle_lookup_tables`).
        settle_lookup_tables(dir);
        match check(dir) {
            Ok(()) => {
                verified.insert(dir.to_path_buf());
                return Ok(());
            }
            Err(e) => {
                warn!(model = name, "shared weights in {} are damaged ({e}); preparing them again", dir.display());
                std::fs::remove_dir_all(dir).map_err(|error| WeightsError::File {
                    action: "remove",
                    path: dir.to_path_buf(),
                    error,
                })?;
            }
        }
    }
    remove_abandoned(root);
    let started = std::time::Instant::now();
    // Unpredictable, and made here or not at all: mkdir fails on anything already there
    // (a planted folder or a link), and follows no link at its last component.
    let nonce = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), started);
    let tmp = root.join(format!(
        ".tmp-{}-{nonce:016x}-{}",
        std::process::id(),
        dir.file_name().unwrap_or_default().to_string_lossy()
    ));
    private_dir(&tmp).map_err(|error| WeightsError::File { action: "create", path: tmp.clone(), error })?;
    let written = write(&tmp, source, build);
    // The optimising session's buffers are freed now; hand the memory back to the system
    // instead of keeping it in the allocator (hundreds of MB for a BERT-base model).
    crate::runtime::allocator::trim();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    match std::fs::rename(&tmp, dir) {
        Ok(()) => {
            WRITTEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Another worker got there first: use theirs, once it checks out.
        Err(_) if dir.exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            check(dir)?;
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(WeightsError::File { action: "move the artefact into", path: dir.to_path_buf(), error: e });
        }
    }
    settle_lookup_tables(dir);
    info!(model = name, "shared weights prepared in {} ({:.1} s)", dir.display(), started.elapsed().as_secs_f64());
    remove_older(root, dir, name);
    verified.insert(dir.to_path_buf());
    Ok(())
}

/// This process's turn at `dir`'s artefact, for as long as the lock it returns lives: an
/// exclusive `flock` on a lock file beside it. Workers that start, or load a model on demand,
/// at the same time would otherwise each prepare the same artefact (an optimising session's
/// weights and pre-packed copies each, at once, which a memory budget counts twice); the
/// second waits for the first and maps what it wrote. The kernel drops the lock with its
/// holder, so a worker killed while preparing holds nobody up.
fn turn(root: &Path, dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, WeightsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = root.join(format!(".lock-{}", dir.file_name().unwrap_or_default().to_string_lossy()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|error| WeightsError::File { action: "open", path: path.clone(), error })?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, errno)| WeightsError::File {
        action: "lock",
        path,
        error: errno.into(),
    })
}

/// Lookup tables smaller than this are left as they are.
const SMALL_TABLE: u64 = 1 << 20;

/// Puts the artefact's lookup tables (an embedding matrix: tens of MB, of which a request
/// reads a few rows) in the page cache as 4 KiB pages, before any session of this process maps
/// them.
///
/// A file read through (the manifest check, the writer) is cached in large folios, and a
/// fault in a mapping of it maps the whole folio: each token a request looks up then maps up
/// to 2 MiB of the table, and a 17-token sentence left ~14 MiB of MiniLM's word embeddings
/// resident in every worker. So the tables' cached pages that no process maps are evicted
/// (`POSIX_FADV_DONTNEED`; a sibling's mapped pages stay) and read back without readahead
/// (`POSIX_FADV_RANDOM`), which caches them page by page. A lookup then maps its page and
/// the kernel's fault-around, the cached pages within 64 KiB. The weights read whole on
/// every run keep their large folios. Best effort: what fails is logged, and changes nothing
/// but memory.
fn settle_lookup_tables(dir: &Path) {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    use std::os::unix::fs::FileExt;
    let settle = || -> Result<u64, WeightsError> {
        let model = std::fs::read(dir.join(MODEL_FILE))?;
        let tables = crate::onnx::lookup_tables(&model)?;
        let mut tables = tables.iter().filter(|t| t.file == DATA_FILE && t.length >= SMALL_TABLE).peekable();
        if tables.peek().is_none() {
            return Ok(0);
        }
        let file = std::fs::File::open(dir.join(DATA_FILE))?;
        posix_fadvise(&file, 0, 0, PosixFadviseAdvice::POSIX_FADV_RANDOM).map_err(WeightsError::Advice)?;
        let (mut buffer, mut settled) = (vec![0u8; 1 << 20], 0);
        for table in tables {
            let (Ok(offset), Ok(length)) = (i64::try_from(table.offset), i64::try_from(table.length)) else { continue };
            posix_fadvise(&file, offset, length, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
                .map_err(WeightsError::Advice)?;
            let end = table.offset.saturating_add(table.length);
            let mut at = table.offset;
            while at < end {
                let want = buffer.len().min(usize::try_from(end - at).unwrap_or(usize::MAX));
                match file.read_at(&mut buffer[..want], at)? {
                    0 => break,
                    n => at += n as u64,
                }
            }
            settled += at - table.offset;
        }
        Ok(settled)
    };
    match settle() {
        Ok(0) => {}
        Ok(bytes) => tracing::debug!("lookup tables in {} cached page by page ({bytes} bytes)", dir.display()),
        Err(e) => warn!("lookup tables in {} left as cached: {e}", dir.display()),
    }
}

/// A new folder of mode 0700 (exclusive: an existing path of that name is an error).
pub(crate) fn private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(path)
}

/// `path` is a folder of this process's user that group and others cannot write.
pub(crate) fn ours(path: &Path) -> Result<(), WeightsError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|error| WeightsError::Read { path: path.to_path_buf(), error })?;
    let uid = nix::unistd::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(WeightsError::NotOurs { path: path.to_path_buf(), uid: meta.uid(), ours: uid });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(WeightsError::Writable { path: path.to_path_buf(), mode: meta.mode() & 0o777 });
    }
    Ok(())
}

/// Writes the optimised model, its data file and the manifest into `tmp`.
fn write(
    tmp: &Path,
    source: &Path,
    build: impl Fn() -> ort::Result<ort::session::builder::SessionBuilder>,
) -> Result<(), WeightsError> {
    let builder = build()?;
    let step = |r: ort::session::builder::BuilderResult| r.map_err(|e| WeightsError::Session(ort::Error::from(e)));
    let builder = step(builder.with_optimization_level(GraphOptimizationLevel::All))?;
    let builder = step(builder.with_optimized_model_path(tmp.join(MODEL_FILE)))?;
    let builder =
        step(builder.with_config_entry("session.optimized_model_external_initializers_file_name", DATA_FILE))?;
    let builder =
        step(builder.with_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024"))?;
    let mut builder = step(builder.with_config_entry("session.save_external_prepacked_constant_initializers", "1"))?;
    let session: Session = builder.commit_from_file(source)?;
    drop(session);
    let mut manifest = String::new();
    for file in [MODEL_FILE, DATA_FILE] {
        let path = tmp.join(file);
        // A model without initializers of 1 KiB or more has no data file.
        if file == DATA_FILE && !path.exists() {
            continue;
        }
        let (size, sha) = digest(&path)?;
        manifest += &format!("{file} {size} {sha}\n");
        std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|error| WeightsError::Sync { path, error })?;
    }
    let mut f = std::fs::File::create(tmp.join(MANIFEST))?;
    Ok(f.write_all(manifest.as_bytes()).and_then(|()| f.sync_all())?)
}

/// Every file the manifest lists has its size and SHA-256.
fn check(dir: &Path) -> Result<(), WeightsError> {
    let manifest = std::fs::read_to_string(dir.join(MANIFEST)).map_err(WeightsError::NoManifest)?;
    let mut model = false;
    for line in manifest.lines() {
        let mut parts = line.split(' ');
        let (Some(file), Some(size), Some(sha)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(WeightsError::ManifestLine(line.to_string()));
        };
        if file.contains('/') {
            return Err(WeightsError::ManifestNames(file.to_string()));
        }
        model |= file == MODEL_FILE;
        let (actual_size, actual_sha) = digest(&dir.join(file))?;
        if actual_size.to_string() != size || actual_sha != sha {
            return Err(WeightsError::Changed {
                file: file.to_string(),
                size: actual_size,
                sha: actual_sha,
                listed_size: size.to_string(),
                listed_sha: sha.to_string(),
            });
        }
    }
    if !model {
        return Err(WeightsError::NoModel);
    }
    Ok(())
}

fn digest(path: &Path) -> Result<(u64, String), WeightsError> {
    let unreadable = |error| WeightsError::Read { path: path.to_path_buf(), error };
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    let mut hasher = Sha256::new();
    let size = std::io::copy(&mut file, &mut hasher).map_err(unreadable)?;
    Ok((size, hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// Removes this model's other artefacts (older versions, other runtimes); mappings of them in
/// running workers stay valid until those workers exit.
fn remove_older(root: &Path, keep: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    let prefix = format!("{name}-");
    for entry in entries.flatten() {
        let path = entry.path();
        let file = entry.file_name().to_string_lossy().to_string();
        // Names are `{model}-{16 hex}-...`: the hex keeps `a` from matching `a-b`'s folders.
        let ours = file.strip_prefix(&prefix).is_some_and(|rest| {
            rest.len() > 17 && rest.as_bytes()[16] == b'-' && rest[..16].bytes().all(|b| b.is_ascii_hexdigit())
        });
        if ours && path != keep {
            let _ = std::fs::remove_file(root.join(format!(".lock-{file}")));
            match std::fs::remove_dir_all(&path) {
                Ok(()) => info!(model = name, "removed the older shared weights in {}", path.display()),
                Err(e) => warn!(model = name, "cannot remove {}: {e}", path.display()),
            }
        }
    }
}

/// Removes the temporary folders of preparations whose process is gone (killed mid-way).
fn remove_abandoned(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().to_string();
        let Some(pid) = file.strip_prefix(".tmp-").and_then(|rest| rest.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The CPU, as far as the optimised graph may depend on it: model name and feature flags, and
/// the kernels' class by CPUID (an emulated or masked CPU shows the host's flags).
fn cpu_id() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let pick = |key: &str| text.lines().find(|l| l.starts_with(key)).unwrap_or("").to_string();
    let class = super::cpu::Class::detect();
    let id = format!("{}\n{}\n{}\n{class}", std::env::consts::ARCH, pick("model name"), pick("flags"));
    Sha256::digest(id.as_bytes()).iter().take(4).map(|b| format!("{b:02x}")).collect()
}
