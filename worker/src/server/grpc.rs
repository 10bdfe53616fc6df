//! gRPC connections: HTTP/2 served by hyper with tonic's service, each call's body charged
//! as it arrives, GOAWAY on drain and after `idle_timeout_secs` without a call.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tracing::debug;

use super::connections::{accept_failed, draining, handshake, Drain};
use crate::http::write_timeout::WriteTimeout;
use crate::request::app::AppState;

/// Concurrent streams per gRPC connection (each is a request, whose bytes the byte budget
/// counts as they arrive).
const MAX_GRPC_STREAMS: u32 = 64;

/// What a gRPC connection is served with, from the [server] settings.
#[derive(Clone, Copy)]
pub(super) struct GrpcLimits {
    pub(super) max_header_bytes: usize,
    /// How long a peer may leave a keep-alive ping unanswered, or take over its TLS handshake
    /// (server.header_timeout_secs).
    pub(super) unanswered: Duration,
    /// server.write_timeout_secs.
    pub(super) write: Duration,
    /// server.idle_timeout_secs.
    pub(super) idle: Duration,
}

/// A gRPC connection's open calls, and when the last one ended.
struct Calls {
    open: std::sync::atomic::AtomicUsize,
    since: std::sync::Mutex<Instant>,
}

/// One open call: counted from its arrival until its handler answered.
pub(crate) struct Call(Arc<Calls>);

impl Call {
    fn new(calls: &Arc<Calls>) -> Call {
        calls.open.fetch_add(1, Ordering::Relaxed);
        Call(calls.clone())
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        *self.0.since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Calls {
    /// How long the connection has had no call open (zero while one is).
    fn idle(&self) -> Duration {
        if self.open.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        self.since.lock().unwrap_or_else(|e| e.into_inner()).elapsed()
    }
}

/// Accepts gRPC connections (HTTP/2, each request a stream) until the worker drains, under
/// the same per-worker connection limit as HTTP. On drain, and once a connection has had no
/// call open for server.idle_timeout_secs, it is told GOAWAY: streams in progress finish, and
/// the client opens its next connection (to the worker that replaced this one, or a
/// sibling); gRPC clients retry a stream the GOAWAY refused on their own. Each
/// call's body is read and charged by [`crate::http::grpc::intake`] before tonic decodes it.
pub(super) async fn serve_grpc(
    mut listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    connections: Arc<tokio::sync::Semaphore>,
    mut drain: watch::Receiver<Drain>,
    limits: GrpcLimits,
    tls: Option<TlsAcceptor>,
) {
    let service = crate::http::grpc::service(state.clone());
    let mut http2 = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    http2
        .timer(hyper_util::rt::TokioTimer::new())
        .max_header_list_size(limits.max_header_bytes.min(u32::MAX as usize) as u32)
        // Explicit, not hyper's default: streams one connection may have open at once.
        .max_concurrent_streams(MAX_GRPC_STREAMS)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(limits.unanswered);
    loop {
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            _ = draining(&mut drain) => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(&mut listener, e).await;
                    continue;
                }
            },
            _ = draining(&mut drain) => break,
        };
        let _ = stream.set_nodelay(true);
        let calls = Arc::new(Calls { open: 0.into(), since: Instant::now().into() });
        let (service, state, counted) = (service.clone(), state.clone(), calls.clone());
        let call = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let (service, state, call) = (service.clone(), state.clone(), Call::new(&counted));
            async move {
                let answer = crate::http::grpc::serve(&state, peer, service, request).await;
                drop(call);
                answer
            }
        });
        let (mut drain, http2, tls) = (drain.clone(), http2.clone(), tls.clone());
        tokio::spawn(async move {
            let stream = match &tls {
                None => Either::Left(stream),
                Some(tls) => match handshake(tls, stream, peer, limits.unanswered).await {
                    Some(stream) => Either::Right(stream),
                    None => return,
                },
            };
            // Read through ShutdownFrames: h2 would drop the connection over a frame a client
            // may legitimately send as the graceful close begins (see there).
            let io = crate::http::grpc::shutdown::ShutdownFrames::new(WriteTimeout::new(stream, limits.write));
            let mut connection = http2.serve_connection(TokioIo::new(io), call);
            let mut told = false;
            loop {
                let idle = calls.idle();
                tokio::select! {
                    ended = &mut connection => {
                        if let Err(e) = ended {
                            debug!("gRPC connection ended: {e}");
                        }
                        break;
                    }
                    _ = draining(&mut drain), if !told => {
                        told = true;
                        std::pin::Pin::new(&mut connection).graceful_shutdown();
                    }
                    // Checked again when the idle time could have run out.
                    _ = tokio::time::sleep(limits.idle.saturating_sub(idle)), if !told => {
                        if calls.idle() >= limits.idle {
                            debug!("closing a gRPC connection idle for {:?} (server.idle_timeout_secs)", limits.idle);
                            told = true;
                            std::pin::Pin::new(&mut connection).graceful_shutdown();
                        }
                    }
                }
            }
            drop(permit);
        });
    }
}
