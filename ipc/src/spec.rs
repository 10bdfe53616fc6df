//! What the supervisor and a worker say to each other.
//!
//! The supervisor starts each worker as `inferd worker` (a fresh exec of its own binary, never
//! a bare fork) with one end of a Unix socketpair as fd 3. It writes one JSON line, the
//! [`WorkerSpec`]; the worker then writes [`WorkerMessage`] lines as it boots and drains.
//! Counts and the model thread's liveness go through shared memory instead (`stats`), and
//! PR_SET_PDEATHSIG tells the worker when the supervisor is gone.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use inferd_config::file::{Allocator, LogConfig, ServerConfig};
use inferd_config::model::ModelEntry;

/// File descriptor of the worker's end of the socketpair.
pub const WORKER_CONTROL_FD: i32 = 3;
/// File descriptor of the worker's HTTP socket: its slot's own, bound by the supervisor with
/// SO_REUSEPORT and put into listening by the worker once warm, or, under socket activation,
/// the one listening socket systemd passed, shared by every worker (see [`WorkerSpec`]).
pub const WORKER_LISTENER_FD: i32 = 5;
/// File descriptor of the slot's gRPC socket, when `server.grpc_listen` is set (as fd 5).
pub const WORKER_GRPC_LISTENER_FD: i32 = 8;
/// The two ends of the pool's hand-off socket (SOCK_SEQPACKET socketpair the supervisor
/// holds open): a draining worker sends its idle keep-alive connections into the first (one
/// message each: the connection's descriptor and the bytes already read from it), and every
/// serving worker receives from the second, so the connection carries on in a sibling.
pub const WORKER_HANDOFF_SEND_FD: i32 = 6;
pub const WORKER_HANDOFF_RECV_FD: i32 = 7;
// Signals a worker takes: SIGUSR1 retires it while its siblings carry on (replaced, scaled
// down, recycled): it drains and hands its idle keep-alive connections over. SIGTERM drains
// and closes them (the whole pool stops).

/// Exit code of a worker whose model failed to load or warm up: the supervisor does not
/// respawn it in a loop (at start-up the whole server stops with the model's error).
pub const EXIT_MODEL_LOAD: i32 = 3;
/// Exit code of a worker that failed to boot for another reason (ONNX Runtime missing, bad
/// spec); `inferd serve` exits with it too when its port cannot be bound.
pub const EXIT_BOOT: i32 = 4;
/// Exit code of a worker in which a thread panicked outside any one request's work (see
/// worker/src/panics.rs): a bug, reported as such; the slot is respawned like after a crash.
pub const EXIT_PANIC: i32 = 5;
/// Exit code of `inferd serve` and `inferd check` when the configuration cannot be used (not
/// found, unreadable, a bad key, an impossible CPU or memory plan): sysexits' EX_CONFIG, which
/// systemd names CONFIG. Like 3 and 4, restarting does not help (the unit's
/// RestartPreventExitStatus lists all three).
pub const EXIT_CONFIG: i32 = 78;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub index: usize,
    /// The pool generation whose models the worker runs (incremented by every reload).
    pub generation: u64,
    /// Why the supervisor started it.
    #[serde(default)]
    pub cause: Cause,
    /// ORT intra-op threads (the worker's share of the cores).
    pub threads: usize,
    /// CPUs the worker is pinned to (empty = not pinned).
    pub cpus: Vec<usize>,
    pub ort_library: PathBuf,
    /// The default model first.
    pub models: Vec<ModelEntry>,
    /// The [server] settings (limits and timeouts) the worker applies.
    pub server: ServerConfig,
    /// The socket at [`WORKER_LISTENER_FD`] is systemd's, listening already and shared by the
    /// whole pool: the worker accepts on it and never takes it out of the port. Otherwise it
    /// is the slot's socket, which a slot's successive workers share (docs/architecture.md,
    /// "Sockets").
    #[serde(default)]
    pub shared_listener: bool,
    /// `runtime.cache_dir`, resolved: where shared weights are prepared (None: off).
    #[serde(default)]
    pub weights_cache: Option<PathBuf>,
    /// `runtime.allocator`.
    #[serde(default)]
    pub allocator: Allocator,
    /// Fds [`WORKER_HANDOFF_SEND_FD`] and [`WORKER_HANDOFF_RECV_FD`] are the pool's
    /// hand-off socket.
    #[serde(default)]
    pub handoff: bool,
    /// The [log] settings (the format itself reaches the worker as INFERD_LOG_FORMAT, since
    /// logging starts before the spec is read).
    #[serde(default)]
    pub log: LogConfig,
    /// The keys requests must carry (digests; none: every request is served) and the TLS
    /// certificate the ports serve (none: plain TCP), as the supervisor read them for this
    /// worker's generation.
    #[serde(default)]
    pub access: inferd_config::auth::Access,
    /// The worker shares its core through the pool's claims at
    /// [`crate::cores::WORKER_CORES_FD`] (server.lend_idle_cores).
    #[serde(default)]
    pub lending: Option<Lending>,
    /// The worker counts its connections in the pool's table at
    /// [`crate::balance::WORKER_BALANCE_FD`] and sheds its excess (see [`crate::balance`]).
    #[serde(default)]
    pub balance: bool,
    /// The nice value the worker loads and warms up at (0: its own), its threads put back by
    /// as much before it listens: a replacement booting beside serving workers takes the cores
    /// they leave idle, not their requests' time (set only where the supervisor found that a
    /// thread may be put back).
    #[serde(default)]
    pub boot_nice: i32,
    /// The worker applies its API keys' rates and concurrency, and counts their requests, in
    /// the pool's table at [`crate::limits::WORKER_LIMITS_FD`].
    #[serde(default)]
    pub limits: bool,
    /// `[models] on_demand`: the repository's other models, each resolved as `models` are,
    /// which the worker loads on the first request for one; empty when off.
    #[serde(default)]
    pub on_demand: Vec<ModelEntry>,
    /// models.load_timeout_secs.
    #[serde(default)]
    pub load_timeout_secs: f64,
    /// With on_demand: the worker's share of models.memory_budget, in bytes (its resident
    /// memory stays under it when it loads a model); None: no budget.
    #[serde(default)]
    pub memory_share: Option<u64>,
    /// models.eviction.
    #[serde(default)]
    pub eviction: inferd_config::file::Eviction,
    /// [tracing]: whether and where the worker exports its spans (the standard OTEL_* variables
    /// it inherits fill in what this leaves unset).
    #[serde(default)]
    pub tracing: inferd_config::file::TracingConfig,
    /// Bytes of answers the worker may cache (its share of cache.max_bytes; 0: no cache).
    #[serde(default)]
    pub cache_bytes: u64,
    /// models.placement: with `pool` (and the connection table of [`crate::balance`]), the
    /// worker says there which models it holds and where siblings reach it.
    #[serde(default)]
    pub placement: inferd_config::file::Placement,
}

/// How a worker of one pinned thread shares cores with its siblings (see [`crate::cores`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lending {
    /// Its own core: claimed for each of its runs, so that a sibling never borrows it then.
    pub home: usize,
    /// The sibling's core it may borrow for a run while that core is idle.
    pub borrow: Option<usize>,
}

/// Why the supervisor started a worker: in its spec, the supervisor's log and `inferd status`.
/// A rolling reload waits for the worker it started itself (the supervisor tells its own by a
/// per-spawn id, never by cause or generation alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// One of the pool's first workers.
    #[default]
    Boot,
    /// The first worker of a slot that `scale +1` added.
    Scale,
    /// The slot's previous worker died (crashed, killed, stuck, over the hard memory limit).
    Respawn,
    /// A rolling reload's new worker (control socket, SIGHUP, repository load or unload).
    Reload,
    /// Replacing a worker past server.max_requests or server.max_worker_age_secs.
    Recycle,
    /// Replacing a worker over the soft memory limit, or the biggest in a pool near its cgroup's.
    Memory,
    /// Replacing a worker that caught a panic serving a request (worker/src/panics.rs).
    Fault,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Boot => "boot",
            Cause::Scale => "scale",
            Cause::Respawn => "respawn",
            Cause::Reload => "reload",
            Cause::Recycle => "recycle",
            Cause::Memory => "memory",
            Cause::Fault => "fault",
        }
    }

    /// Whether a worker started for it replaces one that served (a respawn or a recycle for
    /// age, requests, memory or a fault), not a first start or a reload.
    pub fn replaces(self) -> bool {
        matches!(self, Cause::Respawn | Cause::Recycle | Cause::Memory | Cause::Fault)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub version: String,
    /// First 16 hex digits of the SHA-256 of the model file.
    pub sha256: String,
    /// `shared` (the weights are mapped from the artefact every session shares) or
    /// `private: <why not>` (this session holds its own copy).
    #[serde(default)]
    pub weights: String,
    /// `fp32`, or `int8` with what the accuracy guard measured (see the worker's `quantize`).
    #[serde(default)]
    pub precision: String,
}

impl ModelInfo {
    /// `<version label>+<sha256 prefix>`: changes whenever the file does.
    pub fn full_version(&self) -> String {
        format!("{}+{}", self.version, self.sha256)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The model did not load or failed its warm-up.
    ModelLoad,
    /// Anything else before serving: runtime library, socket, spec.
    Boot,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerMessage {
    /// Models loaded; warm-up inferences are running.
    Warming,
    /// Warm-up done and its socket listening: the worker takes traffic from now on.
    Ready { models: Vec<ModelInfo> },
    /// The worker stopped accepting and is finishing its in-flight requests.
    Draining,
    /// Sent just before exiting with [`EXIT_MODEL_LOAD`] or [`EXIT_BOOT`].
    Failed { kind: FailureKind, error: String },
    /// Ready already, the worker loaded `model` on demand, in `seconds`, at `cost`.
    Loaded {
        model: ModelInfo,
        #[serde(default)]
        cost: ModelCost,
        #[serde(default)]
        seconds: f64,
    },
    /// The worker evicted `model`, loaded on demand, to make room for another.
    Evicted { model: String },
}

/// What a model loaded on demand holds in one worker's memory, measured across its load and
/// warm-up: the worker's own new pages (`private`: anonymous and shmem) and the file pages
/// it mapped (`mapped`: the weights, one copy in the page cache whoever maps them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCost {
    pub private: u64,
    pub mapped: u64,
}

impl ModelCost {
    pub fn total(&self) -> u64 {
        self.private + self.mapped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_json_object_each() {
        let m = WorkerMessage::Failed { kind: FailureKind::ModelLoad, error: "bad".into() };
        let line = serde_json::to_string(&m).unwrap();
        assert_eq!(line, r#"{"event":"failed","kind":"model_load","error":"bad"}"#);
        assert_eq!(serde_json::from_str::<WorkerMessage>(&line).unwrap(), m);
    }

    #[test]
    fn a_model_loaded_on_demand_is_reported_by_name() {
        let model = ModelInfo {
            name: "m".into(),
            version: "1".into(),
            sha256: "0123456789abcdef".into(),
            weights: "shared".into(),
            precision: "fp32".into(),
        };
        let cost = ModelCost { private: 3 << 20, mapped: 5 << 20 };
        let loaded = WorkerMessage::Loaded { model, cost, seconds: 0.25 };
        let line = serde_json::to_string(&loaded).unwrap();
        assert!(line.starts_with(r#"{"event":"loaded","model":{"name":"m","#), "{line}");
        assert_eq!(serde_json::from_str::<WorkerMessage>(&line).unwrap(), loaded);
        let evicted = WorkerMessage::Evicted { model: "m".into() };
        let line = serde_json::to_string(&evicted).unwrap();
        assert_eq!(line, r#"{"event":"evicted","model":"m"}"#);
    }

    #[test]
    fn causes_are_written_as_their_names() {
        for cause in
            [Cause::Boot, Cause::Scale, Cause::Respawn, Cause::Reload, Cause::Recycle, Cause::Memory, Cause::Fault]
        {
            assert_eq!(serde_json::to_string(&cause).unwrap(), format!("\"{}\"", cause.as_str()));
        }
    }
}
