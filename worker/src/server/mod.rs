//! Boot and serve: spec in from the supervisor, models loaded and warmed, port bound, requests
//! served until SIGTERM/SIGINT (or the supervisor's death, via PR_SET_PDEATHSIG), then drain.
//! [`boot`]: pinning, the runtime and the models, the ports; [`connections`]: HTTP/1.1
//! connections (TLS included) from accept to drain or hand-off; [`grpc`]: gRPC connections;
//! here: the report to the supervisor, and the serving loop and the drain that ties them.

mod boot;
mod connections;
mod grpc;
mod report;
mod siblings;

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use inferd_ipc::cores::CoreClaims;
use inferd_ipc::spec::{
    FailureKind, WorkerMessage, WorkerSpec, EXIT_BOOT, EXIT_MODEL_LOAD, WORKER_HANDOFF_RECV_FD, WORKER_HANDOFF_SEND_FD,
};
use inferd_ipc::stats::{WorkerCounters, WORKER_STATS_FD};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::http::forward;
use crate::http::handoff::Handoff;
use crate::request::app::AppState;
use crate::request::call::RequestIds;
use crate::request::link::Link;
use crate::request::models::{Models, OnDemand, LOADS_QUEUED};
use crate::request::placement::Placement;
use crate::runtime::engine::{Cores, Engine, Pool};
use boot::{boot, read_spec, Booted};
use connections::{accept_failed, balance_entry, draining, limits_seat, Connections, Drain, Fresh};
use grpc::{serve_grpc, GrpcLimits};
use inferd_config::file::Placement as Placing;

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
    let reporter = Arc::new(Link::new(stream));
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
        Ok(booted) => {
            crate::trace::init(&spec.tracing, spec.index, stats.clone());
            let code = serve(spec, booted, reporter, stats);
            // What is queued goes to the collector, within a bound.
            crate::trace::shutdown(Duration::from_secs(2));
            code
        }
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

/// How often the I/O loop beats into the shared counters.
const IO_BEAT_EVERY: Duration = Duration::from_millis(250);

fn serve(spec: WorkerSpec, booted: Booted, reporter: Arc<Link>, stats: Arc<WorkerCounters>) -> i32 {
    let Booted { runtime, lanes, models: metas, sessions: models, listeners } = booted;
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
    // The pool's table, for the priorities every worker saw: a mapping of its own, beside the
    // connection balance's (`balance_entry`, which takes the descriptor over later).
    // And another for the models' queue limits, which hold pool-wide.
    let table = |what: &str| {
        spec.balance.then(|| {
            // SAFETY: the supervisor hands this descriptor when the spec says `balance`;
            // borrowed here, not closed.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(inferd_ipc::balance::WORKER_BALANCE_FD) };
            inferd_ipc::balance::Balance::map(fd).map_err(|e| warn!("cannot map the pool's table for {what}: {e}")).ok()
        })?
    };
    let waiting = table("queue limits").and_then(|t| t.waiting_row(std::process::id()));
    let pool = Pool { cores, priorities: table("priorities"), waiting };
    let engine = Engine::start(models, stats.clone(), max_queue, run_timeout, spinning, spec.allocator, pool);
    let engine = match engine {
        Ok(engine) => engine,
        Err(e) => {
            error!("cannot start the engine: {e}");
            return EXIT_BOOT;
        }
    };
    // With [models] on_demand: the loader thread, and the bounded queue of loads to it.
    let (on_demand, loads) = match spec.on_demand.is_empty() {
        true => (None, None),
        false => {
            let (queue, loads) = std::sync::mpsc::sync_channel(LOADS_QUEUED);
            // A refusal holds until a file the model is loaded from, its model.toml or its
            // signature changes.
            let files = |e: &inferd_config::model::ModelEntry| {
                let folder = e.path.parent().unwrap_or(std::path::Path::new("."));
                let mut files: Vec<_> = e.files().into_iter().map(std::path::Path::to_path_buf).collect();
                files.push(folder.join(inferd_config::model::MODEL_CONFIG_FILE));
                files.push(e.signature_file());
                files
            };
            let catalog = spec.on_demand.iter().map(|e| (e.name.clone(), files(e))).collect();
            let timeout = Duration::from_secs_f64(spec.load_timeout_secs);
            (Some(OnDemand::new(catalog, queue, max_queue, timeout, spec.eviction)), Some(loads))
        }
    };
    let state = Arc::new(AppState {
        worker: spec.index,
        server_name: spec.server.name.clone(),
        trace_ratio: inferd_telemetry::root_ratio(&spec.tracing).filter(|_| crate::trace::enabled()),
        models: Models::new(metas, on_demand),
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
        restricted: spec.access.restricted.clone(),
        request_ids: RequestIds::default(),
        cache: crate::request::cache::Cache::new(spec.cache_bytes),
        limits: spec.limits.then(limits_seat).flatten(),
        supervisor: reporter.clone(),
        shared_memory: spec.shared_memory.clone().map(inferd_ipc::shm::Registry::new),
    });
    if let Some(loads) = loads {
        let (state, reporter, catalog) = (state.clone(), reporter.clone(), spec.on_demand.clone());
        let trust = spec.access.signatures.clone();
        let span = tracing::Span::current();
        let share = spec.memory_share;
        let started = std::thread::Builder::new().name("inferd-load".into()).spawn(move || {
            let _worker = span.enter();
            let loader = crate::request::on_demand::Loader::new(runtime, catalog, lanes, trust, state, share);
            loader.run(loads, |message| reporter.send(&message))
        });
        if let Err(e) = started {
            error!("cannot start the loader thread: {e}");
            return EXIT_BOOT;
        }
    }
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
        // models.placement = "pool": offered in the pool's table, and reachable by siblings.
        if spec.placement == Placing::Pool && !spec.on_demand.is_empty() && spec.memory_share.is_some() {
            match &context.balance {
                Some(entry) => {
                    let address = forward::new_address();
                    let mut drain = context.drain.clone();
                    let stop = async move { draining(&mut drain).await };
                    let http = context.http.clone();
                    match siblings::serve(state.clone(), address, http, connections.clone(), stop) {
                        Ok(()) => state.models.place(Placement::new(entry.clone(), spec.generation, address)),
                        Err(e) => warn!("models.placement = \"pool\" is off in this worker: its siblings' socket: {e}"),
                    }
                }
                None => warn!("models.placement = \"pool\" is off: it needs the pool's connection table (server.balance_connections)"),
            }
        }
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
