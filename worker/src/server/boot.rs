//! A worker's boot: pinned to its CPUs before any thread exists, ONNX Runtime and the models
//! loaded ([`crate::load`]) and warmed up, and only then the ports taken.

use std::io::{BufRead, BufReader};
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use inferd_ipc::spec::{Cause, FailureKind, WorkerMessage, WorkerSpec, WORKER_GRPC_LISTENER_FD, WORKER_LISTENER_FD};
use tokio_rustls::TlsAcceptor;
use tracing::info;

use super::report::{failure, Failure};
use crate::load::Lanes;
use crate::request::link::Link;
use crate::request::model::Model;
use crate::runtime::engine::shift_nice;
use crate::runtime::engine::Sessions;
use crate::runtime::model::{ModelError, Runtime, Threads};

pub(super) fn read_spec(stream: &UnixStream) -> Result<WorkerSpec, String> {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| e.to_string())?;
    serde_json::from_str(&line).map_err(|e| e.to_string())
}

/// The worker's ports: HTTP, and gRPC when server.grpc_listen is set; TLS on both with
/// server.tls_cert.
pub(super) struct Listeners {
    pub(super) http: std::net::TcpListener,
    pub(super) grpc: Option<std::net::TcpListener>,
    pub(super) tls: Option<Acceptors>,
}

/// The TLS handshakes of the two ports, from the certificate in the spec (the supervisor read
/// and checked it for this generation): HTTP/1.1 offers ALPN `http/1.1`, gRPC `h2`.
pub(super) struct Acceptors {
    pub(super) http: TlsAcceptor,
    pub(super) grpc: TlsAcceptor,
}

impl Acceptors {
    fn new(tls: &inferd_config::tls::Tls) -> Result<Acceptors, String> {
        use inferd_config::tls::{ALPN_H2, ALPN_HTTP1};
        let acceptor = |alpn: &[u8]| tls.server_config(&[alpn]).map(TlsAcceptor::from);
        Ok(Acceptors { http: acceptor(ALPN_HTTP1)?, grpc: acceptor(ALPN_H2)? })
    }
}

/// Pins the process, loads the runtime and the models, warms them up and binds the ports.
/// What a worker's boot made: its runtime and the lanes it loads models for (kept to load
/// models on demand), the models loaded and their sessions, the ports.
pub(super) struct Booted {
    pub(super) runtime: Runtime,
    pub(super) lanes: Lanes,
    pub(super) models: Vec<Model>,
    pub(super) sessions: Vec<Sessions>,
    pub(super) listeners: Listeners,
}

pub(super) fn boot(spec: &WorkerSpec, reporter: &Link) -> Result<Booted, Failure> {
    if spec.boot_nice > 0 {
        // This thread, and every thread started from now on, boots niced (see `renice`).
        let _ = shift_nice(nix::unistd::gettid().as_raw() as libc::id_t, spec.boot_nice);
    }
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
    // worker to itself). A worker of one thread that may borrow a sibling's core: its wide
    // session has a second thread, pinned there; and a second narrow session for long inputs,
    // run at a lower priority on the same core (the engine's background lane).
    let (spin, block_base) = (spec.server.intra_op_spinning, spec.server.intra_op_block_base);
    let lanes = Lanes {
        narrow: spec.threads.max(1),
        wide: match (spec.threads, spec.lending.and_then(|l| l.borrow)) {
            (1, Some(cpu)) => Some(Threads::Wide { threads: 2, spin, block_base, pool_cpu: Some(cpu) }),
            (1, None) => None,
            (threads, _) => Some(Threads::Wide { threads, spin, block_base, pool_cpu: None }),
        },
        background: spec.threads <= 1 && spec.server.background_lane,
    };
    let load_error = |e: ModelError| failure(FailureKind::ModelLoad)(e.to_string());
    let (mut served, mut models) = (Vec::with_capacity(spec.models.len()), Vec::with_capacity(spec.models.len()));
    for entry in &spec.models {
        let (model, sessions) = crate::load::load(&runtime, entry, &lanes, &spec.access.signatures).map_err(|e| {
            if let Some((model, reason)) = e.refused() {
                reporter.send(&WorkerMessage::Refused { model: model.into(), reason: reason.into() });
            }
            failure(FailureKind::ModelLoad)(e.to_string())
        })?;
        served.push(model);
        models.push(sessions);
    }
    reporter.send(&WorkerMessage::Warming);
    for set in &mut models {
        let started = Instant::now();
        set.warm_up().map_err(load_error)?;
        let name = set.narrow[0].name();
        match set.narrow[0].entry().warmup.enabled {
            true => info!(model = name, "warmed up in {:.0} ms", started.elapsed().as_secs_f64() * 1e3),
            false => info!(model = name, "no warm-up ([warmup] enabled = false): the first requests pay for it"),
        }
        if let Err(why) = set.narrow[0].meta.batch_rows() {
            info!(model = name, "no batch dimension: each request runs whole, alone ({why})");
        }
    }
    // Loading and warming left freed buffers in the allocator: give them back before serving.
    crate::runtime::allocator::trim();
    hold_for_test(spec.cause);
    if spec.boot_nice > 0 {
        renice(-spec.boot_nice);
    }
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
    Ok(Booted { runtime, lanes, models: served, sessions: models, listeners: Listeners { http, grpc, tls } })
}

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
    tracing::warn!("held before listening while {} exists (INFERD_TEST_HOLD_DIR)", hold.display());
    while hold.exists() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Moves every thread of the process `by` in nice value: the boot's nice taken back before
/// the worker listens, each thread keeping its own offset (the background lane's). A thread
/// that cannot be moved stays as it is, and says so.
fn renice(by: i32) {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for tid in tasks.filter_map(|t| t.ok()?.file_name().to_str()?.parse::<libc::id_t>().ok()) {
        match shift_nice(tid, by) {
            // A thread that ended meanwhile.
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => tracing::warn!("cannot put thread {tid} back from its boot's nice value: {e}"),
        }
    }
}

/// The backlog of a slot's socket. The socket itself is the supervisor's, shared by the
/// slot's successive workers so that it never closes under a replacement (supervisor/src/
/// pool/spawn.rs, `SlotSockets`; docs/architecture.md, "Sockets").
pub(super) const BACKLOG: i32 = 1024;

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
