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
use inferd_config::model::Task;
use inferd_ipc::limits::{now_ns, KeyLimits, Over, Pass, Seat};
use inferd_ipc::stats::{Endpoint, Latency, WorkerCounters, MAX_MODELS};

use crate::pipeline::{Head, Pipeline, TextPipeline};
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

impl Model {
    /// Its text pipeline where it is a cross-encoder (a text classification model with one
    /// label), what reranking needs (TEI's `/rerank`, Cohere's); `endpoint` names the route
    /// in the refusal otherwise.
    pub fn cross_encoder(&self, endpoint: &str) -> Result<&TextPipeline, ApiError> {
        let name = &self.info.name;
        match (&*self.pipeline, self.task) {
            (Pipeline::Text(p), Task::Classification) => match &p.head {
                Head::Classification { labels, .. } if labels.len() == 1 => Ok(p),
                Head::Classification { labels, .. } => Err(ApiError::BadRequest(format!(
                    "{endpoint} needs a cross-encoder (a classification model with one label), but '{name}' has {} \
                     labels",
                    labels.len()
                ))),
                Head::Embedding { .. } => Err(ApiError::BadRequest(format!("'{name}' is not a cross-encoder"))),
            },
            _ => Err(ApiError::BadRequest(format!(
                "{endpoint} needs a cross-encoder (a text classification model with one label); '{name}' is not one"
            ))),
        }
    }
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
    /// This worker's row in the pool's table of API key limits and counts
    /// (`inferd_ipc::limits`); None: requests are neither limited nor counted by key.
    pub limits: Option<Seat>,
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

    /// Admits a request of `key` (None: no keys on this route) at `priority` within the key's
    /// rate and concurrency, pool-wide, and counts it by key name and priority. The answer
    /// holds the request's place in the key's concurrency until dropped, and the `RateLimit`
    /// header to send with it.
    pub fn admit(&self, key: Option<&KeySettings>, priority: u8) -> Result<Admission<'_>, ApiError> {
        let Some(seat) = &self.limits else { return Ok(Admission::default()) };
        let (name, limits) = match key {
            Some(k) => (
                k.name.as_str(),
                KeyLimits { rate: k.rate.map(|r| (r.interval_ns(), r.burst)), concurrency: k.concurrency },
            ),
            None => ("", KeyLimits { rate: None, concurrency: None }),
        };
        let policy = key.and_then(|k| k.rate).map(|rate| {
            let window = (rate.interval_ns() as u128 * rate.burst as u128).div_ceil(1_000_000_000);
            format!("\"key\";q={};w={window}", rate.burst)
        });
        let admitted = seat.admit(name, priority, limits, now_ns()).map_err(|over| match over {
            Over::Rate { retry_ns } => ApiError::TooManyRequests(
                format!(
                    "API key {name:?} is over its rate of {}: the next request is admitted in {:.3} s",
                    key.and_then(|k| k.rate).map_or(String::new(), |r| r.to_string()),
                    retry_ns as f64 / 1e9
                ),
                RateHeaders {
                    policy: policy.clone().unwrap_or_default(),
                    state: format!("\"key\";r=0;t={}", seconds(retry_ns)),
                    retry_after: Some(seconds(retry_ns)),
                },
            ),
            Over::Concurrency { limit } => ApiError::TooManyRequests(
                format!("API key {name:?} has {limit} requests in flight, its concurrency limit: retry when one is answered"),
                RateHeaders { policy: String::new(), state: String::new(), retry_after: Some(1) },
            ),
        })?;
        static WARNED: AtomicBool = AtomicBool::new(false);
        if admitted.untracked && !WARNED.swap(true, Ordering::Relaxed) {
            tracing::error!(
                key = name,
                "the pool's table of API key limits is full: keys it has no room for are served without their \
                 limits (a restart of the supervisor empties it)"
            );
        }
        let headers = admitted.standing.zip(policy).map(|(standing, policy)| RateHeaders {
            policy,
            state: format!("\"key\";r={};t={}", standing.remaining, seconds(standing.reset_ns)),
            retry_after: None,
        });
        Ok(Admission { _pass: admitted.pass, headers })
    }
}

/// Whole seconds, rounded up, at least 1 (Retry-After and `RateLimit`'s `t`).
fn seconds(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

/// A request admitted by [`AppState::admit`].
#[derive(Default)]
pub struct Admission<'a> {
    /// Its place in its key's concurrency, given back when dropped.
    _pass: Option<Pass<'a>>,
    /// Its key's standing against its rate, when the key has one.
    pub headers: Option<RateHeaders>,
}

/// The headers of an answer to a key with a rate (draft-ietf-httpapi-ratelimit-headers):
/// `RateLimit-Policy` (the burst, and the seconds it takes to come back whole) and `RateLimit`
/// (what is left of it, and the seconds until it is whole again); and Retry-After on a 429.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub policy: String,
    pub state: String,
    pub retry_after: Option<u64>,
}

impl RateHeaders {
    pub fn apply(&self, headers: &mut hyper::HeaderMap) {
        for (name, value) in [("ratelimit-policy", &self.policy), ("ratelimit", &self.state)] {
            match HeaderValue::from_str(value) {
                Ok(value) if !value.is_empty() => drop(headers.insert(name, value)),
                _ => {}
            }
        }
        if let Some(seconds) = self.retry_after {
            headers.insert(hyper::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
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
    /// Over its API key's rate or concurrency: 429, with Retry-After and `RateLimit` headers.
    #[error("{0}")]
    TooManyRequests(String, RateHeaders),
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
            ApiError::TooManyRequests(..) => StatusCode::TOO_MANY_REQUESTS,
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
