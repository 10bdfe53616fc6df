//! ORT sessions: a model file into a session with its options, runs and warm-up. ONNX Runtime
//! is also reached by allocator.rs (the shared arena), weights.rs (prepared, mapped weights),
//! tensor.rs (values in and out) and the engine (runs); nothing above those does. What a model
//! is made of above its sessions (its digest, its int8 form, its pipeline) is the loader's
//! ([`crate::load`]).
//!
//! One ORT environment per process, created once by [`Runtime::init`]. A model is loaded as
//! *narrow* sessions that run only on the thread that calls them ([`Threads::Narrow`], no pool
//! threads) and, in a worker of T > 1 threads, a *wide* session with a pool of its own
//! ([`Threads::Wide`]: the caller plus T-1 threads, asleep between runs).
//! Loading goes through [`crate::runtime::weights`]: a model's prepared artefact (its weights in an
//! mmap'd file, shared by every worker) is used when there is one.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use inferd_config::file::Allocator;
use inferd_config::model::{ModelEntry, Task};
use inferd_ipc::spec::{ModelInfo, Precision};
use ort::environment::Environment;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::ValueType;

use crate::runtime::tensor::{element_count, ort_type_name, DataType, Tensor, TensorData, TensorSpec};
use crate::runtime::weights::{self, Weights};

/// What went wrong with a model itself: ONNX Runtime or the model could not be loaded or
/// warmed up, or a run failed. The engine's own refusals (a full queue, a deadline, the run
/// clock) are [`crate::runtime::engine::EngineError`]s.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot load ONNX Runtime from {path}: {message}")]
    Runtime { path: String, message: String },
    #[error("model '{model}' failed to load from {path}: {message}")]
    Load { model: String, path: String, message: String },
    #[error("model '{model}' failed its warm-up run: {message}")]
    Warmup { model: String, message: String },
    #[error("model '{model}' rejected the input: {message}")]
    InvalidInput { model: String, message: String },
    #[error("model '{model}' failed: {message}")]
    Run { model: String, message: String },
    #[error("model '{model}' produced output '{output}' of a type inferd cannot return")]
    UnsupportedOutput { model: String, output: String },
}

/// What a model's sessions take and give, and what status and metadata say of it; shared,
/// read-only.
#[derive(Debug, Clone)]
pub struct ModelMeta {
    pub info: ModelInfo,
    pub task: Task,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// model.toml's [batching], with the command line's overrides.
    pub batching: inferd_config::model::Batching,
}

/// Why a model's first dimension is not taken as a batch ([`ModelMeta::batch_rows`]): its
/// requests then run whole, each alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoBatch {
    #[error("its model.toml says [batching] max_batch_size = 0")]
    Declared,
    #[error("not every input and output has a dynamic first dimension of one name")]
    Shape,
    #[error(
        "its tensors come from the client, and the graph does not name their first dimension as a batch \
         ({}); [batching] max_batch_size >= 1 in its model.toml says it is one",
        if .0.is_empty() { "unnamed".to_string() } else { format!("'{}'", .0) }
    )]
    Unnamed(String),
}

impl ModelMeta {
    /// The most rows a run of this model takes, when its first dimension is a batch (each row
    /// answered on its own, so requests may be run together and a request cut into runs of
    /// fewer rows); why not otherwise. It can be one only where every input and output has a
    /// dynamic first dimension, and those the graph names have one name (an output named
    /// otherwise, `num_detections` beside `batch`, has as many rows as the model finds: a batch
    /// could not be split back by rows). Then it is one where model.toml's `max_batch_size` is
    /// at least 1; where model.toml does not say, when inferd builds the rows itself (a
    /// tokenizer or an image pipeline), or the graph names the dimension as a batch (`batch`,
    /// `batch_size`, ...). A dynamic first dimension alone proves nothing: a CumSum over a
    /// vector, or a sum over rows, answers otherwise cut in pieces.
    pub fn batch_rows(&self) -> Result<usize, NoBatch> {
        let declared = self.batching.max_batch_size;
        if declared == Some(0) {
            return Err(NoBatch::Declared);
        }
        let specs = || self.inputs.iter().chain(&self.outputs);
        let mut names = specs().map(|t| t.first_dim.as_str()).filter(|n| !n.is_empty());
        let name = names.next().unwrap_or_default();
        if !(names.all(|n| n == name) && specs().all(|t| t.shape.first().is_some_and(|&d| d < 0))) {
            return Err(NoBatch::Shape);
        }
        match declared {
            Some(rows) => Ok(rows),
            None if self.task != Task::Raw || name.to_ascii_lowercase().contains("batch") => {
                Ok(inferd_config::model::DEFAULT_MAX_BATCH_SIZE)
            }
            None => Err(NoBatch::Unnamed(name.to_string())),
        }
    }
}

#[cfg(test)]
impl ModelMeta {
    /// The unit tests' model: a raw model `name` (version 1) of `inputs` and `outputs`, each
    /// (name, datatype, shape), with model.toml's defaults.
    pub fn for_tests(
        name: &str,
        inputs: &[(&str, DataType, &[i64])],
        outputs: &[(&str, DataType, &[i64])],
    ) -> ModelMeta {
        let spec = |(name, dtype, shape): &(&str, DataType, &[i64])| TensorSpec {
            name: name.to_string(),
            datatype: dtype.name().into(),
            shape: shape.to_vec(),
            dtype: Some(*dtype),
            first_dim: String::new(),
            optional: false,
        };
        ModelMeta {
            info: ModelInfo {
                name: name.into(),
                version: "1".into(),
                sha256: "0".into(),
                weights: Default::default(),
                precision: Default::default(),
                signer: None,
            },
            task: Task::Raw,
            inputs: inputs.iter().map(spec).collect(),
            outputs: outputs.iter().map(spec).collect(),
            batching: Default::default(),
        }
    }
}

/// One ORT session of a model (narrow or wide, see [`Threads`]) and what it takes and gives.
pub struct ModelSession {
    pub meta: ModelMeta,
    entry: ModelEntry,
    session: Session,
}

static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();

/// The process's ONNX Runtime: its one environment, the allocator its sessions use and where
/// prepared weights are kept. Made by [`Runtime::init`] before anything is loaded, and passed
/// to every load ([`ModelSession::load`]): nothing a load depends on is set elsewhere.
pub struct Runtime {
    env: &'static Environment,
    allocator: Allocator,
    weights: Option<weights::Cache>,
}

impl Runtime {
    /// Loads libonnxruntime and creates the process's one environment (the first call; later
    /// ones reuse it), in the process that will run sessions, after it was created (never in a
    /// parent that later forks). `cache_dir`: runtime.cache_dir, for prepared weights.
    pub fn init(library: &Path, allocator: Allocator, cache_dir: Option<PathBuf>) -> Result<Runtime, ModelError> {
        let fail = |message: String| ModelError::Runtime { path: library.display().to_string(), message };
        let env = match ENVIRONMENT.get() {
            Some(env) => env,
            None => {
                // ONNX Runtime 1.31's Linux build starts a telemetry thread that uploads usage
                // data over HTTPS unless this is set (or it detects a CI system). A server's
                // workers do not phone home, and the thread would count against the worker's
                // thread budget. The process is still single-threaded here, so changing the
                // environment is safe.
                std::env::set_var("ORT_DISABLE_TELEMETRY", "1");
                // The library must be loaded before any other ort call: they all go through its
                // API table.
                let builder = ort::init_from(library).map_err(|e| fail(e.to_string()))?;
                // No global thread pool: its threads would spin after every run, which a
                // session's own pool can be told not to (see `Threads::Wide`).
                let env = builder.with_name("inferd").with_telemetry(false).build().map_err(|e| fail(e.to_string()))?;
                let env = ENVIRONMENT.get_or_init(|| env);
                crate::runtime::allocator::configure(allocator, env).map_err(|e| fail(e.to_string()))?;
                env
            }
        };
        Ok(Runtime { env, allocator, weights: cache_dir.map(|dir| weights::Cache::new(dir, library)) })
    }

    /// Where int8 preparations are kept (beside the weights artefacts), when there is a cache.
    pub(crate) fn cache_root(&self) -> Option<(PathBuf, String)> {
        self.weights.as_ref()?.root()
    }
}

/// Which threads a session's operators run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// Only the thread that calls `run`: a *narrow* session, one per lane, for runs side by side.
    Narrow,
    /// `threads` in all (the caller and a pool of its own): a *wide* session, for a request
    /// that has the worker to itself. `spin`: pool threads spin between the operators of a run
    /// (server.intra_op_spinning); `block_base`: how finely its loops are split between them
    /// (server.intra_op_block_base, 0 = ORT's static split); `pool_cpu`: the CPU every pool
    /// thread is pinned to (a core borrowed from a sibling worker, see
    /// [`crate::runtime::engine`]), or none (they run where the worker's mask lets them).
    Wide { threads: usize, spin: bool, block_base: u32, pool_cpu: Option<usize> },
}

/// The first 16 hex digits of a SHA-256, as status and metadata show it.
pub fn sha256_prefix(digest: &[u8]) -> String {
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

impl ModelSession {
    /// Loads `entry`'s file as it is into a session that runs on `threads`, from the shared
    /// artefact of its weights where `runtime.cache_dir` allows (see [`weights`]); `digest`:
    /// the file's SHA-256 (with its external data), which names that artefact.
    pub fn load(
        runtime: &Runtime,
        entry: &ModelEntry,
        threads: Threads,
        digest: &[u8],
    ) -> Result<ModelSession, ModelError> {
        let fail = |message: String| ModelError::Load {
            model: entry.name.clone(),
            path: entry.path.display().to_string(),
            message,
        };
        let env = runtime.env;
        let sha256 = sha256_prefix(digest);
        if let Some(ops) = &entry.custom_ops {
            ops.preload.iter().try_for_each(|lib| preload(lib)).map_err(|e| fail(e.to_string()))?;
        }
        // What every session of this process shares: one thread of its own by default.
        let base = || -> ort::Result<ort::session::builder::SessionBuilder> {
            let plain = |r: ort::session::builder::BuilderResult| r.map_err(ort::Error::<()>::from);
            let builder = Session::builder(env)?;
            let builder = match &entry.custom_ops {
                Some(ops) => plain(builder.with_operator_library(&ops.library))?,
                None => builder,
            };
            let builder = plain(builder.with_inter_threads(1))?;
            let builder = plain(builder.with_parallel_execution(false))?;
            let builder = plain(builder.with_inter_op_spinning(false))?;
            // runtime.allocator (see [`crate::runtime::allocator`]). Memory patterns, which pre-plan
            // buffers per input shape that dynamic batches and sequence lengths never repeat,
            // are off except with ORT's own defaults (`arena`).
            let builder = match runtime.allocator {
                Allocator::Malloc => {
                    let cpu = ort::ep::CPU::default().with_arena_allocator(false).build();
                    let builder = plain(builder.with_execution_providers([cpu]))?;
                    plain(builder.with_memory_pattern(false))?
                }
                Allocator::Arena | Allocator::ArenaShrink => builder,
                // The process's arena, registered with the environment (see `allocator`).
                Allocator::SharedArena => {
                    let builder = plain(builder.with_config_entry("session.use_env_allocators", "1"))?;
                    plain(builder.with_memory_pattern(false))?
                }
            };
            plain(builder.with_intra_threads(1))
        };
        let weights = weights::artefact(runtime.weights.as_ref(), entry, digest, base);
        // Builder errors carry the builder; keep only the message.
        let step = |r: ort::session::builder::BuilderResult| r.map_err(|e| fail(ort::Error::<()>::from(e).to_string()));
        let builder = base().map_err(|e| fail(e.to_string()))?;
        // The artefact is optimised already (and for this CPU); optimising again would copy the
        // weights it maps.
        let builder = match &weights {
            Weights::Shared(_) => step(builder.with_optimization_level(GraphOptimizationLevel::Disable))?,
            Weights::Private(_) => builder,
        };
        let mut builder = match threads {
            Threads::Narrow => step(builder.with_intra_threads(1))?,
            // Pool threads may spin between the operators of a run but stop when it ends:
            // measured on MiniLM at 20 lone requests/s, spinning past the end of each run cost
            // 0.5 of a core (the worker used 774 ms of CPU per second, 246 with the stop).
            Threads::Wide { threads, spin, block_base, pool_cpu } => {
                let builder = step(builder.with_intra_threads(threads))?;
                // ONNX Runtime numbers CPUs from 1, one group per pool thread.
                let builder = match pool_cpu {
                    Some(cpu) => {
                        let groups = vec![(cpu + 1).to_string(); threads.saturating_sub(1)].join(";");
                        step(builder.with_config_entry("session.intra_op_thread_affinities", groups))?
                    }
                    None => builder,
                };
                let builder = step(builder.with_intra_op_spinning(spin))?;
                let builder = match block_base {
                    0 => builder,
                    base => step(builder.with_config_entry("session.dynamic_block_base", base.to_string()))?,
                };
                step(builder.with_config_entry("session.force_spinning_stop", "1"))?
            }
        };

        let session = match &weights {
            Weights::Shared(path) => builder.commit_from_file(path),
            Weights::Private(_) => builder.commit_from_file(&entry.path),
        }
        .map_err(|e| fail(e.to_string()))?;
        let describe = |outlets: &[ort::value::Outlet]| -> Vec<TensorSpec> {
            outlets
                .iter()
                .map(|o| match o.dtype() {
                    ValueType::Tensor { ty, shape, dimension_symbols } => TensorSpec {
                        name: o.name().to_string(),
                        datatype: ort_type_name(*ty),
                        shape: shape.to_vec(),
                        dtype: DataType::from_ort(*ty),
                        first_dim: dimension_symbols.first().cloned().unwrap_or_default(),
                        optional: false,
                    },
                    other => TensorSpec {
                        name: o.name().to_string(),
                        datatype: format!("{other:?}"),
                        shape: Vec::new(),
                        dtype: None,
                        first_dim: String::new(),
                        optional: false,
                    },
                })
                .collect()
        };
        let mut inputs = describe(session.inputs());
        // Optional inputs: graph inputs with an initializer, after the required ones.
        let overridable: Vec<ort::value::Outlet> = session
            .overridable_initializers()
            .into_iter()
            .map(|o| ort::value::Outlet::new(o.name(), o.dtype().clone()))
            .collect();
        for name in &entry.optional_inputs {
            if inputs.iter().any(|i| i.optional && &i.name == name) {
                continue; // named twice
            }
            let Some(outlet) = overridable.iter().find(|o| o.name() == name) else {
                let names: Vec<&str> = overridable.iter().map(|o| o.name()).collect();
                return Err(fail(format!(
                    "optional_inputs names '{name}', which is no graph input with an initializer (those the graph \
                     has: {})",
                    if names.is_empty() { "none".to_string() } else { names.join(", ") }
                )));
            };
            let spec = describe(std::slice::from_ref(outlet)).remove(0);
            inputs.push(TensorSpec { optional: true, ..spec });
        }
        let outputs = describe(session.outputs());
        if let Some(bad) = inputs.iter().find(|i| i.dtype.is_none()) {
            return Err(fail(format!("input '{}' has type {}, which inferd cannot feed", bad.name, bad.datatype)));
        }
        let meta = ModelMeta {
            info: ModelInfo {
                name: entry.name.clone(),
                version: entry.version.clone(),
                sha256,
                weights: match &weights {
                    Weights::Shared(_) => inferd_ipc::spec::Weights::Shared,
                    Weights::Private(why) => inferd_ipc::spec::Weights::Private { why: why.clone() },
                },
                precision: Precision::FP32,
                signer: None,
            },
            task: entry.task,
            inputs,
            outputs,
            batching: entry.batching.clone(),
        };
        Ok(ModelSession { meta, entry: entry.clone(), session })
    }

    /// This session as the model `entry` (loaded from another file, its int8 form): status,
    /// metadata and warm-up speak of `entry`, its SHA-256 `digest` and `precision`.
    pub fn stand_for(&mut self, entry: &ModelEntry, digest: &[u8], precision: Precision, signer: Option<String>) {
        self.meta.info.sha256 = sha256_prefix(digest);
        self.meta.info.precision = precision;
        self.meta.info.signer = signer;
        self.entry = entry.clone();
    }

    pub fn entry(&self) -> &ModelEntry {
        &self.entry
    }

    pub fn name(&self) -> &str {
        &self.meta.info.name
    }

    /// Runs the model on already validated inputs and returns every output; `options` lets
    /// another thread stop the run (see the engine's run clock).
    pub fn run(
        &mut self,
        inputs: Vec<Tensor>,
        options: Option<&ort::session::RunOptions>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let model = self.meta.info.name.clone();
        let run_err = |e: ort::Error| match e.code() {
            ort::error::ErrorCode::InvalidArgument => {
                ModelError::InvalidInput { model: model.clone(), message: e.message().to_string() }
            }
            _ => ModelError::Run { model: model.clone(), message: e.message().to_string() },
        };
        let values = inputs
            .into_iter()
            .map(|t| Ok((t.name, t.data.into_ort(t.shape)?)))
            .collect::<ort::Result<Vec<_>>>()
            .map_err(run_err)?;
        let outputs = match options {
            Some(options) => self.session.run_with_options(values, options),
            None => self.session.run(values),
        }
        .map_err(run_err)?;
        let mut result = Vec::with_capacity(self.meta.outputs.len());
        for spec in &self.meta.outputs {
            let unsupported = || ModelError::UnsupportedOutput { model: model.clone(), output: spec.name.clone() };
            let value = outputs.get(&spec.name).ok_or_else(unsupported)?;
            let (shape, data) = TensorData::from_ort(value).map_err(run_err)?.ok_or_else(unsupported)?;
            result.push(Tensor { name: spec.name.clone(), shape, data });
        }
        Ok(result)
    }

    /// Runs the model once per configured batch size on zero inputs, so the first real request
    /// does not pay for lazy initialisation (allocations, kernel selection, pre-packing).
    pub fn warm_up(&mut self) -> Result<(), ModelError> {
        let warmup = self.entry.warmup.clone();
        let model = self.entry.name.clone();
        let fail = |message: String| ModelError::Warmup { model: model.clone(), message };
        if let Some(name) = warmup.inputs.keys().find(|name| !self.meta.inputs.iter().any(|i| &i.name == *name)) {
            let inputs: Vec<&str> = self.meta.inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(fail(format!(
                "[warmup.inputs] names '{name}', which is not an input of the model (its inputs: {})",
                inputs.join(", ")
            )));
        }
        if !warmup.enabled {
            return Ok(());
        }
        let mut seen = Vec::new();
        for &batch in &warmup.batch_sizes {
            let mut inputs = Vec::with_capacity(self.meta.inputs.len());
            let mut described = Vec::with_capacity(self.meta.inputs.len());
            // An optional input warms up on its initializer, unless [warmup.inputs] gives it.
            let fed = self.meta.inputs.iter().filter(|s| !s.optional || warmup.inputs.contains_key(&s.name));
            for spec in fed {
                let shape = spec.filled(batch, warmup.dynamic_dim);
                let len = element_count(&shape).unwrap_or(0);
                let dtype = spec.dtype.expect("checked in load");
                let (data, value) = match warmup.inputs.get(&spec.name) {
                    Some(value) => {
                        let data = dtype.parse_json(&vec![value; len]).map_err(|(_, what)| {
                            fail(format!("[warmup.inputs] {} = {what}: not a {} value", spec.name, spec.datatype))
                        })?;
                        (data, value.to_string())
                    }
                    None => (dtype.zeros(len), if dtype == DataType::Bytes { "\"\"" } else { "0" }.to_string()),
                };
                described.push(format!("{} {} {shape:?} of {value}", spec.name, spec.datatype));
                inputs.push(Tensor { name: spec.name.clone(), shape, data });
            }
            let shapes: Vec<Vec<i64>> = inputs.iter().map(|t| t.shape.clone()).collect();
            if seen.contains(&shapes) {
                continue; // fixed-shape model: one run is enough
            }
            seen.push(shapes);
            self.run(inputs, None).map_err(|e| {
                fail(format!(
                    "{e} (the warm-up's inputs: {}; give values the graph takes in [warmup.inputs], as \
                     INPUT = \"1\", or set [warmup] enabled = false)",
                    described.join(", ")
                ))
            })?;
        }
        Ok(())
    }
}

/// Loads a shared library for good, its symbols visible to every library loaded after it
/// (`[custom_ops] preload`). Loading one twice is harmless: the loader counts it once.
/// A `[custom_ops] preload` library the loader refused.
#[derive(Debug, thiserror::Error)]
enum PreloadError {
    #[error("{0}")]
    Nul(#[from] std::ffi::NulError),
    #[error("custom_ops.preload: cannot load {}: {message}", path.display())]
    Load { path: std::path::PathBuf, message: String },
}

fn preload(path: &std::path::Path) -> Result<(), PreloadError> {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path; the handle is kept (never closed) so its symbols stay.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message (or null) owned by the loader.
        let message = unsafe { libc::dlerror() };
        let message = match message.is_null() {
            true => "unknown error".into(),
            false => unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned(),
        };
        return Err(PreloadError::Load { path: path.to_path_buf(), message });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(inputs: &[&[i64]], outputs: &[&[i64]]) -> ModelMeta {
        fn specs<'a>(shapes: &[&'a [i64]]) -> Vec<(&'static str, DataType, &'a [i64])> {
            shapes.iter().map(|&shape| ("t", DataType::F32, shape)).collect()
        }
        ModelMeta::for_tests("m", &specs(inputs), &specs(outputs))
    }

    #[test]
    fn only_models_with_a_dynamic_first_dimension_everywhere_may_be_batched() {
        // Named first dimensions: the graph's word for the rows (with no model.toml setting).
        let named = |names: &[&str], task: Task, max_batch_size: Option<usize>| {
            let rows: [&[i64]; 3] = [&[-1, 4], &[-1, 4], &[-1, 4]];
            let mut m = meta(&rows[..names.len() - 1], &rows[..1]);
            m.task = task;
            m.batching.max_batch_size = max_batch_size;
            for (spec, name) in m.inputs.iter_mut().chain(&mut m.outputs).zip(names) {
                spec.first_dim = name.to_string();
            }
            m.batch_rows()
        };
        let default = inferd_config::model::DEFAULT_MAX_BATCH_SIZE;
        assert_eq!(named(&["batch", "batch"], Task::Raw, None), Ok(default));
        assert_eq!(named(&["batch_size", ""], Task::Raw, None), Ok(default), "unnamed ones go with the named");
        assert_eq!(named(&["N", "N"], Task::Raw, None), Err(NoBatch::Unnamed("N".into())));
        assert_eq!(named(&["", ""], Task::Raw, None), Err(NoBatch::Unnamed(String::new())));
        // Rows inferd builds itself (text, images) are a batch; so are rows model.toml says are.
        assert_eq!(named(&["", ""], Task::Embedding, None), Ok(default));
        assert_eq!(named(&["N", "N"], Task::Raw, Some(8)), Ok(8));
        // 0: no batch dimension, whatever the graph says.
        assert_eq!(named(&["batch", "batch"], Task::Embedding, Some(0)), Err(NoBatch::Declared));
        // Shapes that cannot be a batch, whatever model.toml says.
        assert_eq!(named(&["batch", "num_detections"], Task::Raw, Some(8)), Err(NoBatch::Shape));
        let shaped = |inputs: &[&[i64]], outputs: &[&[i64]]| {
            let mut m = meta(inputs, outputs);
            m.batching.max_batch_size = Some(8);
            m.batch_rows()
        };
        assert_eq!(shaped(&[&[-1, 16], &[-1, -1]], &[&[-1, 384]]), Ok(8));
        assert_eq!(shaped(&[&[1, 16]], &[&[-1, 384]]), Err(NoBatch::Shape), "a fixed batch of 1");
        assert_eq!(shaped(&[&[-1, 16]], &[&[384]]), Err(NoBatch::Shape), "an output without rows");
        assert_eq!(shaped(&[&[]], &[&[-1]]), Err(NoBatch::Shape), "a scalar input");
    }
}
