//! Running a model through its pipeline: text or images in, embeddings or scores out. Shared by
//! the TEI-compatible endpoints (`/embed`, `/predict`) and KServe v2 `/infer` with a BYTES
//! input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use crate::pipeline::bge_m3;
use crate::pipeline::colbert::{Colbert, Role};
use crate::pipeline::text::ColbertBatch;
use crate::pipeline::{
    embeddings, l2_normalize, scores, token_embeddings, Head, Pipeline, PipelineError, Side, Text, TextPipeline,
    BYTES_PER_TOKEN,
};
use crate::request::app::AppState;
use crate::request::cache;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::runtime::engine::{Join, Timing};
use crate::runtime::tensor::{Tensor, TensorData};
use inferd_config::model::{ChunkPooling, EmbeddingConfig, LongTexts, Pooling};

/// Texts of at most this many bytes in all are tokenised on the I/O thread (~1 ms of work).
const INLINE_TEXT_BYTES: usize = 4096;

pub enum PipelineInput {
    Texts(Vec<Text>),
    /// Encoded images (PNG, JPEG).
    Images(Vec<Vec<u8>>),
}

#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Cut texts longer than the model's limit on this side instead of refusing them.
    pub truncate: Option<Side>,
    /// L2-normalise embeddings; `None` = the model's default.
    pub normalize: Option<bool>,
    /// Return logits instead of softmax/sigmoid scores.
    pub raw_scores: bool,
    /// Embedding models: every token's vector instead of the pooled one (`/embed_all`).
    pub tokens: bool,
    /// Embedding models: the prompt put before each text (`[embedding.prompts]`); `None` =
    /// the model's default prompt, if it has one.
    pub prompt_name: Option<String>,
}

pub enum Rows {
    Embeddings(Vec<Vec<f32>>),
    /// Per input, the vector of each of its tokens.
    Tokens(Vec<Vec<Vec<f32>>>),
    /// Per input, BGE-M3's three outputs.
    BgeM3(Vec<bge_m3::Outputs>),
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
    /// Rows answered from the cache ([cache]) of the rows looked up in it (a chunked text's
    /// windows are rows of their own); None when it was not consulted.
    pub cached: Option<(usize, usize)>,
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
            | PipelineError::NoTokenVectors { .. }
            | PipelineError::PerToken
            | PipelineError::ThreeOutputs => ApiError::BadRequest(e.to_string()),
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

/// `work` on `meta`'s text pipeline: on the I/O thread for `bytes` of text up to
/// [`INLINE_TEXT_BYTES`] (well under a millisecond), else on the runtime's one blocking thread,
/// so that the worker's other connections are not held up behind a long request (up to
/// max_batch_inputs texts of max_length x BYTES_PER_TOKEN bytes each).
async fn tokenized<T: Send + 'static>(
    meta: &Model,
    bytes: usize,
    work: impl FnOnce(&TextPipeline) -> Result<T, PipelineError> + Send + 'static,
) -> Result<T, ApiError> {
    let Pipeline::Text(p) = &*meta.pipeline else {
        return Err(ApiError::BadRequest(format!("model '{}' does not take text", meta.info.name)));
    };
    if bytes <= INLINE_TEXT_BYTES {
        return Ok(work(p)?);
    }
    let pipeline = Arc::clone(&meta.pipeline);
    off_io_thread("tokenizing", move || match &*pipeline {
        Pipeline::Text(p) => work(p),
        _ => unreachable!("a text pipeline, matched above"),
    })
    .await
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
    call: &Call,
    index: usize,
    meta: &Model,
    input: PipelineInput,
    options: Options,
) -> Result<Outcome, ApiError> {
    // model.toml's `long_texts = "chunk"`: a text past the model's length, in a request that
    // does not ask to truncate, is embedded whole in windows.
    if let (Pipeline::Text(p), PipelineInput::Texts(texts)) = (&*meta.pipeline, &input) {
        if let Head::Embedding { settings, .. } = &p.head {
            if settings.long_texts == LongTexts::Chunk && options.truncate.is_none() && !options.tokens {
                if let Some(chunks) = chunks(state, p, settings, texts, options.prompt_name.as_deref())? {
                    return run_chunked(state, call, index, meta, settings, chunks, options).await;
                }
            }
        }
    }
    run_rows(state, call, index, meta, input, options).await
}

/// A request's texts in windows: every window as its own text, which text each is of, and its
/// tokens (the text's own, without the prompt or special tokens).
struct Chunks {
    windows: Vec<Text>,
    owners: Vec<usize>,
    tokens: Vec<usize>,
    texts: usize,
}

/// `texts` cut into windows where one is longer than the model takes beside its prompt and
/// special tokens; None when none is (the request runs as it is). Bounded before the work:
/// a text of more than embedding.max_chunked_tokens x BYTES_PER_TOKEN bytes is refused before
/// it is tokenized, and the windows' tokens in all, and their number, before any runs.
fn chunks(
    state: &AppState,
    p: &TextPipeline,
    settings: &EmbeddingConfig,
    texts: &[Text],
    prompt_name: Option<&str>,
) -> Result<Option<Chunks>, ApiError> {
    let most = settings.max_chunked_tokens;
    let prompt = settings.prompt(prompt_name).map_err(ApiError::BadRequest)?.unwrap_or_default();
    let prompt_tokens = if prompt.is_empty() { 0 } else { p.count_tokens(0, prompt)? };
    let size = p.max_length.saturating_sub(p.special_tokens(false)).saturating_sub(prompt_tokens);
    if size <= settings.chunk_overlap.max(1) {
        return Err(ApiError::BadRequest(format!(
            "the prompt takes {prompt_tokens} of the model's {} tokens: no room is left for the windows of a long text",
            p.max_length
        )));
    }
    let mut chunks = Chunks { windows: Vec::new(), owners: Vec::new(), tokens: Vec::new(), texts: texts.len() };
    let mut cut = false;
    for (i, text) in texts.iter().enumerate() {
        let long = match text {
            Text::Single(s) if s.len() > most.saturating_mul(BYTES_PER_TOKEN) => {
                return Err(ApiError::TooLarge(format!(
                    "input {i} is {} bytes; a text is embedded in windows up to {most} tokens (embedding.max_chunked_tokens), \
                     at most {} bytes",
                    s.len(),
                    most.saturating_mul(BYTES_PER_TOKEN)
                )))
            }
            // A token covers a byte at least: a text of fewer bytes than a window fits. Others
            // are counted, within the model's bound on bytes (a longer one would not fit anyway).
            Text::Single(s) if s.len() > size && (s.len() > p.max_text_bytes() || p.count_tokens(i, s)? > size) => {
                Some(s)
            }
            // Token ids are the client's own: never cut (the run below truncates windows).
            Text::Ids(ids) if ids.len() > p.max_length => {
                return Err(PipelineError::TooLong { index: i, tokens: ids.len(), max: p.max_length }.into())
            }
            _ => None,
        };
        match long {
            Some(s) => {
                cut = true;
                for (window, tokens) in p.windows(i, s, size, settings.chunk_overlap, (usize::MAX, usize::MAX))? {
                    chunks.windows.push(Text::Single(window));
                    chunks.owners.push(i);
                    chunks.tokens.push(tokens);
                }
            }
            None => {
                chunks.windows.push(text.clone());
                chunks.owners.push(i);
                chunks.tokens.push(1);
            }
        }
        let total: usize = chunks.tokens.iter().sum();
        if total > most {
            return Err(ApiError::TooLarge(format!(
                "the texts make more than {most} tokens in windows (embedding.max_chunked_tokens)"
            )));
        }
        if chunks.windows.len() > state.max_batch_inputs {
            return Err(ApiError::TooLarge(format!(
                "the texts make more than {} windows of {size} tokens; the limit is server.max_batch_inputs",
                state.max_batch_inputs
            )));
        }
    }
    Ok(cut.then_some(chunks))
}

/// Every window embedded in one batch (not normalized, truncated where a window's text
/// tokenizes a token longer on its own), then each text's windows pooled into its embedding,
/// normalized after pooling when the model (or the request) normalizes.
async fn run_chunked(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    settings: &EmbeddingConfig,
    chunks: Chunks,
    options: Options,
) -> Result<Outcome, ApiError> {
    let normalize = options.normalize.unwrap_or(settings.normalize);
    let inner = Options { truncate: Some(Side::Right), normalize: Some(false), ..options };
    let mut outcome = run_rows(state, call, index, meta, PipelineInput::Texts(chunks.windows), inner).await?;
    let Rows::Embeddings(windows) = &outcome.rows else { unreachable!("embedding models answer embeddings") };
    let dims = windows.first().map_or(0, Vec::len);
    let mut pooled = vec![(vec![0f32; dims], 0f32); chunks.texts];
    for ((window, &text), &tokens) in windows.iter().zip(&chunks.owners).zip(&chunks.tokens) {
        let (sum, weight) = &mut pooled[text];
        match settings.chunk_pooling {
            ChunkPooling::Mean => sum.iter_mut().zip(window).for_each(|(s, v)| *s += v * tokens as f32),
            ChunkPooling::Max if *weight == 0.0 => sum.copy_from_slice(window),
            ChunkPooling::Max => sum.iter_mut().zip(window).for_each(|(s, v)| *s = s.max(*v)),
        }
        *weight += tokens as f32;
    }
    let rows = pooled
        .into_iter()
        .map(|(mut row, weight)| {
            if settings.chunk_pooling == ChunkPooling::Mean {
                row.iter_mut().for_each(|x| *x /= weight.max(f32::MIN_POSITIVE));
            }
            if normalize {
                l2_normalize(&mut row);
            }
            row
        })
        .collect();
    outcome.rows = Rows::Embeddings(rows);
    outcome.truncated.clear();
    Ok(outcome)
}

/// Texts or images through the pipeline, one row each.
async fn run_rows(
    state: &AppState,
    call: &Call,
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
    if let Some(Head::Embedding { settings, .. }) = meta.pipeline.head() {
        match settings.pooling {
            Pooling::Colbert if !options.tokens => return Err(PipelineError::PerToken.into()),
            Pooling::BgeM3 if !options.tokens => return Err(PipelineError::ThreeOutputs.into()),
            _ => {}
        }
    }
    let started = Instant::now();
    let mut stage = crate::trace::Stage::start(match &input {
        PipelineInput::Texts(_) => "tokenize",
        PipelineInput::Images(_) => "decode images",
    });
    stage.set(KeyValue::new("inferd.inputs", count as i64));
    let (tensors, lengths, truncated, join) = match (&*meta.pipeline, input) {
        (Pipeline::Text(p), PipelineInput::Texts(texts)) => {
            let texts = prompted(&p.head, texts, options.prompt_name.as_deref())?;
            let by_config =
                matches!(&p.head, Head::Embedding { settings, .. } if settings.long_texts == LongTexts::Truncate);
            let truncate = options.truncate.or(by_config.then_some(Side::Right));
            let bytes: usize = texts.iter().map(Text::bytes).sum();
            let encoded = tokenized(meta, bytes, move |p| p.encode(&texts, truncate)).await?;
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
    let tokens = lengths.iter().sum();
    if !lengths.is_empty() {
        stage.set(KeyValue::new("inferd.tokens", tokens as i64));
    }
    drop(stage);
    let head = meta.pipeline.head().expect("pipelines have a head");
    // [cache]: rows answered before are not run again (every token's vector, /embed_all, is
    // never cached: it is as large as its input; nor is a model whose rows are no batch, said
    // by `max_batch_size = 0`: the rows missed would run without the others).
    let cache = state.cache.as_ref().filter(|_| !options.tokens && !call.fresh && meta.batch_rows().is_ok());
    let row_options =
        cache::RowOptions { normalize: options.normalize, raw_scores: options.raw_scores, tokens: options.tokens };
    let keys = cache.map(|_| cache::keys(meta, &row_options, &tensors, &lengths, count)).unwrap_or_default();
    let mut found = match cache {
        Some(cache) => cache.get(&keys),
        None => vec![None; count],
    };
    let misses: Vec<usize> = (0..count).filter(|&r| found[r].is_none()).collect();
    let counter_row = state.engine.row(index);
    if cache.is_some() {
        state.stats.cache_lookups(counter_row, (count - misses.len()) as u64, misses.len() as u64);
    }
    let mut engine = Timing::default();
    let mut model_time = Duration::ZERO;
    if !misses.is_empty() {
        let (tensors, lengths) = match misses.len() == count {
            true => (tensors, lengths),
            false => only_rows(tensors, &lengths, &misses, count),
        };
        let (outputs, timing) = state.engine.submit(index, tensors, join, call.terms).await?;
        (engine, model_time) = (timing, started.elapsed() - prepare);
        let _post = crate::trace::Stage::start("post-process");
        let output = &outputs[head.output()];
        let computed = match head {
            Head::Embedding { .. } if options.tokens => {
                let rows = Rows::Tokens(token_embeddings(output, &lengths)?);
                return Ok(Outcome { rows, truncated, tokens, prepare, model: model_time, engine, cached: None });
            }
            Head::Embedding { settings, dense, .. } => embeddings(
                output,
                &lengths,
                (settings.pooling, dense),
                options.normalize.unwrap_or(settings.normalize),
            )?,
            Head::Classification { labels, activation, .. } => {
                scores(output, labels.len(), *activation, options.raw_scores)?
            }
        };
        if let Some(cache) = cache {
            let fresh = misses.iter().zip(&computed).map(|(&r, row)| (keys[r], row.clone()));
            cache.put(counter_row, fresh, &state.stats);
        }
        for (&r, row) in misses.iter().zip(computed) {
            found[r] = Some(row);
        }
    }
    let answered: Vec<Vec<f32>> = found.into_iter().map(|row| row.unwrap_or_default()).collect();
    let rows = match head {
        Head::Embedding { .. } => Rows::Embeddings(answered),
        Head::Classification { labels, .. } => Rows::Scores { labels: labels.clone(), scores: answered },
    };
    let cached = cache.map(|_| (count - misses.len(), count));
    Ok(Outcome { rows, truncated, tokens, prepare, model: model_time, engine, cached })
}

/// A ColBERT model's vectors for `texts` as `role` ([`crate::pipeline::colbert`]): each
/// text's kept tokens, projected and normalised as the model's recipe says.
pub async fn run_colbert(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    texts: Vec<String>,
    role: Role,
) -> Result<Outcome, ApiError> {
    if texts.is_empty() {
        return Err(ApiError::BadRequest("no inputs".into()));
    }
    within_limit(state, texts.len())?;
    let (Pipeline::Text(_), Some(Head::Embedding { settings, dense, .. })) = (&*meta.pipeline, meta.pipeline.head())
    else {
        return Err(ApiError::BadRequest(format!("model '{}' is not a ColBERT model", meta.info.name)));
    };
    let started = Instant::now();
    let stage = crate::trace::Stage::start("tokenize");
    let bytes: usize = texts.iter().map(String::len).sum();
    let encoded = tokenized(meta, bytes, move |p| p.encode_colbert(&texts, role)).await?;
    let Some(ColbertBatch { encoded, keep }) = encoded else {
        return Err(ApiError::BadRequest(format!(
            "model '{}' gives one vector per text, not one per token (its pooling is \"{}\", not \"colbert\")",
            meta.info.name,
            settings.pooling.as_str()
        )));
    };
    drop(stage);
    let prepare = started.elapsed();
    let tokens = encoded.lengths.iter().sum();
    let (outputs, engine) = state.engine.submit(index, encoded.inputs, Join::PadSequence, call.terms).await?;
    let model = started.elapsed() - prepare;
    let _post = crate::trace::Stage::start("post-process");
    let head = meta.pipeline.head().expect("matched above");
    let rows = Colbert::vectors(&outputs[head.output()], &keep, dense, settings.normalize)?;
    Ok(Outcome { rows: Rows::Tokens(rows), truncated: Vec::new(), tokens, prepare, model, engine, cached: None })
}

/// A BGE-M3 model's three outputs for `texts` ([`crate::pipeline::bge_m3`]), each cut at the
/// model's length as FlagEmbedding cuts it.
pub async fn run_bge_m3(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    texts: Vec<Text>,
) -> Result<Outcome, ApiError> {
    if texts.is_empty() {
        return Err(ApiError::BadRequest("no inputs".into()));
    }
    within_limit(state, texts.len())?;
    let (Pipeline::Text(p), Some(Head::Embedding { settings, .. })) = (&*meta.pipeline, meta.pipeline.head()) else {
        return Err(ApiError::BadRequest(format!("model '{}' is not a BGE-M3 model", meta.info.name)));
    };
    let Some(m3) = &p.bge_m3 else {
        return Err(ApiError::BadRequest(format!(
            "model '{}' is not a BGE-M3 model (its pooling is \"{}\", not \"bge_m3\"): use /embed",
            meta.info.name,
            settings.pooling.as_str()
        )));
    };
    let started = Instant::now();
    let stage = crate::trace::Stage::start("tokenize");
    let bytes: usize = texts.iter().map(Text::bytes).sum();
    let encoded = tokenized(meta, bytes, move |p| p.encode(&texts, Some(Side::Right))).await?;
    drop(stage);
    let prepare = started.elapsed();
    // Each row's own ids: the ids input, its padding left out.
    let ids: Vec<Vec<u32>> = match encoded.inputs.iter().find(|t| t.name == "input_ids").map(|t| &t.data) {
        Some(TensorData::I64(v)) => ids_of(v.iter().map(|&x| x as u32), &encoded.lengths),
        Some(TensorData::I32(v)) => ids_of(v.iter().map(|&x| x as u32), &encoded.lengths),
        _ => return Err(ApiError::Internal("the text pipeline gave no input_ids".into())),
    };
    let tokens = encoded.lengths.iter().sum();
    let truncated = encoded.truncated;
    let (outputs, engine) = state.engine.submit(index, encoded.inputs, Join::PadSequence, call.terms).await?;
    let model = started.elapsed() - prepare;
    let _post = crate::trace::Stage::start("post-process");
    let head = meta.pipeline.head().expect("matched above");
    let rows = m3.outputs(&outputs[head.output()], &ids, settings.normalize)?;
    Ok(Outcome { rows: Rows::BgeM3(rows), truncated, tokens, prepare, model, engine, cached: None })
}

/// A padded batch of ids split into its rows, each `lengths[r]` long.
fn ids_of(flat: impl ExactSizeIterator<Item = u32>, lengths: &[usize]) -> Vec<Vec<u32>> {
    let all: Vec<u32> = flat.collect();
    let width = all.len() / lengths.len().max(1);
    lengths.iter().enumerate().map(|(r, &n)| all[r * width..][..n.min(width)].to_vec()).collect()
}

/// The batch of `tensors` (each of `count` rows) with only rows `keep`, at the same width, and
/// those rows' lengths.
fn only_rows(tensors: Vec<Tensor>, lengths: &[usize], keep: &[usize], count: usize) -> (Vec<Tensor>, Vec<usize>) {
    let tensors = tensors
        .into_iter()
        .map(|t| {
            let width = t.data.len() / count.max(1);
            let mut data = t.data.dtype().zeros(0);
            for &r in keep {
                data.extend_rows(&t.data.slice(r * width..(r + 1) * width), 1, width, width);
            }
            let mut shape = t.shape;
            if let Some(rows) = shape.first_mut() {
                *rows = keep.len() as i64;
            }
            Tensor { name: t.name, shape, data }
        })
        .collect();
    let lengths = match lengths.is_empty() {
        true => Vec::new(),
        false => keep.iter().map(|&r| lengths[r]).collect(),
    };
    (tensors, lengths)
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
