//! What a model's outputs become: pooled (and normalised) embeddings, per-token vectors,
//! sparse (SPLADE) weights, and labelled scores through the classifier's activation.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use inferd_config::model::{Activation, EmbeddingConfig, ModelEntry, Pooling, Task};

use std::sync::Arc;

use super::dense::Dense;
use super::error::{BuildError, PipelineError};
use crate::onnx::OnnxError;
use crate::runtime::tensor::{element_count, DataType, Tensor, TensorData, TensorSpec};

/// What the model does with its outputs.
#[derive(Debug, Clone)]
pub enum Head {
    /// `settings`: model.toml's `[embedding]` (pooling, normalisation, prompts); `dense`: its
    /// Dense layers' weights, read at load.
    Embedding { output: usize, settings: Box<EmbeddingConfig>, dense: Arc<Dense> },
    /// `why`: where `activation` came from (model.toml, or what the graph ends in).
    Classification { output: usize, labels: Vec<String>, activation: Activation, why: String },
}

/// The operator that computes a graph value, through shape-only operators: (op type, node), or
/// None for a graph input or initializer. Read from the model file only when asked.
pub type Producer<'a> = &'a dyn Fn(&str) -> Result<Option<(String, String)>, OnnxError>;

/// The activation of a classifier whose model.toml names none, from what computes its output:
/// probabilities the graph made itself are not activated again (a second softmax flattens
/// them: measured on published tf2onnx ResNet-50 and VGG16 files, up to 0.27 and 0.52 off).
fn chosen_activation(output: &str, producer: Producer) -> Result<(Activation, String), OnnxError> {
    let (activation, why) = match producer(output)? {
        Some((op, node)) if op == "Softmax" || op == "Sigmoid" => {
            (Activation::AsIs, format!("output '{output}' comes from {op} node '{node}': probabilities already"))
        }
        // softmax(log p) = p: the probabilities.
        Some((op, node)) if op == "LogSoftmax" => (
            Activation::Softmax,
            format!("output '{output}' comes from LogSoftmax node '{node}': softmax of log-probabilities"),
        ),
        Some((op, node)) => (Activation::Softmax, format!("output '{output}' comes from {op} node '{node}': logits")),
        None => (Activation::Softmax, format!("output '{output}' is not computed by a node: taken as logits")),
    };
    Ok((activation, format!("{why} (chosen from the graph; classification.activation in model.toml overrides)")))
}

impl Head {
    /// The head model.toml's task asks for, reading `outputs`; `producer` names the operator
    /// that computes a graph value (a classifier's activation, when model.toml names none).
    pub(super) fn build(entry: &ModelEntry, outputs: &[TensorSpec], producer: Producer) -> Result<Head, BuildError> {
        let pick = |name: &Option<String>| -> Result<(usize, &TensorSpec), BuildError> {
            match name {
                Some(n) => outputs.iter().position(|o| &o.name == n).map(|i| (i, &outputs[i])).ok_or_else(|| {
                    BuildError::NotAnOutput {
                        name: n.clone(),
                        outputs: outputs.iter().map(|o| o.name.clone()).collect(),
                    }
                }),
                None => outputs.first().map(|o| (0, o)).ok_or(BuildError::NoOutputs),
            }
        };
        match entry.task {
            Task::Embedding => {
                let e = entry.embedding.clone().unwrap_or_default();
                let (output, spec) = pick(&e.output)?;
                if spec.dtype != Some(DataType::F32) || !matches!(spec.shape.len(), 2 | 3) {
                    return Err(BuildError::EmbeddingOutput {
                        name: spec.name.clone(),
                        datatype: spec.datatype.clone(),
                        shape: spec.shape.clone(),
                    });
                }
                // The pooled vector's length, where the output declares its last dimension.
                let width = spec.shape.last().and_then(|&d| usize::try_from(d).ok()).filter(|&d| d > 0);
                if matches!(e.pooling, Pooling::Colbert | Pooling::BgeM3) && spec.shape.len() != 3 {
                    return Err(BuildError::ColbertOutput {
                        name: spec.name.clone(),
                        datatype: spec.datatype.clone(),
                        shape: spec.shape.clone(),
                    });
                }
                let dense = Arc::new(Dense::load(&e.dense, width)?);
                Ok(Head::Embedding { output, settings: Box::new(e), dense })
            }
            Task::Classification => {
                let c = entry.classification.clone().expect("checked when model.toml was read");
                let (output, spec) = pick(&c.output)?;
                let width = spec.shape.last().copied();
                if spec.dtype != Some(DataType::F32) || spec.shape.len() != 2 {
                    return Err(BuildError::ClassificationOutput {
                        name: spec.name.clone(),
                        datatype: spec.datatype.clone(),
                        shape: spec.shape.clone(),
                    });
                }
                if width.is_some_and(|w| w >= 0 && w as usize != c.labels.len()) {
                    return Err(BuildError::LabelCount {
                        labels: c.labels.len(),
                        output: spec.name.clone(),
                        logits: width.unwrap_or_default(),
                    });
                }
                let (activation, why) = match c.activation {
                    Some(a) => (a, "classification.activation in model.toml".to_string()),
                    None => chosen_activation(&spec.name, producer)?,
                };
                Ok(Head::Classification { output, labels: c.labels, activation, why })
            }
            Task::Raw => unreachable!("raw models have no head"),
        }
    }
}

impl Head {
    /// The output the head reads.
    pub fn output(&self) -> usize {
        match self {
            Head::Embedding { output, .. } | Head::Classification { output, .. } => *output,
        }
    }
}

/// Cuts each embedding to its first `wanted` values (Matryoshka), normalised again when the
/// request's embeddings are: a unit vector's prefix, scaled to unit length, is the prefix of
/// the raw vector scaled to unit length. `wanted` at most each row's length.
pub fn cut_dimensions(rows: &mut [Vec<f32>], wanted: usize, normalize: bool) {
    for row in rows {
        row.truncate(wanted);
        if normalize {
            l2_normalize(row);
        }
    }
}

/// Scales `row` to unit length (a zero vector stays zero).
pub fn l2_normalize(row: &mut [f32]) {
    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    row.iter_mut().for_each(|x| *x /= norm);
}

/// The vector of every token of every row (`/embed_all`), padding left out: from a
/// `[batch, sequence, dim]` output only.
pub fn token_embeddings(output: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<Vec<f32>>>, PipelineError> {
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    let dims: Vec<usize> = output.shape.iter().map(|&d| d.max(0) as usize).collect();
    let [b, s, d] = dims[..] else {
        return Err(PipelineError::NoTokenVectors { output: output.name.clone(), shape: output.shape.clone() });
    };
    if b != lengths.len() || d == 0 || element_count(&output.shape) != Some(values.len()) {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?} for {} values",
            output.name,
            output.shape,
            values.len()
        )));
    }
    // s x d is at most values.len(), checked above.
    Ok(values
        .chunks(s.saturating_mul(d).max(1))
        .zip(lengths)
        .map(|(row, &n)| row.chunks(d).take(n.min(s)).map(<[f32]>::to_vec).collect())
        .collect())
}

/// Pools token vectors `[batch, sequence, dim]` (or passes `[batch, dim]` through), then
/// L2-normalises when asked.
/// The mean of `tokens`' states (each `dims` values), or with `max` the largest value of each
/// dimension: mean and max pooling, for a whole text here and for a chunk of it in late
/// chunking ([`super::late`]).
pub(super) fn pool<'a>(tokens: impl Iterator<Item = &'a [f32]>, dims: usize, max: bool) -> Vec<f32> {
    let mut pooled = vec![if max { f32::NEG_INFINITY } else { 0.0 }; dims];
    let mut count = 0usize;
    for token in tokens {
        pooled.iter_mut().zip(token).for_each(|(a, &b)| *a = if max { a.max(b) } else { *a + b });
        count = count.saturating_add(1);
    }
    if !max {
        let n = count.max(1) as f32;
        pooled.iter_mut().for_each(|x| *x /= n);
    }
    pooled
}

pub fn embeddings(
    output: &Tensor,
    lengths: &[usize],
    (pooling, dense): (Pooling, &Dense),
    normalize: bool,
) -> Result<Vec<Vec<f32>>, PipelineError> {
    match pooling {
        Pooling::Colbert => return Err(PipelineError::PerToken),
        Pooling::BgeM3 => return Err(PipelineError::ThreeOutputs),
        _ => {}
    }
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    let dims: Vec<usize> = output.shape.iter().map(|&d| d.max(0) as usize).collect();
    if dims.iter().skip(1).any(|&d| d == 0) || element_count(&output.shape) != Some(values.len()) {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?} for {} values: no embedding can be read from it",
            output.name,
            output.shape,
            values.len()
        )));
    }
    let mut rows = match dims.as_slice() {
        [b, d] if *b == lengths.len() => values.chunks(*d).map(<[f32]>::to_vec).collect::<Vec<_>>(),
        [b, s, _] if *b == lengths.len() && *s == 0 => {
            return Err(PipelineError::Output(format!("'{}' has no tokens (shape {:?})", output.name, output.shape)))
        }
        [b, s, d] if *b == lengths.len() => values
            .chunks(s.saturating_mul(*d).max(1))
            .zip(lengths)
            .map(|(row, &length)| {
                // Rows are padded at the end: the first `n` tokens are the text's.
                let n = length.clamp(1, *s);
                let mut tokens = row.chunks(*d).take(n);
                match pooling {
                    Pooling::Cls => row[..*d].to_vec(),
                    Pooling::LastToken => tokens.next_back().unwrap_or(&row[..*d]).to_vec(),
                    Pooling::Mean => pool(tokens, *d, false),
                    Pooling::Max => pool(tokens, *d, true),
                    // log(1 + relu(x)) grows with x: the largest x of each entry decides.
                    Pooling::Splade => {
                        let mut max = vec![0f32; *d];
                        for token in tokens {
                            max.iter_mut().zip(token).for_each(|(a, &b)| *a = a.max(b));
                        }
                        max.iter().map(|x| x.ln_1p()).collect()
                    }
                    Pooling::Colbert | Pooling::BgeM3 => unreachable!("refused above"),
                }
            })
            .collect(),
        _ => return Err(PipelineError::Output(format!("'{}' has shape {:?}", output.name, output.shape))),
    };
    if let Some(inputs) = dense.inputs() {
        // A graph that did not declare its width, and gives another than the layers take.
        if let Some(row) = rows.iter().find(|r| r.len() != inputs) {
            return Err(PipelineError::Output(format!(
                "'{}' gives vectors of {} values; the model's Dense layers take {inputs}",
                output.name,
                row.len()
            )));
        }
        rows = rows.into_iter().map(|row| dense.apply(row)).collect();
    }
    if normalize {
        rows.iter_mut().for_each(|row| l2_normalize(row));
    }
    Ok(rows)
}

/// The entries of `row` above `threshold` as (index, value) in index order; with `top_k`, only
/// the `top_k` largest of them (`/embed_sparse`).
pub fn sparse(row: &[f32], threshold: f32, top_k: Option<usize>) -> Vec<(usize, f32)> {
    let mut kept: Vec<(usize, f32)> = row.iter().copied().enumerate().filter(|(_, v)| *v > threshold).collect();
    if let Some(k) = top_k.filter(|&k| k < kept.len()) {
        kept.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        kept.truncate(k);
        kept.sort_by_key(|e| e.0);
    }
    kept
}

/// Scores per row, `raw` = the output as the model gave it, else activated.
pub fn scores(
    output: &Tensor,
    labels: usize,
    activation: Activation,
    raw: bool,
) -> Result<Vec<Vec<f32>>, PipelineError> {
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    if output.shape.len() != 2 || output.shape[1] as usize != labels || labels == 0 {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?}, expected [batch, {labels}]",
            output.name, output.shape
        )));
    }
    Ok(values
        .chunks(labels)
        .map(|logits| match (raw, activation) {
            (true, _) => logits.to_vec(),
            (false, Activation::AsIs) => logits.to_vec(),
            (false, Activation::Sigmoid) => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
            (false, Activation::Softmax) => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|x| (x - max).exp()).collect();
                let sum: f32 = exp.iter().sum();
                exp.iter().map(|x| x / sum).collect()
            }
        })
        .collect())
}

/// Labels with their scores, best first, at most `top_k`.
pub fn ranked(labels: &[String], scores: &[f32], top_k: Option<usize>) -> Vec<(String, f32)> {
    let mut pairs: Vec<(String, f32)> = labels.iter().cloned().zip(scores.iter().copied()).collect();
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
    pairs.truncate(top_k.unwrap_or(usize::MAX));
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_pooling_ignores_padding_and_normalises() {
        // Two rows, sequence 3, dim 2; row 1 has one real token.
        let out = Tensor {
            name: "h".into(),
            shape: vec![2, 3, 2],
            data: TensorData::F32(vec![1., 2., 3., 4., 9., 9., 6., 8., 100., 100., 100., 100.]),
        };
        let e = embeddings(&out, &[2, 1], (Pooling::Mean, &Dense::default()), false).unwrap();
        assert_eq!(e, vec![vec![2., 3.], vec![6., 8.]]);
        let e = embeddings(&out, &[2, 1], (Pooling::Mean, &Dense::default()), true).unwrap();
        assert!((e[1][0] - 0.6).abs() < 1e-6 && (e[1][1] - 0.8).abs() < 1e-6);
        let e = embeddings(&out, &[2, 1], (Pooling::Cls, &Dense::default()), false).unwrap();
        assert_eq!(e[1], vec![6., 8.]);
        // Row 0 has tokens (1, 2) and (3, 4), then padding (9, 9); row 1 one token.
        let e = embeddings(&out, &[2, 1], (Pooling::Max, &Dense::default()), false).unwrap();
        assert_eq!(e, vec![vec![3., 4.], vec![6., 8.]]);
        let e = embeddings(&out, &[2, 1], (Pooling::LastToken, &Dense::default()), false).unwrap();
        assert_eq!(e, vec![vec![3., 4.], vec![6., 8.]]);
        let out = Tensor { data: TensorData::F32(vec![5., -2., 3., 4., 9., 9., 6., 8., 0., 0., 0., 0.]), ..out };
        let e = embeddings(&out, &[2, 1], (Pooling::Max, &Dense::default()), false).unwrap();
        assert_eq!(e[0], vec![5., 4.], "each dimension's own maximum");
        let e = embeddings(&out, &[2, 1], (Pooling::Splade, &Dense::default()), false).unwrap();
        assert_eq!(e[0], vec![5f32.ln_1p(), 4f32.ln_1p()]);
        let out = Tensor { data: TensorData::F32(vec![-1., -2., 3., -4., 9., 9., 6., 8., 0., 0., 0., 0.]), ..out };
        let e = embeddings(&out, &[2, 1], (Pooling::Splade, &Dense::default()), false).unwrap();
        assert_eq!(e[0], vec![3f32.ln_1p(), 0.], "relu: no token above 0 gives 0");
    }

    #[test]
    fn sparse_vectors_keep_what_is_above_the_threshold_or_the_top_k() {
        let row = [0., 0.5, 0., 2., 0.1, 1.];
        assert_eq!(sparse(&row, 0., None), vec![(1, 0.5), (3, 2.), (4, 0.1), (5, 1.)]);
        assert_eq!(sparse(&row, 0.2, None), vec![(1, 0.5), (3, 2.), (5, 1.)]);
        assert_eq!(sparse(&row, 0., Some(2)), vec![(3, 2.), (5, 1.)], "the two largest, in index order");
        assert_eq!(sparse(&row, 0., Some(9)).len(), 4);
        assert!(sparse(&row, 0., Some(0)).is_empty());
    }

    #[test]
    fn zero_sized_outputs_are_a_model_error_not_a_panic() {
        for shape in [vec![2, 0], vec![2, 3, 0], vec![2, 0, 4]] {
            let out = Tensor { name: "h".into(), shape, data: TensorData::F32(vec![]) };
            for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Max, Pooling::LastToken, Pooling::Splade] {
                let err = embeddings(&out, &[1, 1], (pooling, &Dense::default()), true).unwrap_err().to_string();
                assert!(err.contains("no embedding"), "{err}");
            }
        }
        let short = Tensor { name: "h".into(), shape: vec![2, 3, 2], data: TensorData::F32(vec![1.; 6]) };
        assert!(embeddings(&short, &[1, 1], (Pooling::Mean, &Dense::default()), false).is_err());
        let none = Tensor { name: "l".into(), shape: vec![1, 0], data: TensorData::F32(vec![]) };
        assert!(scores(&none, 0, Activation::Softmax, false).is_err());
    }

    #[test]
    fn softmax_sigmoid_raw_and_ranking() {
        let out = Tensor { name: "l".into(), shape: vec![1, 3], data: TensorData::F32(vec![0., 1., 2.]) };
        let s = scores(&out, 3, Activation::Softmax, false).unwrap();
        assert!((s[0].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(scores(&out, 3, Activation::Softmax, true).unwrap()[0], vec![0., 1., 2.]);
        assert!((scores(&out, 3, Activation::Sigmoid, false).unwrap()[0][0] - 0.5).abs() < 1e-6);
        let labels: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let r = ranked(&labels, &s[0], Some(2));
        assert_eq!(r.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(), ["c", "b"]);
        assert!(scores(&out, 4, Activation::Softmax, false).is_err());
    }
}
