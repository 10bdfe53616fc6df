//! What the supervisor tells: `inferd status`, systemd's status line and the Prometheus
//! metrics, made from a read-only view of the pool's parts ([`Report`]).

use std::collections::BTreeMap;

use inferd_ipc::spec::{ModelCost, ModelInfo};
use inferd_ipc::stats::{Snapshot, BATCH_BUCKETS, MAX_MODELS};

use super::life::Life;
use super::memory::MemoryWatch;
use super::reload::ReloadState;
use super::saturation::Saturation;
use super::slot::{Pool, Role, Worker};
use super::spawn::Launcher;
use super::totals::Totals;
use super::upgrade::Upgrade;
use crate::metrics::PoolMetrics;
use crate::plan::memory::{proc_status, MemoryBudget};
use crate::plan::Resolved;
use crate::status::{BatchSizes, Phase, PoolStatus, WorkerState, WorkerStatus};

/// The pool's parts, read: what every report is made from.
pub(super) struct Report<'a> {
    pub(super) resolved: &'a Resolved,
    pub(super) pool: &'a Pool,
    pub(super) life: &'a Life,
    pub(super) phase: Phase,
    pub(super) reload: &'a ReloadState,
    pub(super) upgrade: &'a Upgrade,
    pub(super) memory: &'a MemoryWatch,
    pub(super) totals: &'a Totals,
    pub(super) saturation: &'a Saturation,
    pub(super) launcher: &'a Launcher,
}

impl Report<'_> {
    pub(super) fn status(&self) -> PoolStatus {
        let plan = &self.resolved.plan;
        let totals = self.totals.snapshot(self.pool);
        let mut workers = Vec::new();
        for (index, slot) in self.pool.slots.iter().enumerate() {
            let row = |w: Option<&Worker>| {
                let proc = w.map(|w| proc_status(w.pid)).unwrap_or_default();
                let counts = w.map(|w| w.stats.snapshot());
                WorkerStatus {
                    index,
                    pid: w.map(|w| w.pid),
                    generation: w.map_or(slot.generation, |w| w.generation),
                    state: match w {
                        None => WorkerState::Down,
                        Some(w) if w.role == Role::Retiring => WorkerState::Draining,
                        Some(w) => w.state,
                    },
                    started_for: w.map(|w| w.cause),
                    cpus: slot.placement.cpus.clone(),
                    borrows: slot.placement.borrow,
                    threads: slot.placement.threads,
                    os_threads: proc.threads,
                    rss_bytes: proc.rss,
                    private_bytes: proc.private,
                    requests: counts.as_ref().map_or(0, Snapshot::requests_total),
                    in_flight: counts.as_ref().map_or(0, Snapshot::in_flight),
                    queued: counts.as_ref().map_or(0, Snapshot::queued),
                    restarts: slot.restarts,
                    uptime_secs: w.map(|w| w.started.elapsed().as_secs_f64()),
                    models: w.map(|w| w.models.clone()).unwrap_or_default(),
                    model_bytes: w.map(|w| w.costs.clone()).unwrap_or_default(),
                    last_exit: slot.last_exit.clone(),
                }
            };
            if slot.workers.is_empty() {
                workers.push(row(None));
            }
            workers.extend(slot.workers.iter().map(|w| row(Some(w))));
        }
        PoolStatus {
            version: inferd_ipc::version().into(),
            pid: std::process::id(),
            phase: self.phase,
            generation: self.pool.generation,
            reload: self.reload.progress(self.pool.slots.len()),
            upgrade: self.upgrade.describe(),
            listen: self.resolved.config.server.listen.clone(),
            grpc_listen: Some(self.resolved.config.server.grpc_listen.clone()).filter(|g| !g.is_empty()),
            uptime_secs: self.life.started().elapsed().as_secs_f64(),
            usable_cores: plan.budget.usable,
            cpu_budget: plan.budget.describe(),
            threads_per_worker: plan.threads_per_worker,
            requests_total: totals.requests_total(),
            latency_last_minute: self.totals.latency_last_minute(&totals),
            memory: format!(
                "{}; worker memory limits (private): {}{}",
                MemoryBudget::detect().describe(),
                self.memory.limits().map_or("not set yet (worker 0 is warming up)".into(), |l| l.describe()),
                match self.memory.models_budget_now(&self.resolved.config) {
                    Some(budget) => format!(
                        "; models on demand within {} MiB ({} MiB per worker)",
                        budget >> 20,
                        (budget / self.pool.slots.len().max(1) as u64) >> 20
                    ),
                    None => String::new(),
                }
            ),
            reloads_succeeded: self.reload.outcomes().succeeded,
            reloads_failed: self.reload.outcomes().failed,
            batches: self
                .pool
                .models
                .iter()
                .enumerate()
                .filter(|(row, _)| *row < MAX_MODELS)
                .map(|(row, m)| {
                    let h = totals.batch(row);
                    let bounds = BATCH_BUCKETS.iter().map(|&b| Some(b)).chain([None]);
                    BatchSizes {
                        model: m.name.clone(),
                        runs: h.count,
                        rows: h.sum as u64,
                        histogram: bounds.zip(h.buckets.iter().copied()).collect(),
                    }
                })
                .collect(),
            workers,
        }
    }

    /// The pool in one line, for systemd's STATUS= (`systemctl status inferd`).
    pub(super) fn summary(&self) -> String {
        let ready = self.pool.ready_count();
        let restarts: u32 = self.pool.slots.iter().map(|s| s.restarts).sum();
        let mut line = format!(
            "{}: {ready}/{} workers ready on {}, generation {}, {} requests, {restarts} restarts",
            format!("{:?}", self.phase).to_lowercase(),
            self.pool.slots.len(),
            self.resolved.config.server.listen,
            self.pool.generation,
            self.totals.snapshot(self.pool).requests_total(),
        );
        if let Some(progress) = self.reload.progress(self.pool.slots.len()) {
            line += &format!("; reload: {progress}");
        }
        line
    }

    pub(super) fn metrics(&self) -> PoolMetrics {
        let mut model_info: Vec<ModelInfo> = Vec::new();
        for w in self.pool.workers() {
            for info in &w.models {
                // One series per version served (how each worker holds its weights aside).
                if !model_info.iter().any(|m| m.name == info.name && m.full_version() == info.full_version()) {
                    model_info.push(info.clone());
                }
            }
        }
        PoolMetrics {
            models: self.pool.models.iter().map(|m| m.name.clone()).collect(),
            versions: self.pool.models.iter().map(|m| m.version.clone()).collect(),
            totals: self.totals.snapshot(self.pool),
            workers: self
                .pool
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.workers.iter().map(move |w| (i, w.pid, proc_status(w.pid).rss)))
                .collect(),
            ready: self.pool.ready_count(),
            desired: self.pool.slots.iter().filter(|s| !s.removing()).count(),
            restarts: self.totals.restarts().clone(),
            recycles: self.totals.recycles().clone(),
            reloads: self.reload.outcomes(),
            generation: self.pool.generation,
            model_info,
            model_events: self.totals.model_events().clone(),
            load_seconds: self.totals.load_seconds().clone(),
            model_bytes: self.pool.workers().flat_map(|w| &w.costs).fold(BTreeMap::new(), |mut sum, (model, cost)| {
                let total: &mut ModelCost = sum.entry(model.clone()).or_default();
                total.private += cost.private;
                total.mapped += cost.mapped;
                sum
            }),
            models_budget: self.memory.models_budget_now(&self.resolved.config),
            saturation: self.saturation.pool(),
            lanes: self
                .pool
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| {
                    let threads = s.placement.threads;
                    s.workers.iter().map(move |w| (i, w.pid, threads, self.saturation.busy_lanes(w.pid)))
                })
                .collect(),
            accept_queued: self.pool.slots.iter().map(|s| s.sockets.waiting()).sum(),
            supervisor_spans: crate::trace::spans(),
            keys: self.launcher.keys(),
            start_time: self.life.started_unix(),
        }
    }
}
