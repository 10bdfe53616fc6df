//! Slots, workers and the supervisor's loop.
//!
//! A slot is a place in the pool with a fixed CPU set; a worker is the process currently in
//! it. A slot whose worker dies gets a new one: at once the first time, then with exponential
//! backoff (0.5 s doubling up to 30 s) while its workers keep dying young. A worker that
//! reports a model-load or boot failure before the pool was ever ready stops the whole server
//! with that error; later, the slot is retried with backoff while the others keep serving.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use inferd_config::cpu::{format_cpus, Placement};
use inferd_config::spec::{
    FailureKind, ModelInfo, WorkerMessage, WorkerSpec, EXIT_BOOT, EXIT_MODEL_LOAD, WORKER_CONTROL_FD,
};
use inferd_config::Resolved;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::control::{self, ControlError, Request, Response};
use crate::status::{Phase, PoolStatus, WorkerState, WorkerStatus};
use crate::{signals, tcp, Event};

/// A worker that stays ready this long is healthy again: its slot's backoff resets.
const STABLE_AFTER: Duration = Duration::from_secs(10);
/// Consecutive deaths of one slot during start-up after which the server gives up.
const MAX_BOOT_CRASHES: u32 = 5;
const TICK: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("worker {slot} could not load its model: {error}")]
    ModelLoad { slot: usize, error: String },
    #[error("worker {slot} failed to start: {error}")]
    Boot { slot: usize, error: String },
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl SupervisorError {
    /// `inferd serve` exits with the worker's reserved code, so scripts can tell a bad model
    /// from a bad environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            SupervisorError::ModelLoad { .. } => EXIT_MODEL_LOAD,
            SupervisorError::Boot { .. } => EXIT_BOOT,
            _ => 1,
        }
    }
}

struct Worker {
    pid: u32,
    generation: u64,
    state: WorkerState,
    started: Instant,
    ready_at: Option<Instant>,
    requests: u64,
    in_flight: u64,
    models: Vec<ModelInfo>,
    /// What the worker said before failing, or why the supervisor killed it.
    failure: Option<(FailureKind, String)>,
}

struct Slot {
    placement: Placement,
    worker: Option<Worker>,
    restarts: u32,
    /// Deaths since the slot last had a worker ready for [`STABLE_AFTER`].
    failures: u32,
    next_start: Option<Instant>,
    last_exit: Option<String>,
}

pub struct Supervisor {
    resolved: Resolved,
    exe: PathBuf,
    events: mpsc::UnboundedSender<Event>,
    slots: Vec<Slot>,
    phase: Phase,
    /// True once every slot has been ready at the same time.
    booted: bool,
    started: Instant,
    generation: u64,
    retired_requests: u64,
    stop_deadline: Option<Instant>,
    killed_all: bool,
    fatal: Option<SupervisorError>,
}

/// Runs the supervisor until the pool has stopped. Blocks the calling thread.
pub fn run(resolved: Resolved) -> Result<(), SupervisorError> {
    // A single-threaded runtime: the supervisor's work is tiny, and its only extra thread is
    // signal-hook's forwarder.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let socket = resolved.config.control_socket();
        let listener = control::bind(&socket)?;
        tcp::ensure_migrate_req(resolved.config.server.set_tcp_migrate_req);
        let (events, mut queue) = mpsc::unbounded_channel();
        signals::forward(events.clone())?;
        tokio::spawn(control::serve(listener, events.clone()));
        let mut supervisor = Supervisor::new(resolved, events)?;
        let result = supervisor.run(&mut queue).await;
        let _ = std::fs::remove_file(&socket);
        result
    })
}

impl Supervisor {
    fn new(resolved: Resolved, events: mpsc::UnboundedSender<Event>) -> std::io::Result<Supervisor> {
        let slots = resolved
            .plan
            .workers
            .iter()
            .map(|placement| Slot {
                placement: placement.clone(),
                worker: None,
                restarts: 0,
                failures: 0,
                next_start: Some(Instant::now()),
                last_exit: None,
            })
            .collect();
        Ok(Supervisor {
            exe: std::env::current_exe()?,
            resolved,
            events,
            slots,
            phase: Phase::Starting,
            booted: false,
            started: Instant::now(),
            generation: 0,
            retired_requests: 0,
            stop_deadline: None,
            killed_all: false,
            fatal: None,
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
            self.resolved.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "),
        );
        let mut tick = tokio::time::interval(TICK);
        loop {
            tokio::select! {
                Some(event) = queue.recv() => self.on_event(event),
                _ = tick.tick() => self.on_tick(),
            }
            if self.phase == Phase::Stopping && self.slots.iter().all(|s| s.worker.is_none()) {
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
                _ => {}
            },
            Event::Message { slot, pid, message } => self.on_message(slot, pid, message),
            Event::Exited { slot, pid, status } => self.on_exit(slot, pid, status),
            Event::Control(request, reply) => {
                let _ = reply.send(self.on_control(request));
            }
        }
    }

    fn on_message(&mut self, slot: usize, pid: u32, message: WorkerMessage) {
        let Some(worker) = self.slots[slot].worker.as_mut().filter(|w| w.pid == pid) else {
            return;
        };
        match message {
            WorkerMessage::Warming => worker.state = WorkerState::Warming,
            WorkerMessage::Ready { models } => {
                worker.state = WorkerState::Ready;
                worker.ready_at = Some(Instant::now());
                worker.models = models;
                info!("worker {slot} (pid {pid}) ready after {:.2} s", worker.started.elapsed().as_secs_f64());
                self.update_phase();
            }
            WorkerMessage::Heartbeat { requests, in_flight } => {
                worker.requests = requests;
                worker.in_flight = in_flight;
            }
            WorkerMessage::Draining => {
                worker.state = WorkerState::Draining;
                self.update_phase();
            }
            WorkerMessage::Failed { kind, error } => worker.failure = Some((kind, error)),
        }
    }

    fn on_exit(&mut self, index: usize, pid: u32, status: Option<ExitStatus>) {
        let slot = &mut self.slots[index];
        let Some(worker) = slot.worker.take_if(|w| w.pid == pid) else {
            return;
        };
        self.retired_requests += worker.requests;
        let how = describe_exit(status);
        slot.last_exit = Some(format!("pid {pid} {how} after {:.1} s", worker.started.elapsed().as_secs_f64()));
        if self.phase == Phase::Stopping {
            info!("worker {index} (pid {pid}) {how}");
            return;
        }
        let code = status.and_then(|s| s.code());
        let failure = worker.failure.clone().or_else(|| match code {
            Some(EXIT_MODEL_LOAD) => Some((FailureKind::ModelLoad, format!("worker {how}"))),
            Some(EXIT_BOOT) => Some((FailureKind::Boot, format!("worker {how}"))),
            _ => None,
        });
        slot.restarts += 1;
        if worker.ready_at.is_some_and(|t| t.elapsed() >= STABLE_AFTER) {
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
            None => warn!("worker {index} (pid {pid}) {how}; replacing it"),
        }
        let delay = backoff(failures);
        if !delay.is_zero() {
            info!("worker {index}: next start in {delay:?} ({failures} failures in a row)");
        }
        self.slots[index].next_start = Some(Instant::now() + delay);
        self.update_phase();
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        if self.phase == Phase::Stopping {
            if self.stop_deadline.is_some_and(|d| now >= d) && !self.killed_all {
                warn!("grace timeout passed; killing the remaining workers");
                self.signal_all(Signal::SIGKILL);
                self.killed_all = true;
            }
            return;
        }
        let boot_timeout = Duration::from_secs_f64(self.resolved.config.server.boot_timeout_secs);
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            if let Some(w) = slot.worker.as_mut() {
                let booting = matches!(w.state, WorkerState::Starting | WorkerState::Warming);
                if booting && w.failure.is_none() && w.started.elapsed() > boot_timeout {
                    let error = format!("not ready within server.boot_timeout_secs = {}", boot_timeout.as_secs_f64());
                    warn!("worker {index} (pid {}) {error}; killing it", w.pid);
                    w.failure = Some((FailureKind::Boot, error));
                    let _ = nix::sys::signal::kill(Pid::from_raw(w.pid as i32), Signal::SIGKILL);
                }
            } else if slot.next_start.is_some_and(|t| now >= t) {
                slot.next_start = None;
                self.spawn(index);
            }
        }
    }

    fn on_control(&mut self, request: Request) -> Response {
        match request {
            Request::Status => Response { ok: true, status: Some(self.status()), error: None },
        }
    }

    fn fail(&mut self, error: SupervisorError) {
        if self.fatal.is_none() {
            self.fatal = Some(error);
        }
        self.begin_stop(true);
    }

    fn begin_stop(&mut self, fast: bool) {
        if self.phase != Phase::Stopping {
            self.phase = Phase::Stopping;
            let grace = Duration::from_secs_f64(self.resolved.config.server.graceful_timeout_secs);
            // A worker enforces the grace period itself; the supervisor adds a margin before
            // it stops waiting.
            self.stop_deadline = Some(Instant::now() + grace + Duration::from_secs(2));
        }
        if fast {
            self.signal_all(Signal::SIGKILL);
            self.killed_all = true;
        } else {
            self.signal_all(Signal::SIGTERM);
        }
    }

    fn signal_all(&self, signal: Signal) {
        for worker in self.slots.iter().filter_map(|s| s.worker.as_ref()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(worker.pid as i32), signal);
        }
    }

    fn update_phase(&mut self) {
        if self.phase == Phase::Stopping {
            return;
        }
        let all_ready = self.slots.iter().all(|s| s.worker.as_ref().is_some_and(|w| w.state == WorkerState::Ready));
        let phase = match (all_ready, self.booted) {
            (true, _) => Phase::Ready,
            (false, true) => Phase::Degraded,
            (false, false) => Phase::Starting,
        };
        if phase == Phase::Ready && !self.booted {
            self.booted = true;
            info!(
                "pool ready: {} workers serving on {} after {:.2} s",
                self.slots.len(),
                self.resolved.config.server.listen,
                self.started.elapsed().as_secs_f64()
            );
        } else if phase != self.phase {
            info!("pool {:?} -> {:?}", self.phase, phase);
        }
        self.phase = phase;
    }

    fn spawn(&mut self, index: usize) {
        self.generation += 1;
        let placement = &self.slots[index].placement;
        let config = &self.resolved.config;
        let spec = WorkerSpec {
            index,
            generation: self.generation,
            listen: config.listen_addr(),
            threads: placement.threads,
            cpus: placement.cpus.clone(),
            ort_library: self.resolved.ort.path.clone(),
            models: self.resolved.models.clone(),
            max_body_bytes: config.server.max_body_bytes,
            max_batch_inputs: config.server.max_batch_inputs,
            graceful_timeout_secs: config.server.graceful_timeout_secs,
        };
        match self.start_process(&spec) {
            Ok(pid) => {
                info!("worker {index} started: pid {pid}, cpus {}, {} threads", format_cpus(&spec.cpus), spec.threads);
                self.slots[index].worker = Some(Worker {
                    pid,
                    generation: spec.generation,
                    state: WorkerState::Starting,
                    started: Instant::now(),
                    ready_at: None,
                    requests: 0,
                    in_flight: 0,
                    models: Vec::new(),
                    failure: None,
                });
            }
            Err(e) => {
                let slot = &mut self.slots[index];
                slot.failures += 1;
                let delay = backoff(slot.failures).max(Duration::from_millis(500));
                error!("cannot start worker {index}: {e}; retrying in {delay:?}");
                slot.next_start = Some(Instant::now() + delay);
            }
        }
    }

    /// Re-executes this binary as `inferd worker` with its end of a socketpair as fd 3.
    fn start_process(&self, spec: &WorkerSpec) -> std::io::Result<u32> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let child_fd = theirs.as_raw_fd();
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
            // No ONNX Runtime telemetry thread (see worker/src/model.rs).
            .env("ORT_DISABLE_TELEMETRY", "1")
            .stdin(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe libc calls are made, and no
        // allocation happens.
        unsafe {
            command.pre_exec(move || {
                if child_fd == WORKER_CONTROL_FD {
                    let flags = libc::fcntl(child_fd, libc::F_GETFD);
                    libc::fcntl(child_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                } else if libc::dup2(child_fd, WORKER_CONTROL_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
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
        drop(theirs);
        let pid = process.id().ok_or_else(|| std::io::Error::other("worker exited at once"))?;
        let mut line = serde_json::to_vec(spec).map_err(std::io::Error::other)?;
        line.push(b'\n');
        (&ours).write_all(&line)?;
        ours.set_nonblocking(true)?;
        let stream = tokio::net::UnixStream::from_std(ours)?;
        let slot = spec.index;
        let events = self.events.clone();
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
        });
        let events = self.events.clone();
        tokio::spawn(async move {
            let status = process.wait().await.ok();
            let _ = events.send(Event::Exited { slot, pid, status });
        });
        Ok(pid)
    }

    fn status(&self) -> PoolStatus {
        let plan = &self.resolved.plan;
        let workers = self
            .slots
            .iter()
            .enumerate()
            .map(|(index, slot)| {
                let w = slot.worker.as_ref();
                let (rss_bytes, os_threads) = w.map(|w| proc_status(w.pid)).unwrap_or((None, None));
                WorkerStatus {
                    index,
                    pid: w.map(|w| w.pid),
                    generation: w.map_or(0, |w| w.generation),
                    state: w.map_or(WorkerState::Down, |w| w.state),
                    cpus: slot.placement.cpus.clone(),
                    threads: slot.placement.threads,
                    os_threads,
                    rss_bytes,
                    requests: w.map_or(0, |w| w.requests),
                    in_flight: w.map_or(0, |w| w.in_flight),
                    restarts: slot.restarts,
                    uptime_secs: w.map(|w| w.started.elapsed().as_secs_f64()),
                    models: w.map(|w| w.models.clone()).unwrap_or_default(),
                    last_exit: slot.last_exit.clone(),
                }
            })
            .collect::<Vec<_>>();
        PoolStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            phase: self.phase,
            listen: self.resolved.config.server.listen.clone(),
            uptime_secs: self.started.elapsed().as_secs_f64(),
            usable_cores: plan.budget.usable,
            cpu_budget: plan.budget.describe(),
            threads_per_worker: plan.threads_per_worker,
            requests_total: self.retired_requests + workers.iter().map(|w| w.requests).sum::<u64>(),
            workers,
        }
    }
}

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

/// RSS in bytes and thread count from /proc/PID/status.
fn proc_status(pid: u32) -> (Option<u64>, Option<u64>) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (None, None);
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    (field("VmRSS:").map(|kb| kb * 1024), field("Threads:"))
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

    #[test]
    fn own_status_is_readable() {
        let (rss, threads) = proc_status(std::process::id());
        assert!(rss.unwrap() > 0);
        assert!(threads.unwrap() >= 1);
    }
}
