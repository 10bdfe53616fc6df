//! Slots, workers and the supervisor's loop.
//!
//! A slot is a place in the pool with a fixed CPU set; its `current` worker serves. A slot
//! whose current worker dies gets a new one: at once, unless its workers keep dying young
//! (before serving for 1 s and for longer than they took to boot): then with exponential
//! backoff (0.5 s doubling up to 30 s). A worker that
//! reports a model-load or boot failure before the pool was ever ready stops the whole server
//! with that error; later, the slot is retried with backoff while the others keep serving.
//!
//! Replacing a slot's worker (reload, recycling) never leaves the slot without a ready
//! worker: an `incoming` worker is started beside the current one and only when it is ready
//! does the old one become `retiring` (SIGUSR1: it stops accepting on the slot's socket, which
//! its successor shares and which never closes in between (spawn.rs, `SlotSockets`), finishes
//! its requests and hands its idle connections to a sibling; see worker/src/http/handoff.rs). A
//! reload replaces the slots one after another; the first replacement is the validation of the
//! new models: if it fails, nothing else changes. Every worker has a spawn id and a [`Cause`]:
//! a reload advances only on the ready of the worker it started itself, fails only on that
//! worker's failure, and waits for a slot's worker still booting for another cause before it
//! replaces that slot (reload.rs); the guards' replacements run on the slot's own models.
//!
//! The states, in one place each: a worker's [`Role`] in its slot and its [`WorkerState`] as it
//! reports it; a slot's [`Start`], the only thing that starts a current worker (at an instant,
//! held at boot, once its retiring workers are gone, or never again while `scale -1` removes
//! it); the pool's [`Phase`], derived from the slots and the reload in progress by
//! [`Supervisor::phase`] and never stored. Each worker has one task that forwards its messages
//! until EOF and then reaps it, so its exit never overtakes what it said. Signals, control
//! requests and scrapes only enqueue an [`Event`]; the loop handles one at a time, and every
//! operator action checks the state it finds and is refused whole when it cannot apply.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::plan::cpu::{format_cpus, plan, Ask, Placement};
use crate::plan::memory::MemoryBudget;
use crate::plan::Resolved;
use inferd_config::auth::Access;
use inferd_config::file::ServerConfig;
use inferd_config::model::ModelEntry;
use inferd_ipc::balance::{Balance, WORKER_BALANCE_FD};
use inferd_ipc::cores::{CoreClaims, WORKER_CORES_FD};
use inferd_ipc::spec::{
    Cause, FailureKind, Lending, ModelInfo, WorkerMessage, WorkerSpec, EXIT_BOOT, EXIT_MODEL_LOAD, EXIT_PANIC,
    WORKER_CONTROL_FD, WORKER_GRPC_LISTENER_FD, WORKER_HANDOFF_RECV_FD, WORKER_HANDOFF_SEND_FD, WORKER_LISTENER_FD,
};
use inferd_ipc::stats::{Snapshot, WorkerCounters, BATCH_BUCKETS, LATENCY_BUCKETS, MAX_MODELS, WORKER_STATS_FD};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::control::{self, ControlError, Replies, Request, Response};
use crate::metrics::PoolMetrics;
use crate::status::{BatchSizes, Phase, PoolStatus, WorkerState, WorkerStatus};
use crate::systemd::{self, Notifier};
use crate::{admin, signals, tcp, Event};

mod guards;
mod reload;
mod report;
mod spawn;

use crate::plan::memory::proc_status;
use guards::recycle_threshold;
use report::rows_of;
use spawn::{dup_high, handoff_socket, SlotSockets};

/// A worker that served at least this long, and longer than its own boot took, was not
/// crash-looping: its slot's backoff resets. (Workers killed from outside every couple of
/// seconds are replaced at once; a worker dying right after each boot is backed off.)
const STABLE_AFTER: Duration = Duration::from_secs(1);
/// Consecutive deaths of one slot during start-up after which the server gives up.
const MAX_BOOT_CRASHES: u32 = 5;
const TICK: Duration = Duration::from_millis(200);
/// Status shows request-latency percentiles over this window, from samples this far apart.
const LATENCY_WINDOW: Duration = Duration::from_secs(60);
const LATENCY_SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// After a failed recycling replacement, the slot is not recycled again for this long.
const RECYCLE_PAUSE: Duration = Duration::from_secs(30);

/// How the pool ends with an error; `inferd serve` exits with the code src/exit.rs maps it to.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("worker {slot} could not load its model: {error}")]
    ModelLoad { slot: usize, error: String },
    #[error("worker {slot} failed to start: {error}")]
    Boot { slot: usize, error: String },
    #[error("memory plan: {0}")]
    Memory(String),
    /// The port (or the gRPC port) cannot be bound.
    #[error("{0}")]
    Port(String),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The slot's serving worker.
    Current,
    /// Started to replace the current worker; takes its place once ready.
    Incoming,
    /// Replaced: draining, then gone.
    Retiring,
}

struct Worker {
    pid: u32,
    /// This spawn's identity, unique over the supervisor's life: a reload waits for the one
    /// worker it started, whatever other workers of the same slot or generation report.
    spawn: u64,
    cause: Cause,
    generation: u64,
    role: Role,
    state: WorkerState,
    started: Instant,
    ready_at: Option<Instant>,
    models: Vec<ModelInfo>,
    /// What the worker said before failing, or why the supervisor killed it.
    failure: Option<(FailureKind, String)>,
    /// The counters it shares with the supervisor.
    stats: WorkerCounters,
    /// Requests after which it is recycled (server.max_requests plus its own jitter).
    recycle_after: Option<u64>,
    /// Why and when the supervisor sent SIGABRT to a stuck worker; SIGKILL follows a tick later.
    stuck: Option<(String, Instant)>,
    /// Killed by the supervisor for passing the hard memory limit.
    memory_killed: bool,
}

struct Slot {
    placement: Placement,
    /// What this slot's workers run, and the pool generation that brought it.
    models: Vec<ModelEntry>,
    generation: u64,
    workers: Vec<Worker>,
    restarts: u32,
    /// Deaths since the slot last had a worker ready for [`STABLE_AFTER`].
    failures: u32,
    /// When it starts its next current worker (see [`Start`]), and why.
    start: Start,
    cause: Cause,
    last_exit: Option<String>,
    /// A recycling replacement failed: no new attempt before this.
    recycle_pause: Option<Instant>,
    /// Its place on the port, shared by its successive workers (spawn.rs).
    sockets: SlotSockets,
}

/// When a slot starts its next current worker: the one place that says what may start one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Nothing to start: its current worker serves or is on its way.
    No,
    /// Held at boot until the first worker's memory says whether this one fits.
    Held,
    /// At this instant: now, or once a crash's backoff has passed.
    At(Instant),
    /// Once its retiring workers have exited (memory is too tight for two), then at once.
    WhenEmpty,
    /// Being removed by `scale -1`: never again; the slot goes once its workers are gone.
    Removing,
}

impl Slot {
    /// Whether its next current worker should start now.
    fn due(&self, now: Instant) -> bool {
        let serving_or_coming = self.workers.iter().any(|w| w.role != Role::Retiring);
        !serving_or_coming
            && match self.start {
                Start::At(t) => now >= t,
                Start::WhenEmpty => self.workers.is_empty(),
                Start::No | Start::Held | Start::Removing => false,
            }
    }

    fn removing(&self) -> bool {
        self.start == Start::Removing
    }

    fn with_role(&self, role: Role) -> Option<&Worker> {
        self.workers.iter().find(|w| w.role == role)
    }

    fn ready(&self) -> bool {
        self.with_role(Role::Current).is_some_and(|w| w.state == WorkerState::Ready)
    }

    /// A worker of the slot, other than a retiring one, that has not reported ready yet.
    fn booting(&self) -> Option<&Worker> {
        self.workers
            .iter()
            .find(|w| w.role != Role::Retiring && matches!(w.state, WorkerState::Starting | WorkerState::Warming))
    }
}

/// The memory guard's state (guards.rs).
#[derive(Default)]
struct MemoryWatch {
    /// Private memory of the first worker after its warm-up: what one more worker costs.
    worker_rss: Option<u64>,
    /// Per-worker limits of private memory, set once worker 0 is warm.
    limits: Option<crate::plan::memory::WorkerLimits>,
    /// When the watch last ran.
    checked: Option<Instant>,
}

/// What the pool has counted since it started, beyond its live workers' own counters.
struct Totals {
    /// Final counts of every worker that has exited.
    retired: Snapshot,
    /// Workers replaced after dying, by reason (every reason from the start, so that the
    /// first scrape has each series at 0: one that appears only with its first restart leaves
    /// rate() and the dashboard without data until then).
    restarts: BTreeMap<&'static str, u64>,
    /// Workers replaced gap-free on purpose, by reason (the same).
    recycles: BTreeMap<&'static str, u64>,
    reloads: crate::metrics::Reloads,
    /// Request-latency buckets of the whole pool, sampled every few seconds, for the
    /// last-minute percentiles in status.
    latency_samples: VecDeque<(Instant, Vec<u64>)>,
}

/// A rolling reload in progress.
struct Reload {
    models: Vec<ModelEntry>,
    /// The API keys and certificate the new workers take, read when the reload began.
    access: Access,
    generation: u64,
    /// The slot being replaced now; slots below it run the new models.
    slot: usize,
    /// The spawn id of the worker this reload started for `slot`, the only one whose
    /// readiness advances it and whose failure fails it; None while it waits for a worker of
    /// that slot started for another cause, on the old models, to finish booting.
    worker: Option<u64>,
    replies: Option<Replies>,
    /// Keep `replies` until the last slot is done (else only until validation).
    wait: bool,
    started: Instant,
}

pub struct Supervisor {
    resolved: Resolved,
    exe: PathBuf,
    events: mpsc::UnboundedSender<Event>,
    slots: Vec<Slot>,
    /// SIGTERM, SIGINT, SIGQUIT or a fatal error: the pool is going down (the phase, derived
    /// in [`Supervisor::phase`], says Stopping from then on).
    stopping: bool,
    /// True once every slot has been ready at the same time.
    booted: bool,
    started: Instant,
    /// Incremented by every reload; workers carry the generation they were started for.
    generation: u64,
    /// Workers started so far: the next one's spawn id.
    spawns: u64,
    /// The models new slots (scale +1) run: those of the latest successful reload.
    models: Vec<ModelEntry>,
    /// The API keys and certificate workers started now take: those of the latest
    /// successful reload.
    access: Access,
    reload: Option<Reload>,
    memory: MemoryWatch,
    totals: Totals,
    stop_deadline: Option<Instant>,
    killed_all: bool,
    fatal: Option<SupervisorError>,
    /// The listening socket systemd passed (socket activation), shared with every worker.
    listener: Option<OwnedFd>,
    /// The pool's hand-off socket (send end, receive end), held open for the pool's life so
    /// that connections handed over wait in it for a worker to take them.
    handoff: Option<(OwnedFd, OwnedFd)>,
    /// Which worker runs on which core now (server.lend_idle_cores), mapped here to clear
    /// the claims of workers that exit, and its descriptor for the workers.
    cores: Option<(CoreClaims, OwnedFd)>,
    /// Each serving worker's open connections (see `inferd_ipc::balance`), mapped here to free
    /// the entries of workers that exit, and its descriptor for the workers.
    balance: Option<(Balance, OwnedFd)>,
    notifier: Notifier,
    /// Test switch: SIGUSR2 blocks the loop (INFERD_TEST_HANG_ON_SIGUSR2=1), to show that a
    /// hung loop stops the watchdog pings.
    hang_on_sigusr2: bool,
}

/// The test switch INFERD_TEST_HANG_ON_SIGUSR2=1, only in builds with the `test-switches`
/// feature (`make test`'s), not releases.
#[cfg(feature = "test-switches")]
fn hang_on_sigusr2() -> bool {
    std::env::var_os("INFERD_TEST_HANG_ON_SIGUSR2").is_some_and(|v| v == "1")
}

#[cfg(not(feature = "test-switches"))]
fn hang_on_sigusr2() -> bool {
    false
}

/// Runs the supervisor until the pool has stopped. Blocks the calling thread.
pub fn run(mut resolved: Resolved) -> Result<(), SupervisorError> {
    // Before any thread exists: taking the socket clears LISTEN_* from the environment.
    let activated = match systemd::listener() {
        Ok(Some(socket)) => {
            let addr = socket.local_addr()?;
            info!(
                "serving on the socket systemd passed ({addr}); server.listen ({}) is not used",
                resolved.config.server.listen
            );
            resolved.config.server.listen = addr.to_string();
            // Above the fds a worker's are moved to (3-5), so that moving them cannot clobber it.
            Some(dup_high(socket.as_raw_fd())?)
        }
        Ok(None) => None,
        Err(e) => return Err(std::io::Error::new(e.kind(), format!("socket activation: {e}")).into()),
    };
    // A single-threaded runtime: the supervisor's work is tiny, and its only extra thread is
    // signal-hook's forwarder.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let socket = resolved.config.control_socket();
        let listener = control::bind(&socket)?;
        if activated.is_none() {
            // A slot left without a worker takes its socket out of the group (systemd's shared
            // socket never leaves, so needs no migration).
            tcp::ensure_migrate_req(resolved.config.server.set_tcp_migrate_req);
        }
        let (events, mut queue) = mpsc::unbounded_channel();
        signals::forward(events.clone())?;
        tokio::spawn(control::serve(listener, events.clone()));
        let admin = &resolved.config.admin.listen;
        if !admin.is_empty() {
            let listener = tokio::net::TcpListener::bind(admin)
                .await
                .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on admin.listen {admin}: {e}")))?;
            let scheme = if resolved.config.admin.tls_cert.is_some() { "https" } else { "http" };
            info!("metrics on {scheme}://{admin}/metrics");
            let config = &resolved.config;
            // Refused at start, not at the first request, when it cannot be used.
            config.admin_tokens().map_err(|e| std::io::Error::other(e.to_string()))?;
            let tls = admin::AdminTls::load(config.admin_tls()).map_err(std::io::Error::other)?;
            let routes = admin::Admin {
                repository: config.model_repository(),
                model_control: config.admin.model_control,
                token_file: config.admin.token_file.as_ref().map(|f| config.resolve(f)),
                protect_metrics: config.admin.protect_metrics,
                loopback: listener.local_addr().is_ok_and(|a| a.ip().is_loopback()),
                allowed: config.allowed_model_paths(),
                tls,
            };
            tokio::spawn(admin::serve(listener, events.clone(), routes));
        }
        let result = match Supervisor::new(resolved, events, activated) {
            Ok(mut supervisor) => supervisor.run(&mut queue).await,
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(&socket);
        result
    })
}

impl Supervisor {
    fn new(
        resolved: Resolved,
        events: mpsc::UnboundedSender<Event>,
        listener: Option<OwnedFd>,
    ) -> Result<Supervisor, SupervisorError> {
        let mut slots = Vec::new();
        for placement in &resolved.plan.workers {
            let sockets =
                SlotSockets::bind(&resolved.config.server, listener.is_some()).map_err(SupervisorError::Port)?;
            slots.push(new_slot(placement.clone(), resolved.models.clone(), 1, Cause::Boot, sockets));
        }
        // The first worker starts alone: its RSS after warm-up decides whether the others fit.
        for slot in slots.iter_mut().skip(1) {
            slot.start = Start::Held;
        }
        Ok(Supervisor {
            exe: std::env::current_exe()?,
            models: resolved.models.clone(),
            access: resolved.access.clone(),
            resolved,
            events,
            slots,
            stopping: false,
            booted: false,
            started: Instant::now(),
            generation: 1,
            spawns: 0,
            reload: None,
            memory: MemoryWatch::default(),
            totals: Totals {
                retired: Snapshot::default(),
                restarts: RESTART_REASONS.iter().map(|&r| (r, 0)).collect(),
                recycles: RECYCLE_REASONS.iter().map(|&r| (r, 0)).collect(),
                reloads: Default::default(),
                latency_samples: VecDeque::new(),
            },
            stop_deadline: None,
            killed_all: false,
            fatal: None,
            listener,
            handoff: handoff_socket()
                .map_err(|e| {
                    warn!("no hand-off socket ({e}): idle keep-alive connections of a retiring worker are closed")
                })
                .ok(),
            // Above fd 10, as every descriptor a worker gets (see `spawn::start_process`).
            cores: CoreClaims::create()
                .and_then(|(claims, fd)| Ok((claims, dup_high(fd.as_raw_fd())?)))
                .map_err(|e| warn!("no core claims ({e}): workers do not lend idle cores to each other"))
                .ok(),
            balance: Balance::create()
                .and_then(|(table, fd)| Ok((table, dup_high(fd.as_raw_fd())?)))
                .map_err(|e| warn!("no connection table ({e}): workers do not shed connections to balance"))
                .ok(),
            notifier: Notifier::from_env(),
            hang_on_sigusr2: hang_on_sigusr2(),
        })
    }

    async fn run(&mut self, queue: &mut mpsc::UnboundedReceiver<Event>) -> Result<(), SupervisorError> {
        let plan = &self.resolved.plan;
        info!(
            "inferd {} (pid {}) starting {} workers x {} intra-op threads on {}; {} usable cores ({}); ONNX Runtime {} ({}); models: {}",
            env!("CARGO_PKG_VERSION"),
            std::process::id(),
            plan.workers.len(),
            plan.threads_per_worker,
            self.resolved.config.server.listen,
            plan.budget.usable,
            plan.budget.describe(),
            self.resolved.ort.path.display(),
            self.resolved.ort.source,
            self.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "),
        );
        if let Some(every) = self.notifier.watchdog() {
            info!("systemd watchdog on: pinging every {:.1} s", every.as_secs_f64());
        }
        let mut tick = tokio::time::interval(TICK);
        loop {
            let before = self.phase();
            tokio::select! {
                Some(event) = queue.recv() => self.on_event(event),
                _ = tick.tick() => self.on_tick(),
            }
            let phase = self.settle(before);
            let mut notifier = std::mem::take(&mut self.notifier);
            notifier.update(phase, || self.summary());
            self.notifier = notifier;
            if phase == Phase::Stopping && self.slots.iter().all(|s| s.workers.is_empty()) {
                return match self.fatal.take() {
                    Some(e) => Err(e),
                    None => {
                        info!("all workers stopped; exiting");
                        Ok(())
                    }
                };
            }
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Signal(signal) => match signal {
                libc::SIGTERM | libc::SIGINT => {
                    info!("{}: stopping gracefully", signal_name(signal));
                    self.begin_stop(false);
                }
                libc::SIGQUIT => {
                    info!("SIGQUIT: stopping now");
                    self.begin_stop(true);
                }
                // The same actions the control socket takes, on the same code path.
                libc::SIGHUP => self.act(Request::Reload { model: None, path: None, wait: false }, None),
                libc::SIGTTIN => self.act(Request::Scale { delta: 1 }, None),
                libc::SIGTTOU => self.act(Request::Scale { delta: -1 }, None),
                libc::SIGUSR2 if self.hang_on_sigusr2 => {
                    warn!("SIGUSR2 with the test switch on: the supervisor's loop hangs now");
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                }
                _ => {}
            },
            Event::Message { slot, pid, message } => self.on_message(slot, pid, message),
            Event::Exited { slot, pid, status } => self.on_exit(slot, pid, status),
            Event::Control(request, replies) => self.act(request, Some(replies)),
            Event::Scrape(reply) => {
                let _ = reply.send(self.metrics());
            }
        }
    }

    /// Every action, whether it came from a signal (`replies` = None) or the control socket.
    fn act(&mut self, request: Request, replies: Option<Replies>) {
        let answer = match request {
            Request::Status => Ok(Response { ok: true, status: Some(self.status()), ..Response::default() }),
            Request::Reload { model, path, wait } => match self.start_reload(model, path, wait, replies.clone()) {
                // The reload answers on its own as it goes.
                Ok(()) => return,
                Err(e) => Err(e),
            },
            Request::Scale { delta } => self.scale(delta).map(Response::message),
            Request::Load { model, path } => match self.start_load(model, path, replies.clone()) {
                Ok(()) => return,
                Err(e) => Err(e),
            },
            Request::Unload { model } => match self.start_unload(model, replies.clone()) {
                Ok(()) => return,
                Err(e) => Err(e),
            },
        };
        match &answer {
            Ok(r) => r.message.iter().for_each(|m| info!("{m}")),
            Err(e) => warn!("{e}"),
        }
        if let Some(replies) = replies {
            // Each action either starts or is refused as a whole.
            let _ = replies.send(answer.unwrap_or_else(Response::refused));
        }
    }

    fn on_message(&mut self, index: usize, pid: u32, message: WorkerMessage) {
        let Some(slot) = self.slots.get_mut(index) else { return };
        let Some(worker) = slot.workers.iter_mut().find(|w| w.pid == pid) else { return };
        match message {
            WorkerMessage::Warming => worker.state = WorkerState::Warming,
            WorkerMessage::Ready { models } => {
                worker.state = WorkerState::Ready;
                worker.ready_at = Some(Instant::now());
                worker.models = models;
                info!("worker {index} (pid {pid}) ready after {:.2} s", worker.started.elapsed().as_secs_f64());
                if worker.role == Role::Incoming {
                    self.promote(index, pid);
                }
                self.settle_port();
                if self.memory.worker_rss.is_none() {
                    if let Err(e) = self.memory_plan(pid) {
                        error!("{e}");
                        self.fail(e);
                    }
                }
            }
            WorkerMessage::Draining => {
                worker.state = WorkerState::Draining;
                self.settle_port();
                self.finish_reload();
            }
            WorkerMessage::Failed { kind, error } => worker.failure = Some((kind, error)),
        }
    }

    /// An incoming worker is ready: it becomes the slot's current worker, and the one it
    /// replaces drains and leaves. The reload advances only if this is the worker it started.
    fn promote(&mut self, index: usize, pid: u32) {
        let slot = &mut self.slots[index];
        let mut spawn = None;
        for w in slot.workers.iter_mut() {
            if w.pid == pid {
                w.role = Role::Current;
                slot.generation = w.generation;
                spawn = Some(w.spawn);
            } else if w.role == Role::Current {
                w.role = Role::Retiring;
                info!("worker {index} (pid {}) replaced by pid {pid}; draining", w.pid);
                retire(w.pid);
            }
        }
        if let Some(spawn) = spawn {
            self.reload_worker_ready(index, spawn, pid);
        }
    }

    fn on_exit(&mut self, index: usize, pid: u32, status: Option<ExitStatus>) {
        let Some(slot) = self.slots.get_mut(index) else { return };
        let Some(at) = slot.workers.iter().position(|w| w.pid == pid) else { return };
        let worker = slot.workers.remove(at);
        if let Some((claims, _)) = &self.cores {
            claims.clear(pid);
        }
        if let Some((table, _)) = &self.balance {
            table.clear(pid);
        }
        if worker.state != WorkerState::Draining {
            self.settle_port();
        }
        let slot = &mut self.slots[index];
        self.totals
            .retired
            .add(&worker.stats.snapshot().without_gauges().remapped(&rows_of(&self.models, &worker.models)));
        let how = describe_exit(status);
        if worker.role == Role::Retiring || slot.removing() {
            info!("worker {index} (pid {pid}) retired: {how}");
            // Events name slots by index: only trailing slots may go, so no index shifts.
            let before = self.slots.len();
            while self.slots.last().is_some_and(|s| s.removing() && s.workers.is_empty()) {
                self.slots.pop();
            }
            if self.slots.len() < before {
                info!("scaled down to {} workers", self.slots.len());
            }
            return;
        }
        let stuck = match (&worker.stuck, worker.memory_killed) {
            (Some((why, _)), _) => format!(" (stuck: {why})"),
            (None, true) => " (over the hard memory limit)".to_string(),
            (None, false) => String::new(),
        };
        slot.last_exit = Some(format!("pid {pid} {how} after {:.1} s{stuck}", worker.started.elapsed().as_secs_f64()));
        if self.stopping {
            info!("worker {index} (pid {pid}) {how}");
            return;
        }
        let code = status.and_then(|s| s.code());
        let failure = worker.failure.clone().or_else(|| match code {
            Some(EXIT_MODEL_LOAD) => Some((FailureKind::ModelLoad, format!("worker {how}"))),
            Some(EXIT_BOOT) => Some((FailureKind::Boot, format!("worker {how}"))),
            _ => None,
        });
        if worker.role == Role::Incoming {
            // A replacement that never became ready: the current worker keeps serving. Only
            // the reload's own worker fails the reload.
            let error = failure.map_or_else(|| format!("the new worker {how}"), |(_, e)| e);
            error!("worker {index}: replacement for {} (pid {pid}) failed: {error}", worker.cause.as_str());
            slot.recycle_pause = Some(Instant::now() + RECYCLE_PAUSE);
            if self.reload.as_ref().is_some_and(|r| r.worker == Some(worker.spawn)) {
                self.abort_reload(index, &error);
            }
            return;
        }
        slot.restarts += 1;
        let reason = match (&failure, status.and_then(|s| s.signal())) {
            _ if worker.stuck.is_some() => "stuck",
            _ if worker.memory_killed => "memory_hard",
            (Some((FailureKind::ModelLoad, _)), _) => "model_load",
            (Some((FailureKind::Boot, _)), _) => "boot",
            _ if code == Some(EXIT_PANIC) => "panic",
            (None, Some(_)) => "signal",
            (None, None) => "exit",
        };
        debug_assert!(RESTART_REASONS.contains(&reason), "{reason} is listed");
        *self.totals.restarts.entry(reason).or_default() += 1;
        if worker.ready_at.is_some_and(|t| t.elapsed() >= STABLE_AFTER.max(t - worker.started)) {
            slot.failures = 0;
        }
        slot.failures += 1;
        let failures = slot.failures;
        match failure {
            Some((kind, error)) if !self.booted => {
                error!("worker {index} (pid {pid}) {how}: {error}");
                return self.fail(match kind {
                    FailureKind::ModelLoad => SupervisorError::ModelLoad { slot: index, error },
                    FailureKind::Boot => SupervisorError::Boot { slot: index, error },
                });
            }
            Some((_, error)) => error!("worker {index} (pid {pid}) {how}: {error}"),
            None if !self.booted && failures >= MAX_BOOT_CRASHES => {
                let error = format!("died {failures} times during start-up, last {how}");
                error!("worker {index}: {error}");
                return self.fail(SupervisorError::Boot { slot: index, error });
            }
            None => match &worker.stuck {
                Some((why, _)) => warn!("worker {index} (pid {pid}) {how} after being stuck ({why}); replacing it"),
                None => warn!("worker {index} (pid {pid}) {how}; replacing it"),
            },
        }
        let delay = backoff(failures);
        if !delay.is_zero() {
            info!("worker {index}: next start in {delay:?} ({failures} failures in a row)");
        }
        self.slots[index].start = Start::At(Instant::now() + delay);
        self.slots[index].cause = Cause::Respawn;
    }

    /// Which slots' sockets stay in the port's SO_REUSEPORT group. A slot none of whose
    /// workers accepts (its worker died, drains, or is not warm yet) leaves the group, so that
    /// connections waiting in its queue move to a sibling (net.ipv4.tcp_migrate_req) and new
    /// ones go there, but only while a sibling accepts: when every worker is down at once, the
    /// sockets that still listen stay, and clients wait in their queues for the first worker
    /// back instead of being refused. That worker's readiness settles the port again, and the
    /// slots still without a worker leave then. A stopping pool respawns nothing: its slots
    /// leave as their workers stop accepting.
    ///
    /// A slot whose next worker is booting is left as it is: that worker listens as soon as
    /// it is warm, before its `Ready` arrives here, and taking its socket out just then would
    /// make it join again (a slot left earlier has left already).
    fn settle_port(&self) {
        if self.stopping || self.slots.iter().any(Slot::ready) {
            for slot in self.slots.iter().filter(|s| !s.ready() && s.booting().is_none()) {
                slot.sockets.leave();
            }
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        if self.totals.latency_samples.back().is_none_or(|(t, _)| now - *t >= LATENCY_SAMPLE_EVERY) {
            self.totals.latency_samples.push_back((now, self.totals().request_latency_buckets()));
            while self
                .totals
                .latency_samples
                .front()
                .is_some_and(|(t, _)| now - *t > LATENCY_WINDOW + LATENCY_SAMPLE_EVERY)
            {
                self.totals.latency_samples.pop_front();
            }
        }
        if self.stopping {
            if self.stop_deadline.is_some_and(|d| now >= d) && !self.killed_all {
                warn!("grace timeout passed; killing the remaining workers");
                self.signal_all(Signal::SIGKILL);
                self.killed_all = true;
            }
            return;
        }
        self.kill_stuck_workers();
        // Before the guards: a slot the reload was waiting for gets the reload's worker now,
        // and no guard starts another replacement beside it.
        self.resume_reload();
        self.finish_reload();
        let every = Duration::from_secs_f64(self.resolved.config.server.memory_check_interval_secs);
        if self.memory.checked.is_none_or(|t| now - t >= every) {
            self.memory.checked = Some(now);
            self.watch_memory();
        }
        self.maybe_recycle(now);
        let boot_timeout = Duration::from_secs_f64(self.resolved.config.server.boot_timeout_secs);
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            for w in slot.workers.iter_mut() {
                let booting = matches!(w.state, WorkerState::Starting | WorkerState::Warming);
                if booting && w.failure.is_none() && w.started.elapsed() > boot_timeout {
                    let error = format!("not ready within server.boot_timeout_secs = {}", boot_timeout.as_secs_f64());
                    warn!("worker {index} (pid {}) {error}; killing it", w.pid);
                    w.failure = Some((FailureKind::Boot, error));
                    let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
                }
            }
            if slot.due(now) {
                slot.start = Start::No;
                let (models, generation, cause) = (slot.models.clone(), slot.generation, slot.cause);
                self.spawn(index, Role::Current, cause, models, generation);
            }
        }
    }

    fn fail(&mut self, error: SupervisorError) {
        if self.fatal.is_none() {
            self.fatal = Some(error);
        }
        self.begin_stop(true);
    }

    fn begin_stop(&mut self, fast: bool) {
        if !self.stopping {
            self.stopping = true;
            let grace = Duration::from_secs_f64(self.resolved.config.server.graceful_timeout_secs);
            // A worker enforces the grace period itself; the supervisor adds a margin before
            // it stops waiting.
            self.stop_deadline = Some(Instant::now() + grace + Duration::from_secs(2));
            if let Some(reload) = self.reload.take() {
                if let Some(replies) = reload.replies {
                    let _ = replies.send(Response::error("reload abandoned: the server is stopping"));
                }
            }
        }
        if fast {
            self.signal_all(Signal::SIGKILL);
            self.killed_all = true;
        } else {
            self.signal_all(Signal::SIGTERM);
        }
    }

    fn signal_all(&self, signal: Signal) {
        for worker in self.slots.iter().flat_map(|s| s.workers.iter()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(worker.pid as i32), signal);
        }
    }

    /// The pool's phase, from the slots and the reload in progress: never stored.
    fn phase(&self) -> Phase {
        if self.stopping {
            return Phase::Stopping;
        }
        let all_ready = self.slots.iter().filter(|s| !s.removing()).all(Slot::ready);
        match (self.booted, self.reload.is_some(), all_ready) {
            (false, _, _) => Phase::Starting,
            (true, true, _) => Phase::Reloading,
            (true, false, true) => Phase::Ready,
            (true, false, false) => Phase::Degraded,
        }
    }

    /// After each event or tick: the pool has booted once every slot has been ready at the same
    /// time; a change of phase is logged. Returns the phase now.
    fn settle(&mut self, before: Phase) -> Phase {
        if !self.booted && !self.stopping && self.slots.iter().filter(|s| !s.removing()).all(Slot::ready) {
            self.booted = true;
            info!(
                "pool ready: {} workers serving on {} after {:.2} s",
                self.slots.len(),
                self.resolved.config.server.listen,
                self.started.elapsed().as_secs_f64()
            );
        }
        let phase = self.phase();
        if phase != before && self.booted {
            info!("pool {before:?} -> {phase:?}");
        }
        phase
    }
}

/// Retires a worker whose siblings carry on: SIGUSR1 makes it drain and hand its idle
/// keep-alive connections to them (SIGTERM, for a stopping pool, closes them).
pub(super) fn retire(pid: u32) {
    let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGUSR1);
}

fn new_slot(
    placement: Placement,
    models: Vec<ModelEntry>,
    generation: u64,
    cause: Cause,
    sockets: SlotSockets,
) -> Slot {
    Slot {
        placement,
        models,
        generation,
        workers: Vec::new(),
        restarts: 0,
        failures: 0,
        start: Start::At(Instant::now()),
        cause,
        last_exit: None,
        recycle_pause: None,
        sockets,
    }
}

/// Why a worker that died was replaced (`inferd_worker_restarts_total{reason}`).
const RESTART_REASONS: [&str; 7] = ["stuck", "memory_hard", "model_load", "boot", "panic", "signal", "exit"];
/// Why a live worker was replaced gap-free (`inferd_worker_recycles_total{reason}`): its
/// memory (guards.rs's soft limit), server.max_requests, server.max_worker_age_secs, a panic
/// it caught.
const RECYCLE_REASONS: [&str; 4] = ["memory", "max_requests", "max_age", "fault"];

/// 0 for the first failure, then 0.5 s doubling up to 30 s.
fn backoff(failures: u32) -> Duration {
    match failures {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(500u64.saturating_mul(1 << (n - 2).min(6))).min(Duration::from_secs(30)),
    }
}

fn signal_name(signal: i32) -> &'static str {
    Signal::try_from(signal).map(|s| s.as_str()).unwrap_or("signal")
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    match status {
        None => "exited (status unknown)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(sig)) => format!("was killed by {}", signal_name(sig)),
            _ => format!("exited ({s})"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let delays: Vec<u64> = (1..=10).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(delays, vec![0, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
    }

    #[test]
    fn exits_are_described() {
        assert_eq!(describe_exit(Some(ExitStatus::from_raw(3 << 8))), "exited with code 3");
        assert_eq!(describe_exit(Some(ExitStatus::from_raw(9))), "was killed by SIGKILL");
    }

    fn worker(role: Role) -> Worker {
        Worker {
            pid: 1,
            spawn: 1,
            cause: Cause::Boot,
            generation: 1,
            role,
            state: WorkerState::Ready,
            started: Instant::now(),
            ready_at: None,
            models: Vec::new(),
            failure: None,
            stats: WorkerCounters::create("inferd-test").unwrap().0,
            recycle_after: None,
            stuck: None,
            memory_killed: false,
        }
    }

    #[test]
    fn only_a_slots_start_state_starts_its_worker() {
        let now = Instant::now();
        let sockets =
            SlotSockets::bind(&ServerConfig { listen: "127.0.0.1:0".into(), ..Default::default() }, false).unwrap();
        let mut slot = new_slot(
            Placement { index: 0, cpus: vec![0], threads: 1, borrow: None },
            Vec::new(),
            1,
            Cause::Boot,
            sockets,
        );
        let later = now + Duration::from_secs(5);
        for (start, due) in [
            (Start::At(now), true),
            (Start::At(later), false),
            (Start::Held, false),
            (Start::No, false),
            (Start::Removing, false),
            (Start::WhenEmpty, true),
        ] {
            slot.start = start;
            assert_eq!(slot.due(now), due, "{start:?}, no workers");
        }
        // A retiring worker holds back WhenEmpty (memory for one only), not a timed start.
        slot.workers.push(worker(Role::Retiring));
        slot.start = Start::WhenEmpty;
        assert!(!slot.due(now));
        slot.start = Start::At(now);
        assert!(slot.due(now));
        // A current or incoming worker: nothing to start, whatever the state says.
        for role in [Role::Current, Role::Incoming] {
            slot.workers = vec![worker(role)];
            assert!(!slot.due(now), "{role:?}");
        }
        assert!(!slot.removing());
        slot.start = Start::Removing;
        assert!(slot.removing());
    }

    #[test]
    fn own_status_is_readable() {
        let own = proc_status(std::process::id());
        assert!(own.rss.unwrap() > 0 && own.private.unwrap() > 0 && own.private <= own.rss);
        assert!(own.threads.unwrap() >= 1);
    }
}
