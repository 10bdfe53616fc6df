//! The model thread: the one place sessions run.
//!
//! HTTP handlers never run inference on the async executor. They send a [`Job`] over a channel
//! and await its `oneshot` reply; the model thread takes jobs in order and runs them on the
//! worker's ORT thread pool. A dynamic batcher slots in here later: it would drain several
//! jobs from the same channel before one `run`.

use std::sync::{mpsc, Arc};
use std::time::Instant;

use inferd_config::stats::{Latency, Shared};
use tokio::sync::oneshot;

use crate::model::{Model, ModelError, Tensor};

struct Job {
    model: usize,
    inputs: Vec<Tensor>,
    queued_at: Instant,
    /// Past this the job is dropped before it reaches the model.
    deadline: Option<Instant>,
    reply: oneshot::Sender<Result<Vec<Tensor>, ModelError>>,
}

/// Test switch for the memory guards: with INFERD_TEST_LEAK_BYTES_PER_REQUEST=N in its
/// environment, a worker leaks N touched bytes per model run, like a model or library that
/// grows. Never set in production.
fn leak_for_tests() {
    static LEAK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let n = *LEAK.get_or_init(|| {
        std::env::var("INFERD_TEST_LEAK_BYTES_PER_REQUEST").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
    });
    if n > 0 {
        std::mem::forget(vec![1u8; n]);
    }
}

/// Handle to the model thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    // std's channel: the receiving side is a plain thread that blocks on recv().
    jobs: mpsc::Sender<Job>,
    stats: Arc<Shared>,
    /// Jobs allowed to wait; past it `infer` refuses at once (server.max_queue).
    max_queue: u64,
}

impl Engine {
    /// Moves the loaded models onto a new thread named `inferd-model`.
    /// Queue time, compute time and batch sizes go to `stats`, and so does a beat at least
    /// every second and the start of each run, which the supervisor watches for a stuck model.
    pub fn start(mut models: Vec<Model>, stats: Arc<Shared>, max_queue: usize) -> std::io::Result<Engine> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let counters = stats.clone();
        std::thread::Builder::new().name("inferd-model".into()).spawn(move || loop {
            counters.beat();
            let job = match queue.recv_timeout(std::time::Duration::from_secs(1)) {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            {
                counters.queued(-1);
                if job.reply.is_closed() {
                    continue; // the client went away while queued: skip the work
                }
                let started = Instant::now();
                if job.deadline.is_some_and(|d| started >= d) {
                    let waited = started - job.queued_at;
                    let _ = job.reply.send(Err(ModelError::DeadlineExceeded { waited }));
                    continue;
                }
                counters.observe_latency(Latency::Queue, job.model, (started - job.queued_at).as_secs_f64());
                let batch = job.inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(1).max(0) as u64;
                counters.observe_batch(job.model, batch);
                counters.busy(true);
                let result = models[job.model].run(job.inputs);
                counters.busy(false);
                leak_for_tests();
                counters.observe_latency(Latency::Compute, job.model, started.elapsed().as_secs_f64());
                let _ = job.reply.send(result);
            }
        })?;
        Ok(Engine { jobs, stats, max_queue: max_queue as u64 })
    }

    /// Runs model number `model` (its index in the worker's model list).
    pub async fn infer(
        &self,
        model: usize,
        inputs: Vec<Tensor>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Tensor>, ModelError> {
        // Backpressure: a full queue answers at once instead of growing its latency.
        let waiting = self.stats.queued_now();
        if waiting >= self.max_queue {
            return Err(ModelError::Overloaded { waiting });
        }
        let (reply, answer) = oneshot::channel();
        self.stats.queued(1);
        if self.jobs.send(Job { model, inputs, queued_at: Instant::now(), deadline, reply }).is_err() {
            self.stats.queued(-1);
            return Err(ModelError::EngineGone);
        }
        answer.await.map_err(|_| ModelError::EngineGone)?
    }
}
