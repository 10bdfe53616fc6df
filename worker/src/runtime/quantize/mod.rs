//! Int8 execution with an accuracy guard (`precision = "int8"` or `"auto"` in model.toml).
//!
//! inferd rewrites the model itself ([`graph`]: every fp32 MatMul or Gemm with a weight matrix
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

pub mod graph;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use inferd_config::model::{ModelEntry, Precision};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::pipeline::{embeddings, scores, Head, Pipeline, Text};
use crate::runtime::model::{ModelMeta, ModelSession, Runtime, Threads};
use crate::runtime::tensor::{DataType, Tensor, TensorData};

/// Changes whenever what the preparation writes or how it measures changes.
const FORMAT: &str = "q5";

/// Preparations made without a cache_dir, by folder: the report and the int8 file's bytes.
type Memo = HashMap<PathBuf, (Report, Option<Arc<Vec<u8>>>)>;
static MEMO: Mutex<Option<Memo>> = Mutex::new(None);

/// What the guard measured, kept beside the int8 file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Whether int8 is served.
    pub int8: bool,
    /// MatMul and Attention nodes in int8, of how many candidates.
    pub quantized: usize,
    pub candidates: usize,
    /// Kept in fp32 by the guard.
    pub kept: Vec<String>,
    /// Calibration inputs measured, and what they are ("texts", "images", "inputs").
    pub inputs: usize,
    pub of: String,
    /// Embeddings: least and mean cosine to fp32.
    pub min_cosine: Option<f64>,
    pub mean_cosine: Option<f64>,
    /// Classifiers: largest probability difference, and top-1 agreement (0..1).
    pub max_probability_error: Option<f64>,
    pub top1_agreement: Option<f64>,
    /// Raw models: largest and mean relative error of an output.
    pub max_relative_error: Option<f64>,
    pub mean_relative_error: Option<f64>,
    /// Median time of a calibration input, one at a time on one thread.
    pub fp32_ms: f64,
    pub int8_ms: f64,
    /// Why int8 is not served, when it is not.
    pub refused: Option<String>,
}

impl Report {
    /// Int8 refused before anything was measured, for `why`.
    fn refused(candidates: usize, why: String) -> Report {
        Report {
            int8: false,
            quantized: 0,
            candidates,
            kept: Vec::new(),
            inputs: 0,
            of: "inputs".into(),
            min_cosine: None,
            mean_cosine: None,
            max_probability_error: None,
            top1_agreement: None,
            max_relative_error: None,
            mean_relative_error: None,
            fp32_ms: 0.0,
            int8_ms: 0.0,
            refused: Some(why),
        }
    }

    /// One line for the log, `status` and the model's metadata.
    pub fn summary(&self) -> String {
        if self.inputs == 0 {
            return format!("fp32 (int8 refused: {})", self.refused.as_deref().unwrap_or("not measured"));
        }
        let error = match (self.min_cosine, self.mean_cosine, self.max_probability_error, self.top1_agreement) {
            (Some(min), Some(mean), _, _) => format!("min cosine {min:.4}, mean {mean:.4} to fp32"),
            (_, _, Some(p), Some(top1)) => {
                format!("largest probability error {p:.4}, top-1 agreement {:.1}% with fp32", top1 * 100.0)
            }
            _ => match (self.max_relative_error, self.mean_relative_error) {
                (Some(max), Some(mean)) => format!("relative error to fp32 at most {max:.4}, mean {mean:.4}"),
                _ => "not measured".into(),
            },
        };
        let speed = format!(
            "{:.2}x fp32's speed ({:.2} vs {:.2} ms {})",
            self.fp32_ms / self.int8_ms.max(1e-9),
            self.int8_ms,
            self.fp32_ms,
            match self.of.as_str() {
                "texts" => "a text",
                "images" => "an image",
                _ => "an input",
            }
        );
        let kept = match self.kept.len() {
            0 => String::new(),
            n => format!("; {n} kept in fp32: {}", self.kept.join(", ")),
        };
        let what = format!(
            "{} of {} MatMul/Gemm/Attention nodes in int8{kept}; {error} over {} {}; {speed}",
            self.quantized, self.candidates, self.inputs, self.of
        );
        match &self.refused {
            None => format!("int8 ({what})"),
            Some(why) => format!("fp32 (int8 refused: {why}; {what})"),
        }
    }
}

/// The file to load for `entry` and what the guard measured; `None` for fp32 as written.
pub struct Prepared {
    pub path: PathBuf,
    pub report: Report,
    /// Made without a cache_dir: to be removed once the session has loaded it ([`remove`]).
    pub scratch: Option<PathBuf>,
}

/// Prepares (or finds prepared) the int8 form of `entry`'s model. `Ok(Some)`: serve that file;
/// `Ok(None)` with a report: serve fp32 (`auto` whose guard failed); `Err`: `int8` refused.
pub fn prepare(runtime: &Runtime, entry: &ModelEntry, sha256: &[u8]) -> Result<(Option<Prepared>, Report), String> {
    let settings = format!(
        "{FORMAT} {:?} {} {} {} {:?} {:?}",
        entry.precision,
        entry.quantization.min_cosine,
        entry.quantization.max_probability_error,
        entry.quantization.max_relative_error,
        entry.quantization.calibration.as_ref().map(|c| std::fs::read(c).unwrap_or_default()),
        graph::host_range(),
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
            std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
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
                Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
            }
            (dir.clone(), Some(dir))
        }
    };
    // One process prepares; the others wait here, then read what it wrote.
    let lock = std::fs::File::create(dir.join("lock")).map_err(|e| format!("cannot lock {}: {e}", dir.display()))?;
    lock.lock().map_err(|e| format!("cannot lock {}: {e}", dir.display()))?;
    let (model, report) = (dir.join("model.onnx"), dir.join("report.json"));
    // Without a cache_dir the folder goes once a session has loaded the file: this process's
    // later sessions (a worker has several) write it again from memory instead of measuring.
    let mut memo = MEMO.lock().unwrap_or_else(|e| e.into_inner());
    let memo = memo.get_or_insert_with(HashMap::new);
    if let Some((r, bytes)) = memo.get(&dir).filter(|_| scratch.is_some()) {
        if let Some(bytes) = bytes {
            std::fs::write(&model, &bytes[..]).map_err(|e| format!("cannot write {}: {e}", model.display()))?;
        }
        std::fs::write(&report, serde_json::to_vec_pretty(r).expect("json")).map_err(|e| e.to_string())?;
    }
    let found = std::fs::read(&report).ok().and_then(|r| serde_json::from_slice::<Report>(&r).ok());
    let report = match found {
        Some(r) if !r.int8 || model.is_file() => {
            info!(model = entry.name, "int8 preparation found in {}", dir.display());
            r
        }
        _ => {
            let started = Instant::now();
            info!(model = entry.name, "preparing int8: rewriting the MatMuls and measuring them against fp32");
            let (bytes, r) = match measure(runtime, entry, &dir) {
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
                    .map_err(|e| format!("cannot write {}: {e}", model.display()))?;
            }
            std::fs::write(&report, serde_json::to_vec_pretty(&r).expect("json"))
                .map_err(|e| format!("cannot write {}: {e}", report.display()))?;
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
            Err(format!("precision = \"int8\" refused: {}", report.summary()))
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

/// One calibration input, as the model's pipeline takes it.
#[derive(Clone)]
enum Sample {
    Text(String),
    /// An encoded image (PNG or JPEG), decoded and resized as a request's would be.
    Image(Vec<u8>),
    /// A raw model's input tensors.
    Tensors(Vec<Tensor>),
}

/// What the guard compares, by the model's head.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Pooled embeddings: cosine to fp32.
    Embeddings,
    /// Class probabilities: largest difference and top-1 agreement.
    Probabilities,
    /// A raw model's float outputs: relative error.
    Tensors,
}

/// What one model gives for the calibration inputs: `per_sample` rows for each, in order
/// (one for a pipeline's head; one per float output of a raw model).
struct Outputs {
    kind: Kind,
    rows: Vec<Vec<f32>>,
    per_sample: usize,
    /// A raw model's other outputs (integers, booleans, strings), per input: compared exactly.
    exact: Vec<Vec<TensorData>>,
}

impl Outputs {
    /// The rows of every third input, as [`run`] gives them for `samples.iter().step_by(3)`.
    fn every_third(&self) -> Outputs {
        let rows = self.rows.chunks(self.per_sample.max(1)).step_by(3).flatten().cloned().collect();
        let exact = self.exact.iter().step_by(3).cloned().collect();
        Outputs { rows, exact, ..*self }
    }
}

/// A float output's values as f32 (`None` for other element types).
fn float_values(tensor: &Tensor) -> Option<Vec<f32>> {
    match &tensor.data {
        TensorData::F32(v) => Some(v.clone()),
        TensorData::F64(v) => Some(v.iter().map(|x| *x as f32).collect()),
        TensorData::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
        _ => None,
    }
}

/// Runs every input alone through `model`: its outputs, and the median time of an input.
fn run(model: &mut ModelSession, samples: &[Sample]) -> Result<(Outputs, f64), String> {
    let pipeline = model.meta.pipeline.clone();
    let head = pipeline.head().cloned();
    let mut rows = Vec::with_capacity(samples.len());
    let mut exact = Vec::new();
    let mut times = Vec::with_capacity(samples.len());
    for sample in samples {
        let (inputs, lengths) = match (&*pipeline, sample) {
            (Pipeline::Text(p), Sample::Text(text)) => {
                let encoded = p.encode(&[Text::Single(text.clone())], true).map_err(|e| e.to_string())?;
                (encoded.inputs, encoded.lengths)
            }
            (Pipeline::Image(p), Sample::Image(bytes)) => {
                (p.preprocess(std::slice::from_ref(bytes)).map_err(|e| e.to_string())?, Vec::new())
            }
            (Pipeline::Raw, Sample::Tensors(tensors)) => (tensors.clone(), Vec::new()),
            _ => return Err("a calibration input of another kind than the model's".into()),
        };
        let started = Instant::now();
        let outputs = model.run(inputs, None).map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        match &head {
            Some(Head::Embedding { output, settings }) => {
                rows.extend(embeddings(&outputs[*output], &lengths, settings.pooling, true).map_err(|e| e.to_string())?)
            }
            Some(Head::Classification { output, labels, activation, .. }) => {
                rows.extend(scores(&outputs[*output], labels.len(), *activation, false).map_err(|e| e.to_string())?)
            }
            None => {
                let mut others = Vec::new();
                for output in outputs {
                    match float_values(&output) {
                        Some(values) => rows.push(values),
                        None => others.push(output.data),
                    }
                }
                exact.push(others);
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
    let kind = match head {
        Some(Head::Embedding { .. }) => Kind::Embeddings,
        Some(Head::Classification { .. }) => Kind::Probabilities,
        None => Kind::Tensors,
    };
    let per_sample = rows.len() / samples.len().max(1);
    Ok((Outputs { kind, rows, per_sample, exact }, median))
}

/// How far `got` is from the fp32 `want`.
struct Deviation {
    /// 0 = as fp32; the larger, the worse (1 - least cosine, the largest probability error, or
    /// the largest relative error); infinite when a measure is NaN (a NaN or an infinity in
    /// either model's outputs) or an exactly compared output differs.
    worst: f64,
    /// The mean cosine (embeddings) or the mean relative error (raw outputs).
    mean: Option<f64>,
    top1: Option<f64>,
    /// Inputs on which an exactly compared output (a raw model's integers, booleans or
    /// strings) differs from fp32's.
    differ: usize,
}

/// The largest of `deviations` (each 0 or more), infinite if any is NaN: `f64::max` would
/// pass over a NaN, and the guard with it.
fn worst_of(deviations: impl Iterator<Item = f64>) -> f64 {
    deviations.fold(0.0, |worst, d| if d.is_nan() { f64::INFINITY } else { worst.max(d) })
}

fn compare(want: &Outputs, got: &Outputs) -> Deviation {
    let pairs = want.rows.iter().zip(&got.rows);
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len().max(1) as f64;
    match want.kind {
        Kind::Embeddings => {
            let cosines: Vec<f64> = pairs
                .map(|(x, y)| {
                    let dot: f64 = x.iter().zip(y).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum();
                    let length = |v: &[f32]| norm(&mut v.iter().map(|p| f64::from(*p))).max(1e-12);
                    dot / (length(x) * length(y))
                })
                .collect();
            Deviation {
                worst: worst_of(cosines.iter().map(|c| 1.0 - c)),
                mean: Some(mean(&cosines)),
                top1: None,
                differ: 0,
            }
        }
        Kind::Probabilities => {
            let argmax = |v: &[f32]| v.iter().enumerate().max_by(|p, q| p.1.total_cmp(q.1)).map(|(i, _)| i);
            let worst =
                worst_of(pairs.clone().flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| f64::from((p - q).abs()))));
            let agree = pairs.filter(|(x, y)| argmax(x) == argmax(y)).count();
            Deviation { worst, mean: None, top1: Some(agree as f64 / want.rows.len().max(1) as f64), differ: 0 }
        }
        Kind::Tensors => {
            // |got - want| / |want| over each output tensor; an output fp32 gives as zeros
            // must be zeros in int8 too.
            let errors: Vec<f64> = pairs
                .map(|(x, y)| {
                    let diff = norm(&mut x.iter().zip(y).map(|(p, q)| f64::from(p - q)));
                    let scale = norm(&mut x.iter().map(|p| f64::from(*p)));
                    if diff == 0.0 {
                        0.0
                    } else {
                        diff / scale
                    }
                })
                .collect();
            let differ = want.exact.iter().zip(&got.exact).filter(|(x, y)| x != y).count();
            let worst = if differ > 0 { f64::INFINITY } else { worst_of(errors.iter().copied()) };
            Deviation { worst, mean: Some(mean(&errors)), top1: None, differ }
        }
    }
}

/// The guard: the int8 bytes to serve (None when refused) and what was measured.
fn measure(runtime: &Runtime, entry: &ModelEntry, dir: &Path) -> Result<(Option<Vec<u8>>, Report), String> {
    let source = std::fs::read(&entry.path).map_err(|e| format!("cannot read {}: {e}", entry.path.display()))?;
    let candidates = graph::candidates(&source)?;
    if candidates.is_empty() {
        let mut why = "the model has no fp32 MatMul or Gemm with a weight matrix in the file to quantise".to_string();
        if !graph::external_files(&source)?.is_empty() {
            why.push_str(" (its weights are in external data files, which the int8 rewrite does not read)");
        }
        return Ok((None, Report::refused(0, why)));
    }
    // Private, unshared sessions of one thread: nothing lands in the weights cache.
    let plain = ModelEntry { precision: Precision::Fp32, share_weights: false, ..entry.clone() };
    let mut fp32 = ModelSession::load(runtime, &plain, Threads::Narrow, None).map_err(|e| e.to_string())?;
    let (samples, of) = match calibration(entry, &fp32.meta)? {
        Calibration::Inputs(samples, of) => (samples, of),
        // Nothing to measure int8 on: refused, with the reason (`auto` serves fp32).
        Calibration::None(why) => return Ok((None, Report::refused(candidates.len(), why))),
    };
    let (want, fp32_ms) = run(&mut fp32, &samples)?;
    drop(fp32);
    // The candidate file goes however the measuring ends (an error included).
    let candidate = ScratchFile(dir.join("candidate.onnx"));
    let scratch = &candidate.0;
    let range = graph::host_range();
    // The model with every candidate but `keep` in int8, loaded from the scratch file.
    let load = |keep: &HashSet<String>| -> Result<(Vec<u8>, ModelSession), String> {
        let rewritten = graph::rewrite(&source, keep, range)?;
        std::fs::write(scratch, &rewritten.bytes).map_err(|e| format!("cannot write {}: {e}", scratch.display()))?;
        let model =
            ModelSession::load(runtime, &ModelEntry { path: scratch.clone(), ..plain.clone() }, Threads::Narrow, None)
                .map_err(|e| format!("the int8 model does not load: {e}"))?;
        Ok((rewritten.bytes, model))
    };
    let try_keep = |keep: &HashSet<String>| -> Result<(Vec<u8>, Deviation, f64), String> {
        let (bytes, mut model) = load(keep)?;
        let (got, ms) = run(&mut model, &samples)?;
        Ok((bytes, compare(&want, &got), ms))
    };
    // The bound as written, and as a limit on `Deviation::worst`.
    let q = &entry.quantization;
    let (bound, key, measured) = match want.kind {
        Kind::Embeddings => (q.min_cosine, "min_cosine", "the least cosine to fp32"),
        Kind::Probabilities => (q.max_probability_error, "max_probability_error", "the largest probability error"),
        Kind::Tensors => (q.max_relative_error, "max_relative_error", "the largest relative error of an output"),
    };
    let limit = if want.kind == Kind::Embeddings { 1.0 - bound } else { bound };
    let mut keep = HashSet::new();
    let mut outcome = try_keep(&keep)?;
    if outcome.1.worst > limit && candidates.len() > 1 {
        // Each node alone in int8: what it costs, on every third input (the ranking needs no
        // more, and a model has tens of nodes).
        // Each input runs alone, so fp32's answers for the sample are those of the full set.
        let sample: Vec<Sample> = samples.iter().step_by(3).cloned().collect();
        let want_sample = want.every_third();
        let mut costs = Vec::with_capacity(candidates.len());
        for node in &candidates {
            let others: HashSet<String> = candidates.iter().filter(|c| *c != node).cloned().collect();
            let (_, mut model) = load(&others)?;
            costs.push((compare(&want_sample, &run(&mut model, &sample)?.0).worst, node.clone()));
        }
        costs.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (cost, node) in costs.into_iter().take(candidates.len() / 2) {
            info!(model = entry.name, "int8 guard: keeping {node} in fp32 (alone it costs {cost:.4})");
            keep.insert(node);
            outcome = try_keep(&keep)?;
            if outcome.1.worst <= limit {
                break;
            }
        }
    }
    let (bytes, error, int8_ms) = outcome;
    let mut kept: Vec<String> = keep.into_iter().collect();
    kept.sort();
    let refused = if error.differ > 0 {
        Some(format!(
            "an output that is not float, compared exactly, differs from fp32's on {} of {} inputs with {} of {} nodes kept in fp32",
            error.differ,
            samples.len(),
            kept.len(),
            candidates.len()
        ))
    } else if !error.worst.is_finite() {
        Some(format!(
            "comparing int8 to fp32 gives NaN or infinite values, with {} of {} nodes kept in fp32",
            kept.len(),
            candidates.len()
        ))
    } else if error.worst > limit {
        let figure = match want.kind {
            Kind::Embeddings => 1.0 - error.worst,
            _ => error.worst,
        };
        Some(format!(
            "{measured} is {figure:.4} with {} of {} nodes kept in fp32, {} quantization.{key} = {bound}",
            kept.len(),
            candidates.len(),
            if want.kind == Kind::Embeddings { "under" } else { "over" },
        ))
    } else if int8_ms >= fp32_ms * 0.95 {
        let slow = format!("int8 is not faster than fp32 on this CPU ({int8_ms:.2} vs {fp32_ms:.2} ms an input)");
        // Asked for by name, int8 is served anyway (the figures are in the log and status).
        match entry.precision {
            Precision::Auto => Some(slow),
            _ => {
                warn!(model = entry.name, "precision = \"int8\": {slow}");
                None
            }
        }
    } else {
        None
    };
    let report = Report {
        int8: refused.is_none(),
        quantized: candidates.len() - kept.len(),
        candidates: candidates.len(),
        kept,
        inputs: samples.len(),
        of: of.into(),
        min_cosine: (want.kind == Kind::Embeddings).then_some(1.0 - error.worst),
        mean_cosine: error.mean.filter(|_| want.kind == Kind::Embeddings),
        max_probability_error: (want.kind == Kind::Probabilities).then_some(error.worst),
        top1_agreement: error.top1,
        max_relative_error: (want.kind == Kind::Tensors).then_some(error.worst),
        mean_relative_error: error.mean.filter(|_| want.kind == Kind::Tensors),
        fp32_ms,
        int8_ms,
        refused,
    };
    Ok((report.int8.then_some(bytes), report))
}

/// A file removed when this is dropped.
struct ScratchFile(PathBuf);

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What the guard measures int8 with.
enum Calibration {
    /// The inputs, and what they are ("texts", "images", "inputs").
    Inputs(Vec<Sample>, &'static str),
    /// None, and why: a raw model with inputs other than floats and no calibration file.
    None(String),
}

/// The calibration inputs for `meta`'s model: the built-in ones for its kind, then the user's
/// (`[quantization] calibration`, one per line, empty lines skipped). `Err`: the user's file
/// has a line that cannot be read or does not fit the model.
fn calibration(entry: &ModelEntry, meta: &ModelMeta) -> Result<Calibration, String> {
    let own = match &entry.quantization.calibration {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?,
        None => String::new(),
    };
    let lines = || own.lines().map(str::trim).filter(|l| !l.is_empty());
    let file = entry.quantization.calibration.as_deref().unwrap_or(Path::new(""));
    let place = |n: usize| format!("quantization.calibration: {}, line {n}", file.display());
    match &*meta.pipeline {
        Pipeline::Text(p) => {
            let mut samples: Vec<Sample> = built_in_texts(p.max_length).into_iter().map(Sample::Text).collect();
            samples.extend(lines().map(|l| Sample::Text(l.to_string())));
            Ok(Calibration::Inputs(samples, "texts"))
        }
        Pipeline::Image(p) => {
            let (w, h) = (p.config.width, p.config.height);
            let mut samples: Vec<Sample> = (0..GENERATED).map(|i| Sample::Image(generated_image(i, w, h))).collect();
            // Image files inside the calibration file's folder (which model loading confines to
            // the repository), named relative to it.
            let folder = file.parent().unwrap_or(Path::new("."));
            let root = match own.is_empty() {
                true => PathBuf::new(),
                false => std::fs::canonicalize(folder)
                    .map_err(|e| format!("quantization.calibration: {}: {e}", file.display()))?,
            };
            for (n, line) in lines().enumerate() {
                let path = folder.join(line);
                let bytes = std::fs::canonicalize(&path)
                    .and_then(|real| match real.starts_with(&root) {
                        true => std::fs::read(real),
                        false => Err(std::io::Error::other("it is outside the calibration file's folder")),
                    })
                    .map_err(|e| format!("{}: cannot read {}: {e}", place(n + 1), path.display()))?;
                samples.push(Sample::Image(bytes));
            }
            Ok(Calibration::Inputs(samples, "images"))
        }
        Pipeline::Raw => {
            // Generated first, then the user's; with no float inputs, the user's alone.
            let mut samples: Vec<Sample> = match generated_tensors(meta, entry.warmup.dynamic_dim) {
                Ok(generated) => generated.into_iter().map(Sample::Tensors).collect(),
                Err(why) if lines().next().is_none() => return Ok(Calibration::None(why)),
                Err(_) => Vec::new(),
            };
            for (n, line) in lines().enumerate() {
                let parsed =
                    crate::http::kserve::parse(line.as_bytes(), None).map_err(|e| format!("{}: {e}", place(n + 1)))?;
                let tensors = crate::http::kserve::validate_inputs(parsed.inputs, meta)
                    .map_err(|e| format!("{}: {e}", place(n + 1)))?;
                samples.push(Sample::Tensors(tensors));
            }
            Ok(Calibration::Inputs(samples, "inputs"))
        }
    }
}

/// How many inputs the guard generates for image and raw models.
const GENERATED: usize = 24;

/// Built-in image `i` of [`GENERATED`], a PNG twice the model's size (so that resizing runs):
/// flat colours, gradients, edges, patterns, smooth and sharp noise, simple scenes.
fn generated_image(i: usize, width: u32, height: u32) -> Vec<u8> {
    let (w, h) = ((width * 2).clamp(16, 512), (height * 2).clamp(16, 512));
    // A fixed pseudo-random value per (seed, x, y): splitmix64.
    let noise = |seed: u64, x: u32, y: u32| -> f32 {
        let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(x) << 32 | u64::from(y));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    // Noise smoothed over cells of `cell` pixels (bilinear between cell corners).
    let smooth = |seed: u64, x: u32, y: u32, cell: u32| -> f32 {
        let (cx, cy) = (x / cell, y / cell);
        let (fx, fy) = ((x % cell) as f32 / cell as f32, (y % cell) as f32 / cell as f32);
        let at = |dx, dy| noise(seed, cx + dx, cy + dy);
        let top = at(0, 0) * (1.0 - fx) + at(1, 0) * fx;
        let bottom = at(0, 1) * (1.0 - fx) + at(1, 1) * fx;
        top * (1.0 - fy) + bottom * fy
    };
    let byte = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    let (fw, fh) = (w as f32, h as f32);
    let image = image::RgbImage::from_fn(w, h, |x, y| {
        let (u, v) = (x as f32 / fw, y as f32 / fh);
        let rgb: [f32; 3] = match i % GENERATED {
            0 => [0.0, 0.0, 0.0],
            1 => [1.0, 1.0, 1.0],
            2 => [0.5, 0.5, 0.5],
            3 => [0.9, 0.1, 0.1],
            4 => [0.1, 0.8, 0.2],
            5 => [0.1, 0.2, 0.9],
            6 => [u, 0.2, 1.0 - u],
            7 => [v, v, v],
            8 => [(u + v) / 2.0, 1.0 - u, v],
            9 => [((x / 4 + y / 4) % 2) as f32; 3],
            10 => [((x * 8 / w + y * 8 / h) % 2) as f32, 0.3, 0.6],
            11 => [0.8, ((y / 3) % 2) as f32, 0.2],
            12 => [((x / 2) % 2) as f32; 3],
            13 => {
                let r = ((u - 0.5).powi(2) + (v - 0.5).powi(2)).sqrt();
                [(r * 40.0).sin() * 0.5 + 0.5, 0.4, (r * 20.0).cos() * 0.5 + 0.5]
            }
            14 => match (u - 0.5).powi(2) + (v - 0.5).powi(2) < 0.09 {
                true => [0.95, 0.85, 0.1],
                false => [0.1, 0.3, 0.6],
            },
            15 => [noise(1, x, y), noise(2, x, y), noise(3, x, y)],
            16 => [smooth(4, x, y, 4), smooth(5, x, y, 4), smooth(6, x, y, 4)],
            17 => [smooth(7, x, y, 16), smooth(8, x, y, 16), smooth(9, x, y, 16)],
            18 => [smooth(10, x, y, 64); 3],
            // Sky, ground and a sun.
            19 => match (v < 0.55, (u - 0.7).powi(2) + (v - 0.2).powi(2) < 0.01) {
                (_, true) => [1.0, 0.9, 0.4],
                (true, false) => [0.4, 0.6 + 0.3 * v, 0.95],
                (false, false) => [0.2, 0.5 + 0.2 * smooth(11, x, y, 8), 0.15],
            },
            // Blocks of colour.
            20 | 21 => {
                let cell = if i % GENERATED == 20 { w / 3 + 1 } else { w / 7 + 1 };
                let seed = i as u64 * 100;
                [
                    noise(seed, x / cell, y / cell),
                    noise(seed + 1, x / cell, y / cell),
                    noise(seed + 2, x / cell, y / cell),
                ]
            }
            // Dark and bright scenes: smooth noise near the ends of the range.
            22 => [0.15 * smooth(12, x, y, 8), 0.1 * smooth(13, x, y, 8), 0.2 * smooth(14, x, y, 8)],
            _ => [0.85 + 0.15 * smooth(15, x, y, 8), 0.9 + 0.1 * smooth(16, x, y, 8), 0.8 + 0.2 * smooth(17, x, y, 8)],
        };
        image::Rgb(rgb.map(byte))
    });
    let mut png = Vec::new();
    image.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).expect("PNG into memory");
    png
}

/// [`GENERATED`] inputs for a raw model whose inputs are all floats, shaped as warm-up shapes
/// them (batch 1, other free dimensions `dynamic_dim`): pseudo-random values spread around
/// zero at scales from 0.1 to 10, so the activations' run-time ranges vary as real inputs'
/// do. `Err` names an input that is not a float.
fn generated_tensors(meta: &ModelMeta, dynamic_dim: usize) -> Result<Vec<Vec<Tensor>>, String> {
    if let Some(spec) =
        meta.inputs.iter().find(|s| !matches!(s.dtype, Some(DataType::F32 | DataType::F64 | DataType::F16)))
    {
        return Err(format!(
            "the guard generates inputs for float tensors only, and input '{}' is {}: give your own inputs in [quantization] calibration (KServe v2 inference requests, one per line)",
            spec.name, spec.datatype
        ));
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        // xorshift64*, two draws summed: a triangular spread around zero.
        let mut draw = || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32
        };
        draw() + draw() - 1.0
    };
    let mut samples = Vec::with_capacity(GENERATED);
    for i in 0..GENERATED {
        let scale = 10f32.powf((i % 5) as f32 / 2.0 - 1.0);
        let mut tensors = Vec::with_capacity(meta.inputs.len());
        for spec in &meta.inputs {
            let shape = spec.filled(1, dynamic_dim);
            let count = crate::runtime::tensor::element_count(&shape).unwrap_or(0);
            let values: Vec<f32> = (0..count).map(|_| next() * scale).collect();
            let data = match spec.dtype {
                Some(DataType::F64) => TensorData::F64(values.into_iter().map(f64::from).collect()),
                Some(DataType::F16) => TensorData::F16(values.into_iter().map(half::f16::from_f32).collect()),
                _ => TensorData::F32(values),
            };
            tensors.push(Tensor { name: spec.name.clone(), shape, data });
        }
        samples.push(tensors);
    }
    Ok(samples)
}

/// The built-in calibration texts: [`BUILT_IN`], then long ones up to and past `max_length`
/// tokens (cut by the tokenizer): the sentences run together.
fn built_in_texts(max: usize) -> Vec<String> {
    let mut texts: Vec<String> = BUILT_IN.iter().map(|t| t.to_string()).collect();
    for (i, take) in [8usize, 16, 32].into_iter().enumerate() {
        let words: Vec<&str> = BUILT_IN.iter().skip(i * 5).take(take).copied().collect();
        let mut text = words.join(" ");
        while text.split_whitespace().count() < max * take / 32 {
            text = format!("{text} {text}");
        }
        texts.push(text);
    }
    texts
}

/// Short and long, questions and statements, several languages and scripts, code and numbers.
const BUILT_IN: &[&str] = &[
    "hello",
    "ok",
    "Why?",
    "weather tomorrow",
    "cheap flights to Lisbon in May",
    "How do I reset my password if I no longer have access to my email account?",
    "The committee postponed its decision until the auditors had reviewed the accounts.",
    "Grey clouds gathered over the harbour as the fishing boats came back in.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She left the keys on the kitchen table before catching the early train.",
    "Der Zug nach Berlin hat wegen eines Signalfehlers zwanzig Minuten Verspätung.",
    "Wie viel kostet eine Monatskarte für den öffentlichen Nahverkehr?",
    "Le musée sera fermé lundi pour des travaux de rénovation.",
    "Pouvez-vous me recommander un bon restaurant près de la gare ?",
    "El partido se suspendió por la lluvia y se jugará el próximo domingo.",
    "¿Cuál es la diferencia entre un virus y una bacteria?",
    "Il gatto dorme sul divano tutto il pomeriggio.",
    "O relatório anual mostra um crescimento de doze por cento nas vendas.",
    "De vergadering begint om negen uur in zaal drie.",
    "Москва является столицей Российской Федерации.",
    "Сколько времени занимает доставка посылки?",
    "東京は日本の首都で、人口が最も多い都市です。",
    "明日の会議は午後三時に始まります。",
    "北京是中国的首都，有着悠久的历史。",
    "我想预订两张去上海的火车票。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة جمهورية مصر العربية.",
    "नई दिल्ली भारत की राजधानी है।",
    "İstanbul, Avrupa ile Asya arasında yer alan bir şehirdir.",
    "Warszawa jest stolicą Polski.",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "error: cannot borrow `x` as mutable because it is also borrowed as immutable",
    "Order #48213 shipped on 2024-03-07, total $1,249.99 incl. VAT.",
    "3.14159 2.71828 1.41421 0.57721",
    "https://example.com/search?q=onnx+runtime&lang=en",
    "I absolutely loved this film, the acting was superb!",
    "Terrible service, the food was cold and the waiter was rude.",
    "The product works as described, nothing more, nothing less.",
    "Can you summarise the main arguments of the paper in two sentences?",
    "Mitochondria are the powerhouse of the cell.",
    "The patient reported mild headaches and occasional dizziness after the new medication.",
    "Interest rates rose by a quarter of a percentage point on Wednesday.",
    "Replace the filter every three months to keep the air purifier efficient.",
    "To be, or not to be, that is the question.",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::tensor::TensorSpec;

    /// A raw model's metadata with inputs of these (name, datatype, shape).
    fn raw_model(inputs: &[(&str, DataType, &[i64])]) -> ModelMeta {
        ModelMeta {
            info: inferd_ipc::spec::ModelInfo {
                name: "m".into(),
                version: "1".into(),
                sha256: "0".into(),
                weights: String::new(),
                precision: String::new(),
            },
            task: inferd_config::model::Task::Raw,
            inputs: inputs
                .iter()
                .map(|(name, dtype, shape)| TensorSpec {
                    name: name.to_string(),
                    datatype: dtype.name().into(),
                    shape: shape.to_vec(),
                    dtype: Some(*dtype),
                    first_dim: String::new(),
                })
                .collect(),
            outputs: Vec::new(),
            pipeline: Arc::new(Pipeline::Raw),
            batching: Default::default(),
        }
    }

    #[test]
    fn raw_inputs_are_generated_for_float_models_at_several_scales_and_refused_otherwise() {
        let meta = raw_model(&[("x", DataType::F32, &[-1, -1, 3]), ("y", DataType::F64, &[2])]);
        let samples = generated_tensors(&meta, 5).unwrap();
        assert_eq!(samples.len(), GENERATED);
        let largest = |t: &Tensor| match &t.data {
            TensorData::F32(v) => v.iter().fold(0f32, |m, x| m.max(x.abs())),
            other => panic!("{other:?}"),
        };
        for sample in &samples {
            assert_eq!((sample[0].shape.as_slice(), sample[1].shape.as_slice()), (&[1, 5, 3][..], &[2][..]));
            assert!(matches!(sample[1].data, TensorData::F64(_)));
        }
        // Sample 0 at scale 0.1, sample 4 at 10.
        assert!(largest(&samples[0][0]) <= 0.1 && largest(&samples[4][0]) > 1.0);
        let meta = raw_model(&[("x", DataType::F32, &[-1, 4]), ("ids", DataType::I64, &[-1, 4])]);
        let why = generated_tensors(&meta, 5).unwrap_err();
        assert!(why.contains("input 'ids' is INT64") && why.contains("[quantization] calibration"), "{why}");
    }

    #[test]
    fn generated_images_are_distinct_pngs_twice_the_models_size() {
        let images: Vec<Vec<u8>> = (0..GENERATED).map(|i| generated_image(i, 20, 12)).collect();
        for (i, png) in images.iter().enumerate() {
            let decoded = image::load_from_memory_with_format(png, image::ImageFormat::Png).unwrap();
            assert_eq!((decoded.width(), decoded.height()), (40, 24), "image {i}");
            assert!(!images[..i].contains(png), "image {i} repeats an earlier one");
        }
    }

    fn outputs(kind: Kind, rows: &[&[f32]], exact: Vec<Vec<TensorData>>) -> Outputs {
        Outputs { kind, rows: rows.iter().map(|r| r.to_vec()).collect(), per_sample: 1, exact }
    }

    #[test]
    fn a_nan_fails_the_guard_whatever_the_task() {
        let nan = f32::NAN;
        for kind in [Kind::Embeddings, Kind::Probabilities, Kind::Tensors] {
            let want = outputs(kind, &[&[0.6, 0.8], &[1.0, 0.0]], Vec::new());
            let close = compare(&want, &outputs(kind, &[&[0.6, 0.8], &[0.99, 0.01]], Vec::new()));
            assert!(close.worst.is_finite() && close.worst < 0.02, "{}", close.worst);
            // One input of two gives NaN: f64::min or max would have passed over it.
            let broken = compare(&want, &outputs(kind, &[&[0.6, 0.8], &[nan, nan]], Vec::new()));
            assert_eq!(broken.worst, f64::INFINITY);
        }
    }

    #[test]
    fn outputs_that_are_not_float_must_be_the_same_as_fp32s() {
        let ids = |v: Vec<i64>| vec![TensorData::I64(v)];
        let want = outputs(Kind::Tensors, &[&[1.0], &[2.0]], vec![ids(vec![3]), ids(vec![1])]);
        let same = compare(&want, &outputs(Kind::Tensors, &[&[1.0], &[2.0]], vec![ids(vec![3]), ids(vec![1])]));
        assert_eq!((same.worst, same.differ), (0.0, 0));
        let moved = compare(&want, &outputs(Kind::Tensors, &[&[1.0], &[2.0]], vec![ids(vec![3]), ids(vec![2])]));
        assert_eq!((moved.worst, moved.differ), (f64::INFINITY, 1));
        // A model with no float output at all is compared on the others alone.
        let want = outputs(Kind::Tensors, &[], vec![ids(vec![3])]);
        assert_eq!(compare(&want, &outputs(Kind::Tensors, &[], vec![ids(vec![4])])).differ, 1);
    }

    #[test]
    fn the_summary_says_what_was_served_and_what_it_cost() {
        let mut report = Report {
            int8: true,
            quantized: 16,
            candidates: 18,
            kept: vec!["a".into(), "b".into()],
            inputs: 48,
            of: "texts".into(),
            min_cosine: Some(0.9912),
            mean_cosine: Some(0.998),
            max_probability_error: None,
            top1_agreement: None,
            max_relative_error: None,
            mean_relative_error: None,
            fp32_ms: 6.0,
            int8_ms: 3.0,
            refused: None,
        };
        let s = report.summary();
        assert!(
            s.starts_with(
                "int8 (16 of 18 MatMul/Gemm/Attention nodes in int8; 2 kept in fp32: a, b; min cosine 0.9912"
            ),
            "{s}"
        );
        assert!(s.contains("2.00x fp32's speed"), "{s}");
        report.int8 = false;
        report.refused = Some("too slow".into());
        assert!(report.summary().starts_with("fp32 (int8 refused: too slow;"));
    }
}
