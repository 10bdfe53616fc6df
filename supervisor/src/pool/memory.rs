//! The memory guard: the memory plan once the first worker is warm (do the others fit?), the
//! per-worker limits it sets, and the watch that replaces or kills a worker over them.

use std::time::{Duration, Instant};

use inferd_config::file::ServerConfig;
use tracing::{error, info, warn};

use super::error::SupervisorError;
use super::slot::{Pool, Role};
use crate::plan::memory::{models_budget, proc_status, MemoryBudget, WorkerLimits, WorkerMemory};
use crate::status::WorkerState;

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
    /// Whether the first worker's memory has been measured (by [`MemoryWatch::plan`]).
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

    /// Called once, when the first worker (`pid`) of a pool of `slots` is ready: do the other
    /// K-1 fit ([`MemoryBudget::fit`], on its memory after warm-up)? If not: refuse with the
    /// numbers, or (fit_workers_to_memory) start as many as fit: returns how many slots the
    /// pool keeps. Also sets the per-worker soft and hard memory limits.
    pub(super) fn plan(&mut self, pid: u32, server: &ServerConfig, slots: usize) -> Result<usize, SupervisorError> {
        let one = WorkerMemory::of(pid);
        let (rss, shared) = (one.private, one.shared);
        self.worker_rss = Some(rss);
        let budget = MemoryBudget::detect();
        let mib = |b: u64| b / (1 << 20);
        let k = slots as u64;
        let (fit, plan) = budget.fit(k, one, "on worker 0 after warm-up");
        let keep = if fit < k {
            if !server.fit_workers_to_memory {
                return Err(SupervisorError::Memory(format!(
                    "{plan}; lower server.workers, or set server.fit_workers_to_memory = true to start fewer"
                )));
            }
            warn!("memory plan: {plan}; starting {fit} workers (server.fit_workers_to_memory)");
            fit as usize
        } else {
            info!("memory plan: {plan}");
            slots
        };
        let s = server;
        let limits = WorkerLimits::derive(
            &budget,
            keep as u64,
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
        self.limits = Some(limits);
        Ok(keep)
    }

    /// Per-worker private memory against the soft and hard limits, and the whole pool against
    /// its cgroup: the worker that grows is replaced before the kernel picks a victim. Every
    /// server.memory_check_interval_secs (`every`; called every tick): what to do with which
    /// slot's current worker, and the budget the decisions were made on.
    pub(super) fn check(&mut self, now: Instant, every: Duration, pool: &Pool) -> Option<(MemoryBudget, Vec<Verdict>)> {
        if self.checked.is_some_and(|t| now - t < every) {
            return None;
        }
        self.checked = Some(now);
        let WorkerLimits { soft, hard, .. } = self.limits.clone()?;
        let budget = MemoryBudget::detect();
        // The pool itself close to its cgroup's limit: the biggest worker goes first.
        let pool_tight = budget.cgroup.as_ref().is_some_and(|c| c.usage > c.limit / 100 * 92);
        let mut verdicts = Vec::new();
        let mut biggest: Option<(u64, usize)> = None;
        for (index, slot) in pool.slots.iter().enumerate() {
            if slot.removing() || slot.with_role(Role::Incoming).is_some() {
                continue;
            }
            let Some(w) = slot.workers.iter().find(|w| w.role == Role::Current && w.state == WorkerState::Ready) else {
                continue;
            };
            let Some(rss) = proc_status(w.pid).private else { continue };
            let mib = rss >> 20;
            if hard.is_some_and(|h| rss > h) && !w.memory_killed {
                error!("worker {index} (pid {}) private memory {mib} MiB is over the hard limit; killing it", w.pid);
                verdicts.push(Verdict::Kill(index));
                continue;
            }
            if soft.is_some_and(|s| rss > s) {
                let why = format!("private memory {mib} MiB is over the soft limit");
                warn!("worker {index} (pid {}) {why}; replacing it", w.pid);
                verdicts.push(Verdict::Replace(index, why));
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
            verdicts.push(Verdict::Replace(index, why));
        }
        Some((budget, verdicts))
    }

    /// Whether `budget` has room for one more worker beside the one it replaces.
    pub(super) fn room_for_one(&self, budget: &MemoryBudget) -> bool {
        self.worker_rss.is_some_and(|rss| budget.room() > rss + rss / 5)
    }
}

/// What the memory watch decided for a slot's current worker.
pub(super) enum Verdict {
    /// Over the hard limit: SIGKILL, and a respawn.
    Kill(usize),
    /// Over the soft limit, or the biggest of a pool close to its cgroup's limit: replaced
    /// gracefully, for this reason.
    Replace(usize, String),
}
