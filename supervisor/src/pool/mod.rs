//! The supervisor's loop, and the pool it runs.
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
//!
//! The files, one concept each, from the loop down; the loop's are the two that write
//! `impl Supervisor`:
//! - this one: the loop (events and ticks in, decisions out, from [`run`]), starting a
//!   worker, and carrying out the guards' decisions; events.rs: what the loop does with each
//!   event (an operator's action, a worker's message or exit);
//! - supervisor.rs: the loop's state, one part per field ([`Supervisor`]); report.rs:
//!   `inferd status`, systemd's status line and the metrics, from a read-only view of the
//!   parts ([`Report`]);
//! - the parts: life.rs: the pool's start, boot and stop ([`Life`]); services.rs: the control
//!   socket and the admin listener ([`Services`]); memory.rs: the memory plan and watch
//!   ([`MemoryWatch`]); saturation.rs: the saturation gauges; reload.rs: rolling reloads,
//!   whose whole state is one [`ReloadState`]; upgrade.rs: upgrading inferd itself, on
//!   either side ([`Upgrade`]); totals.rs: the pool's counters ([`Totals`]);
//! - spawn.rs: starting a worker process (its spec, its descriptors, the ones every worker
//!   shares: [`Launcher`]);
//! - slot.rs: the pool's slots and workers and their states ([`Pool`], [`Slot`], [`Role`],
//!   [`Start`]), scaling, stuck workers, which worker is due for recycling;
//! - what the others share: restart.rs: the loop's tick, how a dead worker's exit is told,
//!   and the backoff of a slot whose workers keep dying; sockets.rs: the slots' sockets on
//!   the port ([`SlotSockets`]); error.rs: how the pool ends with an error
//!   ([`SupervisorError`]).
//!
//! The [`Supervisor`] holds its state in those parts, each a type whose methods are in its
//! own file. The launcher's, the memory guard's, the reload's, the upgrade's, the counters'
//! and the gauges' fields are private to their files, which alone change them: the loop asks
//! them what to do and tells them what became of it. The slots and workers change through
//! the methods of slot.rs; the loop's two files read them and decide.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use inferd_config::model::ModelEntry;
use inferd_ipc::spec::Cause;
use nix::sys::signal::Signal;
use opentelemetry::KeyValue;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::control::Request;
use crate::event::{Event, Say};
use crate::metrics::RecycleReason;
use crate::plan::memory::MemoryBudget;
use crate::plan::Resolved;
use crate::status::Phase;
use crate::systemd::{self, Notifier};
use crate::{signals, tcp, trace};

mod error;
mod events;
mod life;
mod memory;
mod reload;
mod report;
mod restart;
mod saturation;
mod services;
mod slot;
mod sockets;
mod spawn;
mod supervisor;
mod totals;
mod upgrade;

use life::Life;
use memory::{MemoryWatch, Verdict};
use reload::ReloadState;
use report::Report;
use restart::{signal_name, TICK};
use services::Services;
use slot::{Pool, Role, Slot, Start};
use sockets::{dup_high, SlotSockets};
use spawn::{Launcher, Order};
use totals::Totals;
use upgrade::Upgrade;

pub use error::SupervisorError;
pub use supervisor::Supervisor;

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
    // Before any thread exists: both clear the variables that name inherited descriptors.
    let mut inherited = upgrade::Inherited::take().map_err(std::io::Error::other)?;
    let activated = match inherited.as_mut() {
        Some(from) => from.activated.take().map(std::net::TcpListener::from),
        None => systemd::listener().map_err(|e| std::io::Error::new(e.kind(), format!("socket activation: {e}")))?,
    };
    let activated = match activated {
        Some(socket) => {
            let addr = socket.local_addr()?;
            info!(
                "serving on the socket systemd passed ({addr}); server.listen ({}) is not used",
                resolved.config.server.listen
            );
            resolved.config.server.listen = addr.to_string();
            // Above the fds a worker's are moved to, so that moving them cannot clobber it.
            Some(dup_high(socket.as_raw_fd())?)
        }
        None => None,
    };
    // A fresh start joins no other server's port (inherited sockets and systemd's are ours).
    if inherited.is_none() {
        let server = &resolved.config.server;
        if activated.is_none() {
            crate::port::check_free(server.listen_addr(), false)?;
        }
        server.grpc_addr().map(|addr| crate::port::check_free(addr, true)).transpose()?;
    }
    // A single-threaded runtime: the supervisor's work is tiny, and its only extra thread is
    // signal-hook's forwarder.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let socket = resolved.config.control_socket();
        // The shared-memory regions go with the pool (Services::open made the folder afresh).
        let regions = resolved.config.shared_memory_registry();
        let forget = || {
            let _ = std::fs::remove_file(&socket);
            let _ = std::fs::remove_dir_all(&regions);
        };
        // The control socket's file is another supervisor's while this one takes over.
        let candidate = inherited.is_some();
        let (events, mut queue) = mpsc::unbounded_channel();
        let started = async {
            let services = Services::open(&resolved, inherited.as_mut()).await?;
            if activated.is_none() {
                // A slot left without a worker takes its socket out of the group (systemd's
                // shared socket never leaves, so needs no migration).
                tcp::ensure_migrate_req(resolved.config.server.set_tcp_migrate_req);
            }
            signals::forward(events.clone())?;
            crate::trace::init(&resolved.config.tracing_config());
            Supervisor::new(resolved, events, activated, services, inherited)
        };
        let mut supervisor = match started.await {
            Ok(supervisor) => supervisor,
            Err(e) => {
                if !candidate {
                    forget();
                }
                return Err(e);
            }
        };
        let result = supervisor.run(&mut queue).await;
        if let Err(e) = &result {
            supervisor.upgrade.tell_old(Say::Failed { error: e.to_string() });
        }
        // The files stay for the supervisor this one hands over to (or that started it).
        if !supervisor.upgrade.socket_is_not_ours() {
            forget();
        }
        crate::trace::shutdown(Duration::from_secs(2));
        result
    })
}

impl Supervisor {
    fn new(
        resolved: Resolved,
        events: mpsc::UnboundedSender<Event>,
        listener: Option<OwnedFd>,
        services: Services,
        inherited: Option<upgrade::Inherited>,
    ) -> Result<Supervisor, SupervisorError> {
        let (mut slot_sockets, launcher, candidate) = match inherited {
            Some(from) => {
                let launcher = Launcher::new(events.clone(), listener, from.handoff, from.limits)?;
                let sockets = from.slots.into_iter().map(|(http, grpc)| SlotSockets::inherited(http, grpc)).collect();
                (sockets, launcher, Some((from.channel, from.old_pid)))
            }
            None => (Vec::new(), Launcher::new(events.clone(), listener, None, None)?, None),
        };
        slot_sockets.reverse();
        let mut slots = Vec::new();
        for placement in &resolved.plan.workers {
            let sockets = match slot_sockets.pop() {
                Some(inherited) => inherited,
                None => SlotSockets::bind(&resolved.config.server, launcher.activated())
                    .map_err(|e| SupervisorError::Port(e.to_string()))?,
            };
            slots.push(Slot::new(placement.clone(), resolved.models.clone(), 1, Cause::Boot, sockets));
        }
        // The first worker starts alone: its RSS after warm-up decides whether the others fit.
        for slot in slots.iter_mut().skip(1) {
            slot.start = Start::Held;
        }
        let mut supervisor = Supervisor {
            launcher,
            pool: Pool {
                slots,
                generation: 1,
                models: resolved.models.clone(),
                on_demand: slot::read_on_demand(&resolved.config, &resolved.models),
                access: resolved.access.clone(),
            },
            resolved,
            life: Life::new(),
            reload: ReloadState::default(),
            memory: MemoryWatch::default(),
            totals: Totals::new(),
            saturation: Default::default(),
            notifier: Notifier::default(),
            hang_on_sigusr2: hang_on_sigusr2(),
            services,
            events,
            upgrade: Upgrade::None,
            extra_sockets: slot_sockets,
        };
        match candidate {
            Some((channel, old_pid)) => {
                supervisor.upgrade = Upgrade::candidate(channel, old_pid, supervisor.events.clone())?
            }
            None => {
                supervisor.services.start(&supervisor.events);
                supervisor.notifier = Notifier::from_env();
            }
        }
        Ok(supervisor)
    }

    /// Retires every worker (SIGUSR1: each finishes its requests and hands its idle
    /// connections to the new supervisor's workers) and stops once they are gone.
    fn retire_all(&mut self) {
        self.begin_stop_with(None);
        self.pool.retire_all();
    }

    /// Slots' sockets inherited from an old supervisor with more slots: taken out of the
    /// port's group once it has handed over (what waits in them moves to the rest), then
    /// closed.
    fn leave_extra_sockets(&mut self) {
        for sockets in self.extra_sockets.drain(..) {
            sockets.leave();
        }
    }

    async fn run(&mut self, queue: &mut mpsc::UnboundedReceiver<Event>) -> Result<(), SupervisorError> {
        let plan = &self.resolved.plan;
        info!(
            "inferd {} (pid {}) starting {} workers x {} intra-op threads on {}; {} usable cores ({}); ONNX Runtime {} ({}); models: {}",
            inferd_ipc::version(),
            std::process::id(),
            plan.workers.len(),
            plan.threads_per_worker,
            self.resolved.config.server.listen,
            plan.budget.usable,
            plan.budget.describe(),
            self.resolved.ort.path.display(),
            self.resolved.ort.source,
            self.pool.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "),
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
            notifier.update(phase, || self.report().summary());
            self.notifier = notifier;
            if phase == Phase::Stopping && self.pool.slots.iter().all(|s| s.workers.is_empty()) {
                return match self.life.take_fatal() {
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
                // As nginx and gunicorn: upgrade to the binary this one was started from.
                libc::SIGUSR2 => self.act(Request::Upgrade { binary: None }, None),
                _ => {}
            },
            Event::Message { slot, pid, message } => self.on_message(slot, pid, message),
            Event::Exited { slot, pid, status } => self.on_exit(slot, pid, status),
            Event::Control(request, replies) => self.act(request, Some(replies)),
            Event::Scrape(reply) => {
                let _ = reply.send(self.report().metrics());
            }
            Event::Upgrade(event) => self.on_upgrade(event),
        }
    }

    /// Which slots' sockets stay in the port's group (`Pool::settle_port`). During an upgrade
    /// the other supervisor's workers accept on the same sockets: then none leaves.
    fn settle_port(&self) {
        if !self.upgrade.shares_sockets() {
            self.pool.settle_port(self.life.stopping());
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        self.totals.sample_latency(now, &self.pool);
        self.saturation.sample(now, &self.pool);
        if self.life.stopping() {
            if self.life.kill_now(now) {
                warn!("grace timeout passed; killing the remaining workers");
                self.pool.signal_all(Signal::SIGKILL);
            }
            return;
        }
        self.pool.kill_stuck(self.resolved.config.server.request_timeout_secs);
        self.upgrade.watch(self.resolved.config.server.boot_timeout_secs);
        // Before the guards: a slot the reload was waiting for gets the reload's worker now,
        // and no guard starts another replacement beside it.
        self.resume_reload();
        self.finish_reload();
        self.watch_memory(now);
        self.maybe_recycle(now);
        self.pool.kill_unready(Duration::from_secs_f64(self.resolved.config.server.boot_timeout_secs));
        for (index, cause, models, generation) in self.pool.take_due(now) {
            self.spawn(index, Role::Current, cause, models, generation);
        }
    }

    /// The memory watch's decisions (see `MemoryWatch::check`), carried out.
    fn watch_memory(&mut self, now: Instant) {
        let every = Duration::from_secs_f64(self.resolved.config.server.memory_check_interval_secs);
        let Some((budget, verdicts)) = self.memory.check(now, every, &self.pool) else { return };
        for verdict in verdicts {
            match verdict {
                Verdict::Kill(index) => self.pool.kill_for_memory(index),
                Verdict::Replace(index, why) => self.replace_for_memory(index, &budget, &why),
            }
        }
    }

    /// The first worker is ready: the memory plan (see `MemoryWatch::plan`); the pool keeps the
    /// slots that fit and starts those held until now.
    fn memory_plan(&mut self, pid: u32) -> Result<(), SupervisorError> {
        let keep = self.memory.plan(pid, &self.resolved.config.server, self.pool.slots.len())?;
        self.pool.fit(keep);
        Ok(())
    }

    /// Gracefully replaces a slot's worker for memory: the new one first when there is room for
    /// it, else the old one drains and exits before the new one starts. During a reload too:
    /// the reload tells its own workers by their spawn ids, and waits for this one to finish
    /// before it replaces the slot (retiring first would leave a 1-worker pool without a
    /// listener for a boot's length).
    fn replace_for_memory(&mut self, index: usize, budget: &MemoryBudget, why: &str) {
        self.totals.recycled(RecycleReason::Memory);
        let pid = self.pool.slots[index].with_role(Role::Current).map_or(0, |w| w.pid);
        self.pool.begin_replacement(index, Cause::Memory, "memory", pid, why);
        if self.memory.room_for_one(budget) {
            let slot = &self.pool.slots[index];
            let (models, generation) = (slot.models.clone(), slot.generation);
            self.spawn(index, Role::Incoming, Cause::Memory, models, generation);
            return;
        }
        self.pool.retire_first(index, Cause::Memory);
    }

    /// A worker due for recycling or with a fault is replaced, incoming first (see
    /// `Pool::recycle_due`).
    fn maybe_recycle(&mut self, now: Instant) {
        let max_age = self.resolved.config.server.max_worker_age_secs;
        let Some((index, reason)) = self.pool.recycle_due(now, max_age, self.reload.in_progress()) else { return };
        let slot = &self.pool.slots[index];
        let pid = slot.with_role(Role::Current).map_or(0, |w| w.pid);
        let (cause, detail) = match reason {
            RecycleReason::Fault => (Cause::Fault, "caught a panic serving a request (a bug, in its log)".to_string()),
            _ => (Cause::Recycle, format!("reached server.{reason}")),
        };
        let (models, generation) = (slot.models.clone(), slot.generation);
        self.totals.recycled(reason);
        let trace_id = self.pool.begin_replacement(index, cause, reason.as_str(), pid, &detail);
        let trace_id = trace_id.as_deref();
        match cause {
            Cause::Fault => warn!(trace_id, "worker {index} (pid {pid}) {detail}; replacing it"),
            _ => info!(trace_id, "worker {index} (pid {pid}) {detail}; replacing it"),
        }
        self.spawn(index, Role::Incoming, cause, models, generation);
    }

    /// Starts a worker for slot `index`; returns its spawn id, or None if it could not be
    /// started (a current worker is then retried after a backoff).
    fn spawn(
        &mut self,
        index: usize,
        role: Role,
        cause: Cause,
        models: Vec<ModelEntry>,
        generation: u64,
    ) -> Option<u64> {
        let config = &self.resolved.config;
        let slots = self.pool.slots.len();
        let memory_share = config.models.on_demand.then(|| self.memory.models_budget(config) / slots.max(1) as u64);
        let slot = &self.pool.slots[index];
        let order = Order {
            index,
            cause,
            models,
            generation,
            role,
            placement: &slot.placement,
            resolved: &self.resolved,
            catalog: self.reload.on_demand(generation).unwrap_or(&self.pool.on_demand),
            access: self.reload.access(cause).unwrap_or(&self.pool.access),
            memory_share,
            slots,
            beside_others: cause != Cause::Boot || self.upgrade.shares_sockets(),
        };
        match self.launcher.start(order, &slot.sockets) {
            Ok(worker) => {
                let spawn = worker.spawn;
                if cause.replaces() {
                    let started = vec![KeyValue::new("process.pid", i64::from(worker.pid))];
                    trace::event(&self.pool.slots[index].replacement, "worker started", started);
                }
                self.pool.add_worker(index, worker);
                Some(spawn)
            }
            Err(e) => {
                let delay = self.pool.start_failed(index, role);
                error!("cannot start worker {index}: {e}; retrying in {delay:?}");
                None
            }
        }
    }

    fn fail(&mut self, error: SupervisorError) {
        self.life.fail(error);
        self.begin_stop(true);
    }

    fn begin_stop(&mut self, fast: bool) {
        self.upgrade.abandon();
        self.begin_stop_with(Some(if fast { Signal::SIGKILL } else { Signal::SIGTERM }));
    }

    /// The pool stops: nothing starts any more; `signal`, if any, goes to every worker.
    fn begin_stop_with(&mut self, signal: Option<Signal>) {
        // A worker enforces the grace period itself; the supervisor adds a margin before it
        // stops waiting.
        if self.life.stop(Duration::from_secs_f64(self.resolved.config.server.graceful_timeout_secs)) {
            self.reload.abandon();
            self.pool.stopped();
        }
        match signal {
            Some(Signal::SIGKILL) => {
                self.pool.signal_all(Signal::SIGKILL);
                self.life.killed_all();
            }
            Some(signal) => self.pool.signal_all(signal),
            None => {}
        }
    }

    /// The pool's parts, read, for a report.
    fn report(&self) -> Report<'_> {
        Report {
            resolved: &self.resolved,
            pool: &self.pool,
            life: &self.life,
            phase: self.phase(),
            reload: &self.reload,
            upgrade: &self.upgrade,
            memory: &self.memory,
            totals: &self.totals,
            saturation: &self.saturation,
            launcher: &self.launcher,
        }
    }

    /// The pool's phase, from the slots and the reload in progress: never stored.
    fn phase(&self) -> Phase {
        if self.life.stopping() {
            return Phase::Stopping;
        }
        match (self.life.booted(), self.reload.in_progress(), self.pool.all_ready()) {
            (false, _, _) => Phase::Starting,
            (true, true, _) => Phase::Reloading,
            (true, false, true) => Phase::Ready,
            (true, false, false) => Phase::Degraded,
        }
    }

    /// After each event or tick: the pool has booted once every slot has been ready at the same
    /// time; a change of phase is logged. Returns the phase now.
    fn settle(&mut self, before: Phase) -> Phase {
        if self.pool.all_ready() && self.life.all_ready() {
            info!(
                "pool ready: {} workers serving on {} after {:.2} s",
                self.pool.slots.len(),
                self.resolved.config.server.listen,
                self.life.started().elapsed().as_secs_f64()
            );
        }
        if self.life.settled() && self.pool.all_ready() {
            let (pid, version) = (std::process::id(), inferd_ipc::version().to_string());
            self.upgrade.tell_old(Say::Ready { pid, version });
        }
        let phase = self.phase();
        if phase != before && self.life.booted() {
            info!("pool {before:?} -> {phase:?}");
        }
        phase
    }
}

#[cfg(test)]
mod tests {
    use crate::plan::memory::proc_status;

    #[test]
    fn own_status_is_readable() {
        let own = proc_status(std::process::id());
        assert!(own.rss.unwrap() > 0 && own.private.unwrap() > 0 && own.private <= own.rss);
        assert!(own.threads.unwrap() >= 1);
    }
}
