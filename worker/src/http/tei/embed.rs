//! TEI's embedding routes: `/embed`, `/embed_all`, `/embed_sparse` and `/similarity`; and
//! inferd's `/embed_chunks` (late chunking).
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use serde::Serialize;

use crate::http::reply::{ran, Reply};
use crate::http::tei::bodies::{ChunkBy, ChunksRequest, EmbedRequest, EncodeRequest, SimilarityRequest, SparseRequest};
use crate::http::tei::open::{Inference, Needs};
use crate::pipeline::late::{self, Rule};
use crate::pipeline::{cut_dimensions, l2_normalize, sparse, Head, Pipeline, Text};
use crate::request::error::ApiError;
use crate::request::tasks::{self, Options, PipelineInput, Rows};
use inferd_config::model::Pooling;

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

/// `POST /encode` (BGE-M3, `pooling = "bge_m3"`): FlagEmbedding's `encode` from one run:
/// `{"inputs", "return_dense": true, "return_sparse": false, "return_colbert_vecs": false}`
/// -> `{"dense_vecs": [[...]], "lexical_weights": [{"id": weight}], "colbert_vecs": [[[...]]]}`,
/// each key where asked. Texts are cut at the model's length, as FlagEmbedding cuts them.
pub async fn encode(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: EncodeRequest = tei.open(Needs::BgeM3, "/encode", body)?;
    if !(request.return_dense || request.return_sparse || request.return_colbert_vecs) {
        return Err(ApiError::BadRequest(
            "return_dense, return_sparse and return_colbert_vecs are all false: ask for one or more".into(),
        ));
    }
    let (texts, _) = request.inputs.into_vec();
    let texts: Vec<Text> = texts.into_iter().map(Into::into).collect();
    // Bounded before the run, before it is tokenized: a text has at most its bytes' worth of
    // tokens beside its special tokens, and at most the model's length.
    let asked = (request.return_dense, request.return_sparse, request.return_colbert_vecs);
    if let Pipeline::Text(p) = &*tei.meta.pipeline {
        let bound = texts
            .iter()
            .map(|t| {
                let tokens = t.bytes().saturating_add(p.special_tokens(false)).min(p.max_length);
                p.bge_m3.as_ref().map_or(0, |m3| m3.answer_bound(tokens, asked))
            })
            .fold(64u64, u64::saturating_add);
        if bound > tei.state.body_budget_total {
            return Err(ApiError::TooLarge(format!(
                "the answer to {} texts would take up to {bound} bytes, more than a worker holds at once \
                 (server.max_body_bytes_in_flight = {}); send fewer or shorter texts, or fewer outputs",
                texts.len(),
                tei.state.body_budget_total
            )));
        }
    }
    let mut outcome = tasks::run_bge_m3(tei.state, tei.call, tei.index, tei.meta, texts).await?;
    let Rows::BgeM3(rows) = std::mem::replace(&mut outcome.rows, Rows::BgeM3(Vec::new())) else {
        unreachable!("BGE-M3 answers its three outputs")
    };
    // The same bound, of the tokens each text had.
    let bound = match &*tei.meta.pipeline {
        Pipeline::Text(p) => p.bge_m3.as_ref().map_or(0, |m3| {
            rows.iter().map(|r| m3.answer_bound(r.colbert.len().saturating_add(1), asked)).fold(64, u64::saturating_add)
        }),
        _ => 0,
    };
    let answer = EncodeAnswer {
        dense_vecs: request.return_dense.then(|| rows.iter().map(|r| r.dense.clone()).collect()),
        lexical_weights: request.return_sparse.then(|| rows.iter().map(|r| Weights(r.lexical.clone())).collect()),
        colbert_vecs: request.return_colbert_vecs.then(|| rows.into_iter().map(|r| r.colbert).collect()),
    };
    tei.ran_large(&outcome, answer, bound).await
}

/// `/encode`'s answer, FlagEmbedding's keys (a lexical weight's key is its token id, as text).
#[derive(Serialize)]
struct EncodeAnswer {
    #[serde(skip_serializing_if = "Option::is_none")]
    dense_vecs: Option<Vec<Vec<f32>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lexical_weights: Option<Vec<Weights>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    colbert_vecs: Option<Vec<Vec<Vec<f32>>>>,
}

/// One text's lexical weights as a JSON object, in the order the ids first came.
struct Weights(Vec<(u32, f32)>);

impl Serialize for Weights {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(id, w)| (id.to_string(), w)))
    }
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

/// One chunk of `/embed_chunks`' answer: its character span, the tokens it covers and its
/// embedding.
#[derive(Serialize)]
struct ChunkAnswer {
    start: usize,
    end: usize,
    tokens: usize,
    embedding: Vec<f32>,
}

/// `POST /embed_chunks`: the text runs once, within the model's length; each chunk is pooled
/// from the token states of the whole text ([`late`]), then the model's Dense layers and
/// normalisation, as `/embed` does for a whole text.
pub async fn embed_chunks(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: ChunksRequest = tei.open(Needs::Embedding, "/embed_chunks", body)?;
    let name = &tei.meta.info.name;
    let (Pipeline::Text(pipeline), Some(Head::Embedding { settings, dense, .. })) =
        (&*tei.meta.pipeline, tei.meta.pipeline.head())
    else {
        return Err(ApiError::BadRequest(format!("/embed_chunks needs a model of texts; '{name}' takes images")));
    };
    let max = match settings.pooling {
        Pooling::Mean => false,
        Pooling::Max => true,
        other => {
            return Err(ApiError::BadRequest(format!(
                "/embed_chunks pools a chunk's token states by their mean (or max, for a model that pools so); \
                 model '{name}' pools by {other:?}, so its token states are not made to be pooled"
            )))
        }
    };
    let rule = match (request.chunks, request.chunk_by, request.chunk_tokens) {
        (Some(spans), None, None) => Rule::Spans(spans),
        (None, Some(ChunkBy::Sentence), None) => Rule::Sentences,
        (None, None, Some(n)) if n > 0 => Rule::Tokens(n),
        (None, None, Some(_)) => return Err(ApiError::BadRequest("'chunk_tokens' must be at least 1".into())),
        _ => {
            return Err(ApiError::BadRequest(
                "give exactly one of 'chunks' (character spans [start, end)), 'chunk_by': \"sentence\" or \
                 'chunk_tokens': n"
                    .into(),
            ))
        }
    };
    if request.inputs.is_empty() {
        return Err(ApiError::Empty("'inputs' is empty".into()));
    }
    // The text as the model reads it (its prompt first), tokenized with its offsets: which
    // tokens each chunk covers.
    let prompt = settings.prompt(request.prompt_name.as_deref()).map_err(ApiError::BadRequest)?.unwrap_or_default();
    let pieces = pipeline.tokenize(0, &Text::Single(format!("{prompt}{}", request.inputs)), true)?;
    if pieces.len() > pipeline.max_length {
        return Err(ApiError::TooLarge(format!(
            "the text has {} tokens with the model's special tokens; /embed_chunks reads it whole, and model '{name}' \
             takes {}",
            pieces.len(),
            pipeline.max_length
        )));
    }
    let chunks = late::chunks(&request.inputs, prompt.len(), &pieces, &rule).map_err(ApiError::BadRequest)?;
    let options = Options { tokens: true, prompt_name: request.prompt_name, ..Options::default() };
    let outcome = tei.run(PipelineInput::Texts(vec![Text::Single(request.inputs)]), options).await?;
    let Rows::Tokens(rows) = &outcome.rows else { unreachable!("asked for token embeddings") };
    let states = rows.first().map(Vec::as_slice).unwrap_or_default();
    let width = states.first().map_or(0, Vec::len);
    if states.len() != pieces.len() || dense.inputs().is_some_and(|w| w != width) {
        return Err(ApiError::Internal(format!(
            "model '{name}' gave {} token states of {width} values for {} tokens",
            states.len(),
            pieces.len()
        )));
    }
    let normalize = request.normalize.unwrap_or(settings.normalize);
    let answer: Vec<ChunkAnswer> = chunks
        .into_iter()
        .map(|chunk| {
            let mut embedding = dense.apply(late::pool(states, chunk.tokens.clone(), max));
            if normalize {
                l2_normalize(&mut embedding);
            }
            ChunkAnswer { start: chunk.start, end: chunk.end, tokens: chunk.tokens.len(), embedding }
        })
        .collect();
    Ok(ran(serde_json::to_vec(&answer).expect("floats serialise"), &outcome))
}
