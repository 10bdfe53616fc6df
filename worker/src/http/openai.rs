//! OpenAI-compatible embeddings, so the `openai` client and what is built on it (LangChain's
//! `OpenAIEmbeddings`, LlamaIndex) work with a changed base URL:
//! `POST /v1/embeddings` (and `/embeddings`).
//!
//! - `input`: a text, a list of texts, a list of token ids or a list of such lists. Token ids
//!   are the model's own vocabulary, fed as they are (no special tokens added).
//! - `model`: a model this server loads; any other name (a client's default such as
//!   `text-embedding-3-small`) means the default model, and the answer's `model` says which
//!   one answered.
//! - `encoding_format`: `float` (default) or `base64` (little-endian f32, what the `openai`
//!   client asks for when numpy is installed).
//! - `dimensions`: fewer dimensions, for models trained for it (`matryoshka = true` in
//!   model.toml's [embedding]); the prefix is normalised again.
//! - `truncate` (inferd's own): cut texts at the model's limit instead of refusing them.
//! - `is_query` (PyLate's server): for a ColBERT model (`pooling = "colbert"`), whether the
//!   texts are queries (the default) or documents; each `embedding` is then a list of vectors,
//!   one per kept token, as PyLate's server answers. Refused for other models.
//!
//! Errors come in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use base64::Engine as _;
use serde_json::{json, Value};

use crate::http::reply::{annotate, large_json, ran, Reply};
use crate::pipeline::colbert::Role;
use crate::pipeline::{cut_dimensions, Head, Pipeline, Side, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, PipelineInput, Rows, JSON_F32_BYTES};
use inferd_config::model::Pooling;

/// The request, checked field by field so that each mistake names its field.
pub struct Request {
    texts: Vec<Text>,
    /// The model asked for, if any.
    pub model: Option<String>,
    base64: bool,
    dimensions: Option<usize>,
    truncate: bool,
    /// PyLate's `is_query`, where given.
    is_query: Option<bool>,
}

pub fn parse(body: &[u8]) -> Result<Request, ApiError> {
    let bad = |m: String| ApiError::BadRequest(m);
    let value: Value = serde_json::from_slice(body).map_err(|e| bad(format!("request body: {e}")))?;
    let Value::Object(fields) = value else { return Err(bad("the request body must be a JSON object".into())) };
    let texts = inputs(fields.get("input").ok_or_else(|| bad("missing 'input'".into()))?)?;
    let model = match fields.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) => Some(name.clone()),
        Some(_) => return Err(bad("'model' must be a string".into())),
    };
    let base64 = match fields.get("encoding_format").filter(|v| !v.is_null()) {
        None => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(other) => return Err(bad(format!("'encoding_format' must be \"float\" or \"base64\", not {other}"))),
    };
    let dimensions = match fields.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(d) if d > 0 => Some(d as usize),
            _ => return Err(bad(format!("'dimensions' must be a positive whole number, not {v}"))),
        },
    };
    let truncate = match fields.get("truncate") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("'truncate' must be true or false".into())),
    };
    let is_query = match fields.get("is_query") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(other) => return Err(bad(format!("'is_query' must be true or false, not {other}"))),
    };
    Ok(Request { texts, model, base64, dimensions, truncate, is_query })
}

/// `input` as texts or token-id lists.
fn inputs(input: &Value) -> Result<Vec<Text>, ApiError> {
    let shape = "'input' must be a text, a list of texts, a list of token ids or a list of lists of token ids";
    let ids = |list: &[Value]| -> Option<Vec<u32>> {
        list.iter().map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok())).collect()
    };
    match input {
        Value::String(text) => Ok(vec![Text::Single(text.clone())]),
        Value::Array(items) if items.is_empty() => Err(ApiError::BadRequest("'input' is an empty list".into())),
        Value::Array(items) if items.iter().all(Value::is_string) => {
            Ok(items.iter().map(|v| Text::Single(v.as_str().unwrap_or_default().to_string())).collect())
        }
        Value::Array(items) if items.iter().all(Value::is_number) => ids(items)
            .map(|ids| vec![Text::Ids(ids)])
            .ok_or_else(|| ApiError::BadRequest(format!("{shape}: token ids are whole numbers from 0"))),
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                ids(v.as_array().map_or(&[][..], Vec::as_slice))
                    .map(Text::Ids)
                    .ok_or_else(|| ApiError::BadRequest(format!("{shape}: input {i} is not a list of token ids")))
            })
            .collect(),
        _ => Err(ApiError::BadRequest(shape.into())),
    }
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    state: &AppState,
    call: &Call,
    (index, meta): (usize, &Model),
    request: Request,
) -> Result<Reply, ApiError> {
    let Some(Head::Embedding { settings, .. }) = meta.pipeline.head() else {
        return Err(ApiError::BadRequest(format!(
            "model '{}' is not an embedding model; /v1/embeddings needs one",
            meta.info.name
        )));
    };
    if settings.pooling == Pooling::Colbert {
        return multi_vector(state, call, (index, meta), request).await;
    }
    if request.is_query.is_some() {
        return Err(ApiError::BadRequest(format!(
            "'is_query' is for ColBERT models (pooling = \"colbert\"); model '{}' gives one vector per text",
            meta.info.name
        )));
    }
    let (normalize, matryoshka) = (settings.normalize, settings.matryoshka);
    let options =
        Options { truncate: request.truncate.then_some(Side::Right), normalize: Some(normalize), ..Options::default() };
    let mut outcome =
        tasks::run_pipeline(state, call, index, meta, PipelineInput::Texts(request.texts), options).await?;
    let Rows::Embeddings(rows) = &mut outcome.rows else { unreachable!("embedding models return embeddings") };
    if let Some(wanted) = request.dimensions {
        let full = rows.first().map_or(0, Vec::len);
        if wanted > full {
            return Err(ApiError::BadRequest(format!(
                "'dimensions' is {wanted}, but model '{}' gives {full}",
                meta.info.name
            )));
        }
        if wanted < full && !matryoshka {
            return Err(ApiError::BadRequest(format!(
                "model '{}' gives {full} dimensions and is not trained to give fewer ([embedding] matryoshka = false in \
                 its model.toml); leave out 'dimensions' or ask for {full}",
                meta.info.name
            )));
        }
        cut_dimensions(rows, wanted, normalize);
    }
    let data: Vec<Value> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let embedding = match request.base64 {
                true => {
                    let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                false => json!(row),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let body = json!({
        "object": "list",
        "data": data,
        "model": meta.info.name,
        "usage": {"prompt_tokens": outcome.tokens, "total_tokens": outcome.tokens},
    });
    Ok(ran(serde_json::to_vec(&body).expect("json"), &outcome))
}

/// A ColBERT model's answer, as PyLate's server gives it: per text, the vector of each token
/// it keeps. Bounded before the model runs, from the most tokens a text keeps and the width of
/// a vector, in the worker's byte budget ([`large_json`]).
async fn multi_vector(
    state: &AppState,
    call: &Call,
    (index, meta): (usize, &Model),
    request: Request,
) -> Result<Reply, ApiError> {
    let name = &meta.info.name;
    let refused = |field: &str, why: &str| {
        Err(ApiError::BadRequest(format!("'{field}' {why}: model '{name}' gives a vector per token (ColBERT)")))
    };
    if request.base64 {
        return refused("encoding_format", "must be \"float\"");
    }
    if request.dimensions.is_some() {
        return refused("dimensions", "cannot be asked");
    }
    let texts = request
        .texts
        .into_iter()
        .map(|t| match t {
            Text::Single(s) => Ok(s),
            _ => Err(ApiError::BadRequest(format!(
                "'input' must be texts: model '{name}' tokenizes them its own way (ColBERT)"
            ))),
        })
        .collect::<Result<Vec<String>, ApiError>>()?;
    let role = if request.is_query.unwrap_or(true) { Role::Query } else { Role::Document };
    let (Pipeline::Text(p), Some(Head::Embedding { dense, .. })) = (&*meta.pipeline, meta.pipeline.head()) else {
        unreachable!("ColBERT models are text embedders")
    };
    let tokens = p.colbert.as_ref().map_or(0, |c| c.length(role));
    let width = dense.outputs().or_else(|| {
        let spec = meta.outputs.get(meta.pipeline.head().map_or(0, Head::output))?;
        spec.shape.last().and_then(|&d| usize::try_from(d).ok())
    });
    // Each float, and each vector's brackets and comma; the texts' and the envelope's own.
    let per_text =
        width.map(|w| (tokens as u64).saturating_mul((w as u64).saturating_mul(JSON_F32_BYTES).saturating_add(3)));
    let bound = per_text.map(|b| b.saturating_add(80).saturating_mul(texts.len() as u64).saturating_add(200));
    if let Some(bound) = bound.filter(|&b| b > state.body_budget_total) {
        return Err(ApiError::TooLarge(format!(
            "{} texts of up to {tokens} vectors of {} values would take up to {bound} bytes, more than a worker holds \
             at once (server.max_body_bytes_in_flight = {}); send fewer texts",
            texts.len(),
            width.unwrap_or_default(),
            state.body_budget_total
        )));
    }
    let mut outcome = tasks::run_colbert(state, call, index, meta, texts, role).await?;
    let Rows::Tokens(rows) = std::mem::replace(&mut outcome.rows, Rows::Tokens(Vec::new())) else {
        unreachable!("ColBERT answers token vectors")
    };
    let floats: usize = rows.iter().flatten().map(Vec::len).sum();
    let vectors: usize = rows.iter().map(Vec::len).sum();
    let written = (floats as u64)
        .saturating_mul(JSON_F32_BYTES)
        .saturating_add((vectors as u64).saturating_mul(3))
        .saturating_add((rows.len() as u64).saturating_mul(80))
        .saturating_add(200);
    let body = MultiVectors {
        object: "list",
        data: rows
            .into_iter()
            .enumerate()
            .map(|(index, embedding)| Item { object: "embedding", index, embedding })
            .collect(),
        model: name.clone(),
        usage: Usage { prompt_tokens: outcome.tokens, total_tokens: outcome.tokens },
    };
    let mut reply = large_json(state, body, written).await?;
    annotate(&mut reply, &outcome);
    Ok(reply)
}

/// [`multi_vector`]'s answer, written straight from its vectors.
#[derive(serde::Serialize)]
struct MultiVectors {
    object: &'static str,
    data: Vec<Item>,
    model: String,
    usage: Usage,
}

#[derive(serde::Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Vec<Vec<f32>>,
}

#[derive(serde::Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

/// An error in OpenAI's shape.
pub fn error_body(e: &ApiError) -> Value {
    let kind = if e.status().is_server_error() { "server_error" } else { "invalid_request_error" };
    let code = match e {
        ApiError::Unauthorized(_) => Some("invalid_api_key"),
        ApiError::TooManyRequests(..) => Some("rate_limit_exceeded"),
        _ => None,
    };
    json!({"error": {"message": e.to_string(), "type": kind, "param": null, "code": code}})
}
