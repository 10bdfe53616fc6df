//! Boot and serve: spec in from the supervisor, models loaded and warmed, port bound, requests
//! served until SIGTERM/SIGINT (or the supervisor's death, via PR_SET_PDEATHSIG), then drain.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::header::{HeaderValue, CONNECTION};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use inferd_ipc::balance::{Balance, Entry, WORKER_BALANCE_FD};
use inferd_ipc::cores::CoreClaims;
use inferd_ipc::spec::{
    Cause, FailureKind, WorkerMessage, WorkerSpec, EXIT_BOOT, EXIT_MODEL_LOAD, WORKER_GRPC_LISTENER_FD,
    WORKER_HANDOFF_RECV_FD, WORKER_HANDOFF_SEND_FD, WORKER_LISTENER_FD,
};
use inferd_ipc::stats::{WorkerCounters, WORKER_STATS_FD};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tracing::{debug, error, info, warn};

use crate::http::handle;
use crate::http::handoff::{Handoff, Prefixed};
use crate::http::write_timeout::WriteTimeout;
use crate::request::app::{AppState, RequestIds};
use crate::runtime::engine::{Cores, Engine, Sessions};
use crate::runtime::model::{ModelError, ModelSession, Runtime, Threads};

/// Connections accepted whose first request has not been read yet. Draining waits for them:
/// told to shut down before reading its request, hyper would close such a connection
/// unanswered, although its client has sent the request (it did so right after connecting).
#[derive(Default)]
struct Fresh(std::sync::atomic::AtomicUsize);

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

/// Writes [`WorkerMessage`] lines to the supervisor. Writes are small and the supervisor reads
/// continuously; a 1 s write timeout keeps a stopped supervisor from blocking the worker.
struct Reporter(Mutex<UnixStream>);

impl Reporter {
    fn send(&self, message: &WorkerMessage) {
        let mut line = serde_json::to_vec(message).expect("messages serialise");
        line.push(b'\n');
        let mut stream = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = stream.write_all(&line) {
            warn!("cannot report to the supervisor: {e}");
        }
    }
}

struct Failure {
    kind: FailureKind,
    error: String,
}

fn failure(kind: FailureKind) -> impl FnOnce(String) -> Failure {
    move |error| Failure { kind, error }
}

/// Entry point of `inferd worker`: `fd` is the worker's end of the supervisor's socketpair.
/// Returns the process exit code.
pub fn run(fd: RawFd) -> i32 {
    // SAFETY: the supervisor hands the worker this descriptor and nothing else owns it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let spec = match read_spec(&stream) {
        Ok(spec) => spec,
        Err(e) => {
            error!("cannot read the worker spec on fd {fd}: {e} (this command is started by `inferd serve`)");
            return EXIT_BOOT;
        }
    };
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let reporter = Arc::new(Reporter(Mutex::new(stream)));
    let span = tracing::info_span!("worker", index = spec.index, pid = std::process::id());
    let _enter = span.enter();
    // SAFETY: the supervisor hands the worker this descriptor too; mapped here, then closed.
    let stats = match WorkerCounters::map(unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_STATS_FD) }) {
        Ok(stats) => Arc::new(stats),
        Err(e) => {
            error!("cannot map the counters on fd {WORKER_STATS_FD}: {e}");
            return EXIT_BOOT;
        }
    };
    crate::panics::install(stats.clone());
    match boot(&spec, &reporter) {
        Ok((models, listeners)) => serve(spec, models, listeners, reporter, stats),
        Err(f) => {
            error!("{}", f.error);
            reporter.send(&WorkerMessage::Failed { kind: f.kind, error: f.error });
            match f.kind {
                FailureKind::ModelLoad => EXIT_MODEL_LOAD,
                FailureKind::Boot => EXIT_BOOT,
            }
        }
    }
}

fn read_spec(stream: &UnixStream) -> Result<WorkerSpec, String> {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| e.to_string())?;
    serde_json::from_str(&line).map_err(|e| e.to_string())
}

/// The worker's ports: HTTP, and gRPC when server.grpc_listen is set; TLS on both with
/// server.tls_cert.
struct Listeners {
    http: std::net::TcpListener,
    grpc: Option<std::net::TcpListener>,
    tls: Option<Acceptors>,
}

/// The TLS handshakes of the two ports, from the certificate in the spec (the supervisor read
/// and checked it for this generation): HTTP/1.1 offers ALPN `http/1.1`, gRPC `h2`.
struct Acceptors {
    http: TlsAcceptor,
    grpc: TlsAcceptor,
}

impl Acceptors {
    fn new(tls: &inferd_config::tls::Tls) -> Result<Acceptors, String> {
        use inferd_config::tls::{ALPN_H2, ALPN_HTTP1};
        let acceptor = |alpn: &[u8]| tls.server_config(&[alpn]).map(TlsAcceptor::from);
        Ok(Acceptors { http: acceptor(ALPN_HTTP1)?, grpc: acceptor(ALPN_H2)? })
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
async fn handshake(
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

/// Pins the process, loads the runtime and the models, warms them up and binds the ports.
fn boot(spec: &WorkerSpec, reporter: &Reporter) -> Result<(Vec<Sessions>, Listeners), Failure> {
    if !spec.cpus.is_empty() {
        // Before any thread exists, so every thread ORT creates inherits the mask.
        let mut set = nix::sched::CpuSet::new();
        for &cpu in &spec.cpus {
            set.set(cpu).map_err(|e| failure(FailureKind::Boot)(format!("cpu {cpu}: {e}")))?;
        }
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
            .map_err(|e| failure(FailureKind::Boot)(format!("cannot pin to cpus {:?}: {e}", spec.cpus)))?;
    }
    let runtime = Runtime::init(&spec.ort_library, spec.allocator, spec.weights_cache.clone())
        .map_err(|e| failure(FailureKind::Boot)(e.to_string()))?;
    // Per model: one narrow session per thread (the lanes that run side by side under load)
    // and, with more than one thread, a wide one on the whole pool (a request that has the
    // worker to itself).
    let load_error = |e: ModelError| failure(FailureKind::ModelLoad)(e.to_string());
    let mut models = Vec::with_capacity(spec.models.len());
    for entry in &spec.models {
        // The sessions of a model share the first one's pipeline (tokenizer, image settings).
        let first = ModelSession::load(&runtime, entry, Threads::Narrow, None).map_err(load_error)?;
        let pipeline = Arc::clone(&first.meta.pipeline);
        let mut narrow = vec![first];
        for _ in 1..spec.threads.max(1) {
            narrow.push(ModelSession::load(&runtime, entry, Threads::Narrow, Some(&pipeline)).map_err(load_error)?);
        }
        // A worker of one thread that may borrow a sibling's core: its wide session has a
        // second thread, pinned there.
        let (spin, block_base) = (spec.server.intra_op_spinning, spec.server.intra_op_block_base);
        let wide = match (spec.threads, spec.lending.and_then(|l| l.borrow)) {
            (1, Some(cpu)) => Some(Threads::Wide { threads: 2, spin, block_base, pool_cpu: Some(cpu) }),
            (1, None) => None,
            (threads, _) => Some(Threads::Wide { threads, spin, block_base, pool_cpu: None }),
        };
        let wide = wide
            .map(|wide| ModelSession::load(&runtime, entry, wide, Some(&pipeline)))
            .transpose()
            .map_err(load_error)?;
        // A worker of one thread: a second narrow session for long inputs, run at a lower
        // priority on the same core (the engine's background lane).
        let background = (spec.threads <= 1 && spec.server.background_lane)
            .then(|| ModelSession::load(&runtime, entry, Threads::Narrow, Some(&pipeline)))
            .transpose()
            .map_err(load_error)?;
        models.push(Sessions { narrow, wide, background });
    }
    reporter.send(&WorkerMessage::Warming);
    for set in &mut models {
        let started = Instant::now();
        for model in set.narrow.iter_mut().chain(set.wide.as_mut()).chain(set.background.as_mut()) {
            model.warm_up().map_err(load_error)?;
        }
        info!(model = set.narrow[0].name(), "warmed up in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
    }
    // Loading and warming left freed buffers in the allocator: give them back before serving.
    crate::runtime::allocator::trim();
    hold_for_test(spec.cause);
    let http = take_port(WORKER_LISTENER_FD, !spec.shared_listener)
        .map_err(|e| failure(FailureKind::Boot)(format!("cannot listen on {}: {e}", spec.server.listen)))?;
    let grpc =
        spec.server.grpc_addr().map(|_| take_port(WORKER_GRPC_LISTENER_FD, true)).transpose().map_err(|e| {
            failure(FailureKind::Boot)(format!("cannot listen on {} (gRPC): {e}", spec.server.grpc_listen))
        })?;
    let tls = spec
        .access
        .tls
        .as_ref()
        .map(Acceptors::new)
        .transpose()
        .map_err(|e| failure(FailureKind::Boot)(format!("server.tls_cert: {e}")))?;
    Ok((models, Listeners { http, grpc, tls }))
}

/// Concurrent streams per gRPC connection (each is a request, whose bytes the byte budget
/// counts as they arrive).
const MAX_GRPC_STREAMS: u32 = 64;

/// How often the I/O loop beats into the shared counters.
const IO_BEAT_EVERY: Duration = Duration::from_millis(250);

/// Test switch for the supervisor's races (tests/races.rs): with INFERD_TEST_HOLD_DIR=D set,
/// a worker started for cause C (`reload`, `memory`, ...) that finds a file D/hold-C waits,
/// warm but not yet listening, until the file is gone; D/held-C holds the pid of the last
/// worker that waited there.
/// A test uses it to have a replacement still booting at the moment it acts. Only in builds
/// with the `test-switches` feature (`make test`'s), not releases.
#[cfg(not(feature = "test-switches"))]
fn hold_for_test(_cause: Cause) {}

#[cfg(feature = "test-switches")]
fn hold_for_test(cause: Cause) {
    let Some(dir) = std::env::var_os("INFERD_TEST_HOLD_DIR").map(std::path::PathBuf::from) else { return };
    let hold = dir.join(format!("hold-{}", cause.as_str()));
    if !hold.exists() {
        return;
    }
    let held = dir.join(format!("held-{}", cause.as_str()));
    let partial = dir.join(format!(".held-{}-{}", cause.as_str(), std::process::id()));
    // Written whole, then renamed: a reader never sees half a pid.
    let _ = std::fs::write(&partial, std::process::id().to_string()).and_then(|()| std::fs::rename(&partial, &held));
    warn!("held before listening while {} exists (INFERD_TEST_HOLD_DIR)", hold.display());
    while hold.exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The backlog of a slot's socket. The socket itself is the supervisor's, shared by the
/// slot's successive workers so that it never closes under a replacement (supervisor/src/
/// pool/spawn.rs, `SlotSockets`; docs/architecture.md, "Sockets").
const BACKLOG: i32 = 1024;

/// The socket the supervisor put at `fd`: the slot's, which starts listening now (a worker
/// joins the port only once warm; listening on a socket already listening, shared with the
/// worker this one replaces, changes nothing), or systemd's (`slot` false), listening already.
fn take_port(fd: RawFd, slot: bool) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::FromRawFd;
    // SAFETY: the supervisor put the socket at this fd for this process (see spec.rs); nothing
    // else here uses it.
    let socket = socket2::Socket::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    socket.local_addr()?; // a bound socket, not some other descriptor
    if slot {
        socket.listen(BACKLOG)?;
    } else if !socket.is_listener()? {
        return Err(std::io::Error::other(format!("fd {fd} is not a listening socket")));
    }
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    Ok(socket.into())
}

/// After an accept error: a socket that no longer listens was taken out of the port's group
/// by the supervisor (its slot had no worker left to accept, see `SlotSockets::leave`) just as
/// this worker joined it; the worker joins again. Other errors (out of descriptors) back off
/// instead of spinning.
async fn accept_failed(listener: &mut tokio::net::TcpListener, error: std::io::Error) {
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
enum Drain {
    Serving,
    /// The pool stops: finish the request in progress, then close.
    Close,
    /// Retired while siblings carry on: finish the request in progress, then hand the
    /// connection to a sibling (see [`crate::http::handoff`]).
    Handoff,
}

/// What every connection of this worker is served with.
struct Connections {
    state: Arc<AppState>,
    http: hyper::server::conn::http1::Builder,
    fresh: Arc<Fresh>,
    /// server.max_requests_per_connection (0: no limit).
    limit: u64,
    /// This worker's entry in the pool's connection table: a worker with more than its share
    /// of the port's connections announces `Connection: close` (see `inferd_ipc::balance`).
    balance: Option<Entry>,
    /// server.write_timeout_secs.
    write_timeout: Duration,
    drain: watch::Receiver<Drain>,
    handoff: Option<Arc<Handoff>>,
    /// TLS handshakes (server.tls_cert), bounded by the header timeout.
    tls: Option<TlsAcceptor>,
    header_timeout: Duration,
}

impl Connections {
    /// Serves one connection in a task of its own; `read`: bytes already read from it (by the
    /// worker that handed it over: plain TCP). The permit is held until the connection is gone.
    fn serve(
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
fn balance_entry() -> Option<Entry> {
    // SAFETY: the supervisor hands this descriptor when the spec says `balance`; mapped, then
    // closed.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_BALANCE_FD) };
    let entry = Balance::map(fd).map(|table| table.join(std::process::id(), 0));
    match entry {
        Ok(Some(entry)) => Some(entry),
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
async fn draining(drain: &mut watch::Receiver<Drain>) {
    let _ = drain.wait_for(|d| *d != Drain::Serving).await;
}

/// What a gRPC connection is served with, from the [server] settings.
#[derive(Clone, Copy)]
struct GrpcLimits {
    max_header_bytes: usize,
    /// How long a peer may leave a keep-alive ping unanswered, or take over its TLS handshake
    /// (server.header_timeout_secs).
    unanswered: Duration,
    /// server.write_timeout_secs.
    write: Duration,
    /// server.idle_timeout_secs.
    idle: Duration,
}

/// A gRPC connection's open calls, and when the last one ended.
struct Calls {
    open: std::sync::atomic::AtomicUsize,
    since: std::sync::Mutex<Instant>,
}

/// One open call: counted from its arrival until its handler answered.
struct Call(Arc<Calls>);

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
async fn serve_grpc(
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
            use tonic::codegen::Service;
            let (mut service, state, call) = (service.clone(), state.clone(), Call::new(&counted));
            async move {
                // The key is checked on the call's headers, before its message is read.
                let authorization = request.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
                if let Err(e) = state.authorize(authorization, crate::http::grpc::is_health_call(request.uri().path()))
                {
                    drop(call);
                    return Ok(crate::http::grpc::status(e).into_http());
                }
                // A bug that panics in a call costs that call (INTERNAL), not the worker, as
                // on the HTTP routes (panics.rs).
                let served = crate::panics::guarded_future(async {
                    let request = crate::http::grpc::intake::read(&state, request).await;
                    service.call(request).await
                })
                .await;
                drop(call);
                served.unwrap_or_else(|_| {
                    let bug = "internal error: the server hit a bug serving this call (logged)";
                    Ok(crate::http::grpc::status(crate::request::app::ApiError::Internal(bug.into())).into_http())
                })
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

fn serve(
    spec: WorkerSpec,
    models: Vec<Sessions>,
    listeners: Listeners,
    reporter: Arc<Reporter>,
    stats: Arc<WorkerCounters>,
) -> i32 {
    let metas = models.iter().map(|m| m.narrow[0].meta.clone()).collect::<Vec<_>>();
    let infos = metas.iter().map(|m| m.info.clone()).collect();
    let run_timeout = Duration::from_secs_f64(spec.server.request_timeout_secs);
    let (max_queue, spinning) = (spec.server.max_queue, spec.server.intra_op_spinning);
    // The pool's core claims, for a worker that lends (see `runtime::engine::Cores`).
    let cores = spec.lending.map(|l| {
        // SAFETY: the supervisor hands a lending worker this descriptor; mapped, then closed.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(inferd_ipc::cores::WORKER_CORES_FD) };
        CoreClaims::map(fd).map(|claims| Cores::new(claims, l.home, l.borrow))
    });
    let cores = match cores.transpose() {
        Ok(cores) => cores,
        Err(e) => {
            error!("cannot map the core claims on fd {}: {e}", inferd_ipc::cores::WORKER_CORES_FD);
            return EXIT_BOOT;
        }
    };
    let engine = Engine::start(models, stats.clone(), max_queue, run_timeout, spinning, spec.allocator, cores);
    let engine = match engine {
        Ok(engine) => engine,
        Err(e) => {
            error!("cannot start the model thread: {e}");
            return EXIT_BOOT;
        }
    };
    let state = Arc::new(AppState {
        worker: spec.index,
        models: metas,
        engine,
        max_body_bytes: spec.server.max_body_bytes,
        max_batch_inputs: spec.server.max_batch_inputs,
        body_timeout: Duration::from_secs_f64(spec.server.body_timeout_secs),
        body_budget: Arc::new(tokio::sync::Semaphore::new(spec.server.max_body_bytes_in_flight as usize)),
        body_budget_total: spec.server.max_body_bytes_in_flight,
        ready: false.into(),
        stats,
        access_log: spec.log.access_log,
        api_keys: spec.access.api_keys.clone(),
        request_ids: RequestIds::default(),
    });
    // One thread for all I/O: the worker's CPU share belongs to the model. At most one more,
    // started on demand, decodes images (see tasks.rs).
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().max_blocking_threads(1).build() {
        Ok(rt) => rt,
        Err(e) => {
            error!("cannot start the I/O runtime: {e}");
            return EXIT_BOOT;
        }
    };
    runtime.block_on(async move {
        let registered = tokio::net::TcpListener::from_std(listeners.http)
            .and_then(|http| Ok((http, listeners.grpc.map(tokio::net::TcpListener::from_std).transpose()?)));
        let (mut listener, grpc) = match registered {
            Ok(l) => l,
            Err(e) => {
                error!("cannot register the listener: {e}");
                return EXIT_BOOT;
            }
        };
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            error!("cannot install signal handlers");
            return EXIT_BOOT;
        };
        // The I/O loop's pulse: the supervisor replaces a worker whose loop stops turning (a
        // handler that blocks it) as it does one whose model run is stuck.
        let pulse = state.stats.clone();
        tokio::spawn(async move {
            loop {
                pulse.io_beat();
                tokio::time::sleep(IO_BEAT_EVERY).await;
            }
        });
        state.ready.store(true, Ordering::Relaxed);
        reporter.send(&WorkerMessage::Ready { models: infos });
        info!(listen = %spec.server.listen, cpus = ?spec.cpus, threads = spec.threads, "ready");

        let Ok(mut usr1) = signal(SignalKind::user_defined1()) else {
            error!("cannot install signal handlers");
            return EXIT_BOOT;
        };
        let handoff = match spec.handoff {
            true => Handoff::adopt(WORKER_HANDOFF_SEND_FD, WORKER_HANDOFF_RECV_FD)
                .map_err(|e| warn!("no connection hand-off ({e}): idle keep-alive connections are closed on retirement"))
                .ok()
                .map(Arc::new),
            false => None,
        };
        // One permit per open connection: at server.max_connections the worker stops
        // accepting (new connections wait in the kernel's queue, or go to a sibling).
        // Draining waits until every permit is back.
        let connections = Arc::new(tokio::sync::Semaphore::new(spec.server.max_connections));
        let (drain, drained) = watch::channel(Drain::Serving);
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(Duration::from_secs_f64(spec.server.header_timeout_secs))
            .max_buf_size(spec.server.max_header_bytes)
            .max_headers(spec.server.max_headers);
        let context = Connections {
            state: state.clone(),
            http,
            fresh: Arc::new(Fresh::default()),
            limit: spec.server.max_requests_per_connection,
            balance: spec.balance.then(balance_entry).flatten(),
            write_timeout: Duration::from_secs_f64(spec.server.write_timeout_secs),
            drain: drained,
            handoff: handoff.clone(),
            tls: listeners.tls.as_ref().map(|t| t.http.clone()),
            header_timeout: Duration::from_secs_f64(spec.server.header_timeout_secs),
        };
        let context = Arc::new(context);
        if let Some(grpc) = grpc {
            let limits = GrpcLimits {
                max_header_bytes: spec.server.max_header_bytes,
                unanswered: Duration::from_secs_f64(spec.server.header_timeout_secs),
                write: Duration::from_secs_f64(spec.server.write_timeout_secs),
                idle: Duration::from_secs_f64(spec.server.idle_timeout_secs),
            };
            let tls = listeners.tls.as_ref().map(|t| t.grpc.clone());
            tokio::spawn(serve_grpc(grpc, state.clone(), connections.clone(), context.drain.clone(), limits, tls));
        }
        let mode = loop {
            let permit = tokio::select! {
                permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                _ = term.recv() => break Drain::Close,
                _ = int.recv() => break Drain::Close,
                _ = usr1.recv() => break Drain::Handoff,
            };
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => context.serve(stream, peer, Vec::new(), permit),
                    Err(e) => accept_failed(&mut listener, e).await,
                },
                // A connection a retiring sibling handed over, with the bytes it had read.
                received = async { handoff.as_ref().expect("guarded").recv().await }, if handoff.is_some() => {
                    match received.and_then(|(stream, read)| {
                        let stream = tokio::net::TcpStream::from_std(stream)?;
                        let peer = stream.peer_addr()?;
                        Ok((stream, peer, read))
                    }) {
                        Ok((stream, peer, read)) => context.serve(stream, peer, read, permit),
                        Err(e) => debug!("a connection handed over could not be taken: {e}"),
                    }
                }
                _ = term.recv() => break Drain::Close,
                _ = int.recv() => break Drain::Close,
                _ = usr1.recv() => break Drain::Handoff,
            }
        };

        // Drain: stop taking connections (the slot's socket stays: the worker that replaced
        // this one accepts on it already, or the supervisor takes it out of the port once told
        // `Draining`, and connections waiting in it move to a sibling), then end every open
        // connection at a request boundary, bounded by the grace timeout: handed to a sibling
        // when retired (SIGUSR1), closed when the pool stops.
        state.ready.store(false, Ordering::Relaxed);
        drop(listener);
        if let Some(entry) = &context.balance {
            entry.drain();
        }
        reporter.send(&WorkerMessage::Draining);
        let mode = if handoff.is_some() { mode } else { Drain::Close };
        info!(handing_over = mode == Drain::Handoff, "draining");
        if mode == Drain::Close {
            // Connections accepted just before the listener closed get their first request
            // read before the shutdown (bounded by the header timeout, which closes silent
            // ones anyway). Handed over, they need no wait: their bytes travel with them.
            let header_timeout = Duration::from_secs_f64(spec.server.header_timeout_secs);
            let waiting_since = std::time::Instant::now();
            while context.fresh.0.load(Ordering::Relaxed) > 0 && waiting_since.elapsed() < header_timeout {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let _ = drain.send(mode);
        let all = spec.server.max_connections.min(u32::MAX as usize) as u32;
        let grace = Duration::from_secs_f64(spec.server.graceful_timeout_secs);
        tokio::select! {
            _ = connections.acquire_many(all) => info!("drained; exiting"),
            _ = tokio::time::sleep(grace) => warn!("grace timeout of {grace:?} reached; exiting with requests in flight"),
        }
        0
    })
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
            let outcome = runtime.block_on(async {
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
            let _ = done.send(outcome);
        });
        finished.recv_timeout(Duration::from_secs(30)).expect("the I/O thread is stuck (or the test panicked)");
    }
}
