//! What a job is given beside its inputs ([`Terms`]), and what it gets back: where its time
//! went ([`Timing`]) or why it got no outputs ([`EngineError`]).

use std::time::{Duration, Instant};

use crate::runtime::model::ModelError;

/// What a request asks of the engine beside its inputs, given with each job by the request
/// layer (which learned it at the request's door).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Terms {
    /// 0, the default, the highest: a lane takes the waiting job of the highest priority
    /// first, and among equals the oldest, and older lower-priority work at least one run in
    /// [`dispatch::OVERTAKES`] + 1.
    pub priority: u8,
    /// Past this instant a job still waiting is dropped before it reaches the model (504).
    pub deadline: Option<Instant>,
}

/// Why a job got no outputs: the model's own error, or the engine's admission (a full queue, a
/// deadline that passed in it) and run clock.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the engine has stopped")]
    Gone,
    #[error("the model was unloaded (for memory) while this request waited for it; retry")]
    Unloaded,
    #[error("internal error: the server hit a bug running this request (logged); the worker is being replaced")]
    Bug,
    #[error(
        "overloaded: {waiting} requests are already waiting for this worker's model (server.max_queue); retry shortly"
    )]
    Overloaded { waiting: u64 },
    #[error(
        "overloaded: {waiting} requests are already waiting for this model ([batching] max_queue_size in its model.toml); retry shortly"
    )]
    ModelQueueFull { waiting: usize },
    #[error("the request's deadline passed after {waited:?} in the queue; it never reached the model")]
    DeadlineExceeded { waited: std::time::Duration },
    #[error("model '{model}' ran longer than server.request_timeout_secs = {limit} s and was stopped")]
    Stopped { model: String, limit: f64 },
}

/// Where a job's time in the engine went, as the worker's metrics count it: waiting for a
/// lane (`inferd_queue_duration_seconds`), and running on it (`inferd_compute_duration_seconds`:
/// the whole run of the batch it joined, a wait for a lent core included). The rest of the
/// time a request waits for the engine is handing the answer back to its I/O thread.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    pub queue: Duration,
    pub compute: Duration,
}

impl std::ops::AddAssign for Timing {
    fn add_assign(&mut self, other: Timing) {
        self.queue += other.queue;
        self.compute += other.compute;
    }
}
