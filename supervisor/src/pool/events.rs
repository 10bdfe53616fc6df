//! What the loop does with each event: an operator's action (from a signal or the control
//! socket), a worker's message, a worker's exit. Each decision that spans the pool's parts is
//! made here or in mod.rs (the loop and its tick), and carried out through the parts' methods.

use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;

use inferd_config::model::{ModelEntry, ModelOverride};
use inferd_ipc::spec::{Cause, FailureKind, WorkerMessage, EXIT_BOOT, EXIT_MODEL_LOAD, EXIT_PANIC};
use inferd_ipc::triton::{not_done, Answer, Answered, LoadParameters, Question, Refused};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{error, info, warn};

use super::error::SupervisorError;
use super::reload;
use super::restart::{backoff, describe_exit, MAX_BOOT_CRASHES, STABLE_AFTER};
use super::slot::{Replaced, Role};
use super::supervisor::Supervisor;
use super::upgrade::{Handing, Step, Upgrade};
use crate::confine::{confined, PathFrom};
use crate::control::{ActionError, Replies, Request, Response, Roll};
use crate::event::UpgradeEvent;
use crate::metrics::RestartReason;
use crate::status::WorkerState;
use crate::systemd::Notifier;
use crate::triton;

impl Supervisor {
    /// Every action, whether it came from a signal (`replies` = None) or the control socket.
    pub(super) fn act(&mut self, request: Request, replies: Option<Replies>) {
        let changes = !matches!(request, Request::Status);
        if let (true, Upgrade::Starting { pid, .. }) = (changes, &self.upgrade) {
            let error = ActionError::DuringUpgrade(*pid);
            warn!("{error}");
            if let Some(replies) = replies {
                let _ = replies.send(error.into());
            }
            return;
        }
        let answer = match request {
            Request::Status => Ok(Response { ok: true, status: Some(self.report().status()), ..Response::default() }),
            Request::Reload { model, path, wait } => match self.start_reload(model, path, wait, replies.clone()) {
                // The reload answers on its own as it goes.
                Ok(()) => return,
                Err(e) => Err(e),
            },
            Request::Scale { delta } => self.scale(delta).map(Response::message),
            Request::Load { model, path, config } => match self.start_load(model, path, config, replies.clone()) {
                Ok(()) => return,
                Err(e) => Err(e),
            },
            Request::Unload { model } => match self.start_unload(model, replies.clone()) {
                Ok(()) => return,
                Err(e) => Err(e),
            },
            Request::Upgrade { binary } => match self.start_upgrade(binary, replies.clone()) {
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
            let _ = replies.send(answer.unwrap_or_else(Response::from));
        }
    }

    pub(super) fn on_message(&mut self, index: usize, pid: u32, message: WorkerMessage) {
        let Some(slot) = self.pool.slots.get_mut(index) else { return };
        let Some(worker) = slot.workers.iter_mut().find(|w| w.pid == pid) else { return };
        match message {
            WorkerMessage::Warming => worker.warming(),
            WorkerMessage::Ready { models } => {
                for model in &models {
                    self.totals.model_event(&model.name).boot += 1;
                }
                worker.ready(models);
                let replaces = worker.cause.replaces();
                info!("worker {index} (pid {pid}) ready after {:.2} s", worker.started.elapsed().as_secs_f64());
                if replaces {
                    self.pool.end_replacement(index, Replaced::Ready(pid));
                }
                let Some(worker) = self.pool.slots[index].workers.iter().find(|w| w.pid == pid) else { return };
                if worker.role == Role::Incoming {
                    self.promote(index, pid);
                }
                self.settle_port();
                if !self.memory.measured() {
                    if let Err(e) = self.memory_plan(pid) {
                        error!("{e}");
                        self.fail(e);
                    }
                }
            }
            WorkerMessage::Draining => {
                worker.draining();
                self.settle_port();
                self.finish_reload();
            }
            WorkerMessage::Failed { kind, error } => worker.failed(kind, error),
            // A model of its catalog, loaded on demand: status and the model_info metric show
            // it on this worker from now on (its counts go to the shared "other" row).
            WorkerMessage::Loaded { model, cost, seconds } if worker.state == WorkerState::Ready => {
                info!("worker {index} (pid {pid}) loaded model '{}' on demand", model.name);
                self.totals.loaded(&model.name, seconds);
                worker.loaded(model, cost);
            }
            WorkerMessage::Loaded { .. } => {}
            WorkerMessage::Evicted { model } => {
                self.totals.model_event(&model).evictions += 1;
                worker.evicted(&model);
            }
            WorkerMessage::Refused { model, reason } => {
                *self.totals.model_event(&model).refusals.entry(reason).or_default() += 1;
            }
            WorkerMessage::Ask { id, question } => {
                let answers = worker.answers.clone();
                self.answer(id, question, answers);
            }
        }
    }

    /// A worker's question, asked on the main port: Triton's statistics or repository index,
    /// answered from the pool's counters as they are now, off the loop (the index reads the
    /// repository's folders); or a repository load or unload ([`Self::repository_change`]).
    fn answer(&mut self, id: u64, question: Question, answers: UnboundedSender<Answer>) {
        match question {
            Question::Statistics { model, version } => {
                let m = self.report().metrics();
                answer_later(id, answers, move || {
                    triton::statistics(&m, model.as_deref(), version.as_deref()).map(Answered::Statistics)
                })
            }
            Question::Index { ready } => {
                let (m, repository) = (self.report().metrics(), self.resolved.config.model_repository());
                answer_later(id, answers, move || Ok(Answered::Index(triton::index(&m, &repository, ready))))
            }
            Question::Load { model, path, config } => {
                self.repository_change(id, model, Some(LoadParameters { path, config }), answers)
            }
            Question::Unload { model } => self.repository_change(id, model, None, answers),
        }
    }

    /// An incoming worker is ready: it becomes the slot's current worker, and the one it
    /// replaces drains and leaves. The reload advances only if this is the worker it started.
    fn promote(&mut self, index: usize, pid: u32) {
        if let Some(spawn) = self.pool.promote(index, pid) {
            self.reload_worker_ready(index, spawn, pid);
        }
    }

    pub(super) fn on_exit(&mut self, index: usize, pid: u32, status: Option<ExitStatus>) {
        let Some(worker) = self.pool.remove_worker(index, pid) else { return };
        self.launcher.forget(pid);
        if worker.state != WorkerState::Draining {
            self.settle_port();
        }
        self.totals.keep(&worker, &self.pool.models);
        let slot = &mut self.pool.slots[index];
        let how = describe_exit(status);
        if worker.role == Role::Retiring || slot.removing() {
            info!("worker {index} (pid {pid}) retired: {how}");
            if self.pool.drop_removed() {
                info!("scaled down to {} workers", self.pool.slots.len());
            }
            return;
        }
        let stuck = match (&worker.stuck, worker.memory_killed) {
            (Some((why, _)), _) => format!(" (stuck: {why})"),
            (None, true) => " (over the hard memory limit)".to_string(),
            (None, false) => String::new(),
        };
        slot.exited(format!("pid {pid} {how} after {:.1} s{stuck}", worker.started.elapsed().as_secs_f64()));
        if self.life.stopping() {
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
            slot.replacement_failed();
            if worker.cause.replaces() {
                self.pool.end_replacement(index, Replaced::Failed(error.clone()));
            }
            if self.reload.owns(worker.spawn) {
                self.reload.abort(index, &error, self.pool.slots.len());
            }
            return;
        }
        let reason = match (&failure, status.and_then(|s| s.signal())) {
            _ if worker.stuck.is_some() => RestartReason::Stuck,
            _ if worker.memory_killed => RestartReason::MemoryHard,
            (Some((FailureKind::ModelLoad, _)), _) => RestartReason::ModelLoad,
            (Some((FailureKind::Boot, _)), _) => RestartReason::Boot,
            _ if code == Some(EXIT_PANIC) => RestartReason::Panic,
            (None, Some(_)) => RestartReason::Signal,
            (None, None) => RestartReason::Exit,
        };
        self.totals.restarted(reason);
        if worker.cause.replaces() && worker.ready_at.is_none() {
            self.pool.end_replacement(index, Replaced::Failed(format!("the new worker {how}")));
        }
        let trace_id = self.pool.begin_replacement(index, Cause::Respawn, reason.as_str(), pid, &how);
        let trace_id = trace_id.as_deref();
        let stable = worker.ready_at.is_some_and(|t| t.elapsed() >= STABLE_AFTER.max(t - worker.started));
        let failures = self.pool.slots[index].died(stable);
        match failure {
            Some((kind, error)) if !self.life.booted() => {
                error!("worker {index} (pid {pid}) {how}: {error}");
                return self.fail(match kind {
                    FailureKind::ModelLoad => SupervisorError::ModelLoad { slot: index, error },
                    FailureKind::Boot => SupervisorError::Boot { slot: index, error },
                });
            }
            Some((_, error)) => error!(trace_id, "worker {index} (pid {pid}) {how}: {error}"),
            None if !self.life.booted() && failures >= MAX_BOOT_CRASHES => {
                let error = format!("died {failures} times during start-up, last {how}");
                error!("worker {index}: {error}");
                return self.fail(SupervisorError::Boot { slot: index, error });
            }
            None => match &worker.stuck {
                Some((why, _)) => {
                    warn!(trace_id, "worker {index} (pid {pid}) {how} after being stuck ({why}); replacing it")
                }
                None => warn!(trace_id, "worker {index} (pid {pid}) {how}; replacing it"),
            },
        }
        let delay = backoff(failures);
        if !delay.is_zero() {
            info!(trace_id, "worker {index}: next start in {delay:?} ({failures} failures in a row)");
        }
        self.pool.slots[index].respawn_in(delay);
    }

    /// Starts a rolling reload: the named model (or all of them, read again) in a new
    /// generation, slot by slot.
    fn start_reload(
        &mut self,
        model: Option<String>,
        path: Option<PathBuf>,
        wait: bool,
        replies: Option<Replies>,
    ) -> Result<(), ActionError> {
        self.reload.can_roll(Roll::Reload, self.life.settled(), &self.pool)?;
        let models = reload::reload_models(&self.pool, &self.resolved.config, model, path)?;
        self.roll(models, wait, replies)
    }

    /// Triton's repository `load` (`load` Some, with its folder if named) or `unload` asked on
    /// the main port: only with admin.model_control_on_main_port, the folder confined as the
    /// admin listener's; answered once every worker runs the new list, as there (the worker
    /// that asked drains meanwhile, and the reload is complete once it stopped accepting, so
    /// it is still there to answer its client).
    fn repository_change(
        &mut self,
        id: u64,
        model: String,
        load: Option<LoadParameters>,
        answers: UnboundedSender<Answer>,
    ) {
        let config = &self.resolved.config;
        let loads = load.is_some();
        let request = match load {
            _ if !(config.admin.model_control && config.admin.model_control_on_main_port) => {
                Err(Refused::ModelControlOff)
            }
            None => Ok(Request::Unload { model: model.clone() }),
            Some(LoadParameters { path: None, config: settings }) => {
                Ok(Request::Load { model: model.clone(), path: None, config: settings })
            }
            Some(LoadParameters { path: Some(path), config: settings }) => {
                match confined(&path, &model, &config.allowed_model_paths(), PathFrom::AdminLoad) {
                    Ok(path) => Ok(Request::Load { model: model.clone(), path: Some(path), config: settings }),
                    Err(e) => Err(Refused::NotDone { message: not_done(&model, true, e), before_change: true }),
                }
            }
        };
        let request = match request {
            Ok(request) => request,
            Err(refused) => {
                let _ = answers.send(Answer { id, result: Err(refused) });
                return;
            }
        };
        let (replies, mut final_answer) = tokio::sync::mpsc::unbounded_channel();
        self.act(request, Some(replies));
        tokio::spawn(async move {
            let mut last = None;
            while let Some(response) = final_answer.recv().await {
                if response.progress.is_none() {
                    last = Some(response);
                    break;
                }
            }
            let result = match last {
                Some(Response { ok: true, message, .. }) => Ok(Answered::Done(message.unwrap_or_default())),
                Some(Response { error, refused, .. }) => Err(Refused::NotDone {
                    message: not_done(&model, loads, error.as_deref().unwrap_or("the supervisor gave no reason")),
                    before_change: refused,
                }),
                None => Err(Refused::NotDone { message: "the supervisor is stopping".into(), before_change: true }),
            };
            let _ = answers.send(Answer { id, result });
        });
    }

    /// Triton's repository `load`: a model the pool serves is read again, as `reload --model`
    /// does; another is added, from the repository or from the folder `path`, to every worker.
    /// Answers once the last worker runs it.
    fn start_load(
        &mut self,
        model: String,
        path: Option<PathBuf>,
        settings: Option<ModelOverride>,
        replies: Option<Replies>,
    ) -> Result<(), ActionError> {
        let served = self.pool.models.iter().any(|m| m.name == model);
        let roll = if served { Roll::Reload } else { Roll::Load };
        self.reload.can_roll(roll, self.life.settled(), &self.pool)?;
        let config = &self.resolved.config;
        let mut models = match served {
            true => reload::reload_models(&self.pool, config, Some(model.clone()), path)?,
            false => reload::load_models(&self.pool, config, &model, path)?,
        };
        // A Triton configuration's settings, over the model's own until its next load.
        if let Some(settings) = settings {
            let entry = models.iter_mut().find(|m| m.name == model).expect("the model loaded");
            *entry = settings.apply(entry.clone()).map_err(|e| ActionError::Config(Roll::Load, e))?;
        }
        self.roll(models, true, replies)
    }

    /// Triton's repository `unload`: every worker is replaced by one without the model.
    fn start_unload(&mut self, model: String, replies: Option<Replies>) -> Result<(), ActionError> {
        self.reload.can_roll(Roll::Unload, self.life.settled(), &self.pool)?;
        let models = reload::unload_models(&self.pool, model)?;
        self.roll(models, true, replies)
    }

    /// Starts replacing every slot, one by one, with workers running `models`.
    fn roll(&mut self, models: Vec<ModelEntry>, wait: bool, replies: Option<Replies>) -> Result<(), ActionError> {
        let slots = self.pool.slots.len();
        let pool = &mut self.pool;
        self.reload.begin(models, &self.resolved.config, slots, || pool.next_generation(), wait, replies)?;
        self.replace_slot(0);
        Ok(())
    }

    /// Slot `index` is the one the reload replaces now: its worker starts, or waits.
    fn replace_slot(&mut self, index: usize) {
        if self.reload.replace_slot(index, &self.pool) {
            self.start_reload_worker();
        }
    }

    /// The reload waits for a slot's booting worker: start its own once that one is done.
    pub(super) fn resume_reload(&mut self) {
        if self.reload.may_resume(&self.pool) {
            self.start_reload_worker();
        }
    }

    fn start_reload_worker(&mut self) {
        let Some((index, models, generation)) = self.reload.next_worker() else { return };
        match self.spawn(index, Role::Incoming, Cause::Reload, models, generation) {
            Some(spawn) => self.reload.worker_started(spawn),
            None => self.reload.abort(index, "the new worker could not be started", self.pool.slots.len()),
        }
    }

    /// Worker `spawn` (pid `pid`) of slot `index` is ready and current: if the reload started
    /// it, the slot now runs the reload's models and the reload moves on.
    fn reload_worker_ready(&mut self, index: usize, spawn: u64, pid: u32) {
        let Some(models) = self.reload.worker_ready(index, spawn, pid, self.pool.slots.len()) else { return };
        self.pool.slot_runs(index, models);
        match self.reload.advance(self.pool.slots.len()) {
            Some(next) => self.replace_slot(next),
            None => self.finish_reload(),
        }
    }

    /// Once the reload is complete: the pool's model list, catalog and access are its.
    pub(super) fn finish_reload(&mut self) {
        let Some(installed) = self.reload.finish(&self.pool) else { return };
        // The counters of exited workers follow the models into their rows in the new list
        // (an unloaded model's are dropped; see `totals`).
        let rows: Vec<Option<usize>> =
            self.pool.models.iter().map(|m| installed.models.iter().position(|n| n.name == m.name)).collect();
        self.totals.remap(&rows);
        let served = installed.models.iter().chain(&installed.on_demand).map(|m| m.name.as_str());
        self.totals.keep_model_events(&served.collect::<Vec<_>>());
        self.pool.install(installed.models, installed.on_demand, installed.access);
    }

    /// `scale +1` adds a slot when the CPU budget has room for it; `scale -1` drains the last.
    fn scale(&mut self, delta: i32) -> Result<String, ActionError> {
        if !self.life.settled() || self.reload.in_progress() {
            return Err(ActionError::ScaleNotNow);
        }
        self.pool.scale(delta, &self.resolved, self.launcher.activated())
    }

    /// Old side: `inferd upgrade` or SIGUSR2. Starts the new supervisor, or refuses whole.
    fn start_upgrade(&mut self, binary: Option<PathBuf>, replies: Option<Replies>) -> Result<(), ActionError> {
        if self.life.stopping() {
            return Err(ActionError::Stopping);
        }
        self.upgrade.can_start()?;
        if self.reload.in_progress() {
            return Err(ActionError::ReloadFirst);
        }
        if !self.life.booted() {
            return Err(ActionError::NotReadyYet);
        }
        let binary = binary.unwrap_or_else(|| self.launcher.exe().to_path_buf());
        let handing = Handing {
            control: self.services.control.as_ref().map(|fd| fd.as_raw_fd()),
            admin: self.services.admin.as_ref().map(|fd| fd.as_raw_fd()),
            activated: self.launcher.listener_fd(),
            handoff: self.launcher.handoff_fds(),
            limits: self.launcher.limits_fd(),
            slots: self.pool.slots.iter().filter(|s| !s.removing()).map(|s| s.sockets.fds()).collect(),
        };
        self.upgrade.start(binary, handing, self.events.clone(), replies)
    }

    /// The other supervisor of an upgrade said something, or is gone.
    pub(super) fn on_upgrade(&mut self, event: UpgradeEvent) {
        match self.upgrade.on_event(event) {
            Some(Step::HandOver { pid, version }) => {
                // systemd first: the new one's READY=1 must come from the main process.
                self.notifier.hand_over(pid);
                self.upgrade.hand_over(&version);
                self.services.stop();
                self.retire_all();
            }
            Some(Step::Serve) => {
                self.services.start(&self.events);
                self.notifier = Notifier::from_env();
                self.leave_extra_sockets();
            }
            None => {}
        }
    }
}

/// `answer`, computed on a blocking thread, written to the worker that asked.
fn answer_later(
    id: u64,
    answers: UnboundedSender<Answer>,
    answer: impl FnOnce() -> Result<Answered, Refused> + Send + 'static,
) {
    tokio::task::spawn_blocking(move || answers.send(Answer { id, result: answer() }));
}
