//! The worker's state, which every request handler may touch whatever its protocol, and the
//! counting of each request in the counters the supervisor reads. Which models there are, and
//! their lookup: [`crate::request::models`]; the door requests enter by: [`crate::request::door`].

use std::sync::Arc;
use std::time::Instant;

use inferd_config::auth::ApiKeys;
use inferd_config::restricted::Restrictions;
use inferd_ipc::limits::Seat;
use inferd_ipc::stats::{Endpoint, Latency, WorkerCounters, MAX_MODELS};

use crate::kserve::SharedMemory;
use crate::request::cache::Cache;
use crate::request::call::RequestIds;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::models::Models;
use crate::runtime::engine::Engine;

/// Everything a request handler may touch.
pub struct AppState {
    pub worker: usize,
    /// What server metadata calls the server (server.name).
    pub server_name: String,
    /// The share of new requests traced; None: tracing off ([tracing], Triton's trace settings).
    pub trace_ratio: Option<f64>,
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
    pub ready: std::sync::atomic::AtomicBool,
    /// Counters shared with the supervisor (requests, latencies, batch sizes, in flight).
    pub stats: Arc<WorkerCounters>,
    /// log.access_log: one line per answered request.
    pub access_log: bool,
    /// The keys requests must carry ([auth]); None: every request is served.
    pub api_keys: Option<ApiKeys>,
    /// API categories that need a header ([[auth.restricted]]).
    pub restricted: Restrictions,
    pub request_ids: RequestIds,
    /// Answers already computed ([cache]); None: off.
    pub cache: Option<Cache>,
    /// This worker's row in the pool's table of API key limits and counts
    /// (`inferd_ipc::limits`); None: requests are neither limited nor counted by key.
    pub limits: Option<Seat>,
    /// The socketpair to the supervisor: what the pool as a whole knows (Triton's statistics
    /// and repository index) is asked there.
    pub supervisor: Arc<crate::request::link::Link>,
    /// The pool's registry of Triton's system shared-memory regions; None: none is taken.
    pub shared_memory: Option<inferd_ipc::shm::Registry>,
}

impl AppState {
    /// Where a v2 request's tensors in shared memory are read: the pool's registry, at most a
    /// body's bound (server.max_body_bytes) per request.
    pub fn shared_memory_reader(&self) -> SharedMemory<'_> {
        SharedMemory { registry: self.shared_memory.as_ref(), limit: self.max_body_bytes as usize }
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
