//! What the pool has counted since it started, beyond its live workers' own counters
//! ([`Totals`]): the final counts of the workers gone, restarts and recycles by reason, models
//! loaded and evicted, and the samples of the last minute's request latency.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use inferd_config::model::ModelEntry;
use inferd_ipc::spec::ModelInfo;
use inferd_ipc::stats::{Snapshot, LATENCY_BUCKETS};

use super::slot::{Pool, Worker};
use crate::metrics::{LoadSeconds, ModelEvents, RecycleReason, RestartReason};

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
    load_seconds: LoadSeconds,
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
    /// A worker has exited: its final counts join the totals, each model in its pool row.
    pub(super) fn keep(&mut self, worker: &Worker, pool_models: &[ModelEntry]) {
        let rows = rows_of(pool_models, &worker.models);
        self.retired.add(&worker.stats.snapshot().without_gauges().remapped(&rows));
    }

    /// Every [`LATENCY_SAMPLE_EVERY`] (called every tick): the pool's request-latency
    /// buckets now, kept for [`LATENCY_WINDOW`].
    pub(super) fn sample_latency(&mut self, now: Instant, pool: &Pool) {
        if self.latency_samples.back().is_none_or(|(t, _)| now - *t >= LATENCY_SAMPLE_EVERY) {
            let buckets = self.snapshot(pool).request_latency_buckets();
            self.latency_samples.push_back((now, buckets));
            while self.latency_samples.front().is_some_and(|(t, _)| now - *t > LATENCY_WINDOW + LATENCY_SAMPLE_EVERY) {
                self.latency_samples.pop_front();
            }
        }
    }

    /// The pool's counts: every exited worker's final counts plus the live workers' now, each
    /// model in its row of the pool's model list (`pool.models`).
    pub(super) fn snapshot(&self, pool: &Pool) -> Snapshot {
        let mut totals = self.retired.clone();
        for w in pool.workers() {
            totals.add(&w.stats.snapshot().remapped(&rows_of(&pool.models, &w.models)));
        }
        totals
    }

    /// p50 and p99 of request latency over about the last minute, as the upper bound of the
    /// histogram bucket each falls in (milliseconds; None: no requests, or beyond the last
    /// bucket).
    pub(super) fn latency_last_minute(&self, totals: &Snapshot) -> Option<(f64, Option<f64>, Option<f64>)> {
        let now = totals.request_latency_buckets();
        let (start, old) =
            self.latency_samples.iter().find(|(t, _)| t.elapsed() <= LATENCY_WINDOW + LATENCY_SAMPLE_EVERY)?;
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

    /// Workers replaced after dying, by reason.
    pub(super) fn restarts(&self) -> &BTreeMap<RestartReason, u64> {
        &self.restarts
    }

    /// Workers replaced gap-free on purpose, by reason.
    pub(super) fn recycles(&self) -> &BTreeMap<RecycleReason, u64> {
        &self.recycles
    }

    /// A model was loaded on demand, in `seconds`.
    pub(super) fn loaded(&mut self, model: &str, seconds: f64) {
        self.model_event(model).on_demand += 1;
        self.load_seconds.observe(seconds);
    }

    /// How long loads on demand took.
    pub(super) fn load_seconds(&self) -> &LoadSeconds {
        &self.load_seconds
    }

    /// Models loaded and evicted, by model.
    pub(super) fn model_events(&self) -> &BTreeMap<String, ModelEvents> {
        &self.model_events
    }
}

/// Where the counter rows of a worker serving `served` (in its order) go in the pool's, which
/// serves `pool`: a model the pool no longer serves is dropped.
fn rows_of(pool: &[ModelEntry], served: &[ModelInfo]) -> Vec<Option<usize>> {
    served.iter().map(|m| pool.iter().position(|n| n.name == m.name)).collect()
}
