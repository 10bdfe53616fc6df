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

use std::time::Instant;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::http::{json_reply, ApiError, AppState, Reply};
use crate::model::ModelMeta;
use crate::pipeline::{ranked, Text};
use crate::tasks::{self, Options, PipelineInput, Rows};
use inferd_config::model::Task;

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    fn into_vec(self) -> (Vec<T>, bool) {
        match self {
            OneOrMany::One(x) => (vec![x], false),
            OneOrMany::Many(v) => (v, true),
        }
    }
}

#[derive(Deserialize)]
struct EmbedRequest {
    inputs: OneOrMany<String>,
    #[serde(default)]
    normalize: Option<bool>,
    #[serde(default)]
    truncate: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Sequence {
    Single(String),
    Pair(String, String),
}

#[derive(Deserialize)]
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

fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("request body: {e}")))
}

fn require(meta: &ModelMeta, task: Task, endpoint: &str) -> Result<(), ApiError> {
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

pub async fn embed(
    state: &AppState,
    index: usize,
    meta: &ModelMeta,
    body: &[u8],
    deadline: Option<Instant>,
) -> Result<Reply, ApiError> {
    require(meta, Task::Embedding, "/embed")?;
    let request: EmbedRequest = parse(body)?;
    let (texts, _) = request.inputs.into_vec();
    let texts = texts.into_iter().map(Text::Single).collect();
    let options = Options { truncate: request.truncate, normalize: request.normalize, raw_scores: false, deadline };
    let outcome = tasks::run(state, index, meta, PipelineInput::Texts(texts), options).await?;
    let Rows::Embeddings(rows) = &outcome.rows else { unreachable!("embedding models return embeddings") };
    let mut reply = json_reply(hyper::StatusCode::OK, serde_json::to_vec(rows).expect("floats serialise"));
    tasks::annotate(&mut reply, &outcome);
    Ok(reply)
}

pub async fn predict(
    state: &AppState,
    index: usize,
    meta: &ModelMeta,
    body: &[u8],
    deadline: Option<Instant>,
) -> Result<Reply, ApiError> {
    require(meta, Task::Classification, "/predict")?;
    let request: PredictRequest = parse(body)?;
    let (input, listed) = match (request.inputs, request.image_b64) {
        (Some(inputs), None) => {
            let (seqs, listed) = inputs.into_vec();
            let texts = seqs
                .into_iter()
                .map(|s| match s {
                    Sequence::Single(t) => Text::Single(t),
                    Sequence::Pair(a, b) => Text::Pair(a, b),
                })
                .collect();
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
    let options = Options { truncate: request.truncate, normalize: None, raw_scores: request.raw_scores, deadline };
    let outcome = tasks::run(state, index, meta, input, options).await?;
    let Rows::Scores { labels, scores } = &outcome.rows else { unreachable!("classifiers return scores") };
    let lists: Vec<Vec<Prediction>> = scores
        .iter()
        .map(|row| {
            ranked(labels, row, request.top_k).into_iter().map(|(label, score)| Prediction { label, score }).collect()
        })
        .collect();
    let body = if listed { serde_json::to_vec(&lists) } else { serde_json::to_vec(&lists[0]) };
    let mut reply = json_reply(hyper::StatusCode::OK, body.expect("predictions serialise"));
    tasks::annotate(&mut reply, &outcome);
    Ok(reply)
}
