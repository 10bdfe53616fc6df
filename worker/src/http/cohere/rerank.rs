//! Cohere's rerank API, the one LangChain, LlamaIndex, Haystack, Dify and Open WebUI call
//! rerankers through: `POST /v1/rerank` (Cohere's v1, which is also Jina's shape) and
//! `POST /v2/rerank`, for cross-encoders (a classification model with one label, as TEI's
//! `/rerank`; the score is the sigmoid of its logit).
//!
//! - `model`: a cross-encoder this server serves; any other name (a client's default such as
//!   `rerank-v3.5`) means the first cross-encoder it serves, and the answer's `model` says
//!   which one answered.
//! - `query`; `documents`: texts, or objects with a `text`. v1 keeps an object's other fields
//!   and returns them with `return_documents`; its `rank_fields` names the fields scored, in
//!   order, read as `field: value` lines.
//! - `top_n` (default: every document), `return_documents` (default false, as Cohere's; Jina's
//!   clients send it).
//! - A document that does not fit the model beside the query is scored in windows of the tokens
//!   that do, and its score is its best window's (as Cohere's chunking does): at most
//!   `max_chunks_per_doc` windows (v1, default 10), or the first `max_tokens_per_doc` tokens
//!   (v2, default 4096). Every window is one input of the batch, so the windows of a request
//!   count against server.max_batch_inputs (413 past it).
//! - `priority` (v2): a whole number, 0 the highest, as `x-inferd-priority` (which it
//!   overrides): the worker's lanes take higher-priority work first (runtime/engine).
//! - The answer: `{"id", "results": [{"index", "relevance_score", "document"?}], "meta":
//!   {"api_version", "billed_units"}}`, best first, with Jina's `model` and `usage` beside.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::{bad, Fields, Version};
use crate::http::reply::{ran, Reply};
use crate::pipeline::{Side, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, PipelineInput, Rows};

/// Cohere's defaults: windows per document (v1), tokens per document (v2).
const MAX_CHUNKS_PER_DOC: usize = 10;
const MAX_TOKENS_PER_DOC: usize = 4096;
/// A query must leave at least this many of the model's tokens to the document.
const MIN_WINDOW: usize = 16;

/// The request, checked field by field so that each mistake names its field.
pub struct Request {
    /// The model asked for, if any.
    pub model: Option<String>,
    query: String,
    /// Each document: the text scored, and what is returned as its `document`.
    documents: Vec<(String, Value)>,
    top_n: Option<usize>,
    return_documents: bool,
    /// Windows of a long document at most.
    max_windows: Option<usize>,
    /// Tokens of a document read at most.
    max_tokens: usize,
    /// v2's `priority` (0 the highest; above 255 counts as 255).
    pub priority: Option<u8>,
}

pub fn parse(body: &[u8], version: Version) -> Result<Request, ApiError> {
    let fields = Fields::of(body)?;
    let given = |name: &str| fields.given(name);
    let model = fields.model()?;
    let query = match given("query") {
        Some(Value::String(q)) if !q.is_empty() => q.clone(),
        Some(Value::String(_)) => return Err(ApiError::Empty("'query' is empty".into())),
        Some(_) => return Err(bad("'query' must be a string".into())),
        None => return Err(bad("missing 'query'".into())),
    };
    let rank_fields = match (given("rank_fields"), version) {
        (None, _) => None,
        (Some(Value::Array(names)), Version::V1) if !names.is_empty() => Some(
            names
                .iter()
                .map(|n| n.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| bad("'rank_fields' must be a list of field names".into()))?,
        ),
        (Some(_), Version::V1) => return Err(bad("'rank_fields' must be a list of field names".into())),
        (Some(_), Version::V2) => return Err(bad("'rank_fields' is not part of v2 rerank; use /v1/rerank".into())),
    };
    let documents = match given("documents") {
        Some(Value::Array(documents)) if !documents.is_empty() => documents
            .iter()
            .enumerate()
            .map(|(i, d)| document(i, d, version, rank_fields.as_deref()))
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => return Err(bad("'documents' is an empty list".into())),
        Some(_) => return Err(bad("'documents' must be a list of texts or of objects with a 'text'".into())),
        None => return Err(bad("missing 'documents'".into())),
    };
    let return_documents = match given("return_documents") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("'return_documents' must be true or false".into())),
    };
    let priority = fields.priority()?;
    let (max_windows, max_tokens) = match version {
        Version::V1 => (Some(fields.count("max_chunks_per_doc", 1)?.unwrap_or(MAX_CHUNKS_PER_DOC)), usize::MAX),
        Version::V2 => (None, fields.count("max_tokens_per_doc", 1)?.unwrap_or(MAX_TOKENS_PER_DOC)),
    };
    let top_n = fields.count("top_n", 1)?;
    Ok(Request { model, query, documents, top_n, return_documents, max_windows, max_tokens, priority })
}

/// Document `i`: its text to score, and its `document` in the answer.
fn document(
    i: usize,
    value: &Value,
    version: Version,
    rank_fields: Option<&[String]>,
) -> Result<(String, Value), ApiError> {
    let text = match (value, rank_fields) {
        (Value::String(text), _) => return Ok((text.clone(), json!({ "text": text }))),
        (Value::Object(_), _) if version == Version::V2 => {
            return Err(bad(format!("'documents[{i}]' must be a text: v2 rerank takes documents as texts")))
        }
        (Value::Object(fields), None) => match fields.get("text") {
            Some(Value::String(text)) => text.clone(),
            _ => {
                return Err(bad(format!(
                    "'documents[{i}]' has no 'text' (or name the fields to read in 'rank_fields')"
                )))
            }
        },
        (Value::Object(fields), Some(names)) => {
            let mut lines = Vec::with_capacity(names.len());
            for name in names {
                match fields.get(name) {
                    Some(Value::String(v)) => lines.push(format!("{name}: {v}")),
                    Some(Value::Null) | None => {}
                    Some(v) => lines.push(format!("{name}: {v}")),
                }
            }
            lines.join("\n")
        }
        _ => return Err(bad(format!("'documents[{i}]' must be a text or an object with a 'text'"))),
    };
    Ok((text, value.clone()))
}

/// The model a request names when it serves it as a cross-encoder, else the first
/// cross-encoder it serves.
pub async fn model_for(state: &AppState, call: &Call, name: Option<&str>) -> Result<(usize, Arc<Model>), ApiError> {
    let fits = |m: &Model| m.cross_encoder("rerank").map(|_| ());
    let missing = "no cross-encoder (a classification model with one label) is loaded to rerank with";
    super::model_for(state, call, name, fits, missing).await
}

/// Scores every document against the query (in windows where it is long) and answers the
/// best `top_n`.
pub async fn rerank(
    state: &AppState,
    call: &Call,
    (index, meta): (usize, &Model),
    request: Request,
    version: Version,
) -> Result<Reply, ApiError> {
    let pipeline = meta.cross_encoder("rerank")?;
    let query_tokens = pipeline.count_tokens(0, &request.query)?;
    let window = pipeline.max_length.saturating_sub(query_tokens).saturating_sub(pipeline.special_tokens(true));
    if window < MIN_WINDOW {
        return Err(ApiError::TooLarge(format!(
            "the query has {query_tokens} tokens, leaving {window} of the model's {} to each document (at least {MIN_WINDOW} are needed)",
            pipeline.max_length
        )));
    }
    // Each document in windows: which document each input is.
    let mut pairs = Vec::new();
    let mut owner = Vec::new();
    for (i, (text, _)) in request.documents.iter().enumerate() {
        let limit = request.max_windows.unwrap_or_else(|| request.max_tokens.div_ceil(window));
        let windows = match text.is_empty() {
            true => vec![String::new()],
            false => {
                pipeline.windows(i, text, window, 0, (limit, request.max_tokens))?.into_iter().map(|(w, _)| w).collect()
            }
        };
        tasks::within_limit(state, pairs.len().saturating_add(windows.len())).map_err(|_| {
            ApiError::TooLarge(format!(
                "the documents make more than {} inputs (long ones are scored in windows of {window} tokens); the limit is server.max_batch_inputs",
                state.max_batch_inputs
            ))
        })?;
        for w in windows {
            pairs.push(Text::Pair(request.query.clone(), w));
            owner.push(i);
        }
    }
    let windows = pairs.len();
    // Truncation on: a window cut at token offsets may tokenize a token longer on its own.
    let options = Options { truncate: Some(Side::Right), raw_scores: true, ..Options::default() };
    let outcome = tasks::run_pipeline(state, call, index, meta, PipelineInput::Texts(pairs), options).await?;
    let Rows::Scores { scores, .. } = &outcome.rows else { unreachable!("classifiers return scores") };
    let mut best = vec![f32::NEG_INFINITY; request.documents.len()];
    for (row, &doc) in scores.iter().zip(&owner) {
        let logit = row.first().copied().unwrap_or(f32::NAN);
        best[doc] = best[doc].max(logit);
    }
    let mut ranked: Vec<(usize, f32)> =
        best.into_iter().enumerate().map(|(i, logit)| (i, 1.0 / (1.0 + (-logit).exp()))).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(request.top_n.unwrap_or(usize::MAX));
    let results: Vec<Value> = ranked
        .iter()
        .map(|&(i, score)| {
            let mut result = Map::new();
            result.insert("index".into(), i.into());
            result.insert("relevance_score".into(), f64::from(score).into());
            if request.return_documents {
                result.insert("document".into(), request.documents[i].1.clone());
            }
            Value::Object(result)
        })
        .collect();
    let body = json!({
        "id": call.id,
        "results": results,
        "meta": {
            "api_version": {"version": version.number()},
            // Cohere bills a search unit per 100 documents (a long one counting per window).
            "billed_units": {"search_units": windows.div_ceil(100), "input_tokens": outcome.tokens},
        },
        "model": meta.info.name,
        "usage": {"total_tokens": outcome.tokens},
    });
    Ok(ran(serde_json::to_vec(&body).expect("json"), &outcome))
}
