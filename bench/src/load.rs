//! An HTTP load: C clients, each on its own keep-alive connection, POST the given bodies in
//! turn for a fixed time and record each answer's latency, each sending its next request as
//! soon as it has an answer (a closed loop) or on a fixed schedule (an open loop, `rate`).
//! Shared by `inferd-bench http` and `inferd tune`; built on the tests' clients
//! ([`crate::clients`], [`crate::http`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::clients::{Clients, Step};
use crate::http::Connection;

pub struct Load {
    /// host:port
    pub addr: String,
    pub path: String,
    pub bodies: Vec<Vec<u8>>,
    pub concurrency: usize,
    /// Measured time, after `warmup`.
    pub seconds: f64,
    /// Time the clients run before measuring starts.
    pub warmup: Duration,
    /// An open loop: requests per second in all, on one schedule the clients share (client c
    /// of C sends the c-th, (c+C)-th, ... request of it). A request's latency counts from its
    /// time on the schedule, so a client still waiting for an earlier answer counts its lateness
    /// against the server (as oha's `--latency-correction`). None: a closed loop.
    pub rate: Option<f64>,
    /// Sent as `x-inferd-priority` with every request (None: no header).
    pub priority: Option<u8>,
    /// Every request on a new connection (`Connection: close`) rather than keep-alive.
    pub new_connection: bool,
}

/// One answered request: its latency, the server's times from Server-Timing (`prepare`:
/// tokenising; `model`: waiting for the model, running it and handing the answer back; of it,
/// `queue` and `compute`), and which body it sent.
pub struct Sample {
    /// When it was sent (or due, in an open loop).
    pub sent: Instant,
    pub latency: Duration,
    pub prepare_ms: Option<f64>,
    pub model_ms: Option<f64>,
    pub queue_ms: Option<f64>,
    pub compute_ms: Option<f64>,
    pub body: usize,
}

pub struct Outcome {
    pub samples: Vec<Sample>,
    /// Requests answered with another status than 200, or not at all.
    pub errors: usize,
    /// Measured seconds.
    pub elapsed: f64,
}

/// Requests per second and latency percentiles (ms) of a set of samples.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub throughput: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    /// The slowest request: a stall that few requests meet stays below the p99.
    pub max_ms: f64,
    pub requests: usize,
}

impl Summary {
    /// `rows`: sequences per sample, so throughput counts sequences.
    pub fn of(mut latencies: Vec<Duration>, seconds: f64, rows: usize) -> Summary {
        latencies.sort();
        let pct = |p: f64| -> f64 {
            if latencies.is_empty() {
                return f64::NAN;
            }
            let i = ((latencies.len() as f64 - 1.0) * p).round() as usize;
            latencies[i].as_secs_f64() * 1e3
        };
        Summary {
            throughput: (latencies.len() * rows) as f64 / seconds,
            p50_ms: pct(0.5),
            p95_ms: pct(0.95),
            p99_ms: pct(0.99),
            max_ms: pct(1.0),
            requests: latencies.len(),
        }
    }
}

impl Outcome {
    pub fn summary(&self) -> Summary {
        Summary::of(self.samples.iter().map(|s| s.latency).collect(), self.elapsed, 1)
    }
}

/// Runs the load and returns every measured sample.
pub fn run(load: &Load) -> anyhow::Result<Outcome> {
    anyhow::ensure!(!load.bodies.is_empty(), "no request bodies");
    // Checked up front: a client that cannot connect would only count errors.
    Connection::open(load.addr.as_str()).with_context(|| format!("connect {}", load.addr))?;
    let bodies = Arc::new(load.bodies.clone());
    // Set once by this thread after the warm-up; clients only read it (Relaxed: a sample more
    // or less at the edges does not matter).
    let measuring = Arc::new(AtomicBool::new(false));
    let samples: Vec<_> = (0..load.concurrency).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
    let (schedule, senders) = (Instant::now(), load.concurrency as f64);
    // The bodies are one stream the clients take from in turn: each request sends the next
    // body of it, whichever client sends it (a stream of repeats, as bench/cache.sh sends, is
    // then seen once, in its order).
    let next = Arc::new(AtomicUsize::new(0));
    let clients = Clients::start(load.concurrency, |c| {
        let (addr, path, bodies, measuring) = (load.addr.clone(), load.path.clone(), bodies.clone(), measuring.clone());
        let samples = samples[c].clone();
        let (rate, priority, next) = (load.rate.filter(|r| *r > 0.0), load.priority, next.clone());
        let new_connection = load.new_connection;
        let (mut conn, mut sent) = (None, 0u64);
        move || {
            let body = next.fetch_add(1, Ordering::Relaxed) % bodies.len();
            let started = match rate {
                Some(rate) => {
                    let due = schedule + Duration::from_secs_f64((sent as f64 * senders + c as f64) / rate);
                    sent += 1;
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    due
                }
                None => Instant::now(),
            };
            let counted = measuring.load(Ordering::Relaxed);
            let answer = match conn.take() {
                Some(c) => Ok(c),
                None => Connection::open(addr.as_str()),
            }
            .and_then(|mut c| {
                let priority = priority.map(|p| p.to_string());
                let mut headers = vec![("Content-Type", "application/json")];
                if let Some(p) = &priority {
                    headers.push(("x-inferd-priority", p.as_str()));
                }
                if new_connection {
                    headers.push(("Connection", "close"));
                }
                c.send("POST", &path, &headers, &bodies[body]).map(|a| (c, a))
            });
            match answer {
                Ok((c, answer)) if answer.status == 200 => {
                    if counted {
                        let latency = started.elapsed();
                        let timing = |metric| answer.server_timing(metric);
                        samples.lock().unwrap().push(Sample {
                            sent: started,
                            latency,
                            prepare_ms: timing("prepare"),
                            model_ms: timing("model"),
                            queue_ms: timing("queue"),
                            compute_ms: timing("compute"),
                            body,
                        });
                    }
                    // A close the server announced is not an error: the next request reconnects.
                    conn = (!answer.closes()).then_some(c);
                    Step::Skipped
                }
                Ok((_, answer)) if counted => Step::Failed(format!("status {}", answer.status)),
                Err(e) if counted => Step::Failed(e.to_string()),
                _ => Step::Skipped,
            }
        }
    });
    std::thread::sleep(load.warmup);
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(load.seconds));
    let tally = clients.stop();
    let elapsed = started.elapsed().as_secs_f64();
    let samples = samples.into_iter().flat_map(|s| std::mem::take(&mut *s.lock().unwrap())).collect();
    Ok(Outcome { samples, errors: tally.failed.len(), elapsed })
}
