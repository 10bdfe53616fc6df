//! `inferd-bench`: the measuring side of inferd's benchmarks.
//!
//! - `http`: closed-loop clients, one keep-alive connection each, POSTing the same bodies in
//!   turn for a fixed time; prints throughput, latency percentiles and, from the
//!   `Server-Timing` header, the share of each request spent preparing inputs (tokenising).
//! - `ort`: the ceiling without any server: P threads, each with its own session of the same
//!   model (1 intra-op thread each, the same settings inferd uses), running the same inputs
//!   through the same tokenizer and pooling code, for a fixed time.
//!
//! Both print one JSON line (for scripts) after a human-readable line.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use inferd_config::model::ModelEntry;
use inferd_worker::model::{init_runtime, Model};
use inferd_worker::pipeline::{embeddings, Head, Pipeline, Text};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load an inferd endpoint.
    Http {
        /// host:port
        #[arg(long)]
        addr: String,
        #[arg(long, default_value = "/embed")]
        path: String,
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Texts, one per line; each request embeds one, in turn.
        #[arg(long)]
        texts: PathBuf,
        /// Requests sent before measuring, per client.
        #[arg(long, default_value_t = 20)]
        warmup: usize,
        /// Also report, on a line of its own, the requests whose text is shorter than this many
        /// bytes (how short texts fare in a mixed stream).
        #[arg(long)]
        short_below: Option<usize>,
    },
    /// The same texts through the same model with no server in between.
    Ort {
        /// Model folder (with model.toml), e.g. models/minilm.
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        ort_library: PathBuf,
        /// Threads, each with its own session.
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// ORT intra-op threads, in one pool the sessions share (as in an inferd worker).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Texts per run (one ORT call on the padded batch).
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Let ORT's pool threads spin between parallel sections (server.intra_op_spinning).
        #[arg(long)]
        spin: bool,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        #[arg(long)]
        texts: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Http { addr, path, concurrency, seconds, texts, warmup, short_below } => {
            let load = HttpLoad { addr, path, concurrency, seconds, warmup, short_below };
            http(&load, &read_texts(&texts)?)
        }
        Command::Ort { model, ort_library, parallel, threads, batch, spin, seconds, texts } => {
            let setup = OrtSetup { parallel, threads, batch: batch.max(1), spin };
            ort(&model, &ort_library, setup, seconds, &read_texts(&texts)?)
        }
    }
}

fn read_texts(path: &PathBuf) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let lines: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(String::from).collect();
    if lines.is_empty() {
        bail!("{} has no texts", path.display());
    }
    Ok(lines)
}

/// One sample: client-side latency, the server's `prepare` time, and which text it sent.
struct Sample {
    latency: Duration,
    prepare_ms: Option<f64>,
    text: usize,
}

struct HttpLoad {
    addr: String,
    path: String,
    concurrency: usize,
    seconds: f64,
    warmup: usize,
    short_below: Option<usize>,
}

fn http(load: &HttpLoad, texts: &[String]) -> anyhow::Result<()> {
    let HttpLoad { addr, path, concurrency, seconds, warmup, short_below } = load;
    let (concurrency, seconds, warmup) = (*concurrency, *seconds, *warmup);
    let bodies: Arc<Vec<Vec<u8>>> =
        Arc::new(texts.iter().map(|t| serde_json::to_vec(&serde_json::json!({ "inputs": t })).unwrap()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..concurrency)
        .map(|c| {
            let (addr, path, bodies, stop, measuring) =
                (addr.to_string(), path.to_string(), bodies.clone(), stop.clone(), measuring.clone());
            std::thread::spawn(move || -> anyhow::Result<(Vec<Sample>, usize)> {
                let mut conn = Connection::open(&addr)?;
                let (mut samples, mut errors, mut i) = (Vec::new(), 0, c);
                let mut warm = 0;
                while !stop.load(Ordering::Relaxed) {
                    let text = i % bodies.len();
                    i += 1;
                    let started = Instant::now();
                    match conn.post(&addr, &path, &bodies[text]) {
                        Ok((200, timing)) if measuring.load(Ordering::Relaxed) && warm >= warmup => {
                            samples.push(Sample { latency: started.elapsed(), prepare_ms: timing, text })
                        }
                        Ok((200, _)) => warm += 1,
                        Ok(_) | Err(_) => {
                            errors += 1;
                            conn = Connection::open(&addr)?;
                        }
                    }
                }
                Ok((samples, errors))
            })
        })
        .collect();
    // Let every client finish its warm-up before the clock starts.
    std::thread::sleep(Duration::from_secs(2));
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let (mut samples, mut errors) = (Vec::new(), 0);
    for c in clients {
        let (s, e) = c.join().expect("client thread")?;
        samples.extend(s);
        errors += e;
    }
    let prepare: Vec<f64> = samples.iter().filter_map(|s| s.prepare_ms).collect();
    let mean_latency = samples.iter().map(|s| s.latency.as_secs_f64() * 1e3).sum::<f64>() / samples.len().max(1) as f64;
    let prepare_share =
        if prepare.is_empty() { None } else { Some(prepare.iter().sum::<f64>() / prepare.len() as f64 / mean_latency) };
    report(
        &format!("http {path} c={concurrency}"),
        samples.iter().map(|s| s.latency).collect(),
        elapsed,
        1,
        errors,
        prepare_share,
    );
    if let Some(limit) = short_below {
        let short: Vec<Duration> = samples.iter().filter(|s| texts[s.text].len() < *limit).map(|s| s.latency).collect();
        report(&format!("http {path} c={concurrency} texts under {limit} bytes"), short, elapsed, 1, 0, None);
    }
    Ok(())
}

struct OrtSetup {
    parallel: usize,
    threads: usize,
    batch: usize,
    spin: bool,
}

fn ort(model: &Path, library: &Path, setup: OrtSetup, seconds: f64, texts: &[String]) -> anyhow::Result<()> {
    let OrtSetup { parallel, threads, batch, spin } = setup;
    let folder = std::path::absolute(model)?;
    let name = folder.file_name().context("model folder")?.to_string_lossy().to_string();
    let entry = ModelEntry::load(folder.parent().context("model folder")?, &name)?;
    std::env::set_var("TOKENIZERS_PARALLELISM", "false");
    init_runtime(library, threads, spin)?;
    let stop = Arc::new(AtomicBool::new(false));
    // Every thread loads and warms its session, then all start measuring together.
    let start = Arc::new(std::sync::Barrier::new(parallel + 1));
    let sessions: Vec<_> = (0..parallel)
        .map(|p| {
            let (entry, stop, texts, start) = (entry.clone(), stop.clone(), texts.to_vec(), start.clone());
            std::thread::spawn(move || -> anyhow::Result<Vec<Duration>> {
                let prepared = Model::load(&entry).map_err(anyhow::Error::from).and_then(|model| {
                    let pipeline = model.meta.pipeline.clone();
                    let Pipeline::Text(_) = &*pipeline else { bail!("ort mode needs a text model") };
                    Ok((model, pipeline))
                });
                let (mut model, pipeline) = match prepared {
                    Ok(p) => p,
                    Err(e) => {
                        start.wait(); // never leave the others waiting
                        return Err(e);
                    }
                };
                let Pipeline::Text(text) = &*pipeline else { unreachable!("checked above") };
                let Head::Embedding { output, pooling, normalize } = text.head.clone() else {
                    start.wait();
                    bail!("ort mode needs an embedding model")
                };
                let mut run = |i: usize| -> anyhow::Result<()> {
                    let rows: Vec<Text> =
                        (0..batch).map(|b| Text::Single(texts[(i * batch + b) % texts.len()].clone())).collect();
                    let encoded = text.encode(&rows, false)?;
                    let outputs = model.run(encoded.inputs)?;
                    embeddings(&outputs[output], &encoded.lengths, pooling, normalize)?;
                    Ok(())
                };
                let warmed = (0..20).try_for_each(&mut run);
                start.wait();
                warmed?;
                let mut latencies = Vec::new();
                let mut i = p;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    run(i)?;
                    latencies.push(started.elapsed());
                    i += 1;
                }
                Ok(latencies)
            })
        })
        .collect();
    start.wait();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for t in sessions {
        all.extend(t.join().expect("ort thread")?);
    }
    let label = format!("ort tokenize+run+pool parallel={parallel} threads={threads} batch={batch} spin={spin}");
    report(&label, all, elapsed, batch, 0, None);
    Ok(())
}

/// Prints one line for people and one JSON line for scripts. `rows`: sequences per sample, so
/// throughput is in sequences per second.
fn report(
    label: &str,
    mut latencies: Vec<Duration>,
    seconds: f64,
    rows: usize,
    errors: usize,
    prepare_share: Option<f64>,
) {
    latencies.sort();
    let pct = |p: f64| -> f64 {
        if latencies.is_empty() {
            return f64::NAN;
        }
        let i = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies[i].as_secs_f64() * 1e3
    };
    let throughput = (latencies.len() * rows) as f64 / seconds;
    println!(
        "{label}: {:.1} seq/s, p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, {} requests, {errors} errors{}",
        throughput,
        pct(0.5),
        pct(0.95),
        pct(0.99),
        latencies.len(),
        prepare_share.map_or(String::new(), |s| format!(", tokenising {:.1}% of a request", s * 100.0))
    );
    println!(
        "{}",
        serde_json::json!({"label": label, "throughput": throughput, "p50_ms": pct(0.5), "p95_ms": pct(0.95),
            "p99_ms": pct(0.99), "requests": latencies.len(), "errors": errors, "prepare_share": prepare_share})
    );
}

/// A keep-alive HTTP/1.1 connection: enough client for JSON POSTs with Content-Length replies.
struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(addr: &str) -> anyhow::Result<Connection> {
        let stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Connection { reader: BufReader::new(stream) })
    }

    /// Returns the status and the `prepare` duration from `Server-Timing`, if any.
    fn post(&mut self, addr: &str, path: &str, body: &[u8]) -> anyhow::Result<(u16, Option<f64>)> {
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
        let (mut length, mut prepare) = (0usize, None);
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
                prepare = v.split(',').find_map(|m| m.trim().strip_prefix("prepare;dur=")?.parse().ok());
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body)?;
        Ok((status, prepare))
    }
}
