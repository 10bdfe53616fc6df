//! inferd-worker: one worker process. It loads ONNX Runtime and its models, warms them up,
//! and only then binds the shared port (SO_REUSEPORT) and serves KServe v2 over HTTP/1.1.
//!
//! Layout:
//! - [`server`]: boot sequence, listener, accept loop, graceful drain, reports to the supervisor;
//! - [`http`]: routing and the one error-to-status mapping;
//! - [`protocol`]: v2 JSON request validation and response bodies;
//! - [`engine`]: the model thread that owns the sessions;
//! - [`model`]: the only code that talks to ONNX Runtime (also used by `inferd check`);
//! - [`tensor`]: datatypes and their conversions.
//!
//! Threads of a worker with T intra-op threads, T+2 in all (measured with ORT 1.31.1: 3 for
//! T=1, 4 for T=2): 1 main thread running the async I/O (a current-thread tokio runtime), 1
//! `inferd-model` thread that runs the sessions and is the T-th member of ORT's intra-op pool,
//! T-1 ORT pool threads, and 1 ORT housekeeping thread that sleeps in a timed wait.
//!
//! Must not touch: other workers, the supervisor's state, the process table.

pub mod engine;
pub mod http;
pub mod model;
pub mod protocol;
pub mod server;
pub mod tensor;

pub use server::run;
