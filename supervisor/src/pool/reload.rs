//! Rolling reloads and scaling: which models a reload installs, replacing the slots one by
//! one (the first replacement validates), and adding or draining a slot within the CPU plan.
//!
//! The reload's state is all here, in [`ReloadState`]: the rest of the pool reads it through
//! its methods and changes it only by calling this file's.

use std::path::PathBuf;
use std::time::Instant;

use inferd_config::auth::Access;
use inferd_config::model::ModelEntry;
use inferd_ipc::spec::Cause;
use inferd_ipc::stats::MAX_MODELS;
use opentelemetry::{Context, KeyValue};
use tracing::{error, info};

use super::slot::{read_on_demand, Role, Slot, Start};
use super::sockets::SlotSockets;
use super::Supervisor;
use crate::confine::{confined, PathFrom};
use crate::control::{Replies, Response};
use crate::metrics::Reloads;
use crate::plan::cpu::{format_cpus, plan, Ask};
use crate::status::WorkerState;
use crate::trace;

/// The reload's state: the rolling reload in progress, if any, and how the reloads so far
/// ended.
#[derive(Default)]
pub(super) struct ReloadState {
    rolling: Option<Reload>,
    /// Rolling reloads since start, by outcome.
    outcomes: Reloads,
}

/// A rolling reload in progress.
struct Reload {
    models: Vec<ModelEntry>,
    /// The on-demand catalog its workers take, read from the repository when it began
    /// (`Pool::on_demand` once it succeeds).
    on_demand: Vec<ModelEntry>,
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
    /// Its trace ([tracing]): the reload's span, and the span of the slot being replaced.
    trace: Option<Context>,
    slot_trace: Option<Context>,
}

impl ReloadState {
    pub(super) fn in_progress(&self) -> bool {
        self.rolling.is_some()
    }

    /// Whether worker `spawn` is the one the reload in progress started: the only one whose
    /// failure fails it.
    pub(super) fn owns(&self, spawn: u64) -> bool {
        self.rolling.as_ref().is_some_and(|r| r.worker == Some(spawn))
    }

    /// The API keys and certificate a worker started for `cause` takes when they are the
    /// reload's own (its new workers'); None: the pool's.
    pub(super) fn access(&self, cause: Cause) -> Option<&Access> {
        self.rolling.as_ref().filter(|_| cause == Cause::Reload).map(|r| &r.access)
    }

    /// The on-demand catalog of a worker of `generation` when that is the reload's (its new
    /// workers', and theirs alone); None: the pool's.
    pub(super) fn on_demand(&self, generation: u64) -> Option<&[ModelEntry]> {
        self.rolling.as_ref().filter(|r| r.generation == generation).map(|r| r.on_demand.as_slice())
    }

    /// Where the reload in progress is, out of `slots` (status and systemd's STATUS=).
    pub(super) fn progress(&self, slots: usize) -> Option<String> {
        self.rolling.as_ref().map(|r| format!("replacing worker {} of {slots}", r.slot + 1))
    }

    pub(super) fn outcomes(&self) -> Reloads {
        self.outcomes
    }

    /// The pool is stopping: the reload in progress ends here, and its client hears why.
    pub(super) fn abandon(&mut self) {
        if let Some(reload) = self.rolling.take() {
            let why = "reload abandoned: the server is stopping";
            trace::end(reload.slot_trace, vec![KeyValue::new("inferd.outcome", "abandoned")], Some(why.into()));
            trace::end(reload.trace, vec![KeyValue::new("inferd.outcome", "abandoned")], Some(why.into()));
            if let Some(replies) = reload.replies {
                let _ = replies.send(Response::error(why));
            }
        }
    }
}

impl Supervisor {
    /// Worker `spawn` (pid `pid`) of slot `index` is ready and current: if the reload started
    /// it, the slot now runs the reload's models, the client hears of it, and the reload moves
    /// on to the next slot.
    pub(super) fn reload_worker_ready(&mut self, index: usize, spawn: u64, pid: u32) {
        let Some(reload) = self.reload.rolling.as_mut().filter(|r| r.worker == Some(spawn)) else { return };
        let promoted = vec![KeyValue::new("inferd.outcome", "promoted"), KeyValue::new("process.pid", i64::from(pid))];
        trace::end(reload.slot_trace.take(), promoted, None);
        self.pool.slots[index].models = reload.models.clone();
        let total = self.pool.slots.len();
        let progress = format!("worker {} of {total} ready (pid {pid}, generation {})", index + 1, reload.generation);
        info!("reload: {progress}");
        if let Some(replies) = &reload.replies {
            let _ = replies.send(Response::progress(progress));
            if index == 0 && !reload.wait {
                let _ = replies.send(Response::message(format!(
                    "the new models passed validation in worker 1; replacing the other {} worker(s) one by one",
                    total - 1
                )));
                reload.replies = None;
            }
        }
        self.advance_reload();
    }

    /// Starts a rolling reload: the named model (or all of them, read again) in a new
    /// generation, slot by slot.
    pub(super) fn start_reload(
        &mut self,
        model: Option<String>,
        path: Option<PathBuf>,
        wait: bool,
        replies: Option<Replies>,
    ) -> Result<(), String> {
        self.can_roll("reload")?;
        let models = self.new_models(model, path)?;
        self.roll(models, wait, replies)
    }

    /// Whether a rolling reload (`what`) may start now.
    fn can_roll(&self, what: &str) -> Result<(), String> {
        if self.life.stopping || !self.life.booted {
            return Err(format!("{what} refused: the pool is starting or stopping"));
        }
        if self.reload.in_progress() {
            return Err(format!("{what} refused: a reload is already in progress"));
        }
        // A reload replaces every slot; one that `scale -1` is draining must be gone first.
        if let Some(i) = self.pool.removing() {
            return Err(format!(
                "{what} refused: worker {i} is still draining from the last scale -1; retry once it is gone"
            ));
        }
        Ok(())
    }

    /// Triton's repository `load`: a model the pool serves is read again, as `reload --model`
    /// does; another is added, from the repository or from the folder `path`, to every worker.
    /// Answers once the last worker runs it.
    pub(super) fn start_load(
        &mut self,
        model: String,
        path: Option<PathBuf>,
        replies: Option<Replies>,
    ) -> Result<(), String> {
        if self.pool.models.iter().any(|m| m.name == model) {
            return self.start_reload(Some(model), path, true, replies);
        }
        self.can_roll("load")?;
        if self.pool.models.len() >= MAX_MODELS {
            return Err(format!(
                "load refused: the pool serves {} models, the most one server counts (its shared counters have a row per model)",
                self.pool.models.len()
            ));
        }
        let config = &self.resolved.config;
        let entry = match &path {
            Some(dir) if dir.is_dir() => ModelEntry::load_dir(dir, &model),
            Some(other) => {
                return Err(format!(
                "load refused: {} is not a model folder (a model the server does not serve yet needs its folder: a model.toml, or a published model's files)",
                other.display()
            ))
            }
            None => config.load_model(&model),
        }
        .and_then(|entry| config.model_override.apply(entry))
        .map_err(|e| format!("load refused: {e}"))?;
        let mut models = self.pool.models.clone();
        models.push(entry);
        self.roll(models, true, replies)
    }

    /// Triton's repository `unload`: every worker is replaced by one without the model. The
    /// default model stays (requests that name no model go to it).
    pub(super) fn start_unload(&mut self, model: String, replies: Option<Replies>) -> Result<(), String> {
        self.can_roll("unload")?;
        let Some(at) = self.pool.models.iter().position(|m| m.name == model) else {
            return Err(format!("unload refused: this server does not serve a model '{model}'"));
        };
        if at == 0 {
            return Err(format!(
                "unload refused: '{model}' is the default model (models.default), which requests without a model name go to"
            ));
        }
        let mut models = self.pool.models.clone();
        models.remove(at);
        self.roll(models, true, replies)
    }

    /// Starts replacing every slot, one by one, with workers running `models` and the API
    /// keys and TLS files read again now (a file that cannot be used refuses the reload), and
    /// the on-demand catalog read again too (a folder added since is servable on the new
    /// workers; one that does not resolve is left out, as at start).
    fn roll(&mut self, models: Vec<ModelEntry>, wait: bool, replies: Option<Replies>) -> Result<(), String> {
        let access = self.resolved.config.access().map_err(|e| format!("reload refused: {e}"))?;
        let on_demand = read_on_demand(&self.resolved.config, &models);
        self.pool.generation += 1;
        let names = models.iter().map(|m| format!("{} ({})", m.name, m.path.display())).collect::<Vec<_>>().join(", ");
        info!("reload to generation {}: {names}", self.pool.generation);
        if let Some(r) = &replies {
            let _ = r.send(Response::progress(format!(
                "generation {}: validating {names} in a new worker 1 of {}",
                self.pool.generation,
                self.pool.slots.len()
            )));
        }
        let attributes = vec![
            KeyValue::new("inferd.generation", self.pool.generation as i64),
            KeyValue::new("inferd.slots", self.pool.slots.len() as i64),
            KeyValue::new("inferd.models", names.clone()),
        ];
        self.reload.rolling = Some(Reload {
            models,
            on_demand,
            access,
            generation: self.pool.generation,
            slot: 0,
            worker: None,
            replies,
            wait,
            started: Instant::now(),
            trace: trace::start("rolling reload".into(), None, attributes),
            slot_trace: None,
        });
        self.replace_slot(0);
        Ok(())
    }

    /// The model list a reload installs.
    pub(super) fn new_models(&self, model: Option<String>, path: Option<PathBuf>) -> Result<Vec<ModelEntry>, String> {
        let Some(path) = path else {
            // No path: read every model again from the repository (new files, new model.toml).
            let names: Vec<String> = self.pool.models.iter().map(|m| m.name.clone()).collect();
            if let Some(name) = model.as_ref().filter(|n| !names.contains(n)) {
                return Err(format!("reload refused: this server has no model '{name}'"));
            }
            return names
                .iter()
                .map(|name| match &model {
                    Some(only) if only != name => {
                        Ok(self.pool.models.iter().find(|m| &m.name == name).cloned().expect("listed"))
                    }
                    _ => self.resolved.config.load_model(name),
                })
                .collect::<Result<_, _>>()
                .map_err(|e| format!("reload refused: {e}"));
        };
        let name = match model {
            Some(name) => name,
            None if self.pool.models.len() == 1 => self.pool.models[0].name.clone(),
            None => return Err("reload refused: --path needs --model when the server has several models".into()),
        };
        let Some(at) = self.pool.models.iter().position(|m| m.name == name) else {
            return Err(format!("reload refused: this server has no model '{name}'"));
        };
        // As the admin listener's load: inside the repository or admin.allowed_paths. The
        // control socket is the service's own uid's, which its workers share: a worker an
        // attacker took over must not get a file it wrote loaded by the others.
        let allowed = self.resolved.config.allowed_model_paths();
        let path =
            confined(&path, &name, &allowed, PathFrom::ReloadPath).map_err(|e| format!("reload refused: {e}"))?;
        let mut models = self.pool.models.clone();
        models[at] = models[at]
            .replaced_by(&path)
            .and_then(|entry| self.resolved.config.model_override.apply(entry))
            .map_err(|e| format!("reload refused: {e}"))?;
        Ok(models)
    }

    /// Makes slot `index` the one the reload replaces: its new worker starts now, or, while a
    /// worker of the slot started for another cause is still booting on the old models (a
    /// replacement for memory or recycling, a respawn, a new slot), once that one is ready or
    /// gone ([`Supervisor::resume_reload`], every tick). So a slot never boots two workers at
    /// once, and an in-flight replacement finishes on the old models before the reload
    /// replaces it in turn.
    pub(super) fn replace_slot(&mut self, index: usize) {
        let Some(reload) = self.reload.rolling.as_mut() else { return };
        reload.slot = index;
        reload.worker = None;
        let attributes = vec![KeyValue::new("inferd.slot", index as i64)];
        reload.slot_trace = trace::start(format!("reload slot {index}"), reload.trace.as_ref(), attributes);
        let Some(w) = self.pool.slots[index].booting() else { return self.start_reload_worker() };
        let note = format!(
            "worker {} of {}: its worker started for {} (pid {}) is still booting on the previous models; \
             replacing it once it is ready or gone",
            index + 1,
            self.pool.slots.len(),
            w.cause.as_str(),
            w.pid
        );
        info!("reload: {note}");
        if let Some(replies) = self.reload.rolling.as_ref().and_then(|r| r.replies.as_ref()) {
            let _ = replies.send(Response::progress(note));
        }
    }

    /// The reload waits for a slot's booting worker: start its own once that one is done.
    pub(super) fn resume_reload(&mut self) {
        let Some(reload) =
            self.reload.rolling.as_ref().filter(|r| r.worker.is_none() && r.slot < self.pool.slots.len())
        else {
            return;
        };
        if self.pool.slots[reload.slot].booting().is_none() {
            self.start_reload_worker();
        }
    }

    fn start_reload_worker(&mut self) {
        let reload = self.reload.rolling.as_ref().expect("called during a reload");
        let (index, models, generation) = (reload.slot, reload.models.clone(), reload.generation);
        match self.spawn(index, Role::Incoming, Cause::Reload, models, generation) {
            Some(spawn) => {
                let reload = self.reload.rolling.as_mut().expect("checked");
                reload.worker = Some(spawn);
                trace::event(&reload.slot_trace, "worker started", Vec::new());
            }
            None => self.abort_reload(index, "the new worker could not be started"),
        }
    }

    /// After slot `reload.slot` was replaced: the next slot, or done.
    pub(super) fn advance_reload(&mut self) {
        let Some(reload) = self.reload.rolling.as_mut() else { return };
        reload.slot += 1;
        if reload.slot < self.pool.slots.len() {
            let next = reload.slot;
            self.replace_slot(next);
            return;
        }
        // Every slot runs the new models; its worker no longer decides the reload's outcome.
        reload.worker = None;
        self.finish_reload();
    }

    /// The reload's last step, once every slot runs the new models: it is complete (and
    /// `reload --wait` answers) when no worker it replaced can take a connection any more,
    /// each having reported Draining (sent once it stopped accepting) or exited. Until
    /// then a client that calls at once could still reach an old worker: one that answered
    /// "not ready" for a model just loaded made tests/repository.rs fail now and then.
    /// Called after each Draining report and every tick.
    pub(super) fn finish_reload(&mut self) {
        let Some(reload) = self.reload.rolling.as_ref() else { return };
        let listening = self.pool.workers().any(|w| w.role == Role::Retiring && w.state != WorkerState::Draining);
        if reload.slot < self.pool.slots.len() || listening {
            return;
        }
        let reload = self.reload.rolling.take().expect("checked");
        // The counters of exited workers follow the models into their rows in the new list
        // (an unloaded model's are dropped; see `totals`).
        let rows: Vec<Option<usize>> =
            self.pool.models.iter().map(|m| reload.models.iter().position(|n| n.name == m.name)).collect();
        self.totals.remap(&rows);
        let served = reload.models.iter().chain(&reload.on_demand).map(|m| m.name.as_str());
        self.totals.keep_model_events(&served.collect::<Vec<_>>());
        self.pool.models = reload.models;
        self.pool.on_demand = reload.on_demand;
        self.pool.access = reload.access;
        self.reload.outcomes.succeeded += 1;
        let message = format!(
            "reload complete: {} workers on generation {} after {:.1} s",
            self.pool.slots.len(),
            reload.generation,
            reload.started.elapsed().as_secs_f64()
        );
        trace::end(reload.trace, vec![KeyValue::new("inferd.outcome", "complete")], None);
        info!("{message}");
        if let Some(replies) = reload.replies {
            let _ = replies.send(Response::message(message));
        }
    }

    pub(super) fn abort_reload(&mut self, index: usize, error: &str) {
        let Some(reload) = self.reload.rolling.take() else { return };
        self.reload.outcomes.failed += 1;
        let kept = if index == 0 {
            "every worker keeps the previous models".to_string()
        } else {
            format!("workers 1-{index} run generation {}, the others the previous models", reload.generation)
        };
        let message = format!("reload failed at worker {} of {}: {error}; {kept}", index + 1, self.pool.slots.len());
        error!("{message}");
        trace::end(reload.slot_trace, vec![KeyValue::new("inferd.outcome", "failed")], Some(error.to_string()));
        trace::end(reload.trace, vec![KeyValue::new("inferd.outcome", "failed")], Some(message.clone()));
        if let Some(replies) = reload.replies {
            let _ = replies.send(Response::error(message));
        }
    }

    /// `scale +1` adds a slot when the CPU budget has room for it; `scale -1` drains the last.
    pub(super) fn scale(&mut self, delta: i32) -> Result<String, String> {
        if self.life.stopping || !self.life.booted || self.reload.in_progress() {
            return Err("scale refused: the pool is starting, reloading or stopping".into());
        }
        // One step at a time: slots are named by index, so a draining one must be gone before
        // the pool changes size again.
        if let Some(i) = self.pool.removing() {
            return Err(format!("scale refused: worker {i} is still draining from the last scale -1"));
        }
        let count = self.pool.slots.len();
        match delta {
            1 => {
                let threads = self.resolved.plan.threads_per_worker;
                let ask = Ask { workers: count + 1, threads, ..Ask::of(&self.resolved.config.server) };
                let plan = plan(&self.resolved.plan.budget, ask).map_err(|e| format!("scale +1 refused: {e}"))?;
                let placement = plan.workers[count].clone();
                let cpus = format_cpus(&placement.cpus);
                let sockets = SlotSockets::bind(&self.resolved.config.server, self.launcher.activated())
                    .map_err(|e| format!("scale +1 refused: {e}"))?;
                let slot = Slot::new(placement, self.pool.models.clone(), self.pool.generation, Cause::Scale, sockets);
                self.pool.slots.push(slot);
                Ok(format!("scaling up to {} workers: the new one is pinned to cpus {cpus}", self.pool.slots.len()))
            }
            -1 => {
                if count <= 1 {
                    return Err("scale -1 refused: the pool cannot go below 1 worker".into());
                }
                let index = count - 1;
                let slot = &mut self.pool.slots[index];
                slot.start = Start::Removing;
                for w in slot.workers.iter_mut() {
                    w.retire();
                }
                if slot.workers.is_empty() {
                    self.pool.slots.pop(); // the last slot: no removing slot follows it (checked above)
                }
                Ok(format!("scaling down to {} workers: draining worker {index}", count - 1))
            }
            other => Err(format!("scale refused: the step is +1 or -1, not {other}")),
        }
    }
}
