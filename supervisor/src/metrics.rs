//! Prometheus text exposition of the pool, served by the supervisor on `admin.listen`
//! (`GET /metrics`; admin.rs serves it).
//!
//! Request counts and latency histograms come from the counters each worker shares with the
//! supervisor (see `inferd_ipc::stats`): those of live workers plus the final counts of
//! every worker that has exited, so a SIGKILLed worker does not take its counts with it.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt::{self, Write};

use inferd_config::auth::Refusal;
use inferd_ipc::spec::{ModelCost, ModelInfo, Precision};
use inferd_ipc::stats::{Endpoint, Histogram, Latency, Snapshot, BATCH_BUCKETS, CODES, LATENCY_BUCKETS, MAX_MODELS};

/// Rolling reloads since start, by outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reloads {
    pub succeeded: u64,
    pub failed: u64,
}

/// Why a worker that died was replaced (`inferd_worker_restarts_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartReason {
    /// The supervisor aborted it for a run, a batch timer thread or an I/O loop that did not move
    /// (pool/guards.rs).
    Stuck,
    /// The supervisor killed it for passing the hard memory limit.
    MemoryHard,
    /// It could not load its model.
    ModelLoad,
    /// It failed to start otherwise (or was not ready within server.boot_timeout_secs).
    Boot,
    /// It exited with the code of a panic.
    Panic,
    /// A signal killed it.
    Signal,
    /// It exited on its own.
    Exit,
}

impl RestartReason {
    /// Every reason, so that the first scrape has each series at 0.
    pub const ALL: [RestartReason; 7] = [
        RestartReason::Stuck,
        RestartReason::MemoryHard,
        RestartReason::ModelLoad,
        RestartReason::Boot,
        RestartReason::Panic,
        RestartReason::Signal,
        RestartReason::Exit,
    ];

    /// Its `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartReason::Stuck => "stuck",
            RestartReason::MemoryHard => "memory_hard",
            RestartReason::ModelLoad => "model_load",
            RestartReason::Boot => "boot",
            RestartReason::Panic => "panic",
            RestartReason::Signal => "signal",
            RestartReason::Exit => "exit",
        }
    }
}

/// Why a live worker was replaced gap-free (`inferd_worker_recycles_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecycleReason {
    /// Its memory (pool/guards.rs's soft limit), or the pool's near its cgroup's limit.
    Memory,
    /// server.max_requests.
    MaxRequests,
    /// server.max_worker_age_secs.
    MaxAge,
    /// A panic it caught serving a request.
    Fault,
}

impl RecycleReason {
    /// Every reason, so that the first scrape has each series at 0.
    pub const ALL: [RecycleReason; 4] =
        [RecycleReason::Memory, RecycleReason::MaxRequests, RecycleReason::MaxAge, RecycleReason::Fault];

    /// Its `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            RecycleReason::Memory => "memory",
            RecycleReason::MaxRequests => "max_requests",
            RecycleReason::MaxAge => "max_age",
            RecycleReason::Fault => "fault",
        }
    }
}

/// Shown as their labels, and ordered by them: the order of their series in `/metrics`.
macro_rules! by_label {
    ($($reason:ty),*) => {$(
        impl fmt::Display for $reason {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Ord for $reason {
            fn cmp(&self, other: &Self) -> Ordering {
                self.as_str().cmp(other.as_str())
            }
        }

        impl PartialOrd for $reason {
            fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
                Some(self.cmp(other))
            }
        }
    )*};
}

by_label!(RestartReason, RecycleReason);

/// What the loop hands over for one scrape.
#[derive(Debug, Default)]
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
    pub restarts: BTreeMap<RestartReason, u64>,
    pub recycles: BTreeMap<RecycleReason, u64>,
    pub reloads: Reloads,
    pub generation: u64,
    pub model_info: Vec<ModelInfo>,
    /// Models loaded and evicted, by model, since start.
    pub model_events: BTreeMap<String, ModelEvents>,
    /// How long loads on demand took.
    pub load_seconds: LoadSeconds,
    /// What each model loaded on demand holds now, summed over the live workers.
    pub model_bytes: BTreeMap<String, ModelCost>,
    /// models.memory_budget, with on_demand.
    pub models_budget: Option<u64>,
    /// The pool's saturation, 0 .. 1 (see pool/saturation.rs).
    pub saturation: f64,
    /// (slot, pid, lanes, busy lanes over the window) of every live worker.
    pub lanes: Vec<(usize, u32, usize, Option<f64>)>,
    /// Connections waiting in the port's accept queues now.
    pub accept_queued: u64,
    /// The supervisor's own spans (exported, dropped).
    pub supervisor_spans: (u64, u64),
    /// Each API key's requests by priority, refusals and requests in flight, pool-wide.
    pub keys: Vec<inferd_ipc::limits::KeyReport>,
    /// When this supervisor started, in seconds since the Unix epoch: its counters count from
    /// then (an upgrade starts a new supervisor, whose counters start again from zero).
    pub start_time: f64,
}

/// A model's loads, evictions and refused loads since start (`inferd_model_loads_total`,
/// `inferd_model_evictions_total`, `inferd_model_signature_refusals_total`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelEvents {
    /// Loaded by a worker as it started (the default model and models.load).
    pub boot: u64,
    /// Loaded by a worker for a request ([models] on_demand).
    pub on_demand: u64,
    pub evictions: u64,
    /// Loads its signature refused, by the refusal's kind.
    pub refusals: BTreeMap<String, u64>,
}

/// Upper bounds (seconds) of `inferd_model_load_seconds`' buckets.
pub const LOAD_SECONDS_BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// The histogram of load times on demand.
#[derive(Debug, Clone, Default)]
pub struct LoadSeconds {
    /// One count per bound of [`LOAD_SECONDS_BUCKETS`], and one above the last.
    pub buckets: [u64; LOAD_SECONDS_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl LoadSeconds {
    pub fn observe(&mut self, seconds: f64) {
        let bucket = LOAD_SECONDS_BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(LOAD_SECONDS_BUCKETS.len());
        self.buckets[bucket] += 1;
        self.sum += seconds;
        self.count += 1;
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram, bounds: &[String]) {
    let mut cumulative = 0;
    let (before_le, set) = if labels.is_empty() { ("", String::new()) } else { (",", format!("{{{labels}}}")) };
    for (bound, count) in bounds.iter().map(String::as_str).chain(["+Inf"]).zip(h.buckets) {
        cumulative += count;
        let _ = writeln!(out, "{name}_bucket{{{labels}{before_le}le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_sum{set} {}", h.sum);
    let _ = writeln!(out, "{name}_count{set} {}", h.count);
}

/// A label value in the text exposition format: backslash, double quote and newline escaped.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub fn render(m: &PoolMetrics) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // The first MAX_MODELS models have counter rows of their own; the others count as "other".
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
        ("inferd_queue_duration_seconds", Latency::Queue, "Time a request waited for a lane."),
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
    // The cache of answers ([cache]), per model (those loaded on demand count as "other").
    for (name, kind, slot, help) in [
        ("inferd_cache_hits_total", "counter", 0, "Rows answered from the cache of answers, by model."),
        ("inferd_cache_misses_total", "counter", 1, "Rows computed with the cache on (not found in it), by model."),
        (
            "inferd_cache_evictions_total",
            "counter",
            2,
            "Cache entries evicted to stay within cache.max_bytes, by model.",
        ),
        ("inferd_cache_bytes", "gauge", 3, "Bytes of answers the workers' caches hold now, by model."),
    ] {
        header(&mut out, name, kind, help);
        for (row, model) in models.iter().map(|(i, n)| (*i, n.as_str())).chain([(MAX_MODELS, "other")]) {
            let _ = writeln!(out, "{name}{{model=\"{model}\"}} {}", m.totals.cache(row)[slot]);
        }
    }
    header(&mut out, "inferd_requests_in_flight", "gauge", "Requests being handled by the workers now.");
    let _ = writeln!(out, "inferd_requests_in_flight {}", m.totals.in_flight());
    header(&mut out, "inferd_requests_queued", "gauge", "Requests waiting for a lane now.");
    let _ = writeln!(out, "inferd_requests_queued {}", m.totals.queued());
    header(
        &mut out,
        "inferd_saturation",
        "gauge",
        "How much of the pool's capacity is taken, 0 (idle) to 1 (none free): requests held by the \
         ready workers against their lanes, 1 while connections wait in the accept queues; the mean \
         over the last 5 s (docs/operations.md, Saturation).",
    );
    let _ = writeln!(out, "inferd_saturation {:.4}", m.saturation);
    header(
        &mut out,
        "inferd_accept_queue_connections",
        "gauge",
        "Connections waiting in the port's accept queues (every slot's HTTP and gRPC socket) now.",
    );
    let _ = writeln!(out, "inferd_accept_queue_connections {}", m.accept_queued);
    header(
        &mut out,
        "inferd_lane_busy_seconds_total",
        "counter",
        "Seconds the workers' lanes spent running models (its rate: busy lanes, time-weighted).",
    );
    let _ = writeln!(out, "inferd_lane_busy_seconds_total {:.6}", m.totals.lane_busy_seconds());
    header(&mut out, "inferd_worker_lanes", "gauge", "Lanes of each worker: model runs it can do at once.");
    for (slot, pid, lanes, _) in &m.lanes {
        let _ = writeln!(out, "inferd_worker_lanes{{worker=\"{slot}\",pid=\"{pid}\"}} {lanes}");
    }
    header(
        &mut out,
        "inferd_worker_busy_lanes",
        "gauge",
        "Lanes of each worker busy running models, time-weighted over the last 5 s.",
    );
    for (slot, pid, _, busy) in &m.lanes {
        if let Some(busy) = busy {
            let _ = writeln!(out, "inferd_worker_busy_lanes{{worker=\"{slot}\",pid=\"{pid}\"}} {busy:.4}");
        }
    }
    let (exported, dropped) = m.totals.spans();
    let (exported, dropped) = (exported + m.supervisor_spans.0, dropped + m.supervisor_spans.1);
    header(
        &mut out,
        "inferd_trace_spans_exported_total",
        "counter",
        "Spans the workers exported over OTLP ([tracing]).",
    );
    let _ = writeln!(out, "inferd_trace_spans_exported_total {exported}");
    header(
        &mut out,
        "inferd_trace_spans_dropped_total",
        "counter",
        "Spans dropped: the export queue was full (tracing.max_queued_spans), or an export failed or timed out.",
    );
    let _ = writeln!(out, "inferd_trace_spans_dropped_total {dropped}");
    header(&mut out, "inferd_worker_rss_bytes", "gauge", "Resident memory of each worker process.");
    for (slot, pid, rss) in &m.workers {
        if let Some(rss) = rss {
            let _ = writeln!(out, "inferd_worker_rss_bytes{{worker=\"{slot}\",pid=\"{pid}\"}} {rss}");
        }
    }
    header(&mut out, "inferd_workers_ready", "gauge", "Workers ready and serving.");
    let _ = writeln!(out, "inferd_workers_ready {}", m.ready);
    header(
        &mut out,
        "process_start_time_seconds",
        "gauge",
        "When the supervisor started (its counters count from then).",
    );
    let _ = writeln!(out, "process_start_time_seconds {}", m.start_time);
    header(&mut out, "inferd_build_info", "gauge", "The inferd version the supervisor runs.");
    let _ = writeln!(out, "inferd_build_info{{version=\"{}\"}} 1", label(inferd_ipc::version()));
    header(&mut out, "inferd_workers_desired", "gauge", "Workers the pool is meant to have.");
    let _ = writeln!(out, "inferd_workers_desired {}", m.desired);
    header(
        &mut out,
        "inferd_auth_refused_total",
        "counter",
        "Requests refused for their API key ([auth]), by reason: missing or invalid.",
    );
    for (reason, n) in Refusal::ALL.iter().zip(m.totals.auth_refused()) {
        let _ = writeln!(out, "inferd_auth_refused_total{{reason=\"{reason}\"}} {n}");
    }
    if !m.keys.is_empty() {
        header(
            &mut out,
            "inferd_key_requests_total",
            "counter",
            "Requests admitted, by API key name (empty without keys) and priority (0 the highest).",
        );
        for k in &m.keys {
            for (priority, n) in &k.served {
                let _ = writeln!(
                    out,
                    "inferd_key_requests_total{{key=\"{}\",priority=\"{priority}\"}} {n}",
                    label(&k.name)
                );
            }
        }
        header(
            &mut out,
            "inferd_key_limited_total",
            "counter",
            "Requests refused with 429 for their API key's limit, by key name and limit (rate, concurrency).",
        );
        for k in &m.keys {
            for (limit, n) in [("rate", k.refused_rate), ("concurrency", k.refused_concurrency)] {
                let _ = writeln!(out, "inferd_key_limited_total{{key=\"{}\",limit=\"{limit}\"}} {n}", label(&k.name));
            }
        }
        header(&mut out, "inferd_key_in_flight", "gauge", "Requests in flight, by API key name, pool-wide.");
        for k in &m.keys {
            let _ = writeln!(out, "inferd_key_in_flight{{key=\"{}\"}} {}", label(&k.name), k.in_flight);
        }
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
    header(
        &mut out,
        "inferd_model_forwards_total",
        "counter",
        "Requests for a model loaded on demand that a sibling worker held (models.placement = \"pool\"), \
         by outcome: answered by it (forwarded), or served here because it could not be reached \
         (unreached) or went away before it answered (lost).",
    );
    for (outcome, n) in inferd_ipc::stats::FORWARD_EVENTS.iter().zip(m.totals.forwards()) {
        let _ = writeln!(out, "inferd_model_forwards_total{{outcome=\"{outcome}\"}} {n}");
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
    header(
        &mut out,
        "inferd_model_int8_info",
        "gauge",
        "Models served in int8: the CPU's int8 class (by CPUID), the type and bits of their weights.",
    );
    for info in &m.model_info {
        if let Precision::Int8 { cpu, weight_type, weight_bits, .. } = &info.precision {
            let _ = writeln!(
                out,
                "inferd_model_int8_info{{model=\"{}\",version=\"{}\",cpu_class=\"{}\",weight_type=\"{}\",weight_bits=\"{weight_bits}\"}} 1",
                label(&info.name),
                label(&info.version),
                label(cpu),
                label(weight_type)
            );
        }
    }
    header(
        &mut out,
        "inferd_model_loads_total",
        "counter",
        "Models loaded by the workers, by model and reason: boot (as a worker started) or on_demand (for a request).",
    );
    for (model, events) in &m.model_events {
        for (reason, n) in [("boot", events.boot), ("on_demand", events.on_demand)] {
            if n > 0 {
                let _ = writeln!(out, "inferd_model_loads_total{{model=\"{}\",reason=\"{reason}\"}} {n}", label(model));
            }
        }
    }
    header(
        &mut out,
        "inferd_model_evictions_total",
        "counter",
        "Models evicted by the workers to make room for others, by model.",
    );
    for (model, events) in m.model_events.iter().filter(|(_, e)| e.evictions > 0) {
        let _ = writeln!(out, "inferd_model_evictions_total{{model=\"{}\"}} {}", label(model), events.evictions);
    }
    header(
        &mut out,
        "inferd_model_signature_refusals_total",
        "counter",
        "Loads refused by the model folder's signature ([models] signatures), by model and reason.",
    );
    for (model, events) in &m.model_events {
        for (reason, n) in &events.refusals {
            let _ = writeln!(
                out,
                "inferd_model_signature_refusals_total{{model=\"{}\",reason=\"{}\"}} {n}",
                label(model),
                label(reason)
            );
        }
    }
    header(
        &mut out,
        "inferd_model_load_seconds",
        "histogram",
        "Time a worker took to load a model on demand, warm-up included.",
    );
    let bounds: Vec<String> = LOAD_SECONDS_BUCKETS.iter().map(|b| b.to_string()).collect();
    let loads = Histogram { buckets: &m.load_seconds.buckets, sum: m.load_seconds.sum, count: m.load_seconds.count };
    histogram(&mut out, "inferd_model_load_seconds", "", &loads, &bounds);
    header(
        &mut out,
        "inferd_model_bytes",
        "gauge",
        "Memory the models loaded on demand hold now, summed over the workers, by model and kind: private \
         (each worker's own pages) or mapped (file pages: the weights, one copy in the page cache).",
    );
    for (model, cost) in &m.model_bytes {
        for (kind, bytes) in [("private", cost.private), ("mapped", cost.mapped)] {
            let _ = writeln!(out, "inferd_model_bytes{{model=\"{}\",kind=\"{kind}\"}} {bytes}", label(model));
        }
    }
    if let Some(budget) = m.models_budget {
        header(
            &mut out,
            "inferd_models_budget_bytes",
            "gauge",
            "models.memory_budget: what the pool's workers may hold, in all.",
        );
        let _ = writeln!(out, "inferd_models_budget_bytes {budget}");
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
            model_info: vec![
                ModelInfo {
                    name: "m\"0".into(),
                    version: "v\"1\\\n".into(),
                    sha256: "ab".into(),
                    weights: inferd_ipc::spec::Weights::Shared,
                    precision: Precision::FP32,
                    signer: None,
                },
                ModelInfo {
                    name: "q".into(),
                    version: "1".into(),
                    sha256: "cd".into(),
                    weights: inferd_ipc::spec::Weights::Shared,
                    precision: Precision::Int8 {
                        guard: "...".into(),
                        cpu: "avx2".into(),
                        weight_type: "s8".into(),
                        weight_bits: 7,
                    },
                    signer: None,
                },
            ],
            ..Default::default()
        });
        assert!(text.contains(r#"inferd_model_info{model="m\"0",version="v\"1\\\n",sha256="ab"} 1"#), "{text}");
        assert!(text.contains(
            r#"inferd_model_int8_info{model="q",version="1",cpu_class="avx2",weight_type="s8",weight_bits="7"} 1"#
        ));
        assert_eq!(text.matches("inferd_model_int8_info{").count(), 1, "fp32 models have no int8 row");
        assert!(text.contains(r#"inferd_batch_size_count{model="m7"} 0"#));
        assert!(!text.contains(r#"model="m8""#), "a ninth model has no counter row");
    }

    #[test]
    fn reasons_are_listed_by_their_labels_from_zero() {
        let restarts: BTreeMap<RestartReason, u64> = RestartReason::ALL.iter().map(|&r| (r, 0)).collect();
        let recycles: BTreeMap<RecycleReason, u64> = RecycleReason::ALL.iter().map(|&r| (r, 0)).collect();
        let labels = |keys: Vec<String>| keys.join(" ");
        assert_eq!(
            labels(restarts.keys().map(|r| r.to_string()).collect()),
            "boot exit memory_hard model_load panic signal stuck"
        );
        assert_eq!(labels(recycles.keys().map(|r| r.to_string()).collect()), "fault max_age max_requests memory");
        let text = render(&PoolMetrics {
            models: vec!["m".into()],
            versions: vec!["1".into()],
            totals: Snapshot::default(),
            workers: Vec::new(),
            ready: 1,
            desired: 1,
            restarts,
            recycles,
            reloads: Reloads::default(),
            generation: 1,
            model_info: Vec::new(),
            ..Default::default()
        });
        for line in [
            "inferd_auth_refused_total{reason=\"missing\"} 0\ninferd_auth_refused_total{reason=\"invalid\"} 0\n",
            "inferd_worker_restarts_total{reason=\"memory_hard\"} 0\ninferd_worker_restarts_total{reason=\"model_load\"} 0\n",
            "inferd_worker_recycles_total{reason=\"max_requests\"} 0\ninferd_worker_recycles_total{reason=\"memory\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn models_loaded_and_evicted_are_counted_by_model_and_their_bytes_and_load_times_shown() {
        let mut load_seconds = LoadSeconds::default();
        for seconds in [0.04, 0.3, 200.0] {
            load_seconds.observe(seconds);
        }
        let refusals = [("digest_mismatch".to_string(), 4)].into();
        let events = ModelEvents { boot: 2, on_demand: 3, evictions: 1, refusals };
        let text = render(&PoolMetrics {
            model_events: [("m\"1".to_string(), events), ("quiet".to_string(), ModelEvents::default())].into(),
            load_seconds,
            model_bytes: [("m\"1".to_string(), ModelCost { private: 5, mapped: 7 })].into(),
            models_budget: Some(1 << 30),
            ..Default::default()
        });
        for line in [
            r#"inferd_model_loads_total{model="m\"1",reason="boot"} 2"#,
            r#"inferd_model_loads_total{model="m\"1",reason="on_demand"} 3"#,
            r#"inferd_model_evictions_total{model="m\"1"} 1"#,
            r#"inferd_model_signature_refusals_total{model="m\"1",reason="digest_mismatch"} 4"#,
            r#"inferd_model_bytes{model="m\"1",kind="private"} 5"#,
            r#"inferd_model_bytes{model="m\"1",kind="mapped"} 7"#,
            r#"inferd_model_load_seconds_bucket{le="0.05"} 1"#,
            r#"inferd_model_load_seconds_bucket{le="0.5"} 2"#,
            r#"inferd_model_load_seconds_bucket{le="120"} 2"#,
            r#"inferd_model_load_seconds_bucket{le="+Inf"} 3"#,
            "inferd_model_load_seconds_count 3",
            "inferd_models_budget_bytes 1073741824",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert!(!text.contains("quiet"), "a model never loaded on demand nor evicted has no series");
    }
}
