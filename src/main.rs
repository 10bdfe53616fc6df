//! `inferd`: the command line. `serve` runs the supervisor, `check` prints the plan, `status`
//! asks a running server, and the hidden `worker` is what the supervisor executes for each
//! worker process.

mod exit;
mod logging;
mod tune;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use exit::{Failure, EXIT_ANSWERED_NO};
use inferd_config::file::LogFormat;
use inferd_config::model::{ModelOverride, Precision};
use inferd_config::{Config, Overrides};
use inferd_supervisor::control::{self, Request};
use inferd_supervisor::plan::cpu::format_cpus;
use inferd_supervisor::plan::Resolved;
use inferd_worker::runtime::model::{Runtime, Threads};

/// A production server for ONNX models: one supervisor, K pinned worker processes, one port.
#[derive(Parser)]
#[command(name = "inferd", version = inferd_ipc::version(), propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the supervisor and its workers and serve until SIGTERM/SIGINT.
    Serve(ServeArgs),
    /// Print the resolved plan (cores, workers, threads, CPU sets, ONNX Runtime, models) and
    /// exit non-zero if it is impossible.
    Check(ServeArgs),
    /// Show the pool of a running server. Exits 2 when the pool is degraded.
    Status(StatusArgs),
    /// Swap models with a rolling replacement of the workers (the same as SIGHUP).
    Reload(ReloadArgs),
    /// Add (+1, the same as SIGTTIN) or drain (-1, SIGTTOU) one worker.
    Scale(ScaleArgs),
    /// Upgrade inferd itself with no failed request (the same as SIGUSR2): start the new binary
    /// as a new supervisor on the running one's sockets, and hand over once its workers are
    /// ready. Exits non-zero, the old one serving as before, when the new one cannot.
    Upgrade(UpgradeArgs),
    /// Measure this host's plans for a model (workers x threads x batching) under a short load
    /// at 1, 4 and 16 connections, print the table and the best plan for --goal; --write puts
    /// it into the configuration and the model's model.toml, keeping their comments.
    Tune(TuneArgs),
    /// Write the model.toml that a published model folder (Hugging Face, sentence-transformers,
    /// optimum) without one is served with, for editing: every value commented with the file
    /// it came from.
    Init(InitArgs),
    /// Internal: one worker process, started by `inferd serve`.
    #[command(hide = true)]
    Worker {
        /// Descriptor of the supervisor's socketpair.
        #[arg(long, default_value_t = inferd_ipc::spec::WORKER_CONTROL_FD)]
        fd: i32,
    },
}

#[derive(Args)]
struct ConfigArg {
    /// Configuration file. Default: ./inferd.toml, else inferd.toml beside or above the
    /// binary (the repository's own), else /etc/inferd/inferd.toml.
    #[arg(long, env = "INFERD_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Serve this model folder alone (with its model.toml, or a published folder without one)
    /// instead of the configuration's models.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to serve on, e.g. 127.0.0.1:8000 (server.listen).
    #[arg(long)]
    listen: Option<String>,
    /// Address to serve KServe v2 over gRPC on, "" for none (server.grpc_listen).
    #[arg(long)]
    grpc_listen: Option<String>,
    /// Address of the admin listener (Prometheus /metrics, Triton's statistics and model
    /// repository load/unload), "" for none (admin.listen).
    #[arg(long)]
    admin_listen: Option<String>,
    /// Largest request body in bytes (server.max_body_bytes); Triton's name for it is accepted.
    #[arg(long, visible_alias = "http-max-input-size")]
    max_body_bytes: Option<u64>,
    /// Number of worker processes; 0 = fill the CPU budget (server.workers).
    #[arg(long)]
    workers: Option<usize>,
    /// ORT intra-op threads per worker; 0 = derive from the CPU budget (server.threads).
    #[arg(long)]
    threads: Option<usize>,
    /// Control socket used by `inferd status` (server.control_socket).
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// Rows per ORT run for every model, over model.toml's [batching] (1 = no batching).
    #[arg(long)]
    max_batch_size: Option<usize>,
    /// How long a request may wait for company, for every model, over model.toml's [batching].
    #[arg(long)]
    max_queue_delay_ms: Option<u64>,
    /// fp32, int8 or auto for every model, over model.toml's `precision`.
    #[arg(long)]
    precision: Option<Precision>,
    /// The int8 guard's least cosine to fp32 for embeddings, over model.toml's [quantization].
    #[arg(long)]
    min_cosine: Option<f64>,
    /// The int8 guard's largest probability error for classifiers, over model.toml's [quantization].
    #[arg(long)]
    max_probability_error: Option<f64>,
    /// The int8 guard's largest relative error of raw models' outputs, over model.toml's [quantization].
    #[arg(long)]
    max_relative_error: Option<f64>,
}

#[derive(Args)]
struct SocketArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Control socket of the server; default: the one in the configuration.
    #[arg(long)]
    control_socket: Option<PathBuf>,
}

impl SocketArgs {
    fn path(&self) -> anyhow::Result<PathBuf> {
        Ok(match &self.control_socket {
            Some(path) => path.clone(),
            None => Config::load(self.config.config.as_deref())?.control_socket(),
        })
    }
}

#[derive(Args)]
struct StatusArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Refresh the table in place every --interval seconds until interrupted.
    #[arg(long)]
    watch: bool,
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
}

#[derive(Args)]
struct ReloadArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// The model to swap (needed with --path when the server has several models).
    #[arg(long)]
    model: Option<String>,
    /// New model: a folder with its model.toml, or an ONNX file. Without it the models are
    /// read again from the repository (a forced recycle when nothing changed).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Follow the reload until every worker is replaced (default: until the new models
    /// passed validation in the first new worker).
    #[arg(long)]
    wait: bool,
}

#[derive(Args)]
struct TuneArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The model to tune; default: the default model.
    #[arg(long)]
    model: Option<String>,
    /// latency (lowest lone-request p50), throughput (most requests/s), or p99-under=MS (most
    /// requests/s with p99 under MS milliseconds).
    #[arg(long, default_value = "throughput")]
    goal: tune::Goal,
    /// Write the best plan into the configuration file and the model's model.toml.
    #[arg(long)]
    write: bool,
    /// Measured seconds at each concurrency.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Image models: the image (PNG or JPEG, as clients send it) every request carries;
    /// default: a PNG of the model's input size.
    #[arg(long)]
    image: Option<PathBuf>,
    /// The accuracy bound of int8 candidates (embeddings): least cosine to fp32 over the
    /// calibration texts; default: the model's [quantization] min_cosine.
    #[arg(long)]
    min_cosine: Option<f64>,
    /// The accuracy bound of int8 candidates (classifiers): largest probability difference to
    /// fp32; default: the model's [quantization] max_probability_error.
    #[arg(long)]
    max_probability_error: Option<f64>,
}

#[derive(Args)]
struct InitArgs {
    /// The model folder.
    dir: PathBuf,
    /// The model's name; default: the folder's.
    #[arg(long)]
    name: Option<String>,
    /// The ONNX file to serve, relative to the folder (when it has several).
    #[arg(long)]
    file: Option<String>,
    /// Replace a model.toml that is there already.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct UpgradeArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// The new binary (default: the path the running supervisor was started from, where a
    /// package upgrade puts the new one).
    #[arg(long)]
    binary: Option<PathBuf>,
}

#[derive(Args)]
struct ScaleArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// +1 or -1.
    #[arg(allow_negative_numbers = true)]
    delta: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The server's log format comes from its config (read again, with errors, by `resolve`).
    let format = logging::from_env().unwrap_or_else(|| match &cli.command {
        Command::Serve(args) => Config::load(args.config.config.as_deref()).map_or(LogFormat::Auto, |c| c.log.format),
        _ => LogFormat::Text,
    });
    let format = logging::init(format);
    let result = match cli.command {
        Command::Worker { fd } => return ExitCode::from(inferd_worker::run(fd) as u8),
        Command::Serve(args) => serve(args, format),
        Command::Check(args) => check(args),
        Command::Init(args) => init(args),
        Command::Status(args) => status(args),
        Command::Reload(args) => reload(args),
        Command::Scale(args) => scale(args),
        Command::Upgrade(args) => upgrade(args),
        Command::Tune(args) => tune::run(tune::Tune {
            config: args.config.config,
            model: args.model,
            goal: args.goal,
            write: args.write,
            seconds: args.seconds,
            image: args.image,
            min_cosine: args.min_cosine,
            max_probability_error: args.max_probability_error,
        })
        .map_err(Failure::from),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            match &e {
                Failure::Other(e) => eprintln!("inferd: error: {e:#}"),
                e => eprintln!("inferd: error: {e}"),
            }
            e.exit_code()
        }
    }
}

fn resolve(args: &ServeArgs) -> Result<Resolved, Failure> {
    let mut config = Config::load(args.config.config.as_deref())?;
    config.apply(&Overrides {
        listen: args.listen.clone(),
        grpc_listen: args.grpc_listen.clone(),
        admin_listen: args.admin_listen.clone(),
        workers: args.workers,
        threads: args.threads,
        max_body_bytes: args.max_body_bytes,
        control_socket: args.control_socket.clone(),
        model_dir: args.model.clone(),
        model_override: ModelOverride {
            max_batch_size: args.max_batch_size,
            max_queue_delay_ms: args.max_queue_delay_ms,
            max_queue_size: None,
            precision: args.precision,
            min_cosine: args.min_cosine,
            max_probability_error: args.max_probability_error,
            max_relative_error: args.max_relative_error,
        },
    })?;
    Ok(Resolved::new(config)?)
}

fn serve(args: ServeArgs, log_format: LogFormat) -> Result<ExitCode, Failure> {
    let mut resolved = resolve(&args)?;
    // What this process uses, so that the workers log the same way.
    resolved.config.log.format = log_format;
    inferd_supervisor::run(resolved)?;
    Ok(ExitCode::SUCCESS)
}

fn check(args: ServeArgs) -> Result<ExitCode, Failure> {
    let resolved = resolve(&args)?;
    let config = &resolved.config;
    let plan = &resolved.plan;
    println!("config:          {}", config.source.as_ref().map_or("(defaults)".into(), |p| p.display().to_string()));
    // Whether `serve` would find the address free (a running inferd of this config holds it too).
    let held = |addr, grpc| match inferd_supervisor::port::check_free(addr, grpc) {
        Ok(()) => String::new(),
        Err(held) => format!(" (ALREADY SERVED by {}: serve refuses while it listens)", held.holder),
    };
    println!("listen:          {}{}", config.server.listen, held(config.server.listen_addr(), false));
    if let Some(addr) = config.server.grpc_addr() {
        println!("grpc listen:     {}{}", config.server.grpc_listen, held(addr, true));
    }
    println!("control socket:  {}", config.control_socket().display());
    match &resolved.access.api_keys {
        Some(keys) => println!("auth:            {}", keys.describe()),
        None => println!("auth:            none: every request is served ([auth] api_keys_file, INFERD_API_KEYS)"),
    }
    if let Some(restricted) = resolved.access.restricted.describe() {
        println!("restricted:      {restricted}");
    }
    match &resolved.access.tls {
        Some(tls) => println!(
            "tls:             {} ({}){}",
            config.server_tls().cert.expect("loaded").display(),
            if config.server.grpc_listen.is_empty() { "HTTP/1.1" } else { "HTTP/1.1 and gRPC" },
            if tls.mutual() { ", client certificates required (server.tls_client_ca)" } else { "" }
        ),
        None => println!("tls:             none: plain TCP ([server] tls_cert, tls_key)"),
    }
    println!("usable cores:    {} ({})", plan.budget.usable, plan.budget.describe());
    println!(
        "workers:         {} x {} intra-op thread(s) = {} threads{}",
        plan.workers.len(),
        plan.threads_per_worker,
        plan.total_threads(),
        if plan.oversubscribed { " (OVERSUBSCRIBED: allowed by server.allow_oversubscription)" } else { "" }
    );
    for w in &plan.workers {
        let cpus = if w.cpus.is_empty() { "not pinned".to_string() } else { format_cpus(&w.cpus) };
        let borrows = w.borrow.map_or(String::new(), |cpu| format!(", and cpu {cpu} while its worker is idle"));
        println!("  worker {}:      cpus {cpus}, {} thread(s){borrows}", w.index, w.threads);
    }
    println!("onnx runtime:    {} (from {})", resolved.ort.path.display(), resolved.ort.source);
    if config.models.on_demand {
        let (on_demand, unusable) = config.on_demand_models(&resolved.models);
        let names: Vec<&str> = on_demand.iter().map(|m| m.name.as_str()).collect();
        let names = if names.is_empty() { "none".to_string() } else { names.join(", ") };
        println!("on demand:       {names} (loaded on a worker's first request for each)");
        for (name, error) in unusable {
            println!("  {name}: cannot be loaded on demand: {error}");
        }
    }
    // As the workers will: an int8 preparation made here is theirs too.
    let runtime = Runtime::init(&resolved.ort.path, config.runtime.allocator, config.weights_cache())
        .map_err(|error| Failure::Model { context: "checking ONNX Runtime".into(), error: error.into() })?;
    for entry in &resolved.models {
        let (meta, _session) = inferd_worker::load::one(&runtime, entry, Threads::Narrow, &resolved.access.signatures)
            .map_err(|error| Failure::Model { context: format!("checking model '{}'", entry.name), error })?;
        println!(
            "model {} (version {}, sha256 {}): {}",
            meta.info.name,
            meta.info.version,
            meta.info.sha256,
            entry.path.display()
        );
        let dir = config.model_repository().join(&entry.name);
        if let Some(toml) = inferd_config::model::ModelEntry::inferred_toml(&dir, &entry.name)? {
            println!("  no model.toml: served as this one (`inferd init {}` writes it)", dir.display());
            toml.lines().for_each(|line| println!("    {line}"));
        }
        println!("  precision {}", meta.info.precision);
        if let Some(inferd_worker::pipeline::Head::Classification { activation, why, .. }) = meta.pipeline.head() {
            println!("  scores {}: {why}", activation.as_str());
        }
        match (&entry.tokenizer, &entry.image) {
            (Some(t), _) => println!(
                "  task   {:?}: text, tokenizer {} (max_length {})",
                entry.task,
                t.path.display(),
                t.max_length
            ),
            (_, Some(i)) => {
                println!("  task   {:?}: images {}x{} {:?} {:?}", entry.task, i.width, i.height, i.channels, i.layout)
            }
            _ => println!("  task   {:?}: tensors in, tensors out", entry.task),
        }
        for (kind, specs) in [("input ", &meta.inputs), ("output", &meta.outputs)] {
            for s in specs {
                println!("  {kind} {:<24} {:<6} {:?}", s.name, s.datatype, s.shape);
            }
        }
    }
    // The models are loaded in this process: its memory now approximates one worker's before
    // warm-up. `serve` applies the same rule to worker 0's after warm-up (MemoryBudget::fit).
    use inferd_supervisor::plan::memory::{MemoryBudget, WorkerLimits, WorkerMemory};
    let one = WorkerMemory::of(std::process::id());
    let budget = MemoryBudget::detect();
    let k = plan.workers.len() as u64;
    let (fit, memory_plan) = budget.fit(k, one, "on this process with the models loaded, before warm-up");
    println!("memory:          {memory_plan}");
    if fit < k {
        println!("                 DOES NOT FIT: serve refuses, or starts {fit} with server.fit_workers_to_memory");
    }
    let limits = WorkerLimits::derive(
        &budget,
        k,
        one.private,
        one.shared,
        config.server.worker_memory_soft_limit_mb,
        config.server.worker_memory_hard_limit_mb,
    );
    println!("worker memory:   {} (about; serve measures worker 0)", limits.describe());
    if config.models.on_demand {
        let configured = config.models.memory_budget.map(|b| b.0);
        let (models, source) = inferd_supervisor::plan::memory::models_budget(configured, &budget);
        let share = models / k.max(1);
        println!("models budget:   {} MiB ({source}): {} MiB per worker", models >> 20, share >> 20);
        let base = one.private + one.shared;
        if share <= base {
            println!(
                "                 TOO SMALL: a worker's share is not above what one holds with its pinned models \
                 ({} MiB): every load on demand is refused",
                base >> 20
            );
        }
        on_demand_room(&config.on_demand_models(&resolved.models).0, share.saturating_sub(base), base, k);
    }
    println!("plan OK");
    Ok(ExitCode::SUCCESS)
}

/// What `inferd check` says of the models loaded on demand against `room`, what a worker's
/// share leaves beside the `base` it holds with its pinned models (`k` workers): the largest,
/// the models that can never fit (refused with the figures), and those whose first load's
/// estimated peak passes the room (the pool's memory may then pass the budget while it loads).
fn on_demand_room(models: &[inferd_config::model::ModelEntry], room: u64, base: u64, k: u64) {
    use inferd_worker::request::models::FIRST_LOAD_FACTOR;
    let mut files: Vec<(&str, u64)> =
        models.iter().map(|m| (m.name.as_str(), std::fs::metadata(&m.path).map_or(0, |f| f.len()))).collect();
    files.sort_by_key(|&(_, file)| std::cmp::Reverse(file));
    let Some(&(largest, file)) = files.first() else { return };
    let mib = |bytes: u64| bytes >> 20;
    println!(
        "largest on demand: '{largest}', a file of {} MiB: its first load peaks at about {} MiB \
         ({FIRST_LOAD_FACTOR} times its file, estimated; later loads as measured); a share's room: {} MiB",
        mib(file),
        mib(file.saturating_mul(FIRST_LOAD_FACTOR)),
        mib(room)
    );
    let never: Vec<&str> = files.iter().filter(|&&(_, file)| file > room).map(|&(name, _)| name).collect();
    if !never.is_empty() {
        println!(
            "                 NEVER FITS: {} (larger than a share's room): their requests are refused with the figures",
            list(&never)
        );
    }
    let peaking: Vec<(&str, u64)> = files
        .iter()
        .filter(|&&(_, file)| file <= room && file.saturating_mul(FIRST_LOAD_FACTOR) > room)
        .copied()
        .collect();
    if let Some(&(_, file)) = peaking.first() {
        let names: Vec<&str> = peaking.iter().map(|&(name, _)| name).collect();
        let holds = (file.saturating_mul(FIRST_LOAD_FACTOR) + base).saturating_mul(k);
        println!(
            "                 WARNING: {} may peak past a share's room while loading: the pool may pass \
             models.memory_budget for those moments; a budget of {} MiB or more holds them",
            list(&names),
            mib(holds).max(1)
        );
    }
}

/// Up to five names, then how many more.
fn list(names: &[&str]) -> String {
    let shown: Vec<String> = names.iter().take(5).map(|n| format!("'{n}'")).collect();
    match names.len() > 5 {
        true => format!("{} and {} more", shown.join(", "), names.len() - 5),
        false => shown.join(", "),
    }
}

fn init(args: InitArgs) -> Result<ExitCode, Failure> {
    use inferd_config::model::{published, ModelEntry, MODEL_CONFIG_FILE};
    let dir = std::path::absolute(&args.dir)?;
    let name = match &args.name {
        Some(name) => name.clone(),
        None => dir.file_name().and_then(|n| n.to_str()).context("the folder has no name: pass --name")?.to_string(),
    };
    let path = dir.join(MODEL_CONFIG_FILE);
    if path.exists() && !args.force {
        return Err(anyhow::anyhow!("{} exists; --force replaces it", path.display()).into());
    }
    let text = published::infer(&dir, &name, args.file.as_deref()).map_err(anyhow::Error::msg)?;
    // Put in place whole, then read back as the server will read it.
    let staged = dir.join(".model.toml.init");
    std::fs::write(&staged, &text).with_context(|| format!("writing {}", staged.display()))?;
    std::fs::rename(&staged, &path)?;
    if let Err(e) = ModelEntry::load_dir(&dir, &name) {
        eprintln!("inferd: warning: {} is written, but the model does not load as it says: {e}", path.display());
    }
    print!("{text}");
    eprintln!("wrote {}", path.display());
    Ok(ExitCode::SUCCESS)
}

fn status(args: StatusArgs) -> Result<ExitCode, Failure> {
    let socket = args.socket.path()?;
    loop {
        let response = control::query(&socket, &Request::Status, |_| {})?;
        let status = response.status.context("the server sent no status")?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&status).map_err(anyhow::Error::from)?);
        } else if args.watch {
            // Clear the screen and home the cursor, then redraw.
            print!("\x1b[2J\x1b[H{}", status.render());
            std::io::Write::flush(&mut std::io::stdout())?;
        } else {
            print!("{}", status.render());
        }
        if !args.watch {
            let degraded = status.phase == inferd_supervisor::status::Phase::Degraded;
            return Ok(if degraded { ExitCode::from(EXIT_ANSWERED_NO as u8) } else { ExitCode::SUCCESS });
        }
        std::thread::sleep(std::time::Duration::from_secs_f64(args.interval.max(0.1)));
    }
}

fn reload(args: ReloadArgs) -> Result<ExitCode, Failure> {
    let path = args.path.map(|p| std::path::absolute(&p).unwrap_or(p));
    let request = Request::Reload { model: args.model, path, wait: args.wait };
    let response = control::query(&args.socket.path()?, &request, |p| println!("{p}"))?;
    println!("{}", response.message.unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}

fn upgrade(args: UpgradeArgs) -> Result<ExitCode, Failure> {
    let binary = args.binary.map(|p| std::path::absolute(&p).unwrap_or(p));
    let response = control::query(&args.socket.path()?, &Request::Upgrade { binary }, |p| println!("{p}"))?;
    println!("{}", response.message.unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}

fn scale(args: ScaleArgs) -> Result<ExitCode, Failure> {
    let delta: i32 = args.delta.parse().with_context(|| format!("scale takes +1 or -1, not {}", args.delta))?;
    let response = control::query(&args.socket.path()?, &Request::Scale { delta }, |p| println!("{p}"))?;
    println!("{}", response.message.unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}
