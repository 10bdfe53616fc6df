//! What the supervisor and a worker say to each other.
//!
//! The supervisor starts each worker as `inferd worker` (a fresh exec of its own binary, never
//! a bare fork) with one end of a Unix socketpair as fd 3. It writes one JSON line, the
//! [`WorkerSpec`]; the worker then writes [`WorkerMessage`] lines as it boots and drains,
//! and the supervisor writes a [`crate::triton::Answer`] line for each question a worker asks.
//! Counts, latencies and liveness (the start of the oldest run its lanes have in progress, the
//! beats of its `inferd-batch` timer thread and of its I/O loop) go through shared memory
//! instead ([`crate::stats`]), and PR_SET_PDEATHSIG tells the worker when the supervisor is
//! gone.

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
    /// The pool's registry of system shared-memory regions ([`crate::shm`]); None: the
    /// worker registers none.
    #[serde(default)]
    pub shared_memory: Option<PathBuf>,
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

/// A model as a worker serves it: what `inferd status` and the `inferd_model_info` metric show.
///
/// On the wire (a worker's `ready` and `loaded` messages, and the control socket's status) it
/// carries `weights` and `precision` twice: typed, under `weights_held` and
/// `precision_served`, and as the prose an inferd before them wrote under `weights` and
/// `precision` (`"shared"`, `"private: <why>"`; `"fp32"`, `"int8 (<what the guard
/// measured>)"`, `"fp32 (int8 refused: <why>)"`). The prose stays because during an upgrade
/// two versions read each other: an old supervisor may run workers of the new binary once it
/// replaced the old file (a respawn before `inferd upgrade`), and an old `inferd status` may
/// ask a new supervisor. Those readers take `weights` and `precision` as strings and ignore
/// keys they do not know, so they read a new sender as before; a new reader takes the typed
/// keys, and parses the prose of an old sender that has none ([`Weights::from_prose`],
/// [`Precision::from_prose`]; what it does not understand it keeps as said).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ModelInfoWire", into = "ModelInfoWire")]
pub struct ModelInfo {
    pub name: String,
    pub version: String,
    /// First 16 hex digits of the SHA-256 of the model file.
    pub sha256: String,
    pub weights: Weights,
    pub precision: Precision,
    /// Who signed the folder it was loaded from, when its signature was verified
    /// (`[models] signatures`): the key's hint and curve.
    pub signer: Option<String>,
}

impl ModelInfo {
    /// `<version label>+<sha256 prefix>`: changes whenever the file does.
    pub fn full_version(&self) -> String {
        format!("{}+{}", self.version, self.sha256)
    }
}

/// How a model's sessions hold their weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "held", rename_all = "snake_case")]
pub enum Weights {
    /// Mapped from the prepared artefact every session shares.
    Shared,
    /// This session holds its own copy, for `why`.
    Private { why: String },
    /// The prose of a sender this version does not understand, kept as it said it (empty: it
    /// said nothing). Never sent typed.
    #[serde(skip)]
    Said(String),
}

impl Default for Weights {
    fn default() -> Weights {
        Weights::Said(String::new())
    }
}

impl Weights {
    /// The prose form (see [`ModelInfo`]).
    pub fn from_prose(prose: &str) -> Weights {
        match prose.split_once(": ") {
            _ if prose == "shared" => Weights::Shared,
            Some(("private", why)) => Weights::Private { why: why.to_string() },
            _ => Weights::Said(prose.to_string()),
        }
    }
}

impl std::fmt::Display for Weights {
    /// The prose form: `shared`, `private: <why>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Weights::Shared => f.write_str("shared"),
            Weights::Private { why } => write!(f, "private: {why}"),
            Weights::Said(prose) => f.write_str(prose),
        }
    }
}

/// The precision a model's sessions run in, and what the int8 accuracy guard found (the
/// worker's int8 preparation, worker/src/load/int8/: `guard.rs` measures, `report.rs` keeps
/// the outcome and says the precision served).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "served", rename_all = "snake_case")]
pub enum Precision {
    /// fp32: as written (`guard` None), or because the guard refused int8 (`guard` says why).
    Fp32 {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        guard: Option<String>,
    },
    /// int8, with what the guard measured against fp32, the CPU's int8 class by CPUID
    /// (`avx2`, `avx512-vnni`, ...), and the type and bits of the weights (`s8` of 8 bits with
    /// VNNI; without, `s8` of 7 bits or `u8` of 8, as the guard chose); empty and 0 from a
    /// sender that did not say.
    Int8 {
        guard: String,
        #[serde(default)]
        cpu: String,
        #[serde(default)]
        weight_type: String,
        #[serde(default)]
        weight_bits: u8,
    },
    /// The prose of a sender this version does not understand, kept as it said it (empty: it
    /// said nothing). Never sent typed.
    #[serde(skip)]
    Said(String),
}

impl Default for Precision {
    fn default() -> Precision {
        Precision::Said(String::new())
    }
}

impl Precision {
    /// fp32 as written: no guard ran.
    pub const FP32: Precision = Precision::Fp32 { guard: None };

    /// The prose form (see [`ModelInfo`]): `fp32` or `int8`, then what the guard found in
    /// parentheses.
    pub fn from_prose(prose: &str) -> Precision {
        let guard = |rest: &str| rest.strip_prefix(" (").and_then(|g| g.strip_suffix(')')).map(str::to_string);
        match (prose.get(..4), prose.get(4..).unwrap_or("")) {
            (Some("fp32"), "") => Precision::FP32,
            (Some("fp32"), rest) if guard(rest).is_some() => Precision::Fp32 { guard: guard(rest) },
            (Some("int8"), rest) => match guard(rest) {
                Some(guard) => {
                    Precision::Int8 { guard, cpu: String::new(), weight_type: String::new(), weight_bits: 0 }
                }
                None => Precision::Said(prose.to_string()),
            },
            _ => Precision::Said(prose.to_string()),
        }
    }
}

impl std::fmt::Display for Precision {
    /// The prose form: `fp32`, `fp32 (<guard>)`, `int8 (<guard>)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Precision::Fp32 { guard: None } => f.write_str("fp32"),
            Precision::Fp32 { guard: Some(guard) } => write!(f, "fp32 ({guard})"),
            Precision::Int8 { guard, .. } => write!(f, "int8 ({guard})"),
            Precision::Said(prose) => f.write_str(prose),
        }
    }
}

/// [`ModelInfo`] as it is written: its typed fields, and their prose for older readers.
#[derive(Serialize, Deserialize)]
struct ModelInfoWire {
    name: String,
    version: String,
    sha256: String,
    /// The prose, written for readers before the typed keys, read from senders before them.
    #[serde(default)]
    weights: String,
    #[serde(default)]
    precision: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    weights_held: Option<Weights>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    precision_served: Option<Precision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signer: Option<String>,
}

impl From<ModelInfo> for ModelInfoWire {
    fn from(m: ModelInfo) -> ModelInfoWire {
        ModelInfoWire {
            weights: m.weights.to_string(),
            precision: m.precision.to_string(),
            weights_held: Some(m.weights).filter(|w| !matches!(w, Weights::Said(_))),
            precision_served: Some(m.precision).filter(|p| !matches!(p, Precision::Said(_))),
            name: m.name,
            version: m.version,
            sha256: m.sha256,
            signer: m.signer,
        }
    }
}

impl From<ModelInfoWire> for ModelInfo {
    fn from(w: ModelInfoWire) -> ModelInfo {
        ModelInfo {
            weights: w.weights_held.unwrap_or_else(|| Weights::from_prose(&w.weights)),
            precision: w.precision_served.unwrap_or_else(|| Precision::from_prose(&w.precision)),
            name: w.name,
            version: w.version,
            sha256: w.sha256,
            signer: w.signer,
        }
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
    /// A load of `model` was refused by its signature, for `reason` (the refusal's kind:
    /// `digest_mismatch`, `no_signature`, ...); at boot, sent before [`WorkerMessage::Failed`].
    Refused { model: String, reason: String },
    /// A question for the supervisor (a client asked the main port for Triton's statistics
    /// or repository index); the supervisor writes a [`crate::triton::Answer`] line with the
    /// same `id` back on the socketpair.
    Ask { id: u64, question: crate::triton::Question },
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
            weights: Weights::Shared,
            precision: Precision::FP32,
            signer: Some("key 85ef3151 (P-256)".into()),
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

    #[test]
    fn model_info_is_typed_and_keeps_the_prose_older_readers_take() {
        let guard = "1 of 1 MatMul/Gemm/Attention nodes in int8; min cosine 0.9990, mean 0.9995 to fp32 over 16 texts";
        let model = ModelInfo {
            name: "m".into(),
            version: "1".into(),
            sha256: "ab".into(),
            weights: Weights::Private { why: "runtime.cache_dir is not set".into() },
            precision: Precision::Int8 {
                guard: guard.into(),
                cpu: "avx2".into(),
                weight_type: "s8".into(),
                weight_bits: 7,
            },
            signer: None,
        };
        let line = serde_json::to_string(&model).unwrap();
        assert_eq!(
            line,
            format!(
                r#"{{"name":"m","version":"1","sha256":"ab","weights":"private: runtime.cache_dir is not set","precision":"int8 ({guard})","weights_held":{{"held":"private","why":"runtime.cache_dir is not set"}},"precision_served":{{"served":"int8","guard":"{guard}","cpu":"avx2","weight_type":"s8","weight_bits":7}}}}"#
            )
        );
        assert_eq!(serde_json::from_str::<ModelInfo>(&line).unwrap(), model);

        // An older reader: the prose under the names it knows, the rest ignored.
        #[derive(Deserialize)]
        struct Old {
            weights: String,
            precision: String,
        }
        let old: Old = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (old.weights.as_str(), old.precision),
            ("private: runtime.cache_dir is not set", format!("int8 ({guard})"))
        );

        // An older sender: prose alone, read into the same types.
        let said = |weights: &str, precision: &str| {
            let line = format!(
                r#"{{"name":"m","version":"1","sha256":"ab","weights":"{weights}","precision":"{precision}"}}"#
            );
            let m: ModelInfo = serde_json::from_str(&line).unwrap();
            assert_eq!((m.weights.to_string(), m.precision.to_string()), (weights.to_string(), precision.to_string()));
            (m.weights, m.precision)
        };
        assert_eq!(said("shared", "fp32"), (Weights::Shared, Precision::FP32));
        let refused = "fp32 (int8 refused: the least cosine to fp32 is 0.91)";
        let fp32 = Precision::Fp32 { guard: Some("int8 refused: the least cosine to fp32 is 0.91".into()) };
        assert_eq!(said("private: why", refused), (Weights::Private { why: "why".into() }, fp32));
        assert_eq!(said("", ""), (Weights::default(), Precision::default()));
        assert_eq!(said("mapped", "bf16"), (Weights::Said("mapped".into()), Precision::Said("bf16".into())));
        let none: ModelInfo = serde_json::from_str(r#"{"name":"m","version":"1","sha256":"ab"}"#).unwrap();
        assert_eq!((none.weights, none.precision), (Weights::default(), Precision::default()));
    }
}
