//! TEI's embedding routes: `/embed`, `/embed_all`, `/embed_sparse` and `/similarity`.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use serde::Serialize;

use crate::http::reply::{ran, Reply};
use crate::http::tei::bodies::{EmbedRequest, SimilarityRequest, SparseRequest};
use crate::http::tei::open::{Inference, Needs};
use crate::pipeline::{cut_dimensions, sparse, Head, Text};
use crate::request::error::ApiError;
use crate::request::tasks::{self, Options, PipelineInput, Rows};

pub async fn embed(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: EmbedRequest = tei.open(Needs::Embedding, "/embed", body)?;
    if request.dimensions == Some(0) {
        return Err(ApiError::BadRequest("`dimensions` should be positive".into()));
    }
    let normalize = match tei.meta.pipeline.head() {
        Some(Head::Embedding { settings, .. }) => request.normalize.unwrap_or(settings.normalize),
        _ => false,
    };
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        normalize: request.normalize,
        prompt_name: request.prompt_name,
        ..Options::default()
    };
    let mut outcome = tei.run_texts(request.inputs, options).await?;
    let Rows::Embeddings(rows) = &mut outcome.rows else { unreachable!("embedding models return embeddings") };
    // As TEI (since its Matryoshka support): any model's vector may be cut, not only one
    // trained for it (OpenAI's route asks `[embedding] matryoshka`).
    if let Some(wanted) = request.dimensions {
        let full = rows.first().map_or(0, Vec::len);
        if wanted > full {
            return Err(ApiError::BadRequest(format!(
                "`dimensions` should be smaller than the maximum embedding dimension ({full} for model '{}'); {wanted} \
                 was asked",
                tei.meta.info.name
            )));
        }
        cut_dimensions(rows, wanted, normalize);
    }
    Ok(ran(serde_json::to_vec(rows).expect("floats serialise"), &outcome))
}

/// `POST /embed_all`: `{"inputs": ..., "truncate": false}` -> per input, the vector of each of
/// its tokens (special tokens included, padding left out), not pooled or normalised.
pub async fn embed_all(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: EmbedRequest = tei.open(Needs::Embedding, "/embed_all", body)?;
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        tokens: true,
        prompt_name: request.prompt_name,
        ..Options::default()
    };
    let mut outcome = tei.run_texts(request.inputs, options).await?;
    let Rows::Tokens(rows) = std::mem::replace(&mut outcome.rows, Rows::Tokens(Vec::new())) else {
        unreachable!("asked for token embeddings")
    };
    // Each float, and the brackets and comma of each vector and text.
    let floats: usize = rows.iter().flatten().map(Vec::len).sum();
    let lists = rows.iter().map(|r| r.len().saturating_add(1)).sum::<usize>().saturating_add(1);
    let bound = (floats as u64).saturating_mul(tasks::JSON_F32_BYTES).saturating_add((lists as u64).saturating_mul(3));
    tei.ran_large(&outcome, rows, bound).await
}

#[derive(Serialize)]
struct SparseValue {
    index: usize,
    value: f32,
}

/// `POST /embed_sparse`: SPLADE vectors as their non-zero entries.
pub async fn embed_sparse(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: SparseRequest = tei.open(Needs::Splade, "/embed_sparse", body)?;
    let threshold = request.threshold.unwrap_or(0.0);
    if !threshold.is_finite() || threshold < 0.0 {
        return Err(ApiError::BadRequest(format!("'threshold' is {threshold}; it must be 0 or more")));
    }
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        normalize: Some(false),
        prompt_name: request.prompt_name,
        ..Options::default()
    };
    let outcome = tei.run_texts(request.inputs, options).await?;
    let Rows::Embeddings(rows) = &outcome.rows else { unreachable!("embedding models return embeddings") };
    let rows: Vec<Vec<SparseValue>> = rows
        .iter()
        .map(|row| {
            sparse(row, threshold, request.top_k)
                .into_iter()
                .map(|(index, value)| SparseValue { index, value })
                .collect()
        })
        .collect();
    // Each entry `{"index":N,"value":F},` (N has at most 20 digits), and each list's brackets.
    let entries = rows.iter().map(Vec::len).sum::<usize>() as u64;
    let bound = entries
        .saturating_mul(tasks::JSON_F32_BYTES.saturating_add(40))
        .saturating_add((rows.len() as u64).saturating_mul(3).saturating_add(2));
    tei.ran_large(&outcome, rows, bound).await
}

/// `POST /similarity` (sentence-transformers' sentence similarity): the cosine similarity of
/// `source_sentence` to each of `sentences`, in their order.
pub async fn similarity(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: SimilarityRequest = tei.open(Needs::Embedding, "/similarity", body)?;
    if request.inputs.sentences.is_empty() {
        return Err(ApiError::BadRequest("'inputs.sentences' is an empty list".into()));
    }
    let texts =
        std::iter::once(request.inputs.source_sentence).chain(request.inputs.sentences).map(Text::Single).collect();
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        normalize: Some(true),
        ..Options::default()
    };
    let outcome = tei.run(PipelineInput::Texts(texts), options).await?;
    let Rows::Embeddings(rows) = &outcome.rows else { unreachable!("embedding models return embeddings") };
    let scores: Vec<f32> = rows[1..].iter().map(|r| r.iter().zip(&rows[0]).map(|(a, b)| a * b).sum()).collect();
    Ok(ran(serde_json::to_vec(&scores).expect("floats serialise"), &outcome))
}
