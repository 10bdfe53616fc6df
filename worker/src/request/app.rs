//! What every request handler touches, whatever its protocol (REST routes in `http`, TEI and
//! OpenAI handlers, gRPC): the worker's state, a model as handlers see it, the one error type
//! and its status codes, and the counting of each request in the counters the supervisor
//! reads. Which models there are, and their lookup: [`crate::request::models`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};

use inferd_config::auth::{bearer, ApiKeys, KeySettings, Refusal};
use inferd_ipc::stats::{Endpoint, Latency, WorkerCounters, MAX_MODELS};

use crate::pipeline::Pipeline;
use crate::request::models::Models;
use crate::runtime::engine::{Engine, EngineError};
use crate::runtime::model::{ModelError, ModelMeta};

/// A model as the handlers see it: what its sessions take and give ([`ModelMeta`], which it
/// dereferences to) and the pipeline around them. Made by the loader ([`crate::load`]).
#[derive(Debug, Clone)]
pub struct Model {
    pub meta: ModelMeta,
    /// Tokenizer or image decoding in front of the model, and pooling or scoring behind it.
    pub pipeline: Arc<Pipeline>,
}

impl std::ops::Deref for Model {
    type Target = ModelMeta;

    fn deref(&self) -> &ModelMeta {
        &self.meta
    }
}

/// Everything a request handler may touch.
pub struct AppState {
    pub worker: usize,
    /// The models it serves, the default first; on demand, those it may load.
    pub models: Models,
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
    pub stats: Arc<WorkerCounters>,
    /// log.access_log: one line per answered request.
    pub access_log: bool,
    /// The keys requests must carry ([auth]); None: every request is served.
    pub api_keys: Option<ApiKeys>,
    pub request_ids: RequestIds,
    /// Answers already computed ([cache]); None: off.
    pub cache: Option<crate::request::cache::Cache>,
}

impl AppState {
    /// Whether a request whose `Authorization` header (or gRPC metadata) is `authorization`
    /// may be served ([auth]); `health`: a health or readiness route. A refusal is counted by
    /// its reason; the key itself is never logged.
    /// The key's settings when keys are on and the route needs one.
    pub fn authorize(&self, authorization: Option<&[u8]>, health: bool) -> Result<Option<&KeySettings>, ApiError> {
        let Some(keys) = &self.api_keys else { return Ok(None) };
        if health && !keys.protect_health {
            return Ok(None);
        }
        keys.check(authorization.and_then(bearer)).map(Some).map_err(|refusal| {
            self.stats.count_auth_refusal(refusal);
            ApiError::Unauthorized(refusal)
        })
    }
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
    pub fn for_request(&self, given: Option<&HeaderValue>) -> HeaderValue {
        let usable = |v: &&HeaderValue| (1..=128).contains(&v.len()) && v.as_bytes().iter().all(u8::is_ascii_graphic);
        if let Some(v) = given.filter(usable) {
            return v.clone();
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = std::hash::BuildHasher::hash_one(&self.key, (std::process::id(), n));
        HeaderValue::from_str(&format!("{id:016x}")).expect("hex digits")
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    /// An input with nothing in it (an empty text): 400, TEI's `error_type: Empty`.
    #[error("{0}")]
    Empty(String),
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
    /// No API key, or not one of the server's ([auth]).
    #[error("{}", match .0 {
        Refusal::Missing => "this server needs an API key: send it as `Authorization: Bearer KEY`",
        Refusal::Invalid => "the API key is not valid",
    })]
    Unauthorized(Refusal),
}

impl ApiError {
    /// The only place an error becomes a status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) | ApiError::Empty(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed(..) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Model(ModelError::InvalidInput { .. }) => ApiError::BadRequest(e.to_string()),
            EngineError::Overloaded { .. } | EngineError::Unloaded => ApiError::Overloaded(e.to_string()),
            EngineError::DeadlineExceeded { .. } | EngineError::Stopped { .. } => {
                ApiError::DeadlineExceeded(e.to_string())
            }
            EngineError::Model(_) | EngineError::Gone | EngineError::Bug => ApiError::Internal(e.to_string()),
        }
    }
}

/// The counter row of a looked-up model: its own for a model loaded at boot, the shared last
/// row for an unknown model and for one loaded on demand ([`Engine::row`]).
pub fn found_index(state: &AppState, found: &Result<(usize, Arc<Model>), ApiError>) -> usize {
    found.as_ref().map_or(MAX_MODELS, |(index, _)| state.engine.row(*index))
}

/// Counts an inference request (by model, route family and status code) and its latency in
/// the counters the supervisor reads, before the response is written: a client that got an
/// answer was counted, even if the worker is killed the next instant. A client that goes away
/// first (hyper drops this future) is counted as 499, and its request leaves `in_flight` all
/// the same.
pub async fn counted<T: CountedAs>(
    state: &AppState,
    model: usize,
    endpoint: Endpoint,
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
pub trait CountedAs {
    fn code(&self) -> u16;
}

/// Status counted for a request whose client closed the connection before the answer.
pub const CLIENT_CLOSED: u16 = 499;

struct InFlight<'a> {
    state: &'a AppState,
    model: usize,
    endpoint: Endpoint,
    started: Instant,
    code: u16,
}

impl<'a> InFlight<'a> {
    fn enter(state: &'a AppState, model: usize, endpoint: Endpoint) -> InFlight<'a> {
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
