//! Prometheus text exposition of the pool, served by the supervisor on `admin.listen`
//! (`GET /metrics`, see [`crate::admin`]).
//!
//! Request counts and latency histograms come from the counters each worker shares with the
//! supervisor (see `inferd_ipc::stats`): those of live workers plus the final counts of
//! every worker that has exited, so a SIGKILLed worker does not take its counts with it.

use std::collections::BTreeMap;
use std::fmt::Write;

use inferd_ipc::spec::ModelInfo;
use inferd_ipc::stats::{Endpoint, Histogram, Latency, Snapshot, BATCH_BUCKETS, CODES, LATENCY_BUCKETS, MAX_MODELS};

/// Rolling reloads since start, by outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reloads {
    pub succeeded: u64,
    pub failed: u64,
}

/// What the loop hands over for one scrape.
#[derive(Debug)]
pub struct PoolMetrics {
    /// Model names by counter row.
    pub models: Vec<String>,
    /// Their version labels.
    pub versions: Vec<String>,
    pub totals: Snapshot,
    /// (slot, pid, RSS bytes) of every live worker.
    pub workers: Vec<(usize, u32, Option<u64>)>,
    pub ready: usize,
    pub desired: usize,
    pub restarts: BTreeMap<&'static str, u64>,
    pub recycles: BTreeMap<&'static str, u64>,
    pub reloads: Reloads,
    pub generation: u64,
    pub model_info: Vec<ModelInfo>,
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram, bounds: &[String]) {
    let mut cumulative = 0;
    for (bound, count) in bounds.iter().map(String::as_str).chain(["+Inf"]).zip(h.buckets) {
        cumulative += count;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

/// A label value in the text exposition format: backslash, double quote and newline escaped.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub fn render(m: &PoolMetrics) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // The counters have MAX_MODELS rows (config validation keeps the model list within them).
    let models: Vec<(usize, String)> = m.models.iter().take(MAX_MODELS).map(|n| label(n)).enumerate().collect();
    let rows = models.iter().map(|(i, n)| (*i, n.as_str())).chain([(MAX_MODELS, "other")]);
    header(
        &mut out,
        "inferd_requests_total",
        "counter",
        "Inference requests answered, by model, endpoint and status code.",
    );
    for (row, model) in rows {
        for endpoint in Endpoint::ALL {
            for &code in &CODES {
                let n = m.totals.requests(row, endpoint, code);
                if n > 0 {
                    let code = if code == 0 { "other".to_string() } else { code.to_string() };
                    let _ = writeln!(
                        out,
                        "inferd_requests_total{{model=\"{model}\",endpoint=\"{}\",code=\"{code}\"}} {n}",
                        endpoint.as_str()
                    );
                }
            }
        }
    }
    let latency_bounds: Vec<String> = LATENCY_BUCKETS.iter().map(|b| b.to_string()).collect();
    let batch_bounds: Vec<String> = BATCH_BUCKETS.iter().map(|b| b.to_string()).collect();
    for (name, kind, help) in [
        ("inferd_request_duration_seconds", Latency::Request, "Time a worker spent on a request, routing to response."),
        ("inferd_queue_duration_seconds", Latency::Queue, "Time a request waited for the model thread."),
        ("inferd_compute_duration_seconds", Latency::Compute, "Time the model ran for a request."),
    ] {
        header(&mut out, name, "histogram", help);
        for (row, model) in &models {
            histogram(&mut out, name, &format!("model=\"{model}\""), &m.totals.latency(kind, *row), &latency_bounds);
        }
    }
    header(&mut out, "inferd_batch_size", "histogram", "Rows per model run.");
    for (row, model) in &models {
        histogram(&mut out, "inferd_batch_size", &format!("model=\"{model}\""), &m.totals.batch(*row), &batch_bounds);
    }
    header(&mut out, "inferd_requests_in_flight", "gauge", "Requests being handled by the workers now.");
    let _ = writeln!(out, "inferd_requests_in_flight {}", m.totals.in_flight());
    header(&mut out, "inferd_requests_queued", "gauge", "Requests waiting for a model thread now.");
    let _ = writeln!(out, "inferd_requests_queued {}", m.totals.queued());
    header(&mut out, "inferd_worker_rss_bytes", "gauge", "Resident memory of each worker process.");
    for (slot, pid, rss) in &m.workers {
        if let Some(rss) = rss {
            let _ = writeln!(out, "inferd_worker_rss_bytes{{worker=\"{slot}\",pid=\"{pid}\"}} {rss}");
        }
    }
    header(&mut out, "inferd_workers_ready", "gauge", "Workers ready and serving.");
    let _ = writeln!(out, "inferd_workers_ready {}", m.ready);
    header(&mut out, "inferd_workers_desired", "gauge", "Workers the pool is meant to have.");
    let _ = writeln!(out, "inferd_workers_desired {}", m.desired);
    header(
        &mut out,
        "inferd_auth_refused_total",
        "counter",
        "Requests refused for their API key ([auth]), by reason: missing or invalid.",
    );
    for (reason, n) in inferd_ipc::stats::AUTH_REFUSALS.iter().zip(m.totals.auth_refused()) {
        let _ = writeln!(out, "inferd_auth_refused_total{{reason=\"{reason}\"}} {n}");
    }
    header(
        &mut out,
        "inferd_core_lending_total",
        "counter",
        "Runs on a sibling worker's idle core (borrowed) and runs that waited for their own core \
         to come back from a sibling (waited); server.lend_idle_cores.",
    );
    for (event, n) in inferd_ipc::stats::LENDING_EVENTS.iter().zip(m.totals.lending()) {
        let _ = writeln!(out, "inferd_core_lending_total{{event=\"{event}\"}} {n}");
    }
    header(&mut out, "inferd_worker_restarts_total", "counter", "Workers replaced after dying, by reason.");
    for (reason, n) in &m.restarts {
        let _ = writeln!(out, "inferd_worker_restarts_total{{reason=\"{reason}\"}} {n}");
    }
    header(
        &mut out,
        "inferd_worker_recycles_total",
        "counter",
        "Workers replaced gap-free for reaching a limit, by reason.",
    );
    for (reason, n) in &m.recycles {
        let _ = writeln!(out, "inferd_worker_recycles_total{{reason=\"{reason}\"}} {n}");
    }
    header(&mut out, "inferd_reloads_total", "counter", "Rolling reloads, by outcome.");
    let _ = writeln!(out, "inferd_reloads_total{{outcome=\"success\"}} {}", m.reloads.succeeded);
    let _ = writeln!(out, "inferd_reloads_total{{outcome=\"failure\"}} {}", m.reloads.failed);
    header(&mut out, "inferd_generation", "gauge", "Pool generation: 1 at start, +1 per reload.");
    let _ = writeln!(out, "inferd_generation {}", m.generation);
    header(&mut out, "inferd_model_info", "gauge", "Models served now (1 per version being served).");
    for info in &m.model_info {
        let _ = writeln!(
            out,
            "inferd_model_info{{model=\"{}\",version=\"{}\",sha256=\"{}\"}} 1",
            label(&info.name),
            label(&info.version),
            label(&info.sha256)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_rows_stay_within_the_counters() {
        let nine: Vec<String> = (0..9).map(|i| format!("m{i}")).collect();
        let text = render(&PoolMetrics {
            versions: vec!["1".into(); 9],
            models: nine,
            totals: Snapshot::default(),
            workers: Vec::new(),
            ready: 1,
            desired: 1,
            restarts: BTreeMap::new(),
            recycles: BTreeMap::new(),
            reloads: Reloads::default(),
            generation: 1,
            model_info: vec![ModelInfo {
                name: "m\"0".into(),
                version: "v\"1\\\n".into(),
                sha256: "ab".into(),
                weights: "shared".into(),
                precision: "fp32".into(),
            }],
        });
        assert!(text.contains(r#"inferd_model_info{model="m\"0",version="v\"1\\\n",sha256="ab"} 1"#), "{text}");
        assert!(text.contains(r#"inferd_batch_size_count{model="m7"} 0"#));
        assert!(!text.contains(r#"model="m8""#), "a ninth model has no counter row");
    }
}
