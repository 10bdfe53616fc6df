//! A closed-loop HTTP load: C clients, each on its own keep-alive connection, POST the given
//! bodies in turn for a fixed time and record each answer's latency. Shared by `inferd-bench
//! http` and `inferd tune`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

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
}

/// One answered request: its latency, the server's `prepare` time (Server-Timing) and which
/// body it sent.
pub struct Sample {
    pub latency: Duration,
    pub prepare_ms: Option<f64>,
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
pub fn closed_loop(load: &Load) -> anyhow::Result<Outcome> {
    anyhow::ensure!(!load.bodies.is_empty(), "no request bodies");
    let bodies = Arc::new(load.bodies.clone());
    // Written once by this thread; clients only read them (Relaxed: a sample more or less at
    // the edges does not matter).
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..load.concurrency)
        .map(|c| {
            let (addr, path, bodies, stop, measuring) =
                (load.addr.clone(), load.path.clone(), bodies.clone(), stop.clone(), measuring.clone());
            std::thread::spawn(move || -> anyhow::Result<(Vec<Sample>, usize)> {
                let mut conn = Connection::open(&addr)?;
                let (mut samples, mut errors, mut i) = (Vec::new(), 0, c);
                while !stop.load(Ordering::Relaxed) {
                    let body = i % bodies.len();
                    i += 1;
                    let started = Instant::now();
                    let counted = measuring.load(Ordering::Relaxed);
                    match conn.post(&addr, &path, &bodies[body]) {
                        Ok(answer) if answer.status == 200 => {
                            if counted {
                                samples.push(Sample {
                                    latency: started.elapsed(),
                                    prepare_ms: answer.prepare_ms,
                                    body,
                                });
                            }
                            if answer.close {
                                conn = Connection::open(&addr)?; // announced: not an error
                            }
                        }
                        Ok(_) | Err(_) => {
                            errors += usize::from(counted);
                            conn = Connection::open(&addr)?;
                        }
                    }
                }
                Ok((samples, errors))
            })
        })
        .collect();
    std::thread::sleep(load.warmup);
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(load.seconds));
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let (mut samples, mut errors) = (Vec::new(), 0);
    for c in clients {
        let (s, e) = c.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        samples.extend(s);
        errors += e;
    }
    Ok(Outcome { samples, errors, elapsed })
}

/// What a POST got back.
pub struct Answer {
    pub status: u16,
    /// From `Server-Timing: prepare;dur=...`.
    pub prepare_ms: Option<f64>,
    /// The server announced `Connection: close`: the next request needs a new connection.
    pub close: bool,
}

/// A keep-alive HTTP/1.1 connection: enough client for POSTs with Content-Length replies.
pub struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    pub fn open(addr: &str) -> anyhow::Result<Connection> {
        let stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Connection { reader: BufReader::new(stream) })
    }

    pub fn post(&mut self, addr: &str, path: &str, body: &[u8]) -> anyhow::Result<Answer> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line.split(' ').nth(1).and_then(|s| s.parse().ok()).context("status line")?;
        let (mut length, mut prepare_ms, mut close) = (0usize, None, false);
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let Some((k, v)) = l.split_once(':') else { continue };
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse()?;
            } else if k.eq_ignore_ascii_case("server-timing") {
                prepare_ms = v.split(',').find_map(|m| m.trim().strip_prefix("prepare;dur=")?.parse().ok());
            } else if k.eq_ignore_ascii_case("connection") {
                close = v.trim().eq_ignore_ascii_case("close");
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body)?;
        Ok(Answer { status, prepare_ms, close })
    }
}
