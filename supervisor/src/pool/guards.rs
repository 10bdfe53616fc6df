//! The supervisor's guards: the memory plan at start, the memory watch, stuck-worker
//! escalation (SIGABRT, then SIGKILL) and recycling after server.max_requests or an age.

use std::time::{Duration, Instant};

use inferd_ipc::spec::Cause;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tracing::{error, info, warn};

use super::slot::{Role, Start};
use super::{Supervisor, SupervisorError, TICK};
use crate::metrics::RecycleReason;
use crate::plan::memory::{models_budget, proc_status, MemoryBudget, WorkerLimits, WorkerMemory};
use crate::status::WorkerState;

/// A worker stops a run past server.request_timeout_secs itself (ORT run termination); the
/// supervisor aborts the worker only if the run is still going this long after.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// The memory guard's state.
#[derive(Default)]
pub(super) struct MemoryWatch {
    /// Private memory of the first worker after its warm-up: what one more worker costs.
    worker_rss: Option<u64>,
    /// Per-worker limits of private memory, set once worker 0 is warm.
    limits: Option<WorkerLimits>,
    /// When the watch last ran.
    checked: Option<Instant>,
    /// models.memory_budget's default, from the memory there was when the first worker
    /// started.
    default_models_budget: Option<u64>,
}

impl MemoryWatch {
    /// Whether the first worker's memory has been measured (by [`Supervisor::memory_plan`]).
    pub(super) fn measured(&self) -> bool {
        self.worker_rss.is_some()
    }

    /// The per-worker limits, once the memory plan has set them.
    pub(super) fn limits(&self) -> Option<&WorkerLimits> {
        self.limits.as_ref()
    }

    /// The memory the pool's models may hold ([models] on_demand): models.memory_budget as
    /// the configuration says now (a reload may change it), or [`models_budget`]'s default of
    /// the memory there was when the first worker started.
    pub(super) fn models_budget(&mut self, config: &inferd_config::file::Config) -> u64 {
        if let Some(budget) = config.models.memory_budget {
            return budget.0;
        }
        *self.default_models_budget.get_or_insert_with(|| {
            let (bytes, source) = models_budget(None, &MemoryBudget::detect());
            info!("models loaded on demand: a budget of {} MiB ({source})", bytes >> 20);
            bytes
        })
    }

    /// [`MemoryWatch::models_budget`] without working it out: None before the first worker
    /// started, or without on_demand.
    pub(super) fn models_budget_now(&self, config: &inferd_config::file::Config) -> Option<u64> {
        match config.models.memory_budget {
            _ if !config.models.on_demand => None,
            Some(budget) => Some(budget.0),
            None => self.default_models_budget,
        }
    }
}

impl Supervisor {
    /// Called once, when the first worker is ready: do the other K-1 fit ([`MemoryBudget::fit`],
    /// on its memory after warm-up)? If not: refuse with the numbers, or
    /// (fit_workers_to_memory) start as many as fit. Also sets the per-worker soft and hard
    /// memory limits.
    pub(super) fn memory_plan(&mut self, pid: u32) -> Result<(), SupervisorError> {
        let one = WorkerMemory::of(pid);
        let (rss, shared) = (one.private, one.shared);
        self.memory.worker_rss = Some(rss);
        let budget = MemoryBudget::detect();
        let mib = |b: u64| b / (1 << 20);
        let k = self.pool.slots.len() as u64;
        let (fit, plan) = budget.fit(k, one, "on worker 0 after warm-up");
        if fit < k {
            if !self.resolved.config.server.fit_workers_to_memory {
                return Err(SupervisorError::Memory(format!(
                    "{plan}; lower server.workers, or set server.fit_workers_to_memory = true to start fewer"
                )));
            }
            warn!("memory plan: {plan}; starting {fit} workers (server.fit_workers_to_memory)");
            self.pool.slots.truncate(fit as usize);
        } else {
            info!("memory plan: {plan}");
        }
        let s = &self.resolved.config.server;
        let limits = WorkerLimits::derive(
            &budget,
            self.pool.slots.len() as u64,
            rss,
            shared,
            s.worker_memory_soft_limit_mb,
            s.worker_memory_hard_limit_mb,
        );
        // A limit a fresh worker already passes would replace (or kill) workers forever.
        for (key, value) in [("soft", limits.soft), ("hard", limits.hard)] {
            if value.is_some_and(|v| v <= rss + rss / 20) {
                return Err(SupervisorError::Memory(format!(
                    "the {key} worker memory limit ({} MiB) is not above a fresh worker's private memory ({} MiB); raise \
                     server.worker_memory_{key}_limit_mb or the memory limit, or lower server.workers",
                    mib(value.unwrap_or(0)),
                    mib(rss)
                )));
            }
        }
        info!("worker memory limits (private memory): {}", limits.describe());
        self.memory.limits = Some(limits);
        for slot in self.pool.slots.iter_mut().skip(1).filter(|s| s.start == Start::Held) {
            slot.start = Start::At(Instant::now());
        }
        Ok(())
    }

    /// Per-worker private memory against the soft and hard limits, and the whole pool against its cgroup:
    /// the worker that grows is replaced before the kernel picks a victim. Every
    /// server.memory_check_interval_secs (called every tick).
    pub(super) fn watch_memory(&mut self, now: Instant) {
        let every = Duration::from_secs_f64(self.resolved.config.server.memory_check_interval_secs);
        if self.memory.checked.is_some_and(|t| now - t < every) {
            return;
        }
        self.memory.checked = Some(now);
        let Some(WorkerLimits { soft, hard, .. }) = self.memory.limits.clone() else { return };
        let budget = MemoryBudget::detect();
        // The pool itself close to its cgroup's limit: the biggest worker goes first.
        let pool_tight = budget.cgroup.as_ref().is_some_and(|c| c.usage > c.limit / 100 * 92);
        let mut biggest: Option<(u64, usize)> = None;
        for index in 0..self.pool.slots.len() {
            let slot = &mut self.pool.slots[index];
            if slot.removing() || slot.with_role(Role::Incoming).is_some() {
                continue;
            }
            let Some(w) = slot.workers.iter_mut().find(|w| w.role == Role::Current && w.state == WorkerState::Ready)
            else {
                continue;
            };
            let Some(rss) = proc_status(w.pid).private else { continue };
            let mib = rss >> 20;
            if hard.is_some_and(|h| rss > h) && !w.memory_killed {
                error!("worker {index} (pid {}) private memory {mib} MiB is over the hard limit; killing it", w.pid);
                w.memory_killed = true;
                let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
                continue;
            }
            if soft.is_some_and(|s| rss > s) {
                let why = format!("private memory {mib} MiB is over the soft limit");
                warn!("worker {index} (pid {}) {why}; replacing it", w.pid);
                self.replace_for_memory(index, &budget, &why);
                continue;
            }
            if biggest.is_none_or(|(b, _)| rss > b) {
                biggest = Some((rss, index));
            }
        }
        if let (true, Some((rss, index))) = (pool_tight, biggest) {
            let why = format!(
                "the pool is above 92% of its cgroup memory limit; this worker is the biggest ({} MiB)",
                rss >> 20
            );
            warn!("worker {index}: {why}; replacing it");
            self.replace_for_memory(index, &budget, &why);
        }
    }

    /// Gracefully replaces a slot's worker for memory: the new one first when there is room for
    /// it, else the old one drains and exits before the new one starts. During a reload too:
    /// the reload tells its own workers by their spawn ids, and waits for this one to finish
    /// before it replaces the slot (retiring first would leave a 1-worker pool without a
    /// listener for a boot's length).
    pub(super) fn replace_for_memory(&mut self, index: usize, budget: &MemoryBudget, why: &str) {
        self.totals.recycled(RecycleReason::Memory);
        let pid = self.pool.slots[index].with_role(Role::Current).map_or(0, |w| w.pid);
        self.begin_replacement(index, Cause::Memory, "memory", pid, why);
        let room_for_one = self.memory.worker_rss.is_some_and(|rss| budget.room() > rss + rss / 5);
        let slot = &mut self.pool.slots[index];
        if room_for_one {
            let (models, generation) = (slot.models.clone(), slot.generation);
            self.spawn(index, Role::Incoming, Cause::Memory, models, generation);
            return;
        }
        for w in slot.workers.iter_mut().filter(|w| w.role == Role::Current) {
            w.retire();
        }
        slot.start = Start::WhenEmpty;
        slot.cause = Cause::Memory;
    }

    /// A worker whose model run has lasted longer than server.request_timeout_secs (plus
    /// [`STOP_GRACE`] for the worker to stop it itself), or whose
    /// model thread stopped beating, gets SIGABRT, and SIGKILL on the next tick if it is still
    /// there (gunicorn's escalation); it is then replaced like any dead worker.
    pub(super) fn kill_stuck_workers(&mut self) {
        let timeout = self.resolved.config.server.request_timeout_secs;
        for (index, slot) in self.pool.slots.iter_mut().enumerate() {
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
                    (None, Some(b)) if b > timeout.max(5.0) => format!("the model thread has not beaten for {b:.1} s"),
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

    /// Recycling (server.max_requests, server.max_worker_age_secs) and faults (a panic caught
    /// serving a request, which comes first): such a worker is replaced like in a reload,
    /// incoming first. One replacement at a time across the pool,
    /// the worker furthest past its limit first, and none during a reload (which replaces
    /// everyone anyway).
    pub(super) fn maybe_recycle(&mut self, now: Instant) {
        let max_age = self.resolved.config.server.max_worker_age_secs;
        if self.reload.in_progress() || self.pool.slots.iter().any(|s| s.with_role(Role::Incoming).is_some()) {
            return;
        }
        // (how far past the limit, as a share of it; slot; reason)
        let mut due: Option<(f64, usize, RecycleReason)> = None;
        for (index, slot) in self.pool.slots.iter().enumerate() {
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
        let Some((_, index, reason)) = due else { return };
        let slot = &self.pool.slots[index];
        let pid = slot.with_role(Role::Current).map_or(0, |w| w.pid);
        let (cause, detail) = match reason {
            RecycleReason::Fault => (Cause::Fault, "caught a panic serving a request (a bug, in its log)".to_string()),
            _ => (Cause::Recycle, format!("reached server.{reason}")),
        };
        let (models, generation) = (slot.models.clone(), slot.generation);
        self.totals.recycled(reason);
        let trace_id = self.begin_replacement(index, cause, reason.as_str(), pid, &detail);
        let trace_id = trace_id.as_deref();
        match cause {
            Cause::Fault => warn!(trace_id, "worker {index} (pid {pid}) {detail}; replacing it"),
            _ => info!(trace_id, "worker {index} (pid {pid}) {detail}; replacing it"),
        }
        self.spawn(index, Role::Incoming, cause, models, generation);
    }
}
