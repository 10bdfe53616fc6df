//! inferd-worker: one worker process. It loads ONNX Runtime and its models, warms them up,
//! and only then binds the shared port (SO_REUSEPORT) and serves KServe v2 over HTTP/1.1 (and
//! over gRPC on a second shared port when `server.grpc_listen` is set).
//!
//! Layout:
//! - [`server`]: boot sequence, listeners, accept loops, graceful drain, reports to the supervisor;
//! - [`app`]: what every handler shares: the worker's state, the one error type and its status
//!   codes, model lookup, request counting;
//! - [`http`]: REST routing and error bodies; [`tei`] and [`openai`]: those APIs' handlers;
//! - [`protocol`]: v2 JSON request validation and response bodies;
//! - [`grpc`]: the same protocol over gRPC (`inference.GRPCInferenceService`);
//! - [`infer`]: a parsed v2 request run through the pipeline or the model's tensors (REST and
//!   gRPC); [`tasks`]: pipelined requests (texts, images) through the engine;
//! - [`pipeline`]: tokenizers, image decoding, pooling and scoring around a model;
//! - [`engine`]: the dynamic batcher and the lanes that own the sessions;
//! - [`model`]: the only code that talks to ONNX Runtime (also used by `inferd check`);
//! - [`allocator`]: where runs' buffers come from (`runtime.allocator`), memory handed back;
//! - [`tensor`]: datatypes and their conversions;
//! - [`panics`]: a panic costs its request (500, then the worker is replaced) or the worker;
//! - [`write_timeout`]: an answer its client does not read stalls its connection only so long.
//!
//! Threads of a worker with T intra-op threads: 2T+1 (measured with ORT 1.31.1: 3 for T=1,
//! 5 for T=2): the main thread running all HTTP I/O (a current-thread tokio runtime), the
//! `inferd-batch` dispatcher that forms batches, T `inferd-lane-N` threads that run them (lane
//! 0 also runs the wide sessions, as the T-th member of ORT's intra-op pool), and T-1 ORT pool
//! threads. At most T of them compute at once. (ORT's telemetry thread is switched off.)
//!
//! Must not touch: other workers, the supervisor's state, the process table.

/// `impl AsyncWrite` for a socket wrapper `$wrapper<T>` that changes only what is read:
/// every write goes straight to its `inner` field ([`handoff::Prefixed`],
/// [`grpc::shutdown::ShutdownFrames`]).
macro_rules! write_through_inner {
    ($wrapper:ident) => {
        impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $wrapper<T> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }
        }
    };
}

pub mod allocator;
pub mod app;
pub mod engine;
pub mod grpc;
pub mod handoff;
pub mod http;
pub mod infer;
pub mod model;
pub mod openai;
pub mod panics;
pub mod pipeline;
pub mod protocol;
pub mod protowire;
pub mod quantize;
pub mod server;
pub mod tasks;
pub mod tei;
pub mod tensor;
pub mod weights;
pub mod write_timeout;

pub use server::run;
