//! Running a model through its pipeline: text or images in, embeddings or scores out. Shared by
//! the TEI-compatible endpoints (`/embed`, `/predict`) and KServe v2 `/infer` with a BYTES
//! input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use crate::pipeline::{embeddings, scores, token_embeddings, Head, Pipeline, PipelineError, Text};
use crate::request::app::{ApiError, AppState, Model};
use crate::runtime::engine::{Join, Timing};

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
pub async fn off_io_thread<T: Send + 'static>(
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

/// The most bytes one f32 takes in JSON, with its comma (`-1.17549435e-38,`).
pub const JSON_F32_BYTES: u64 = 16;

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
    meta: &Model,
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
    let mut stage = crate::trace::Stage::start(match &input {
        PipelineInput::Texts(_) => "tokenize",
        PipelineInput::Images(_) => "decode images",
    });
    stage.set(KeyValue::new("inferd.inputs", count as i64));
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
    if !lengths.is_empty() {
        stage.set(KeyValue::new("inferd.tokens", lengths.iter().sum::<usize>() as i64));
    }
    drop(stage);
    let (outputs, engine) = state.engine.submit(index, tensors, join, options.deadline).await?;
    let model_time = started.elapsed() - prepare;
    let _post = crate::trace::Stage::start("post-process");
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
