//! inferd-worker: one worker process. It loads ONNX Runtime and its models, warms them up,
//! and only then listens on its slot's socket of the shared port (SO_REUSEPORT) and serves
//! KServe v2 over HTTP/1.1 (and over gRPC on a second shared port when `server.grpc_listen`
//! is set).
//!
//! Layout, by layer, from the socket down (each folder uses only those below it; `layers`,
//! a test in `make test`, reads this list and fails on a `crate::` path that goes up it):
//! - [`server`]: boot sequence, listeners, accept loops (HTTP, gRPC, the siblings' socket),
//!   graceful drain, reports to the supervisor;
//! - [`http`]: the protocol surface: each HTTP request's side of the door ([`http`] itself),
//!   its route ([`http::route`]) and dispatch ([`http::dispatch`]), KServe v2's REST handlers
//!   ([`http::v2`]), TEI's, OpenAI's and Cohere's ([`http::tei`], [`http::openai`],
//!   [`http::cohere`]), KServe v2 over gRPC ([`http::grpc`]), bodies received and read
//!   ([`http::body`]), answers as hyper sends them ([`http::reply`]) and compressed where the
//!   client asks ([`http::compress`]), and connection plumbing:
//!   the hand-off of idle connections ([`http::handoff`]), requests sent to the sibling that
//!   holds their model ([`http::forward`]) and write timeouts ([`http::write_timeout`]);
//! - [`request`]: what every protocol shares: the door every request enters by
//!   ([`request::door`]: key, limits, priority, deadline, id, access line) and what it learns
//!   ([`request::call`]), the worker's state and request counting ([`request::app`]), its
//!   socketpair to the supervisor ([`request::link`]: reports, and questions only the
//!   supervisor answers), the one error type ([`request::error`]), the models it serves,
//!   loaded at boot or on demand, and their lookup ([`request::models`]: the registry, each
//!   load's single flight, eviction within the memory budget; the loader thread that serves
//!   loads on demand: [`request::on_demand`]; which models its siblings hold:
//!   [`request::placement`]), a v2 request's run ([`request::infer`]), and pipelined requests through the cache and the
//!   engine ([`request::tasks`], [`request::cache`]);
//! - [`load`]: a model loaded, above the runtime and the pipelines: its digest, the int8
//!   preparation and its accuracy guard ([`load::int8`]), its sessions, and the model the
//!   handlers see, with its pipeline built ([`load::model`]); at boot, and on demand for the
//!   request layer's loader thread;
//! - [`pipeline`]: tokenizers, image decoding, pooling and scoring around a model;
//!   [`kserve`]: KServe v2's inference request decoded, and its JSON codec; [`jsonbody`]: JSON
//!   bodies read with errors in the client's terms;
//! - [`runtime`]: everything that calls ONNX Runtime: sessions ([`runtime::model`]), the
//!   dynamic batcher and the lanes that run them ([`runtime::engine`]), where runs' buffers
//!   come from ([`runtime::allocator`]), prepared weights ([`runtime::weights`]), datatypes
//!   and values, checked against a model's inputs ([`runtime::tensor`]);
//! - [`onnx`]: read-only questions about a model file; [`protowire`]: the protobuf wire
//!   format, read by the gRPC intake and [`onnx`] and written by the int8 rewrite; [`panics`]:
//!   a panic costs its request (500, then the worker is replaced), for every layer's threads
//!   and tasks; [`trace`]: OpenTelemetry spans of a request's stages, made where each stage is
//!   timed, and their export.
//!
//! Threads of a worker with T intra-op threads: 2T+1 (measured with ORT 1.31.1: 3 for T=1,
//! 5 for T=2): the main thread running all HTTP I/O (a current-thread tokio runtime), the
//! `inferd-batch` timer thread (what falls due by the clock: a batch's wait for company, run
//! timeouts; batches are formed under the dispatcher's lock by whoever hands a job in or
//! frees a lane), T `inferd-lane-N` threads that run them (lane 0 also runs the wide sessions,
//! as the T-th member of ORT's intra-op pool), and T-1 ORT pool threads. At most T of them
//! compute at once. (ORT's telemetry thread is switched off.) A worker of one thread that
//! borrows a sibling's idle core has one ORT pool thread more, pinned to that core (4
//! threads), which computes only while the core is lent to it, and a worker of one thread has
//! its background lane (`inferd-lane-bg`, 5 threads with lending), which runs long inputs on
//! the worker's core at a lower priority. With [tracing], one more: `inferd-otlp`, asleep but
//! for an export every 200 ms. Once asked for Triton's statistics or repository index, one
//! more: `inferd-answers`, asleep on the supervisor's socketpair but for its answers.
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

pub mod http;
pub mod jsonbody;
pub mod kserve;
pub mod load;
pub mod onnx;
pub mod panics;
pub mod pipeline;
pub mod protowire;
pub mod request;
pub mod runtime;
pub mod server;
pub mod trace;

pub use server::run;

#[cfg(test)]
mod layers;
