//! The dispatcher: the waiting jobs, and the decisions which job anchors the next batch, how
//! much of what waits a lane takes, and when a batch runs wide. It is shared under one lock
//! ([`Shared`]) and has no thread of its own on a request's way: the I/O thread hands it each
//! job and a lane tells it when it is free, and each then hands out, before it lets go of the
//! lock, what may start at once (a lane that finishes usually hands itself its next batch). A
//! timer thread (`inferd-batch`) does what falls due by the clock: a batch's wait for company,
//! a lapsed reservation, a run past its timeout, a job past its deadline, the worker's beat and
//! handing memory back.

use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use inferd_ipc::balance::{Balance, Waiting};
use inferd_ipc::stats::WorkerCounters;

use crate::runtime::engine::batch::{Job, Join, Policy};
use crate::runtime::engine::clock::RunClock;
use crate::runtime::engine::terms::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneState {
    Idle,
    Light,
    /// A batch anchored by a heavy job ([`crate::runtime::engine::batch::HEAVY_TOKENS`]).
    Heavy,
}

/// What the dispatcher is told: a new job from the I/O thread, or a lane that finished.
pub enum Event {
    Job(Job),
    Done { lane: usize },
}

/// A batch for a lane, to run on its narrow sessions or (lane 0 only) the wide ones.
pub struct Work {
    pub batch: Vec<Job>,
    pub wide: bool,
    /// Other work waited or ran beside it: with lent cores, the worker marks its core busy so
    /// that siblings do not borrow it now.
    pub loaded: bool,
}

/// Requests that overlapped this recently mean load: a lone one then runs narrow.
pub(super) const RECENT_LOAD: Duration = Duration::from_millis(50);

/// After this long with nothing to run, the worker hands the memory its last runs freed back
/// to the system (see [`Dispatcher::trim_due`]).
const TRIM_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Under load, the worker also hands memory back when every batch of a whole [`TRIM_AFTER_IDLE`]
/// was this many times smaller (rows x width) than the largest since it last did: the load
/// has fallen, and the buffers of its largest batches lie unused.
const LOAD_FELL: usize = 4;

/// While a lane runs, the dispatcher looks this often for a run past its timeout.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// How long after the last light batch started the last free lane stays reserved for light
/// work; with only heavy work coming, every lane runs it.
const LIGHT_RESERVATION: Duration = Duration::from_millis(200);

/// After this many runs in a row that went ahead of older work of a lower priority, the next
/// run goes to the oldest waiting job ([`Dispatcher::next_anchor`]): lower-priority work gets
/// at least one run in `OVERTAKES + 1` while higher-priority work never stops, and it is
/// never starved. A rule in runs, not in time: however long the line has waited, priorities
/// keep ordering it (levelling them by the time waited, as a job of priority 9 once stood
/// level with 0 after 0.9 s, ordered nothing exactly when the line was long).
pub(super) const OVERTAKES: u32 = 4;

/// For this long after a job of some priority arrived, work of a lower priority runs without
/// company of its own priority ([`Dispatcher::gather`]): a run is not preemptible, and a
/// higher-priority request that arrives during one waits for its end, so while such requests
/// come, lower-priority runs are kept to one request each (a bulk batch of 5 passages of 100
/// tokens holds the lane ~5 times as long as one).
const PRIORITY_SEEN_FOR: Duration = Duration::from_secs(1);

/// The next job to start, from [`Dispatcher::next_anchor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pick {
    /// Its index in `pending`.
    index: usize,
    lane: usize,
    /// It goes ahead of an older job of a lower priority that a lane could take now.
    overtakes: bool,
}

/// Takes jobs, forms batches and hands them to free lanes.
pub(super) struct Dispatcher {
    /// Jobs taken and not yet handed to a lane, oldest first.
    pending: VecDeque<Job>,
    /// Runs in a row that went ahead of older work of a lower priority ([`OVERTAKES`]).
    overtaken: u32,
    /// The highest priority (the lowest number) among the jobs that arrived within
    /// [`PRIORITY_SEEN_FOR`], and when the last of that priority did.
    priority_seen: Option<(u8, Instant)>,
    /// The pool's table, where every worker records the most urgent priority it saw lately
    /// ([`Dispatcher::with_pool_priorities`]): a client moved to this worker by the pool's
    /// connection balance is then as urgent here as it was there.
    pool: Option<Balance>,
    /// This worker's row of the pool's waiting counts: a model's `max_queue_size` holds for
    /// the pool ([`Dispatcher::with_pool_waiting`]).
    waiting: Option<Waiting>,
    /// Each model's limits, by model number.
    policies: HashMap<usize, Policy>,
    /// Each lane's work channel and what it runs.
    lanes: Vec<(mpsc::Sender<Work>, LaneState)>,
    /// Whether lane 0 has wide sessions.
    has_wide: bool,
    /// Every batch may run wide, not only a lone request: a worker of one lane that borrows
    /// an idle sibling's core (the lane runs it narrow when the core is not free), where no
    /// other lane of its own could run beside it.
    wide_batches: bool,
    /// The background lane (the last), which takes only heavy work (see [`super::Lane`]).
    background: Option<usize>,
    /// Lane 0 runs on every thread: no other lane may start until it is done.
    wide_running: bool,
    counters: Arc<WorkerCounters>,
    clock: Arc<RunClock>,
    /// Gone once every [`super::Engine`] handle is dropped.
    engine: std::sync::Weak<()>,
    /// Until when the oldest job waits for company (`max_queue_delay_ms`): the timer thread
    /// wakes then.
    company_until: Option<Instant>,
    /// When the last light batch started.
    last_light: Option<Instant>,
    /// When a batch last started with other work waiting or running beside it.
    last_load: Option<Instant>,
    /// When the last batch started or ended (idleness counts from the end of a long run), and
    /// whether the allocator was trimmed since.
    last_run: Option<Instant>,
    trimmed: bool,
    /// The largest batch (rows x width) since the allocator was last trimmed; when the current
    /// window of [`TRIM_AFTER_IDLE`] began, and its largest batch.
    largest: usize,
    window: (Instant, usize),
}

/// The dispatcher under its lock, shared by the I/O thread, the lanes and the timer thread.
pub(super) struct Shared {
    dispatcher: Mutex<Dispatcher>,
    /// What the timer thread sleeps on, woken early when a wait for company begins.
    timer: Condvar,
}

impl Shared {
    pub(super) fn new(dispatcher: Dispatcher) -> Shared {
        Shared { dispatcher: Mutex::new(dispatcher), timer: Condvar::new() }
    }

    /// A model added while the engine runs ([`super::Engine::add`]): its limits.
    pub(super) fn add_policy(&self, model: usize, policy: Policy) {
        self.lock().policies.insert(model, policy);
    }

    /// A model removed ([`super::Engine::remove`]): a job for it still waiting runs alone.
    pub(super) fn remove_policy(&self, model: usize) {
        let mut d = self.lock();
        if let (Some(policy), Some(row)) = (d.policies.remove(&model), d.waiting.as_mut()) {
            row.set(policy.key, 0);
        }
    }

    /// A panic under the lock ends the process ([`Shared::handle`]): a poisoned lock is never
    /// seen by the worker's other threads, which are gone with it.
    fn lock(&self) -> MutexGuard<'_, Dispatcher> {
        self.dispatcher.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a new job or a lane's end, drops the jobs nobody waits for any more and hands out
    /// what may start now, all under the lock; a panic in it ends the worker, whose thread
    /// calls it ([`crate::panics::unguarded`]).
    pub(super) fn handle(&self, event: Event) {
        crate::panics::unguarded(|| {
            let mut d = self.lock();
            let waiting = d.company_until;
            d.take(event);
            d.drop_dead();
            let dispatched = d.dispatch();
            d.publish_waiting();
            if let Err(e) = dispatched {
                // A lane ends only once close() dropped its channel: one gone before is a bug,
                // and a worker that cannot reach its lanes must not stay ready, answering
                // nothing. Unguarded, this panic ends the process and the slot is respawned.
                panic!("a lane of this worker is gone ({e})");
            }
            // A wait for company began (or another job now waits): the timer ends it.
            if d.company_until.is_some_and(|until| Some(until) != waiting) {
                self.timer.notify_one();
            }
        })
    }

    /// The timer thread: does what is due by the clock, then sleeps until the next thing is
    /// ([`Dispatcher::next_due`]) or a wait for company begins. Returns once every
    /// [`super::Engine`] handle is dropped, closing the lanes' channels.
    pub(super) fn run_timer(&self) {
        let mut d = self.lock();
        loop {
            d.counters.beat();
            d.clock.stop_overdue();
            if d.trim_due() {
                drop(d);
                crate::runtime::allocator::trim();
                d = self.lock();
            }
            d.drop_dead();
            let dispatched = d.dispatch();
            d.publish_waiting();
            if dispatched.is_err() || d.engine.strong_count() == 0 {
                d.close();
                return;
            }
            let wait = d.next_due();
            d = self.timer.wait_timeout(d, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Dispatcher {
    /// Model `model`'s limits ([`Policy::GONE`] once it was removed).
    fn policy(&self, model: usize) -> &Policy {
        self.policies.get(&model).unwrap_or(&Policy::GONE)
    }

    /// `lanes`: each lane's work channel, all idle; `has_wide`: whether lane 0 has wide
    /// sessions; `engine`: dropped with the last handle.
    pub(super) fn new(
        policies: Vec<Policy>,
        lanes: Vec<mpsc::Sender<Work>>,
        has_wide: bool,
        counters: Arc<WorkerCounters>,
        clock: Arc<RunClock>,
        engine: std::sync::Weak<()>,
    ) -> Dispatcher {
        Dispatcher {
            pending: VecDeque::new(),
            overtaken: 0,
            priority_seen: None,
            pool: None,
            waiting: None,
            policies: policies.into_iter().enumerate().collect(),
            lanes: lanes.into_iter().map(|l| (l, LaneState::Idle)).collect(),
            has_wide,
            wide_batches: false,
            background: None,
            wide_running: false,
            counters,
            clock,
            engine,
            company_until: None,
            last_light: None,
            last_load: None,
            last_run: None,
            trimmed: true,
            largest: 0,
            window: (Instant::now(), 0),
        }
    }

    /// Lets every batch run wide ([`Dispatcher::wide_batches`]).
    pub(super) fn with_wide_batches(mut self) -> Dispatcher {
        self.wide_batches = true;
        self
    }

    /// Shares the priorities seen with the pool's other workers ([`Dispatcher::pool`]).
    pub(super) fn with_pool_priorities(mut self, pool: Balance) -> Dispatcher {
        self.pool = Some(pool);
        self
    }

    /// Counts the jobs waiting for models of a limited queue with the pool's.
    pub(super) fn with_pool_waiting(mut self, row: Waiting) -> Dispatcher {
        self.waiting = Some(row);
        self
    }

    /// Says in the pool's table how many jobs wait here for each model of a limited queue.
    fn publish_waiting(&mut self) {
        let Some(row) = self.waiting.as_mut() else { return };
        for (number, policy) in self.policies.iter().filter(|(_, p)| p.max_waiting > 0) {
            row.set(policy.key, self.pending.iter().filter(|j| j.model == *number).count());
        }
    }

    /// The most urgent priority that arrived within [`PRIORITY_SEEN_FOR`], here or at a
    /// sibling.
    fn urgent(&self) -> Option<u8> {
        let here = self.priority_seen.filter(|(_, t)| t.elapsed() < PRIORITY_SEEN_FOR).map(|(p, _)| p);
        let pool = self.pool.as_ref().and_then(|pool| pool.urgent(PRIORITY_SEEN_FOR));
        here.into_iter().chain(pool).min()
    }

    /// Makes the last lane the background lane ([`Dispatcher::background`]).
    pub(super) fn with_background_lane(mut self) -> Dispatcher {
        self.background = self.lanes.len().checked_sub(1);
        self
    }

    /// How long the timer may sleep: until a wait for company or a reservation ends, at most
    /// [`WATCH_EVERY`] while a lane runs (its run is watched for its timeout) and a second
    /// otherwise (the beat).
    fn next_due(&self) -> Duration {
        let busy = self.lanes.iter().any(|(_, s)| *s != LaneState::Idle);
        let limit = if busy { WATCH_EVERY } else { Duration::from_secs(1) };
        let now = Instant::now();
        [self.reserved_until(), self.company_until].into_iter().flatten().fold(limit, |wait, t| wait.min(t - now))
    }

    /// The engine is dropped: every lane's channel closes, so the lanes end, and each waiting
    /// job's handler hears that the engine is gone.
    fn close(&mut self) {
        self.lanes.clear();
        self.background = None;
        self.counters.queued(-(self.pending.len() as i64));
        self.pending.clear();
    }

    /// Once the worker has been idle for [`TRIM_AFTER_IDLE`], what its runs left behind goes
    /// back to the system ([`crate::runtime::allocator::trim`]): the shared arena's regions
    /// (the largest batches' buffers) and glibc's free heap; and so it does under load that has
    /// fallen ([`LOAD_FELL`]): a burst of large batches followed by steady small ones. Without
    /// an arena the lanes also hand back what passes [`crate::runtime::allocator::FREE_LIMIT`]
    /// after each run. Returns whether to trim now: the timer does, once it has let go of the
    /// lock (a trim can take milliseconds).
    fn trim_due(&mut self) -> bool {
        let now = Instant::now();
        let idle = self.pending.is_empty() && self.lanes.iter().all(|(_, s)| *s == LaneState::Idle);
        if idle && !self.trimmed && self.last_run.is_some_and(|t| now - t >= TRIM_AFTER_IDLE) {
            self.trimmed = true;
            (self.largest, self.window) = (0, (now, 0));
            return true;
        }
        let (start, window_largest) = self.window;
        let mut due = false;
        if now - start >= TRIM_AFTER_IDLE {
            // A window in which no batch started (one long run) says nothing of the load.
            if window_largest > 0 && window_largest.saturating_mul(LOAD_FELL) <= self.largest {
                due = true;
                self.largest = window_largest;
            }
            self.window = (now, 0);
        }
        due
    }

    /// Counts a batch's size (its rows x its widest row's tokens or elements) towards
    /// [`Dispatcher::trim_due`]'s windows.
    fn note_batch(&mut self, batch: &[Job]) {
        let rows: usize = batch.iter().map(|j| j.rows.unwrap_or(1)).sum();
        let size = rows.saturating_mul(batch.iter().map(|j| j.width).max().unwrap_or(0).max(1));
        self.largest = self.largest.max(size);
        self.window.1 = self.window.1.max(size);
    }

    /// Hands batches to free lanes while there is work that may start now.
    fn dispatch(&mut self) -> Result<(), mpsc::SendError<Work>> {
        self.company_until = None;
        while let Some(pick) = self.next_anchor() {
            if let Some(until) = self.company_due(pick.index) {
                // Nothing starts before it: the timer dispatches it when its wait ends, and a
                // job that fills its batch sooner does.
                self.company_until = Some(until);
                break;
            }
            let (anchor, lane) = (self.take_anchor(pick), pick.lane);
            let heavy = anchor.heavy();
            // Lanes share what waits: a lane takes its share of it, not all of it, so the others
            // (free now or soon) get work too and no request waits behind one oversized batch.
            // The background lane shares with nobody: only heavy work goes there, and only there.
            let free = self.lanes.iter().filter(|(_, s)| *s == LaneState::Idle).count();
            let waiting = anchor.rows.unwrap_or(1) + self.pending.iter().filter_map(|j| j.rows).sum::<usize>();
            let sharing = if Some(lane) == self.background { 1 } else { self.regular_lanes() };
            // A job whose waiter gave up at its deadline (answered 504 already) does not run.
            let (batch, given_up): (Vec<Job>, Vec<Job>) = self
                .gather(anchor, waiting.div_ceil(sharing), Some(lane) == self.background)
                .into_iter()
                .partition(|job| job.start.begin());
            self.counters.queued(-(given_up.len() as i64));
            if batch.is_empty() {
                continue;
            }
            self.note_batch(&batch);
            let now = Instant::now();
            let idle = batch.len() == 1 && self.pending.is_empty() && free == self.lanes.len();
            if !idle {
                self.last_load = Some(now);
            }
            // Wide blocks every lane until it is done, and costs more CPU per request than a
            // narrow run: only for one request that has the worker to itself, and not while
            // requests have been overlapping lately (a burst would then run wide one by one);
            // or, with `wide_batches`, whenever the lane can borrow a core.
            let alone = idle && self.last_load.is_none_or(|t| now - t > RECENT_LOAD);
            let wide = self.has_wide && (alone || self.wide_batches) && Some(lane) != self.background;
            let lane = if wide { 0 } else { lane };
            self.lanes[lane].1 = if heavy { LaneState::Heavy } else { LaneState::Light };
            if !heavy {
                self.last_light = Some(now);
            }
            self.wide_running = wide;
            self.last_run = Some(now);
            self.trimmed = false;
            self.lanes[lane].0.send(Work { batch, wide, loaded: !idle })?;
        }
        Ok(())
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Job(job) => {
                crate::panics::test_switch("batch", job.rows);
                // Arriving while other work waits or runs is load, even when that work is done
                // by the time this job is dispatched (a lone run's lanes are free again).
                if !self.pending.is_empty() || self.lanes.iter().any(|(_, s)| *s != LaneState::Idle) {
                    self.last_load = Some(Instant::now());
                }
                let now = Instant::now();
                if self.priority_seen.is_none_or(|(p, t)| job.priority <= p || now - t >= PRIORITY_SEEN_FOR) {
                    self.priority_seen = Some((job.priority, now));
                }
                if let Some(pool) = &self.pool {
                    pool.saw_priority(job.priority, PRIORITY_SEEN_FOR);
                }
                // Its model's own queue full in the pool ([batching] max_queue_size): answered
                // at once.
                let policy = self.policy(job.model);
                let (limit, key) = (policy.max_waiting, policy.key);
                let here = self.pending.iter().filter(|j| j.model == job.model).count();
                let elsewhere = match (&self.waiting, limit) {
                    (Some(row), 1..) => row.elsewhere(key),
                    _ => 0,
                };
                let waiting = here + elsewhere;
                if limit > 0 && waiting >= limit {
                    self.counters.queued(-1);
                    let _ = job.reply.send(Err(EngineError::ModelQueueFull { waiting }));
                    return;
                }
                self.pending.push_back(job);
            }
            Event::Done { lane } => {
                // None once closed.
                let Some(entry) = self.lanes.get_mut(lane) else { return };
                entry.1 = LaneState::Idle;
                self.last_run = Some(Instant::now());
                if lane == 0 {
                    self.wide_running = false;
                }
            }
        }
    }

    /// The lanes that take any work: all but the background lane.
    fn regular_lanes(&self) -> usize {
        self.lanes.len() - usize::from(self.background.is_some())
    }

    /// While light work ran lately, heavy work may not take the last free regular lane: until
    /// when.
    fn reserved_until(&self) -> Option<Instant> {
        let regular = &self.lanes[..self.regular_lanes()];
        let heavy_lanes = regular.iter().filter(|(_, s)| *s == LaneState::Heavy).count();
        // A worker of one lane and no background lane has nowhere else for heavy work.
        if (regular.len() < 2 && self.background.is_none()) || heavy_lanes + 1 < regular.len() {
            return None;
        }
        self.last_light.map(|t| t + LIGHT_RESERVATION).filter(|&until| until > Instant::now())
    }

    /// The next job to start and its lane: of the jobs a free lane may take, the one of the
    /// highest priority, the oldest among equals; after [`OVERTAKES`] runs in a row that went
    /// ahead of older lower-priority work, the oldest. Light work goes to a regular lane, and
    /// so does heavy work unless the last free regular lane is reserved for light work
    /// ([`Dispatcher::reserved_until`]). Where there is a background lane, heavy work goes
    /// there instead while light work comes (and a job of more than the model's token budget,
    /// a bulk request, always), unless it has the worker to itself: then lane 0 may run it
    /// wide. With no light work about, long texts run on lane 0 as in any worker, batched, one
    /// run at a time. Nothing starts while a wide run holds every lane.
    fn next_anchor(&self) -> Option<Pick> {
        if self.wide_running {
            return None;
        }
        let idle = |lane: usize| self.lanes[lane].1 == LaneState::Idle;
        let regular = (0..self.regular_lanes()).find(|&lane| idle(lane));
        let background = self.background.filter(|&lane| idle(lane));
        let reserved = self.reserved_until().is_some();
        let quiet = self.has_wide
            && self.pending.len() == 1
            && self.lanes.iter().all(|(_, s)| *s == LaneState::Idle)
            && self.last_load.is_none_or(|t| t.elapsed() > RECENT_LOAD);
        // While work of a higher priority comes, lower-priority work keeps off lane 0 where the
        // background lane can take it: a higher-priority request then finds lane 0 free and
        // runs beside it, with the core mostly its own, instead of waiting for that run's end.
        let urgent = self.urgent();
        let yields = |job: &Job| urgent.is_some_and(|p| p < job.priority);
        let lane_for = |job: &Job| {
            let bulk = job.tokens() > self.policy(job.model).max_tokens;
            if self.background.is_some() && yields(job) {
                return background;
            }
            match (job.heavy(), self.background.is_some()) {
                (false, _) => regular,
                (true, false) => regular.filter(|_| !reserved),
                (true, true) if !bulk && (quiet || !reserved) => regular,
                (true, true) => background,
            }
        };
        // The jobs a lane may take now, oldest first (`pending` is in order of arrival).
        let mut startable = self.pending.iter().enumerate().filter_map(|(i, job)| Some((i, lane_for(job)?))).peekable();
        let (oldest, oldest_lane) = *startable.peek()?;
        // The highest priority, the oldest among equals (min_by_key keeps the first minimum).
        let (index, lane) = if self.overtaken < OVERTAKES {
            startable.min_by_key(|&(i, _)| self.pending[i].priority)?
        } else {
            (oldest, oldest_lane)
        };
        let overtakes = self.pending[index].priority < self.pending[oldest].priority;
        Some(Pick { index, lane, overtakes })
    }

    /// Takes the job `pick` names out of `pending`, counting the runs in a row that overtook.
    fn take_anchor(&mut self, pick: Pick) -> Job {
        self.overtaken = if pick.overtakes { self.overtaken + 1 } else { 0 };
        self.pending.remove(pick.index).expect("next_anchor gives an index into pending")
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
                let _ = job.reply.send(Err(EngineError::DeadlineExceeded { waited }));
            } else {
                live.push_back(job);
            }
        }
        self.pending = live;
    }

    /// With `max_queue_delay_ms`, the anchor (`pending[index]`) waits for company until its
    /// batch is full or that long after its arrival: until when, if it is to wait now.
    fn company_due(&self, index: usize) -> Option<Instant> {
        let anchor = &self.pending[index];
        let policy = self.policy(anchor.model);
        let rows = anchor.rows?;
        if policy.max_rows <= 1 || policy.delay.is_zero() {
            return None;
        }
        let others = self.pending.iter().enumerate().filter(|&(i, job)| i != index && anchor.fits(job));
        let rows = rows + others.filter_map(|(_, job)| job.rows).sum::<usize>();
        let until = anchor.queued_at + policy.delay;
        (rows < policy.max_rows && Instant::now() < until).then_some(until)
    }

    /// The anchor plus the waiting jobs that fit it within the model's limits and `max_rows`,
    /// for the background lane (`background`) or a regular one.
    fn gather(&mut self, anchor: Job, max_rows: usize, background: bool) -> Vec<Job> {
        let policy = self.policy(anchor.model).clone();
        let max_rows = max_rows.min(policy.max_rows);
        let Some(mut rows) = anchor.rows.filter(|_| max_rows > 1) else { return vec![anchor] };
        let (mut width, mut narrowest) = (anchor.width, anchor.width);
        // Company of a lower priority than the anchor's would make its run longer: it waits for
        // its own. And while work of a higher priority than the anchor's comes, company of the
        // anchor's own priority would make a run such work waits for longer: the anchor takes
        // only company of a higher priority. Not on the background lane, which such work never
        // waits for.
        let higher_comes = !background && self.urgent().is_some_and(|p| p < anchor.priority);
        let lowest = if higher_comes { anchor.priority.saturating_sub(1) } else { anchor.priority };
        let mut candidates: Vec<usize> = (0..self.pending.len())
            .filter(|&i| anchor.fits(&self.pending[i]) && self.pending[i].priority <= lowest)
            .collect();
        // The highest priority first, then the closest in length (a stable sort: oldest first
        // among equals).
        candidates.sort_by_key(|&i| (self.pending[i].priority, self.pending[i].width.abs_diff(anchor.width)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::engine::batch::tests::text_job;

    fn dispatcher(max_rows: usize, max_tokens: usize, pending: Vec<Job>) -> Dispatcher {
        let policies =
            vec![Policy { batchable: true, max_rows, max_tokens, delay: Duration::ZERO, max_waiting: 0, key: 0 }];
        let counters = Arc::new(WorkerCounters::create("inferd-engine-test").unwrap().0);
        // No lanes: no run options, so no ONNX Runtime needed.
        let clock = Arc::new(RunClock::new(0, counters.clone(), Duration::from_secs(1), Default::default()).unwrap());
        let mut d = Dispatcher::new(policies, Vec::new(), false, counters, clock, std::sync::Weak::new());
        d.pending = pending.into();
        d
    }

    /// The next anchor, taken from the waiting jobs as `dispatch` takes it.
    fn next_job(d: &mut Dispatcher) -> Option<Job> {
        let pick = d.next_anchor()?;
        Some(d.take_anchor(pick))
    }

    /// Gives `d` `n` idle lanes and wide sessions; returns what each lane is handed.
    fn with_lanes(d: &mut Dispatcher, n: usize) -> Vec<mpsc::Receiver<Work>> {
        d.has_wide = true;
        let (senders, lanes): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Work>()).unzip();
        d.lanes = senders.into_iter().map(|s| (s, LaneState::Idle)).collect();
        lanes
    }

    #[test]
    #[should_panic(expected = "a lane of this worker is gone")]
    fn a_lane_gone_before_its_channel_closed_ends_the_worker() {
        let mut d = dispatcher(32, 8192, Vec::new());
        drop(with_lanes(&mut d, 1));
        // A job someone waits for (text_job's answer goes nowhere: it would be dropped).
        let (reply, _waiting) = tokio::sync::oneshot::channel();
        let job = Job { reply, ..text_job(1, 17, 0) };
        // In a worker the panic hook ends the process here (unguarded); in a test it unwinds.
        Shared::new(d).handle(Event::Job(job));
    }

    /// A text job of `priority` that has waited `waited` (its clock set back by that much).
    fn waiting(priority: u8, waited: Duration, id: i64) -> Job {
        let mut job = Job { priority, ..text_job(1, 17, id) };
        job.queued_at -= waited;
        job
    }

    #[test]
    fn a_lane_takes_the_highest_priority_first_however_long_the_line_has_waited() {
        let ms = Duration::from_millis;
        // Bulk (priority 9) arrived first; an interactive request (0) after: it goes first.
        let pending =
            vec![waiting(9, ms(50), 0), waiting(9, ms(40), 100), waiting(9, ms(30), 200), waiting(0, ms(0), 300)];
        let mut d = dispatcher(1, 8192, pending);
        let _lanes = with_lanes(&mut d, 1);
        assert_eq!(next_job(&mut d).unwrap().priority, 0, "the interactive request first");
        // Among equals, the oldest.
        assert_eq!(next_job(&mut d).unwrap().inputs[0].data, text_job(1, 17, 0).inputs[0].data);

        // A line of 40 bulk jobs that have waited 5 to 9 s: a priority-0 request that arrives
        // now is still taken first. Time waited raises nothing: priorities order a long line
        // as they order a short one.
        let mut pending: Vec<Job> = (0..40).map(|i| waiting(9, ms(9000 - 100 * i), i as i64)).collect();
        pending.push(waiting(0, ms(0), 1000));
        let mut d = dispatcher(1, 8192, pending);
        let _lanes = with_lanes(&mut d, 1);
        assert_eq!(next_job(&mut d).unwrap().priority, 0);
        // And so is the next one that arrives while the line waits, run after run.
        for i in 0..10 {
            d.pending.push_back(waiting(0, ms(0), 2000 + i));
            assert_eq!(next_job(&mut d).unwrap().priority, 0, "interactive request {i}");
            assert_eq!(next_job(&mut d).unwrap().priority, 9, "the bulk line's turn between them");
        }

        // A batch gathers the highest-priority company first, and none of a lower priority
        // than its anchor's (it would make the anchor's run longer).
        let mut d = dispatcher(3, 8192, vec![waiting(9, ms(10), 0), waiting(0, ms(0), 100), waiting(5, ms(0), 300)]);
        let batch = d.gather(waiting(0, ms(0), 200), 64, false);
        assert_eq!(batch.iter().map(|j| j.priority).collect::<Vec<_>>(), [0, 0]);
        let mut d = dispatcher(3, 8192, vec![waiting(9, ms(10), 0), waiting(0, ms(0), 100)]);
        let batch = d.gather(waiting(5, ms(0), 200), 64, false);
        assert_eq!(batch.iter().map(|j| j.priority).collect::<Vec<_>>(), [5, 0], "a bulk anchor takes anyone");

        // While work of a higher priority comes, a bulk anchor runs without company of its
        // own priority (an interactive request would wait for a longer run), and takes the
        // higher-priority work waiting; once none came for PRIORITY_SEEN_FOR, it takes its own.
        let bulk_batch = |seen: Duration| {
            let mut d = dispatcher(8, 8192, vec![waiting(9, ms(10), 0), waiting(9, ms(5), 100)]);
            d.take(Event::Job(waiting(0, ms(0), 300)));
            d.priority_seen = d.priority_seen.map(|(p, t)| (p, t - seen));
            d.gather(waiting(9, ms(20), 200), 64, false).iter().map(|j| j.priority).collect::<Vec<_>>()
        };
        assert_eq!(bulk_batch(Duration::ZERO), [9, 0]);
        assert_eq!(bulk_batch(PRIORITY_SEEN_FOR), [9, 0, 9, 9]);
    }

    #[test]
    fn lower_priority_work_gets_one_run_in_overtakes_plus_one_while_higher_never_stops() {
        // 10 bulk jobs (priority 9) waiting, and priority-0 work that never stops: a new one
        // arrives with every run, so one always waits.
        let bulk = 10;
        let mut d = dispatcher(1, 8192, (0..bulk).map(|i| waiting(9, Duration::from_secs(5), i)).collect());
        let _lanes = with_lanes(&mut d, 1);
        let per_round = OVERTAKES as usize + 1;
        let mut taken = Vec::new();
        for run in 0..bulk as usize * per_round + 3 {
            d.pending.push_back(waiting(0, Duration::ZERO, 1000 + run as i64));
            taken.push(next_job(&mut d).unwrap());
        }
        let bulk_runs: Vec<usize> = (0..taken.len()).filter(|&i| taken[i].priority == 9).collect();
        // Every bulk job served, oldest first, one run in OVERTAKES + 1: the k-th within
        // (k + 1) x (OVERTAKES + 1) runs, whatever priority-0 work keeps coming.
        assert_eq!(bulk_runs.len(), bulk as usize, "runs: {:?}", taken.iter().map(|j| j.priority).collect::<Vec<_>>());
        for (k, &run) in bulk_runs.iter().enumerate() {
            assert_eq!(run, (k + 1) * per_round - 1, "bulk job {k}");
            assert_eq!(taken[run].inputs[0].data, text_job(1, 17, k as i64).inputs[0].data, "oldest first");
        }
        // The priority-0 work took the other runs: OVERTAKES in each round, oldest first.
        let interactive: Vec<&Job> = taken.iter().filter(|j| j.priority == 0).collect();
        assert_eq!(interactive.len(), taken.len() - bulk as usize);
        assert!(interactive.windows(2).all(|w| w[0].queued_at <= w[1].queued_at));
        // With the bulk line served, priority 0 has every run: nothing older is overtaken.
        assert!(taken[bulk as usize * per_round..].iter().all(|j| j.priority == 0));
        assert_eq!(d.overtaken, 0);
    }

    #[test]
    fn short_texts_batch_together_and_a_long_one_does_not_inflate_them() {
        let shorts = || (0..15).map(|i| text_job(1, 17, i)).collect::<Vec<_>>();
        let mut pending = shorts();
        pending.insert(3, text_job(1, 256, 0));
        let mut d = dispatcher(32, 8192, pending);
        let batch = d.gather(text_job(1, 17, 99), 64, false);
        assert_eq!(batch.len(), 16, "the anchor and the 15 short texts");
        assert!(batch.iter().all(|j| j.width == 17));
        assert_eq!(d.pending.len(), 1, "the long text waits for its own run");

        // No row is padded to more than twice its length: a long anchor runs without them.
        let mut d = dispatcher(32, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 256, 0), 64, false).len(), 1);
        let mut d = dispatcher(32, 8192, vec![text_job(1, 10, 0), text_job(1, 30, 0), text_job(1, 20, 0)]);
        let widths: Vec<usize> = d.gather(text_job(1, 15, 0), 64, false).iter().map(|j| j.width).collect();
        assert_eq!(widths, [15, 20, 10], "closest first, then within 2x of the narrowest");

        // Rows and the token budget both bound a batch.
        let mut d = dispatcher(4, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64, false).len(), 4);
        let mut d = dispatcher(32, 17 * 6, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64, false).len(), 6);
        // Batching off (no dynamic batch dimension, or max_batch_size = 1): always alone.
        let mut d = dispatcher(1, 8192, shorts());
        assert_eq!(d.gather(text_job(1, 17, 0), 64, false).len(), 1);
    }

    #[test]
    fn a_lone_request_runs_wide_unless_requests_arrive_while_others_run() {
        let mut d = dispatcher(32, 512, Vec::new());
        let lanes = with_lanes(&mut d, 2);
        let wide_of_next_run = |d: &mut Dispatcher| {
            d.dispatch().unwrap();
            let work = lanes.iter().find_map(|l| l.try_recv().ok()).expect("a batch was handed out");
            work.wide
        };
        // Requests one after another, each once the last was answered: every one runs wide.
        for _ in 0..3 {
            d.take(Event::Job(text_job(1, 17, 0)));
            assert!(wide_of_next_run(&mut d), "a request with the worker to itself runs wide");
            d.take(Event::Done { lane: 0 });
        }
        // One arrives while a run is in progress: by the time it is dispatched the lanes are
        // free again, but it was load, and for a while lone requests run narrow.
        d.take(Event::Job(text_job(1, 17, 0)));
        assert!(wide_of_next_run(&mut d));
        d.take(Event::Job(text_job(1, 17, 1)));
        d.take(Event::Done { lane: 0 });
        assert!(!wide_of_next_run(&mut d), "it came while another request ran");
        d.take(Event::Done { lane: 0 });
        d.take(Event::Job(text_job(1, 17, 0)));
        assert!(!wide_of_next_run(&mut d), "within RECENT_LOAD of the overlap");
        d.take(Event::Done { lane: 0 });
        d.take(Event::Done { lane: 1 });
        d.last_load = Some(Instant::now() - RECENT_LOAD * 2);
        d.take(Event::Job(text_job(1, 17, 0)));
        assert!(wide_of_next_run(&mut d), "the load is over");
    }

    #[test]
    fn a_worker_of_one_lane_that_borrows_asks_for_wide_runs_under_load_too() {
        // Two requests overlapping on a worker of one lane: the batch of both it hands out.
        let batch_of_two = |mut d: Dispatcher| {
            let lane = with_lanes(&mut d, 1).remove(0);
            d.take(Event::Job(text_job(1, 17, 0)));
            d.take(Event::Job(text_job(1, 17, 1)));
            d.dispatch().unwrap();
            lane.try_recv().unwrap()
        };
        let work = batch_of_two(dispatcher(32, 512, Vec::new()).with_wide_batches());
        assert_eq!((work.batch.len(), work.wide), (2, true), "wide: the lane borrows if it can");
        assert!(!batch_of_two(dispatcher(32, 512, Vec::new())).wide, "without it, load runs narrow");
    }

    #[test]
    fn a_worker_of_one_lane_runs_heavy_work_on_its_background_lane_beside_light_work() {
        let mut d = dispatcher(32, 512, Vec::new());
        let lanes = with_lanes(&mut d, 2);
        let mut d = d.with_background_lane();
        // What each lane was handed: (rows, widest text, wide).
        let handed = |lane: usize| {
            lanes[lane].try_recv().ok().map(|w| (w.batch.len(), w.batch.iter().map(|j| j.width).max().unwrap(), w.wide))
        };
        // Only long texts about: they run on lane 0, batched, one run at a time, as in a worker
        // without a background lane.
        d.last_load = Some(Instant::now());
        for i in 0..3 {
            d.take(Event::Job(text_job(1, 256, i)));
        }
        d.dispatch().unwrap();
        assert_eq!((handed(0), handed(1), d.pending.len()), (Some((2, 256, false)), None, 1));
        d.take(Event::Done { lane: 0 });
        d.dispatch().unwrap();
        assert_eq!(handed(0), Some((1, 256, false)));
        d.take(Event::Done { lane: 0 });

        // A long text and short ones waiting while short work comes: the long one runs on the
        // background lane, the short ones beside it on lane 0, narrow.
        d.last_light = Some(Instant::now());
        d.take(Event::Job(text_job(1, 256, 0)));
        d.take(Event::Job(text_job(1, 17, 0)));
        d.take(Event::Job(text_job(1, 17, 1)));
        d.dispatch().unwrap();
        assert_eq!(handed(1), Some((1, 256, false)), "the long text, on the background lane");
        assert_eq!(handed(0), Some((2, 17, false)), "both short texts, on lane 0");
        // Lane 0 busy: a short text waits for it, never the background lane...
        d.take(Event::Done { lane: 1 });
        d.take(Event::Job(text_job(1, 17, 2)));
        d.dispatch().unwrap();
        assert_eq!((handed(0), handed(1), d.pending.len()), (None, None, 1));
        // ... while a long one takes the background lane past it.
        d.take(Event::Job(text_job(1, 256, 1)));
        d.dispatch().unwrap();
        assert_eq!((handed(1), d.pending.len()), (Some((1, 256, false)), 1));
        d.take(Event::Done { lane: 0 });
        d.dispatch().unwrap();
        assert_eq!(handed(0), Some((1, 17, false)));
        d.take(Event::Done { lane: 0 });
        d.take(Event::Done { lane: 1 });

        // Alone, a long text within the token budget runs on lane 0, wide, even right after
        // short work; a larger job (a bulk request) goes to the background lane even then.
        d.last_load = Some(Instant::now() - RECENT_LOAD * 2);
        d.take(Event::Job(text_job(2, 256, 0)));
        d.dispatch().unwrap();
        assert_eq!(handed(0), Some((1, 256, true)), "512 tokens, the worker to itself: wide");
        d.take(Event::Done { lane: 0 });
        d.last_load = Some(Instant::now() - RECENT_LOAD * 2);
        d.take(Event::Job(text_job(4, 256, 0)));
        d.dispatch().unwrap();
        assert_eq!((handed(0), handed(1)), (None, Some((1, 256, false))), "1024 tokens: background");
    }

    #[test]
    fn a_job_past_its_models_own_queue_size_is_refused_at_once() {
        let mut d = dispatcher(32, 512, Vec::new());
        d.policies.get_mut(&0).unwrap().max_waiting = 2;
        // No lanes: every job waits.
        let mut answers: Vec<_> = (0..3)
            .map(|i| {
                let (reply, answer) = tokio::sync::oneshot::channel();
                d.take(Event::Job(Job { reply, ..text_job(1, 17, i) }));
                answer
            })
            .collect();
        assert_eq!(d.pending.len(), 2);
        let refused = answers.pop().unwrap().try_recv().unwrap().unwrap_err().to_string();
        assert!(
            refused.contains("2 requests are already waiting for this model ([batching] max_queue_size"),
            "{refused}"
        );
        assert!(answers.iter_mut().all(|a| a.try_recv().is_err()), "the first two wait");
    }

    #[test]
    fn lower_priority_work_keeps_off_lane_0_while_higher_priority_work_comes() {
        let mut d = dispatcher(32, 512, Vec::new());
        let lanes = with_lanes(&mut d, 2);
        let mut d = d.with_background_lane();
        // The priorities of what each lane was handed.
        let handed = |lane: usize| lanes[lane].try_recv().ok().map(|w| w.batch.iter().map(|j| j.priority).collect());
        let now = Duration::ZERO;
        // Bulk work alone runs on lane 0, as any light work does.
        d.take(Event::Job(waiting(9, now, 0)));
        d.dispatch().unwrap();
        assert_eq!((handed(0), handed(1)), (Some(vec![9]), None));
        d.take(Event::Done { lane: 0 });
        // Once an interactive request came, bulk work takes the background lane, and lane 0
        // stays free for the next interactive request, which runs beside it.
        d.take(Event::Job(waiting(0, now, 1)));
        d.dispatch().unwrap();
        assert_eq!(handed(0), Some(vec![0]));
        d.take(Event::Done { lane: 0 });
        for i in 0..3 {
            d.take(Event::Job(waiting(9, now, 10 + i)));
        }
        d.dispatch().unwrap();
        // Batched there: no interactive request waits for that lane.
        assert_eq!((handed(0), handed(1)), (None, Some(vec![9, 9, 9])), "the bulk jobs, beside");
        d.take(Event::Job(waiting(0, now, 20)));
        d.dispatch().unwrap();
        assert_eq!(handed(0), Some(vec![0]), "the interactive request, on lane 0");
        d.take(Event::Done { lane: 0 });
        d.take(Event::Job(waiting(9, now, 30)));
        d.take(Event::Job(waiting(9, now, 31)));
        d.dispatch().unwrap();
        assert_eq!((handed(0), d.pending.len()), (None, 2), "bulk work waits for the background lane");
        // None came for PRIORITY_SEEN_FOR: bulk work takes lane 0 again, with company.
        d.priority_seen = Some((0, Instant::now() - PRIORITY_SEEN_FOR));
        d.take(Event::Done { lane: 1 });
        d.dispatch().unwrap();
        assert_eq!((handed(0), handed(1)), (Some(vec![9, 9]), None));
    }

    #[test]
    fn the_last_free_lane_is_kept_for_light_work_while_it_comes() {
        let lanes = || (0..2).map(|_| (mpsc::channel().0, LaneState::Idle)).collect::<Vec<_>>();
        let mut d = dispatcher(32, 512, vec![text_job(1, 256, 0), text_job(1, 17, 0), text_job(1, 256, 1)]);
        d.lanes = lanes();
        // Both lanes free: the oldest job goes first, heavy or not.
        assert_eq!(next_job(&mut d).unwrap().width, 256);
        // One lane runs heavy work and light work ran lately: the other lane takes light work,
        // and a heavy job waits rather than take it.
        d.lanes[0].1 = LaneState::Heavy;
        d.last_light = Some(Instant::now());
        assert_eq!(next_job(&mut d).unwrap().width, 17);
        assert!(next_job(&mut d).is_none() && d.pending.len() == 1);
        assert!(d.reserved_until().is_some());
        // No light work for a while: heavy work may use every lane.
        d.last_light = Some(Instant::now() - LIGHT_RESERVATION);
        assert_eq!(next_job(&mut d).unwrap().width, 256);
    }
}
