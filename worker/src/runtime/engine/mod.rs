//! The engine: the one place sessions run, and the dynamic batcher in front of them.
//!
//! HTTP handlers never run inference on the async executor. They hand a job (validated
//! tensors and a `oneshot` reply) to the dispatcher ([`dispatch`], under a lock: it keeps the
//! waiting jobs, forms batches and hands each to a free lane) and await the reply. A lane that
//! finishes takes its next batch from the dispatcher itself, so no thread stands between a
//! request and its lane. Threads, for a worker with T threads:
//! - `inferd-batch`: the dispatcher's timer (waits for company, reservations, run timeouts,
//!   deadlines, the beat, handing memory back);
//! - `inferd-lane-0` .. `inferd-lane-{T-1}` ([`Lane`]): each owns a *narrow* session (one
//!   thread, its own) of every model and runs its batches on it; lane 0 also owns the *wide*
//!   sessions (all T threads) and runs a request that has the worker to itself there;
//! - with one thread (server.background_lane), `inferd-lane-bg`: the *background lane*, a
//!   second narrow session of every model that runs only heavy work ([`HEAVY_TOKENS`]), its
//!   thread at [`BACKGROUND_NICE`] on the worker's core. A long text then does not hold the
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
//! ([`HEAVY_TOKENS`]) may hold every lane but one while short ones keep coming, and go to the
//! background lane first where there is one.
//!
//! Lent cores ([`Cores`], server.lend_idle_cores): a worker of one pinned thread claims its
//! core for each run in the pool's shared claims, and a lone request may also borrow a
//! sibling's idle core, whose wide session's second thread is pinned there; it runs narrow
//! when the sibling holds its core or was busy within [`dispatch::RECENT_LOAD`] (it waited for
//! its core, or ran a batch while other work waited or ran: [`Work::loaded`]). Such a
//! worker has one lane, so any batch may run wide, not only a lone request: a worker that
//! the port's hashing gave every connection still uses an idle sibling's core. A run
//! waits for its own core while a sibling has it (at most that sibling's run), so the pool
//! never runs more threads than there are cores.
//!
//! Contract per job, batched or not: a job whose client went away is skipped, one past its
//! deadline is answered 504 without running, and the `queued` counter (which `max_queue`
//! reads) counts it until a lane takes it. A run longer than `server.request_timeout_secs` is
//! stopped through ORT's run options (the dispatcher watches the [`RunClock`]) and every
//! request in it is answered 504; the worker goes on serving.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use inferd_config::file::Allocator;
use inferd_ipc::stats::{Latency, WorkerCounters, MAX_MODELS};
use opentelemetry::KeyValue;
use tokio::sync::oneshot;
use tracing::warn;

use crate::runtime::model::{ModelError, ModelSession};
use crate::runtime::tensor::Tensor;

mod batch;
mod dispatch;

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

pub use batch::Join;
use batch::{merge, split, Job, Policy};
use dispatch::{Dispatcher, Shared};

/// A job of at least this many tokens (rows x padded length; other jobs count their rows) is
/// *heavy*: one 256-token MiniLM text takes ~70 ms on one thread, 14x a short sentence. Heavy
/// jobs may occupy all lanes but one while lighter jobs wait, so a stream of long texts does
/// not hold short ones up behind it (measured: short texts' p99 went from 61 ms alone to 1.5 s
/// with one request in 8 of 256 tokens before this rule).
const HEAVY_TOKENS: usize = 256;

/// How much nicer than the worker the background lane's thread runs: at +10 the kernel's
/// weights give it ~10% of a core that lane 0 also wants (1024 against 110), and all of one
/// that nobody else wants.
const BACKGROUND_NICE: i32 = 10;

/// After a lone request's wide run, how long lane 0 polls for its next batch before it sleeps
/// ([`Engine::start`]'s `poll_when_idle`). A client that sends its next request as soon as it
/// has an answer finds it awake: on the 2-core development machine, 0.12 ms less per lone
/// request (p50 2.36 -> 2.24 ms with MiniLM, when a dispatcher thread polled too), for at most
/// this much CPU per request.
const IDLE_POLL: Duration = Duration::from_micros(300);

/// How often at most a lane looks whether more than [`crate::runtime::allocator::FREE_LIMIT`]
/// lies free after its runs.
const TRIM_CHECK_EVERY: Duration = Duration::from_millis(100);

/// Waits for a message, checking for one for `poll` (yielding the CPU between checks) before
/// blocking: a thread that blocks takes a wake-up to start again.
fn recv_polling<T>(rx: &mpsc::Receiver<T>, poll: Duration) -> Result<T, mpsc::RecvError> {
    let started = Instant::now();
    while !poll.is_zero() {
        match rx.try_recv() {
            Ok(message) => return Ok(message),
            Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
            Err(mpsc::TryRecvError::Empty) if started.elapsed() >= poll => break,
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    rx.recv()
}

/// Test switch for the memory guards: with INFERD_TEST_LEAK_BYTES_PER_REQUEST=N in its
/// environment, a worker leaks N touched bytes per model run, like a model or library that
/// grows. Only in builds with the `test-switches` feature (`make test`'s), not releases.
#[cfg(not(feature = "test-switches"))]
fn leak_for_tests() {}

#[cfg(feature = "test-switches")]
fn leak_for_tests() {
    static LEAK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let n = *LEAK.get_or_init(|| {
        std::env::var("INFERD_TEST_LEAK_BYTES_PER_REQUEST").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
    });
    if n > 0 {
        // black_box: an allocation nobody reads or frees may otherwise be optimised away.
        std::mem::forget(std::hint::black_box(vec![1u8; n]));
    }
}

/// A worker's part in the pool's core claims (see [`inferd_ipc::cores`]).
pub struct Cores {
    claims: inferd_ipc::cores::CoreClaims,
    /// Its own core.
    home: usize,
    /// The sibling's core its wide sessions' second thread is pinned to.
    borrow: Option<usize>,
    pid: u32,
}

impl Cores {
    pub fn new(claims: inferd_ipc::cores::CoreClaims, home: usize, borrow: Option<usize>) -> Cores {
        Cores { claims, home, borrow, pid: std::process::id() }
    }

    /// Claims the worker's core for a run (waiting while a sibling has it) and, when `wide`,
    /// borrows the sibling's if it is free and its owner was not busy lately.
    fn hold(&self, wide: bool, counters: &WorkerCounters) -> Held<'_> {
        if self.claims.take(self.home, self.pid) {
            counters.lending(true);
        }
        let borrowed = match self.borrow {
            Some(cpu) if wide => self.claims.try_borrow(cpu, self.pid, dispatch::RECENT_LOAD).then_some(cpu),
            _ => None,
        };
        if borrowed.is_some() {
            counters.lending(false);
        }
        Held { cores: self, borrowed }
    }
}

/// The cores a run holds, given back when it ends (or panics).
struct Held<'a> {
    cores: &'a Cores,
    borrowed: Option<usize>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let Cores { claims, home, pid, .. } = self.cores;
        if let Some(cpu) = self.borrowed {
            claims.release(cpu, *pid);
        }
        claims.release(*home, *pid);
    }
}

/// Why a job got no outputs: the model's own error, or the engine's admission (a full queue, a
/// deadline that passed in it) and run clock.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the model thread has stopped")]
    Gone,
    #[error("the model was unloaded (for memory) while this request waited for it; retry")]
    Unloaded,
    #[error("internal error: the server hit a bug running this request (logged); the worker is being replaced")]
    Bug,
    #[error(
        "overloaded: {waiting} requests are already waiting for this worker's model (server.max_queue); retry shortly"
    )]
    Overloaded { waiting: u64 },
    #[error("the request's deadline passed after {waited:?} in the queue; it never reached the model")]
    DeadlineExceeded { waited: std::time::Duration },
    #[error("model '{model}' ran longer than server.request_timeout_secs = {limit} s and was stopped")]
    Stopped { model: String, limit: f64 },
}

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

/// Handle to the model threads; cheap to clone.
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

/// What the dispatcher is told: a new job from the I/O thread, or a lane that finished.
enum Event {
    Job(Job),
    Done { lane: usize },
}

/// A batch for a lane, to run on its narrow sessions or (lane 0 only) the wide ones.
struct Work {
    batch: Vec<Job>,
    wide: bool,
    /// Other work waited or ran beside it: with lent cores, the worker marks its core busy so
    /// that siblings do not borrow it now.
    loaded: bool,
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
    /// for a stuck model. `cores`: the worker's part in the pool's core claims, when it lends.
    pub fn start(
        models: Vec<Sessions>,
        stats: Arc<WorkerCounters>,
        max_queue: usize,
        run_timeout: Duration,
        poll_when_idle: bool,
        allocator: Allocator,
        cores: Option<Cores>,
    ) -> std::io::Result<Engine> {
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
        for range in runs {
            if Instant::now() >= stop_at {
                return Err(EngineError::Stopped { model: name.clone(), limit: self.run_timeout.as_secs_f64() });
            }
            let n = range.len();
            let (part, spent) = self.queue(model, batch::take_rows(&inputs, range, rows), join, terms).await?;
            timing += spent;
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
        let (reply, answer) = oneshot::channel();
        self.stats.queued(1);
        let queued = crate::trace::enabled().then(std::time::SystemTime::now);
        // Dropped unanswered if the engine is going down: EngineGone below.
        self.dispatcher.handle(Event::Job(Job::new(model, inputs, join, terms, reply)));
        let answered = answer.await.map_err(|_| EngineError::Gone)?;
        // Its wait for a lane, as a stage of its request (the run is a span of its own).
        if let (Some(queued), Ok((_, timing))) = (queued, &answered) {
            crate::trace::stage("queue wait", queued, queued + timing.queue, Vec::new());
        }
        answered
    }
}

/// The start of each lane's current run, so the supervisor sees the oldest one (a stuck lane
/// stays visible while another keeps finishing runs), and the means to stop a run that
/// overstays: each lane runs with its own ORT run options, which [`RunClock::stop_overdue`]
/// sets to terminate.
pub(super) struct RunClock {
    // A mutex, not atomics: start and end must update the shared minimum together, and a run
    // is stopped only while its lane still says it runs (see `set`).
    starts: std::sync::Mutex<Vec<u64>>,
    counters: Arc<WorkerCounters>,
    stops: Vec<RunStop>,
    timeout: Duration,
}

struct RunStop {
    options: ort::session::RunOptions,
    /// Set (under the clock's lock) when this lane's run was told to terminate.
    stopped: AtomicBool,
}

impl RunClock {
    fn new(
        lanes: usize,
        counters: Arc<WorkerCounters>,
        timeout: Duration,
        allocator: Allocator,
    ) -> ort::Result<RunClock> {
        let stops = (0..lanes)
            .map(|_| {
                let mut options = ort::session::RunOptions::new()?;
                if allocator == Allocator::ArenaShrink {
                    // Every arena the run used goes back to its first chunk when it ends.
                    options.set("memory.enable_memory_arena_shrinkage", "cpu:0")?;
                }
                Ok(RunStop { options, stopped: AtomicBool::new(false) })
            })
            .collect::<ort::Result<_>>()?;
        Ok(RunClock { starts: std::sync::Mutex::new(vec![0; lanes]), counters, stops, timeout })
    }

    /// A lane starts or ends a run. Returns, at the end of a run, whether it was stopped.
    fn set(&self, lane: usize, running: bool) -> bool {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let now = inferd_ipc::stats::monotonic_nanos();
        if !running && starts[lane] != 0 {
            self.counters.lane_busy(now.saturating_sub(starts[lane]));
        }
        starts[lane] = if running { now } else { 0 };
        self.counters.busy_since(starts.iter().copied().filter(|&t| t != 0).min());
        drop(starts);
        let stop = &self.stops[lane];
        // No terminate can come after the start was cleared: the flag is final now.
        if !running && stop.stopped.swap(false, Ordering::Relaxed) {
            if let Err(e) = stop.options.unterminate() {
                warn!("cannot reset lane {lane}'s run options: {e}");
            }
            return true;
        }
        false
    }

    fn options(&self, lane: usize) -> &ort::session::RunOptions {
        &self.stops[lane].options
    }

    /// Tells every run that has lasted longer than the timeout to terminate (ORT stops between
    /// operators; a kernel that never returns is left to the supervisor's SIGABRT).
    pub(super) fn stop_overdue(&self) {
        let starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let now = inferd_ipc::stats::monotonic_nanos();
        for (lane, &start) in starts.iter().enumerate() {
            let overdue = start != 0 && now.saturating_sub(start) > self.timeout.as_nanos() as u64;
            let stop = &self.stops[lane];
            if overdue && !stop.stopped.swap(true, Ordering::Relaxed) {
                warn!(lane, "a model run passed server.request_timeout_secs = {:?}; stopping it", self.timeout);
                if let Err(e) = stop.options.terminate() {
                    warn!("cannot stop lane {lane}'s run: {e}");
                }
            }
        }
    }
}

/// Makes the calling thread `by` nicer than it is. Raising it needs no privilege; failing,
/// the lane runs at the worker's priority, which costs short requests latency, not
/// correctness.
fn lower_priority(by: i32) {
    if let Err(e) = shift_nice(nix::unistd::gettid().as_raw() as libc::id_t, by) {
        warn!("cannot lower the background lane's priority: {e}");
    }
}

/// Moves thread `tid`'s nice value (Linux: each thread has its own) by `by`, within -20..=19:
/// up needs no privilege, down needs RLIMIT_NICE or CAP_SYS_NICE. Shared by the background
/// lane and the worker's niced boot (server/boot.rs), so that each undoes exactly what the
/// other did.
pub(crate) fn shift_nice(tid: libc::id_t, by: i32) -> Result<(), nix::errno::Errno> {
    use nix::errno::Errno;
    // getpriority returns the nice value, and -1 both for nice -1 and for an error: errno tells.
    Errno::clear();
    // SAFETY: plain system calls on a thread id; no memory is passed.
    let now = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    match Errno::last_raw() {
        0 => Errno::result(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, (now + by).clamp(-20, 19)) }).map(drop),
        _ => Err(Errno::last()),
    }
}

/// A job's result with the channel it goes back on, sent once the run is over.
type Delivery = (batch::ReplyTo, Result<(Vec<Tensor>, Timing), EngineError>);

/// Model number `model`'s row in the shared counters, of an engine that started with
/// `started_with` models: its own for those, the shared last row ([`MAX_MODELS`]) for a model
/// added while serving (each worker numbers those in its own order, so their numbers are no
/// rows the supervisor can name).
fn counter_row(model: usize, started_with: usize) -> usize {
    if model < started_with {
        model
    } else {
        MAX_MODELS
    }
}

/// One lane's sessions, by model number. Under a lock that the lane holds for each run: the
/// engine adds and removes models ([`Engine::add`], [`Engine::remove`]) between runs.
#[derive(Default)]
struct LaneSessions {
    narrow: HashMap<usize, ModelSession>,
    /// Lane 0's: the wide ones.
    wide: HashMap<usize, ModelSession>,
}

/// A thread that runs batches on its own sessions.
struct Lane {
    index: usize,
    /// Every lane's sessions; this one's at `index`.
    sessions: Arc<[Mutex<LaneSessions>]>,
    /// How many models the engine started with.
    started_with: usize,
    /// Lane 0 with wide sessions.
    has_wide: bool,
    /// Told when a run is over; hands the lane its next batch then.
    dispatcher: Arc<Shared>,
    counters: Arc<WorkerCounters>,
    clock: Arc<RunClock>,
    /// [`IDLE_POLL`] or zero.
    poll_when_idle: Duration,
    cores: Option<Arc<Cores>>,
    /// The background lane: runs at [`BACKGROUND_NICE`].
    background: bool,
}

impl Lane {
    fn run(mut self, work: mpsc::Receiver<Work>) {
        if self.background {
            lower_priority(BACKGROUND_NICE);
        }
        let mut poll = Duration::ZERO;
        let mut trim_checked = Instant::now();
        while let Ok(Work { batch, wide, loaded }) = recv_polling(&work, poll) {
            let mut answers = Vec::with_capacity(batch.len());
            if let Some(cores) = self.cores.as_deref().filter(|_| loaded) {
                cores.claims.mark_busy(cores.home);
            }
            // `execute` guards each run itself (a bug costs only the request that hit it); this
            // is the last resort for one outside them: the replies still held are dropped, so
            // their requests are answered (500) at once, and the lane serves on.
            // One span for the run, linked to each traced request it serves.
            let traced: Vec<_> = batch.iter().filter_map(|job| job.trace.clone()).collect();
            let run = (!traced.is_empty()).then(|| {
                let rows: usize = batch.iter().map(|job| job.rows.unwrap_or(1)).sum();
                let tokens: usize = batch.iter().map(Job::tokens).sum();
                (crate::trace::Run::start(traced), batch.len(), rows, tokens)
            });
            if crate::panics::guarded(|| self.execute(batch, wide, &mut answers)).is_err() {
                self.clock.set(self.index, false);
            }
            if let Some((span, requests, rows, tokens)) = run {
                span.end(vec![
                    KeyValue::new("inferd.batch.requests", requests as i64),
                    KeyValue::new("inferd.batch.rows", rows as i64),
                    KeyValue::new("inferd.batch.padded_tokens", tokens as i64),
                    KeyValue::new("inferd.lane", self.index as i64),
                    KeyValue::new("inferd.wide", wide),
                ]);
            }
            // Free before the answers go out: a request sent on receipt of one then never finds
            // this lane still busy (the dispatcher would take it for load, see `dispatch`). What
            // waits starts now: the lane hands itself its next batch, waking no other thread.
            self.dispatcher.handle(Event::Done { lane: self.index });
            for (reply, answer) in answers {
                let _ = reply.send(answer);
            }
            // A lone request ran: the next one may come as soon as its client has the answer.
            poll = if wide { self.poll_when_idle } else { Duration::ZERO };
            // The answers are out: past its limit, what the batches freed goes back now, looked
            // at no more often than TRIM_CHECK_EVERY: reading glibc's totals walks its free
            // chunks, and a request of many small elements (BYTES) in pieces of one row left
            // one per element, so a look after every piece made the request cost N squared.
            if trim_checked.elapsed() >= TRIM_CHECK_EVERY {
                crate::runtime::allocator::trim_if_over(crate::runtime::allocator::FREE_LIMIT);
                trim_checked = Instant::now();
            }
        }
    }

    fn row(&self, model: usize) -> usize {
        counter_row(model, self.started_with)
    }

    /// Runs a batch and adds each job's answer to `answers`.
    fn execute(&mut self, batch: Vec<Job>, wide: bool, answers: &mut Vec<Delivery>) {
        let started = Instant::now();
        let model = batch[0].model;
        let counters = Arc::clone(&self.counters);
        for job in &batch {
            counters.queued(-1);
            counters.observe_latency(Latency::Queue, self.row(model), (started - job.queued_at).as_secs_f64());
        }
        if batch.len() == 1 {
            let job = batch.into_iter().next().expect("one job");
            self.run_alone(model, job, wide, answers);
            return;
        }
        let rows: Vec<usize> = batch.iter().map(|j| j.rows.expect("only batchable jobs are gathered")).collect();
        let total: usize = rows.iter().sum();
        // A panic assembling or running the batch (a bug) counts as a failed batch: each job
        // then runs alone, so only the one that hits the bug again fails.
        let run = crate::panics::guarded(|| {
            batch.iter().for_each(|job| crate::panics::test_switch("lane", job.rows));
            self.run_one(model, merge(&batch, total), total as u64, wide)
        });
        if run.is_err() {
            self.clock.set(self.index, false);
        }
        let split = match run.unwrap_or(Err(EngineError::Bug)) {
            Err(EngineError::Stopped { model: name, limit }) => {
                // Stopped for time: running each request alone would take as long again.
                for job in batch {
                    answers.push((job.reply, Err(EngineError::Stopped { model: name.clone(), limit })));
                }
                return;
            }
            result => result.ok().and_then(|outputs| split(outputs, &rows)),
        };
        match split {
            Some(parts) => {
                let compute = started.elapsed();
                for (job, part) in batch.into_iter().zip(parts) {
                    counters.observe_latency(Latency::Compute, self.row(model), compute.as_secs_f64());
                    answers.push((job.reply, Ok((part, Timing { queue: started - job.queued_at, compute }))));
                }
            }
            None => {
                // One request's values may have failed the batch: each runs alone and gets its
                // own answer.
                for job in batch {
                    self.run_alone(model, job, wide, answers);
                }
            }
        }
    }

    /// One job in its own ORT call; a panic in it (a bug) answers it 500.
    fn run_alone(&mut self, model: usize, job: Job, wide: bool, answers: &mut Vec<Delivery>) {
        let started = Instant::now();
        let rows = job.inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(1).max(0) as u64;
        let (inputs, switch) = (job.inputs, job.rows);
        let result = crate::panics::guarded(|| {
            crate::panics::test_switch("lane", switch);
            self.run_one(model, inputs, rows, wide)
        })
        .unwrap_or_else(|_| {
            self.clock.set(self.index, false);
            Err(EngineError::Bug)
        });
        let timing = Timing { queue: started - job.queued_at, compute: started.elapsed() };
        self.counters.observe_latency(Latency::Compute, self.row(model), timing.compute.as_secs_f64());
        answers.push((job.reply, result.map(|outputs| (outputs, timing))));
    }

    /// One ORT call, counted as a batch of `rows`.
    fn run_one(
        &mut self,
        model: usize,
        inputs: Vec<Tensor>,
        rows: u64,
        wide: bool,
    ) -> Result<Vec<Tensor>, EngineError> {
        self.counters.observe_batch(self.row(model), rows);
        let held = self.cores.as_deref().map(|cores| cores.hold(wide, &self.counters));
        // Lending: wide only on a borrowed core.
        let wide = wide && held.as_ref().is_none_or(|held| held.borrowed.is_some());
        let mut sessions = self.sessions[self.index].lock().unwrap_or_else(|e| e.into_inner());
        let LaneSessions { narrow, wide: wides } = &mut *sessions;
        let session = match if self.has_wide && wide { wides } else { narrow }.get_mut(&model) {
            Some(session) => session,
            None => return Err(EngineError::Unloaded),
        };
        self.clock.set(self.index, true);
        let result = session.run(inputs, Some(self.clock.options(self.index)));
        let stopped = self.clock.set(self.index, false);
        drop(held);
        leak_for_tests();
        match result {
            // A run that finished just as it was told to stop keeps its answer.
            Err(_) if stopped => {
                Err(EngineError::Stopped { model: session.name().to_string(), limit: self.clock.timeout.as_secs_f64() })
            }
            result => Ok(result?),
        }
    }
}
