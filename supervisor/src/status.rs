//! The pool as `inferd status` shows it: one JSON document, and the table rendered from it.

use std::fmt::Write;

use crate::plan::cpu::format_cpus;
use std::collections::BTreeMap;

use inferd_ipc::spec::{Cause, ModelCost, ModelInfo, Precision, Weights};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Workers are booting; not all of them have been ready yet.
    Starting,
    /// Every slot has a ready worker.
    Ready,
    /// At least one slot has no ready worker (crash, restart, backoff).
    Degraded,
    /// A rolling reload is replacing the workers one by one.
    Reloading,
    /// SIGTERM/SIGINT received: workers are draining.
    Stopping,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Spawned; loading ONNX Runtime and the models.
    Starting,
    /// Models loaded; warm-up runs in progress. Not bound to the port yet.
    Warming,
    /// Bound to the port and serving.
    Ready,
    /// Not accepting; finishing in-flight requests.
    Draining,
    /// No process in this slot (waiting for a restart after backoff).
    Down,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub index: usize,
    pub pid: Option<u32>,
    pub generation: u64,
    pub state: WorkerState,
    /// Why the supervisor started this worker (none: the slot is down).
    #[serde(default)]
    pub started_for: Option<Cause>,
    pub cpus: Vec<usize>,
    /// The sibling's CPU it may borrow for a lone request (server.lend_idle_cores).
    #[serde(default)]
    pub borrows: Option<usize>,
    /// ORT intra-op threads (the worker's share of the cores).
    pub threads: usize,
    /// Threads of the process as the kernel counts them (documented: 2 x threads + 1, one
    /// more for a worker that borrows).
    pub os_threads: Option<u64>,
    pub rss_bytes: Option<u64>,
    /// Memory only this worker holds (RssAnon + RssShmem): RSS less the shared weights and
    /// libraries. The memory guards watch this.
    #[serde(default)]
    pub private_bytes: Option<u64>,
    /// Inference requests answered by the current process.
    pub requests: u64,
    pub in_flight: u64,
    /// Requests waiting for a lane.
    pub queued: u64,
    /// Times this slot's worker died without being asked to.
    pub restarts: u32,
    pub uptime_secs: Option<f64>,
    pub models: Vec<ModelInfo>,
    /// What each model it loaded on demand holds, as it measured when loading it ([models]
    /// on_demand).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_bytes: BTreeMap<String, ModelCost>,
    /// How the previous worker of this slot ended, if one did.
    pub last_exit: Option<String>,
}

/// How one model's requests were batched since start: ORT runs by rows per run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchSizes {
    pub model: String,
    /// ORT runs and the rows they carried.
    pub runs: u64,
    pub rows: u64,
    /// (upper bound of rows, runs) per histogram bucket; `None` = above the last bound.
    pub histogram: Vec<(Option<u64>, u64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStatus {
    pub version: String,
    pub pid: u32,
    pub phase: Phase,
    /// Incremented by every reload.
    pub generation: u64,
    /// What a reload in progress is doing.
    pub reload: Option<String>,
    /// An upgrade of inferd itself in progress (`inferd upgrade`): the other supervisor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<String>,
    pub listen: String,
    /// server.grpc_listen, when gRPC is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_listen: Option<String>,
    pub uptime_secs: f64,
    pub usable_cores: usize,
    pub cpu_budget: String,
    pub threads_per_worker: usize,
    /// Requests answered by the pool since start, retired workers included.
    pub requests_total: u64,
    /// (window seconds, p50 ms, p99 ms) of request latency over about the last minute; the
    /// percentiles are histogram bucket upper bounds (None: above the last bucket).
    pub latency_last_minute: Option<(f64, Option<f64>, Option<f64>)>,
    /// The memory budget and the per-worker limits of private memory.
    pub memory: String,
    pub reloads_succeeded: u64,
    pub reloads_failed: u64,
    /// Per model, how requests were batched (dynamic batching in each worker's engine).
    pub batches: Vec<BatchSizes>,
    pub workers: Vec<WorkerStatus>,
}

impl PoolStatus {
    pub fn ready_workers(&self) -> usize {
        self.workers.iter().filter(|w| w.state == WorkerState::Ready).count()
    }

    /// The human-readable table `inferd status` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "inferd {} (pid {}) {} on {}{}, up {}; {}/{} workers ready; {} requests served",
            self.version,
            self.pid,
            serde_plain(&self.phase),
            self.listen,
            self.grpc_listen.as_ref().map_or(String::new(), |g| format!(" (gRPC on {g})")),
            duration(self.uptime_secs),
            self.ready_workers(),
            self.workers.len(),
            self.requests_total
        );
        if let Some(upgrade) = &self.upgrade {
            let _ = writeln!(out, "upgrade: {upgrade}");
        }
        let _ = writeln!(
            out,
            "cpu: {} usable cores ({}); {} intra-op thread(s) per worker",
            self.usable_cores, self.cpu_budget, self.threads_per_worker
        );
        let _ = writeln!(out, "memory: {}", self.memory);
        let ms = |v: Option<f64>| v.map_or("> 10 s".to_string(), |v| format!("<= {v} ms"));
        let _ = writeln!(
            out,
            "latency over the last {}: {}",
            self.latency_last_minute.map_or("minute".into(), |(s, _, _)| format!("{s:.0} s")),
            self.latency_last_minute.map_or("no requests".into(), |(_, p50, p99)| format!(
                "p50 {}, p99 {}",
                ms(p50),
                ms(p99)
            ))
        );
        for b in self.batches.iter().filter(|b| b.runs > 0) {
            let buckets: Vec<String> = b
                .histogram
                .iter()
                .filter(|(_, n)| *n > 0)
                .map(|(bound, n)| format!("{}: {n}", bound.map_or("more".into(), |v| format!("<={v}"))))
                .collect();
            let _ = writeln!(
                out,
                "batches of {}: {} runs, {:.1} rows per run ({})",
                b.model,
                b.runs,
                b.rows as f64 / b.runs as f64,
                buckets.join(", ")
            );
        }
        let _ = writeln!(
            out,
            "generation {}; reloads: {} succeeded, {} failed{}\n",
            self.generation,
            self.reloads_succeeded,
            self.reloads_failed,
            self.reload.as_ref().map_or(String::new(), |r| format!("; reloading: {r}"))
        );
        let header = [
            "WORKER",
            "PID",
            "STATE",
            "GEN",
            "FOR",
            "CPUS",
            "THREADS",
            "RSS",
            "PRIVATE",
            "REQUESTS",
            "IN-FLIGHT",
            "QUEUED",
            "RESTARTS",
            "UPTIME",
            "MODEL",
        ];
        let mut rows = vec![header.map(String::from).to_vec()];
        for w in &self.workers {
            let models = w
                .models
                .iter()
                .map(|m| {
                    // `shared`: weights mapped from the one prepared copy; `private`: its own.
                    let weights = match &m.weights {
                        Weights::Shared => "shared",
                        Weights::Private { .. } => "private",
                        Weights::Said(prose) => prose.split(':').next().filter(|w| !w.is_empty()).unwrap_or("?"),
                    };
                    // `fp32`, or `int8` with the CPU's int8 class and the bits of its weights (the
                    // guard's figures are in the JSON).
                    let precision = match &m.precision {
                        Precision::Fp32 { .. } => "fp32".to_string(),
                        Precision::Int8 { cpu, weight_type, weight_bits, .. } if !cpu.is_empty() => {
                            format!("int8 {cpu} {weight_type} {weight_bits}-bit")
                        }
                        Precision::Int8 { .. } => "int8".to_string(),
                        Precision::Said(prose) => {
                            prose.split(' ').next().filter(|p| !p.is_empty()).unwrap_or("fp32").to_string()
                        }
                    };
                    let held = match w.model_bytes.get(&m.name) {
                        Some(cost) => format!(", on demand: {}", bytes(cost.total())),
                        None => String::new(),
                    };
                    let signed = match &m.signer {
                        Some(signer) => format!(", signed by {signer}"),
                        None => String::new(),
                    };
                    format!("{}:{} ({}, {precision}, {weights} weights{held}{signed})", m.name, m.version, m.sha256)
                })
                .collect::<Vec<_>>();
            rows.push(vec![
                w.index.to_string(),
                w.pid.map_or("-".into(), |p| p.to_string()),
                serde_plain(&w.state),
                w.generation.to_string(),
                w.started_for.map_or("-", Cause::as_str).into(),
                match w.borrows {
                    Some(cpu) => format!("{} (+{cpu})", format_cpus(&w.cpus)),
                    None => format_cpus(&w.cpus),
                },
                match w.os_threads {
                    Some(os) => format!("{} ({os} os)", w.threads),
                    None => w.threads.to_string(),
                },
                w.rss_bytes.map_or("-".into(), bytes),
                w.private_bytes.map_or("-".into(), bytes),
                w.requests.to_string(),
                w.in_flight.to_string(),
                w.queued.to_string(),
                w.restarts.to_string(),
                w.uptime_secs.map_or("-".into(), duration),
                if models.is_empty() { "-".into() } else { models.join(", ") },
            ]);
        }
        let widths: Vec<usize> =
            (0..header.len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
        for row in &rows {
            let line: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
            let _ = writeln!(out, "{}", line.join("  ").trim_end());
        }
        for w in self.workers.iter().filter(|w| w.last_exit.is_some()) {
            let _ = writeln!(out, "worker {} last exit: {}", w.index, w.last_exit.as_deref().unwrap_or_default());
        }
        out
    }
}

fn serde_plain<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

fn duration(secs: f64) -> String {
    let s = secs as u64;
    match s {
        0..60 => format!("{secs:.1}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

fn bytes(b: u64) -> String {
    format!("{:.1}MiB", b as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_one_row_per_worker() {
        let worker = |index| WorkerStatus {
            index,
            pid: Some(100 + index as u32),
            generation: 1,
            state: WorkerState::Ready,
            started_for: Some(Cause::Boot),
            cpus: vec![index],
            borrows: None,
            threads: 1,
            os_threads: Some(2),
            rss_bytes: Some(50 << 20),
            private_bytes: Some(20 << 20),
            requests: 7,
            in_flight: 0,
            queued: 0,
            restarts: 0,
            uptime_secs: Some(75.0),
            models: vec![ModelInfo {
                name: "m".into(),
                version: "1".into(),
                sha256: "abcd".into(),
                weights: Weights::Shared,
                precision: Precision::FP32,
                signer: None,
            }],
            model_bytes: [("m".to_string(), ModelCost { private: 1 << 20, mapped: 24 << 20 })].into(),
            last_exit: None,
        };
        let status = PoolStatus {
            version: "0".into(),
            pid: 1,
            phase: Phase::Ready,
            generation: 1,
            reload: None,
            upgrade: None,
            reloads_succeeded: 0,
            batches: vec![BatchSizes {
                model: "m".into(),
                runs: 4,
                rows: 10,
                histogram: vec![(Some(1), 1), (None, 3)],
            }],
            reloads_failed: 0,
            listen: "127.0.0.1:8000".into(),
            grpc_listen: None,
            uptime_secs: 3.0,
            usable_cores: 2,
            cpu_budget: "affinity 0-1".into(),
            threads_per_worker: 1,
            requests_total: 14,
            latency_last_minute: Some((60.0, Some(5.0), None)),
            memory: "MemAvailable 1000 MiB, no cgroup memory limit".into(),
            workers: vec![worker(0), worker(1)],
        };
        let table = status.render();
        assert!(table.contains("ready on 127.0.0.1:8000"), "{table}");
        assert!(table.contains("2/2 workers ready"), "{table}");
        let rows: Vec<&str> =
            table.lines().filter(|l| l.contains("m:1 (abcd, fp32, shared weights, on demand: 25.0MiB)")).collect();
        assert_eq!(rows.len(), 2, "{table}");
        assert!(rows[1].starts_with("1  "), "{table}");
        assert!(rows[1].contains("50.0MiB  20.0MiB") && rows[1].contains("1m15s"), "{table}");
    }
}
