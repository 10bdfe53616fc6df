//! `inferd-bench`: the measuring side of inferd's benchmarks.
//!
//! - `http`: closed-loop clients ([`inferd_bench::load`]), one keep-alive connection each,
//!   POSTing the same bodies in turn for a fixed time; prints throughput, latency percentiles
//!   and, from the `Server-Timing` header, the share of each request spent preparing inputs.
//! - `grpc`: the same closed loop over KServe v2 gRPC (ModelInfer with the text as a raw BYTES
//!   tensor, as tritonclient.grpc sends it), one HTTP/2 connection per client;
//! - `ort`: the ceiling without any server: P threads, each with its own session of the same
//!   model (1 intra-op thread each, the same settings inferd uses), running the same inputs
//!   through the same tokenizer and pooling code, for a fixed time.
//!
//! Both print one JSON line (for scripts) after a human-readable line.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use inferd_bench::load::{run, Load, Summary};
use inferd_config::model::{ModelEntry, Precision};
use inferd_worker::pipeline::{embeddings, Head, Pipeline, Text};
use inferd_worker::runtime::model::{ModelSession, Runtime, Threads};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load an inferd endpoint.
    Http {
        #[command(flatten)]
        clients: Clients,
        #[arg(long, default_value = "/embed")]
        path: String,
        /// Also report, on a line of its own, the requests whose text is shorter than this many
        /// bytes (how short texts fare in a mixed stream).
        #[arg(long)]
        short_below: Option<usize>,
        /// An open loop: this many requests per second in all, on a fixed schedule shared by
        /// the clients, latency counted from each request's time on it (as oha's `-q` with
        /// `--latency-correction`); without it, a closed loop.
        #[arg(long)]
        rate: Option<f64>,
    },
    /// Load an inferd gRPC port (server.grpc_listen) with ModelInfer of one text each.
    Grpc {
        #[command(flatten)]
        clients: Clients,
        #[arg(long, default_value = "minilm")]
        model: String,
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
        /// ORT intra-op threads per session: 1 = a narrow session, more = a wide one (its own
        /// pool, as in an inferd worker).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Texts per run (one ORT call on the padded batch).
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Let a wide session's pool threads spin between operators (server.intra_op_spinning).
        #[arg(long)]
        spin: bool,
        /// How finely a wide session splits its loops (server.intra_op_block_base; 0 = ORT's
        /// static split).
        #[arg(long, default_value_t = 4)]
        block_base: u32,
        /// Pin a wide session's pool threads to this CPU (as a worker that borrows a sibling's
        /// core does; run the benchmark itself pinned to another with `taskset`).
        #[arg(long)]
        pool_cpu: Option<usize>,
        /// fp32 (the file as it is) or int8 (inferd's int8 rewrite of it, prepared as a worker
        /// prepares it, its accuracy guard included, and kept in --cache-dir).
        #[arg(long, default_value = "fp32")]
        precision: Precision,
        /// Where int8 is prepared and found again (runtime.cache_dir of the server compared).
        #[arg(long, default_value = ".cache/inferd")]
        cache_dir: PathBuf,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        #[arg(long)]
        texts: PathBuf,
    },
}

/// The closed-loop clients of `http` and `grpc`.
#[derive(Args)]
struct Clients {
    /// host:port
    #[arg(long)]
    addr: String,
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Texts, one per line; each request embeds one, in turn.
    #[arg(long)]
    texts: PathBuf,
    /// Seconds the clients run before measuring starts.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Http { clients, path, short_below, rate } => {
            let texts = read_texts(&clients.texts)?;
            http(&clients, &path, short_below, rate, &texts)
        }
        Command::Grpc { clients, model } => {
            let texts = read_texts(&clients.texts)?;
            grpc(&clients, &model, &texts)
        }
        Command::Ort {
            model,
            ort_library,
            parallel,
            threads,
            batch,
            spin,
            block_base,
            pool_cpu,
            precision,
            cache_dir,
            seconds,
            texts,
        } => {
            let batch = batch.max(1);
            let setup = OrtSetup { parallel, threads, batch, spin, block_base, pool_cpu, precision, cache_dir };
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

fn http(
    load: &Clients,
    path: &str,
    short_below: Option<usize>,
    rate: Option<f64>,
    texts: &[String],
) -> anyhow::Result<()> {
    let bodies =
        texts.iter().map(|t| serde_json::to_vec(&serde_json::json!({ "inputs": t }))).collect::<Result<_, _>>()?;
    let outcome = run(&Load {
        addr: load.addr.clone(),
        path: path.to_string(),
        bodies,
        concurrency: load.concurrency,
        seconds: load.seconds,
        warmup: Duration::from_secs_f64(load.warmup),
        rate,
    })?;
    let samples = &outcome.samples;
    // Where a request's time goes, from Server-Timing: tokenising, the model (queue and run),
    // and the rest (HTTP, JSON, the client), as shares of the mean latency.
    let mean = |values: Vec<f64>| (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
    let latency = mean(samples.iter().map(|s| s.latency.as_secs_f64() * 1e3).collect()).unwrap_or(f64::NAN);
    let prepare = mean(samples.iter().filter_map(|s| s.prepare_ms).collect());
    let model = mean(samples.iter().filter_map(|s| s.model_ms).collect());
    let shares = prepare.zip(model).map(|(p, m)| (p / latency, m / latency));
    let label = match rate {
        Some(rate) => format!("http {path} c={} open loop at {rate} req/s", load.concurrency),
        None => format!("http {path} c={}", load.concurrency),
    };
    let summary = outcome.summary();
    // The slowest 1%: how much of their time the server says was its model's (queue and run).
    let tail: Vec<_> = samples.iter().filter(|s| s.latency.as_secs_f64() * 1e3 >= summary.p99_ms).collect();
    let tail_latency = mean(tail.iter().map(|s| s.latency.as_secs_f64() * 1e3).collect());
    let tail_model = mean(tail.iter().filter_map(|s| s.model_ms).collect());
    let tail_prepare = mean(tail.iter().filter_map(|s| s.prepare_ms).collect());
    if let (Some(l), Some(m), Some(p)) = (tail_latency, tail_model, tail_prepare) {
        println!(
            "{label}: the slowest 1% ({} requests) took {l:.2} ms on average: the model (queue and run) {m:.2} ms, \
             tokenising {p:.2} ms, the rest (HTTP, JSON, waiting for a thread, the client) {:.2} ms",
            tail.len(),
            l - m - p
        );
    }
    report(&label, summary, outcome.errors, shares);
    if let Some(limit) = short_below {
        // The long texts first: bench/compare.sh reads the last line, the short ones.
        let long: Vec<_> = samples.iter().filter(|s| texts[s.body].len() >= limit).map(|s| s.latency).collect();
        if !long.is_empty() {
            report(&format!("{label} texts of {limit} bytes or more"), Summary::of(long, outcome.elapsed, 1), 0, None);
        }
        let short = samples.iter().filter(|s| texts[s.body].len() < limit).map(|s| s.latency).collect();
        report(&format!("{label} texts under {limit} bytes"), Summary::of(short, outcome.elapsed, 1), 0, None);
    }
    Ok(())
}

/// C clients, each on its own channel (one HTTP/2 connection), send ModelInfer in turn: the
/// load shape of `http`, over gRPC. All on one thread, as oha runs.
fn grpc(load: &Clients, model: &str, texts: &[String]) -> anyhow::Result<()> {
    use inferd_worker::http::grpc::proto::{
        grpc_inference_service_client::GrpcInferenceServiceClient, model_infer_request::InferInputTensor,
        ModelInferRequest,
    };
    let requests: Vec<ModelInferRequest> = texts
        .iter()
        .map(|t| ModelInferRequest {
            model_name: model.to_string(),
            inputs: vec![InferInputTensor {
                name: "text".into(),
                datatype: "BYTES".into(),
                shape: vec![1],
                ..Default::default()
            }],
            raw_input_contents: vec![[&(t.len() as u32).to_le_bytes()[..], t.as_bytes()].concat()],
            ..Default::default()
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (latencies, errors, elapsed) = runtime.block_on(async {
        let stop = Arc::new(AtomicBool::new(false));
        let measuring = Arc::new(AtomicBool::new(false));
        let mut clients = Vec::new();
        for c in 0..load.concurrency {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", load.addr))?
                .tcp_nodelay(true)
                .connect()
                .await
                .with_context(|| format!("connect {}", load.addr))?;
            let mut client = GrpcInferenceServiceClient::new(channel).max_decoding_message_size(64 << 20);
            let (requests, stop, measuring) = (requests.clone(), stop.clone(), measuring.clone());
            clients.push(tokio::spawn(async move {
                let (mut latencies, mut errors, mut i) = (Vec::new(), 0usize, c);
                while !stop.load(Ordering::Relaxed) {
                    let request = requests[i % requests.len()].clone();
                    i += 1;
                    let counted = measuring.load(Ordering::Relaxed);
                    let started = Instant::now();
                    match client.model_infer(request).await {
                        Ok(_) if counted => latencies.push(started.elapsed()),
                        Ok(_) => {}
                        Err(_) => errors += usize::from(counted),
                    }
                }
                (latencies, errors)
            }));
        }
        tokio::time::sleep(Duration::from_secs_f64(load.warmup)).await;
        measuring.store(true, Ordering::Relaxed);
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(load.seconds)).await;
        stop.store(true, Ordering::Relaxed);
        let elapsed = started.elapsed().as_secs_f64();
        let (mut latencies, mut errors) = (Vec::new(), 0);
        for c in clients {
            let (l, e) = c.await?;
            latencies.extend(l);
            errors += e;
        }
        anyhow::Ok((latencies, errors, elapsed))
    })?;
    let label = format!("grpc ModelInfer {model} c={}", load.concurrency);
    report(&label, Summary::of(latencies, elapsed, 1), errors, None);
    Ok(())
}

struct OrtSetup {
    parallel: usize,
    threads: usize,
    batch: usize,
    spin: bool,
    block_base: u32,
    pool_cpu: Option<usize>,
    precision: Precision,
    cache_dir: PathBuf,
}

fn ort(model: &Path, library: &Path, setup: OrtSetup, seconds: f64, texts: &[String]) -> anyhow::Result<()> {
    let OrtSetup { parallel, threads, batch, spin, block_base, pool_cpu, precision, cache_dir } = setup;
    let folder = std::path::absolute(model)?;
    let name = folder.file_name().context("model folder")?.to_string_lossy().to_string();
    let mut entry = ModelEntry::load(folder.parent().context("model folder")?, &name)?;
    std::env::set_var("TOKENIZERS_PARALLELISM", "false");
    // The defaults a worker has (runtime.allocator); int8 is prepared into the server's cache.
    let cache = (precision != Precision::Fp32).then(|| std::path::absolute(cache_dir)).transpose()?;
    entry.precision = precision;
    let runtime = Arc::new(Runtime::init(library, Default::default(), cache)?);
    let session_threads =
        if threads > 1 { Threads::Wide { threads, spin, block_base, pool_cpu } } else { Threads::Narrow };
    let stop = Arc::new(AtomicBool::new(false));
    // Every thread loads and warms its session, then all start measuring together.
    let start = Arc::new(std::sync::Barrier::new(parallel + 1));
    let sessions: Vec<_> = (0..parallel)
        .map(|p| {
            let (entry, stop, texts, start) = (entry.clone(), stop.clone(), texts.to_vec(), start.clone());
            let runtime = runtime.clone();
            std::thread::spawn(move || -> anyhow::Result<Vec<Duration>> {
                let prepared = ModelSession::load(&runtime, &entry, session_threads, None)
                    .map_err(anyhow::Error::from)
                    .and_then(|model| {
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
                let Head::Embedding { output, settings } = text.head.clone() else {
                    start.wait();
                    bail!("ort mode needs an embedding model")
                };
                let mut run = |i: usize| -> anyhow::Result<()> {
                    let rows: Vec<Text> =
                        (0..batch).map(|b| Text::Single(texts[(i * batch + b) % texts.len()].clone())).collect();
                    let encoded = text.encode(&rows, false)?;
                    let outputs = model.run(encoded.inputs, None)?;
                    embeddings(&outputs[output], &encoded.lengths, settings.pooling, settings.normalize)?;
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
    let label = format!(
        "ort tokenize+run+pool parallel={parallel} threads={threads} batch={batch} spin={spin} block_base={block_base} pool_cpu={pool_cpu:?} precision={}",
        precision.as_str()
    );
    report(&label, Summary::of(all, elapsed, batch), 0, None);
    Ok(())
}

/// Prints one line for people and one JSON line for scripts. `shares`: of tokenising and of
/// the model in a request's mean latency.
fn report(label: &str, s: Summary, errors: usize, shares: Option<(f64, f64)>) {
    println!(
        "{label}: {:.1} seq/s, p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, {} requests, {errors} errors{}",
        s.throughput,
        s.p50_ms,
        s.p95_ms,
        s.p99_ms,
        s.requests,
        shares.map_or(String::new(), |(p, m)| format!(
            ", of a request: tokenising {:.1}%, the model {:.1}%, the rest (HTTP, JSON, client) {:.1}%",
            p * 100.0,
            m * 100.0,
            (1.0 - p - m) * 100.0
        ))
    );
    println!(
        "{}",
        serde_json::json!({"label": label, "throughput": s.throughput, "p50_ms": s.p50_ms, "p95_ms": s.p95_ms,
            "p99_ms": s.p99_ms, "max_ms": s.max_ms, "requests": s.requests, "errors": errors,
            "prepare_share": shares.map(|s| s.0), "model_share": shares.map(|s| s.1)})
    );
}
