//! Boot and serve: spec in from the supervisor, models loaded and warmed, port bound, requests
//! served until SIGTERM/SIGINT (or the supervisor's death, via PR_SET_PDEATHSIG), then drain.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::header::{HeaderValue, CONNECTION};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use inferd_config::spec::{FailureKind, WorkerMessage, WorkerSpec, EXIT_BOOT, EXIT_MODEL_LOAD, WORKER_LISTENER_FD};
use inferd_config::stats::{Shared, WORKER_STATS_FD};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

use crate::engine::{Engine, Sessions};
use crate::http::{handle, AppState, RequestIds};
use crate::model::{init_runtime, Model, ModelError, Threads};

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
    let stats = match Shared::map(unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_STATS_FD) }) {
        Ok(stats) => Arc::new(stats),
        Err(e) => {
            error!("cannot map the counters on fd {WORKER_STATS_FD}: {e}");
            return EXIT_BOOT;
        }
    };
    match boot(&spec, &reporter) {
        Ok((models, listener)) => serve(spec, models, listener, reporter, stats),
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

/// Pins the process, loads the runtime and the models, warms them up and binds the port.
fn boot(spec: &WorkerSpec, reporter: &Reporter) -> Result<(Vec<Sessions>, std::net::TcpListener), Failure> {
    if !spec.cpus.is_empty() {
        // Before any thread exists, so every thread ORT creates inherits the mask.
        let mut set = nix::sched::CpuSet::new();
        for &cpu in &spec.cpus {
            set.set(cpu).map_err(|e| failure(FailureKind::Boot)(format!("cpu {cpu}: {e}")))?;
        }
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
            .map_err(|e| failure(FailureKind::Boot)(format!("cannot pin to cpus {:?}: {e}", spec.cpus)))?;
    }
    init_runtime(&spec.ort_library).map_err(|e| failure(FailureKind::Boot)(e.to_string()))?;
    crate::weights::configure(spec.weights_cache.clone(), &spec.ort_library);
    // Per model: one narrow session per thread (the lanes that run side by side under load)
    // and, with more than one thread, a wide one on the whole pool (a request that has the
    // worker to itself).
    let load_error = |e: ModelError| failure(FailureKind::ModelLoad)(e.to_string());
    let mut models = Vec::with_capacity(spec.models.len());
    for entry in &spec.models {
        let narrow = (0..spec.threads.max(1))
            .map(|_| Model::load_with(entry, Threads::Narrow))
            .collect::<Result<Vec<_>, _>>()
            .map_err(load_error)?;
        let wide = match spec.threads > 1 {
            true => {
                let wide = Threads::Wide { threads: spec.threads, spin: spec.server.intra_op_spinning };
                Some(Model::load_with(entry, wide).map_err(load_error)?)
            }
            false => None,
        };
        models.push(Sessions { narrow, wide });
    }
    reporter.send(&WorkerMessage::Warming);
    for set in &mut models {
        let started = std::time::Instant::now();
        for model in set.narrow.iter_mut().chain(set.wide.as_mut()) {
            model.warm_up().map_err(load_error)?;
        }
        info!(model = set.narrow[0].name(), "warmed up in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
    }
    // Loading and warming left freed buffers in the allocator: give them back before serving.
    crate::weights::trim();
    let listener = match spec.inherited_listener {
        true => inherited_listener(),
        false => bind_reuseport(spec.server.listen_addr()),
    }
    .map_err(|e| failure(FailureKind::Boot)(format!("cannot listen on {}: {e}", spec.server.listen)))?;
    Ok((models, listener))
}

/// The one socket systemd passed to the supervisor, shared by every worker: the kernel queues
/// connections on it while no worker accepts (all of them warming, or the service restarting),
/// and whichever worker is free takes the next. A worker only starts accepting once warm.
fn inherited_listener() -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::FromRawFd;
    // SAFETY: the supervisor put the socket at this fd for this process (see spec.rs); nothing
    // else here uses it.
    let socket = socket2::Socket::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(WORKER_LISTENER_FD) });
    if !socket.is_listener()? {
        return Err(std::io::Error::other(format!("fd {WORKER_LISTENER_FD} is not a listening socket")));
    }
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    Ok(socket.into())
}

/// A listener of its own in the port's SO_REUSEPORT group: the kernel spreads new connections
/// over the group's members, and a worker joins only once it is warm.
fn bind_reuseport(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

fn serve(
    spec: WorkerSpec,
    models: Vec<Sessions>,
    listener: std::net::TcpListener,
    reporter: Arc<Reporter>,
    stats: Arc<Shared>,
) -> i32 {
    let metas = models.iter().map(|m| m.narrow[0].meta.clone()).collect::<Vec<_>>();
    let infos = metas.iter().map(|m| m.info.clone()).collect();
    let run_timeout = Duration::from_secs_f64(spec.server.request_timeout_secs);
    let engine = match Engine::start(models, stats.clone(), spec.server.max_queue, run_timeout) {
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
        let listener = match tokio::net::TcpListener::from_std(listener) {
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
        state.ready.store(true, Ordering::Relaxed);
        reporter.send(&WorkerMessage::Ready { models: infos });
        info!(listen = %spec.server.listen, cpus = ?spec.cpus, threads = spec.threads, "ready");

        // Tracks every open connection so that draining can wait for them.
        let graceful = GracefulShutdown::new();
        // One permit per open connection: at server.max_connections the worker stops
        // accepting (new connections wait in the kernel's queue, or go to a sibling).
        let connections = Arc::new(tokio::sync::Semaphore::new(spec.server.max_connections));
        let fresh = Arc::new(Fresh::default());
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(Duration::from_secs_f64(spec.server.header_timeout_secs))
            .max_buf_size(spec.server.max_header_bytes)
            .max_headers(spec.server.max_headers);
        loop {
            let permit = tokio::select! {
                permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                _ = term.recv() => break,
                _ = int.recv() => break,
            };
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        let state = state.clone();
                        let guard = FreshGuard::new(&fresh);
                        let first = guard.clone();
                        // service_fn takes an Fn: the count is a Cell (one connection, one task).
                        let (served, limit) = (std::cell::Cell::new(0u64), spec.server.max_requests_per_connection);
                        let service = service_fn(move |request| {
                            first.seen();
                            served.set(served.get() + 1);
                            let served = served.get();
                            let response = handle(state.clone(), peer, request);
                            async move {
                                let mut reply = response.await?;
                                // Announced, so the client knows before it sends again: its next
                                // connection is hashed afresh over the SO_REUSEPORT group.
                                if limit > 0 && served >= limit {
                                    reply.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
                                }
                                Ok::<_, std::convert::Infallible>(reply)
                            }
                        });
                        let connection = http.serve_connection(TokioIo::new(stream), service);
                        let watched = graceful.watch(connection);
                        tokio::spawn(async move {
                            let _ = watched.await;
                            drop((permit, guard));
                        });
                    }
                    Err(e) => {
                        // Out of descriptors or similar: back off instead of spinning.
                        warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }

        // Drain: leave the port's group first (with net.ipv4.tcp_migrate_req=1 the kernel moves
        // connections still queued on this listener to a sibling), then let every open
        // connection finish its current request, bounded by the grace timeout.
        state.ready.store(false, Ordering::Relaxed);
        drop(listener);
        reporter.send(&WorkerMessage::Draining);
        info!("draining");
        // Connections accepted just before the listener closed get their first request read
        // before the shutdown (bounded by the header timeout, which closes silent ones anyway).
        let header_timeout = Duration::from_secs_f64(spec.server.header_timeout_secs);
        let waiting_since = std::time::Instant::now();
        while fresh.0.load(Ordering::Relaxed) > 0 && waiting_since.elapsed() < header_timeout {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let grace = Duration::from_secs_f64(spec.server.graceful_timeout_secs);
        tokio::select! {
            _ = graceful.shutdown() => info!("drained; exiting"),
            _ = tokio::time::sleep(grace) => warn!("grace timeout of {grace:?} reached; exiting with requests in flight"),
        }
        0
    })
}
