//! The accuracy guard: the fp32 and the int8 model run side by side on the calibration inputs
//! ([`super::calibration`]), each input alone, and compared on what the task cares about; the
//! nodes that cost the most are kept in fp32 until the bound holds, or int8 is refused.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use inferd_config::model::{ModelEntry, Precision};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use super::calibration::{calibration, Calibration, Sample};
use super::error::Int8Error;
use super::report::Report;
use super::rewrite::{self, Range};
use crate::pipeline::{embeddings, scores, Head, Pipeline, Side, Text};
use crate::runtime::model::{ModelSession, Runtime, Threads};
use crate::runtime::tensor::{Tensor, TensorData};

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
fn run(model: &mut ModelSession, pipeline: &Pipeline, samples: &[Sample]) -> Result<(Outputs, f64), Int8Error> {
    let head = pipeline.head().cloned();
    let mut rows = Vec::with_capacity(samples.len());
    let mut exact = Vec::new();
    let mut times = Vec::with_capacity(samples.len());
    for sample in samples {
        let (inputs, lengths) = match (pipeline, sample) {
            (Pipeline::Text(p), Sample::Text(text)) => {
                let encoded = p.encode(&[Text::Single(text.clone())], Some(Side::Right))?;
                (encoded.inputs, encoded.lengths)
            }
            (Pipeline::Image(p), Sample::Image(bytes)) => (p.preprocess(std::slice::from_ref(bytes))?, Vec::new()),
            (Pipeline::Raw, Sample::Tensors(tensors)) => (tensors.clone(), Vec::new()),
            _ => return Err(Int8Error::Kind),
        };
        let started = Instant::now();
        let outputs = model.run(inputs, None)?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        match &head {
            Some(Head::Embedding { output, settings, dense }) => {
                rows.extend(embeddings(&outputs[*output], &lengths, (settings.pooling, dense), true)?)
            }
            Some(Head::Classification { output, labels, activation, .. }) => {
                rows.extend(scores(&outputs[*output], labels.len(), *activation, false)?)
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
/// `sha256`: the model file's digest.
pub(super) fn measure(
    runtime: &Runtime,
    entry: &ModelEntry,
    sha256: &[u8],
    dir: &Path,
) -> Result<(Option<Vec<u8>>, Report), Int8Error> {
    let source = std::fs::read(&entry.path).map_err(|error| Int8Error::File {
        action: "read",
        path: entry.path.clone(),
        error,
    })?;
    let candidates = rewrite::candidates(&source)?;
    if candidates.is_empty() {
        let mut why = "the model has no fp32 MatMul or Gemm with a weight matrix in the file to quantise".to_string();
        if !crate::onnx::external_files(&source)?.is_empty() {
            why.push_str(" (its weights are in external data files, which the int8 rewrite does not read)");
        }
        return Ok((None, Report::refused(0, why)));
    }
    // Private, unshared sessions of one thread: nothing lands in the weights cache.
    let plain = ModelEntry { precision: Precision::Fp32, share_weights: false, ..entry.clone() };
    let mut fp32 = ModelSession::load(runtime, &plain, Threads::Narrow, sha256)?;
    // Built once, for both models: the int8 rewrite leaves the inputs and outputs as they are.
    let pipeline = crate::load::model::pipeline(entry, &fp32.meta)?;
    let (samples, of) = match calibration(entry, &fp32.meta, &pipeline)? {
        Calibration::Inputs(samples, of) => (samples, of),
        // Nothing to measure int8 on: refused, with the reason (`auto` serves fp32).
        Calibration::None(why) => return Ok((None, Report::refused(candidates.len(), why))),
    };
    let (want, fp32_ms) = run(&mut fp32, &pipeline, &samples)?;
    drop(fp32);
    // The candidate file goes however the measuring ends (an error included).
    let candidate = ScratchFile(dir.join("candidate.onnx"));
    let scratch = &candidate.0;
    let cpu = crate::runtime::cpu::Class::detect();
    // The model with every candidate but `keep` in int8 as `range` says, loaded from the
    // scratch file.
    let load = |keep: &HashSet<String>, range: Range| -> Result<(Vec<u8>, ModelSession), Int8Error> {
        let rewritten = rewrite::rewrite(&source, keep, range)?;
        std::fs::write(scratch, &rewritten.bytes).map_err(|error| Int8Error::File {
            action: "write",
            path: scratch.clone(),
            error,
        })?;
        let candidate = ModelEntry { path: scratch.clone(), ..plain.clone() };
        let model = ModelSession::load(runtime, &candidate, Threads::Narrow, &Sha256::digest(&rewritten.bytes))
            .map_err(Int8Error::Int8Session)?;
        Ok((rewritten.bytes, model))
    };
    let try_keep = |keep: &HashSet<String>, range: Range| -> Result<(Vec<u8>, Deviation, f64), Int8Error> {
        let (bytes, mut model) = load(keep, range)?;
        let (got, ms) = run(&mut model, &pipeline, &samples)?;
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
    // One formulation: every node in int8, then the costliest kept in fp32 one by one.
    let attempt = |range: Range| -> Result<Attempt, Int8Error> {
        let mut keep = HashSet::new();
        let mut outcome = try_keep(&keep, range)?;
        if outcome.1.worst > limit && candidates.len() > 1 {
            // Each node alone in int8: what it costs, on every third input (the ranking needs
            // no more, and a model has tens of nodes).
            // Each input runs alone, so fp32's answers for the sample are those of the full set.
            let sample: Vec<Sample> = samples.iter().step_by(3).cloned().collect();
            let want_sample = want.every_third();
            let mut costs = Vec::with_capacity(candidates.len());
            for node in &candidates {
                let others: HashSet<String> = candidates.iter().filter(|c| *c != node).cloned().collect();
                let (_, mut model) = load(&others, range)?;
                costs.push((compare(&want_sample, &run(&mut model, &pipeline, &sample)?.0).worst, node.clone()));
            }
            costs.sort_by(|a, b| b.0.total_cmp(&a.0));
            for (cost, node) in costs.into_iter().take(candidates.len() / 2) {
                info!(model = entry.name, "int8 guard ({range:?}): keeping {node} in fp32 (alone it costs {cost:.4})");
                keep.insert(node);
                outcome = try_keep(&keep, range)?;
                if outcome.1.worst <= limit {
                    break;
                }
            }
        }
        let (bytes, error, int8_ms) = outcome;
        Ok(Attempt { range, keep, bytes, error, int8_ms })
    };
    // Each formulation this CPU's kernels add exactly (two without VNNI): the one that passes
    // and runs fastest, else the one closest to passing. One that cannot run is passed over
    // while another can.
    let mut attempts: Vec<Attempt> = Vec::new();
    let mut failed = None;
    for &range in Range::candidates(cpu) {
        match attempt(range) {
            Ok(a) => attempts.push(a),
            Err(e) => {
                warn!(model = entry.name, "int8 guard: {} cannot be measured: {e}", range.formulation());
                failed.get_or_insert(e);
            }
        }
    }
    let passes = |a: &Attempt| a.error.differ == 0 && a.error.worst.is_finite() && a.error.worst <= limit;
    attempts.sort_by(|a, b| {
        passes(b).cmp(&passes(a)).then(match passes(a) {
            true => a.int8_ms.total_cmp(&b.int8_ms),
            false => a.error.worst.total_cmp(&b.error.worst),
        })
    });
    let figure = |worst: f64| if want.kind == Kind::Embeddings { 1.0 - worst } else { worst };
    let alternatives: Vec<String> = attempts
        .iter()
        .skip(1)
        .map(|a| {
            format!(
                "{}: {measured} {:.4} with {} kept in fp32, {:.2} ms",
                a.range.formulation(),
                figure(a.error.worst),
                a.keep.len(),
                a.int8_ms
            )
        })
        .collect();
    let Some(Attempt { range, keep, bytes, error, int8_ms }) = attempts.into_iter().next() else {
        return Err(failed.expect("a formulation was tried"));
    };
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
        Some(format!(
            "{measured} is {:.4} with {} of {} nodes kept in fp32, {} quantization.{key} = {bound}",
            figure(error.worst),
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
        cpu,
        formulation: range,
        alternatives,
    };
    Ok((report.int8.then_some(bytes), report))
}

/// One formulation's outcome: the nodes kept in fp32, the int8 file and its figures.
struct Attempt {
    range: Range,
    keep: HashSet<String>,
    bytes: Vec<u8>,
    error: Deviation,
    int8_ms: f64,
}

/// A file removed when this is dropped.
struct ScratchFile(PathBuf);

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
