//! The lanes: threads that each run batches on their own sessions of every model, as the
//! dispatcher hands them out, and answer each job.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use inferd_ipc::stats::{Latency, WorkerCounters, MAX_MODELS};
use opentelemetry::KeyValue;
use tracing::warn;

use crate::runtime::engine::batch::{self, merge, split, Job};
use crate::runtime::engine::clock::RunClock;
use crate::runtime::engine::cores::Cores;
use crate::runtime::engine::dispatch::{Event, Shared, Work};
use crate::runtime::engine::terms::{EngineError, Timing};
use crate::runtime::model::ModelSession;
use crate::runtime::tensor::Tensor;

/// How much nicer than the worker the background lane's thread runs: at +10 the kernel's
/// weights give it ~10% of a core that lane 0 also wants (1024 against 110), and all of one
/// that nobody else wants.
const BACKGROUND_NICE: i32 = 10;

/// After a lone request's wide run, how long lane 0 polls for its next batch before it sleeps
/// ([`Engine::start`]'s `poll_when_idle`). A client that sends its next request as soon as it
/// has an answer finds it awake: on the 2-core development machine, 0.12 ms less per lone
/// request (p50 2.36 -> 2.24 ms with MiniLM, when a dispatcher thread polled too), for at most
/// this much CPU per request.
pub const IDLE_POLL: Duration = Duration::from_micros(300);

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
/// `started_with` models: its own for the first [`MAX_MODELS`] of those, the shared last row
/// (`MAX_MODELS`) for the others and for a model added while serving (each worker numbers
/// those in its own order, so their numbers are no rows the supervisor can name).
pub fn counter_row(model: usize, started_with: usize) -> usize {
    if model < started_with.min(MAX_MODELS) {
        model
    } else {
        MAX_MODELS
    }
}

/// One lane's sessions, by model number. Under a lock that the lane holds for each run: the
/// engine adds and removes models ([`Engine::add`], [`Engine::remove`]) between runs.
#[derive(Default)]
pub struct LaneSessions {
    pub narrow: HashMap<usize, ModelSession>,
    /// Lane 0's: the wide ones.
    pub wide: HashMap<usize, ModelSession>,
}

/// A thread that runs batches on its own sessions.
pub struct Lane {
    pub index: usize,
    /// Every lane's sessions; this one's at `index`.
    pub sessions: Arc<[Mutex<LaneSessions>]>,
    /// How many models the engine started with.
    pub started_with: usize,
    /// Lane 0 with wide sessions.
    pub has_wide: bool,
    /// Told when a run is over; hands the lane its next batch then.
    pub dispatcher: Arc<Shared>,
    pub counters: Arc<WorkerCounters>,
    pub clock: Arc<RunClock>,
    /// [`IDLE_POLL`] or zero.
    pub poll_when_idle: Duration,
    pub cores: Option<Arc<Cores>>,
    /// The background lane: runs at [`BACKGROUND_NICE`].
    pub background: bool,
}

impl Lane {
    pub fn run(mut self, work: mpsc::Receiver<Work>) {
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
