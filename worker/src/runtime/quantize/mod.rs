//! Int8 execution with an accuracy guard (`precision = "int8"` or `"auto"` in model.toml).
//!
//! inferd rewrites the model itself ([`graph`]: every fp32 MatMul with a weight matrix becomes
//! ONNX Runtime's DynamicQuantizeMatMul, weights int8 per output column), with no Python on
//! the serving host. Before serving it, the guard runs the fp32 and the int8 model side by side
//! on calibration texts (a built-in set of 1 to `max_length` tokens in several languages, and
//! `[quantization] calibration`, the user's own) and measures what the task cares about: the
//! cosine of each embedding to fp32 (least and mean), or for a classifier the largest
//! probability difference and top-1 agreement. When the guard fails with every MatMul in int8,
//! the MatMuls that cost the most accuracy (each measured alone) are kept in fp32, one by one,
//! until it passes; past half of them int8 is refused with the figures (`int8`: the model does
//! not load; `auto`: it is served in fp32). `auto` also keeps fp32 when int8 is not faster on
//! this CPU (measured on the calibration texts); `int8` is then served with a warning.
//!
//! The outcome is prepared once per model content, settings, runtime and CPU: the int8 file
//! and its report are kept in `runtime.cache_dir` (one process prepares, the others wait on a
//! lock and read it). Without a cache_dir, each worker prepares its own at boot.

pub mod graph;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use inferd_config::model::{ModelEntry, Precision};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::pipeline::{embeddings, scores, Head, Pipeline, Text};
use crate::runtime::model::{ModelSession, Runtime, Threads};

/// Changes whenever what the preparation writes or how it measures changes.
const FORMAT: &str = "q4";

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
    pub texts: usize,
    /// Embeddings: least and mean cosine to fp32.
    pub min_cosine: Option<f64>,
    pub mean_cosine: Option<f64>,
    /// Classifiers: largest probability difference, and top-1 agreement (0..1).
    pub max_probability_error: Option<f64>,
    pub top1_agreement: Option<f64>,
    /// Time of the calibration texts, one at a time on one thread.
    pub fp32_ms: f64,
    pub int8_ms: f64,
    /// Why int8 is not served, when it is not.
    pub refused: Option<String>,
}

impl Report {
    /// One line for the log, `status` and the model's metadata.
    pub fn summary(&self) -> String {
        let error = match (self.min_cosine, self.mean_cosine, self.max_probability_error, self.top1_agreement) {
            (Some(min), Some(mean), _, _) => format!("min cosine {min:.4}, mean {mean:.4} to fp32"),
            (_, _, Some(p), Some(top1)) => {
                format!("largest probability error {p:.4}, top-1 agreement {:.1}% with fp32", top1 * 100.0)
            }
            _ => "not measured".into(),
        };
        let speed = format!(
            "{:.2}x fp32's speed ({:.2} vs {:.2} ms a text)",
            self.fp32_ms / self.int8_ms.max(1e-9),
            self.int8_ms,
            self.fp32_ms
        );
        let kept = match self.kept.len() {
            0 => String::new(),
            n => format!("; {n} kept in fp32: {}", self.kept.join(", ")),
        };
        let what = format!(
            "{} of {} MatMul/Attention nodes in int8{kept}; {error} over {} texts; {speed}",
            self.quantized, self.candidates, self.texts
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
        "{FORMAT} {:?} {} {} {:?} {:?}",
        entry.precision,
        entry.quantization.min_cosine,
        entry.quantization.max_probability_error,
        entry.quantization.calibration.as_ref().map(|c| std::fs::read(c).unwrap_or_default()),
        graph::host_range(),
    );
    let key: String = Sha256::new()
        .chain_update(sha256)
        .chain_update(settings)
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
            let (bytes, r) = measure(runtime, entry, &dir)?;
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
fn remove_older(dir: &std::path::Path, name: &str) {
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

/// What one model gives for the calibration texts.
enum Outputs {
    Embeddings(Vec<Vec<f32>>),
    Probabilities(Vec<Vec<f32>>),
}

impl Outputs {
    /// The rows of every third text, as [`run`] gives them for `texts.iter().step_by(3)`.
    fn every_third(&self) -> Outputs {
        let pick = |rows: &[Vec<f32>]| rows.iter().step_by(3).cloned().collect();
        match self {
            Outputs::Embeddings(rows) => Outputs::Embeddings(pick(rows)),
            Outputs::Probabilities(rows) => Outputs::Probabilities(pick(rows)),
        }
    }
}

/// Runs every text alone through `model`: its outputs, and the median time of a text.
fn run(model: &mut ModelSession, texts: &[String]) -> Result<(Outputs, f64), String> {
    let pipeline = model.meta.pipeline.clone();
    let Pipeline::Text(p) = &*pipeline else { return Err("the accuracy guard needs a text model".into()) };
    let head = p.head.clone();
    let mut rows = Vec::with_capacity(texts.len());
    let mut times = Vec::with_capacity(texts.len());
    for text in texts {
        let encoded = p.encode(&[Text::Single(text.clone())], true).map_err(|e| e.to_string())?;
        let started = Instant::now();
        let outputs = model.run(encoded.inputs, None).map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        let output = &outputs[head.output()];
        let row = match &head {
            Head::Embedding { settings, .. } => embeddings(output, &encoded.lengths, settings.pooling, true),
            Head::Classification { labels, activation, .. } => scores(output, labels.len(), *activation, false),
        }
        .map_err(|e| e.to_string())?;
        rows.extend(row);
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
    Ok(match head {
        Head::Embedding { .. } => (Outputs::Embeddings(rows), median),
        Head::Classification { .. } => (Outputs::Probabilities(rows), median),
    })
}

/// How far `got` is from the fp32 `want`.
struct Deviation {
    /// 0 = as fp32; the larger, the worse (1 - least cosine, or the largest probability error).
    worst: f64,
    mean_cosine: Option<f64>,
    top1: Option<f64>,
}

fn compare(want: &Outputs, got: &Outputs) -> Deviation {
    match (want, got) {
        (Outputs::Embeddings(a), Outputs::Embeddings(b)) => {
            let cosines: Vec<f64> = a
                .iter()
                .zip(b)
                .map(|(x, y)| {
                    let dot: f64 = x.iter().zip(y).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum();
                    let norm = |v: &[f32]| v.iter().map(|p| f64::from(*p).powi(2)).sum::<f64>().sqrt().max(1e-12);
                    dot / (norm(x) * norm(y))
                })
                .collect();
            let min = cosines.iter().copied().fold(1.0, f64::min);
            Deviation {
                worst: 1.0 - min,
                mean_cosine: Some(cosines.iter().sum::<f64>() / cosines.len().max(1) as f64),
                top1: None,
            }
        }
        (Outputs::Probabilities(a), Outputs::Probabilities(b)) => {
            let argmax = |v: &[f32]| v.iter().enumerate().max_by(|p, q| p.1.total_cmp(q.1)).map(|(i, _)| i);
            let worst = a
                .iter()
                .zip(b)
                .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| f64::from((p - q).abs())))
                .fold(0.0, f64::max);
            let agree = a.iter().zip(b).filter(|(x, y)| argmax(x) == argmax(y)).count();
            Deviation { worst, mean_cosine: None, top1: Some(agree as f64 / a.len().max(1) as f64) }
        }
        _ => Deviation { worst: f64::INFINITY, mean_cosine: None, top1: None },
    }
}

/// The guard: the int8 bytes to serve (None when refused) and what was measured.
fn measure(runtime: &Runtime, entry: &ModelEntry, dir: &std::path::Path) -> Result<(Option<Vec<u8>>, Report), String> {
    let source = std::fs::read(&entry.path).map_err(|e| format!("cannot read {}: {e}", entry.path.display()))?;
    let candidates = graph::candidates(&source)?;
    let texts = calibration(entry)?;
    // Private, unshared sessions of one thread: nothing lands in the weights cache.
    let plain = ModelEntry { precision: Precision::Fp32, share_weights: false, ..entry.clone() };
    let mut fp32 = ModelSession::load(runtime, &plain, Threads::Narrow).map_err(|e| e.to_string())?;
    let (want, fp32_ms) = run(&mut fp32, &texts)?;
    drop(fp32);
    let scratch = dir.join("candidate.onnx");
    let range = graph::host_range();
    // The model with every candidate but `keep` in int8, loaded from the scratch file.
    let load = |keep: &HashSet<String>| -> Result<(Vec<u8>, ModelSession), String> {
        let rewritten = graph::rewrite(&source, keep, range)?;
        std::fs::write(&scratch, &rewritten.bytes).map_err(|e| format!("cannot write {}: {e}", scratch.display()))?;
        let model =
            ModelSession::load(runtime, &ModelEntry { path: scratch.clone(), ..plain.clone() }, Threads::Narrow)
                .map_err(|e| format!("the int8 model does not load: {e}"))?;
        Ok((rewritten.bytes, model))
    };
    let try_keep = |keep: &HashSet<String>| -> Result<(Vec<u8>, Deviation, f64), String> {
        let (bytes, mut model) = load(keep)?;
        let (got, ms) = run(&mut model, &texts)?;
        Ok((bytes, compare(&want, &got), ms))
    };
    let limit = match &want {
        Outputs::Embeddings(_) => 1.0 - entry.quantization.min_cosine,
        Outputs::Probabilities(_) => entry.quantization.max_probability_error,
    };
    let mut keep = HashSet::new();
    let mut outcome = try_keep(&keep)?;
    if outcome.1.worst > limit && candidates.len() > 1 {
        // Each node alone in int8: what it costs, on every third text (the ranking needs no
        // more, and a model has tens of nodes).
        // Each text runs alone, so fp32's answers for the sample are those of the full set.
        let sample: Vec<String> = texts.iter().step_by(3).cloned().collect();
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
    let _ = std::fs::remove_file(&scratch);
    let (bytes, error, int8_ms) = outcome;
    let mut kept: Vec<String> = keep.into_iter().collect();
    kept.sort();
    let refused = if candidates.is_empty() {
        Some("the model has no fp32 MatMul with a weight matrix to quantise".to_string())
    } else if error.worst > limit {
        let kept = format!("{} of {} nodes kept in fp32", kept.len(), candidates.len());
        Some(match &want {
            Outputs::Embeddings(_) => format!(
                "the least cosine to fp32 is {:.4} with {kept}, under quantization.min_cosine = {}",
                1.0 - error.worst,
                entry.quantization.min_cosine
            ),
            Outputs::Probabilities(_) => format!(
                "the largest probability error is {:.4} with {kept}, over quantization.max_probability_error = {}",
                error.worst, entry.quantization.max_probability_error
            ),
        })
    } else if int8_ms >= fp32_ms * 0.95 {
        let slow = format!("int8 is not faster than fp32 on this CPU ({int8_ms:.2} vs {fp32_ms:.2} ms a text)");
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
    let embedding = matches!(want, Outputs::Embeddings(_));
    let report = Report {
        int8: refused.is_none(),
        quantized: candidates.len() - kept.len(),
        candidates: candidates.len(),
        kept,
        texts: texts.len(),
        min_cosine: embedding.then_some(1.0 - error.worst),
        mean_cosine: error.mean_cosine,
        max_probability_error: (!embedding).then_some(error.worst),
        top1_agreement: error.top1,
        fp32_ms,
        int8_ms,
        refused,
    };
    Ok((report.int8.then_some(bytes), report))
}

/// The built-in calibration texts, then the user's (one per line, empty lines skipped).
fn calibration(entry: &ModelEntry) -> Result<Vec<String>, String> {
    let mut texts: Vec<String> = BUILT_IN.iter().map(|t| t.to_string()).collect();
    // Long ones, up to and past max_length tokens (cut by the tokenizer): the sentences above
    // run together.
    let max = entry.tokenizer.as_ref().map_or(256, |t| t.max_length);
    for (i, take) in [8usize, 16, 32].into_iter().enumerate() {
        let words: Vec<&str> = BUILT_IN.iter().skip(i * 5).take(take).copied().collect();
        let mut text = words.join(" ");
        while text.split_whitespace().count() < max * take / 32 {
            text = format!("{text} {text}");
        }
        texts.push(text);
    }
    if let Some(path) = &entry.quantization.calibration {
        let own = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        texts.extend(own.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string));
    }
    Ok(texts)
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

    #[test]
    fn the_summary_says_what_was_served_and_what_it_cost() {
        let mut report = Report {
            int8: true,
            quantized: 16,
            candidates: 18,
            kept: vec!["a".into(), "b".into()],
            texts: 48,
            min_cosine: Some(0.9912),
            mean_cosine: Some(0.998),
            max_probability_error: None,
            top1_agreement: None,
            fp32_ms: 6.0,
            int8_ms: 3.0,
            refused: None,
        };
        let s = report.summary();
        assert!(
            s.starts_with("int8 (16 of 18 MatMul/Attention nodes in int8; 2 kept in fp32: a, b; min cosine 0.9912"),
            "{s}"
        );
        assert!(s.contains("2.00x fp32's speed"), "{s}");
        report.int8 = false;
        report.refused = Some("too slow".into());
        assert!(report.summary().starts_with("fp32 (int8 refused: too slow;"));
    }
}
