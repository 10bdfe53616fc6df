//! ColBERT's late interaction (`pooling = "colbert"`): a vector per token, as PyLate's
//! `ColBERT.encode` computes them (pylate/models/colbert.py: `tokenize`, `insert_prefix_token`,
//! `encode`, `skiplist_mask`).
//!
//! - A text is tokenized with the model's special tokens, cut to one token less than its
//!   length (`query_length` / `document_length`), then its marker (`query_prefix` /
//!   `document_prefix`, a token) goes after its first token (`[CLS]`), attended, type 0.
//! - A query with `do_query_expansion` is padded to `query_length` with the mask token, not
//!   attended unless `attend_to_expansion_tokens`; every one of its `query_length` vectors is
//!   kept. Without expansion a query keeps its own tokens.
//! - A document keeps its tokens but those of `skiplist_words` (punctuation).
//! - Each kept token's state goes through the model's Dense layers, then is scaled to unit
//!   length when the model normalises.
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::HashSet;

use inferd_config::model::ColbertConfig;
use tokenizers::models::ModelWrapper;
use tokenizers::{Encoding, Tokenizer, TruncationDirection};

use super::dense::Dense;
use super::error::{BuildError, PipelineError};
use super::head::{l2_normalize, token_embeddings};
use crate::runtime::tensor::Tensor;

/// Which side of a search a text is: PyLate's `is_query`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Query,
    Document,
}

/// The recipe with its tokens as the tokenizer's ids, resolved when the model loads.
#[derive(Debug, Clone)]
pub struct Colbert {
    query_prefix: Option<u32>,
    document_prefix: Option<u32>,
    mask: u32,
    skiplist: HashSet<u32>,
    pub query_length: usize,
    pub document_length: usize,
    expand: bool,
    attend: bool,
}

/// A batch of texts as ColBERT feeds them, and which positions of each row give a vector.
pub struct Marked {
    /// Each row: its ids, attention mask and type ids.
    pub rows: Vec<Encoding>,
    pub keep: Vec<Vec<bool>>,
}

impl Colbert {
    /// `config`'s tokens looked up in `tokenizer`: a marker or mask token it does not have is
    /// refused.
    pub fn build(config: &ColbertConfig, tokenizer: &Tokenizer) -> Result<Colbert, BuildError> {
        let id = |key: &'static str, token: &str| -> Result<Option<u32>, BuildError> {
            match token {
                "" => Ok(None),
                token => tokenizer
                    .token_to_id(token)
                    .map(Some)
                    .ok_or_else(|| BuildError::ColbertToken { key, token: token.to_string() }),
            }
        };
        let unknown = unknown_id(tokenizer);
        let mask = id("mask_token", &config.mask_token)?
            .ok_or(BuildError::ColbertToken { key: "mask_token", token: String::new() })?;
        Ok(Colbert {
            query_prefix: id("query_prefix", &config.query_prefix)?,
            document_prefix: id("document_prefix", &config.document_prefix)?,
            mask,
            // As transformers' convert_tokens_to_ids, which PyLate calls: a word that is not a
            // token is the unknown token (so a document's unknown tokens are skipped with it).
            skiplist: config.skiplist_words.iter().filter_map(|w| tokenizer.token_to_id(w).or(unknown)).collect(),
            query_length: config.query_length,
            document_length: config.document_length,
            expand: config.do_query_expansion,
            attend: config.attend_to_expansion_tokens,
        })
    }

    /// The most tokens a text of `role` gives, marker and special tokens included.
    pub fn length(&self, role: Role) -> usize {
        match role {
            Role::Query => self.query_length,
            Role::Document => self.document_length,
        }
    }

    /// `texts` tokenized by `tokenizer` (no truncation or padding of its own) as `role`;
    /// `special`: the tokens the tokenizer's post-processor adds to one text.
    pub fn mark(
        &self,
        tokenizer: &Tokenizer,
        special: usize,
        texts: &[&str],
        role: Role,
    ) -> Result<Marked, PipelineError> {
        let (prefix, length) = match role {
            Role::Query => (self.query_prefix, self.query_length),
            Role::Document => (self.document_prefix, self.document_length),
        };
        // The text with its special tokens fills the length less its marker.
        let room = length.saturating_sub(usize::from(prefix.is_some()));
        let expand = role == Role::Query && self.expand;
        let mut rows = Vec::with_capacity(texts.len());
        let mut keep = Vec::with_capacity(texts.len());
        for (index, text) in texts.iter().enumerate() {
            if text.is_empty() {
                return Err(PipelineError::Empty { index });
            }
            let tokenizer_error = |e: tokenizers::Error| PipelineError::Tokenizer { index, message: e.to_string() };
            let mut bare = tokenizer.encode_fast(*text, false).map_err(tokenizer_error)?;
            bare.truncate(room.saturating_sub(special), 0, TruncationDirection::Right);
            let full = tokenizer.post_process(bare, None, true).map_err(tokenizer_error)?;
            let (mut ids, mut mask, mut types) =
                (full.get_ids().to_vec(), full.get_attention_mask().to_vec(), full.get_type_ids().to_vec());
            if let Some(prefix) = prefix {
                let at = ids.len().min(1);
                ids.insert(at, prefix);
                mask.insert(at, 1);
                types.insert(at, 0);
            }
            let kept = if expand {
                let missing = length.saturating_sub(ids.len());
                ids.extend(std::iter::repeat_n(self.mask, missing));
                mask.extend(std::iter::repeat_n(u32::from(self.attend), missing));
                types.extend(std::iter::repeat_n(0, missing));
                vec![true; ids.len()]
            } else if role == Role::Query {
                vec![true; ids.len()]
            } else {
                ids.iter().map(|id| !self.skiplist.contains(id)).collect()
            };
            keep.push(kept);
            rows.push(row(ids, mask, types));
        }
        Ok(Marked { rows, keep })
    }

    /// Each row's kept token vectors from `output` (`[batch, sequence, dim]`), through `dense`,
    /// normalised when `normalize`.
    pub fn vectors(
        output: &Tensor,
        keep: &[Vec<bool>],
        dense: &Dense,
        normalize: bool,
    ) -> Result<Vec<Vec<Vec<f32>>>, PipelineError> {
        let lengths: Vec<usize> = keep.iter().map(Vec::len).collect();
        let rows = token_embeddings(output, &lengths)?;
        let width = rows.iter().flatten().next().map_or(0, Vec::len);
        if dense.inputs().is_some_and(|inputs| inputs != width) {
            return Err(PipelineError::Output(format!(
                "'{}' gives vectors of {width} values; the model's Dense layers take {:?}",
                output.name,
                dense.inputs()
            )));
        }
        Ok(rows
            .into_iter()
            .zip(keep)
            .map(|(tokens, kept)| {
                tokens
                    .into_iter()
                    .zip(kept)
                    .filter(|(_, &k)| k)
                    .map(|(token, _)| {
                        let mut v = dense.apply(token);
                        if normalize {
                            l2_normalize(&mut v);
                        }
                        v
                    })
                    .collect()
            })
            .collect())
    }
}

/// The id of the tokenizer's unknown token, where its model names one.
fn unknown_id(tokenizer: &Tokenizer) -> Option<u32> {
    let token = match tokenizer.get_model() {
        ModelWrapper::WordPiece(m) => Some(m.unk_token.as_str()),
        ModelWrapper::BPE(m) => m.unk_token.as_deref(),
        ModelWrapper::WordLevel(m) => Some(m.unk_token.as_str()),
        ModelWrapper::Unigram(_) => None,
    }?;
    tokenizer.token_to_id(token)
}

/// A row of ids, attention mask and type ids as an [`Encoding`] (what the text pipeline pads
/// into a batch).
fn row(ids: Vec<u32>, mask: Vec<u32>, types: Vec<u32>) -> Encoding {
    let n = ids.len();
    Encoding::new(
        ids,
        types,
        vec![String::new(); n],
        vec![None; n],
        vec![(0, 0); n],
        vec![0; n],
        mask,
        Vec::new(),
        Default::default(),
    )
}
