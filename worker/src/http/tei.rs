//! Endpoints compatible with Hugging Face text-embeddings-inference, so its clients work
//! unchanged: `POST /embed` and `POST /predict` (the default model), and the same under
//! `/v2/models/{name}/` for any model.
//!
//! - `/embed`: `{"inputs": "text" | ["t1", ...], "normalize": true, "truncate": false}` ->
//!   `[[f32, ...], ...]`, one vector per input.
//! - `/predict` (text): `{"inputs": ..., "raw_scores": false, "truncate": false, "top_k": n}`
//!   where inputs is a text, a pair `["a", "b"]` (as TEI reads a two-element list), or a list
//!   of texts and pairs -> `[{"label", "score"}, ...]` best first, or a list of those for a
//!   list input.
//! - `/predict` (image): `{"image_b64": "<base64 PNG/JPEG>" | [...], "top_k": n}` -> the same.
//! - `/similarity`: `{"inputs": {"source_sentence": "a", "sentences": ["b", ...]}}` -> cosine
//!   similarities `[f32, ...]`.
//! - `/rerank` (cross-encoders: a classification model with one label): `{"query": "q",
//!   "texts": [...], "raw_scores", "return_text", "truncate"}` -> `[{"index", "score"}, ...]`
//!   best first.
//! - `/embed_all`: the same body as `/embed` -> `[[[f32, ...], ...], ...]`, every token's vector.
//! - `/embed_sparse` (`pooling = "splade"`): `{"inputs", "truncate", "prompt_name"}`, and
//!   inferd's own `"top_k"` and `"threshold"` -> `[[{"index", "value"}, ...], ...]`, the
//!   non-zero entries (above the threshold, the top k of them) in index order.
//! - `GET /info`, `POST /tokenize`, `POST /decode`: the default model and its tokenizer.
//! - `POST /` and `POST /invocations` (SageMaker): `/embed` or `/predict`, by the default
//!   model's task; `GET /ping` answers like `/v2/health/ready`.
//!
//! Errors carry TEI's `error_type` beside the message.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::http::reply::{annotate, json_reply, large_json, ran, Reply};
use crate::jsonbody::{self, OneOrMany, Shape};
use crate::pipeline::{cut_dimensions, ranked, sparse, Head, Pipeline, Text, TextPipeline};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, Outcome, PipelineInput, Rows};
use inferd_config::model::{Pooling, Task};

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct EmbedRequest {
    inputs: OneOrMany<String>,
    /// One of the model's `[embedding.prompts]`, put before every input.
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default)]
    normalize: Option<bool>,
    #[serde(default)]
    truncate: bool,
    /// `/embed`: the first this many values of each embedding (TEI's Matryoshka), normalised
    /// after the cut when the embeddings are.
    #[serde(default)]
    dimensions: Option<usize>,
}

/// A text, or a pair of texts (`["query", "passage"]`).
enum Sequence {
    Single(String),
    Pair(String, String),
}

impl Shape for Sequence {
    const EXPECTED: &'static str = "a text or a pair of texts";
    const PLURAL: &'static str = "texts and pairs of texts";
    fn fits(value: &Value) -> bool {
        match value {
            Value::String(_) => true,
            Value::Array(pair) => pair.len() == 2 && pair.iter().all(Value::is_string),
            _ => false,
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(text) => Sequence::Single(text),
            Value::Array(pair) => {
                let mut texts = pair.into_iter().map(String::take);
                match (texts.next(), texts.next()) {
                    (Some(a), Some(b)) => Sequence::Pair(a, b),
                    _ => unreachable!("fits"),
                }
            }
            _ => unreachable!("fits"),
        }
    }
}

impl From<Sequence> for Text {
    fn from(s: Sequence) -> Text {
        match s {
            Sequence::Single(t) => Text::Single(t),
            Sequence::Pair(a, b) => Text::Pair(a, b),
        }
    }
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct PredictRequest {
    #[serde(default)]
    inputs: Option<OneOrMany<Sequence>>,
    #[serde(default)]
    image_b64: Option<OneOrMany<String>>,
    #[serde(default)]
    raw_scores: bool,
    #[serde(default)]
    truncate: bool,
    #[serde(default)]
    top_k: Option<usize>,
}

#[derive(Serialize)]
struct Prediction {
    label: String,
    score: f32,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    read(body).map_err(ApiError::BadRequest)
}

fn read<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    jsonbody::parse(body).map_err(|e| format!("request body: {e}"))
}

/// One TEI inference on the model its route found: what each inference route's handler is
/// given (its body beside).
#[derive(Clone, Copy)]
pub struct Inference<'a> {
    pub state: &'a AppState,
    pub call: &'a Call,
    /// The model's place among the worker's (its row in the engine).
    pub index: usize,
    pub meta: &'a Model,
}

/// What an inference route needs of its model, checked before its body is read.
#[derive(Clone, Copy)]
enum Needs {
    /// An embedding model (`/embed`, `/embed_all`, `/similarity`).
    Embedding,
    /// An embedding model with SPLADE pooling (`/embed_sparse`).
    Splade,
    /// A classification model (`/predict`).
    Classification,
    /// A cross-encoder (`/rerank`): a classification model, then one of one label
    /// ([`Model::cross_encoder`], the check Cohere's rerank makes too).
    CrossEncoder,
}

impl Inference<'_> {
    /// Every inference route's opening: the model checked for what `endpoint` needs, then the
    /// body read as the route's request.
    fn open<T: serde::de::DeserializeOwned>(&self, needs: Needs, endpoint: &str, body: &[u8]) -> Result<T, ApiError> {
        let meta = self.meta;
        match needs {
            Needs::Embedding => require(meta, Task::Embedding, endpoint)?,
            Needs::Splade => {
                require(meta, Task::Embedding, endpoint)?;
                let splade = matches!(meta.pipeline.head(), Some(Head::Embedding { settings, .. }) if settings.pooling == Pooling::Splade);
                if !splade {
                    return Err(ApiError::BadRequest(format!(
                        "{endpoint} needs a SPLADE model (pooling = \"splade\"); '{}' gives dense vectors: use /embed",
                        meta.info.name
                    )));
                }
            }
            Needs::Classification => require(meta, Task::Classification, endpoint)?,
            Needs::CrossEncoder => {
                require(meta, Task::Classification, endpoint)?;
                meta.cross_encoder(endpoint)?;
            }
        }
        parse(body)
    }

    /// Runs `input` through the model's pipeline with `options`.
    async fn run(&self, input: PipelineInput, options: Options) -> Result<Outcome, ApiError> {
        tasks::run_pipeline(self.state, self.call, self.index, self.meta, input, options).await
    }

    /// Runs texts, each on its own: what `/embed`, `/embed_all` and `/embed_sparse` run.
    async fn run_texts(&self, inputs: OneOrMany<String>, options: Options) -> Result<Outcome, ApiError> {
        let (texts, _) = inputs.into_vec();
        self.run(PipelineInput::Texts(texts.into_iter().map(Text::Single).collect()), options).await
    }

    /// A large answer ([`large_json`]: `bound` is what its JSON takes at most) with the headers
    /// that say how the pipeline ran.
    async fn ran_large<T: Serialize + Send + 'static>(
        &self,
        outcome: &Outcome,
        value: T,
        bound: u64,
    ) -> Result<Reply, ApiError> {
        let mut reply = large_json(self.state, value, bound).await?;
        annotate(&mut reply, outcome);
        Ok(reply)
    }
}

/// The model's task is `task`, or the refusal names the route that fits it.
fn require(meta: &Model, task: Task, endpoint: &str) -> Result<(), ApiError> {
    if meta.task == task {
        return Ok(());
    }
    let wanted = match task {
        Task::Embedding => "an embedding",
        Task::Classification => "a classification",
        Task::Raw => "a raw",
    };
    let other = match meta.task {
        Task::Embedding => "an embedding model; use /embed",
        Task::Classification => "a classification model; use /predict",
        Task::Raw => "a raw model (no pipeline); send tensors to /v2/models/NAME/infer",
    };
    Err(ApiError::BadRequest(format!("{endpoint} needs {wanted} model, but '{}' is {other}", meta.info.name)))
}

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
        truncate: request.truncate,
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
    let options =
        Options { truncate: request.truncate, tokens: true, prompt_name: request.prompt_name, ..Options::default() };
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

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct SparseRequest {
    inputs: OneOrMany<String>,
    #[serde(default)]
    truncate: bool,
    #[serde(default)]
    prompt_name: Option<String>,
    /// Only the k largest entries of each vector.
    #[serde(default)]
    top_k: Option<usize>,
    /// Only entries above this (default 0: every non-zero one).
    #[serde(default)]
    threshold: Option<f32>,
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
        truncate: request.truncate,
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

pub async fn predict(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: PredictRequest = tei.open(Needs::Classification, "/predict", body)?;
    let (input, listed) = match (request.inputs, request.image_b64) {
        (Some(inputs), None) => {
            let (seqs, listed) = inputs.into_vec();
            let texts = seqs.into_iter().map(Text::from).collect();
            (PipelineInput::Texts(texts), listed)
        }
        (None, Some(images)) => {
            let (encoded, listed) = images.into_vec();
            let images = encoded
                .iter()
                .enumerate()
                .map(|(i, b64)| {
                    base64::engine::general_purpose::STANDARD
                        .decode(b64.trim())
                        .map_err(|e| ApiError::BadRequest(format!("image_b64 {i} is not base64: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            (PipelineInput::Images(images), listed)
        }
        (Some(_), Some(_)) => return Err(ApiError::BadRequest("send either 'inputs' or 'image_b64', not both".into())),
        (None, None) => return Err(ApiError::BadRequest("missing 'inputs' (text) or 'image_b64' (image)".into())),
    };
    let options = Options { truncate: request.truncate, raw_scores: request.raw_scores, ..Options::default() };
    let outcome = tei.run(input, options).await?;
    let Rows::Scores { labels, scores } = &outcome.rows else { unreachable!("classifiers return scores") };
    let lists: Vec<Vec<Prediction>> = scores
        .iter()
        .map(|row| {
            ranked(labels, row, request.top_k).into_iter().map(|(label, score)| Prediction { label, score }).collect()
        })
        .collect();
    let body = if listed { serde_json::to_vec(&lists) } else { serde_json::to_vec(&lists[0]) };
    Ok(ran(body.expect("predictions serialise"), &outcome))
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct RerankRequest {
    query: String,
    texts: Vec<String>,
    #[serde(default)]
    truncate: bool,
    #[serde(default)]
    raw_scores: bool,
    #[serde(default)]
    return_text: bool,
}

#[derive(Serialize)]
struct Rank {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    score: f32,
}

/// `POST /rerank`: `{"query": "q", "texts": ["a", ...], "raw_scores": false, "return_text":
/// false, "truncate": false}` -> `[{"index", "score"[, "text"]}, ...]`, best first. The model
/// is a cross-encoder: a classification model with one label, run on each (query, text) pair;
/// the score is the sigmoid of its logit (the logit with `raw_scores`).
pub async fn rerank(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: RerankRequest = tei.open(Needs::CrossEncoder, "/rerank", body)?;
    if request.texts.is_empty() {
        return Err(ApiError::BadRequest("'texts' is an empty list".into()));
    }
    let pairs = request.texts.iter().map(|t| Text::Pair(request.query.clone(), t.clone())).collect();
    let options = Options { truncate: request.truncate, raw_scores: true, ..Options::default() };
    let outcome = tei.run(PipelineInput::Texts(pairs), options).await?;
    let Rows::Scores { scores, .. } = &outcome.rows else { unreachable!("classifiers return scores") };
    let mut ranks: Vec<Rank> = scores
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let logit = row.first().copied().unwrap_or(f32::NAN);
            Rank {
                index: i,
                text: request.return_text.then(|| request.texts[i].clone()),
                score: if request.raw_scores { logit } else { 1.0 / (1.0 + (-logit).exp()) },
            }
        })
        .collect();
    ranks.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(ran(serde_json::to_vec(&ranks).expect("ranks serialise"), &outcome))
}

/// text-embeddings-inference's error body: the message and its `error_type`.
pub fn error_body(e: &ApiError) -> serde_json::Value {
    let kind = match e {
        ApiError::Overloaded(_) | ApiError::TooManyRequests(..) => "Overloaded",
        ApiError::Unauthorized(_) => "Unauthorized",
        ApiError::Internal(_) | ApiError::Timeout(_) | ApiError::DeadlineExceeded(_) => "Backend",
        ApiError::Empty(_) => "Empty",
        _ => "Validation",
    };
    serde_json::json!({"error": e.to_string(), "error_type": kind})
}

fn text_pipeline<'a>(meta: &'a Model, endpoint: &str) -> Result<&'a TextPipeline, ApiError> {
    match &*meta.pipeline {
        Pipeline::Text(p) => Ok(p),
        _ => Err(ApiError::BadRequest(format!(
            "{endpoint} needs a text model, but '{}' has no tokenizer",
            meta.info.name
        ))),
    }
}

/// `GET /info`: what the default model is and the limits requests meet.
pub fn info(state: &AppState, meta: &Model) -> Reply {
    let model_type = match meta.pipeline.head() {
        Some(Head::Embedding { settings, .. }) => serde_json::json!({"embedding": {"pooling": settings.pooling}}),
        Some(Head::Classification { labels, .. }) => {
            let id2label: serde_json::Map<String, serde_json::Value> =
                labels.iter().enumerate().map(|(i, l)| (i.to_string(), l.clone().into())).collect();
            let label2id: serde_json::Map<String, serde_json::Value> =
                labels.iter().enumerate().map(|(i, l)| (l.clone(), i.into())).collect();
            serde_json::json!({"classifier": {"id2label": id2label, "label2id": label2id}})
        }
        None => serde_json::json!({"raw": {}}),
    };
    let max_input_length = match &*meta.pipeline {
        Pipeline::Text(p) => Some(p.max_length),
        _ => None,
    };
    let body = serde_json::json!({
        "model_id": meta.info.name,
        "model_sha": meta.info.sha256,
        "model_version": meta.info.version,
        "model_dtype": if matches!(meta.info.precision, inferd_ipc::spec::Precision::Int8 { .. }) { "int8" } else { "float32" },
        "served_model_name": meta.info.name,
        "model_type": model_type,
        "max_input_length": max_input_length,
        "max_batch_tokens": meta.batching.max_batch_tokens,
        "max_batch_requests": meta.batch_rows().ok(),
        "max_client_batch_size": state.max_batch_inputs,
        // Requests that may wait for this worker's model before more are refused at once
        // (server.max_queue), as TEI's limit refuses rather than queue.
        "max_concurrent_requests": state.engine.max_queue(),
        "auto_truncate": false,
        "tokenization_workers": 1,
        "version": inferd_ipc::version(),
    });
    json_reply(hyper::StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct TokenizeRequest {
    #[serde(deserialize_with = "jsonbody::read")]
    inputs: TokenizeInputs,
    #[serde(default = "yes")]
    add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

/// As TEI reads it: a text, or a list of texts; a pair is a list of two inside the list.
enum TokenizeInputs {
    One(String),
    Many(Vec<Sequence>),
}

impl Shape for TokenizeInputs {
    const EXPECTED: &'static str = "a text or a list of texts and pairs of texts";
    const PLURAL: &'static str = "such lists";
    fn fits(value: &Value) -> bool {
        match value {
            Value::String(_) => true,
            Value::Array(items) => items.iter().all(Sequence::fits),
            _ => false,
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(text) => TokenizeInputs::One(text),
            Value::Array(items) => TokenizeInputs::Many(items.into_iter().map(Sequence::take).collect()),
            _ => unreachable!("fits"),
        }
    }
}

/// `POST /tokenize`: `[[{"id", "text", "special", "start", "stop"}, ...], ...]`, one list per
/// input (a single text too), offsets in bytes of the text (of the second text for its tokens).
pub async fn tokenize(state: &AppState, meta: &Model, body: &[u8]) -> Result<Reply, ApiError> {
    let pipeline = text_pipeline(meta, "/tokenize")?;
    let request: TokenizeRequest = parse(body)?;
    let sequences = match request.inputs {
        TokenizeInputs::One(text) => vec![Sequence::Single(text)],
        TokenizeInputs::Many(list) => list,
    };
    tasks::within_limit(state, sequences.len())?;
    let lists = sequences
        .into_iter()
        .enumerate()
        .map(|(i, s)| pipeline.tokenize(i, &Text::from(s), request.add_special_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    // A token's object with its largest numbers, and its text escaped (at most 6 bytes each).
    let bound = lists.iter().flatten().map(|p| 112u64.saturating_add(6u64.saturating_mul(p.text.len() as u64)));
    let bound = bound.fold(2u64.saturating_mul(lists.len() as u64).saturating_add(2), u64::saturating_add);
    large_json(state, lists, bound).await
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct DecodeRequest {
    ids: OneOrMany<IdsOrId>,
    #[serde(default = "yes")]
    skip_special_tokens: bool,
}

enum IdsOrId {
    Id(u32),
    Ids(Vec<u32>),
}

/// A token id: a whole number that fits the tokenizer's u32.
fn token_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|id| u32::try_from(id).ok())
}

impl Shape for IdsOrId {
    const EXPECTED: &'static str = "a token id (a whole number from 0 to 4294967295) or a list of them";
    const PLURAL: &'static str = "token ids and lists of token ids";
    fn fits(value: &Value) -> bool {
        match value {
            Value::Array(ids) => ids.iter().all(|id| token_id(id).is_some()),
            id => token_id(id).is_some(),
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::Array(ids) => IdsOrId::Ids(ids.iter().filter_map(token_id).collect()),
            id => IdsOrId::Id(token_id(&id).expect("fits")),
        }
    }
}

/// `POST /decode`: `{"ids": [..] | [[..], ..], "skip_special_tokens": true}` -> a list of texts.
pub fn decode(state: &AppState, meta: &Model, body: &[u8]) -> Result<Reply, ApiError> {
    let pipeline = text_pipeline(meta, "/decode")?;
    let request: DecodeRequest = parse(body)?;
    // One list of ids, or a list of lists.
    let lists: Vec<Vec<u32>> = match request.ids {
        OneOrMany::One(IdsOrId::Ids(ids)) => vec![ids],
        OneOrMany::One(IdsOrId::Id(id)) => vec![vec![id]],
        OneOrMany::Many(items) => {
            let (ids, lists): (Vec<_>, Vec<_>) = items.into_iter().partition(|i| matches!(i, IdsOrId::Id(_)));
            let unwrap = |items: Vec<IdsOrId>| -> Vec<Vec<u32>> {
                items
                    .into_iter()
                    .map(|i| match i {
                        IdsOrId::Id(id) => vec![id],
                        IdsOrId::Ids(ids) => ids,
                    })
                    .collect()
            };
            match (ids.is_empty(), lists.is_empty()) {
                (false, false) => return Err(ApiError::BadRequest("'ids' mixes token ids and lists of them".into())),
                (false, true) => vec![unwrap(ids).concat()],
                _ => unwrap(lists),
            }
        }
    };
    tasks::within_limit(state, lists.len())?;
    let texts = lists
        .iter()
        .enumerate()
        .map(|(i, ids)| match ids.is_empty() {
            true => Err(ApiError::BadRequest(format!("ids {i} is an empty list"))),
            false => Ok(pipeline.decode(i, ids, request.skip_special_tokens)?),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json_reply(hyper::StatusCode::OK, serde_json::to_vec(&texts).expect("json")))
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct SimilarityRequest {
    inputs: SimilarityInputs,
    #[serde(default)]
    truncate: bool,
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct SimilarityInputs {
    source_sentence: String,
    sentences: Vec<String>,
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
    let options = Options { truncate: request.truncate, normalize: Some(true), ..Options::default() };
    let outcome = tei.run(PipelineInput::Texts(texts), options).await?;
    let Rows::Embeddings(rows) = &outcome.rows else { unreachable!("embedding models return embeddings") };
    let scores: Vec<f32> = rows[1..].iter().map(|r| r.iter().zip(&rows[0]).map(|(a, b)| a * b).sum()).collect();
    Ok(ran(serde_json::to_vec(&scores).expect("floats serialise"), &outcome))
}

/// Every TEI request body this module reads, parsed as its handler parses it: the inputs each
/// would carry, or the error a client would read where the body is not that request (the fuzz
/// target's entry, fuzz/fuzz_targets/tei_openai.rs).
pub fn parse_bodies(body: &[u8]) -> [Result<usize, String>; 7] {
    fn count<T: serde::de::DeserializeOwned>(body: &[u8], count: impl FnOnce(T) -> usize) -> Result<usize, String> {
        read(body).map(count)
    }
    [
        count(body, |r: EmbedRequest| r.inputs.into_vec().0.len()),
        count(body, |r: PredictRequest| {
            let texts = r.inputs.map_or(0, |i| i.into_vec().0.into_iter().map(Text::from).count());
            texts.saturating_add(r.image_b64.map_or(0, |i| i.into_vec().0.len()))
        }),
        count(body, |r: RerankRequest| r.texts.len()),
        count(body, |r: TokenizeRequest| match r.inputs {
            TokenizeInputs::One(_) => 1,
            TokenizeInputs::Many(list) => list.len(),
        }),
        count(body, |r: DecodeRequest| match r.ids {
            OneOrMany::One(_) => 1,
            OneOrMany::Many(items) => items.len(),
        }),
        count(body, |r: SimilarityRequest| r.inputs.sentences.len()),
        count(body, |r: SparseRequest| r.inputs.into_vec().0.len()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Words of serde's and Rust's that a client's error must not carry.
    pub(crate) const INTERNAL: [&str; 12] = [
        "untagged",
        "variant",
        "struct ",
        "enum ",
        "OneOrMany",
        "usize",
        "u32",
        "u64",
        "i64",
        "f32",
        "a sequence",
        "a map",
    ];

    /// Each seed of the fuzz targets' corpora with each of its fields given each wrong shape:
    /// every route's error names the field, says what it must be and what came, in words.
    #[test]
    fn every_body_error_over_the_seed_corpora_is_in_the_clients_terms() {
        let wrong = [
            json!(5),
            json!(-1),
            json!(1.5),
            json!("x"),
            json!(true),
            json!(null),
            json!([]),
            json!({}),
            json!([5]),
            json!([[5]]),
            json!([{"a": 1}]),
            json!(["a", 5]),
        ];
        let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/tei_openai");
        let mut checked = 0;
        for seed in std::fs::read_dir(&corpus).unwrap() {
            let seed = seed.unwrap().path();
            let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(&std::fs::read(&seed).unwrap()) else {
                continue;
            };
            for key in fields.keys() {
                for value in &wrong {
                    let mut body = fields.clone();
                    body.insert(key.clone(), value.clone());
                    let body = serde_json::to_vec(&body).unwrap();
                    let openai = crate::http::openai::parse(&body).err().map(|e| e.to_string());
                    let cohere = [crate::http::cohere::Version::V1, crate::http::cohere::Version::V2]
                        .map(|v| crate::http::cohere::parse(&body, v).err().map(|e| e.to_string()));
                    let others = cohere.into_iter().flatten().chain(openai);
                    for error in parse_bodies(&body).into_iter().filter_map(Result::err).chain(others) {
                        checked += 1;
                        for word in INTERNAL {
                            assert!(
                                !error.contains(word),
                                "{}: {key} = {value}: {error:?} says {word:?}",
                                seed.display()
                            );
                        }
                        // A value of the wrong shape is named by its path (TEI's routes) or
                        // its name (OpenAI's).
                        if ["must be", "invalid type", "invalid value"].iter().any(|w| error.contains(w)) {
                            let named = error.starts_with("request body: `") || error.starts_with('\'');
                            assert!(named, "{key} = {value}: {error}");
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "only {checked} errors checked: is the corpus at {} there?", corpus.display());
    }

    #[test]
    fn the_embed_inputs_that_were_a_rust_type_name_now_say_what_they_must_be() {
        let [embed, ..] = parse_bodies(br#"{"inputs": 5}"#);
        let error = embed.unwrap_err();
        assert!(
            error.starts_with("request body: `inputs`: must be a string or a list of strings, got the number 5"),
            "{error}"
        );
        let [_, predict, _, tokenize, decode, ..] = parse_bodies(br#"{"inputs": [["a", "b"], ["c"]], "ids": [1, -2]}"#);
        let predict = predict.unwrap_err();
        assert!(predict.contains("must be a text or a pair of texts or a list of texts and pairs of texts, got a list whose item [1] is a list of 1"), "{predict}");
        let tokenize = tokenize.unwrap_err();
        assert!(tokenize.contains("`inputs`: must be a text or a list of texts and pairs of texts"), "{tokenize}");
        let decode = decode.unwrap_err();
        assert!(
            decode.contains("`ids`: must be a token id") && decode.contains("item [1] is the number -2"),
            "{decode}"
        );
    }
}
