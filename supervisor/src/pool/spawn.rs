//! Starting a worker: its spec, the re-exec of this binary as `inferd worker` with its
//! descriptors in place (the control socket, the shared counters, its slot's sockets on the
//! port, the hand-off socket and the pool's core claims, at the numbers ipc/src/spec.rs and
//! ipc/src/cores.rs give them), and the task that forwards its messages and then reaps it.
//! What that takes beside the spec, the descriptors every worker shares included, is the
//! [`Launcher`]'s.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Instant;

use inferd_config::auth::Access;
use inferd_config::model::ModelEntry;
use inferd_ipc::balance::{Balance, WORKER_BALANCE_FD};
use inferd_ipc::cores::{CoreClaims, WORKER_CORES_FD};
use inferd_ipc::limits::{Limits, WORKER_LIMITS_FD};
use inferd_ipc::spec::{
    Cause, Lending, WorkerSpec, WORKER_CONTROL_FD, WORKER_GRPC_LISTENER_FD, WORKER_HANDOFF_RECV_FD,
    WORKER_HANDOFF_SEND_FD, WORKER_LISTENER_FD,
};
use inferd_ipc::stats::{WorkerCounters, WORKER_STATS_FD};
use inferd_ipc::triton::Answer;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::slot::{on_demand_besides, recycle_threshold, Role, Worker};
use super::sockets::{dup_high, handoff_socket, SlotSockets};
use crate::event::Event;
use crate::plan::cpu::{format_cpus, Placement};
use crate::plan::Resolved;
use crate::status::WorkerState;
use crate::systemd;

/// A worker to start: for which slot, role and cause, running what, and what the pool's other
/// parts say of it.
pub(super) struct Order<'a> {
    pub(super) index: usize,
    pub(super) cause: Cause,
    pub(super) models: Vec<ModelEntry>,
    pub(super) generation: u64,
    pub(super) role: Role,
    pub(super) placement: &'a Placement,
    pub(super) resolved: &'a Resolved,
    /// [models] on_demand: the catalog its worker may load from besides `models`: the reload's
    /// when this is one of its workers, else the pool's (read at start or by the latest
    /// successful reload; slot.rs). Nothing read here.
    pub(super) catalog: &'a [ModelEntry],
    /// The API keys and certificate: the reload's for its workers, else the pool's.
    pub(super) access: &'a Access,
    /// Its share of the memory for models loaded on demand.
    pub(super) memory_share: Option<u64>,
    /// How many slots the pool has.
    pub(super) slots: usize,
    /// Whether other workers serve while this one boots: a replacement, or the first
    /// workers of an upgrade's new supervisor.
    pub(super) beside_others: bool,
}

impl Launcher {
    /// Starts the worker `order` asks for on its slot's `sockets`.
    pub(super) fn start(&mut self, order: Order<'_>, sockets: &SlotSockets) -> std::io::Result<Worker> {
        let Order { index, cause, models, generation, role, placement, resolved, catalog, access, .. } = order;
        let config = &resolved.config;
        let on_demand = on_demand_besides(catalog, &models);
        let spec = WorkerSpec {
            index,
            generation,
            cause,
            threads: placement.threads,
            cpus: placement.cpus.clone(),
            ort_library: resolved.ort.path.clone(),
            models,
            server: config.server.clone(),
            shared_listener: self.activated(),
            handoff: self.handoff.is_some(),
            log: config.log.clone(),
            weights_cache: config.weights_cache(),
            shared_memory: Some(config.shared_memory_registry()),
            allocator: config.runtime.allocator,
            access: access.clone(),
            lending: match (&self.cores, placement.cpus.as_slice()) {
                (Some(_), &[home]) if placement.threads == 1 && config.server.lend_idle_cores => {
                    Some(Lending { home, borrow: placement.borrow })
                }
                _ => None,
            },
            balance: self.balance.is_some() && config.server.balance_connections,
            limits: self.limits.is_some(),
            boot_nice: match order.beside_others {
                true if self.renice => BOOT_NICE,
                _ => 0,
            },
            memory_share: order.memory_share,
            on_demand,
            load_timeout_secs: config.models.load_timeout_secs,
            eviction: config.models.eviction,
            placement: config.models.placement,
            tracing: config.tracing_config(),
            cache_bytes: config.cache.per_worker(order.slots),
        };
        let (pid, stats, answers) = self.start_process(&spec, sockets)?;
        let borrows = match spec.lending.and_then(|l| l.borrow) {
            Some(cpu) => format!(" (and cpu {cpu} while idle)"),
            None => String::new(),
        };
        info!(
            "worker {index} started for {}: pid {pid}, cpus {}{borrows}, {} threads, generation {generation}",
            cause.as_str(),
            format_cpus(&spec.cpus),
            spec.threads
        );
        self.spawns += 1;
        Ok(Worker {
            pid,
            spawn: self.spawns,
            cause,
            generation,
            role,
            state: WorkerState::Starting,
            started: Instant::now(),
            ready_at: None,
            models: Vec::new(),
            failure: None,
            stats,
            answers,
            recycle_after: recycle_threshold(&config.server),
            stuck: None,
            memory_killed: false,
            costs: Default::default(),
        })
    }

    /// Each API key's rate, concurrency and counts now (for the metrics).
    pub(super) fn keys(&self) -> Vec<inferd_ipc::limits::KeyReport> {
        self.limits.as_ref().map(|(table, _)| table.report()).unwrap_or_default()
    }
}

/// What starting a worker takes beside its spec: this binary, the queue its task reports to,
/// the descriptors every worker shares, and the spawn ids handed out so far.
pub(super) struct Launcher {
    exe: PathBuf,
    events: mpsc::UnboundedSender<Event>,
    /// Workers started so far: the next one's spawn id.
    spawns: u64,
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
    /// Each API key's rate, concurrency and counts (see `inferd_ipc::limits`), mapped here to
    /// report them and to clear the requests of workers that exit, and its descriptor.
    limits: Option<(Limits, OwnedFd)>,
    /// Whether a thread of this user may be put back to nice 0 once niced (root with
    /// CAP_SYS_NICE, or RLIMIT_NICE: systemd's `LimitNICE=+0`): workers then boot niced.
    renice: bool,
}

/// The nice value a worker boots at beside serving ones ([`WorkerSpec::boot_nice`]): at +9 a
/// thread gets about an eighth of a core a nice-0 thread wants, and the background lane's +10
/// on top of it (19) comes back exactly to +10.
const BOOT_NICE: i32 = 9;

/// Whether a thread may be niced and put back (the worker's boot does that to all of its).
fn can_renice() -> bool {
    std::thread::spawn(|| {
        let tid = nix::unistd::gettid().as_raw() as libc::id_t;
        // SAFETY: plain system calls on this thread's own id.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, tid, 1) == 0 && libc::setpriority(libc::PRIO_PROCESS, tid, 0) == 0
        }
    })
    .join()
    .unwrap_or(false)
}

impl Launcher {
    /// `listener`: systemd's socket, under socket activation. Without a hand-off socket, core
    /// claims or a connection table, the pool runs without what each gives (and says so).
    /// `handoff` and `limits`: the pool's hand-off socket and table of key limits, inherited
    /// from the supervisor this one upgrades (created here when None).
    pub(super) fn new(
        events: mpsc::UnboundedSender<Event>,
        listener: Option<OwnedFd>,
        handoff: Option<(OwnedFd, OwnedFd)>,
        limits: Option<OwnedFd>,
    ) -> std::io::Result<Launcher> {
        let handoff = match handoff {
            Some(pair) => Some(pair),
            None => handoff_socket()
                .map_err(|e| {
                    warn!("no hand-off socket ({e}): idle keep-alive connections of a retiring worker are closed")
                })
                .ok(),
        };
        let limits = match limits {
            Some(fd) => Limits::map(&fd).map(|table| (table, fd)),
            None => Limits::create().and_then(|(table, fd)| Ok((table, dup_high(fd.as_raw_fd())?))),
        };
        let renice = can_renice();
        if !renice {
            info!("workers boot at their own priority: a thread may not be put back to nice 0 here (LimitNICE=+0 allows it)");
        }
        Ok(Launcher {
            renice,
            exe: std::env::current_exe()?,
            events,
            spawns: 0,
            listener,
            handoff,
            // Above fd 11, as every descriptor a worker gets (see `start_process`).
            cores: CoreClaims::create()
                .and_then(|(claims, fd)| Ok((claims, dup_high(fd.as_raw_fd())?)))
                .map_err(|e| warn!("no core claims ({e}): workers do not lend idle cores to each other"))
                .ok(),
            balance: Balance::create()
                .and_then(|(table, fd)| Ok((table, dup_high(fd.as_raw_fd())?)))
                .map_err(|e| warn!("no connection table ({e}): workers do not shed connections to balance"))
                .ok(),
            limits: limits
                .map_err(|e| error!("no table of API key limits ({e}): keys' rate and concurrency are not enforced"))
                .ok(),
        })
    }

    /// The binary workers are started from (and an upgrade, by default): this one's path as
    /// it was at start.
    pub(super) fn exe(&self) -> &std::path::Path {
        &self.exe
    }

    /// Descriptors an upgrade hands to the new supervisor: systemd's socket, the hand-off
    /// socket, the table of key limits.
    pub(super) fn listener_fd(&self) -> Option<i32> {
        self.listener.as_ref().map(|fd| fd.as_raw_fd())
    }

    pub(super) fn handoff_fds(&self) -> Option<(i32, i32)> {
        self.handoff.as_ref().map(|(send, recv)| (send.as_raw_fd(), recv.as_raw_fd()))
    }

    pub(super) fn limits_fd(&self) -> Option<i32> {
        self.limits.as_ref().map(|(_, fd)| fd.as_raw_fd())
    }

    /// Whether the workers share systemd's socket (socket activation) rather than their
    /// slots' own.
    pub(super) fn activated(&self) -> bool {
        self.listener.is_some()
    }

    /// Worker `pid` has exited: its core claims and its entry in the connection table go.
    pub(super) fn forget(&self, pid: u32) {
        if let Some((claims, _)) = &self.cores {
            claims.clear(pid);
        }
        if let Some((table, _)) = &self.balance {
            table.clear(pid);
        }
        if let Some((table, _)) = &self.limits {
            table.clear(pid);
        }
    }

    /// Re-executes this binary as `inferd worker` with its end of a socketpair as fd 3 and
    /// its shared counters as fd 4.
    fn start_process(
        &self,
        spec: &WorkerSpec,
        sockets: &SlotSockets,
    ) -> std::io::Result<(u32, WorkerCounters, mpsc::UnboundedSender<Answer>)> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let (stats, stats_fd) = WorkerCounters::create(&format!("inferd-worker-{}", spec.index))?;
        // Both descriptors go to fds 3 and 4 in the child: first move them above 11 so that
        // neither dup2 can overwrite the other.
        let (control, counters) = (dup_high(theirs.as_raw_fd())?, dup_high(stats_fd.as_raw_fd())?);
        drop((theirs, stats_fd));
        let (control_fd, counters_fd) = (control.as_raw_fd(), counters.as_raw_fd());
        // The slot's sockets, or systemd's shared one, and the hand-off socket (already above
        // 10: see `run`, `SlotSockets::bind` and `handoff_socket`).
        let (http, grpc) = sockets.listeners();
        let listener_fd = http.or(self.listener.as_ref()).map(|l| l.as_raw_fd());
        let grpc_fd = grpc.map(|l| l.as_raw_fd());
        let handoff_fds = self.handoff.as_ref().map(|(send, recv)| (send.as_raw_fd(), recv.as_raw_fd()));
        let cores_fd = self.cores.as_ref().filter(|_| spec.lending.is_some()).map(|(_, fd)| fd.as_raw_fd());
        let balance_fd = self.balance.as_ref().filter(|_| spec.balance).map(|(_, fd)| fd.as_raw_fd());
        let limits_fd = self.limits.as_ref().filter(|_| spec.limits).map(|(_, fd)| fd.as_raw_fd());
        let supervisor = std::process::id() as libc::pid_t;
        let threads = spec.threads.to_string();
        let mut command = tokio::process::Command::new(&self.exe);
        command
            .arg("worker")
            .arg("--fd")
            .arg(WORKER_CONTROL_FD.to_string())
            // Libraries that size their own pools from these stay within the worker's share.
            .env("OMP_NUM_THREADS", &threads)
            .env("MKL_NUM_THREADS", &threads)
            .env("OPENBLAS_NUM_THREADS", &threads)
            .env("TOKENIZERS_PARALLELISM", "false")
            // Workers get the keys' digests in their spec, not the keys.
            .env_remove(inferd_config::auth::API_KEYS_ENV)
            // No ONNX Runtime telemetry thread (see worker/src/runtime/model.rs).
            .env("ORT_DISABLE_TELEMETRY", "1")
            // Logging starts before the spec is read: the format and the slot come this way.
            .env("INFERD_LOG_FORMAT", spec.log.format.as_str())
            .env("INFERD_WORKER", spec.index.to_string())
            .stdin(Stdio::null());
        for name in systemd::VARIABLES {
            command.env_remove(name);
        }
        // SAFETY: between fork and exec only async-signal-safe libc calls are made, and no
        // allocation happens.
        unsafe {
            command.pre_exec(move || {
                // dup2 leaves the new descriptors without FD_CLOEXEC: they survive the exec.
                let listeners =
                    [listener_fd.map(|fd| (fd, WORKER_LISTENER_FD)), grpc_fd.map(|fd| (fd, WORKER_GRPC_LISTENER_FD))];
                let handoff = handoff_fds
                    .map(|(send, recv)| [(send, WORKER_HANDOFF_SEND_FD), (recv, WORKER_HANDOFF_RECV_FD)])
                    .into_iter()
                    .flatten();
                let moves = [(control_fd, WORKER_CONTROL_FD), (counters_fd, WORKER_STATS_FD)];
                let cores = cores_fd.map(|fd| (fd, WORKER_CORES_FD));
                let balance = balance_fd.map(|fd| (fd, WORKER_BALANCE_FD));
                let limits = limits_fd.map(|fd| (fd, WORKER_LIMITS_FD));
                let listeners = listeners.into_iter().flatten().chain(cores).chain(balance).chain(limits);
                for (from, to) in moves.into_iter().chain(listeners).chain(handoff) {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // If the supervisor dies, the worker drains and exits instead of lingering.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != supervisor {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let mut process = command.spawn()?;
        drop((control, counters));
        let pid = process.id().ok_or_else(|| std::io::Error::other("worker exited at once"))?;
        let mut line = serde_json::to_vec(spec).map_err(std::io::Error::other)?;
        line.push(b'\n');
        (&ours).write_all(&line)?;
        ours.set_nonblocking(true)?;
        let (stream, answers) = tokio::net::UnixStream::from_std(ours)?.into_split();
        let slot = spec.index;
        let events = self.events.clone();
        // The answers to its questions (`WorkerMessage::Ask`), written as the loop gives them.
        let (answer, mut to_write) = mpsc::unbounded_channel::<Answer>();
        tokio::spawn(async move {
            let mut answers = answers;
            while let Some(a) = to_write.recv().await {
                let mut line = serde_json::to_vec(&a).expect("answers serialise");
                line.push(b'\n');
                if answers.write_all(&line).await.is_err() {
                    break; // the worker is gone
                }
            }
        });
        // One task per worker: its messages to EOF (the socket closes when it exits), then its
        // exit, so that `Exited` never overtakes the `Failed` that explains it.
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str(&line) {
                    Ok(message) => {
                        let _ = events.send(Event::Message { slot, pid, message });
                    }
                    Err(e) => {
                        warn!("worker {slot} (pid {pid}) sent an unreadable message ({e}): {line}")
                    }
                }
            }
            let status = process.wait().await.ok();
            let _ = events.send(Event::Exited { slot, pid, status });
        });
        Ok((pid, stats, answer))
    }
}
