//! What the supervisor tells: `inferd status`, the pool's counters and their last-minute
//! latency percentiles, and the Prometheus metrics.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use inferd_config::model::ModelEntry;
use inferd_ipc::spec::{ModelCost, ModelInfo};
use inferd_ipc::stats::{Snapshot, BATCH_BUCKETS, LATENCY_BUCKETS, MAX_MODELS};

use super::slot::{Role, Worker};
use super::Supervisor;
use crate::metrics::{LoadSeconds, ModelEvents, PoolMetrics, RecycleReason, RestartReason};
use crate::plan::memory::{proc_status, MemoryBudget};
use crate::status::{BatchSizes, PoolStatus, WorkerState, WorkerStatus};

/// Status shows request-latency percentiles over this window, from samples this far apart.
const LATENCY_WINDOW: Duration = Duration::from_secs(60);
const LATENCY_SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// What the pool has counted since it started, beyond its live workers' own counters.
pub(super) struct Totals {
    /// Final counts of every worker that has exited.
    retired: Snapshot,
    /// Workers replaced after dying, by reason (every reason from the start, so that the
    /// first scrape has each series at 0: one that appears only with its first restart leaves
    /// rate() and the dashboard without data until then).
    restarts: BTreeMap<RestartReason, u64>,
    /// Workers replaced gap-free on purpose, by reason (the same).
    recycles: BTreeMap<RecycleReason, u64>,
    /// Request-latency buckets of the whole pool, sampled every few seconds, for the
    /// last-minute percentiles in status.
    latency_samples: VecDeque<(Instant, Vec<u64>)>,
    /// Models loaded and evicted, by model.
    model_events: BTreeMap<String, ModelEvents>,
    /// How long loads on demand took.
    pub(super) load_seconds: LoadSeconds,
}

impl Totals {
    pub(super) fn new() -> Totals {
        Totals {
            retired: Snapshot::default(),
            restarts: RestartReason::ALL.iter().map(|&r| (r, 0)).collect(),
            recycles: RecycleReason::ALL.iter().map(|&r| (r, 0)).collect(),
            latency_samples: VecDeque::new(),
            model_events: BTreeMap::new(),
            load_seconds: LoadSeconds::default(),
        }
    }

    /// A reload: the loads and evictions of the models the pool no longer serves (nor may load)
    /// leave the metrics, as their other series do.
    pub(super) fn keep_model_events(&mut self, served: &[&str]) {
        self.model_events.retain(|model, _| served.contains(&model.as_str()));
    }

    /// `model`'s loads and evictions, to count one more.
    pub(super) fn model_event(&mut self, model: &str) -> &mut ModelEvents {
        self.model_events.entry(model.to_string()).or_default()
    }

    /// A worker that died was replaced.
    pub(super) fn restarted(&mut self, reason: RestartReason) {
        *self.restarts.entry(reason).or_default() += 1;
    }

    /// A live worker is being replaced gap-free.
    pub(super) fn recycled(&mut self, reason: RecycleReason) {
        *self.recycles.entry(reason).or_default() += 1;
    }

    /// The pool's model list changed: the counts of exited workers follow their models to
    /// their new rows (`rows[i]`: the new row of row `i`; None: dropped).
    pub(super) fn remap(&mut self, rows: &[Option<usize>]) {
        self.retired = self.retired.remapped(rows);
    }
}

impl Supervisor {
    /// A worker has exited: its final counts join the totals, each model in its pool row.
    pub(super) fn keep_counts(&mut self, worker: &Worker) {
        let rows = rows_of(&self.pool.models, &worker.models);
        self.totals.retired.add(&worker.stats.snapshot().without_gauges().remapped(&rows));
    }

    /// Every [`LATENCY_SAMPLE_EVERY`] (called every tick): the pool's request-latency
    /// buckets now, kept for [`LATENCY_WINDOW`].
    pub(super) fn sample_latency(&mut self, now: Instant) {
        if self.totals.latency_samples.back().is_none_or(|(t, _)| now - *t >= LATENCY_SAMPLE_EVERY) {
            self.totals.latency_samples.push_back((now, self.totals().request_latency_buckets()));
            while self
                .totals
                .latency_samples
                .front()
                .is_some_and(|(t, _)| now - *t > LATENCY_WINDOW + LATENCY_SAMPLE_EVERY)
            {
                self.totals.latency_samples.pop_front();
            }
        }
    }

    pub(super) fn status(&self) -> PoolStatus {
        let plan = &self.resolved.plan;
        let totals = self.totals();
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
            phase: self.phase(),
            generation: self.pool.generation,
            reload: self.reload.progress(self.pool.slots.len()),
            upgrade: self.upgrade.describe(),
            listen: self.resolved.config.server.listen.clone(),
            grpc_listen: Some(self.resolved.config.server.grpc_listen.clone()).filter(|g| !g.is_empty()),
            uptime_secs: self.life.started.elapsed().as_secs_f64(),
            usable_cores: plan.budget.usable,
            cpu_budget: plan.budget.describe(),
            threads_per_worker: plan.threads_per_worker,
            requests_total: totals.requests_total(),
            latency_last_minute: self.latency_last_minute(&totals),
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
            format!("{:?}", self.phase()).to_lowercase(),
            self.pool.slots.len(),
            self.resolved.config.server.listen,
            self.pool.generation,
            self.totals().requests_total(),
        );
        if let Some(progress) = self.reload.progress(self.pool.slots.len()) {
            line += &format!("; reload: {progress}");
        }
        line
    }

    /// The pool's counts: every exited worker's final counts plus the live workers' now, each
    /// model in its row of the pool's model list (`self.pool.models`).
    pub(super) fn totals(&self) -> Snapshot {
        let mut totals = self.totals.retired.clone();
        for w in self.pool.workers() {
            totals.add(&w.stats.snapshot().remapped(&rows_of(&self.pool.models, &w.models)));
        }
        totals
    }

    /// p50 and p99 of request latency over about the last minute, as the upper bound of the
    /// histogram bucket each falls in (milliseconds; None: no requests, or beyond the last
    /// bucket).
    fn latency_last_minute(&self, totals: &Snapshot) -> Option<(f64, Option<f64>, Option<f64>)> {
        let now = totals.request_latency_buckets();
        let (start, old) =
            self.totals.latency_samples.iter().find(|(t, _)| t.elapsed() <= LATENCY_WINDOW + LATENCY_SAMPLE_EVERY)?;
        // Saturating: the counts of a model that was unloaded leave the totals.
        let delta: Vec<u64> = now.iter().zip(old).map(|(a, b)| a.saturating_sub(*b)).collect();
        let total: u64 = delta.iter().sum();
        if total == 0 {
            return None;
        }
        let quantile = |q: f64| {
            let target = (q * total as f64).ceil() as u64;
            let mut seen = 0;
            delta
                .iter()
                .position(|n| {
                    seen += n;
                    seen >= target
                })
                .and_then(|i| LATENCY_BUCKETS.get(i).map(|b| b * 1e3))
        };
        Some((start.elapsed().as_secs_f64(), quantile(0.5), quantile(0.99)))
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
            totals: self.totals(),
            workers: self
                .pool
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.workers.iter().map(move |w| (i, w.pid, proc_status(w.pid).rss)))
                .collect(),
            ready: self.pool.ready_count(),
            desired: self.pool.slots.iter().filter(|s| !s.removing()).count(),
            restarts: self.totals.restarts.clone(),
            recycles: self.totals.recycles.clone(),
            reloads: self.reload.outcomes(),
            generation: self.pool.generation,
            model_info,
            model_events: self.totals.model_events.clone(),
            load_seconds: self.totals.load_seconds.clone(),
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
            start_time: self.life.started_unix,
        }
    }
}

/// Where the counter rows of a worker serving `served` (in its order) go in the pool's, which
/// serves `pool`: a model the pool no longer serves is dropped.
fn rows_of(pool: &[ModelEntry], served: &[ModelInfo]) -> Vec<Option<usize>> {
    served.iter().map(|m| pool.iter().position(|n| n.name == m.name)).collect()
}
