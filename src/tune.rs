//! `inferd tune`: measures, on this host, the plans a model can be served with (workers x
//! threads x batching) and picks the best for a goal; `--write` puts it into the files.
//!
//! Each candidate is a real `inferd serve` (this binary, the user's configuration, a free
//! loopback port, its own control socket and process group) loaded by the closed-loop client
//! of `inferd-bench` at a few concurrencies. Nothing is timed in-process: what is measured is
//! what clients would see, HTTP and JSON included.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use inferd_bench::http::request;
use inferd_bench::load::{self, Load, Summary};
use inferd_bench::process::Process;
use inferd_config::model::{ModelEntry, Precision, Task, MODEL_CONFIG_FILE};
use inferd_config::Config;
use inferd_supervisor::control::{self, Request};
use inferd_supervisor::plan::Resolved;

/// The sentence text models are loaded with (17 tokens for MiniLM's tokenizer).
const SENTENCE: &str = "The quick brown fox jumps over the lazy dog while the cat sleeps.";
const CONCURRENCIES: [usize; 3] = [1, 4, 16];

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    /// Lowest p50 of a lone request.
    Latency,
    /// Most requests per second at any of the concurrencies.
    Throughput,
    /// Most requests per second at a concurrency whose p99 stays under this many ms.
    P99Under(f64),
}

impl std::str::FromStr for Goal {
    type Err = String;
    fn from_str(s: &str) -> Result<Goal, String> {
        match s {
            "latency" => Ok(Goal::Latency),
            "throughput" => Ok(Goal::Throughput),
            _ => match s.strip_prefix("p99-under=").map(str::parse::<f64>) {
                Some(Ok(ms)) if ms > 0.0 && ms.is_finite() => Ok(Goal::P99Under(ms)),
                _ => Err(format!("'{s}': use latency, throughput or p99-under=MS")),
            },
        }
    }
}

pub struct Tune {
    pub config: Option<PathBuf>,
    pub model: Option<String>,
    pub goal: Goal,
    pub write: bool,
    /// Measured seconds per concurrency.
    pub seconds: f64,
    /// Image models: the encoded image each request carries (else [`generated_image`]).
    pub image: Option<PathBuf>,
    /// The accuracy bound int8 candidates are served under (over the model's [quantization]):
    /// a candidate whose guard refuses it fails, with the figures.
    pub min_cosine: Option<f64>,
    pub max_probability_error: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    workers: usize,
    threads: usize,
    max_batch_size: usize,
    max_queue_delay_ms: u64,
    precision: Precision,
}

impl Candidate {
    fn plan(&self) -> String {
        format!("{} x {}", self.workers, self.threads)
    }

    fn batching(&self) -> String {
        match (self.max_batch_size, self.max_queue_delay_ms) {
            (1, _) => "off".into(),
            (n, 0) => format!("up to {n}"),
            (n, d) => format!("up to {n}, wait {d} ms"),
        }
    }

    /// The plan, its batching and its precision, as the progress lines and the verdict say it.
    fn describe(&self) -> String {
        format!("{} threads, batching {}, {}", self.plan(), self.batching(), self.precision.as_str())
    }
}

struct Measured {
    candidate: Candidate,
    /// One summary per concurrency of [`CONCURRENCIES`]; empty when the server did not start.
    points: Vec<Summary>,
    errors: usize,
    rss_bytes: u64,
    /// What the server said it serves (`int8 (... min cosine ...)`, `fp32`).
    served: Option<String>,
    failure: Option<String>,
}

impl Measured {
    fn best_throughput(&self, p99_under: Option<f64>) -> Option<f64> {
        self.points.iter().filter(|p| p99_under.is_none_or(|ms| p.p99_ms <= ms)).map(|p| p.throughput).reduce(f64::max)
    }

    /// Higher is better; `None` when the candidate cannot meet the goal.
    fn score(&self, goal: Goal) -> Option<f64> {
        if self.failure.is_some() || self.errors > 0 {
            return None;
        }
        match goal {
            Goal::Latency => self.points.first().map(|p| -p.p50_ms),
            Goal::Throughput => self.best_throughput(None),
            Goal::P99Under(ms) => self.best_throughput(Some(ms)),
        }
    }
}

/// The plans worth trying on `usable` cores: 1, 2, 4, ... threads per worker (and all of them
/// in one worker), each with batching off, on, and on with a 2 ms wait, in fp32; with `int8`
/// (text models, whose int8 the accuracy guard can check), each split batched again in int8.
fn candidates(usable: usize, max_batch_size: usize, int8: bool) -> Vec<Candidate> {
    let mut threads: Vec<usize> =
        std::iter::successors(Some(1), |t| Some(t * 2)).take_while(|&t| t <= usable).collect();
    if !threads.contains(&usable) {
        threads.push(usable);
    }
    let batch = max_batch_size.max(2);
    let mut settings = vec![(1, 0, Precision::Fp32), (batch, 0, Precision::Fp32), (batch, 2, Precision::Fp32)];
    if int8 {
        settings.push((batch, 0, Precision::Int8));
    }
    threads
        .into_iter()
        .flat_map(|t| {
            settings.iter().map(move |&(max_batch_size, max_queue_delay_ms, precision)| Candidate {
                workers: usable / t,
                threads: t,
                max_batch_size,
                max_queue_delay_ms,
                precision,
            })
        })
        .collect()
}

pub fn run(args: Tune) -> anyhow::Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    let resolved = Resolved::new(config.clone())?;
    let name = args.model.clone().unwrap_or_else(|| config.models.default.clone());
    let entry =
        resolved.models.iter().find(|m| m.name == name).with_context(|| {
            format!("model '{name}' is not served by this configuration (models.default, models.load)")
        })?;
    let image = match (&entry.image, &args.image) {
        (Some(_), Some(path)) => Some(std::fs::read(path).with_context(|| format!("--image {}", path.display()))?),
        (Some(settings), None) => Some(generated_image(settings.width, settings.height)?),
        (None, Some(_)) => bail!("--image: model '{name}' takes no images"),
        (None, None) => None,
    };
    // A bound out of range is refused here, not by every int8 candidate.
    inferd_config::model::ModelOverride {
        min_cosine: args.min_cosine,
        max_probability_error: args.max_probability_error,
        ..Default::default()
    }
    .apply(entry.clone())?;
    if args.write && config.source.is_none() {
        bail!("--write needs a configuration file to write (--config)");
    }
    let usable = resolved.plan.budget.usable;
    // int8 is tried where its guard can run, with the model's own [quantization] bounds; one the
    // guard refuses is a failed candidate with the figures.
    let max_batch_size = entry.batching.max_batch_size.unwrap_or(inferd_config::model::DEFAULT_MAX_BATCH_SIZE);
    let grid = candidates(usable, max_batch_size, entry.tokenizer.is_some());
    let per_candidate = 1.5 + CONCURRENCIES.len() as f64 * (args.seconds + 0.5);
    eprintln!("tuning '{name}' on {usable} usable cores: {} candidates x ~{per_candidate:.0} s", grid.len());
    let work = std::env::temp_dir().join(format!("inferd-tune-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut results = Vec::new();
    for (i, candidate) in grid.iter().enumerate() {
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        if !terminal {
            eprintln!("[{}/{}] {}", i + 1, grid.len(), candidate.describe());
        }
        let progress = |step: &str| {
            if !terminal {
                return;
            }
            let done = (i * 20) / grid.len();
            eprint!(
                "\r[{}{}] {}/{} {}: {step:<24}",
                "#".repeat(done),
                " ".repeat(20 - done),
                i + 1,
                grid.len(),
                candidate.describe()
            );
            let _ = std::io::stderr().flush();
        };
        results.push(measure(&args, entry, image.as_deref(), *candidate, &work, progress));
    }
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("\r[{}] done{:60}", "#".repeat(20), "");
    }
    let _ = std::fs::remove_dir_all(&work);

    print_table(&results);
    let best = results
        .iter()
        .filter_map(|m| m.score(args.goal).map(|s| (s, m)))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, m)| m);
    let Some(best) = best else {
        println!("\nno candidate meets the goal {:?}", args.goal);
        return Ok(ExitCode::from(1));
    };
    let c = best.candidate;
    println!(
        "\nbest for {:?}: {} workers x {} threads, batching {}, {}",
        args.goal,
        c.workers,
        c.threads,
        c.batching(),
        c.precision.as_str()
    );
    if let Some(served) = best.served.as_ref().filter(|_| c.precision != Precision::Fp32) {
        println!("served as {served}");
    }
    if args.write {
        let config_path = config.source.as_deref().expect("checked above");
        // The bound int8 was chosen under is the one it is served under.
        let bounds = match c.precision {
            Precision::Fp32 => Vec::new(),
            _ => [("min_cosine", args.min_cosine), ("max_probability_error", args.max_probability_error)]
                .into_iter()
                .filter_map(|(key, bound)| Some((key, bound?.into())))
                .collect(),
        };
        let dir = config.model_repository().join(&name);
        // A published folder without model.toml gets the one it is served with, plus the plan.
        if let Some(text) = ModelEntry::inferred_toml(&dir, &name)? {
            std::fs::write(dir.join(MODEL_CONFIG_FILE), text)?;
        }
        write_plan(config_path, &dir.join(MODEL_CONFIG_FILE), c, &bounds)?;
    } else {
        println!(
            "(--write puts it into {} and the model's model.toml)",
            config.source.as_ref().map_or("the config".into(), |p| p.display().to_string())
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(results: &[Measured]) {
    let mut header = format!("\n{:<10} {:<20} {:<9}", "workers", "batching", "precision");
    for c in CONCURRENCIES {
        header.push_str(&format!(" {:>22}", format!("c={c} req/s (p50/p99)")));
    }
    println!("{header} {:>10} {:>7}", "RSS", "errors");
    for m in results {
        let mut line =
            format!("{:<10} {:<20} {:<9}", m.candidate.plan(), m.candidate.batching(), m.candidate.precision.as_str());
        if let Some(failure) = &m.failure {
            println!("{line} failed: {failure}");
            continue;
        }
        for p in &m.points {
            line.push_str(&format!(" {:>22}", format!("{:.0} ({:.1}/{:.1})", p.throughput, p.p50_ms, p.p99_ms)));
        }
        println!("{line} {:>6} MiB {:>7}", m.rss_bytes >> 20, m.errors);
    }
    // What the int8 guard measured, once per preparation (plans of one model share it).
    let mut guards: Vec<(Vec<String>, &str)> = Vec::new();
    for m in results.iter().filter(|m| m.candidate.precision != Precision::Fp32) {
        let Some(served) = m.served.as_deref() else { continue };
        match guards.iter_mut().find(|(_, s)| *s == served) {
            Some((plans, _)) => plans.push(m.candidate.plan()),
            None => guards.push((vec![m.candidate.plan()], served)),
        }
    }
    for (plans, served) in guards {
        println!("{} ({}): {served}", Precision::Int8.as_str(), plans.join(", "));
    }
}

/// Starts one candidate, loads it at each concurrency, reads its RSS, stops it.
fn measure(
    args: &Tune,
    entry: &ModelEntry,
    image: Option<&[u8]>,
    candidate: Candidate,
    work: &Path,
    progress: impl Fn(&str),
) -> Measured {
    let mut measured = Measured { candidate, points: Vec::new(), errors: 0, rss_bytes: 0, served: None, failure: None };
    progress("starting");
    let mut server = match Server::start(args, candidate, work) {
        Ok(s) => s,
        Err(e) => {
            measured.failure = Some(format!("{e:#}"));
            return measured;
        }
    };
    let outcome = (|| -> anyhow::Result<()> {
        server.wait_ready()?;
        let (path, body) = load_request(&server.addr, entry, image)?;
        for c in CONCURRENCIES {
            progress(&format!("load at c={c}"));
            let load = Load {
                addr: server.addr.clone(),
                path: path.clone(),
                bodies: vec![body.clone()],
                concurrency: c,
                seconds: args.seconds,
                warmup: Duration::from_millis(500),
                rate: None,
                priority: None,
                new_connection: false,
            };
            let outcome = load::run(&load)?;
            measured.errors += outcome.errors;
            measured.points.push(outcome.summary());
        }
        let status = control::query(&server.socket, &Request::Status, |_| {})?.status.context("no status")?;
        measured.rss_bytes = status.workers.iter().filter_map(|w| w.rss_bytes).sum();
        measured.served = status
            .workers
            .iter()
            .flat_map(|w| &w.models)
            .find(|m| m.name == entry.name)
            .map(|m| m.precision.to_string());
        Ok(())
    })();
    if let Err(e) = outcome {
        measured.failure = Some(format!("{e:#}; log: {}", server.log_tail()));
    }
    // SIGTERM: the supervisor drains its workers.
    server.process.stop(Duration::from_secs(10));
    measured
}

/// The request the model is loaded with: one sentence for text models, one image for image
/// models (a v2 BYTES tensor, which every task of theirs takes), zeros for tensor models.
fn load_request(addr: &str, entry: &ModelEntry, image: Option<&[u8]>) -> anyhow::Result<(String, Vec<u8>)> {
    use base64::Engine as _;
    let name = &entry.name;
    if let Some(image) = image {
        let meta = metadata(addr, name)?;
        // The pipeline's input (the encoded image), not the graph's pixel tensor.
        let input = &meta["pipeline"]["inputs"][0]["name"];
        anyhow::ensure!(input.is_string(), "model metadata without a pipeline input: {meta}");
        let data = base64::engine::general_purpose::STANDARD.encode(image);
        let inputs = serde_json::json!([{ "name": input, "datatype": "BYTES", "shape": [1], "data": [data] }]);
        return Ok((format!("/v2/models/{name}/infer"), serde_json::to_vec(&serde_json::json!({ "inputs": inputs }))?));
    }
    Ok(match entry.task {
        Task::Embedding => {
            (format!("/v2/models/{name}/embed"), serde_json::to_vec(&serde_json::json!({ "inputs": SENTENCE }))?)
        }
        Task::Classification => {
            (format!("/v2/models/{name}/predict"), serde_json::to_vec(&serde_json::json!({ "inputs": SENTENCE }))?)
        }
        Task::Raw => {
            let meta = metadata(addr, name)?;
            let inputs: Vec<serde_json::Value> = meta["inputs"]
                .as_array()
                .context("model metadata without inputs")?
                .iter()
                .map(|input| {
                    let shape: Vec<i64> = input["shape"]
                        .as_array()
                        .map(|dims| {
                            dims.iter()
                                .enumerate()
                                .map(|(i, d)| match d.as_i64().unwrap_or(-1) {
                                    d if d >= 0 => d,
                                    _ if i == 0 => 1,
                                    _ => entry.warmup.dynamic_dim as i64,
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let n: i64 = shape.iter().product();
                    let zero = match input["datatype"].as_str() {
                        Some("BOOL") => serde_json::json!(false),
                        Some("BYTES") => serde_json::json!(""),
                        _ => serde_json::json!(0),
                    };
                    serde_json::json!({"name": input["name"], "datatype": input["datatype"], "shape": shape,
                        "data": vec![zero; n.max(0) as usize]})
                })
                .collect();
            (format!("/v2/models/{name}/infer"), serde_json::to_vec(&serde_json::json!({ "inputs": inputs }))?)
        }
    })
}

/// The model's v2 metadata, as the candidate serves it.
fn metadata(addr: &str, name: &str) -> anyhow::Result<serde_json::Value> {
    let answer = request(addr, "GET", &format!("/v2/models/{name}"), &[], b"")?;
    anyhow::ensure!(answer.status == 200, "model metadata: status {}", answer.status);
    Ok(serde_json::from_slice(&answer.body)?)
}

/// A PNG of `width` x `height` (the model's input size, so no resize is measured): smooth
/// colour gradients with some texture, a picture rather than a flat field that compresses to
/// nothing.
fn generated_image(width: u32, height: u32) -> anyhow::Result<Vec<u8>> {
    let pixels = image::RgbImage::from_fn(width, height, |x, y| {
        let ramp = |at: u32, of: u32| u64::from(at) * 255 / u64::from(of.max(1));
        let (u, v) = (ramp(x, width), ramp(y, height));
        let texture = u64::from(x.wrapping_mul(7919) ^ y.wrapping_mul(104_729)) % 32;
        image::Rgb([u as u8, v as u8, ((u + v) / 2 + texture).min(255) as u8])
    });
    let mut png = std::io::Cursor::new(Vec::new());
    pixels.write_to(&mut png, image::ImageFormat::Png).context("cannot encode the load's image")?;
    Ok(png.into_inner())
}

/// A candidate's `inferd serve`, in its own process group (killed with it when dropped).
struct Server {
    process: Process,
    addr: String,
    socket: PathBuf,
}

impl Server {
    fn start(args: &Tune, c: Candidate, work: &Path) -> anyhow::Result<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = format!("127.0.0.1:{port}");
        let socket = work.join("control.sock");
        let mut command = Command::new(std::env::current_exe()?);
        command.arg("serve");
        if let Some(config) = &args.config {
            command.arg("--config").arg(config);
        }
        if c.precision != Precision::Fp32 {
            for (flag, bound) in
                [("--min-cosine", args.min_cosine), ("--max-probability-error", args.max_probability_error)]
            {
                if let Some(bound) = bound {
                    command.args([flag, &bound.to_string()]);
                }
            }
        }
        command
            .args(["--listen", &addr, "--admin-listen", ""])
            .arg("--control-socket")
            .arg(&socket)
            .args(["--workers", &c.workers.to_string(), "--threads", &c.threads.to_string()])
            .args(["--max-batch-size", &c.max_batch_size.to_string()])
            .args(["--max-queue-delay-ms", &c.max_queue_delay_ms.to_string()])
            .args(["--precision", c.precision.as_str()]);
        let process = Process::spawn(&mut command).context("cannot start inferd serve")?;
        Ok(Server { process, addr, socket })
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(180);
        while Instant::now() < deadline {
            if let Some(status) = self.process.exited() {
                bail!("inferd serve exited ({status}): {}", self.log_tail());
            }
            if request(self.addr.as_str(), "GET", "/v2/health/ready", &[], b"").is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("not ready after 180 s: {}", self.log_tail())
    }

    fn log_tail(&self) -> String {
        self.process.log_tail(3, " | ")
    }
}

/// Puts the plan into the configuration (`server.workers`, `server.threads`) and the batching,
/// precision and `bounds` (`[quantization]` keys) into the model's `model.toml`, keeping every
/// comment and other key.
fn write_plan(
    config: &Path,
    model_toml: &Path,
    c: Candidate,
    bounds: &[(&str, toml_edit::Value)],
) -> anyhow::Result<()> {
    set_keys(
        config,
        Some("server"),
        &[("workers", (c.workers as i64).into()), ("threads", (c.threads as i64).into())],
    )?;
    let batching = [
        ("max_batch_size", (c.max_batch_size as i64).into()),
        ("max_queue_delay_ms", (c.max_queue_delay_ms as i64).into()),
    ];
    set_keys(model_toml, Some("batching"), &batching)?;
    set_keys(model_toml, None, &[("precision", c.precision.as_str().into())])?;
    if !bounds.is_empty() {
        set_keys(model_toml, Some("quantization"), bounds)?;
    }
    println!("wrote {} and {}", config.display(), model_toml.display());
    Ok(())
}

/// Sets `keys` in `[section]` of a TOML file (at its top with `None`), keeping the rest as written.
fn set_keys(path: &Path, section: Option<&str>, keys: &[(&str, toml_edit::Value)]) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut doc: toml_edit::DocumentMut = text.parse().with_context(|| format!("{} is not TOML", path.display()))?;
    let table = match section {
        Some(section) => {
            if !doc.contains_key(section) {
                doc[section] = toml_edit::table(); // `[section]`, not an inline table
            }
            &mut doc[section]
        }
        None => doc.as_item_mut(),
    };
    for (key, value) in keys {
        table[*key] = toml_edit::Item::Value(value.clone());
    }
    std::fs::write(path, doc.to_string()).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_image_is_a_png_of_the_models_size() {
        let png = generated_image(224, 160).unwrap();
        let decoded = image::load_from_memory_with_format(&png, image::ImageFormat::Png).unwrap();
        assert_eq!((decoded.width(), decoded.height()), (224, 160));
        // Not a flat field: the load decodes a picture.
        let pixels = decoded.to_rgb8();
        assert_ne!(pixels.get_pixel(0, 0), pixels.get_pixel(223, 159));
    }

    #[test]
    fn goals_parse_and_bad_ones_are_explained() {
        assert_eq!("latency".parse::<Goal>(), Ok(Goal::Latency));
        assert_eq!("p99-under=50".parse::<Goal>(), Ok(Goal::P99Under(50.0)));
        assert!("p99-under=-1".parse::<Goal>().unwrap_err().contains("p99-under=MS"));
        assert!("fast".parse::<Goal>().is_err());
    }

    #[test]
    fn the_grid_covers_every_thread_split_within_the_cores() {
        let grid = candidates(2, 32, false);
        let plans: Vec<(usize, usize)> = grid.iter().map(|c| (c.workers, c.threads)).collect();
        assert_eq!(plans, [(2, 1), (2, 1), (2, 1), (1, 2), (1, 2), (1, 2)]);
        assert_eq!(grid[0].max_batch_size, 1, "batching off is a candidate");
        assert!(grid.iter().all(|c| c.precision == Precision::Fp32));
        let six: Vec<usize> = candidates(6, 32, false).iter().map(|c| c.threads).step_by(3).collect();
        assert_eq!(six, [1, 2, 4, 6]);
        assert!(candidates(6, 32, false).iter().all(|c| c.workers * c.threads <= 6));
        // Text models: each split once more, batched, in int8.
        let int8: Vec<(usize, usize)> = candidates(2, 32, true)
            .iter()
            .filter(|c| c.precision == Precision::Int8)
            .map(|c| (c.workers, c.threads))
            .collect();
        assert_eq!(int8, [(2, 1), (1, 2)]);
    }
}
