//! HTTP/1.1 connections, plain or TLS, from accept to their end: each served by hyper in a
//! task of its own, shed (`Connection: close`) past the worker's share of the port, and on
//! drain finished at a request boundary and closed or handed to a sibling.

use std::net::SocketAddr;
use std::os::fd::FromRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderValue, CONNECTION};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use inferd_ipc::balance::{Balance, Entry, WORKER_BALANCE_FD};
use inferd_ipc::limits::{Limits, Seat, WORKER_LIMITS_FD};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tracing::{debug, error, info, warn};

use super::boot::BACKLOG;
use crate::http::handle;
use crate::http::handoff::{Handoff, Prefixed};
use crate::http::write_timeout::WriteTimeout;
use crate::request::app::AppState;

/// Connections accepted whose first request has not been read yet. Draining waits for them:
/// told to shut down before reading its request, hyper would close such a connection
/// unanswered, although its client has sent the request (it did so right after connecting).
#[derive(Default)]
pub(super) struct Fresh(pub(super) std::sync::atomic::AtomicUsize);

/// One accepted connection's place in [`Fresh`], given up at its first request or its end.
struct FreshGuard {
    fresh: Arc<Fresh>,
    counted: std::sync::atomic::AtomicBool,
}

impl FreshGuard {
    fn new(fresh: &Arc<Fresh>) -> Arc<FreshGuard> {
        fresh.0.fetch_add(1, Ordering::Relaxed);
        Arc::new(FreshGuard { fresh: fresh.clone(), counted: true.into() })
    }

    fn seen(&self) {
        if self.counted.swap(false, Ordering::Relaxed) {
            self.fresh.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for FreshGuard {
    fn drop(&mut self) {
        self.seen();
    }
}

/// A connection's bytes: plain TCP, with what a sibling had already read of it when it was
/// handed over, or TLS, which is never handed over (its session lives in this process).
type Stream = Either<Prefixed<tokio::net::TcpStream>, tokio_rustls::server::TlsStream<tokio::net::TcpStream>>;

/// How long a retiring worker keeps an idle TLS connection open for its next request (answered
/// with `Connection: close`) before closing it: such a connection cannot be handed over, and
/// closing it at once could cross a request its client is sending on it.
const TLS_LINGER: Duration = Duration::from_secs(2);

/// What a client that sends plain HTTP to a TLS port is answered (its bytes are not a TLS
/// handshake, so it could read no TLS alert).
const PLAIN_ON_TLS: &str = "this port speaks TLS (server.tls_cert): connect with https\n";

/// Runs a TLS handshake, within `timeout` (server.header_timeout_secs: a client that stalls
/// it is a slowloris too); None when it fails (logged at debug: scanners cause many).
pub(super) async fn handshake(
    acceptor: &TlsAcceptor,
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    timeout: Duration,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    let accepted = async {
        let mut first = [0u8; 1];
        // 0x16 starts every TLS handshake record; anything else is no TLS client.
        if stream.peek(&mut first).await? == 1 && first[0] != 0x16 {
            let reply = format!(
                "HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Type: text/plain\r\n\
                 Content-Length: {}\r\n\r\n{PLAIN_ON_TLS}",
                PLAIN_ON_TLS.len()
            );
            stream.write_all(reply.as_bytes()).await?;
            let _ = stream.shutdown().await;
            // Read what the client still sends (a body, up to 64 KiB) before closing: closed
            // with bytes unread, the socket would reset the connection, and the client could
            // lose the answer.
            let (mut sink, mut left) = ([0u8; 4096], 64 * 1024usize);
            while left > 0 {
                match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut sink)).await {
                    Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
                    _ => break,
                }
            }
            return Err(std::io::Error::other("not a TLS handshake (answered 400)"));
        }
        acceptor.accept(stream).await
    };
    match tokio::time::timeout(timeout, accepted).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(e)) => {
            debug!("TLS handshake with {peer} failed: {e}");
            None
        }
        Err(_) => {
            debug!("TLS handshake with {peer} not done within {timeout:?} (server.header_timeout_secs)");
            None
        }
    }
}

/// After an accept error: a socket that no longer listens was taken out of the port's group
/// by the supervisor (its slot had no worker left to accept, see `SlotSockets::leave`) just as
/// this worker joined it; the worker joins again. Other errors (out of descriptors) back off
/// instead of spinning.
pub(super) async fn accept_failed(listener: &mut tokio::net::TcpListener, error: std::io::Error) {
    if error.raw_os_error() == Some(libc::EINVAL) {
        match rejoin(listener) {
            Ok(()) => return info!("the slot's socket had left the port; listening again"),
            Err(e) => warn!("cannot listen again: {e}"),
        }
    } else {
        warn!("accept failed: {error}");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Listens again on a socket taken out of the port, through a new registration with the
/// reactor: leaving put the socket in TCP_CLOSE, which polls as a hang-up, and tokio keeps a
/// hang-up in the old registration's readiness for good, so accepting through it would find
/// it ready forever and spin the I/O thread (seen: a worker replaced as stuck after 60 s).
fn rejoin(listener: &mut tokio::net::TcpListener) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(&*listener).try_clone()?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    *listener = tokio::net::TcpListener::from_std(socket.into())?;
    Ok(())
}

/// What open connections are told when the worker drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drain {
    Serving,
    /// The pool stops: finish the request in progress, then close.
    Close,
    /// Retired while siblings carry on: finish the request in progress, then hand the
    /// connection to a sibling (see [`crate::http::handoff`]).
    Handoff,
}

/// What every connection of this worker is served with.
pub(super) struct Connections {
    pub(super) state: Arc<AppState>,
    pub(super) http: hyper::server::conn::http1::Builder,
    pub(super) fresh: Arc<Fresh>,
    /// server.max_requests_per_connection (0: no limit).
    pub(super) limit: u64,
    /// This worker's entry in the pool's connection table: a worker with more than its share
    /// of the port's connections announces `Connection: close` (see `inferd_ipc::balance`).
    pub(super) balance: Option<Arc<Entry>>,
    /// server.write_timeout_secs.
    pub(super) write_timeout: Duration,
    pub(super) drain: watch::Receiver<Drain>,
    pub(super) handoff: Option<Arc<Handoff>>,
    /// TLS handshakes (server.tls_cert), bounded by the header timeout.
    pub(super) tls: Option<TlsAcceptor>,
    pub(super) header_timeout: Duration,
}

impl Connections {
    /// Serves one connection in a task of its own; `read`: bytes already read from it (by the
    /// worker that handed it over: plain TCP). The permit is held until the connection is gone.
    pub(super) fn serve(
        self: &Arc<Self>,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
        read: Vec<u8>,
        permit: OwnedSemaphorePermit,
    ) {
        let _ = stream.set_nodelay(true);
        let this = self.clone();
        let guard = FreshGuard::new(&self.fresh);
        tokio::spawn(async move {
            let stream = match &this.tls {
                None => Either::Left(Prefixed::new(read, stream)),
                Some(tls) => match handshake(tls, stream, peer, this.header_timeout).await {
                    Some(stream) => Either::Right(stream),
                    None => return,
                },
            };
            this.run(stream, peer, guard).await;
            drop(permit);
        });
    }

    /// Serves requests on `stream` until it closes, is closed, or is handed over (drain).
    async fn run(&self, stream: Stream, peer: SocketAddr, guard: Arc<FreshGuard>) {
        let state = self.state.clone();
        let first = guard.clone();
        // Set once this connection is to close after its answer (the client asked, or the
        // server announced it): such a connection is never handed over.
        let closing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (closes, draining) = (closing.clone(), self.drain.clone());
        // service_fn takes an Fn: the count is a Cell (one connection, one task).
        let (served, limit) = (std::cell::Cell::new(0u64), self.limit);
        // Counted in the pool's table until it is announced to close, or ends.
        let balance = self.balance.as_ref();
        if let Some(entry) = balance {
            entry.add(1);
        }
        let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            first.seen();
            served.set(served.get() + 1);
            let served = served.get();
            let asked = request.version() == hyper::Version::HTTP_10
                || request.headers().get(CONNECTION).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            let response = handle(state.clone(), peer, request);
            let (closes, draining) = (closes.clone(), draining.clone());
            // Boxed: the connection is polled by hand (poll_without_shutdown), which needs an
            // Unpin future.
            Box::pin(async move {
                let mut reply = response.await?;
                // Announced, so the client knows before it sends again: after `limit`
                // requests, and while this worker holds more than its share of the port's
                // connections (its next connection is placed afresh by the kernel), and for
                // a request answered while the worker drains (an idle connection is handed
                // over instead, but this one was busy).
                let shed = || !asked && balance.is_some_and(|entry| entry.over_share());
                if (limit > 0 && served >= limit) || *draining.borrow() != Drain::Serving || shed() {
                    reply.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
                }
                let announced = reply.headers().get(CONNECTION).is_some_and(|v| v.as_bytes() == b"close");
                // Counted out at once, so that the connections answered next see it gone.
                if (asked || announced) && !closes.swap(true, Ordering::Relaxed) {
                    if let Some(entry) = balance {
                        entry.add(-1);
                    }
                }
                Ok::<_, std::convert::Infallible>(reply)
            })
        });
        let tls = matches!(stream, Either::Right(_));
        let io = WriteTimeout::new(stream, self.write_timeout);
        let mut connection = self.http.serve_connection(TokioIo::new(io), service);
        let mut drain = self.drain.clone();
        let mut told = None;
        // Retired, a TLS connection is closed at a request boundary only after TLS_LINGER.
        let mut linger: Option<tokio::time::Instant> = None;
        let ended = loop {
            tokio::select! {
                ended = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => break ended,
                mode = drain.wait_for(|d| *d != Drain::Serving), if told.is_none() => {
                    let mode = mode.map_or(Drain::Close, |m| *m);
                    told = Some(mode);
                    match mode == Drain::Handoff && tls {
                        true => linger = Some(tokio::time::Instant::now() + TLS_LINGER),
                        // At a request boundary: now if idle, else after the current answer.
                        false => std::pin::Pin::new(&mut connection).graceful_shutdown(),
                    }
                }
                _ = tokio::time::sleep_until(linger.unwrap_or_else(tokio::time::Instant::now)), if linger.is_some() => {
                    linger = None;
                    std::pin::Pin::new(&mut connection).graceful_shutdown();
                }
            }
        };
        if let Some(entry) = self.balance.as_ref().filter(|_| !closing.load(Ordering::Relaxed)) {
            entry.add(-1);
        }
        let parts = connection.into_parts();
        match (told, ended, &self.handoff, parts.io.into_inner().into_inner()) {
            (Some(Drain::Handoff), Ok(()), Some(handoff), Either::Left(plain)) if !closing.load(Ordering::Relaxed) => {
                // What hyper read, then what it had not read yet of an earlier hand-off.
                let (stream, unread) = plain.into_parts();
                let mut read = parts.read_buf.to_vec();
                read.extend_from_slice(&unread);
                let sent = match stream.into_std() {
                    Ok(stream) => handoff.send(stream, &read).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = sent {
                    debug!("closing a connection that could not be handed over: {e}");
                }
            }
            // Closed as hyper would: FIN after the last answer (a 4xx for a bad request
            // included), so that the client reads it before the socket goes; over TLS after
            // a close_notify.
            (_, ended, _, mut stream) => {
                if let Err(e) = ended {
                    debug!("connection ended: {e}");
                }
                let _ = stream.shutdown().await;
            }
        }
        drop(guard);
    }
}

/// This worker's entry in the pool's connection table on [`WORKER_BALANCE_FD`], taken as it
/// starts accepting (None, with a warning, when it cannot be had: the worker then only
/// closes connections after `max_requests_per_connection`).
pub(super) fn balance_entry() -> Option<Arc<Entry>> {
    // SAFETY: the supervisor hands this descriptor when the spec says `balance`; mapped, then
    // closed.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_BALANCE_FD) };
    let entry = Balance::map(fd).map(|table| table.join(std::process::id(), 0));
    match entry {
        Ok(Some(entry)) => Some(Arc::new(entry)),
        Ok(None) => {
            warn!("the pool's connection table is full: this worker does not balance its connections");
            None
        }
        Err(e) => {
            warn!("cannot map the pool's connection table on fd {WORKER_BALANCE_FD}: {e}");
            None
        }
    }
}

/// Returns once the worker drains (or the drain signal is gone).
pub(super) async fn draining(drain: &mut watch::Receiver<Drain>) {
    let _ = drain.wait_for(|d| *d != Drain::Serving).await;
}

/// This worker's row in the pool's table of API key limits (see `inferd_ipc::limits`).
pub(super) fn limits_seat() -> Option<Seat> {
    // SAFETY: the supervisor hands this descriptor when the spec says `limits`; mapped, then
    // closed.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_LIMITS_FD) };
    match Limits::map(fd).map(|table| table.join(std::process::id())) {
        Ok(Some(seat)) => Some(seat),
        Ok(None) => {
            error!("the pool's table of API key limits is full: this worker neither limits nor counts keys");
            None
        }
        Err(e) => {
            error!("cannot map the pool's table of API key limits on fd {WORKER_LIMITS_FD}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The supervisor takes a slot's socket out of the port (`shutdown`) just as this worker
    /// listens on it: accepting fails with EINVAL, the worker listens again, and then waits for
    /// connections as before, its I/O thread free (it once spun there for good).
    #[test]
    fn a_socket_taken_out_of_the_port_is_joined_again_without_spinning() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                // A port of its own, bound as the supervisor binds a slot's (an ephemeral one
                // would be given up by the shutdown below).
                let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
                socket.set_reuse_address(true).unwrap();
                socket.set_reuse_port(true).unwrap();
                socket.bind(&addr.into()).unwrap();
                socket.listen(BACKLOG).unwrap();
                socket.set_nonblocking(true).unwrap();
                let mut listener = tokio::net::TcpListener::from_std(socket.into()).unwrap();
                nix::sys::socket::shutdown(listener.as_raw_fd(), nix::sys::socket::Shutdown::Read).unwrap();
                let error = listener.accept().await.unwrap_err();
                assert_eq!(error.raw_os_error(), Some(libc::EINVAL), "{error}");
                accept_failed(&mut listener, error).await;
                // Nobody connects: accepting waits, and a timer on the same thread fires.
                let idle = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
                assert!(idle.is_err(), "accepted {idle:?} with nobody connecting");
                let client = std::thread::spawn(move || std::net::TcpStream::connect(addr));
                let accepted = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await;
                assert!(matches!(accepted, Ok(Ok(_))), "{accepted:?}");
                client.join().unwrap().unwrap();
            });
            let _ = done.send(());
        });
        finished.recv_timeout(Duration::from_secs(30)).expect("the I/O thread is stuck (or the test panicked)");
    }
}
