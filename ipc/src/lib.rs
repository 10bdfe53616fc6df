//! inferd-ipc: what the supervisor and its workers say to each other.
//!
//! - [`spec`]: the worker's command line contract: the descriptors it is handed, the
//!   [`spec::WorkerSpec`] line it reads at start, the [`spec::WorkerMessage`] lines it writes
//!   back, its exit codes;
//! - [`stats`]: the counters each worker shares with the supervisor through a memfd (request
//!   counts, latency and batch histograms, the beats of the batch timer thread and the I/O loop);
//! - [`cores`]: which process runs on which CPU, shared by the whole pool, so that workers
//!   lend idle cores to each other;
//! - [`balance`]: each worker's open connections, shared by the whole pool, so that a worker
//!   with more than its share sheds some;
//! - [`limits`]: each API key's rate and concurrency, and its requests by priority, shared by
//!   the whole pool, so that a key's limits hold pool-wide;
//! - [`shm`]: the system shared-memory regions clients register, shared by the whole pool
//!   (a folder the supervisor empties at a fresh start);
//! - [`triton`]: Triton's statistics and repository index, which a worker asks the
//!   supervisor for to serve them on the main port.
//!
//! Must not touch: ONNX Runtime, sockets or processes; both sides link it.

pub mod balance;
pub mod cores;
pub mod limits;
mod region;
pub mod shm;
pub mod spec;
pub mod stats;
pub mod triton;

/// The version this build reports (`inferd --version`, `inferd status`, the `x-inferd-version`
/// header, the server metadata routes): `INFERD_VERSION` when the build set it (a release's
/// own string), else the package's. With the `test-switches` feature, `INFERD_TEST_VERSION`
/// at run time stands for a second build (tests of `inferd upgrade`).
pub fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        #[cfg(feature = "test-switches")]
        if let Some(v) = std::env::var("INFERD_TEST_VERSION").ok().filter(|v| !v.is_empty()) {
            return v;
        }
        option_env!("INFERD_VERSION").unwrap_or(env!("CARGO_PKG_VERSION")).to_string()
    })
}
