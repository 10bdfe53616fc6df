//! Running a model through its pipeline: text or images in, embeddings or scores out. Shared by
//! the TEI-compatible endpoints (`/embed`, `/predict`) and KServe v2 `/infer` with a BYTES
//! input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;
use hyper::Response;

use crate::pipeline::{embeddings, scores, token_embeddings, Head, Pipeline, PipelineError, Text};
use crate::request::app::{json_reply, ApiError, AppState, Reply};
use crate::runtime::engine::{Join, Timing};
use crate::runtime::model::ModelMeta;

/// Texts of at most this many bytes in all are tokenised on the I/O thread (~1 ms of work).
const INLINE_TEXT_BYTES: usize = 4096;

pub enum PipelineInput {
    Texts(Vec<Text>),
    /// Encoded images (PNG, JPEG).
    Images(Vec<Vec<u8>>),
}

#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Truncate texts longer than the model's limit instead of refusing them.
    pub truncate: bool,
    /// L2-normalise embeddings; `None` = the model's default.
    pub normalize: Option<bool>,
    /// Return logits instead of softmax/sigmoid scores.
    pub raw_scores: bool,
    /// Embedding models: every token's vector instead of the pooled one (`/embed_all`).
    pub tokens: bool,
    /// Drop the request if it is still waiting for the model at this instant.
    pub deadline: Option<Instant>,
    /// Embedding models: the prompt put before each text (`[embedding.prompts]`); `None` =
    /// the model's default prompt, if it has one.
    pub prompt_name: Option<String>,
}

pub enum Rows {
    Embeddings(Vec<Vec<f32>>),
    /// Per input, the vector of each of its tokens.
    Tokens(Vec<Vec<Vec<f32>>>),
    Scores {
        labels: Vec<String>,
        scores: Vec<Vec<f32>>,
    },
}

pub struct Outcome {
    pub rows: Rows,
    /// Inputs that were truncated (only with `truncate`).
    pub truncated: Vec<usize>,
    /// Tokens the model read, padding excluded (texts only).
    pub tokens: usize,
    /// Tokenising or decoding.
    pub prepare: Duration,
    /// Waiting for and running the model, and handing its answer back.
    pub model: Duration,
    /// Of `model`: waiting for a lane, and the run.
    pub engine: Timing,
}

impl From<PipelineError> for ApiError {
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::TooLong { .. }
            | PipelineError::TextTooLong { .. }
            | PipelineError::ImageTooLarge { .. }
            | PipelineError::ImageTooLong { .. }
            | PipelineError::ImageTooCostly { .. } => ApiError::TooLarge(e.to_string()),
            PipelineError::Output(_) => ApiError::Internal(e.to_string()),
            PipelineError::Empty { .. } => ApiError::Empty(e.to_string()),
            PipelineError::Tokenizer { .. }
            | PipelineError::NotAnImage { .. }
            | PipelineError::NoTokenVectors { .. } => ApiError::BadRequest(e.to_string()),
        }
    }
}

/// Runs `work` on the runtime's one blocking thread (started on demand), so the I/O thread
/// serves the worker's other connections meanwhile; a panic in it is a bug, answered 500
/// (panics.rs).
async fn off_io_thread<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
) -> Result<T, ApiError> {
    let done = tokio::task::spawn_blocking(move || crate::panics::guarded(work)).await;
    let result = done
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| ApiError::Internal(format!("{what} failed: the server hit a bug (logged)")))?;
    Ok(result?)
}

/// JSON bytes that hold their share of the worker's byte budget until hyper has sent them
/// (the answer's `Bytes` own them, and are dropped once written or the connection is gone).
struct Held {
    json: Vec<u8>,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.json
    }
}

/// The most bytes one f32 takes in JSON, with its comma (`-1.17549435e-38,`).
pub const JSON_F32_BYTES: u64 = 16;

/// A large JSON answer (`/embed_all` gives ~3000 times the bytes of its input, `/tokenize`
/// ~100): `bound`, what its JSON takes at most, is taken from the worker's byte budget
/// (server.max_body_bytes_in_flight, shared with the request bodies) before it is written,
/// 503 when the budget is spent and 413 when it could never fit, and the written JSON holds
/// its share until it has been sent. Written off the I/O thread: a few MB of JSON take
/// milliseconds.
pub async fn large_json<T: serde::Serialize + Send + 'static>(
    state: &AppState,
    value: T,
    bound: u64,
) -> Result<Reply, ApiError> {
    let total = state.body_budget_total;
    if bound > total {
        return Err(ApiError::TooLarge(format!(
            "the answer would take up to {bound} bytes, more than a worker holds at once \
             (server.max_body_bytes_in_flight = {total}); send fewer or shorter inputs"
        )));
    }
    let claim = u32::try_from(bound.max(1)).unwrap_or(u32::MAX);
    let mut budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| {
        ApiError::Overloaded(format!(
            "too many bytes in flight on this worker for an answer of up to {bound} bytes \
             (server.max_body_bytes_in_flight = {total}); retry shortly"
        ))
    })?;
    let json = off_io_thread("writing the answer", move || Ok(serde_json::to_vec(&value).expect("json"))).await?;
    // Only what was written stays claimed.
    drop(budget.split(budget.num_permits().saturating_sub(json.len().max(1))));
    let held = Held { json, _budget: budget };
    let mut reply = json_reply(hyper::StatusCode::OK, Vec::new());
    *reply.body_mut() = http_body_util::Full::new(bytes::Bytes::from_owner(held));
    Ok(reply)
}

/// Refuses a request with more inputs than `server.max_batch_inputs` (413).
pub fn within_limit(state: &AppState, count: usize) -> Result<(), ApiError> {
    match count > state.max_batch_inputs {
        true => Err(ApiError::TooLarge(format!(
            "{count} inputs in one request; the limit is {} (server.max_batch_inputs)",
            state.max_batch_inputs
        ))),
        false => Ok(()),
    }
}

pub async fn run_pipeline(
    state: &AppState,
    index: usize,
    meta: &ModelMeta,
    input: PipelineInput,
    options: Options,
) -> Result<Outcome, ApiError> {
    let count = match &input {
        PipelineInput::Texts(t) => t.len(),
        PipelineInput::Images(i) => i.len(),
    };
    if count == 0 {
        return Err(ApiError::BadRequest("no inputs".into()));
    }
    within_limit(state, count)?;
    let model = &meta.info.name;
    let started = Instant::now();
    let (tensors, lengths, truncated, join) = match (&*meta.pipeline, input) {
        (Pipeline::Text(p), PipelineInput::Texts(texts)) => {
            let texts = prompted(&p.head, texts, options.prompt_name.as_deref())?;
            let truncate = options.truncate;
            // A short request is tokenised on the I/O thread (well under a millisecond); a long
            // one (up to max_batch_inputs texts of max_length x BYTES_PER_TOKEN bytes each)
            // goes to the runtime's one blocking thread, so that the other connections of the
            // worker are not held up behind it.
            let bytes: usize = texts.iter().map(Text::bytes).sum();
            let encoded = if bytes <= INLINE_TEXT_BYTES {
                p.encode(&texts, truncate)?
            } else {
                let pipeline = Arc::clone(&meta.pipeline);
                off_io_thread("tokenizing", move || match &*pipeline {
                    Pipeline::Text(p) => p.encode(&texts, truncate),
                    _ => unreachable!("matched above"),
                })
                .await?
            };
            (encoded.inputs, encoded.lengths, encoded.truncated, Join::PadSequence)
        }
        (Pipeline::Image(_), PipelineInput::Images(images)) => {
            // Decoding can take tens of milliseconds: off the I/O thread.
            let pipeline = Arc::clone(&meta.pipeline);
            let tensors = off_io_thread("image decoding", move || match &*pipeline {
                Pipeline::Image(p) => p.preprocess(&images),
                _ => unreachable!("matched above"),
            })
            .await?;
            (tensors, Vec::new(), Vec::new(), Join::Exact)
        }
        (Pipeline::Raw, _) => {
            return Err(ApiError::BadRequest(format!(
                "model '{model}' has no pipeline (task = \"raw\"); send its tensors to /v2/models/{model}/infer"
            )))
        }
        (Pipeline::Text(_), PipelineInput::Images(_)) => {
            return Err(ApiError::BadRequest(format!("model '{model}' takes text, not images")))
        }
        (Pipeline::Image(_), PipelineInput::Texts(_)) => {
            return Err(ApiError::BadRequest(format!("model '{model}' takes images, not text")))
        }
    };
    let prepare = started.elapsed();
    let (outputs, engine) = state.engine.submit(index, tensors, join, options.deadline).await?;
    let model_time = started.elapsed() - prepare;
    let head = meta.pipeline.head().expect("pipelines have a head");
    let output = &outputs[head.output()];
    let rows = match head {
        Head::Embedding { .. } if options.tokens => Rows::Tokens(token_embeddings(output, &lengths)?),
        Head::Embedding { settings, .. } => Rows::Embeddings(embeddings(
            output,
            &lengths,
            settings.pooling,
            options.normalize.unwrap_or(settings.normalize),
        )?),
        Head::Classification { labels, activation, .. } => Rows::Scores {
            labels: labels.clone(),
            scores: scores(output, labels.len(), *activation, options.raw_scores)?,
        },
    };
    Ok(Outcome { rows, truncated, tokens: lengths.iter().sum(), prepare, model: model_time, engine })
}

/// `texts` with the model's prompt before each (the one `name`d, else the model's default);
/// empty texts stay empty, to be refused as such, and token ids are the client's own.
fn prompted(head: &Head, texts: Vec<Text>, name: Option<&str>) -> Result<Vec<Text>, ApiError> {
    let Head::Embedding { settings, .. } = head else {
        return match name {
            Some(_) => Err(ApiError::BadRequest("prompt_name is for embedding models".into())),
            None => Ok(texts),
        };
    };
    match settings.prompt(name).map_err(ApiError::BadRequest)? {
        None | Some("") => Ok(texts),
        Some(prompt) => Ok(texts
            .into_iter()
            .map(|t| match t {
                Text::Single(s) if !s.is_empty() => Text::Single(format!("{prompt}{s}")),
                other => other,
            })
            .collect()),
    }
}

/// `x-inferd-truncated: 0,3` when inputs were truncated, and `Server-Timing` with the time
/// spent preparing the inputs (`prepare`) and in the model (`model`), and of the latter,
/// waiting for a lane (`queue`) and running (`compute`: the whole batch the request joined);
/// what `model` holds beyond both is the answer's way back to the I/O thread.
pub fn annotate<B>(reply: &mut Response<B>, outcome: &Outcome) {
    let headers = reply.headers_mut();
    if !outcome.truncated.is_empty() {
        let list = outcome.truncated.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        if let Ok(v) = HeaderValue::from_str(&list) {
            headers.insert("x-inferd-truncated", v);
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let timing = format!(
        "prepare;dur={:.3}, model;dur={:.3}, queue;dur={:.3}, compute;dur={:.3}",
        ms(outcome.prepare),
        ms(outcome.model),
        ms(outcome.engine.queue),
        ms(outcome.engine.compute)
    );
    if let Ok(v) = HeaderValue::from_str(&timing) {
        headers.insert("server-timing", v);
    }
}
