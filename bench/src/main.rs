//! `inferd-bench`: the measuring side of inferd's benchmarks.
//!
//! - `http`: closed-loop clients ([`inferd_bench::load`]), one keep-alive connection each,
//!   POSTing the same bodies in turn for a fixed time; prints throughput, latency percentiles
//!   and, from the `Server-Timing` header, the share of each request spent preparing inputs.
//! - `grpc`: the same closed loop over KServe v2 gRPC (ModelInfer with the text as a raw BYTES
//!   tensor, as tritonclient.grpc sends it), one HTTP/2 connection per client;
//! - `ort`: the ceiling without any server: P threads, each with its own session of the same
//!   model (1 intra-op thread each, the same settings inferd uses), running the same inputs
//!   through the same tokenizer and pooling code, for a fixed time; or, with `--rate`, an
//!   open loop through one perfect queue;
//! - `floor`: the same sessions behind the thinnest HTTP server (one queue, nothing else),
//!   for `http` to load: the reference for what a full server adds to the model.
//!
//! `http`, `grpc` and `ort` print one JSON line (for scripts) after a human-readable line.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use inferd_bench::load::{run, Load, Sample, Summary};
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
        /// The request body: JSON in which each string "{text}" is replaced by a text, the
        /// request's own and the ones after it for further occurrences (a template with 16
        /// embeds 16 texts a request).
        #[arg(long, default_value = r#"{"inputs": "{text}"}"#)]
        body: String,
        /// Also report, on a line of its own, the requests whose text is shorter than this many
        /// bytes (how short texts fare in a mixed stream).
        #[arg(long)]
        short_below: Option<usize>,
        /// An open loop: this many requests per second in all, on a fixed schedule shared by
        /// the clients, latency counted from each request's time on it (as oha's `-q` with
        /// `--latency-correction`); without it, a closed loop.
        #[arg(long)]
        rate: Option<f64>,
        /// Every request's priority (`x-inferd-priority`: 0 the highest).
        #[arg(long)]
        priority: Option<u8>,
        /// Every request on a new connection (`Connection: close`), not keep-alive.
        #[arg(long)]
        new_connection: bool,
        /// Write every answered request to this file: when it was sent (Unix time, ms) and
        /// its latency (ms), one per line (bench/upgrade.sh cuts the run into periods).
        #[arg(long)]
        timeline: Option<PathBuf>,
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
        #[command(flatten)]
        sessions: Sessions,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        #[arg(long)]
        texts: PathBuf,
        /// An open loop: this many texts per second in all, on a fixed schedule. The sessions
        /// take them from one queue, each run taking every text due (up to --batch), and a
        /// text's latency counts from its time on the schedule: what a server with a perfect
        /// queue and no HTTP, JSON or client would show.
        #[arg(long)]
        rate: Option<f64>,
    },
    /// Writes generated models (`m00`.., [`inferd_bench::models`]) into a repository folder.
    Models {
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        set: ModelSet,
    },
    /// Zipf-distributed traffic over generated models (as `models` wrote them, the same
    /// arguments), every answer checked against its model's reference; prints the hit ratio
    /// (requests that did not wait for a load), latency of cold and warm requests, and the
    /// pool's PSS sampled every 100 ms (with --pool-pid: the supervisor's).
    Trace {
        #[arg(long)]
        addr: String,
        #[command(flatten)]
        set: ModelSet,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// The Zipf exponent.
        #[arg(long, default_value_t = 1.0)]
        zipf: f64,
        #[arg(long)]
        pool_pid: Option<u32>,
    },
    /// The same sessions behind the thinnest HTTP server: `POST /embed` with `{"inputs":
    /// "text"}` answers `[[...]]`; one thread for all connections (hyper, HTTP/1.1), one
    /// queue that every session takes from (up to --batch texts a run), nothing else: what
    /// `http` measures against it is what any HTTP server of these sessions pays on these
    /// cores, and a full server is compared with it. Serves until killed.
    Floor {
        #[command(flatten)]
        sessions: Sessions,
        #[arg(long, default_value = "127.0.0.1:18090")]
        listen: String,
    },
}

/// The generated models of `models` and `trace` ([`inferd_bench::models::set`]).
#[derive(Args)]
struct ModelSet {
    #[arg(long, default_value_t = 60)]
    count: usize,
    #[arg(long, default_value_t = 5)]
    min_mib: usize,
    #[arg(long, default_value_t = 30)]
    max_mib: usize,
}

/// The sessions of `ort` and `floor`: P threads, each with its own session of the model.
#[derive(Args)]
struct Sessions {
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
    /// Texts per run (one ORT call on the padded batch; at most this many with a queue).
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
        Command::Models { out, set } => {
            inferd_bench::models::generate(&out, set.count, set.min_mib, set.max_mib)?;
            Ok(())
        }
        Command::Trace { addr, set, concurrency, seconds, zipf, pool_pid } => {
            trace(&addr, &set, concurrency, seconds, zipf, pool_pid)
        }
        Command::Http { clients, path, body, short_below, rate, priority, new_connection, timeline } => {
            let texts = read_texts(&clients.texts)?;
            let bodies = bodies(&body, &texts)?;
            http(&clients, (&path, bodies), short_below, (rate, priority, new_connection), &texts, timeline.as_deref())
        }
        Command::Grpc { clients, model } => {
            let texts = read_texts(&clients.texts)?;
            grpc(&clients, &model, &texts)
        }
        Command::Ort { sessions, seconds, texts, rate } => {
            ort(sessions, seconds, rate.filter(|r| *r > 0.0), &read_texts(&texts)?)
        }
        Command::Floor { sessions, listen } => floor(sessions, &listen),
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

/// One body per text (`--body`): the template with its `"{text}"` strings replaced by that
/// text and the ones after it.
fn bodies(template: &str, texts: &[String]) -> anyhow::Result<Vec<Vec<u8>>> {
    let template: serde_json::Value = serde_json::from_str(template).context("--body is not JSON")?;
    fn fill(value: &mut serde_json::Value, next: &mut dyn FnMut() -> String) {
        match value {
            serde_json::Value::String(s) if s == "{text}" => *s = next(),
            serde_json::Value::Array(items) => items.iter_mut().for_each(|v| fill(v, next)),
            serde_json::Value::Object(fields) => fields.values_mut().for_each(|v| fill(v, next)),
            _ => {}
        }
    }
    (0..texts.len())
        .map(|first| {
            let mut body = template.clone();
            let mut at = first;
            fill(&mut body, &mut || {
                let text = texts[at % texts.len()].clone();
                at += 1;
                text
            });
            Ok(serde_json::to_vec(&body)?)
        })
        .collect()
}

fn http(
    load: &Clients,
    (path, bodies): (&str, Vec<Vec<u8>>),
    short_below: Option<usize>,
    (rate, priority, new_connection): (Option<f64>, Option<u8>, bool),
    texts: &[String],
    timeline: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let outcome = run(&Load {
        addr: load.addr.clone(),
        path: path.to_string(),
        bodies,
        concurrency: load.concurrency,
        seconds: load.seconds,
        warmup: Duration::from_secs_f64(load.warmup),
        rate,
        priority,
        new_connection,
    })?;
    let samples = &outcome.samples;
    if let Some(file) = timeline {
        let (now, wall) = (std::time::Instant::now(), std::time::SystemTime::now());
        let mut lines = String::new();
        for s in samples {
            let sent = wall - now.duration_since(s.sent);
            let ms = sent.duration_since(std::time::UNIX_EPOCH)?.as_secs_f64() * 1e3;
            lines.push_str(&format!("{ms:.1} {:.3}\n", s.latency.as_secs_f64() * 1e3));
        }
        std::fs::write(file, lines).with_context(|| format!("write {}", file.display()))?;
    }
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
    // The slowest 1%: where the server says their time went.
    let tail: Vec<_> = samples.iter().filter(|s| s.latency.as_secs_f64() * 1e3 >= summary.p99_ms).collect();
    let tail_mean = |f: fn(&Sample) -> Option<f64>| mean(tail.iter().filter_map(|s| f(s)).collect());
    let tail_latency = tail_mean(|s| Some(s.latency.as_secs_f64() * 1e3));
    let (tail_model, tail_prepare) = (tail_mean(|s| s.model_ms), tail_mean(|s| s.prepare_ms));
    if let (Some(l), Some(m), Some(p)) = (tail_latency, tail_model, tail_prepare) {
        // A server without the engine's split (an older inferd) gives only `model`.
        let split = match (tail_mean(|s| s.queue_ms), tail_mean(|s| s.compute_ms)) {
            (Some(q), Some(c)) => {
                format!(": waiting for a lane {q:.2}, the run {c:.2}, the answer's way back {:.2}", m - q - c)
            }
            _ => String::new(),
        };
        println!(
            "{label}: the slowest 1% ({} requests) took {l:.2} ms on average: the model {m:.2} ms{split}; \
             tokenising {p:.2} ms; the rest (HTTP, JSON, waiting for a thread, the client) {:.2} ms",
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

/// One session of an embedding model and the pipeline around it: tokenising, the run and
/// pooling, as a worker does them.
struct Embedder {
    model: ModelSession,
    pipeline: Arc<Pipeline>,
}

impl Sessions {
    /// The ORT environment and the model's entry, int8 prepared into the cache if asked.
    fn runtime(&self) -> anyhow::Result<(Arc<Runtime>, ModelEntry)> {
        let folder = std::path::absolute(&self.model)?;
        let name = folder.file_name().context("model folder")?.to_string_lossy().to_string();
        let mut entry = ModelEntry::load(folder.parent().context("model folder")?, &name)?;
        std::env::set_var("TOKENIZERS_PARALLELISM", "false");
        // The defaults a worker has (runtime.allocator); int8 is prepared into the server's cache.
        let cache = (self.precision != Precision::Fp32).then(|| std::path::absolute(&self.cache_dir)).transpose()?;
        entry.precision = self.precision;
        Ok((Arc::new(Runtime::init(&self.ort_library, Default::default(), cache)?), entry))
    }

    fn threads(&self) -> Threads {
        let Sessions { threads, spin, block_base, pool_cpu, .. } = *self;
        if threads > 1 {
            Threads::Wide { threads, spin, block_base, pool_cpu }
        } else {
            Threads::Narrow
        }
    }

    fn label(&self) -> String {
        let Sessions { parallel, threads, batch, spin, block_base, pool_cpu, .. } = self;
        format!(
            "parallel={parallel} threads={threads} batch={batch} spin={spin} block_base={block_base} pool_cpu={pool_cpu:?} precision={}",
            self.precision.as_str()
        )
    }
}

impl Embedder {
    /// Loads a session and warms it with 20 runs of `batch` texts.
    fn load(
        runtime: &Runtime,
        entry: &ModelEntry,
        threads: Threads,
        warm: &[String],
        batch: usize,
    ) -> anyhow::Result<Self> {
        let (served, model) = inferd_worker::load::one(runtime, entry, threads, &Default::default())?;
        let pipeline = served.pipeline;
        let Pipeline::Text(text) = &*pipeline else { bail!("this mode needs a text model") };
        let Head::Embedding { .. } = text.head else { bail!("this mode needs an embedding model") };
        let mut embedder = Embedder { model, pipeline };
        for i in 0..20 {
            let texts: Vec<String> = (0..batch).map(|b| warm[(i * batch + b) % warm.len()].clone()).collect();
            embedder.embed(&texts)?;
        }
        Ok(embedder)
    }

    /// One run of these texts: their embeddings.
    fn embed(&mut self, texts: &[String]) -> anyhow::Result<Vec<Vec<f32>>> {
        let Pipeline::Text(text) = &*self.pipeline else { unreachable!("checked at load") };
        let Head::Embedding { output, settings, dense } = &text.head else { unreachable!("checked at load") };
        let rows: Vec<Text> = texts.iter().cloned().map(Text::Single).collect();
        let encoded = text.encode(&rows, None)?;
        let outputs = self.model.run(encoded.inputs, None)?;
        Ok(embeddings(&outputs[*output], &encoded.lengths, (settings.pooling, dense), settings.normalize)?)
    }
}

fn ort(setup: Sessions, seconds: f64, rate: Option<f64>, texts: &[String]) -> anyhow::Result<()> {
    let (runtime, entry) = setup.runtime()?;
    let (parallel, batch, threads) = (setup.parallel, setup.batch.max(1), setup.threads());
    let stop = Arc::new(AtomicBool::new(false));
    // Every thread loads and warms its session, then all start measuring together.
    let start = Arc::new(std::sync::Barrier::new(parallel + 1));
    // The open loop's schedule: the next text not yet taken, and when text 0 was due (when
    // the first session is through the start, once all are warm).
    let schedule = Arc::new((std::sync::Mutex::new(0u64), std::sync::OnceLock::<Instant>::new()));
    let sessions: Vec<_> = (0..parallel)
        .map(|p| {
            let (entry, stop, texts, start) = (entry.clone(), stop.clone(), texts.to_vec(), start.clone());
            let (runtime, schedule) = (runtime.clone(), schedule.clone());
            std::thread::spawn(move || -> anyhow::Result<Vec<Duration>> {
                let loaded = Embedder::load(&runtime, &entry, threads, &texts, batch);
                start.wait(); // also on failure: never leave the others waiting
                let mut embedder = loaded?;
                let mut run = |first: usize, rows: usize| {
                    let batch: Vec<String> = (first..first + rows).map(|i| texts[i % texts.len()].clone()).collect();
                    embedder.embed(&batch)
                };
                let mut latencies = Vec::new();
                let Some(rate) = rate else {
                    let mut i = p;
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        run(i * batch, batch)?;
                        latencies.push(started.elapsed());
                        i += 1;
                    }
                    return Ok(latencies);
                };
                let (next, zero) = &*schedule;
                let zero = *zero.get_or_init(Instant::now);
                let due = |n: u64| zero + Duration::from_secs_f64(n as f64 / rate);
                while !stop.load(Ordering::Relaxed) {
                    // Take every text due, up to a batch; or wait for the next one.
                    let taken = {
                        let mut next = next.lock().map_err(|_| anyhow::anyhow!("a session panicked"))?;
                        let now = Instant::now();
                        let mut k = 0;
                        while k < batch as u64 && due(*next + k) <= now {
                            k += 1;
                        }
                        *next += k;
                        (k > 0).then(|| (*next - k, k)).ok_or(due(*next) - now)
                    };
                    match taken {
                        Ok((first, k)) => {
                            run(first as usize, k as usize)?;
                            let done = Instant::now();
                            latencies.extend((first..first + k).map(|n| done - due(n)));
                        }
                        Err(wait) => std::thread::sleep(wait),
                    }
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
    let open = rate.map_or(String::new(), |r| format!(" open loop at {r} texts/s"));
    let label = format!("ort tokenize+run+pool {}{open}", setup.label());
    // Closed, each latency is a run of `batch` texts; open, each is one text's.
    report(&label, Summary::of(all, elapsed, if rate.is_some() { 1 } else { batch }), 0, None);
    Ok(())
}

/// A text waiting for a session, and where its embedding goes.
type Queued = (String, tokio::sync::oneshot::Sender<Vec<f32>>);

fn floor(setup: Sessions, listen: &str) -> anyhow::Result<()> {
    use http_body_util::{BodyExt, Full, Limited};
    use hyper::body::Bytes;

    let (runtime, entry) = setup.runtime()?;
    let (batch, threads) = (setup.batch.max(1), setup.threads());
    let queue =
        Arc::new((std::sync::Mutex::new(std::collections::VecDeque::<Queued>::new()), std::sync::Condvar::new()));
    let warm = vec!["The quick brown fox jumps over the lazy dog.".to_string()];
    let (ready, loaded) = std::sync::mpsc::channel();
    for _ in 0..setup.parallel {
        let (runtime, entry, queue, warm, ready) =
            (runtime.clone(), entry.clone(), queue.clone(), warm.clone(), ready.clone());
        std::thread::spawn(move || {
            let mut embedder = match Embedder::load(&runtime, &entry, threads, &warm, batch) {
                Ok(e) => e,
                Err(e) => return ready.send(Err(e)).unwrap_or(()),
            };
            let _ = ready.send(Ok(()));
            let (waiting, wake) = &*queue;
            loop {
                let taken: Vec<Queued> = {
                    let Ok(mut waiting) = wake.wait_while(waiting.lock().expect("queue"), |w| w.is_empty()) else {
                        return;
                    };
                    let k = waiting.len().min(batch);
                    waiting.drain(..k).collect()
                };
                let (texts, replies): (Vec<_>, Vec<_>) = taken.into_iter().unzip();
                match embedder.embed(&texts) {
                    Ok(rows) => rows.into_iter().zip(replies).for_each(|(row, reply)| drop(reply.send(row))),
                    // One bad text (empty, too long) fails the batch: each runs alone, and the
                    // reply of one that fails again drops (500).
                    Err(_) => {
                        for (text, reply) in texts.into_iter().zip(replies) {
                            if let Some(row) =
                                embedder.embed(std::slice::from_ref(&text)).ok().and_then(|mut r| r.pop())
                            {
                                let _ = reply.send(row);
                            }
                        }
                    }
                }
            }
        });
    }
    drop(ready);
    for _ in 0..setup.parallel {
        loaded.recv().context("a session thread ended")??;
    }
    let io = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    io.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("listen on {listen}"))?;
        println!("floor: {} sessions ({}) serving POST /embed on {listen}", setup.parallel, setup.label());
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let queue = queue.clone();
            let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let queue = queue.clone();
                async move {
                    let answer = |status: u16, body: Vec<u8>| {
                        hyper::Response::builder().status(status).body(Full::new(Bytes::from(body)))
                    };
                    let Ok(body) = Limited::new(request.into_body(), 1 << 20).collect().await else {
                        return answer(400, b"unreadable body".to_vec());
                    };
                    let parsed = serde_json::from_slice::<serde_json::Value>(&body.to_bytes());
                    let Some(text) = parsed.ok().and_then(|v| v.get("inputs")?.as_str().map(String::from)) else {
                        return answer(400, b"expected {\"inputs\": \"text\"}".to_vec());
                    };
                    let (reply, embedding) = tokio::sync::oneshot::channel();
                    let (waiting, wake) = &*queue;
                    waiting.lock().expect("queue").push_back((text, reply));
                    wake.notify_one();
                    match embedding.await {
                        Ok(row) => answer(200, serde_json::to_vec(&[row]).unwrap_or_default()),
                        Err(_) => answer(500, b"the run failed".to_vec()),
                    }
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    })
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

/// `trace`: see [`Command::Trace`].
fn trace(
    addr: &str,
    set: &ModelSet,
    concurrency: usize,
    seconds: f64,
    zipf: f64,
    pool_pid: Option<u32>,
) -> anyhow::Result<()> {
    use inferd_bench::models::{trace, tree_pss, Outcome};
    let addr = std::net::ToSocketAddrs::to_socket_addrs(addr)?.next().context("no address")?;
    let models = inferd_bench::models::set(set.count, set.min_mib, set.max_mib);
    let running = Arc::new(AtomicBool::new(true));
    let sampler = pool_pid.map(|pid| {
        let running = running.clone();
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while running.load(Ordering::Relaxed) {
                samples.push(tree_pss(pid));
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        })
    });
    let sent = trace(addr, &models, concurrency, seconds, zipf);
    running.store(false, Ordering::Relaxed);
    let pss = sampler.map(|s| s.join().unwrap_or_default()).unwrap_or_default();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let percentile = |mut v: Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN)
    };
    let answered: Vec<_> = sent.iter().filter(|s| s.outcome == Outcome::Answered).collect();
    let cold: Vec<f64> = answered.iter().filter(|s| s.load.is_some()).map(|s| ms(&s.latency)).collect();
    let warm: Vec<f64> = answered.iter().filter(|s| s.load.is_none()).map(|s| ms(&s.latency)).collect();
    let busy: Vec<f64> = sent.iter().filter(|s| s.outcome == Outcome::Busy).map(|s| ms(&s.latency)).collect();
    let all: Vec<f64> = answered.iter().map(|s| ms(&s.latency)).collect();
    let failed: Vec<&String> = sent
        .iter()
        .filter_map(|s| match &s.outcome {
            Outcome::Failed(why) => Some(why),
            _ => None,
        })
        .collect();
    let mib = |b: u64| (b >> 20) as f64;
    let summary = serde_json::json!({
        "requests": sent.len(),
        "answered": answered.len(),
        "busy_503": busy.len(),
        "busy_p99_ms": percentile(busy, 0.99),
        "p50_ms": percentile(all.clone(), 0.5),
        "p99_ms": percentile(all, 0.99),
        "failed": failed.len(),
        "first_failure": failed.first(),
        "hit_ratio": warm.len() as f64 / answered.len().max(1) as f64,
        "cold_requests": cold.len(),
        "cold_p50_ms": percentile(cold.clone(), 0.5),
        "cold_p99_ms": percentile(cold, 0.99),
        "warm_p50_ms": percentile(warm.clone(), 0.5),
        "warm_p99_ms": percentile(warm, 0.99),
        "pss_peak_mib": pss.iter().copied().max().map(mib),
        "pss_mean_mib": (!pss.is_empty()).then(|| mib(pss.iter().sum::<u64>() / pss.len() as u64)),
        "pss_start_mib": pss.first().copied().map(mib),
    });
    println!("{summary}");
    Ok(())
}
