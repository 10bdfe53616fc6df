//! The engine: the one place sessions run, and the dynamic batcher in front of them.
//!
//! HTTP handlers never run inference on the async executor. They hand a job (validated
//! tensors and a `oneshot` reply) to the dispatcher ([`dispatch`], under a lock: it keeps the
//! waiting jobs, forms batches and hands each to a free lane) and await the reply. A lane that
//! finishes takes its next batch from the dispatcher itself, so no thread stands between a
//! request and its lane. Threads, for a worker with T threads:
//! - `inferd-batch`: the dispatcher's timer (waits for company, reservations, run timeouts,
//!   deadlines, the beat, handing memory back);
//! - `inferd-lane-0` .. `inferd-lane-{T-1}` ([`lane`]): each owns a *narrow* session (one
//!   thread, its own) of every model and runs its batches on it; lane 0 also owns the *wide*
//!   sessions (all T threads) and runs a request that has the worker to itself there;
//! - with one thread (server.background_lane), `inferd-lane-bg`: the *background lane*, a
//!   second narrow session of every model that runs only heavy work ([`batch::HEAVY_TOKENS`]), its
//!   thread at [`lane::BACKGROUND_NICE`] on the worker's core. A long text then does not hold the
//!   worker's one lane: short requests keep running on lane 0, and the kernel gives them the
//!   core while both run (at nice +10 a thread gets ~10% of a core that a nice-0 thread wants).
//!
//! Batching ([`batch`]): the dispatcher takes the oldest job (the *anchor*) and adds the
//! waiting jobs that fit it: same model, tensors that agree in every dimension but the first
//! (text may also differ in length: rows are padded to the longest, none to more than twice
//! its own), within the model's `max_batch_size` rows and `max_batch_tokens` padded tokens,
//! and within this lane's share of what waits; closest in length first. The outputs are split
//! back by rows. A request past those limits (a bulk request of many long texts) is cut into
//! runs within them, queued one after another ([`Engine::submit`]), so it takes its turns with
//! other requests instead of holding a lane for seconds. With `max_queue_delay_ms` > 0 the
//! anchor waits up to that long after its arrival for company; with 0 (the default) only jobs
//! already waiting join, so an idle server adds no latency. A batch that fails (one request's bad values, an output without a batch
//! dimension) is rerun one job at a time, so a bad request fails alone. Long texts
//! ([`batch::HEAVY_TOKENS`]) may hold every lane but one while short ones keep coming, and go to the
//! background lane first where there is one.
//!
//! Lent cores ([`cores`], server.lend_idle_cores): a worker of one pinned thread claims its
//! core for each run in the pool's shared claims, and a lone request may also borrow a
//! sibling's idle core, whose wide session's second thread is pinned there; it runs narrow
//! when the sibling holds its core or was busy within [`dispatch::RECENT_LOAD`] (it waited for
//! its core, or ran a batch while other work waited or ran: [`dispatch::Work::loaded`]). Such a
//! worker has one lane, so any batch may run wide, not only a lone request: a worker that
//! the port's hashing gave every connection still uses an idle sibling's core. A run
//! waits for its own core while a sibling has it (at most that sibling's run), so the pool
//! never runs more threads than there are cores.
//!
//! Contract per job, batched or not: a job whose client went away is skipped, one past its
//! deadline is answered 504 without running, and the `queued` counter (which `max_queue`
//! reads) counts it until a lane takes it. A run longer than `server.request_timeout_secs` is
//! stopped through ORT's run options (the dispatcher watches the [`clock`]) and every
//! request in it is answered 504; the worker goes on serving.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use inferd_config::file::Allocator;
use inferd_ipc::balance::{Balance, Waiting};
use inferd_ipc::stats::WorkerCounters;
use tokio::sync::oneshot;

use crate::runtime::model::{ModelError, ModelSession};
use crate::runtime::tensor::Tensor;

mod batch;
mod clock;
mod cores;
mod dispatch;
mod lane;
mod terms;

pub use batch::Join;
use batch::{Job, Policy};
use clock::RunClock;
pub use cores::Cores;
use dispatch::{Dispatcher, Event, Shared, Work};
pub(crate) use lane::shift_nice;
use lane::{counter_row, Lane, LaneSessions, IDLE_POLL};
pub use terms::{EngineError, Terms, Timing};

/// One model's sessions, which only the engine runs (the handlers see the model's
/// [`crate::runtime::model::ModelMeta`]).
pub struct Sessions {
    /// One narrow session (1 thread: its caller) per lane.
    pub narrow: Vec<ModelSession>,
    /// A session on the worker's whole thread pool, when the worker has more than one thread,
    /// or on its core and the one it may borrow ([`Cores`]).
    pub wide: Option<ModelSession>,
    /// The background lane's narrow session (a worker of one thread, server.background_lane).
    pub background: Option<ModelSession>,
}

impl Sessions {
    /// Runs each session once per configured batch size ([`ModelSession::warm_up`]).
    pub fn warm_up(&mut self) -> Result<(), ModelError> {
        let Sessions { narrow, wide, background } = self;
        narrow.iter_mut().chain(wide.as_mut()).chain(background.as_mut()).try_for_each(ModelSession::warm_up)
    }
}

/// What a worker's engine shares with its siblings: its part in the pool's core claims, when
/// it lends ([`Cores`]); and the pool's table, where the priorities its requests came with are
/// seen by every worker (`dispatch`: lower-priority work keeps off lane 0 while more urgent
/// work comes, wherever the pool's balance moves its connection).
#[derive(Default)]
pub struct Pool {
    pub cores: Option<Cores>,
    pub priorities: Option<Balance>,
    /// This worker's row of the pool's waiting counts (models' `max_queue_size`).
    pub waiting: Option<Waiting>,
}

/// Handle to the lanes; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    dispatcher: Arc<Shared>,
    stats: Arc<WorkerCounters>,
    /// Jobs allowed to wait; past it `infer` refuses at once (server.max_queue).
    max_queue: u64,
    /// Each model's limits, by which a request past them is cut into runs ([`batch::runs`]),
    /// and its name, by model number.
    policies: Arc<std::sync::RwLock<HashMap<usize, (Policy, String)>>>,
    /// Each lane's sessions ([`LaneSessions`]), and what a model's [`Sessions`] must hold for
    /// them.
    sessions: Arc<[Mutex<LaneSessions>]>,
    shape: (usize, bool, bool),
    /// The number the next model added gets: numbers are never used twice, so a job for a
    /// model removed meanwhile never runs on another.
    next: Arc<std::sync::atomic::AtomicUsize>,
    /// How many models the engine started with ([`counter_row`]).
    started_with: usize,
    /// server.request_timeout_secs: bounds each run, and a request cut into runs as a whole.
    run_timeout: Duration,
    /// Dropped with the last handle: the lanes hold the dispatcher too, so it alone never tells
    /// the timer that nobody will send again.
    _alive: Arc<()>,
}

impl Engine {
    /// Jobs allowed to wait for a lane (server.max_queue); past it a request is refused at
    /// once.
    pub fn max_queue(&self) -> u64 {
        self.max_queue
    }

    /// Starts the dispatcher's timer thread (`inferd-batch`) and one thread per lane
    /// (`inferd-lane-N`), each owning the narrow session of every model for its lane; lane 0
    /// also owns the wide sessions. `models[m].narrow.len()` is the number of lanes, the same for every model.
    ///
    /// Scheduling (see [`dispatch`]): one request runs *wide* (on every thread of the worker)
    /// when it is the only work there is and requests have not overlapped lately; otherwise
    /// batches run *narrow*, one per lane, side by side, and nothing runs wide until every lane
    /// is free again. So a lone request uses all the worker's cores, and a loaded worker pays
    /// no thread synchronisation.
    ///
    /// Queue time, compute time and batch sizes go to `stats`, and so does a beat at least
    /// every second and the start of the oldest run in progress, which the supervisor watches
    /// for a stuck model. `pool`: what it shares with its siblings.
    pub fn start(
        models: Vec<Sessions>,
        stats: Arc<WorkerCounters>,
        max_queue: usize,
        run_timeout: Duration,
        poll_when_idle: bool,
        allocator: Allocator,
        pool: Pool,
    ) -> std::io::Result<Engine> {
        let Pool { cores, priorities, waiting } = pool;
        let cores = cores.map(Arc::new);
        let poll_when_idle = if poll_when_idle { IDLE_POLL } else { Duration::ZERO };
        let lanes = models.first().map_or(1, |m| m.narrow.len()).max(1);
        let has_wide = models.iter().all(|m| m.wide.is_some()) && !models.is_empty();
        let has_background = models.iter().all(|m| m.background.is_some()) && !models.is_empty();
        let policies: Vec<(Policy, String)> =
            models.iter().map(|m| (Policy::of(&m.narrow[0]), m.narrow[0].name().to_string())).collect();
        let started_with = policies.len();
        let alive = Arc::new(());
        let all = lanes + usize::from(has_background);
        let clock = Arc::new(RunClock::new(all, stats.clone(), run_timeout, allocator).map_err(std::io::Error::other)?);
        // Regroup by lane: lane l gets the l-th narrow session of every model; the background
        // lane, when there is one, comes last.
        let mut per_lane: Vec<LaneSessions> = (0..all).map(|_| LaneSessions::default()).collect();
        for (number, set) in models.into_iter().enumerate() {
            for (lane, model) in set.narrow.into_iter().chain(set.background).enumerate() {
                per_lane[lane].narrow.insert(number, model);
            }
            per_lane[0].wide.extend(set.wide.filter(|_| has_wide).map(|w| (number, w)));
        }
        let sessions: Arc<[Mutex<LaneSessions>]> = per_lane.into_iter().map(Mutex::new).collect();
        let (senders, queues): (Vec<_>, Vec<_>) = (0..all).map(|_| mpsc::channel::<Work>()).unzip();
        let borrows = cores.as_ref().is_some_and(|c| c.borrow.is_some());
        let limits = policies.iter().map(|p| p.0.clone()).collect();
        let dispatcher =
            Dispatcher::new(limits, senders, has_wide, stats.clone(), clock.clone(), Arc::downgrade(&alive));
        let dispatcher = if borrows && lanes == 1 { dispatcher.with_wide_batches() } else { dispatcher };
        let dispatcher = if has_background { dispatcher.with_background_lane() } else { dispatcher };
        let dispatcher = match priorities {
            Some(table) => dispatcher.with_pool_priorities(table),
            None => dispatcher,
        };
        let dispatcher = match waiting {
            Some(row) => dispatcher.with_pool_waiting(row),
            None => dispatcher,
        };
        let dispatcher = Arc::new(Shared::new(dispatcher));
        for (index, queue) in queues.into_iter().enumerate() {
            let background = index == lanes;
            let lane = Lane {
                index,
                sessions: sessions.clone(),
                started_with,
                has_wide: index == 0 && has_wide,
                dispatcher: dispatcher.clone(),
                counters: stats.clone(),
                clock: clock.clone(),
                poll_when_idle,
                // The background lane claims no core: it runs only where lane 0 leaves room.
                cores: cores.clone().filter(|_| !background),
                background,
            };
            let name = if background { "inferd-lane-bg".to_string() } else { format!("inferd-lane-{index}") };
            std::thread::Builder::new().name(name).spawn(move || lane.run(queue))?;
        }
        let timer = dispatcher.clone();
        std::thread::Builder::new().name("inferd-batch".into()).spawn(move || timer.run_timer())?;
        Ok(Engine {
            dispatcher,
            stats,
            max_queue: max_queue as u64,
            policies: Arc::new(std::sync::RwLock::new(policies.into_iter().enumerate().collect())),
            sessions,
            shape: (lanes, has_wide, has_background),
            next: Arc::new(started_with.into()),
            started_with,
            run_timeout,
            _alive: alive,
        })
    }

    /// Adds a model loaded while the engine serves (on demand), its sessions shaped as those
    /// of the models it started with (a narrow session per lane, and the wide and background
    /// ones where those are); returns its model number, one no model had before. No job can
    /// name the model before this returns.
    pub fn add(&self, sessions: Sessions) -> Result<usize, String> {
        let (lanes, has_wide, has_background) = self.shape;
        if sessions.narrow.len() != lanes
            || sessions.wide.is_some() != has_wide
            || sessions.background.is_some() != has_background
        {
            return Err(format!(
                "the model's sessions ({} narrow, wide {}, background {}) do not fit the engine's lanes ({lanes}, wide {has_wide}, background {has_background})",
                sessions.narrow.len(),
                sessions.wide.is_some(),
                sessions.background.is_some()
            ));
        }
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let policy = (Policy::of(&sessions.narrow[0]), sessions.narrow[0].name().to_string());
        // Each lock waits at most for its lane's run in progress.
        for (lane, session) in sessions.narrow.into_iter().chain(sessions.background).enumerate() {
            self.lane(lane).narrow.insert(number, session);
        }
        if let Some(wide) = sessions.wide {
            self.lane(0).wide.insert(number, wide);
        }
        self.dispatcher.add_policy(number, policy.0.clone());
        self.policies.write().unwrap_or_else(|e| e.into_inner()).insert(number, policy);
        Ok(number)
    }

    /// Removes model number `model` and drops its sessions (their memory goes back before this
    /// returns); a job for it that still waits is answered [`EngineError::Unloaded`]. Each lane
    /// gives its session up once its run in progress, if any, is over.
    pub fn remove(&self, model: usize) {
        self.policies.write().unwrap_or_else(|e| e.into_inner()).remove(&model);
        self.dispatcher.remove_policy(model);
        let mut dropped = Vec::new();
        for lane in 0..self.sessions.len() {
            let mut sessions = self.lane(lane);
            dropped.extend(sessions.narrow.remove(&model));
            dropped.extend(sessions.wide.remove(&model));
        }
        // Outside the lanes' locks: a session's release takes a while.
        drop(dropped);
    }

    fn lane(&self, lane: usize) -> std::sync::MutexGuard<'_, LaneSessions> {
        self.sessions[lane].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs model number `model` (its index in the worker's model list) on `inputs`, batched
    /// with other requests where `join` and the model's limits allow. A request past the
    /// limits is cut into runs within them ([`batch::runs`]), queued one after another: each
    /// takes its turn with what else waits, a client that goes away stops the rest, and none
    /// is queued once the request has taken `run_timeout` (504, as for a run that long).
    /// Returns the outputs and where the time went (summed over the runs).
    pub async fn submit(
        &self,
        model: usize,
        inputs: Vec<Tensor>,
        join: Join,
        terms: Terms,
    ) -> Result<(Vec<Tensor>, Timing), EngineError> {
        // Backpressure: a full queue answers at once instead of growing its latency. A request
        // cut into runs is admitted once, not refused half done.
        let waiting = self.stats.queued_now();
        if waiting >= self.max_queue {
            return Err(EngineError::Overloaded { waiting });
        }
        let known = self.policies.read().unwrap_or_else(|e| e.into_inner()).get(&model).cloned();
        let Some((policy, name)) = known else {
            return Err(EngineError::Unloaded);
        };
        let Some((rows, runs)) = batch::runs(&inputs, join, &policy) else {
            return self.queue(model, inputs, join, terms).await;
        };
        let stop_at = Instant::now() + self.run_timeout;
        let mut parts = Vec::with_capacity(runs.len());
        let mut sizes = Vec::with_capacity(runs.len());
        let mut timing = Timing::default();
        let mut terms = terms;
        for range in runs {
            if Instant::now() >= stop_at {
                return Err(EngineError::Stopped { model: name.clone(), limit: self.run_timeout.as_secs_f64() });
            }
            let n = range.len();
            let (part, spent) = self.queue(model, batch::take_rows(&inputs, range, rows), join, terms).await?;
            timing += spent;
            // Its run has begun: the rest of its pieces complete it, deadline or not.
            terms.deadline = None;
            // An output without the piece's rows (a model whose output has no batch dimension
            // after all) cannot be joined: the request runs whole, as it would have.
            if part.iter().any(|t| t.shape.first() != Some(&(n as i64))) {
                return self.queue(model, inputs, join, terms).await;
            }
            sizes.push(n);
            parts.push(part);
        }
        match batch::concat(parts, &sizes, join) {
            Some(outputs) => Ok((outputs, timing)),
            // Pieces whose outputs disagree beyond their rows: likewise.
            None => self.queue(model, inputs, join, terms).await,
        }
    }

    /// Model number `model`'s row in the shared counters ([`counter_row`]).
    pub fn row(&self, model: usize) -> usize {
        counter_row(model, self.started_with)
    }

    /// Queues one job and awaits its answer.
    async fn queue(
        &self,
        model: usize,
        inputs: Vec<Tensor>,
        join: Join,
        terms: Terms,
    ) -> Result<(Vec<Tensor>, Timing), EngineError> {
        let begun = Instant::now();
        let (reply, mut answer) = oneshot::channel();
        self.stats.queued(1);
        let queued = crate::trace::enabled().then(std::time::SystemTime::now);
        let job = Job::new(model, inputs, join, terms, reply);
        let start = job.start.clone();
        // Dropped unanswered if the engine is going down: EngineGone below.
        self.dispatcher.handle(Event::Job(job));
        let answered = match terms.deadline {
            None => answer.await,
            // Answered at its deadline if no lane has begun it by then (the lane that reaches
            // it later skips it); a run that began is awaited to its end.
            Some(deadline) => tokio::select! {
                answered = &mut answer => answered,
                () = tokio::time::sleep_until(deadline.into()) => match start.give_up() {
                    true => return Err(EngineError::DeadlineExceeded { waited: deadline.saturating_duration_since(begun) }),
                    false => answer.await,
                },
            },
        };
        let answered = answered.map_err(|_| EngineError::Gone)?;
        // Its wait for a lane, as a stage of its request (the run is a span of its own).
        if let (Some(queued), Ok((_, timing))) = (queued, &answered) {
            crate::trace::stage("queue wait", queued, queued + timing.queue, Vec::new());
        }
        answered
    }
}
