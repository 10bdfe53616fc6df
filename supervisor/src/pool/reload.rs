//! Rolling reloads: which models a reload (or Triton's load and unload) installs, and its
//! progress through the slots, replaced one by one (the first replacement validates).
//!
//! The reload's state is all here, in [`ReloadState`], and only this file changes it. The
//! loop starts the workers it asks for ([`ReloadState::next_worker`]) and tells it what
//! becomes of them; the pool's own state changes through the pool's methods, called by the
//! loop with what this file hands back ([`Installed`]).

use std::path::PathBuf;
use std::time::Instant;

use inferd_config::auth::Access;
use inferd_config::file::Config;
use inferd_config::model::ModelEntry;
use inferd_ipc::spec::Cause;
use opentelemetry::{Context, KeyValue};
use tracing::{error, info};

use super::slot::{read_on_demand, Pool, Role};
use crate::confine::{confined, PathFrom};
use crate::control::{ActionError, Replies, Response, Roll};
use crate::metrics::Reloads;
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

/// What a complete reload leaves the pool: the models, the on-demand catalog and the access
/// its workers run, for the workers started from now on.
pub(super) struct Installed {
    pub(super) models: Vec<ModelEntry>,
    pub(super) on_demand: Vec<ModelEntry>,
    pub(super) access: Access,
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

    /// Whether a rolling action may start now: refused while the pool starts or stops
    /// (`settled` false), while a reload runs, or while `scale -1` drains a slot.
    pub(super) fn can_roll(&self, what: Roll, settled: bool, pool: &Pool) -> Result<(), ActionError> {
        if !settled {
            return Err(ActionError::NotSettled(what));
        }
        if self.in_progress() {
            return Err(ActionError::Rolling(what));
        }
        // A reload replaces every slot; one that `scale -1` is draining must be gone first.
        match pool.removing() {
            Some(i) => Err(ActionError::Draining(what, i)),
            None => Ok(()),
        }
    }

    /// Starts a rolling reload to `models`, with the API keys and TLS files read again now (a
    /// file that cannot be used refuses the reload) and the on-demand catalog read again too
    /// (a folder added since is servable on the new workers; one that does not resolve is left
    /// out, as at start), in the generation `next_generation` gives; then
    /// [`ReloadState::replace_slot`] 0.
    pub(super) fn begin(
        &mut self,
        models: Vec<ModelEntry>,
        config: &Config,
        slots: usize,
        next_generation: impl FnOnce() -> u64,
        wait: bool,
        replies: Option<Replies>,
    ) -> Result<(), ActionError> {
        let access = config.access().map_err(|e| ActionError::Config(Roll::Reload, e))?;
        let on_demand = read_on_demand(config, &models);
        let generation = next_generation();
        let names = models.iter().map(|m| format!("{} ({})", m.name, m.path.display())).collect::<Vec<_>>().join(", ");
        info!("reload to generation {generation}: {names}");
        if let Some(r) = &replies {
            let _ = r.send(Response::progress(format!(
                "generation {generation}: validating {names} in a new worker 1 of {slots}"
            )));
        }
        let attributes = vec![
            KeyValue::new("inferd.generation", generation as i64),
            KeyValue::new("inferd.slots", slots as i64),
            KeyValue::new("inferd.models", names.clone()),
        ];
        self.rolling = Some(Reload {
            models,
            on_demand,
            access,
            generation,
            slot: 0,
            worker: None,
            replies,
            wait,
            started: Instant::now(),
            trace: trace::start("rolling reload".into(), None, attributes),
            slot_trace: None,
        });
        Ok(())
    }

    /// Makes slot `index` the one the reload replaces. Returns whether its new worker should
    /// start now: not while a worker of the slot started for another cause is still booting
    /// on the old models (a replacement for memory or recycling, a respawn, a new slot); then
    /// once that one is ready or gone ([`ReloadState::may_resume`], every tick). So a slot
    /// never boots two workers at once, and an in-flight replacement finishes on the old
    /// models before the reload replaces it in turn.
    pub(super) fn replace_slot(&mut self, index: usize, pool: &Pool) -> bool {
        let Some(reload) = self.rolling.as_mut() else { return false };
        reload.slot = index;
        reload.worker = None;
        let attributes = vec![KeyValue::new("inferd.slot", index as i64)];
        reload.slot_trace = trace::start(format!("reload slot {index}"), reload.trace.as_ref(), attributes);
        let Some(w) = pool.slots[index].booting() else { return true };
        let note = format!(
            "worker {} of {}: its worker started for {} (pid {}) is still booting on the previous models; \
             replacing it once it is ready or gone",
            index + 1,
            pool.slots.len(),
            w.cause.as_str(),
            w.pid
        );
        info!("reload: {note}");
        if let Some(replies) = &reload.replies {
            let _ = replies.send(Response::progress(note));
        }
        false
    }

    /// Whether the reload waits for a slot's booting worker that is done now: then it starts
    /// its own.
    pub(super) fn may_resume(&self, pool: &Pool) -> bool {
        self.rolling
            .as_ref()
            .is_some_and(|r| r.worker.is_none() && r.slot < pool.slots.len() && pool.slots[r.slot].booting().is_none())
    }

    /// The worker the reload starts now: its slot, models and generation.
    pub(super) fn next_worker(&self) -> Option<(usize, Vec<ModelEntry>, u64)> {
        self.rolling.as_ref().map(|r| (r.slot, r.models.clone(), r.generation))
    }

    /// The loop started the reload's worker for its slot: spawn id `spawn`.
    pub(super) fn worker_started(&mut self, spawn: u64) {
        if let Some(reload) = self.rolling.as_mut() {
            reload.worker = Some(spawn);
            trace::event(&reload.slot_trace, "worker started", Vec::new());
        }
    }

    /// Worker `spawn` (pid `pid`) of slot `index`, of a pool of `slots`, is ready and current:
    /// if the reload started it, the client hears of it, and the models the slot runs now are
    /// returned (the loop then calls [`ReloadState::advance`]).
    pub(super) fn worker_ready(&mut self, index: usize, spawn: u64, pid: u32, slots: usize) -> Option<Vec<ModelEntry>> {
        let reload = self.rolling.as_mut().filter(|r| r.worker == Some(spawn))?;
        let promoted = vec![KeyValue::new("inferd.outcome", "promoted"), KeyValue::new("process.pid", i64::from(pid))];
        trace::end(reload.slot_trace.take(), promoted, None);
        let progress = format!("worker {} of {slots} ready (pid {pid}, generation {})", index + 1, reload.generation);
        info!("reload: {progress}");
        if let Some(replies) = &reload.replies {
            let _ = replies.send(Response::progress(progress));
            if index == 0 && !reload.wait {
                let _ = replies.send(Response::message(format!(
                    "the new models passed validation in worker 1; replacing the other {} worker(s) one by one",
                    slots - 1
                )));
                reload.replies = None;
            }
        }
        Some(reload.models.clone())
    }

    /// After the reload's slot was replaced: the next slot to replace, or None once every
    /// slot runs the new models (the loop then calls [`ReloadState::finish`]).
    pub(super) fn advance(&mut self, slots: usize) -> Option<usize> {
        let reload = self.rolling.as_mut()?;
        reload.slot += 1;
        if reload.slot < slots {
            return Some(reload.slot);
        }
        // Every slot runs the new models; its worker no longer decides the reload's outcome.
        reload.worker = None;
        None
    }

    /// The reload's last step, once every slot runs the new models: it is complete (and
    /// `reload --wait` answers) when no worker it replaced can take a connection any more,
    /// each having reported Draining (sent once it stopped accepting) or exited. Until
    /// then a client that calls at once could still reach an old worker: one that answered
    /// "not ready" for a model just loaded made tests/repository.rs fail now and then.
    /// Called after each Draining report and every tick; returns what the pool installs.
    pub(super) fn finish(&mut self, pool: &Pool) -> Option<Installed> {
        let reload = self.rolling.as_ref()?;
        let listening = pool.workers().any(|w| w.role == Role::Retiring && w.state != WorkerState::Draining);
        if reload.slot < pool.slots.len() || listening {
            return None;
        }
        let reload = self.rolling.take().expect("checked");
        self.outcomes.succeeded += 1;
        let message = format!(
            "reload complete: {} workers on generation {} after {:.1} s",
            pool.slots.len(),
            reload.generation,
            reload.started.elapsed().as_secs_f64()
        );
        trace::end(reload.trace, vec![KeyValue::new("inferd.outcome", "complete")], None);
        info!("{message}");
        if let Some(replies) = reload.replies {
            let _ = replies.send(Response::message(message));
        }
        Some(Installed { models: reload.models, on_demand: reload.on_demand, access: reload.access })
    }

    /// The reload's worker for slot `index` (of `slots`) failed, for `error`: the reload ends
    /// there, and its client hears which workers run what.
    pub(super) fn abort(&mut self, index: usize, error: &str, slots: usize) {
        let Some(reload) = self.rolling.take() else { return };
        self.outcomes.failed += 1;
        let kept = if index == 0 {
            "every worker keeps the previous models".to_string()
        } else {
            format!("workers 1-{index} run generation {}, the others the previous models", reload.generation)
        };
        let message = format!("reload failed at worker {} of {slots}: {error}; {kept}", index + 1);
        error!("{message}");
        trace::end(reload.slot_trace, vec![KeyValue::new("inferd.outcome", "failed")], Some(error.to_string()));
        trace::end(reload.trace, vec![KeyValue::new("inferd.outcome", "failed")], Some(message.clone()));
        if let Some(replies) = reload.replies {
            let _ = replies.send(Response::error(message));
        }
    }
}

/// The model list `inferd reload` installs: the named model (or all of them, read again from
/// the repository), or the named one from `path`.
pub(super) fn reload_models(
    pool: &Pool,
    config: &Config,
    model: Option<String>,
    path: Option<PathBuf>,
) -> Result<Vec<ModelEntry>, ActionError> {
    let refused = |e| ActionError::Config(Roll::Reload, e);
    let Some(path) = path else {
        // No path: read every model again from the repository (new files, new model.toml).
        let names: Vec<String> = pool.models.iter().map(|m| m.name.clone()).collect();
        if let Some(name) = model.as_ref().filter(|n| !names.contains(n)) {
            return Err(ActionError::NoSuchModel(name.clone()));
        }
        return names
            .iter()
            .map(|name| match &model {
                Some(only) if only != name => {
                    Ok(pool.models.iter().find(|m| &m.name == name).cloned().expect("listed"))
                }
                _ => config.load_model(name),
            })
            .collect::<Result<_, _>>()
            .map_err(refused);
    };
    let name = match model {
        Some(name) => name,
        None if pool.models.len() == 1 => pool.models[0].name.clone(),
        None => return Err(ActionError::PathNeedsModel),
    };
    let Some(at) = pool.models.iter().position(|m| m.name == name) else {
        return Err(ActionError::NoSuchModel(name));
    };
    // As the admin listener's load: inside the repository or admin.allowed_paths (confine.rs).
    let path = confined(&path, &name, &config.allowed_model_paths(), PathFrom::ReloadPath)?;
    let mut models = pool.models.clone();
    models[at] = models[at].replaced_by(&path).and_then(|entry| config.model_override.apply(entry)).map_err(refused)?;
    Ok(models)
}

/// The model list Triton's repository `load` installs for a model the pool does not serve
/// yet: it added, from the repository or from the folder `path`, to every worker.
pub(super) fn load_models(
    pool: &Pool,
    config: &Config,
    model: &str,
    path: Option<PathBuf>,
) -> Result<Vec<ModelEntry>, ActionError> {
    let entry = match path {
        Some(dir) if dir.is_dir() => ModelEntry::load_dir(&dir, model),
        Some(other) => return Err(ActionError::NotAModelFolder(other)),
        None => config.load_model(model),
    }
    .and_then(|entry| config.model_override.apply(entry))
    .map_err(|e| ActionError::Config(Roll::Load, e))?;
    let mut models = pool.models.clone();
    models.push(entry);
    Ok(models)
}

/// The model list Triton's repository `unload` installs: the pool's without `model`. The
/// default model stays (requests that name no model go to it).
pub(super) fn unload_models(pool: &Pool, model: String) -> Result<Vec<ModelEntry>, ActionError> {
    let Some(at) = pool.models.iter().position(|m| m.name == model) else {
        return Err(ActionError::NotServed(model));
    };
    if at == 0 {
        return Err(ActionError::DefaultModel(model));
    }
    let mut models = pool.models.clone();
    models.remove(at);
    Ok(models)
}
