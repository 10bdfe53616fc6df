//! BGE-M3's three outputs from one run (`pooling = "bge_m3"`), as FlagEmbedding's
//! `BGEM3FlagModel.encode` computes them (FlagEmbedding/inference/embedder/encoder_only/m3.py
//! and finetune/embedder/encoder_only/m3/modeling.py):
//!
//! - dense: the first token's state (`sentence_pooling_method = "cls"`), normalised;
//! - lexical weights: `relu(sparse_linear(state))` of each token, and per token id the largest,
//!   where it is above 0 and the token is not one of `unused_tokens` (the tokenizer's cls, eos,
//!   pad and unk tokens), in the order the ids first come;
//! - ColBERT vectors: `colbert_linear(state)` of every token after the first, normalised.
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::{HashMap, HashSet};

use inferd_config::model::{BgeM3Config, DenseActivation, DenseLayer};
use tokenizers::Tokenizer;

use super::dense::Dense;
use super::error::{BuildError, PipelineError};
use super::head::{l2_normalize, token_embeddings};
use crate::runtime::tensor::Tensor;

/// The two heads, read when the model loads, and the ids that get no lexical weight.
#[derive(Debug)]
pub struct BgeM3 {
    colbert: Dense,
    sparse: Dense,
    unused: HashSet<u32>,
}

/// One text's outputs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Outputs {
    pub dense: Vec<f32>,
    /// (token id, weight), in the order the ids first come.
    pub lexical: Vec<(u32, f32)>,
    pub colbert: Vec<Vec<f32>>,
}

impl BgeM3 {
    /// The heads of `config` (safetensors with `weight` and `bias`); an unused token the
    /// tokenizer does not have is refused.
    pub fn build(config: &BgeM3Config, tokenizer: &Tokenizer) -> Result<BgeM3, BuildError> {
        let head = |file: &std::path::Path, activation| {
            Dense::load(&[DenseLayer { file: file.to_path_buf(), activation }], None)
        };
        let colbert = head(&config.colbert_linear, DenseActivation::Identity)?;
        let sparse = head(&config.sparse_linear, DenseActivation::Relu)?;
        if sparse.outputs() != Some(1) || colbert.inputs() != sparse.inputs() {
            return Err(BuildError::BgeM3Heads {
                colbert: (colbert.inputs(), colbert.outputs()),
                sparse: (sparse.inputs(), sparse.outputs()),
            });
        }
        let unused = config
            .unused_tokens
            .iter()
            .map(|t| tokenizer.token_to_id(t).ok_or_else(|| BuildError::UnusedToken(t.clone())))
            .collect::<Result<_, _>>()?;
        Ok(BgeM3 { colbert, sparse, unused })
    }

    /// Each row's outputs from `output` (`[batch, sequence, hidden]`), its first `ids[r].len()`
    /// tokens being `ids[r]`; dense and ColBERT vectors normalised when `normalize`.
    pub fn outputs(&self, output: &Tensor, ids: &[Vec<u32>], normalize: bool) -> Result<Vec<Outputs>, PipelineError> {
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let rows = token_embeddings(output, &lengths)?;
        if rows.iter().zip(&lengths).any(|(row, &n)| row.is_empty() || row.len() != n) {
            return Err(PipelineError::Output(format!(
                "'{}' has shape {:?} for rows of {lengths:?} tokens",
                output.name, output.shape
            )));
        }
        let width = rows.iter().flatten().next().map_or(0, Vec::len);
        if self.colbert.inputs() != Some(width) {
            return Err(PipelineError::Output(format!(
                "'{}' gives vectors of {width} values; BGE-M3's heads take {:?}",
                output.name,
                self.colbert.inputs()
            )));
        }
        let scaled = |mut v: Vec<f32>| {
            if normalize {
                l2_normalize(&mut v);
            }
            v
        };
        Ok(rows
            .into_iter()
            .zip(ids)
            .map(|(states, ids)| {
                let mut lexical: Vec<(u32, f32)> = Vec::new();
                let mut at: HashMap<u32, usize> = HashMap::new();
                for (state, &id) in states.iter().zip(ids) {
                    let weight = self.sparse.apply(state.clone()).first().copied().unwrap_or(0.0);
                    if self.unused.contains(&id) || weight <= 0.0 {
                        continue;
                    }
                    match at.get(&id) {
                        Some(&i) => lexical[i].1 = lexical[i].1.max(weight),
                        None => {
                            at.insert(id, lexical.len());
                            lexical.push((id, weight));
                        }
                    }
                }
                let mut states = states.into_iter();
                let dense = scaled(states.next().unwrap_or_default());
                Outputs { dense, lexical, colbert: states.map(|s| scaled(self.colbert.apply(s))).collect() }
            })
            .collect())
    }

    /// The most bytes the JSON answer for a text of `tokens` tokens takes, with the outputs
    /// asked for (dense, lexical, ColBERT): each float with its comma, each weight with its
    /// id, each list's brackets.
    pub fn answer_bound(&self, tokens: usize, (dense, lexical, colbert): (bool, bool, bool)) -> u64 {
        const FLOAT: u64 = 16;
        let hidden = self.colbert.inputs().unwrap_or(0) as u64;
        let width = self.colbert.outputs().unwrap_or(0) as u64;
        let per_token = match colbert {
            true => width.saturating_mul(FLOAT).saturating_add(3),
            false => 0,
        }
        .saturating_add(if lexical { FLOAT.saturating_add(16) } else { 0 });
        let fixed = if dense { hidden.saturating_mul(FLOAT) } else { 0 };
        (tokens as u64).saturating_mul(per_token).saturating_add(fixed).saturating_add(16)
    }
}
