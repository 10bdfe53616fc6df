//! `inferd.toml`: schema, validation and command-line overrides. Where the file is looked for
//! is [`discover`]'s; what goes wrong reading it, [`ConfigError`] (both re-exported here).
//!
//! Relative paths in the file are resolved against the directory that holds the file, so the
//! repository's own `inferd.toml` works from any working directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::discover::{discover, CONFIG_FILE_NAME, SYSTEM_CONFIG};
pub use crate::error::ConfigError;
use crate::model::{ModelEntry, ModelOverride};

/// The largest duration a `*_secs` key takes: a year (timers cannot hold an unbounded one).
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub models: ModelsConfig,
    pub runtime: RuntimeConfig,
    pub log: LogConfig,
    pub auth: crate::auth::AuthConfig,
    pub tracing: TracingConfig,
    pub cache: CacheConfig,
    /// Directory that relative paths are resolved against (the config file's directory).
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// The file this configuration was read from, if any.
    #[serde(skip)]
    pub source: Option<PathBuf>,
    /// Command-line model settings for every model (not a file key).
    #[serde(skip)]
    pub model_override: ModelOverride,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the pool listens on: one SO_REUSEPORT socket per worker slot.
    pub listen: String,
    /// Address the pool also serves KServe v2 over gRPC on (a socket per slot, joined after
    /// warm-up like `listen`); empty = no gRPC.
    pub grpc_listen: String,
    /// TLS on `listen` (ALPN http/1.1) and `grpc_listen` (ALPN h2): the certificate chain
    /// (PEM, the server's certificate first), read at start and at every reload.
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM; readable by the service's user alone).
    pub tls_key: Option<PathBuf>,
    /// CA certificate(s) (PEM): with it, every client must present a certificate they signed
    /// (mutual TLS).
    pub tls_client_ca: Option<PathBuf>,
    /// Number of worker processes; 0 = as many as the CPU budget allows.
    pub workers: usize,
    /// ORT intra-op threads per worker; 0 = derive from the CPU budget (see `cpu::plan`).
    pub threads: usize,
    /// Let a wide session's pool threads spin between the operators of a run instead of
    /// sleeping: a lone request on 2 threads then takes ~0.6x the single-thread time instead of
    /// ~1.0x (wake-ups per operator cost more than they save). The spinning stops when the run
    /// ends, so an idle server stays idle; after such a lone request the worker's dispatcher
    /// and first lane also poll 0.3 ms for the next one before sleeping. No effect with 1
    /// thread per worker.
    pub intra_op_spinning: bool,
    /// How a wide run splits each operator's parallel loop between its threads: into
    /// dynamically sized blocks, about `threads x this` of them (ONNX Runtime's
    /// `session.dynamic_block_base`), so a thread that finishes early takes more; 0 is ORT's
    /// static split. 4 made a lone request's p50 8% faster in int8 and 4% in fp32 on MiniLM,
    /// outputs bit-identical (docs/tuning.md). No effect with 1 thread per worker.
    pub intra_op_block_base: u32,
    /// Permit workers x threads > usable cores (not recommended: p95 suffers).
    pub allow_oversubscription: bool,
    /// Pin each worker to its own disjoint CPU set (sched_setaffinity).
    pub pin_workers: bool,
    /// With pinned workers of one thread each, a worker runs on two threads, the second on a
    /// sibling's core, while that core is idle (borrowed for one run; the sibling waits for it
    /// at most that run). So a pool of two one-thread workers (the default on 2 or 3 cores)
    /// answers a lone request as fast as one worker of two threads, and loses only half its
    /// capacity when a worker dies. docs/tuning.md, "Lent cores".
    pub lend_idle_cores: bool,
    /// A worker of one thread also runs long inputs (a batch of 256 tokens or more) on a second
    /// lane at a lower CPU priority (nice +10) on the same core, so short requests that arrive
    /// meanwhile do not wait behind them: the kernel gives the core to the short work first.
    /// Costs one more session per model and worker. docs/tuning.md, "The background lane".
    pub background_lane: bool,
    /// Unix socket for `inferd status`; created with mode 0600.
    pub control_socket: PathBuf,
    /// Request bodies above this size are refused with 413.
    pub max_body_bytes: u64,
    /// Texts or images in one `/embed`, `/predict` or pipeline `/infer` request; more get 413.
    pub max_batch_inputs: usize,
    /// How long a stopping worker may take to finish its in-flight requests.
    pub graceful_timeout_secs: f64,
    /// How long a worker may take to load its models and warm up before it is killed.
    pub boot_timeout_secs: f64,
    /// Requests a worker lets wait for its lanes; more get 503 with Retry-After at once.
    pub max_queue: usize,
    /// Open connections per worker; past it the worker stops accepting until one closes.
    pub max_connections: usize,
    /// A keep-alive connection is closed (announced with `Connection: close`) after this many
    /// requests, so the client's next connection is placed afresh: by a load balancer in front,
    /// over pods or hosts added since (within the pool, `balance_connections` evens out the
    /// workers). 0 = never.
    pub max_requests_per_connection: u64,
    /// A worker that holds two or more keep-alive connections more than its least busy
    /// sibling announces `Connection: close` on its next answer, so the kernel places the
    /// client's next connection afresh: the port's HTTP connections stay spread evenly over
    /// the workers (docs/tuning.md, "Connection balance").
    pub balance_connections: bool,
    /// A client must send its request headers within this (slowloris).
    pub header_timeout_secs: f64,
    /// ... and its body within this.
    pub body_timeout_secs: f64,
    /// How long an answer's write may make no progress (a client that does not read) before
    /// the connection is closed.
    pub write_timeout_secs: f64,
    /// A gRPC (HTTP/2) connection with no request open for this long is closed with GOAWAY
    /// (its client reconnects when it next calls). HTTP/1 needs no such setting: a kept-alive
    /// connection must send its next request's headers within header_timeout_secs.
    pub idle_timeout_secs: f64,
    /// Largest request head (request line and headers) in bytes; more is refused (431).
    pub max_header_bytes: usize,
    /// Most headers in one request.
    pub max_headers: usize,
    /// Request-body bytes one worker may hold at once; past it, 503 (at least max_body_bytes).
    pub max_body_bytes_in_flight: u64,
    /// A model run longer than this is stopped (through ORT's run options) and every request
    /// in it answered 504; the worker goes on serving. Only a run that does not stop within a
    /// grace after it means a stuck worker: SIGABRT, then SIGKILL on the next tick, replaced.
    pub request_timeout_secs: f64,
    /// When K workers do not fit in memory (measured on the first worker after warm-up), start
    /// as many as fit instead of refusing to start.
    pub fit_workers_to_memory: bool,
    /// How often the supervisor samples the workers' RSS (at least every tick, 0.2 s).
    pub memory_check_interval_secs: f64,
    /// Private memory above which a worker is replaced gracefully; 0 = 85% of its share of
    /// the cgroup memory limit, or without one of 80% of MemAvailable at start.
    pub worker_memory_soft_limit_mb: u64,
    /// Private memory above which a worker is killed at once; 0 = 95% of the same share.
    pub worker_memory_hard_limit_mb: u64,
    /// Replace a worker (gap-free, like a reload) after this many requests; 0 = never.
    pub max_requests: u64,
    /// Up to this many more requests, drawn per worker, so workers do not recycle together.
    pub max_requests_jitter: u64,
    /// Replace a worker (gap-free) once it is this old; 0 = never.
    pub max_worker_age_secs: f64,
    /// Set net.ipv4.tcp_migrate_req=1 at start (when permitted) so connections queued on a
    /// worker that stops accepting move to its siblings instead of being reset.
    pub set_tcp_migrate_req: bool,
    /// What KServe v2's server metadata calls the server (`GET /v2`, gRPC ServerMetadata):
    /// "inferd" by default; "triton" for clients that check for Triton's name.
    pub name: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:8000".into(),
            grpc_listen: String::new(),
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            workers: 0,
            threads: 0,
            intra_op_spinning: true,
            intra_op_block_base: 4,
            allow_oversubscription: false,
            pin_workers: true,
            lend_idle_cores: true,
            background_lane: true,
            control_socket: PathBuf::from("/run/inferd/control.sock"),
            max_body_bytes: 64 * 1024 * 1024,
            max_batch_inputs: 64,
            graceful_timeout_secs: 30.0,
            boot_timeout_secs: 120.0,
            max_queue: 128,
            max_connections: 1024,
            max_requests_per_connection: 100,
            balance_connections: true,
            header_timeout_secs: 10.0,
            body_timeout_secs: 30.0,
            write_timeout_secs: 30.0,
            idle_timeout_secs: 60.0,
            max_header_bytes: 16 * 1024,
            max_headers: 64,
            max_body_bytes_in_flight: 256 * 1024 * 1024,
            request_timeout_secs: 60.0,
            fit_workers_to_memory: false,
            memory_check_interval_secs: 0.2,
            worker_memory_soft_limit_mb: 0,
            worker_memory_hard_limit_mb: 0,
            max_requests: 0,
            max_requests_jitter: 0,
            max_worker_age_secs: 0.0,
            set_tcp_migrate_req: true,
            name: "inferd".into(),
        }
    }
}

/// The supervisor's own HTTP listener: Prometheus metrics, Triton's statistics and model
/// repository extensions.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `GET /metrics` is served here; empty = no admin listener.
    pub listen: String,
    /// Allow Triton's `POST /v2/repository/models/{name}/load` and `/unload` here (rolling
    /// reloads that add or remove a model): off unless the operator turns it on; needs
    /// `token_file`.
    pub model_control: bool,
    /// Serve load and unload on the main port too (HTTP and gRPC), without the admin token
    /// (the main port's API keys, if any, gate them as every route), so that unmodified
    /// Triton clients load and unload with one URL; needs `model_control`. Only where the
    /// main port's clients may change what it serves.
    pub model_control_on_main_port: bool,
    /// The admin token(s), one per line, sent as `Authorization: Bearer TOKEN`: every route
    /// but `/metrics` needs one (the same file rules as `[auth] api_keys_file`).
    pub token_file: Option<PathBuf>,
    /// `/metrics` needs the token too.
    pub protect_metrics: bool,
    /// Folders besides `models.repository` that `load`'s `parameters.path` may name.
    pub allowed_paths: Vec<PathBuf>,
    /// TLS on this listener, as `[server]`'s keys of the same names (its own certificate).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9464".into(),
            model_control: false,
            model_control_on_main_port: false,
            token_file: None,
            protect_metrics: false,
            allowed_paths: Vec::new(),
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelsConfig {
    /// Folder holding one sub-folder per model.
    pub repository: PathBuf,
    /// Model served when a request does not name one.
    pub default: String,
    /// Models every worker loads besides the default one.
    pub load: Vec<String>,
    /// Every other model of the repository is servable too: a worker loads it on the first
    /// request that names it (warm-up included), once for every request that waits for it.
    /// The default model and `load` stay loaded always. Which folders those are is read at
    /// start and at each reload; one that does not resolve is left out with a warning.
    pub on_demand: bool,
    /// How long a request waits for its model's load on demand before it is answered 503
    /// (with Retry-After; the load goes on).
    pub load_timeout_secs: f64,
    /// With on_demand: the memory the pool's workers may hold, in all (each keeps its resident
    /// memory under its share, evicting idle models loaded on demand before a load). None:
    /// derived from the memory plan (docs/configuration.md, "Models on demand").
    pub memory_budget: Option<ByteSize>,
    /// Which idle model loaded on demand is evicted first.
    pub eviction: Eviction,
    /// With on_demand and a budget: whether each worker loads every model its requests ask
    /// for, or a worker whose share has no free room for a model a serving sibling holds
    /// forwards the request to that sibling.
    pub placement: Placement,
    /// Whether a model folder's OpenSSF model-signing signature (`model.sig`) is checked at
    /// every load: off, verify (where there is one) or required.
    pub signatures: crate::signing::Signatures,
    /// The PEM public key signatures must verify against (the CLI's `key` method).
    pub signature_public_key: Option<PathBuf>,
    /// PEM files of the certificate authorities signing certificates must chain to (the
    /// CLI's `certificate` method).
    pub signature_certificate_chain: Vec<PathBuf>,
}

/// Where a model loaded on demand is served ([`ModelsConfig::placement`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Each worker loads the models its requests ask for.
    #[default]
    Worker,
    /// A worker loads a model only while its share has room for it beside what it holds, or
    /// when no serving sibling holds it; otherwise it forwards the request to the sibling
    /// that does, so the pool keeps more models warm within one budget.
    Pool,
}

/// Which idle model goes first when a load needs room ([`ModelsConfig::eviction`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// The least recently used. The default: on bench/many_models.sh's Zipf trace it kept
    /// slightly more hits than SIEVE at both budgets measured (docs/benchmarks.md).
    #[default]
    Lru,
    /// SIEVE: models in load order, a hand that passes over those used since it last passed
    /// (and forgets that they were) and evicts the first that was not. A model used once does
    /// not push out one used all the time.
    Sieve,
}

/// `[tracing]`: OpenTelemetry traces of every request, exported over OTLP (docs/operations.md,
/// "Traces"). Each key overrides the standard variable named beside it; what it leaves unset
/// comes from the environment (OTEL_EXPORTER_OTLP_HEADERS, _CERTIFICATE, OTEL_RESOURCE_ATTRIBUTES
/// and the others the OpenTelemetry SDK reads).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// None: on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set
    /// (and OTEL_SDK_DISABLED is not true); true: on (`endpoint` or the protocol's default
    /// collector on localhost); false: off.
    pub enabled: Option<bool>,
    /// The collector: its base URL (http:// or https://), as OTEL_EXPORTER_OTLP_ENDPOINT
    /// (`/v1/traces` is added for HTTP).
    pub endpoint: Option<String>,
    /// PEM file of the CAs that sign an https:// collector's certificate
    /// (OTEL_EXPORTER_OTLP_CERTIFICATE; by default the system's CA bundle).
    pub certificate: Option<PathBuf>,
    /// The exporter's own certificate chain and key, PEM, for a collector that asks for one
    /// (mTLS; OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and _CLIENT_KEY). The key's file must be
    /// readable by its owner only.
    pub client_certificate: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// `grpc` or `http/protobuf` (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL;
    /// by default http/protobuf).
    pub protocol: Option<String>,
    /// The share of new traces (requests without a sampled parent) that are recorded; a request
    /// whose parent was sampled always is (OTEL_TRACES_SAMPLER = parentbased_traceidratio with
    /// OTEL_TRACES_SAMPLER_ARG; by default 1).
    pub sample_ratio: Option<f64>,
    /// `service.name` (OTEL_SERVICE_NAME; by default "inferd").
    pub service_name: Option<String>,
    /// How long one export may take (OTEL_EXPORTER_OTLP_TIMEOUT; by default 10 s).
    pub timeout_secs: Option<f64>,
    /// Spans a worker keeps for export at most; past it new spans are dropped and counted
    /// (inferd_trace_spans_dropped_total). 0: 2048.
    pub max_queued_spans: usize,
}

/// `[cache]`: the cache of answers (docs/configuration.md, "The cache of answers").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// What the pool's workers may hold in answers, in all (each worker a 1/workers share);
    /// a size as `models.memory_budget` takes it. None or 0: no cache (the default).
    pub max_bytes: Option<ByteSize>,
}

impl CacheConfig {
    /// Bytes of answers each of `workers` workers may hold (0: no cache).
    pub fn per_worker(&self, workers: usize) -> u64 {
        self.max_bytes.map_or(0, |b| b.0 / workers.max(1) as u64)
    }
}

/// A number of bytes, written as an integer or as a string with a unit: `"2GiB"`,
/// `"512 MiB"`, `"1.5GB"`, `"800000"` (B, kB/KB, KiB, MB, MiB, GB, GiB, TB, TiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

/// A text that is not a [`ByteSize`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    #[error("'{text}': unknown unit '{unit}' (B, kB, KiB, MB, MiB, GB, GiB, TB, TiB)")]
    Unit { text: String, unit: String },
    #[error("'{0}' is not a size such as \"2GiB\"")]
    Number(String),
    #[error("'{0}' is too large")]
    TooLarge(String),
}

impl std::str::FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(text: &str) -> Result<ByteSize, ByteSizeError> {
        let text = text.trim();
        let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
        let (number, unit) = (&text[..split], text[split..].trim());
        let scale: u64 = match unit {
            "" | "B" => 1,
            "kB" | "KB" => 1_000,
            "KiB" => 1 << 10,
            "MB" => 1_000_000,
            "MiB" => 1 << 20,
            "GB" => 1_000_000_000,
            "GiB" => 1 << 30,
            "TB" => 1_000_000_000_000,
            "TiB" => 1 << 40,
            other => return Err(ByteSizeError::Unit { text: text.into(), unit: other.into() }),
        };
        let value: f64 = number.parse().map_err(|_| ByteSizeError::Number(text.into()))?;
        let bytes = value * scale as f64;
        if !(bytes.is_finite() && bytes < u64::MAX as f64) {
            return Err(ByteSizeError::TooLarge(text.into()));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} MiB", self.0 >> 20)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ByteSize, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Bytes(u64),
            Text(String),
        }
        match Written::deserialize(deserializer)? {
            Written::Bytes(n) => Ok(ByteSize(n)),
            Written::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            repository: PathBuf::from("models"),
            default: "minilm".into(),
            load: Vec::new(),
            on_demand: false,
            load_timeout_secs: 120.0,
            memory_budget: None,
            eviction: Eviction::default(),
            placement: Placement::default(),
            signatures: crate::signing::Signatures::Off,
            signature_public_key: None,
            signature_certificate_chain: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Full path to libonnxruntime.so.1.xx; otherwise ORT_DYLIB_PATH, then the places
    /// listed in `ortlib`.
    pub ort_library: Option<PathBuf>,
    /// Where each model's optimised weights are prepared once and mapped by every session of
    /// every worker (relative: to the config file's folder); empty = each session loads its
    /// own copy.
    pub cache_dir: PathBuf,
    /// Where a run's tensors come from (docs/configuration.md, "Memory").
    pub allocator: Allocator,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { ort_library: None, cache_dir: PathBuf::from(".cache/inferd"), allocator: Allocator::default() }
    }
}

/// Where ONNX Runtime takes the buffers of a run from (`runtime.allocator`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Allocator {
    /// No ORT arena and no memory patterns: every run mallocs its buffers, and free memory
    /// past a limit goes back to the system after a run (see the worker's `allocator`).
    Malloc,
    /// ORT's defaults: a CPU arena per session (grown by powers of two, never shrunk) and
    /// memory patterns.
    Arena,
    /// ORT's arena, shrunk back to its first chunk after every run.
    ArenaShrink,
    /// One ORT arena per worker process, shared by all its sessions (every lane, the wide
    /// session, every model), grown by what a run asks rather than by powers of two; no
    /// memory patterns. The default: the arena's speed at about half its memory.
    #[default]
    SharedArena,
}

/// How every process logs (stderr, or the journal's native protocol under systemd).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `auto` (the journal when stderr is connected to it, else text), `text`, `json` (one JSON
    /// object per line) or `journal`. The environment variable INFERD_LOG_FORMAT wins.
    pub format: LogFormat,
    /// One line per answered request: client, method, path, status, bytes, duration, model,
    /// worker and request id (target `inferd::access`, in the chosen format).
    pub access_log: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Auto,
    Text,
    Json,
    Journal,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Auto => "auto",
            LogFormat::Text => "text",
            LogFormat::Json => "json",
            LogFormat::Journal => "journal",
        }
    }

    pub fn parse(text: &str) -> Option<LogFormat> {
        [LogFormat::Auto, LogFormat::Text, LogFormat::Json, LogFormat::Journal].into_iter().find(|f| f.as_str() == text)
    }
}

impl ServerConfig {
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen.parse().expect("validated in Config::validate")
    }

    /// The gRPC address, when gRPC is on.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        (!self.grpc_listen.is_empty()).then(|| self.grpc_listen.parse().expect("validated in Config::validate"))
    }
}

/// Command-line values that take precedence over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub grpc_listen: Option<String>,
    pub admin_listen: Option<String>,
    pub workers: Option<usize>,
    pub threads: Option<usize>,
    pub max_body_bytes: Option<u64>,
    pub control_socket: Option<PathBuf>,
    pub model_override: ModelOverride,
    /// One model folder to serve, alone, in place of the repository's models (its parent
    /// becomes the repository, its name the model's).
    pub model_dir: Option<PathBuf>,
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|error| ConfigError::Read { path: path.to_path_buf(), error })?;
        let mut config: Config = toml::from_str(&text)
            .map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        config.base_dir = absolute.parent().map(Path::to_path_buf).unwrap_or_default();
        config.source = Some(absolute);
        config.validate()?;
        Ok(config)
    }

    /// Loads `explicit` if given, else the first file found by [`discover`].
    pub fn load(explicit: Option<&Path>) -> Result<Config, ConfigError> {
        match explicit {
            Some(path) => Config::from_file(path),
            None => Config::from_file(&discover().ok_or(ConfigError::NotFound)?),
        }
    }

    /// Applies command-line overrides, then validates again.
    pub fn apply(&mut self, overrides: &Overrides) -> Result<(), ConfigError> {
        if let Some(listen) = &overrides.listen {
            self.server.listen = listen.clone();
        }
        if let Some(grpc) = &overrides.grpc_listen {
            self.server.grpc_listen = grpc.clone();
        }
        if let Some(admin) = &overrides.admin_listen {
            self.admin.listen = admin.clone();
        }
        if let Some(workers) = overrides.workers {
            self.server.workers = workers;
        }
        if let Some(threads) = overrides.threads {
            self.server.threads = threads;
        }
        if let Some(bytes) = overrides.max_body_bytes {
            self.server.max_body_bytes = bytes;
        }
        self.model_override = overrides.model_override;
        if let Some(dir) = &overrides.model_dir {
            let invalid = |message: String| Err(ConfigError::Invalid { key: "--model", message });
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
            let (Some(parent), Some(name)) = (dir.parent(), dir.file_name().and_then(|n| n.to_str())) else {
                return invalid(format!("{} is not a model folder", dir.display()));
            };
            if !dir.is_dir() {
                return invalid(format!("{} is not a folder", dir.display()));
            }
            self.models =
                ModelsConfig { repository: parent.to_path_buf(), default: name.to_string(), ..ModelsConfig::default() };
        }
        if let Some(socket) = &overrides.control_socket {
            // A path given on the command line is relative to the working directory.
            self.server.control_socket = std::path::absolute(socket).unwrap_or_else(|_| socket.clone());
        }
        self.validate()
    }

    /// Checks every value that can be checked without touching the system.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if let Err(e) = self.server.listen.parse::<SocketAddr>() {
            return invalid("server.listen", format!("'{}' is not an IP:port address ({e})", self.server.listen));
        }
        if !self.admin.listen.is_empty() {
            if let Err(e) = self.admin.listen.parse::<SocketAddr>() {
                return invalid("admin.listen", format!("'{}' is not an IP:port address ({e})", self.admin.listen));
            }
        }
        if self.admin.model_control && self.admin.token_file.is_none() {
            return invalid(
                "admin.model_control",
                "changes what the public port serves, so it needs admin.token_file (the operator's token)".into(),
            );
        }
        if self.admin.model_control_on_main_port && !self.admin.model_control {
            return invalid(
                "admin.model_control_on_main_port",
                "opens load and unload on the main port, so it needs admin.model_control = true".into(),
            );
        }
        self.server_tls().validate("server")?;
        self.admin_tls().validate("admin")?;
        self.restrictions()?;
        let name = &self.server.name;
        if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return invalid("server.name", format!("'{name}' is not 1 to 64 visible ASCII characters"));
        }
        let tracing = &self.tracing_config();
        if let Some(protocol) = tracing.protocol.as_deref().filter(|p| !["grpc", "http/protobuf"].contains(p)) {
            return invalid("tracing.protocol", format!("'{protocol}' is not one of grpc, http/protobuf"));
        }
        if let Some(ratio) = tracing.sample_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
            return invalid("tracing.sample_ratio", format!("{ratio} is not between 0 and 1"));
        }
        if let Some(timeout) = tracing.timeout_secs.filter(|t| !(t.is_finite() && *t > 0.0)) {
            return invalid("tracing.timeout_secs", format!("{timeout} is not a positive number of seconds"));
        }
        if tracing.max_queued_spans > 1 << 20 {
            return invalid("tracing.max_queued_spans", format!("{} is more than 1048576", tracing.max_queued_spans));
        }
        if let Some(endpoint) =
            tracing.endpoint.as_deref().filter(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return invalid("tracing.endpoint", format!("'{endpoint}' is not an http:// or https:// URL"));
        }
        let identity = match (&tracing.client_certificate, &tracing.client_key) {
            (Some(chain), Some(key)) => Some((chain.as_path(), key.as_path())),
            (None, None) => None,
            (Some(_), None) => {
                return invalid("tracing.client_key", "is needed with tracing.client_certificate".into())
            }
            (None, Some(_)) => {
                return invalid("tracing.client_certificate", "is needed with tracing.client_key".into())
            }
        };
        if let Some(roots) = &tracing.certificate {
            if let Err(e) = crate::tls::ClientTls::load(Some(roots), None) {
                return invalid("tracing.certificate", e.to_string());
            }
        }
        if identity.is_some() {
            if let Err(e) = crate::tls::ClientTls::load(tracing.certificate.as_deref(), identity) {
                return invalid("tracing.client_certificate", e.to_string());
            }
        }
        if self.admin.protect_metrics && self.admin.token_file.is_none() {
            return invalid("admin.protect_metrics", "needs admin.token_file".into());
        }
        if !self.server.grpc_listen.is_empty() {
            match self.server.grpc_listen.parse::<SocketAddr>() {
                Err(e) => {
                    return invalid(
                        "server.grpc_listen",
                        format!("'{}' is not an IP:port address ({e})", self.server.grpc_listen),
                    )
                }
                Ok(grpc) if [&self.server.listen, &self.admin.listen].iter().any(|a| a.parse() == Ok(grpc)) => {
                    return invalid("server.grpc_listen", format!("{grpc} is already server.listen or admin.listen"))
                }
                Ok(_) => {}
            }
        }
        if self.server.workers > 1024 {
            return invalid("server.workers", format!("{} is more than 1024", self.server.workers));
        }
        if self.server.threads > 1024 {
            return invalid("server.threads", format!("{} is more than 1024", self.server.threads));
        }
        if self.server.max_body_bytes == 0 {
            return invalid("server.max_body_bytes", "must be greater than 0".into());
        }
        for (key, value) in [
            ("server.max_batch_inputs", self.server.max_batch_inputs),
            ("server.max_queue", self.server.max_queue),
            ("server.max_connections", self.server.max_connections),
            ("server.max_headers", self.server.max_headers),
        ] {
            if value == 0 {
                return invalid(key, "must be greater than 0".into());
            }
        }
        // Upper bounds the worker's semaphores can hold (tokio's limit is usize::MAX >> 3),
        // well past any real use: a larger value is a typo, refused here rather than a
        // worker that panics at boot.
        if self.server.max_connections > 1 << 20 {
            let message =
                format!("{} is more than 1048576 (the kernel's default open-file limit)", self.server.max_connections);
            return invalid("server.max_connections", message);
        }
        if self.server.max_body_bytes_in_flight > 1 << 40 {
            let message = format!("{} is more than 1 TiB", self.server.max_body_bytes_in_flight);
            return invalid("server.max_body_bytes_in_flight", message);
        }
        if self.server.max_body_bytes_in_flight < self.server.max_body_bytes {
            return invalid(
                "server.max_body_bytes_in_flight",
                format!("must be at least server.max_body_bytes ({})", self.server.max_body_bytes),
            );
        }
        if self.server.max_header_bytes < 8192 {
            return invalid(
                "server.max_header_bytes",
                format!("{} is below the minimum of 8192", self.server.max_header_bytes),
            );
        }
        for (key, value) in [
            ("server.graceful_timeout_secs", self.server.graceful_timeout_secs),
            ("server.boot_timeout_secs", self.server.boot_timeout_secs),
            ("server.header_timeout_secs", self.server.header_timeout_secs),
            ("server.body_timeout_secs", self.server.body_timeout_secs),
            ("server.write_timeout_secs", self.server.write_timeout_secs),
            ("server.idle_timeout_secs", self.server.idle_timeout_secs),
            ("server.request_timeout_secs", self.server.request_timeout_secs),
            ("server.memory_check_interval_secs", self.server.memory_check_interval_secs),
            ("models.load_timeout_secs", self.models.load_timeout_secs),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return invalid(key, format!("{value} is not a positive number of seconds"));
            }
            if value > MAX_SECONDS {
                return invalid(key, format!("{value} s is more than a year ({MAX_SECONDS} s)"));
            }
        }
        let age = self.server.max_worker_age_secs;
        if !(age.is_finite() && (0.0..=MAX_SECONDS).contains(&age)) {
            return invalid(
                "server.max_worker_age_secs",
                format!("{age}: must be 0 (never) or up to a year of seconds"),
            );
        }
        if self.server.control_socket.as_os_str().is_empty() {
            return invalid("server.control_socket", "must not be empty".into());
        }
        if self.models.default.is_empty() {
            return invalid("models.default", "must name a model folder".into());
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.server.listen_addr()
    }

    /// Resolves a path from the file against the file's directory.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.base_dir.join(path)
        }
    }

    pub fn control_socket(&self) -> PathBuf {
        self.resolve(&self.server.control_socket)
    }

    /// The admin listener's tokens (`admin.token_file`), read now; None: no token set.
    pub fn admin_tokens(&self) -> Result<Option<crate::auth::ApiKeys>, ConfigError> {
        let Some(file) = &self.admin.token_file else { return Ok(None) };
        crate::auth::ApiKeys::from_file(&self.resolve(file), self.admin.protect_metrics)
            .map(Some)
            .map_err(|e| ConfigError::Invalid { key: "admin.token_file", message: e.to_string() })
    }

    /// The API keys requests must carry (`[auth]`, INFERD_API_KEYS), read now; None: none.
    pub fn api_keys(&self) -> Result<Option<crate::auth::ApiKeys>, ConfigError> {
        let file = self.auth.api_keys_file.as_ref().map(|f| self.resolve(f));
        crate::auth::ApiKeys::load(file.as_deref(), self.auth.protect_health)
    }

    /// What the public port serves and whom: the API keys, the TLS files and the key model
    /// signatures verify against, read now (at start and at every reload).
    pub fn access(&self) -> Result<crate::auth::Access, ConfigError> {
        Ok(crate::auth::Access {
            api_keys: self.api_keys()?,
            tls: self.server_tls().load("server")?,
            signatures: self.trust()?,
            restricted: self.restrictions()?,
        })
    }

    /// `[[auth.restricted]]`, checked.
    pub fn restrictions(&self) -> Result<crate::restricted::Restrictions, ConfigError> {
        crate::restricted::Restrictions::of(&self.auth.restricted)
            .map_err(|message| ConfigError::Invalid { key: "auth.restricted", message })
    }

    /// `[models] signatures` with its public key, read now (at start and at every reload).
    pub fn trust(&self) -> Result<crate::signing::Trust, ConfigError> {
        let key = self.models.signature_public_key.as_ref().map(|k| self.resolve(k));
        let chain: Vec<PathBuf> = self.models.signature_certificate_chain.iter().map(|c| self.resolve(c)).collect();
        crate::signing::Trust::load(self.models.signatures, key.as_deref(), &chain)
            .map_err(|e| ConfigError::Invalid { key: "models.signature_public_key", message: e.to_string() })
    }

    /// `[server]`'s TLS files, resolved.
    pub fn server_tls(&self) -> crate::tls::TlsPaths {
        let s = &self.server;
        self.tls_paths([&s.tls_cert, &s.tls_key, &s.tls_client_ca])
    }

    /// `[admin]`'s TLS files, resolved.
    pub fn admin_tls(&self) -> crate::tls::TlsPaths {
        let a = &self.admin;
        self.tls_paths([&a.tls_cert, &a.tls_key, &a.tls_client_ca])
    }

    fn tls_paths(&self, [cert, key, client_ca]: [&Option<PathBuf>; 3]) -> crate::tls::TlsPaths {
        let resolve = |p: &Option<PathBuf>| p.as_deref().map(|p| self.resolve(p));
        crate::tls::TlsPaths { cert: resolve(cert), key: resolve(key), client_ca: resolve(client_ca) }
    }

    /// `[tracing]`, its files' paths resolved.
    pub fn tracing_config(&self) -> TracingConfig {
        let resolve = |p: &Option<PathBuf>| p.as_deref().map(|p| self.resolve(p));
        TracingConfig {
            certificate: resolve(&self.tracing.certificate),
            client_certificate: resolve(&self.tracing.client_certificate),
            client_key: resolve(&self.tracing.client_key),
            ..self.tracing.clone()
        }
    }

    /// Where a model may be loaded from by path (the admin listener's `load`, `inferd reload
    /// --path`): the repository and `admin.allowed_paths`, resolved.
    pub fn allowed_model_paths(&self) -> Vec<PathBuf> {
        let mut allowed = vec![self.model_repository()];
        allowed.extend(self.admin.allowed_paths.iter().map(|p| self.resolve(p)));
        allowed
    }

    /// `runtime.cache_dir`, resolved; None when it is empty (shared weights off).
    pub fn weights_cache(&self) -> Option<PathBuf> {
        (!self.runtime.cache_dir.as_os_str().is_empty()).then(|| self.resolve(&self.runtime.cache_dir))
    }

    /// The pool's registry of Triton's system shared-memory regions: a folder beside the
    /// control socket (`control.sock.shm`), which the supervisor empties at a fresh start.
    pub fn shared_memory_registry(&self) -> PathBuf {
        let mut path = self.control_socket().into_os_string();
        path.push(".shm");
        PathBuf::from(path)
    }

    pub fn model_repository(&self) -> PathBuf {
        self.resolve(&self.models.repository)
    }

    /// Reads model `name` from the repository, with the command line's model settings.
    pub fn load_model(&self, name: &str) -> Result<ModelEntry, ConfigError> {
        self.model_override.apply(ModelEntry::load(&self.model_repository(), name)?)
    }

    /// With `[models] on_demand`, the repository's models besides `pinned` (those every
    /// worker loads), sorted by name, each resolved as [`Config::load_model`] resolves it; and
    /// the model folders that do not resolve, with why. Nothing when on_demand is off.
    pub fn on_demand_models(&self, pinned: &[ModelEntry]) -> (Vec<ModelEntry>, Vec<(String, ConfigError)>) {
        let (mut found, mut refused) = (Vec::new(), Vec::new());
        if !self.models.on_demand {
            return (found, refused);
        }
        for name in ModelEntry::folders(&self.model_repository()) {
            if pinned.iter().any(|m| m.name == name) {
                continue;
            }
            match self.load_model(&name) {
                Ok(entry) => found.push(entry),
                Err(e) => refused.push((name, e)),
            }
        }
        (found, refused)
    }

    /// The models every worker loads, default first.
    pub fn model_names(&self) -> Vec<String> {
        let mut names = vec![self.models.default.clone()];
        names.extend(self.models.load.iter().filter(|n| **n != self.models.default).cloned());
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config =
            toml::from_str(text).map_err(|e| ConfigError::Parse { path: "t.toml".into(), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn defaults_are_valid() {
        let config = parse("").unwrap();
        assert_eq!(config.server.listen, "127.0.0.1:8000");
        assert_eq!(config.model_names(), vec!["minilm".to_string()]);
    }

    #[test]
    fn limits_past_what_a_worker_can_hold_are_refused() {
        let err = parse("[server]\nmax_connections = 4611686018427387904\n").unwrap_err().to_string();
        assert!(err.contains("server.max_connections") && err.contains("more than 1048576"), "{err}");
        let err = parse("[server]\nmax_body_bytes_in_flight = 4611686018427387904\n").unwrap_err().to_string();
        assert!(err.contains("server.max_body_bytes_in_flight") && err.contains("1 TiB"), "{err}");
        parse("[server]\nmax_connections = 1048576\nmax_body_bytes_in_flight = 1099511627776\n").unwrap();
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("[server]\nworkerz = 2\n").unwrap_err().to_string();
        assert!(err.contains("workerz"), "{err}");
    }

    #[test]
    fn impossible_values_name_their_key() {
        let err = parse("[server]\nlisten = \"localhost\"\n").unwrap_err().to_string();
        assert!(err.contains("server.listen"), "{err}");
        let err = parse("[server]\ngraceful_timeout_secs = -1\n").unwrap_err().to_string();
        assert!(err.contains("server.graceful_timeout_secs"), "{err}");
        let err = parse("[server]\nworkers = \"two\"\n").unwrap_err().to_string();
        assert!(err.contains("workers"), "{err}");
        let err = parse("[server]\ngrpc_listen = \"8001\"\n").unwrap_err().to_string();
        assert!(err.contains("server.grpc_listen") && err.contains("IP:port"), "{err}");
        let err = parse("[server]\ngrpc_listen = \"127.0.0.1:8000\"\n").unwrap_err().to_string();
        assert!(err.contains("server.grpc_listen") && err.contains("already"), "{err}");
        let config = parse("[server]\ngrpc_listen = \"127.0.0.1:8001\"\n").unwrap();
        assert_eq!(config.server.grpc_addr().map(|a| a.port()), Some(8001));
        assert_eq!(parse("").unwrap().server.grpc_addr(), None);
    }

    #[test]
    fn the_allocator_is_one_of_four() {
        assert_eq!(parse("").unwrap().runtime.allocator, Allocator::SharedArena);
        for (name, choice) in [("arena-shrink", Allocator::ArenaShrink), ("malloc", Allocator::Malloc)] {
            let text = format!("[runtime]\nallocator = \"{name}\"\n");
            assert_eq!(parse(&text).unwrap().runtime.allocator, choice);
        }
        let err = parse("[runtime]\nallocator = \"jemalloc\"\n").unwrap_err().to_string();
        assert!(err.contains("jemalloc") && err.contains("shared-arena"), "{err}");
    }

    #[test]
    fn what_timers_and_counters_cannot_hold_is_refused() {
        for key in ["graceful_timeout_secs", "boot_timeout_secs", "request_timeout_secs", "max_worker_age_secs"] {
            let err = parse(&format!("[server]\n{key} = 1e300\n")).unwrap_err().to_string();
            assert!(err.contains(&format!("server.{key}")) && err.contains("year"), "{err}");
        }
        parse("[server]\nmax_worker_age_secs = 86400\n").unwrap();
        // Any number of models: the counters' rows bound only which are counted by name.
        let forty = (1..40).map(|i| format!("\"m{i}\"")).collect::<Vec<_>>().join(", ");
        parse(&format!("[models]\ndefault = \"m0\"\nload = [{forty}]\n")).unwrap();
    }

    #[test]
    fn models_on_demand_are_off_by_default_and_wait_a_bounded_time() {
        let models = parse("").unwrap().models;
        assert_eq!((models.on_demand, models.load_timeout_secs), (false, 120.0));
        let models = parse("[models]\non_demand = true\nload_timeout_secs = 30\n").unwrap().models;
        assert_eq!((models.on_demand, models.load_timeout_secs), (true, 30.0));
        assert_eq!((models.memory_budget, models.eviction), (None, Eviction::Lru));
        for (written, bytes) in
            [("\"2GiB\"", 2u64 << 30), ("\"512 MiB\"", 512 << 20), ("\"1.5GB\"", 1_500_000_000), ("4096", 4096)]
        {
            let models = parse(&format!("[models]\nmemory_budget = {written}\neviction = \"sieve\"\n")).unwrap().models;
            assert_eq!((models.memory_budget, models.eviction), (Some(ByteSize(bytes)), Eviction::Sieve), "{written}");
        }
        for bad in ["\"2 parsecs\"", "\"GiB\"", "\"-1GiB\"", "-5", "\"1e30TiB\""] {
            let err = parse(&format!("[models]\nmemory_budget = {bad}\n")).unwrap_err().to_string();
            assert!(err.contains("memory_budget"), "{bad}: {err}");
        }
        for bad in ["0", "-1", "1e300"] {
            let err = parse(&format!("[models]\nload_timeout_secs = {bad}\n")).unwrap_err().to_string();
            assert!(err.contains("models.load_timeout_secs"), "{err}");
        }
    }

    #[test]
    fn models_on_demand_are_the_other_folders_that_resolve() {
        let repository = std::env::temp_dir().join(format!("inferd-config-on-demand-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&repository);
        for (name, says) in [("a", "a"), ("b", "b"), ("c", "c"), ("broken", "other")] {
            let dir = repository.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("model.onnx"), b"x").unwrap();
            let toml = format!("name = \"{says}\"\nversion = \"1\"\nfile = \"model.onnx\"\n");
            std::fs::write(dir.join(crate::model::MODEL_CONFIG_FILE), toml).unwrap();
        }
        std::fs::create_dir_all(repository.join("empty")).unwrap();
        let mut config = parse("[models]\ndefault = \"a\"\nload = [\"b\"]\n").unwrap();
        config.models.repository = repository.clone();
        let pinned: Vec<ModelEntry> = config.model_names().iter().map(|n| config.load_model(n).unwrap()).collect();
        let (found, refused) = config.on_demand_models(&pinned);
        assert!(found.is_empty() && refused.is_empty(), "off by default");
        config.models.on_demand = true;
        let (found, refused) = config.on_demand_models(&pinned);
        assert_eq!(found, vec![config.load_model("c").unwrap()]);
        let refused: Vec<String> = refused.iter().map(|(name, e)| format!("{name}: {e}")).collect();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with("broken: ") && refused[0].contains("it must be \"broken\""), "{refused:?}");
        let _ = std::fs::remove_dir_all(&repository);
    }

    #[test]
    fn the_default_model_is_always_loaded_first() {
        let config = parse("[models]\ndefault = \"a\"\nload = [\"b\", \"a\"]\n").unwrap();
        assert_eq!(config.model_names(), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn overrides_win_and_are_validated() {
        let mut config = parse("[server]\nworkers = 2\n").unwrap();
        config
            .apply(&Overrides { workers: Some(3), listen: Some("127.0.0.1:9".into()), ..Default::default() })
            .unwrap();
        assert_eq!(config.server.workers, 3);
        assert_eq!(config.listen_addr().port(), 9);
        let err = config.apply(&Overrides { listen: Some("nope".into()), ..Default::default() }).unwrap_err();
        assert!(err.to_string().contains("server.listen"));
    }

    #[test]
    fn relative_paths_follow_the_file() {
        let mut config = parse("[models]\nrepository = \"m\"\n").unwrap();
        config.base_dir = PathBuf::from("/srv/inferd");
        assert_eq!(config.model_repository(), PathBuf::from("/srv/inferd/m"));
    }

    #[test]
    fn a_tracing_section_is_checked_key_by_key() {
        let good = "[tracing]\nendpoint = \"http://collector:4318\"\nprotocol = \"grpc\"\nsample_ratio = 0.1\n";
        let tracing = parse(good).unwrap().tracing;
        assert_eq!((tracing.protocol.as_deref(), tracing.sample_ratio), (Some("grpc"), Some(0.1)));
        for (bad, key) in [
            ("protocol = \"http/json\"", "tracing.protocol"),
            ("sample_ratio = 1.5", "tracing.sample_ratio"),
            ("timeout_secs = 0", "tracing.timeout_secs"),
            ("max_queued_spans = 2000000", "tracing.max_queued_spans"),
            ("endpoint = \"ftp://collector:4318\"", "tracing.endpoint"),
            ("certificate = \"/nonexistent/ca.pem\"", "tracing.certificate"),
            ("client_certificate = \"/etc/hostname\"", "tracing.client_key"),
            ("endpoint = \"collector:4318\"", "tracing.endpoint"),
        ] {
            let err = parse(&format!("[tracing]\n{bad}\n")).unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }
}
