//! Triton's statistics and repository index, from the pool's counters and the repository:
//! what the admin listener serves, and what the supervisor answers a worker that serves them
//! on the main port (HTTP and gRPC).

use std::path::Path;

use inferd_config::model::ModelEntry;
use inferd_ipc::triton::{Duration, IndexEntry, InferStats, ModelStats, Refused};

use crate::metrics::PoolMetrics;

/// Triton's statistics of every model the pool serves (`model` None), or of one (and of one
/// version).
pub fn statistics(m: &PoolMetrics, model: Option<&str>, version: Option<&str>) -> Result<Vec<ModelStats>, Refused> {
    let rows: Vec<usize> = match model {
        None => (0..m.models.len()).collect(),
        Some(name) => match m.models.iter().position(|n| n == name) {
            None => return Err(Refused::UnknownModel { name: name.to_string(), served: m.models.clone() }),
            Some(row) => match version.filter(|v| *v != m.versions[row]) {
                Some(version) => {
                    return Err(Refused::UnknownVersion {
                        name: name.to_string(),
                        version: version.to_string(),
                        serves: m.versions[row].clone(),
                    })
                }
                None => vec![row],
            },
        },
    };
    Ok(rows.into_iter().map(|row| model_statistics(m, row)).collect())
}

/// One model's statistics in Triton's shape. From inferd's counters: success and fail are
/// requests answered 200 and otherwise with the time they took in the worker; queue and
/// compute_infer are the per-request queue and model times; inference_count and
/// execution_count are the rows run and the model calls (batches); cache_hit and cache_miss
/// are the rows the answer cache found and did not (their time is not measured apart: ns 0).
/// inferd does not time input and output preparation apart from the request (compute_input
/// and compute_output are 0).
fn model_statistics(m: &PoolMetrics, row: usize) -> ModelStats {
    use inferd_ipc::stats::{Latency, Outcomes};
    let t = &m.totals;
    let Outcomes { ok, ok_seconds, failed, failed_seconds, last_millis } = t.outcomes(row);
    let queue = t.latency(Latency::Queue, row);
    let compute = t.latency(Latency::Compute, row);
    let batches = t.batch(row);
    let [hits, misses, ..] = t.cache(row);
    ModelStats {
        name: m.models[row].clone(),
        version: m.versions[row].clone(),
        last_inference: last_millis,
        inference_count: batches.sum as u64,
        execution_count: batches.count,
        inference_stats: InferStats {
            success: Duration::of(ok, ok_seconds),
            fail: Duration::of(failed, failed_seconds),
            queue: Duration::of(queue.count, queue.sum),
            compute_infer: Duration::of(compute.count, compute.sum),
            cache_hit: Duration::of(hits, 0.0),
            cache_miss: Duration::of(misses, 0.0),
            ..InferStats::default()
        },
        batch_stats: Vec::new(),
    }
}

/// Triton's repository index: every model the pool serves (those `load` added from elsewhere
/// too), then every other folder of the repository with a model (its model.toml, or an ONNX
/// file to serve without one); with on_demand, a model a worker loaded on demand is READY.
/// With `ready_only`, only the READY ones.
pub fn index(m: &PoolMetrics, repository: &Path, ready_only: bool) -> Vec<IndexEntry> {
    let mut entries: Vec<IndexEntry> =
        m.models.iter().zip(&m.versions).map(|(name, version)| entry(name, version, true, "")).collect();
    let on_demand = m.models_budget.is_some();
    for name in ModelEntry::folders(repository).into_iter().filter(|n| !m.models.contains(n)) {
        let loaded = m.model_bytes.contains_key(&name);
        if ready_only && !loaded {
            continue;
        }
        let (version, reason) = match ModelEntry::load(repository, &name) {
            Ok(e) if loaded => (e.version, "loaded on demand".to_string()),
            Ok(e) if on_demand => (e.version, "not loaded: loaded on its first request (on_demand)".to_string()),
            Ok(e) => (e.version, "unloaded".to_string()),
            Err(e) => (String::new(), e.to_string()),
        };
        entries.push(entry(&name, &version, loaded, &reason));
    }
    entries
}

fn entry(name: &str, version: &str, ready: bool, reason: &str) -> IndexEntry {
    IndexEntry {
        name: name.to_string(),
        version: version.to_string(),
        state: if ready { "READY" } else { "UNAVAILABLE" }.to_string(),
        reason: reason.to_string(),
    }
}
