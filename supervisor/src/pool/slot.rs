//! The pool's parts: its slots, each with a fixed CPU set and the workers it runs, and what
//! workers started now run. A worker's [`Role`] in its slot, a slot's [`Start`] (the only thing
//! that starts a current worker).

use std::time::{Duration, Instant};

use inferd_config::auth::Access;
use inferd_config::file::ServerConfig;
use inferd_config::model::ModelEntry;
use inferd_config::Config;
use inferd_ipc::spec::{Cause, FailureKind, ModelCost, ModelInfo};
use inferd_ipc::stats::WorkerCounters;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use opentelemetry::KeyValue;
use tracing::{error, info, warn};

use super::restart::{backoff, RECYCLE_PAUSE, TICK};
use super::sockets::SlotSockets;
use crate::control::ActionError;
use crate::metrics::RecycleReason;
use crate::plan::cpu::{format_cpus, plan, Ask, Placement};
use crate::plan::Resolved;
use crate::status::WorkerState;
use crate::trace;

/// How a slot's worker replacement ended: its new worker is ready (its pid), or it failed.
pub(super) enum Replaced {
    Ready(u32),
    Failed(String),
}

/// A worker stops a run past server.request_timeout_secs itself (ORT run termination); the
/// supervisor aborts the worker only if the run is still going this long after.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// The pool: its slots, and what the workers started now run.
pub(super) struct Pool {
    pub(super) slots: Vec<Slot>,
    /// Incremented by every reload; workers carry the generation they were started for.
    pub(super) generation: u64,
    /// The models new slots (scale +1) run: those of the latest successful reload.
    pub(super) models: Vec<ModelEntry>,
    /// `[models] on_demand`: the repository's models besides the default one, as read when the
    /// pool started or by the latest successful reload ([`read_on_demand`]); a worker gets
    /// those it does not run (spawn.rs). Empty when on_demand is off.
    pub(super) on_demand: Vec<ModelEntry>,
    /// The API keys and certificate workers started now take: those of the latest
    /// successful reload.
    pub(super) access: Access,
}

impl Pool {
    /// Every worker of every slot.
    pub(super) fn workers(&self) -> impl Iterator<Item = &Worker> {
        self.slots.iter().flat_map(|s| &s.workers)
    }

    /// Whether every slot not being removed has its current worker ready.
    pub(super) fn all_ready(&self) -> bool {
        self.slots.iter().filter(|s| !s.removing()).all(Slot::ready)
    }

    /// Slots whose current worker is ready.
    pub(super) fn ready_count(&self) -> usize {
        self.slots.iter().filter(|s| s.ready()).count()
    }

    /// The first slot that `scale -1` is still draining.
    pub(super) fn removing(&self) -> Option<usize> {
        self.slots.iter().position(Slot::removing)
    }

    /// A worker whose model run has lasted longer than server.request_timeout_secs (plus
    /// [`STOP_GRACE`] for the worker to stop it itself), or whose
    /// batch timer thread stopped beating, gets SIGABRT, and SIGKILL on the next tick if it is still
    /// there (gunicorn's escalation); it is then replaced like any dead worker.
    pub(super) fn kill_stuck(&mut self, timeout: f64) {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            for w in slot.workers.iter_mut().filter(|w| w.ready_at.is_some()) {
                if let Some((why, since)) = &w.stuck {
                    if since.elapsed() >= TICK {
                        warn!("worker {index} (pid {}) still there after SIGABRT ({why}); SIGKILL", w.pid);
                        let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
                    }
                    continue;
                }
                let (busy, beat) = w.stats.model_thread();
                let io = w.stats.io_thread();
                let why = match (busy, beat) {
                    // The worker stops such a run itself at the timeout; one still going this
                    // much later does not stop (a kernel that never returns).
                    (Some(b), _) if b > timeout + STOP_GRACE.as_secs_f64() => format!(
                        "a model run has lasted {b:.1} s, over server.request_timeout_secs = {timeout} and did not stop"
                    ),
                    (None, Some(b)) if b > timeout.max(5.0) => {
                        format!("the batch timer thread has not beaten for {b:.1} s")
                    }
                    // Nothing the I/O loop does for one request takes seconds: one that has
                    // not turned for this long serves nobody on this worker.
                    _ if io.is_some_and(|b| b > timeout.max(5.0)) => {
                        format!("the I/O loop has not turned for {:.1} s", io.unwrap_or_default())
                    }
                    _ => continue,
                };
                error!("worker {index} (pid {}) is stuck: {why}; SIGABRT", w.pid);
                let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGABRT);
                w.stuck = Some((why, Instant::now()));
            }
        }
    }

    /// Recycling (server.max_requests, server.max_worker_age_secs, older than `max_age`
    /// seconds when not 0) and faults (a panic caught serving a request, which comes first):
    /// the slot whose worker is replaced now, like in a reload, incoming first, and why. One
    /// replacement at a time across the pool, the worker furthest past its limit first, and
    /// none during a reload (`reloading`: it replaces everyone anyway).
    pub(super) fn recycle_due(&self, now: Instant, max_age: f64, reloading: bool) -> Option<(usize, RecycleReason)> {
        if reloading || self.slots.iter().any(|s| s.with_role(Role::Incoming).is_some()) {
            return None;
        }
        // (how far past the limit, as a share of it; slot; reason)
        let mut due: Option<(f64, usize, RecycleReason)> = None;
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.removing() || slot.recycle_pause.is_some_and(|t| now < t) {
                continue;
            }
            let Some(w) = slot.with_role(Role::Current).filter(|w| w.state == WorkerState::Ready) else { continue };
            let by_requests = w
                .recycle_after
                .map(|n| (w.stats.snapshot().requests_total() as f64 / n as f64, RecycleReason::MaxRequests));
            let by_age = (max_age > 0.0).then(|| (w.started.elapsed().as_secs_f64() / max_age, RecycleReason::MaxAge));
            let by_fault = (w.stats.faults() > 0).then_some((f64::INFINITY, RecycleReason::Fault));
            for (over, reason) in [by_requests, by_age, by_fault].into_iter().flatten() {
                if over >= 1.0 && due.is_none_or(|(o, _, _)| over > o) {
                    due = Some((over, index, reason));
                }
            }
        }
        due.map(|(_, index, reason)| (index, reason))
    }

    /// Opens the trace of slot `index`'s worker `pid` being replaced for `cause` (`reason`,
    /// `detail`: what happened to it), one span until the new worker is ready or fails
    /// (docs/operations.md, "Traces"). Returns its trace id for the log lines that follow.
    pub(super) fn begin_replacement(
        &mut self,
        index: usize,
        cause: Cause,
        reason: &str,
        pid: u32,
        detail: &str,
    ) -> Option<String> {
        use opentelemetry::trace::TraceContextExt as _;
        let attributes = vec![
            KeyValue::new("inferd.slot", index as i64),
            KeyValue::new("inferd.cause", cause.as_str()),
            KeyValue::new("inferd.reason", reason.to_string()),
            KeyValue::new("inferd.replaced_pid", i64::from(pid)),
            KeyValue::new("inferd.detail", detail.to_string()),
        ];
        let span = trace::start(format!("replace worker {index}"), None, attributes);
        let trace_id = span.as_ref().map(|cx| cx.span().span_context().trace_id().to_string());
        let slot = &mut self.slots[index];
        if let Some(old) = std::mem::replace(&mut slot.replacement, span) {
            trace::end(Some(old), vec![KeyValue::new("inferd.outcome", "superseded")], None);
        }
        trace_id
    }

    /// Ends slot `index`'s replacement trace: its new worker `pid` is ready, or it failed.
    pub(super) fn end_replacement(&mut self, index: usize, outcome: Replaced) {
        let span = self.slots[index].replacement.take();
        match outcome {
            Replaced::Ready(pid) => trace::end(
                span,
                vec![KeyValue::new("inferd.outcome", "ready"), KeyValue::new("process.pid", i64::from(pid))],
                None,
            ),
            Replaced::Failed(why) => trace::end(span, vec![KeyValue::new("inferd.outcome", "failed")], Some(why)),
        }
    }

    /// Which slots' sockets stay in the port's SO_REUSEPORT group. A slot none of whose
    /// workers accepts (its worker died, drains, or is not warm yet) leaves the group, so that
    /// connections waiting in its queue move to a sibling (net.ipv4.tcp_migrate_req) and new
    /// ones go there, but only while a sibling accepts: when every worker is down at once, the
    /// sockets that still listen stay, and clients wait in their queues for the first worker
    /// back instead of being refused. That worker's readiness settles the port again, and the
    /// slots still without a worker leave then. A `stopping` pool respawns nothing: its slots
    /// leave as their workers stop accepting.
    ///
    /// A slot whose next worker is booting is left as it is: that worker listens as soon as
    /// it is warm, before its `Ready` arrives here, and taking its socket out just then would
    /// make it join again (a slot left earlier has left already).
    pub(super) fn settle_port(&self, stopping: bool) {
        if stopping || self.slots.iter().any(Slot::ready) {
            for slot in self.slots.iter().filter(|s| !s.ready() && s.booting().is_none()) {
                slot.sockets.leave();
            }
        }
    }

    /// Every worker of the pool gets `signal`.
    pub(super) fn signal_all(&self, signal: Signal) {
        for worker in self.workers() {
            let _ = nix::sys::signal::kill(Pid::from_raw(worker.pid as i32), signal);
        }
    }

    /// Every worker retires (SIGUSR1: each finishes its requests and hands its idle
    /// connections on), and no slot starts another.
    pub(super) fn retire_all(&mut self) {
        for slot in &mut self.slots {
            slot.start = Start::No;
            for worker in slot.workers.iter_mut() {
                worker.retire();
            }
        }
    }

    /// The memory plan keeps `keep` slots; those held at boot start now.
    pub(super) fn fit(&mut self, keep: usize) {
        self.slots.truncate(keep);
        for slot in self.slots.iter_mut().skip(1).filter(|s| s.start == Start::Held) {
            slot.start = Start::At(Instant::now());
        }
    }

    /// Workers still booting past `boot_timeout`: killed, with that as their failure.
    pub(super) fn kill_unready(&mut self, boot_timeout: Duration) {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            for w in slot.workers.iter_mut() {
                let booting = matches!(w.state, WorkerState::Starting | WorkerState::Warming);
                if booting && w.failure.is_none() && w.started.elapsed() > boot_timeout {
                    let error = format!("not ready within server.boot_timeout_secs = {}", boot_timeout.as_secs_f64());
                    warn!("worker {index} (pid {}) {error}; killing it", w.pid);
                    w.failure = Some((FailureKind::Boot, error));
                    let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
                }
            }
        }
    }

    /// The slots whose current worker starts now ([`Slot::due`]), each with the cause, models
    /// and generation it starts for; their start is spent.
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<(usize, Cause, Vec<ModelEntry>, u64)> {
        let mut due = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if slot.due(now) {
                slot.start = Start::No;
                due.push((index, slot.cause, slot.models.clone(), slot.generation));
            }
        }
        due
    }

    /// A worker was started for slot `index`.
    pub(super) fn add_worker(&mut self, index: usize, worker: Worker) {
        self.slots[index].workers.push(worker);
    }

    /// Slot `index`'s worker (`role`) could not be started: the slot counts a failure, and a
    /// current worker is tried again after the returned delay.
    pub(super) fn start_failed(&mut self, index: usize, role: Role) -> Duration {
        let slot = &mut self.slots[index];
        slot.failures += 1;
        let delay = backoff(slot.failures).max(Duration::from_millis(500));
        if role == Role::Current {
            slot.start = Start::At(Instant::now() + delay);
        }
        delay
    }

    /// An incoming worker is ready: it becomes the slot's current worker, and the one it
    /// replaces drains and leaves. Returns its spawn id.
    pub(super) fn promote(&mut self, index: usize, pid: u32) -> Option<u64> {
        let slot = &mut self.slots[index];
        let mut spawn = None;
        for w in slot.workers.iter_mut() {
            if w.pid == pid {
                w.role = Role::Current;
                slot.generation = w.generation;
                spawn = Some(w.spawn);
            } else if w.role == Role::Current {
                info!("worker {index} (pid {}) replaced by pid {pid}; draining", w.pid);
                w.retire();
            }
        }
        spawn
    }

    /// A reload's worker is current in slot `index`: the slot runs `models` from now on.
    pub(super) fn slot_runs(&mut self, index: usize, models: Vec<ModelEntry>) {
        self.slots[index].models = models;
    }

    /// Worker `pid` of slot `index` has exited: it leaves the slot.
    pub(super) fn remove_worker(&mut self, index: usize, pid: u32) -> Option<Worker> {
        let slot = self.slots.get_mut(index)?;
        let at = slot.workers.iter().position(|w| w.pid == pid)?;
        Some(slot.workers.remove(at))
    }

    /// Trailing slots that `scale -1` removed and whose workers are gone leave the pool (events
    /// name slots by index: only trailing slots may go, so no index shifts). Returns whether
    /// any did.
    pub(super) fn drop_removed(&mut self) -> bool {
        let before = self.slots.len();
        while self.slots.last().is_some_and(|s| s.removing() && s.workers.is_empty()) {
            self.slots.pop();
        }
        self.slots.len() < before
    }

    /// The memory watch: slot `index`'s current worker is over the hard limit: SIGKILL.
    pub(super) fn kill_for_memory(&mut self, index: usize) {
        for w in self.slots[index].workers.iter_mut().filter(|w| w.role == Role::Current) {
            w.memory_killed = true;
            let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
        }
    }

    /// Slot `index`'s current worker retires first, and its successor starts for `cause` once
    /// it is gone (memory too tight for both at once).
    pub(super) fn retire_first(&mut self, index: usize, cause: Cause) {
        let slot = &mut self.slots[index];
        for w in slot.workers.iter_mut().filter(|w| w.role == Role::Current) {
            w.retire();
        }
        slot.start = Start::WhenEmpty;
        slot.cause = cause;
    }

    /// The pool stops: every replacement in progress ends there.
    pub(super) fn stopped(&mut self) {
        for slot in &mut self.slots {
            trace::end(slot.replacement.take(), vec![KeyValue::new("inferd.outcome", "stopped")], None);
        }
    }

    /// A reload begins: the generation its workers are started for.
    pub(super) fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    /// A reload is complete: workers started from now on run its models, catalog and access.
    pub(super) fn install(&mut self, models: Vec<ModelEntry>, on_demand: Vec<ModelEntry>, access: Access) {
        self.models = models;
        self.on_demand = on_demand;
        self.access = access;
    }

    /// `scale +1` adds a slot when the CPU budget has room for it (`activated`: the workers
    /// share systemd's socket); `scale -1` drains the last.
    pub(super) fn scale(&mut self, delta: i32, resolved: &Resolved, activated: bool) -> Result<String, ActionError> {
        // One step at a time: slots are named by index, so a draining one must be gone before
        // the pool changes size again.
        if let Some(i) = self.removing() {
            return Err(ActionError::ScaleDraining(i));
        }
        let count = self.slots.len();
        match delta {
            1 => {
                let threads = resolved.plan.threads_per_worker;
                let ask = Ask { workers: count + 1, threads, ..Ask::of(&resolved.config.server) };
                let plan = plan(&resolved.plan.budget, ask)?;
                let placement = plan.workers[count].clone();
                let cpus = format_cpus(&placement.cpus);
                let sockets = SlotSockets::bind(&resolved.config.server, activated)?;
                let slot = Slot::new(placement, self.models.clone(), self.generation, Cause::Scale, sockets);
                self.slots.push(slot);
                Ok(format!("scaling up to {} workers: the new one is pinned to cpus {cpus}", self.slots.len()))
            }
            -1 => {
                if count <= 1 {
                    return Err(ActionError::LastWorker);
                }
                let index = count - 1;
                let slot = &mut self.slots[index];
                slot.start = Start::Removing;
                for w in slot.workers.iter_mut() {
                    w.retire();
                }
                if slot.workers.is_empty() {
                    self.slots.pop(); // the last slot: no removing slot follows it (checked above)
                }
                Ok(format!("scaling down to {} workers: draining worker {index}", count - 1))
            }
            other => Err(ActionError::Step(other)),
        }
    }
}

/// `[models] on_demand`'s catalog, read from the repository now: every model folder but the
/// default model's (`models[0]`), each resolved as a `models.load` entry is. A folder that does
/// not resolve is left out with a warning naming it: a request for it gets a worker's 404.
/// Models the pool runs stay in, so that a later unload leaves them servable on demand; a
/// worker gets those it does not run ([`on_demand_besides`]). Nothing when on_demand is off.
pub(super) fn read_on_demand(config: &Config, models: &[ModelEntry]) -> Vec<ModelEntry> {
    let (found, refused) = config.on_demand_models(&models[..models.len().min(1)]);
    for (name, error) in refused {
        warn!("model folder '{name}' cannot be loaded on demand: {error}");
    }
    found
}

/// What a worker that runs `models` may load on demand: the catalog's other models.
pub(super) fn on_demand_besides(catalog: &[ModelEntry], models: &[ModelEntry]) -> Vec<ModelEntry> {
    catalog.iter().filter(|m| !models.iter().any(|p| p.name == m.name)).cloned().collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// The slot's serving worker.
    Current,
    /// Started to replace the current worker; takes its place once ready.
    Incoming,
    /// Replaced: draining, then gone.
    Retiring,
}

pub(super) struct Worker {
    pub(super) pid: u32,
    /// This spawn's identity, unique over the supervisor's life: a reload waits for the one
    /// worker it started, whatever other workers of the same slot or generation report.
    pub(super) spawn: u64,
    pub(super) cause: Cause,
    pub(super) generation: u64,
    pub(super) role: Role,
    pub(super) state: WorkerState,
    pub(super) started: Instant,
    pub(super) ready_at: Option<Instant>,
    pub(super) models: Vec<ModelInfo>,
    /// What the worker said before failing, or why the supervisor killed it.
    pub(super) failure: Option<(FailureKind, String)>,
    /// The counters it shares with the supervisor.
    pub(super) stats: WorkerCounters,
    /// Where the answers to its questions go (written on its socketpair).
    pub(super) answers: tokio::sync::mpsc::UnboundedSender<inferd_ipc::triton::Answer>,
    /// Requests after which it is recycled (server.max_requests plus its own jitter).
    pub(super) recycle_after: Option<u64>,
    /// Why and when the supervisor sent SIGABRT to a stuck worker; SIGKILL follows a tick later.
    pub(super) stuck: Option<(String, Instant)>,
    /// Killed by the supervisor for passing the hard memory limit.
    pub(super) memory_killed: bool,
    /// What each model it loaded on demand holds, as it measured.
    pub(super) costs: std::collections::BTreeMap<String, inferd_ipc::spec::ModelCost>,
}

impl Worker {
    /// It said it is warming up.
    pub(super) fn warming(&mut self) {
        self.state = WorkerState::Warming;
    }

    /// It said it is ready, serving `models`.
    pub(super) fn ready(&mut self, models: Vec<ModelInfo>) {
        self.state = WorkerState::Ready;
        self.ready_at = Some(Instant::now());
        self.models = models;
    }

    /// It said it stopped accepting and drains.
    pub(super) fn draining(&mut self) {
        self.state = WorkerState::Draining;
    }

    /// It said why it fails, before exiting.
    pub(super) fn failed(&mut self, kind: FailureKind, error: String) {
        self.failure = Some((kind, error));
    }

    /// It loaded `model` on demand, holding `cost`.
    pub(super) fn loaded(&mut self, model: ModelInfo, cost: ModelCost) {
        self.costs.insert(model.name.clone(), cost);
        self.models.push(model);
    }

    /// It evicted `model`, loaded on demand.
    pub(super) fn evicted(&mut self, model: &str) {
        self.costs.remove(model);
        self.models.retain(|m| m.name != model);
    }

    /// Retires a worker whose siblings carry on: SIGUSR1 makes it drain and hand its idle
    /// keep-alive connections to them (SIGTERM, for a stopping pool, closes them).
    pub(super) fn retire(&mut self) {
        self.role = Role::Retiring;
        let _ = nix::sys::signal::kill(Pid::from_raw(self.pid as i32), Signal::SIGUSR1);
    }
}

pub(super) struct Slot {
    pub(super) placement: Placement,
    /// What this slot's workers run, and the pool generation that brought it.
    pub(super) models: Vec<ModelEntry>,
    pub(super) generation: u64,
    pub(super) workers: Vec<Worker>,
    pub(super) restarts: u32,
    /// Deaths since the slot last had a worker ready for [`STABLE_AFTER`](super::restart::STABLE_AFTER).
    pub(super) failures: u32,
    /// When it starts its next current worker (see [`Start`]), and why.
    pub(super) start: Start,
    pub(super) cause: Cause,
    pub(super) last_exit: Option<String>,
    /// A recycling replacement failed: no new attempt before this.
    pub(super) recycle_pause: Option<Instant>,
    /// Its place on the port, shared by its successive workers (spawn.rs).
    pub(super) sockets: SlotSockets,
    /// The trace of its worker's replacement in progress (respawn, recycle, memory, fault):
    /// open from the decision to the new worker's readiness or failure (mod.rs).
    pub(super) replacement: Option<opentelemetry::Context>,
}

/// When a slot starts its next current worker: the one place that says what may start one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// Nothing to start: its current worker serves or is on its way.
    No,
    /// Held at boot until the first worker's memory says whether this one fits.
    Held,
    /// At this instant: now, or once a crash's backoff has passed.
    At(Instant),
    /// Once its retiring workers have exited (memory is too tight for two), then at once.
    WhenEmpty,
    /// Being removed by `scale -1`: never again; the slot goes once its workers are gone.
    Removing,
}

impl Slot {
    /// Its worker exited: what status says of the slot's last exit.
    pub(super) fn exited(&mut self, note: String) {
        self.last_exit = Some(note);
    }

    /// A replacement of its worker failed: no recycling replacement again for a while.
    pub(super) fn replacement_failed(&mut self) {
        self.recycle_pause = Some(Instant::now() + RECYCLE_PAUSE);
    }

    /// Its current worker died, after serving long enough to count as `stable` or not:
    /// returns its deaths in a row.
    pub(super) fn died(&mut self, stable: bool) -> u32 {
        self.restarts += 1;
        if stable {
            self.failures = 0;
        }
        self.failures += 1;
        self.failures
    }

    /// Its next current worker starts, as a respawn, after `delay`.
    pub(super) fn respawn_in(&mut self, delay: Duration) {
        self.start = Start::At(Instant::now() + delay);
        self.cause = Cause::Respawn;
    }

    /// A slot whose first worker starts at once.
    pub(super) fn new(
        placement: Placement,
        models: Vec<ModelEntry>,
        generation: u64,
        cause: Cause,
        sockets: SlotSockets,
    ) -> Slot {
        Slot {
            placement,
            models,
            generation,
            workers: Vec::new(),
            restarts: 0,
            failures: 0,
            start: Start::At(Instant::now()),
            cause,
            last_exit: None,
            recycle_pause: None,
            sockets,
            replacement: None,
        }
    }

    /// Whether its next current worker should start now.
    pub(super) fn due(&self, now: Instant) -> bool {
        let serving_or_coming = self.workers.iter().any(|w| w.role != Role::Retiring);
        !serving_or_coming
            && match self.start {
                Start::At(t) => now >= t,
                Start::WhenEmpty => self.workers.is_empty(),
                Start::No | Start::Held | Start::Removing => false,
            }
    }

    pub(super) fn removing(&self) -> bool {
        self.start == Start::Removing
    }

    pub(super) fn with_role(&self, role: Role) -> Option<&Worker> {
        self.workers.iter().find(|w| w.role == role)
    }

    pub(super) fn ready(&self) -> bool {
        self.with_role(Role::Current).is_some_and(|w| w.state == WorkerState::Ready)
    }

    /// A worker of the slot, other than a retiring one, that has not reported ready yet.
    pub(super) fn booting(&self) -> Option<&Worker> {
        self.workers
            .iter()
            .find(|w| w.role != Role::Retiring && matches!(w.state, WorkerState::Starting | WorkerState::Warming))
    }
}

/// server.max_requests plus a per-worker draw from 0..=server.max_requests_jitter.
pub(super) fn recycle_threshold(server: &ServerConfig) -> Option<u64> {
    use std::hash::{BuildHasher, Hasher};
    if server.max_requests == 0 {
        return None;
    }
    // RandomState is seeded randomly per instance: enough randomness for spreading recycles.
    let draw = std::collections::hash_map::RandomState::new().build_hasher().finish();
    Some(server.max_requests + draw % (server.max_requests_jitter + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn worker(role: Role) -> Worker {
        Worker {
            pid: 1,
            spawn: 1,
            cause: Cause::Boot,
            generation: 1,
            role,
            state: WorkerState::Ready,
            started: Instant::now(),
            ready_at: None,
            models: Vec::new(),
            failure: None,
            stats: WorkerCounters::create("inferd-test").unwrap().0,
            answers: tokio::sync::mpsc::unbounded_channel().0,
            recycle_after: None,
            stuck: None,
            memory_killed: false,
            costs: Default::default(),
        }
    }

    #[test]
    fn only_a_slots_start_state_starts_its_worker() {
        let now = Instant::now();
        let sockets =
            SlotSockets::bind(&ServerConfig { listen: "127.0.0.1:0".into(), ..Default::default() }, false).unwrap();
        let mut slot = Slot::new(
            Placement { index: 0, cpus: vec![0], threads: 1, borrow: None },
            Vec::new(),
            1,
            Cause::Boot,
            sockets,
        );
        let later = now + Duration::from_secs(5);
        for (start, due) in [
            (Start::At(now), true),
            (Start::At(later), false),
            (Start::Held, false),
            (Start::No, false),
            (Start::Removing, false),
            (Start::WhenEmpty, true),
        ] {
            slot.start = start;
            assert_eq!(slot.due(now), due, "{start:?}, no workers");
        }
        // A retiring worker holds back WhenEmpty (memory for one only), not a timed start.
        slot.workers.push(worker(Role::Retiring));
        slot.start = Start::WhenEmpty;
        assert!(!slot.due(now));
        slot.start = Start::At(now);
        assert!(slot.due(now));
        // A current or incoming worker: nothing to start, whatever the state says.
        for role in [Role::Current, Role::Incoming] {
            slot.workers = vec![worker(role)];
            assert!(!slot.due(now), "{role:?}");
        }
        assert!(!slot.removing());
        slot.start = Start::Removing;
        assert!(slot.removing());
    }

    #[test]
    fn the_on_demand_catalog_is_every_other_model_folder_that_resolves() {
        let repository = std::env::temp_dir().join(format!("inferd-on-demand-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&repository);
        let model = |name: &str, toml: &str| {
            let dir = repository.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("model.onnx"), b"x").unwrap();
            if !toml.is_empty() {
                std::fs::write(dir.join("model.toml"), toml).unwrap();
            }
        };
        for name in ["a", "b", "c"] {
            model(name, &format!("name = \"{name}\"\nversion = \"1\"\nfile = \"model.onnx\"\n"));
        }
        model("published", ""); // an ONNX file and no model.toml: served as its files say
        model("broken", "name = \"other\"\nversion = \"1\"\nfile = \"model.onnx\"\n");
        std::fs::create_dir_all(repository.join("notes")).unwrap(); // no model: not a model folder
        let mut config = Config::default();
        config.models.repository = repository.clone();
        config.models.default = "a".into();
        let load = |name: &str| config.load_model(name).unwrap();
        let (pinned, c) = (vec![load("a"), load("b")], load("c"));
        let names = |models: &[ModelEntry]| models.iter().map(|m| m.name.clone()).collect::<Vec<_>>();

        assert!(read_on_demand(&config, &pinned).is_empty(), "on_demand is off by default");
        config.models.on_demand = true;
        let catalog = read_on_demand(&config, &pinned);
        // The default model never; a pinned one stays in the catalog (an unload may drop it).
        assert_eq!(names(&catalog), ["b", "c", "published"]);
        assert_eq!(catalog[1], c, "resolved as models.load resolves it");
        assert_eq!(names(&on_demand_besides(&catalog, &pinned)), ["c", "published"]);
        assert_eq!(names(&on_demand_besides(&catalog, &pinned[..1])), ["b", "c", "published"]);
        let _ = std::fs::remove_dir_all(&repository);
    }
}
