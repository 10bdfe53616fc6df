//! HTTP routing for one worker: KServe v2 REST, the TEI-compatible `/embed` and `/predict`,
//! and the one mapping from errors to status codes ([`ApiError::status`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tracing::{debug, info, warn};

use inferd_config::model::Task;
use inferd_config::stats::{Latency, Shared, MAX_MODELS};

use crate::engine::{Engine, Join};
use crate::model::{ModelError, ModelMeta, Tensor};
use crate::pipeline::{Head, Pipeline, Text};
use crate::protocol::{self, Parsed};
use crate::tasks::{self, Options, PipelineInput, Rows};
use crate::tensor::TensorData;
use crate::{openai, tei};

/// Everything a request handler may touch.
pub struct AppState {
    pub worker: usize,
    /// The default model first.
    pub models: Vec<ModelMeta>,
    pub engine: Engine,
    pub max_body_bytes: u64,
    pub max_batch_inputs: usize,
    /// How long a client may take to send its body (server.body_timeout_secs).
    pub body_timeout: std::time::Duration,
    /// Bytes of request bodies the worker may hold at once (server.max_body_bytes_in_flight).
    pub body_budget: Arc<tokio::sync::Semaphore>,
    pub body_budget_total: u64,
    /// False until warm-up is done and again once draining starts; `/v2/health/ready` follows it.
    pub ready: AtomicBool,
    /// Counters shared with the supervisor (requests, latencies, batch sizes, in flight).
    pub stats: Arc<Shared>,
    /// log.access_log: one line per answered request.
    pub access_log: bool,
    pub request_ids: RequestIds,
}

/// Request ids for requests that come without a usable `X-Request-Id`: 16 hex digits, from a
/// per-process random key (std's hasher keys) and a counter.
#[derive(Default)]
pub struct RequestIds {
    key: std::collections::hash_map::RandomState,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    /// The client's id when it is one (1-128 visible ASCII characters), else a new one.
    fn for_request(&self, given: Option<&HeaderValue>) -> HeaderValue {
        let usable = |v: &&HeaderValue| (1..=128).contains(&v.len()) && v.as_bytes().iter().all(u8::is_ascii_graphic);
        if let Some(v) = given.filter(usable) {
            return v.clone();
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = std::hash::BuildHasher::hash_one(&self.key, (std::process::id(), n));
        HeaderValue::from_str(&format!("{id:016x}")).expect("hex digits")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("method {0} is not allowed on {1}")]
    MethodNotAllowed(Method, String),
    /// Backpressure: answered at once with 503 and Retry-After.
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// The only place an error becomes a status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed(..) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::InvalidInput { .. } => ApiError::BadRequest(e.to_string()),
            ModelError::Overloaded { .. } => ApiError::Overloaded(e.to_string()),
            ModelError::DeadlineExceeded { .. } | ModelError::Stopped { .. } => {
                ApiError::DeadlineExceeded(e.to_string())
            }
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

pub type Reply = Response<Full<Bytes>>;

pub fn json_reply(status: StatusCode, body: Vec<u8>) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_reply(e: &ApiError, style: ErrorStyle) -> Reply {
    let body = match style {
        ErrorStyle::V2 => json!({ "error": e.to_string() }),
        ErrorStyle::Tei => tei::error_body(e),
        ErrorStyle::OpenAi => openai::error_body(e),
    };
    let mut reply = json_reply(e.status(), serde_json::to_vec(&body).expect("json"));
    if matches!(e, ApiError::Overloaded(_)) {
        reply.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    reply
}

pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Every request: routed, answered, its id echoed, its failure logged with that id, and its
/// access line written (log.access_log).
pub async fn handle(
    state: Arc<AppState>,
    peer: SocketAddr,
    mut request: Request<Incoming>,
) -> Result<Reply, Infallible> {
    let started = Instant::now();
    let id = state.request_ids.for_request(request.headers().get(REQUEST_ID_HEADER));
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    // A body left unread (an error answered before it was read, or a failed read) means hyper
    // closes the connection after the answer: the answer must say so, or a keep-alive client
    // sends its next request into a closing socket.
    let body_read = match hyper::body::Body::is_end_stream(request.body()) {
        true => None,
        false => {
            let flag = BodyRead::default();
            request.extensions_mut().insert(flag.clone());
            Some(flag)
        }
    };
    let mut reply = match route(&state, request).await {
        Ok(reply) => reply,
        Err(e) => {
            let request_id = id.to_str().unwrap_or_default();
            if e.status().is_server_error() {
                warn!(request_id, method = %method, path, status = e.status().as_u16(), "request failed: {e}");
            } else {
                debug!(request_id, method = %method, path, status = e.status().as_u16(), "request refused: {e}");
            }
            let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
            error_reply(&e, parse_route(&segments).map_or(ErrorStyle::V2, |r| r.error_style()))
        }
    };
    if state.access_log {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let model = match parse_route(&segments) {
            Some(Route::Model(m, _) | Route::ModelReady(m, _) | Route::Infer(m, _)) => m,
            Some(Route::Embed(m) | Route::Predict(m) | Route::Rerank(m)) => m.unwrap_or(&state.models[0].info.name),
            _ => "",
        };
        info!(
            target: "inferd::access",
            client = %peer,
            method = %method,
            path,
            status = reply.status().as_u16(),
            bytes = hyper::body::Body::size_hint(reply.body()).exact().unwrap_or(0),
            duration_ms = (started.elapsed().as_secs_f64() * 1e4).round() / 10.0,
            model,
            worker = state.worker,
            request_id = id.to_str().unwrap_or_default(),
            "{method} {path} {}",
            reply.status().as_u16()
        );
    }
    let headers = reply.headers_mut();
    headers.insert("x-inferd-worker", HeaderValue::from(state.worker));
    headers.insert(REQUEST_ID_HEADER, id);
    if body_read.is_some_and(|read| !read.0.load(Ordering::Relaxed)) {
        headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(reply)
}

/// Set once a request's body has been read whole (see [`handle`]).
#[derive(Clone, Default)]
struct BodyRead(Arc<AtomicBool>);

/// The endpoints; `/versions/{v}` is accepted wherever the protocol allows it, and a missing
/// model name means the default model.
enum Route<'a> {
    Server,
    Live,
    Ready,
    Model(&'a str, Option<&'a str>),
    ModelReady(&'a str, Option<&'a str>),
    Infer(&'a str, Option<&'a str>),
    Embed(Option<&'a str>),
    Predict(Option<&'a str>),
    /// OpenAI's `POST /v1/embeddings`; the model is named in the body.
    OpenAiEmbeddings,
    /// text-embeddings-inference's routes for the default model.
    Info,
    Tokenize,
    Decode,
    Similarity,
    EmbedAll,
    Rerank(Option<&'a str>),
    /// `POST /` and SageMaker's `POST /invocations`: `/embed` or `/predict` by the default
    /// model's task.
    Invocations,
    /// SageMaker's health check.
    Ping,
}

/// The shape of an error body: KServe v2's `{"error"}`, text-embeddings-inference's (with
/// `error_type`) or OpenAI's.
#[derive(Clone, Copy)]
enum ErrorStyle {
    V2,
    Tei,
    OpenAi,
}

impl Route<'_> {
    fn error_style(&self) -> ErrorStyle {
        match self {
            Route::OpenAiEmbeddings => ErrorStyle::OpenAi,
            Route::Embed(_)
            | Route::Predict(_)
            | Route::Info
            | Route::Tokenize
            | Route::Decode
            | Route::Similarity
            | Route::EmbedAll
            | Route::Rerank(_)
            | Route::Invocations
            | Route::Ping => ErrorStyle::Tei,
            _ => ErrorStyle::V2,
        }
    }
}

fn parse_route<'a>(segments: &[&'a str]) -> Option<Route<'a>> {
    Some(match *segments {
        ["v2"] => Route::Server,
        ["v2", "health", "live"] | ["health"] => Route::Live,
        ["v2", "health", "ready"] => Route::Ready,
        ["v2", "models", name] => Route::Model(name, None),
        ["v2", "models", name, "versions", v] => Route::Model(name, Some(v)),
        ["v2", "models", name, "ready"] => Route::ModelReady(name, None),
        ["v2", "models", name, "versions", v, "ready"] => Route::ModelReady(name, Some(v)),
        ["v2", "models", name, "infer"] => Route::Infer(name, None),
        ["v2", "models", name, "versions", v, "infer"] => Route::Infer(name, Some(v)),
        ["embed"] => Route::Embed(None),
        ["v2", "models", name, "embed"] => Route::Embed(Some(name)),
        ["predict"] => Route::Predict(None),
        ["v2", "models", name, "predict"] => Route::Predict(Some(name)),
        ["v1", "embeddings"] | ["embeddings"] => Route::OpenAiEmbeddings,
        ["info"] => Route::Info,
        ["tokenize"] => Route::Tokenize,
        ["decode"] => Route::Decode,
        ["similarity"] => Route::Similarity,
        ["embed_all"] => Route::EmbedAll,
        ["rerank"] => Route::Rerank(None),
        ["v2", "models", name, "rerank"] => Route::Rerank(Some(name)),
        ["invocations"] | [""] => Route::Invocations,
        ["ping"] => Route::Ping,
        _ => return None,
    })
}

async fn route(state: &AppState, request: Request<Incoming>) -> Result<Reply, ApiError> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = parse_route(&segments).ok_or_else(|| ApiError::NotFound(format!("no route for {method} {path}")))?;
    let allowed = match route {
        Route::Infer(..)
        | Route::Embed(_)
        | Route::Predict(_)
        | Route::OpenAiEmbeddings
        | Route::Tokenize
        | Route::Decode
        | Route::Similarity
        | Route::EmbedAll
        | Route::Rerank(_)
        | Route::Invocations => method == Method::POST,
        _ => method == Method::GET || method == Method::HEAD,
    };
    if !allowed {
        return Err(ApiError::MethodNotAllowed(method, path.clone()));
    }
    let ready = state.ready.load(Ordering::Relaxed);
    let deadline = deadline(&request)?;
    match route {
        Route::Server => Ok(server_metadata(state)),
        Route::Live => Ok(json_reply(StatusCode::OK, b"{\"live\":true}".to_vec())),
        Route::Ready => Ok(readiness(ready)),
        Route::Model(name, version) => model(state, name, version).map(|(_, m)| versioned(model_metadata(m), m)),
        Route::ModelReady(name, version) => model(state, name, version).map(|(_, m)| versioned(readiness(ready), m)),
        Route::Infer(name, version) => {
            let found = model(state, name, version);
            let row = found_index(&found);
            let work = async {
                let (index, meta) = found?;
                infer(state, index, meta, request, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, row, 0, work).await
        }
        Route::Embed(name) => {
            let found = model(state, name.unwrap_or(&state.models[0].info.name), None);
            let row = found_index(&found);
            let work = async {
                let (index, meta) = found?;
                let body = read_body(state, request).await?;
                tei::embed(state, index, meta, &body, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, row, 1, work).await
        }
        Route::Predict(name) => {
            let found = model(state, name.unwrap_or(&state.models[0].info.name), None);
            let row = found_index(&found);
            let work = async {
                let (index, meta) = found?;
                let body = read_body(state, request).await?;
                tei::predict(state, index, meta, &body, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, row, 2, work).await
        }
        Route::OpenAiEmbeddings => {
            // The model is named in the body; a name this server does not load (a client's
            // default) means the default model.
            let body = match read_body(state, request).await {
                Ok(body) => body,
                Err(e) => return counted(state, 0, 1, async { Err(e) }).await,
            };
            let request = openai::parse(&body);
            let wanted = request.as_ref().ok().and_then(|r| r.model.as_deref());
            let found = wanted.and_then(|name| model(state, name, None).ok()).unwrap_or((0, &state.models[0]));
            let work = async {
                let reply = openai::embeddings(state, found, request?, deadline).await?;
                Ok(versioned(reply, found.1))
            };
            counted(state, found.0, 1, work).await
        }
        Route::Info => Ok(tei::info(state, &state.models[0])),
        Route::Tokenize => tei::tokenize(state, &state.models[0], &read_body(state, request).await?),
        Route::Decode => tei::decode(state, &state.models[0], &read_body(state, request).await?),
        Route::Similarity => {
            let meta = &state.models[0];
            let work = async {
                let body = read_body(state, request).await?;
                tei::similarity(state, 0, meta, &body, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, 0, 1, work).await
        }
        Route::Rerank(name) => {
            let found = model(state, name.unwrap_or(&state.models[0].info.name), None);
            let row = found_index(&found);
            let work = async {
                let (index, meta) = found?;
                let body = read_body(state, request).await?;
                tei::rerank(state, index, meta, &body, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, row, 2, work).await
        }
        Route::EmbedAll => {
            let meta = &state.models[0];
            let work = async {
                let body = read_body(state, request).await?;
                tei::embed_all(state, 0, meta, &body, deadline).await.map(|r| versioned(r, meta))
            };
            counted(state, 0, 1, work).await
        }
        Route::Invocations => {
            let meta = &state.models[0];
            let endpoint = match meta.task {
                Task::Embedding => 1,
                Task::Classification => 2,
                Task::Raw => {
                    return Err(ApiError::BadRequest(format!(
                        "the default model '{}' has no pipeline; send its tensors to /v2/models/{0}/infer",
                        meta.info.name
                    )))
                }
            };
            let work = async {
                let body = read_body(state, request).await?;
                let reply = match endpoint {
                    1 => tei::embed(state, 0, meta, &body, deadline).await,
                    _ => tei::predict(state, 0, meta, &body, deadline).await,
                };
                reply.map(|r| versioned(r, meta))
            };
            counted(state, 0, endpoint, work).await
        }
        Route::Ping => Ok(readiness(ready)),
    }
}

/// Header with the client's time budget for a request, in milliseconds from its arrival: a
/// request still waiting for the model when it runs out is dropped and answered 504.
pub const DEADLINE_HEADER: &str = "x-inferd-deadline-ms";

fn deadline(request: &Request<Incoming>) -> Result<Option<Instant>, ApiError> {
    let Some(value) = request.headers().get(DEADLINE_HEADER) else { return Ok(None) };
    let ms = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| ApiError::BadRequest(format!("{DEADLINE_HEADER} must be a whole number of milliseconds")))?;
    Ok(Some(Instant::now() + std::time::Duration::from_millis(ms)))
}

/// The counter row of a looked-up model (unknown models share the last one).
pub fn found_index(found: &Result<(usize, &ModelMeta), ApiError>) -> usize {
    found.as_ref().map_or(MAX_MODELS, |(index, _)| *index)
}

/// Counts an inference request (by model, endpoint — an index of
/// `inferd_config::stats::ENDPOINTS` — and status code) and its latency in the counters the
/// supervisor reads, before the response is written: a client that got an answer was counted,
/// even if the worker is killed the next instant. A client that goes away first (hyper drops
/// this future) is counted as 499, and its request leaves `in_flight` all the same.
pub async fn counted<T: Answer>(
    state: &AppState,
    model: usize,
    endpoint: usize,
    work: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let mut guard = InFlight::enter(state, model, endpoint);
    let result = work.await;
    guard.answered(match &result {
        Ok(answer) => answer.code(),
        Err(e) => e.status().as_u16(),
    });
    result
}

/// The status code an answer is counted under.
pub trait Answer {
    fn code(&self) -> u16;
}

impl Answer for Reply {
    fn code(&self) -> u16 {
        self.status().as_u16()
    }
}

/// Status counted for a request whose client closed the connection before the answer.
pub const CLIENT_CLOSED: u16 = 499;

struct InFlight<'a> {
    state: &'a AppState,
    model: usize,
    endpoint: usize,
    started: Instant,
    code: u16,
}

impl<'a> InFlight<'a> {
    fn enter(state: &'a AppState, model: usize, endpoint: usize) -> InFlight<'a> {
        state.stats.in_flight(1);
        InFlight { state, model, endpoint, started: Instant::now(), code: CLIENT_CLOSED }
    }

    fn answered(&mut self, code: u16) {
        self.code = code;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let stats = &self.state.stats;
        stats.in_flight(-1);
        let seconds = self.started.elapsed().as_secs_f64();
        stats.count_request(self.model, self.endpoint, self.code);
        stats.observe_latency(Latency::Request, self.model, seconds);
        stats.answered(self.model, self.code, seconds);
    }
}

/// `x-inferd-model-version: <version label>+<sha256 prefix>`: which model answered, so a
/// client can see a rolling reload arrive.
fn versioned(mut reply: Reply, meta: &ModelMeta) -> Reply {
    if let Ok(v) = HeaderValue::from_str(&meta.info.full_version()) {
        reply.headers_mut().insert("x-inferd-model-version", v);
    }
    reply
}

fn readiness(ready: bool) -> Reply {
    if ready {
        json_reply(StatusCode::OK, b"{\"ready\":true}".to_vec())
    } else {
        json_reply(StatusCode::SERVICE_UNAVAILABLE, b"{\"ready\":false}".to_vec())
    }
}

fn server_metadata(state: &AppState) -> Reply {
    let body = json!({
        "name": "inferd",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["binary_tensor_data"],
        "models": state.models.iter().map(|m| &m.info.name).collect::<Vec<_>>(),
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

fn model_metadata(meta: &ModelMeta) -> Reply {
    let pipeline = pipeline_io(meta).map(|(input, outputs)| {
        let outputs: Vec<Value> = outputs
            .iter()
            .map(|(name, datatype, shape)| json!({"name": name, "datatype": datatype, "shape": shape}))
            .collect();
        json!({
            "task": meta.task,
            "inputs": [{"name": input, "datatype": "BYTES", "shape": [-1]}],
            "outputs": outputs,
        })
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&protocol::ModelMetadata::of(meta, pipeline)).expect("json"))
}

/// Finds a model by name (and version, when the path names one).
pub fn model<'a>(state: &'a AppState, name: &str, version: Option<&str>) -> Result<(usize, &'a ModelMeta), ApiError> {
    let (index, meta) = state.models.iter().enumerate().find(|(_, m)| m.info.name == name).ok_or_else(|| {
        let known: Vec<&str> = state.models.iter().map(|m| m.info.name.as_str()).collect();
        ApiError::NotFound(format!("unknown model '{name}'; this server has {}", known.join(", ")))
    })?;
    match version {
        Some(v) if v != meta.info.version => Err(ApiError::NotFound(format!(
            "model '{name}' has no version '{v}'; it serves version '{}'",
            meta.info.version
        ))),
        _ => Ok((index, meta)),
    }
}

/// The whole body, refusing more than `server.max_body_bytes` (early when Content-Length says so).
/// The body and its share of the worker's body-bytes budget, held until the request is done.
struct Body {
    bytes: Bytes,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

async fn read_body(state: &AppState, request: Request<Incoming>) -> Result<Body, ApiError> {
    let limit = state.max_body_bytes;
    let too_large = || {
        ApiError::TooLarge(format!("request body is larger than the limit of {limit} bytes (server.max_body_bytes)"))
    };
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    // Bodies being read or held by this worker may not add up past its budget: many large
    // requests at once get a fast 503 instead of exhausting memory.
    let claim = declared.unwrap_or(limit).max(1).min(u32::MAX as u64) as u32;
    let budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| {
        ApiError::Overloaded(format!(
            "too many request bytes in flight on this worker (server.max_body_bytes_in_flight = {}); retry shortly",
            state.body_budget_total
        ))
    })?;
    let read = request.extensions().get::<BodyRead>().cloned();
    let collect = Limited::new(request.into_body(), limit as usize).collect();
    let timeout = state.body_timeout;
    let bytes = tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| {
            ApiError::Timeout(format!("the request body did not arrive within {timeout:?} (server.body_timeout_secs)"))
        })?
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                too_large()
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes();
    if let Some(read) = read {
        read.0.store(true, Ordering::Relaxed);
    }
    Ok(Body { bytes, _budget: budget })
}

async fn infer(
    state: &AppState,
    index: usize,
    meta: &ModelMeta,
    request: Request<Incoming>,
    deadline: Option<Instant>,
) -> Result<Reply, ApiError> {
    let header_length = match request.headers().get(protocol::HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| ApiError::BadRequest("Inference-Header-Content-Length must be a byte count".into()))?,
        ),
    };
    let body = read_body(state, request).await?;
    let parsed = protocol::parse(&body, header_length).map_err(ApiError::BadRequest)?;
    let inferred = run_parsed(state, index, meta, parsed, deadline).await?;
    let mut reply = infer_reply(meta, inferred.id, inferred.outputs, &inferred.selection);
    if let Some(outcome) = &inferred.outcome {
        tasks::annotate(&mut reply, outcome);
    }
    Ok(reply)
}

/// A v2 request's answer before it is encoded (as JSON and binary data, or as protobuf).
pub struct Inferred {
    pub id: Option<String>,
    pub outputs: Vec<Tensor>,
    /// (index into `outputs`, binary): the outputs asked for, in the order asked.
    pub selection: Vec<(usize, bool)>,
    /// How a pipeline ran the request (for the Server-Timing header); `None` for raw tensors.
    pub outcome: Option<tasks::Outcome>,
}

/// Runs a parsed v2 request, REST or gRPC: one BYTES input named as the pipeline's goes
/// through the model's pipeline (text or image), anything else to the model's own tensors.
pub async fn run_parsed(
    state: &AppState,
    index: usize,
    meta: &ModelMeta,
    parsed: Parsed,
    deadline: Option<Instant>,
) -> Result<Inferred, ApiError> {
    let model = &meta.info.name;
    if let Some((input_name, outputs)) = pipeline_io(meta) {
        if parsed.inputs.len() == 1 && parsed.inputs[0].tensor.name == input_name {
            let names: Vec<&str> = outputs.iter().map(|o| o.0).collect();
            let selection = protocol::select_outputs(&parsed, &names, model).map_err(ApiError::BadRequest)?;
            let truncate = parsed.parameters.get("truncate").and_then(Value::as_bool).unwrap_or(false);
            let id = parsed.id.clone();
            let input = pipeline_input(meta, parsed)?;
            let outcome =
                tasks::run(state, index, meta, input, Options { truncate, deadline, ..Options::default() }).await?;
            let outputs = pipeline_tensors(&outcome.rows);
            return Ok(Inferred { id, outputs, selection, outcome: Some(outcome) });
        }
    }
    let names: Vec<&str> = meta.outputs.iter().map(|o| o.name.as_str()).collect();
    let selection = protocol::select_outputs(&parsed, &names, model).map_err(ApiError::BadRequest)?;
    let id = parsed.id.clone();
    let inputs = protocol::validate_inputs(parsed.inputs, meta).map_err(ApiError::BadRequest)?;
    let outputs = state.engine.infer(index, inputs, Join::Exact, deadline).await?;
    Ok(Inferred { id, outputs, selection, outcome: None })
}

fn infer_reply(meta: &ModelMeta, id: Option<String>, outputs: Vec<Tensor>, selection: &[(usize, bool)]) -> Reply {
    let (body, header_length) = protocol::infer_response(meta, id, outputs, selection);
    let mut reply = json_reply(StatusCode::OK, body);
    if let Some(n) = header_length {
        let headers = reply.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        headers.insert(protocol::HEADER_LENGTH, HeaderValue::from(n));
    }
    reply
}

pub type OutputSpec = (&'static str, &'static str, Vec<i64>);

/// The BYTES input a pipelined model takes through `/infer`, and the outputs it returns.
pub fn pipeline_io(meta: &ModelMeta) -> Option<(&'static str, Vec<OutputSpec>)> {
    let input = match &*meta.pipeline {
        Pipeline::Raw => return None,
        Pipeline::Text(_) => "text",
        Pipeline::Image(_) => "image",
    };
    let outputs = match meta.pipeline.head()? {
        Head::Embedding { .. } => vec![("embedding", "FP32", vec![-1, -1])],
        Head::Classification { labels, .. } => vec![
            ("label", "BYTES", vec![-1]),
            ("score", "FP32", vec![-1]),
            ("probabilities", "FP32", vec![-1, labels.len() as i64]),
        ],
    };
    Some((input, outputs))
}

/// The pipeline's input from a one-tensor request: UTF-8 texts, or encoded images (raw bytes
/// when sent as binary data, base64 when sent as JSON strings).
fn pipeline_input(meta: &ModelMeta, mut parsed: Parsed) -> Result<PipelineInput, ApiError> {
    let input = parsed.inputs.remove(0);
    let name = input.tensor.name;
    let TensorData::Bytes(items) = input.tensor.data else {
        return Err(ApiError::BadRequest(format!(
            "input '{name}': expected BYTES, got {}",
            input.tensor.data.dtype().name()
        )));
    };
    if !matches!(input.tensor.shape.as_slice(), [_] | [_, 1]) {
        return Err(ApiError::BadRequest(format!(
            "input '{name}': expected shape [n] or [n,1], got {}",
            protocol::shape_text(&input.tensor.shape)
        )));
    }
    let bad = |i: usize, what: &str| ApiError::BadRequest(format!("input '{name}': element {i} is not {what}"));
    match &*meta.pipeline {
        Pipeline::Text(_) => items
            .into_iter()
            .enumerate()
            .map(|(i, b)| String::from_utf8(b).map(Text::Single).map_err(|_| bad(i, "UTF-8 text")))
            .collect::<Result<_, _>>()
            .map(PipelineInput::Texts),
        _ if input.binary => Ok(PipelineInput::Images(items)),
        _ => items
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                base64::engine::general_purpose::STANDARD.decode(b.trim_ascii()).map_err(|_| bad(i, "base64"))
            })
            .collect::<Result<_, _>>()
            .map(PipelineInput::Images),
    }
}

/// The pipeline's result as v2 output tensors, named as [`pipeline_io`] lists them.
fn pipeline_tensors(rows: &Rows) -> Vec<Tensor> {
    match rows {
        Rows::Embeddings(rows) => {
            let dim = rows.first().map_or(0, Vec::len);
            vec![Tensor {
                name: "embedding".into(),
                shape: vec![rows.len() as i64, dim as i64],
                data: TensorData::F32(rows.concat()),
            }]
        }
        Rows::Tokens(rows) => {
            // Padded to the longest input (not asked for by any v2 route today).
            let width = rows.iter().map(Vec::len).max().unwrap_or(0);
            let dim = rows.iter().flatten().next().map_or(0, Vec::len);
            let mut data = vec![0f32; rows.len() * width * dim];
            for (r, tokens) in rows.iter().enumerate() {
                for (t, vector) in tokens.iter().enumerate() {
                    data[(r * width + t) * dim..][..dim].copy_from_slice(vector);
                }
            }
            vec![Tensor {
                name: "token_embeddings".into(),
                shape: vec![rows.len() as i64, width as i64, dim as i64],
                data: TensorData::F32(data),
            }]
        }
        Rows::Scores { labels, scores } => {
            let n = scores.len() as i64;
            let best: Vec<usize> = scores
                .iter()
                .map(|row| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i))
                .collect();
            vec![
                Tensor {
                    name: "label".into(),
                    shape: vec![n],
                    data: TensorData::Bytes(best.iter().map(|&i| labels[i].as_bytes().to_vec()).collect()),
                },
                Tensor {
                    name: "score".into(),
                    shape: vec![n],
                    data: TensorData::F32(best.iter().zip(scores).map(|(&i, row)| row[i]).collect()),
                },
                Tensor {
                    name: "probabilities".into(),
                    shape: vec![n, labels.len() as i64],
                    data: TensorData::F32(scores.concat()),
                },
            ]
        }
    }
}
