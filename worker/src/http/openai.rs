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
//!
//! Errors come in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use base64::Engine as _;
use serde_json::{json, Value};

use crate::http::reply::{ran, Reply};
use crate::pipeline::{cut_dimensions, Head, Side, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, PipelineInput, Rows};

/// The request, checked field by field so that each mistake names its field.
pub struct Request {
    texts: Vec<Text>,
    /// The model asked for, if any.
    pub model: Option<String>,
    base64: bool,
    dimensions: Option<usize>,
    truncate: bool,
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
    Ok(Request { texts, model, base64, dimensions, truncate })
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
