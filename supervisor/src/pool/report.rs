//! What the supervisor tells: `inferd status`, the pool's counters and their last-minute
//! latency percentiles, and the Prometheus metrics.

use super::*;

impl Supervisor {
    pub(super) fn status(&self) -> PoolStatus {
        let plan = &self.resolved.plan;
        let totals = self.totals();
        let mut workers = Vec::new();
        for (index, slot) in self.slots.iter().enumerate() {
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
                    last_exit: slot.last_exit.clone(),
                }
            };
            if slot.workers.is_empty() {
                workers.push(row(None));
            }
            workers.extend(slot.workers.iter().map(|w| row(Some(w))));
        }
        PoolStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            phase: self.phase(),
            generation: self.generation,
            reload: self.reload.as_ref().map(|r| format!("replacing worker {} of {}", r.slot + 1, self.slots.len())),
            listen: self.resolved.config.server.listen.clone(),
            grpc_listen: Some(self.resolved.config.server.grpc_listen.clone()).filter(|g| !g.is_empty()),
            uptime_secs: self.started.elapsed().as_secs_f64(),
            usable_cores: plan.budget.usable,
            cpu_budget: plan.budget.describe(),
            threads_per_worker: plan.threads_per_worker,
            requests_total: totals.requests_total(),
            latency_last_minute: self.latency_last_minute(&totals),
            memory: format!(
                "{}; worker memory limits (private): {}",
                MemoryBudget::detect().describe(),
                self.memory.limits.as_ref().map_or("not set yet (worker 0 is warming up)".into(), |l| l.describe())
            ),
            reloads_succeeded: self.totals.reloads.succeeded,
            reloads_failed: self.totals.reloads.failed,
            batches: self
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
        let ready = self.slots.iter().filter(|s| s.ready()).count();
        let restarts: u32 = self.slots.iter().map(|s| s.restarts).sum();
        let mut line = format!(
            "{}: {ready}/{} workers ready on {}, generation {}, {} requests, {restarts} restarts",
            format!("{:?}", self.phase()).to_lowercase(),
            self.slots.len(),
            self.resolved.config.server.listen,
            self.generation,
            self.totals().requests_total(),
        );
        if let Some(r) = &self.reload {
            line += &format!("; reload: replacing worker {} of {}", r.slot + 1, self.slots.len());
        }
        line
    }

    /// The pool's counts: every exited worker's final counts plus the live workers' now, each
    /// model in its row of the pool's model list (`self.models`).
    pub(super) fn totals(&self) -> Snapshot {
        let mut totals = self.totals.retired.clone();
        for w in self.slots.iter().flat_map(|s| &s.workers) {
            totals.add(&w.stats.snapshot().remapped(&rows_of(&self.models, &w.models)));
        }
        totals
    }

    /// p50 and p99 of request latency over about the last minute, as the upper bound of the
    /// histogram bucket each falls in (milliseconds; None: no requests, or beyond the last
    /// bucket).
    pub(super) fn latency_last_minute(&self, totals: &Snapshot) -> Option<(f64, Option<f64>, Option<f64>)> {
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
        for w in self.slots.iter().flat_map(|s| &s.workers) {
            for info in &w.models {
                // One series per version served (how each worker holds its weights aside).
                if !model_info.iter().any(|m| m.name == info.name && m.full_version() == info.full_version()) {
                    model_info.push(info.clone());
                }
            }
        }
        PoolMetrics {
            models: self.models.iter().map(|m| m.name.clone()).collect(),
            versions: self.models.iter().map(|m| m.version.clone()).collect(),
            totals: self.totals(),
            workers: self
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.workers.iter().map(move |w| (i, w.pid, proc_status(w.pid).rss)))
                .collect(),
            ready: self.slots.iter().filter(|s| s.ready()).count(),
            desired: self.slots.iter().filter(|s| !s.removing()).count(),
            restarts: self.totals.restarts.clone(),
            recycles: self.totals.recycles.clone(),
            reloads: self.totals.reloads,
            generation: self.generation,
            model_info,
        }
    }
}

/// Where the counter rows of a worker serving `served` (in its order) go in the pool's, which
/// serves `pool`: a model the pool no longer serves is dropped.
pub(super) fn rows_of(pool: &[ModelEntry], served: &[ModelInfo]) -> Vec<Option<usize>> {
    served.iter().map(|m| pool.iter().position(|n| n.name == m.name)).collect()
}
