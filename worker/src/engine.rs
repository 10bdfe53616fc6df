//! The model thread: the one place sessions run, and the dynamic batcher in front of them.
//!
//! HTTP handlers never run inference on the async executor. They send a [`Job`] over a channel
//! and await its `oneshot` reply; the model thread takes jobs oldest first and runs them on the
//! worker's ORT thread pool.
//!
//! Batching: before each run the thread moves everything already in the channel into its
//! `pending` list, takes the oldest live job (the *anchor*) and adds the waiting jobs that fit
//! it into one ORT call, whose outputs are split back by rows. A job fits when it is for the
//! same model, its tensors agree with the anchor's in every dimension but the first (text jobs
//! may also differ in sequence length: the batch is padded to its longest row), and the batch
//! stays within the model's `max_batch_size` rows and, for text, `max_batch_tokens`
//! (rows x padded length), with no row padded to more than twice its length. Candidates
//! closest in length to the anchor are tried first, so short texts batch with short texts. The
//! anchor is the oldest job, except that heavy jobs (long texts, [`HEAVY_TOKENS`]) may hold
//! all lanes but one while lighter jobs wait; with one lane, strictly the oldest. With `max_queue_delay_ms` > 0 the anchor waits up to that
//! long after its arrival for company; with 0 (the default) only jobs already waiting join, so
//! an idle server adds no latency. A batch that fails (one request's bad values, an output
//! without a batch dimension) is rerun one job at a time, so a bad request fails alone.
//!
//! Contract per job, batched or not: a job whose client went away is skipped, one past its
//! deadline is answered 504 without running, and the `queued` counter (which `max_queue`
//! reads) counts it until it leaves `pending`.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use inferd_config::stats::{Latency, Shared};
use tokio::sync::oneshot;

use crate::model::{Model, ModelError, Tensor};
use crate::tensor::element_count;

/// How a job's tensors may be combined with other jobs' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// Every dimension but the first must match (raw tensors, images).
    Exact,
    /// Tokenised text `[rows, sequence, ...]`: the sequence axis may differ and is padded with
    /// zeros (attention mask 0) to the batch's longest row.
    PadSequence,
}

type Reply = oneshot::Sender<Result<Vec<Tensor>, ModelError>>;

struct Job {
    model: usize,
    inputs: Vec<Tensor>,
    join: Join,
    /// Rows (the first dimension, the same in every input); `None` = cannot be batched.
    rows: Option<usize>,
    /// Sequence length of a `PadSequence` job (1 otherwise).
    width: usize,
    queued_at: Instant,
    /// Past this the job is dropped before it reaches the model.
    deadline: Option<Instant>,
    reply: Reply,
}

impl Job {
    fn new(model: usize, inputs: Vec<Tensor>, join: Join, deadline: Option<Instant>, reply: Reply) -> Job {
        let rows = inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(0);
        let width = match join {
            Join::Exact => Some(1),
            Join::PadSequence => inputs.first().and_then(|t| t.shape.get(1)).copied(),
        };
        // Batchable: every input has the same rows (and width), and each row holds data.
        let uniform = width.is_some()
            && inputs.iter().all(|t| {
                t.shape.first() == Some(&rows)
                    && (join == Join::Exact || t.shape.get(1).copied() == width)
                    && element_count(&t.shape[1..]).is_some_and(|n| n > 0)
            });
        let rows = (uniform && rows > 0).then_some(rows as usize);
        let width = width.unwrap_or(1).max(1) as usize;
        Job { model, inputs, join, rows, width, queued_at: Instant::now(), deadline, reply }
    }

    /// Whether `other` can run in one ORT call with `self`.
    fn fits(&self, other: &Job) -> bool {
        let same_tensor = |a: &Tensor, b: &Tensor| {
            let skip = if self.join == Join::PadSequence { 2 } else { 1 };
            a.name == b.name
                && a.data.dtype() == b.data.dtype()
                && a.shape.len() == b.shape.len()
                && a.shape[skip.min(a.shape.len())..] == b.shape[skip.min(b.shape.len())..]
        };
        self.model == other.model
            && self.join == other.join
            && self.rows.is_some()
            && other.rows.is_some()
            && self.inputs.len() == other.inputs.len()
            && self.inputs.iter().zip(&other.inputs).all(|(a, b)| same_tensor(a, b))
    }

    fn heavy(&self) -> bool {
        self.rows.unwrap_or(1) * self.width >= HEAVY_TOKENS
    }

    fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
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
        // black_box: an allocation nobody reads or frees may otherwise be optimised away.
        std::mem::forget(std::hint::black_box(vec![1u8; n]));
    }
}

/// A model's batching limits, from its model.toml `[batching]`.
struct Policy {
    /// 1 when the model has no dynamic batch dimension.
    max_rows: usize,
    max_tokens: usize,
    delay: Duration,
}

impl Policy {
    fn of(model: &Model) -> Policy {
        let b = &model.entry().batching;
        let max_rows = if model.meta.batchable() { b.max_batch_size } else { 1 };
        Policy { max_rows, max_tokens: b.max_batch_tokens, delay: Duration::from_millis(b.max_queue_delay_ms) }
    }
}

/// One model's sessions: the HTTP side only ever sees its `meta`.
pub struct Sessions {
    /// One narrow session (1 thread: its caller) per lane.
    pub narrow: Vec<Model>,
    /// A session on the worker's whole thread pool, when the worker has more than one thread.
    pub wide: Option<Model>,
}

/// Handle to the model threads; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    // std's channel: the receiving side is a plain thread that blocks on recv().
    events: mpsc::Sender<Event>,
    stats: Arc<Shared>,
    /// Jobs allowed to wait; past it `infer` refuses at once (server.max_queue).
    max_queue: u64,
    /// Dropped with the last handle: the lanes hold senders too, so the channel alone never
    /// tells the dispatcher that nobody will send again.
    _alive: Arc<()>,
}

/// What the dispatcher hears about: a new job from the I/O thread, or a lane that finished.
enum Event {
    Job(Job),
    Done { lane: usize },
}

/// A batch for a lane, to run on its narrow sessions or (lane 0 only) the wide ones.
struct Work {
    batch: Vec<Job>,
    wide: bool,
}

impl Engine {
    /// Starts the dispatcher thread (`inferd-batch`) and one thread per lane (`inferd-lane-N`),
    /// each owning the narrow session of every model for its lane; lane 0 also owns the wide
    /// sessions. `models[m].narrow.len()` is the number of lanes, the same for every model.
    ///
    /// Scheduling: a batch runs *wide* (on every thread of the worker) when it is the only work
    /// there is: nothing else waits and no lane is busy; otherwise batches run *narrow*, one per
    /// lane, side by side, and nothing runs wide until every lane is free again. So a lone
    /// request uses all the worker's cores, and a loaded worker pays no thread synchronisation.
    ///
    /// Queue time, compute time and batch sizes go to `stats`, and so does a beat at least
    /// every second and the start of the oldest run in progress, which the supervisor watches
    /// for a stuck model.
    pub fn start(models: Vec<Sessions>, stats: Arc<Shared>, max_queue: usize) -> std::io::Result<Engine> {
        let lanes = models.first().map_or(1, |m| m.narrow.len()).max(1);
        let has_wide = models.iter().all(|m| m.wide.is_some()) && !models.is_empty();
        let policies = models.iter().map(|m| Policy::of(&m.narrow[0])).collect();
        let (events, inbox) = mpsc::channel::<Event>();
        let alive = Arc::new(());
        let clock = Arc::new(RunClock::new(lanes, stats.clone()));
        // Regroup by lane: lane l gets the l-th narrow session of every model.
        let mut per_lane: Vec<Vec<Model>> = (0..lanes).map(|_| Vec::new()).collect();
        let mut wide = Vec::new();
        for set in models {
            for (lane, model) in set.narrow.into_iter().enumerate() {
                per_lane[lane].push(model);
            }
            wide.extend(set.wide);
        }
        let mut wide = Some(wide).filter(|_| has_wide);
        let mut senders = Vec::with_capacity(lanes);
        for (index, narrow) in per_lane.into_iter().enumerate() {
            let (work, queue) = mpsc::channel::<Work>();
            let lane = Lane {
                index,
                narrow,
                wide: if index == 0 { wide.take() } else { None },
                done: events.clone(),
                counters: stats.clone(),
                clock: clock.clone(),
            };
            std::thread::Builder::new().name(format!("inferd-lane-{index}")).spawn(move || lane.run(queue))?;
            senders.push(work);
        }
        let dispatcher = Dispatcher {
            inbox,
            pending: VecDeque::new(),
            policies,
            lanes: senders.into_iter().map(|s| (s, LaneState::Idle)).collect(),
            has_wide,
            wide_running: false,
            counters: stats.clone(),
            engine: Arc::downgrade(&alive),
            last_light: None,
            last_load: None,
        };
        std::thread::Builder::new().name("inferd-batch".into()).spawn(move || dispatcher.run())?;
        Ok(Engine { events, stats, max_queue: max_queue as u64, _alive: alive })
    }

    /// Runs model number `model` (its index in the worker's model list) on `inputs`, batched
    /// with other requests where `join` and the model's limits allow.
    pub async fn infer(
        &self,
        model: usize,
        inputs: Vec<Tensor>,
        join: Join,
        deadline: Option<Instant>,
    ) -> Result<Vec<Tensor>, ModelError> {
        // Backpressure: a full queue answers at once instead of growing its latency.
        let waiting = self.stats.queued_now();
        if waiting >= self.max_queue {
            return Err(ModelError::Overloaded { waiting });
        }
        let (reply, answer) = oneshot::channel();
        self.stats.queued(1);
        if self.events.send(Event::Job(Job::new(model, inputs, join, deadline, reply))).is_err() {
            self.stats.queued(-1);
            return Err(ModelError::EngineGone);
        }
        answer.await.map_err(|_| ModelError::EngineGone)?
    }
}

/// The start of each lane's current run, so the supervisor sees the oldest one (a stuck lane
/// stays visible while another keeps finishing runs).
struct RunClock {
    // A mutex, not atomics: start and end must update the shared minimum together.
    starts: std::sync::Mutex<Vec<u64>>,
    counters: Arc<Shared>,
}

impl RunClock {
    fn new(lanes: usize, counters: Arc<Shared>) -> RunClock {
        RunClock { starts: std::sync::Mutex::new(vec![0; lanes]), counters }
    }

    fn set(&self, lane: usize, running: bool) {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        starts[lane] = if running { inferd_config::stats::monotonic_nanos() } else { 0 };
        self.counters.busy_since(starts.iter().copied().filter(|&t| t != 0).min());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneState {
    Idle,
    Light,
    /// A batch anchored by a heavy job ([`HEAVY_TOKENS`]).
    Heavy,
}

/// A job of at least this many tokens (rows x padded length; other jobs count their rows) is
/// *heavy*: one 256-token MiniLM text takes ~70 ms on one thread, 14x a short sentence. Heavy
/// jobs may occupy all lanes but one while lighter jobs wait, so a stream of long texts does
/// not hold short ones up behind it (measured: short texts' p99 went from 61 ms alone to 1.5 s
/// with one request in 8 of 256 tokens before this rule).
const HEAVY_TOKENS: usize = 256;

/// Requests that overlapped this recently mean load: a lone one then runs narrow.
const RECENT_LOAD: Duration = Duration::from_millis(50);

/// How long after the last light batch started the last free lane stays reserved for light
/// work; with only heavy work coming, every lane runs it.
const LIGHT_RESERVATION: Duration = Duration::from_millis(200);

/// Takes jobs, forms batches and hands them to free lanes.
struct Dispatcher {
    inbox: mpsc::Receiver<Event>,
    /// Jobs taken from the channel and not yet handed to a lane, oldest first.
    pending: VecDeque<Job>,
    policies: Vec<Policy>,
    /// Each lane's work channel and what it runs.
    lanes: Vec<(mpsc::Sender<Work>, LaneState)>,
    has_wide: bool,
    /// Lane 0 runs on every thread: no other lane may start until it is done.
    wide_running: bool,
    counters: Arc<Shared>,
    /// Gone once every [`Engine`] handle is dropped.
    engine: std::sync::Weak<()>,
    /// When the last light batch started.
    last_light: Option<Instant>,
    /// When a batch last started with other work waiting or running beside it.
    last_load: Option<Instant>,
}

impl Dispatcher {
    fn run(mut self) {
        loop {
            self.counters.beat();
            self.drop_dead();
            if self.dispatch().is_err() {
                return; // a lane is gone: the worker is going down
            }
            // Nothing more can start until a job arrives, a lane finishes or a reservation for
            // light work lapses.
            let wait = self.reserved_until().map_or(Duration::from_secs(1), |t| t - Instant::now());
            match self.inbox.recv_timeout(wait.min(Duration::from_secs(1))) {
                Ok(event) => self.take(event),
                Err(mpsc::RecvTimeoutError::Timeout) if self.engine.strong_count() == 0 => return,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            while let Ok(event) = self.inbox.try_recv() {
                self.take(event);
            }
        }
    }

    /// Hands batches to free lanes while there is work that may start now.
    fn dispatch(&mut self) -> Result<(), mpsc::SendError<Work>> {
        while let Some(lane) = self.free_lane() {
            let Some(anchor) = self.next_anchor() else { break };
            let heavy = anchor.heavy();
            let policy = &self.policies[anchor.model];
            if policy.max_rows > 1 && !policy.delay.is_zero() && anchor.rows.is_some() {
                self.wait_for_company(&anchor);
            }
            // Lanes share what waits: a lane takes its share of it, not all of it, so the others
            // (free now or soon) get work too and no request waits behind one oversized batch.
            let free = self.lanes.iter().filter(|(_, s)| *s == LaneState::Idle).count();
            let waiting = anchor.rows.unwrap_or(1) + self.pending.iter().filter_map(|j| j.rows).sum::<usize>();
            let batch = self.gather(anchor, waiting.div_ceil(self.lanes.len()));
            let now = Instant::now();
            let idle = batch.len() == 1 && self.pending.is_empty() && free == self.lanes.len();
            if !idle {
                self.last_load = Some(now);
            }
            // Wide blocks every lane until it is done, and costs more CPU per request than a
            // narrow run: only for one request that has the worker to itself, and not while
            // requests have been overlapping lately (a burst would then run wide one by one).
            let alone = idle && self.last_load.is_none_or(|t| now - t > RECENT_LOAD);
            let (lane, wide) = if self.has_wide && alone { (0, true) } else { (lane, false) };
            self.lanes[lane].1 = if heavy { LaneState::Heavy } else { LaneState::Light };
            if !heavy {
                self.last_light = Some(Instant::now());
            }
            self.wide_running = wide;
            self.lanes[lane].0.send(Work { batch, wide })?;
        }
        Ok(())
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Job(job) => self.pending.push_back(job),
            Event::Done { lane } => {
                self.lanes[lane].1 = LaneState::Idle;
                if lane == 0 {
                    self.wide_running = false;
                }
            }
        }
    }

    fn free_lane(&self) -> Option<usize> {
        if self.wide_running {
            return None;
        }
        self.lanes.iter().position(|(_, s)| *s == LaneState::Idle)
    }

    /// While light work ran lately, heavy work may not take the last free lane: until when.
    fn reserved_until(&self) -> Option<Instant> {
        let heavy_lanes = self.lanes.iter().filter(|(_, s)| *s == LaneState::Heavy).count();
        if self.lanes.len() < 2 || heavy_lanes + 1 < self.lanes.len() {
            return None;
        }
        self.last_light.map(|t| t + LIGHT_RESERVATION).filter(|&until| until > Instant::now())
    }

    /// The oldest waiting job; but when it is heavy and the last free lane is reserved for
    /// light work, the oldest light job, or none (the heavy job waits for a lane).
    fn next_anchor(&mut self) -> Option<Job> {
        let index = match self.pending.front()?.heavy() && self.reserved_until().is_some() {
            true => self.pending.iter().position(|j| !j.heavy())?,
            false => 0,
        };
        self.pending.remove(index)
    }

    /// Removes jobs whose client went away (skipping the work) and answers those past their
    /// deadline.
    fn drop_dead(&mut self) {
        let now = Instant::now();
        let mut live = VecDeque::with_capacity(self.pending.len());
        for job in self.pending.drain(..) {
            if job.reply.is_closed() {
                self.counters.queued(-1);
            } else if job.expired(now) {
                self.counters.queued(-1);
                let waited = now - job.queued_at;
                let _ = job.reply.send(Err(ModelError::DeadlineExceeded { waited }));
            } else {
                live.push_back(job);
            }
        }
        self.pending = live;
    }

    /// Holds the anchor until its batch is full or `max_queue_delay_ms` after its arrival.
    fn wait_for_company(&mut self, anchor: &Job) {
        let policy = &self.policies[anchor.model];
        let (until, max_rows) = (anchor.queued_at + policy.delay, policy.max_rows);
        loop {
            let rows: usize = anchor.rows.unwrap_or(1)
                + self.pending.iter().filter(|j| anchor.fits(j)).filter_map(|j| j.rows).sum::<usize>();
            let now = Instant::now();
            if rows >= max_rows || now >= until {
                return;
            }
            match self.inbox.recv_timeout(until - now) {
                Ok(event) => self.take(event),
                Err(_) => return,
            }
        }
    }

    /// The anchor plus the waiting jobs that fit it within the model's limits and `max_rows`.
    fn gather(&mut self, anchor: Job, max_rows: usize) -> Vec<Job> {
        let policy = &self.policies[anchor.model];
        let max_rows = max_rows.min(policy.max_rows);
        let Some(mut rows) = anchor.rows.filter(|_| max_rows > 1) else { return vec![anchor] };
        let (mut width, mut narrowest) = (anchor.width, anchor.width);
        let mut candidates: Vec<usize> = (0..self.pending.len()).filter(|&i| anchor.fits(&self.pending[i])).collect();
        // Closest in length first (a stable sort: oldest first among equals).
        candidates.sort_by_key(|&i| self.pending[i].width.abs_diff(anchor.width));
        let mut chosen = Vec::new();
        for i in candidates {
            let job = &self.pending[i];
            let (job_rows, job_width) = (job.rows.unwrap_or(usize::MAX), job.width);
            let new_rows = rows.saturating_add(job_rows);
            let (new_width, new_narrowest) = (width.max(job_width), narrowest.min(job_width));
            if new_rows > max_rows {
                continue;
            }
            if anchor.join == Join::PadSequence
                && (new_rows * new_width > policy.max_tokens || new_width > 2 * new_narrowest)
            {
                continue;
            }
            (rows, width, narrowest) = (new_rows, new_width, new_narrowest);
            chosen.push(i);
        }
        chosen.sort_unstable();
        let mut batch = vec![anchor];
        // Highest index first, so the lower indices stay valid.
        for &i in chosen.iter().rev() {
            batch.extend(self.pending.remove(i));
        }
        batch
    }
}

/// A thread that runs batches on its own sessions.
struct Lane {
    index: usize,
    /// This lane's narrow session of every model.
    narrow: Vec<Model>,
    /// Lane 0 only: the wide session of every model.
    wide: Option<Vec<Model>>,
    done: mpsc::Sender<Event>,
    counters: Arc<Shared>,
    clock: Arc<RunClock>,
}

impl Lane {
    fn run(mut self, work: mpsc::Receiver<Work>) {
        while let Ok(Work { batch, wide }) = work.recv() {
            self.execute(batch, wide);
            if self.done.send(Event::Done { lane: self.index }).is_err() {
                return;
            }
        }
    }

    fn execute(&mut self, batch: Vec<Job>, wide: bool) {
        let started = Instant::now();
        let model = batch[0].model;
        let counters = Arc::clone(&self.counters);
        for job in &batch {
            counters.queued(-1);
            counters.observe_latency(Latency::Queue, model, (started - job.queued_at).as_secs_f64());
        }
        if batch.len() == 1 {
            let job = batch.into_iter().next().expect("one job");
            let rows = job.inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(1).max(0) as u64;
            let result = self.run_one(model, job.inputs, rows, wide);
            counters.observe_latency(Latency::Compute, model, started.elapsed().as_secs_f64());
            let _ = job.reply.send(result);
            return;
        }
        let rows: Vec<usize> = batch.iter().map(|j| j.rows.expect("only batchable jobs are gathered")).collect();
        let total: usize = rows.iter().sum();
        let merged = merge(&batch, total);
        let split = self.run_one(model, merged, total as u64, wide).ok().and_then(|outputs| split(outputs, &rows));
        match split {
            Some(parts) => {
                let elapsed = started.elapsed().as_secs_f64();
                for (job, part) in batch.into_iter().zip(parts) {
                    counters.observe_latency(Latency::Compute, model, elapsed);
                    let _ = job.reply.send(Ok(part));
                }
            }
            None => {
                // One request's values may have failed the batch: each runs alone and gets its
                // own answer.
                for job in batch {
                    let one = Instant::now();
                    let result = self.run_one(model, job.inputs, job.rows.unwrap_or(1) as u64, wide);
                    counters.observe_latency(Latency::Compute, model, one.elapsed().as_secs_f64());
                    let _ = job.reply.send(result);
                }
            }
        }
    }

    /// One ORT call, counted as a batch of `rows`.
    fn run_one(&mut self, model: usize, inputs: Vec<Tensor>, rows: u64, wide: bool) -> Result<Vec<Tensor>, ModelError> {
        self.counters.observe_batch(model, rows);
        self.clock.set(self.index, true);
        let session = match (&mut self.wide, wide) {
            (Some(sessions), true) => &mut sessions[model],
            _ => &mut self.narrow[model],
        };
        let result = session.run(inputs);
        self.clock.set(self.index, false);
        leak_for_tests();
        result
    }
}

/// The batch's inputs: each job's rows one after the other, padded along the sequence axis to
/// the longest when the jobs are text.
fn merge(batch: &[Job], total: usize) -> Vec<Tensor> {
    let width = batch.iter().map(|j| j.width).max().unwrap_or(1);
    batch[0]
        .inputs
        .iter()
        .enumerate()
        .map(|(i, first)| {
            let mut shape = first.shape.clone();
            shape[0] = total as i64;
            if batch[0].join == Join::PadSequence {
                shape[1] = width as i64;
            }
            let row_len = element_count(&shape[1..]).unwrap_or(0);
            let mut data = first.data.dtype().zeros(0);
            for job in batch {
                let input = &job.inputs[i];
                let rows = job.rows.unwrap_or(0);
                let from = input.data.len() / rows.max(1);
                let ok = data.extend_rows(&input.data, rows, from, row_len);
                debug_assert!(ok, "fits() checked the element types");
            }
            Tensor { name: first.name.clone(), shape, data }
        })
        .collect()
}

/// Splits a batch's outputs back into each job's rows; `None` when an output has no batch
/// dimension to split along.
fn split(outputs: Vec<Tensor>, rows: &[usize]) -> Option<Vec<Vec<Tensor>>> {
    let total: usize = rows.iter().sum();
    let mut parts: Vec<Vec<Tensor>> = rows.iter().map(|_| Vec::with_capacity(outputs.len())).collect();
    for output in outputs {
        if output.shape.first().copied() != Some(total as i64) {
            return None;
        }
        let row_len = element_count(&output.shape[1..])?;
        let mut start = 0;
        for (part, &n) in parts.iter_mut().zip(rows) {
            let mut shape = output.shape.clone();
            shape[0] = n as i64;
            part.push(Tensor {
                name: output.name.clone(),
                shape,
                data: output.data.slice(start * row_len..(start + n) * row_len),
            });
            start += n;
        }
    }
    Some(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::TensorData;

    fn text_job(rows: usize, width: usize, first_id: i64) -> Job {
        let ids: Vec<i64> = (0..(rows * width) as i64).map(|i| first_id + i).collect();
        let shape = vec![rows as i64, width as i64];
        let inputs = vec![
            Tensor { name: "input_ids".into(), shape: shape.clone(), data: TensorData::I64(ids) },
            Tensor { name: "attention_mask".into(), shape, data: TensorData::I64(vec![1; rows * width]) },
        ];
        Job::new(0, inputs, Join::PadSequence, None, oneshot::channel().0)
    }

    #[test]
    fn text_jobs_pad_to_the_longest_row_and_split_back() {
        let batch = vec![text_job(1, 2, 10), text_job(2, 3, 20)];
        assert!(batch[0].fits(&batch[1]));
        let merged = merge(&batch, 3);
        assert_eq!(merged[0].shape, vec![3, 3]);
        assert_eq!(merged[0].data, TensorData::I64(vec![10, 11, 0, 20, 21, 22, 23, 24, 25]));
        assert_eq!(merged[1].data, TensorData::I64(vec![1, 1, 0, 1, 1, 1, 1, 1, 1]));

        let out = Tensor { name: "o".into(), shape: vec![3, 2], data: TensorData::F32(vec![0., 1., 2., 3., 4., 5.]) };
        let parts = split(vec![out], &[1, 2]).unwrap();
        assert_eq!(parts[0][0].shape, vec![1, 2]);
        assert_eq!(parts[1][0].data, TensorData::F32(vec![2., 3., 4., 5.]));
        // An output without the batch's rows cannot be split.
        let scalar = Tensor { name: "s".into(), shape: vec![], data: TensorData::F32(vec![1.]) };
        assert!(split(vec![scalar], &[1, 2]).is_none());
    }

    fn dispatcher(max_rows: usize, max_tokens: usize, pending: Vec<Job>) -> Dispatcher {
        let (_, inbox) = mpsc::channel();
        Dispatcher {
            inbox,
            pending: pending.into(),
            policies: vec![Policy { max_rows, max_tokens, delay: Duration::ZERO }],
            lanes: Vec::new(),
            has_wide: false,
            wide_running: false,
            counters: Arc::new(Shared::create("inferd-engine-test").unwrap().0),
            engine: std::sync::Weak::new(),
            last_light: None,
            last_load: None,
        }
    }

    #[test]
    fn short_texts_batch_together_and_a_long_one_does_not_inflate_them() {
        let shorts = || (0..15).map(|i| text_job(1, 17, i)).collect::<Vec<_>>();
        let mut pending = shorts();
        pending.insert(3, text_job(1, 256, 0));
        let mut d = dispatcher(32, 8192, pending);
        let batch = d.gather(text_job(1, 17, 99), 64);
        assert_eq!(batch.len(), 16, "the anchor and the 15 short texts");
        assert!(batch.iter().all(|j| j.width == 17));
        assert_eq!(d.pending.len(), 1, "the long text waits for its own run");

        // No row is padded to more than twice its length: a long anchor runs without them.
        let mut d = dispatcher(32, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 256, 0), 64).len(), 1);
        let mut d = dispatcher(32, 8192, vec![text_job(1, 10, 0), text_job(1, 30, 0), text_job(1, 20, 0)]);
        let widths: Vec<usize> = d.gather(text_job(1, 15, 0), 64).iter().map(|j| j.width).collect();
        assert_eq!(widths, [15, 20, 10], "closest first, then within 2x of the narrowest");

        // Rows and the token budget both bound a batch.
        let mut d = dispatcher(4, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64).len(), 4);
        let mut d = dispatcher(32, 17 * 6, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64).len(), 6);
        // Batching off (no dynamic batch dimension, or max_batch_size = 1): always alone.
        let mut d = dispatcher(1, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64).len(), 1);
    }

    #[test]
    fn the_last_free_lane_is_kept_for_light_work_while_it_comes() {
        let lanes = || (0..2).map(|_| (mpsc::channel().0, LaneState::Idle)).collect::<Vec<_>>();
        let mut d = dispatcher(32, 512, vec![text_job(1, 256, 0), text_job(1, 17, 0), text_job(1, 256, 1)]);
        d.lanes = lanes();
        // Both lanes free: the oldest job goes first, heavy or not.
        assert_eq!(d.next_anchor().unwrap().width, 256);
        // One lane runs heavy work and light work ran lately: the other lane takes light work,
        // and a heavy job waits rather than take it.
        d.lanes[0].1 = LaneState::Heavy;
        d.last_light = Some(Instant::now());
        assert_eq!(d.next_anchor().unwrap().width, 17);
        assert!(d.next_anchor().is_none() && d.pending.len() == 1);
        assert!(d.reserved_until().is_some());
        // No light work for a while: heavy work may use every lane.
        d.last_light = Some(Instant::now() - LIGHT_RESERVATION);
        assert_eq!(d.next_anchor().unwrap().width, 256);
    }

    #[test]
    fn exact_jobs_must_agree_beyond_the_first_dimension() {
        let job = |shape: Vec<i64>, dtype_f32: bool| {
            let n = element_count(&shape).unwrap();
            let data = if dtype_f32 { TensorData::F32(vec![0.; n]) } else { TensorData::I32(vec![0; n]) };
            Job::new(0, vec![Tensor { name: "x".into(), shape, data }], Join::Exact, None, oneshot::channel().0)
        };
        assert!(job(vec![1, 4], true).fits(&job(vec![3, 4], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 5], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 4], false)));
        assert!(job(vec![0, 4], true).rows.is_none(), "no rows: never batched");
        assert!(job(vec![2, 0], true).rows.is_none(), "empty rows: never batched");
    }
}
