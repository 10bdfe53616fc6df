//! The worker's loader thread (`inferd-load`), with `[models] on_demand`: loads the models
//! requests ask for ([`crate::request::models`]), one at a time, each as boot loads a model
//! ([`crate::load`]: its sessions for every lane, warmed up), then hands its sessions to the
//! engine and the model to the handlers. A load that fails or panics costs that model's
//! requests (500 with the reason), never the worker.
//!
//! Within the worker's share of `models.memory_budget` ([`Budget`]): a load starts once what
//! it needs fits beside what the worker holds: idle models loaded on demand are evicted first
//! (models.eviction's order), models in use are waited for [`IN_USE_WAIT`] (then 503). A
//! worker's memory is its PSS: its own pages, and each page it maps divided among the
//! processes that map it, so that the weights two workers map from the one prepared file count
//! once for the pool, half in each (RSS would count them once per worker, and once per session
//! in each). What a load needs is its peak (models/need.rs): the highest its loads here measured (the worker's own pages at their highest, sampled, and the weights it maps), or
//! before its first, a multiple of its file. A model whose size once loaded (measured, or at
//! least its file) does not fit the share beside the worker's own memory and its pinned
//! models is refused at once, naming both sizes. With nothing left to evict and nothing in
//! use, a load goes on alone in the worker: a peak past the share's room is then the model's
//! own, for the moments of its load. The one load of a model version that prepares its shared
//! weights peaks higher than any later one, once for the pool: preparations of one artefact
//! are one at a time pool-wide ([`crate::runtime::weights`]), and a sibling maps what the
//! first prepared. A worker's PSS also grows without a load of its own, when a
//! sibling unmaps weights both mapped: the loader looks every [`CHECK_EVERY`] while idle, and
//! evicts what no longer fits.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferd_config::model::ModelEntry;
use inferd_config::signing::Trust;
use inferd_ipc::spec::{ModelCost, WorkerMessage};
use opentelemetry::KeyValue;
use tracing::{info, warn};

use crate::load::{Lanes, Model};
use crate::request::app::AppState;
use crate::request::models::{Basis, Load, LoadError, Need};
use crate::runtime::engine::Sessions;
use crate::runtime::model::{ModelError, Runtime};

/// How often an idle loader checks that the worker is still within its share.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long a load waits for models in use to make room (then 503), looking every
/// [`IN_USE_POLL`].
const IN_USE_WAIT: Duration = Duration::from_secs(2);
const IN_USE_POLL: Duration = Duration::from_millis(10);

/// The worker's share of models.memory_budget, and what it held when the loader started (the
/// worker itself, warm, with its pinned models).
#[derive(Debug, Clone, Copy)]
struct Budget {
    share: u64,
    base: u64,
}

/// Why a model did not load on demand: told to the requests that wait for it
/// ([`LoadError::Failed`]).
#[derive(Debug, thiserror::Error)]
enum Unloaded {
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    NotLoaded(#[from] crate::load::NotLoaded),
    #[error("the server hit a bug loading it (logged)")]
    Bug,
    #[error(
        "model '{name}' needs {} MiB ({}), more than this worker can hold: its share of models.memory_budget is {} MiB, {} MiB of which the worker and its pinned models hold",
        need.bytes >> 20,
        need.basis,
        share >> 20,
        base >> 20
    )]
    OverBudget { name: String, need: Need, share: u64, base: u64 },
}

/// A model loaded on demand: its number in the engine, what it holds, the peak its load took
/// and whether that load prepared its shared weights.
struct Loaded {
    model: Model,
    number: usize,
    cost: ModelCost,
    peak: u64,
    prepared: bool,
}

/// The loader's state: what may be loaded, where models go, the budget and what each model
/// cost when it last loaded.
pub struct Loader {
    runtime: Runtime,
    catalog: Vec<ModelEntry>,
    lanes: Lanes,
    /// The signatures models must carry ([`crate::load::signature`]).
    trust: Trust,
    state: Arc<AppState>,
    budget: Option<Budget>,
}

impl Loader {
    pub fn new(
        runtime: Runtime,
        catalog: Vec<ModelEntry>,
        lanes: Lanes,
        trust: Trust,
        state: Arc<AppState>,
        share: Option<u64>,
    ) -> Self {
        let budget = share.map(|share| Budget { share, base: resident().total() });
        if let Some(Budget { share, base }) = budget {
            let mib = |b: u64| b >> 20;
            info!("models loaded on demand fit in {} MiB: this worker's share of models.memory_budget ({} MiB), less the {} MiB it holds with its pinned models", mib(share.saturating_sub(base)), mib(share), mib(base));
        }
        Loader { runtime, catalog, lanes, trust, state, budget }
    }

    /// Serves loads from `queue` until every sender is gone; `told`: each model loaded or
    /// evicted (the worker reports it to the supervisor).
    pub fn run(mut self, queue: Receiver<Load>, told: impl Fn(WorkerMessage)) {
        loop {
            let Load { name, done, trace } = match queue.recv_timeout(CHECK_EVERY) {
                Ok(load) => load,
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(budget) = self.budget {
                        self.make_room(0, budget.share, None, &told);
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let (started, since) = (Instant::now(), std::time::SystemTime::now());
            let trace_id = trace.as_ref().map(|t| t.trace_id().to_string());
            let loaded = self.load(&name, &told);
            // The load is a span of the request that asked for it (ended before it is told).
            let (outcome, error) = match &loaded {
                Ok(loaded) => (vec![KeyValue::new("inferd.model.bytes", loaded.cost.total() as i64)], None),
                Err(why) => (Vec::new(), Some(why.to_string())),
            };
            let attributes = [vec![KeyValue::new("inferd.model", name.clone())], outcome].concat();
            crate::trace::child_of(trace.as_ref(), "load model", since, attributes, error);
            match loaded {
                Ok(Loaded { model, number, cost, peak, prepared }) => {
                    let seconds = started.elapsed().as_secs_f64();
                    let info = model.info.clone();
                    info!(
                        model = name,
                        trace_id = trace_id.as_deref(),
                        "loaded on demand in {:.0} ms, {} MiB ({} MiB private, {} MiB mapped); its load took {} MiB ({})",
                        seconds * 1e3,
                        cost.total() >> 20,
                        cost.private >> 20,
                        cost.mapped >> 20,
                        peak >> 20,
                        if prepared { "preparing its shared weights" } else { "mapping its prepared weights" }
                    );
                    // The supervisor first: status and /metrics then show the model by the time
                    // its first answer is out.
                    told(WorkerMessage::Loaded { model: info, cost, seconds });
                    self.state.models.loaded_on_demand(model, number, cost, &done);
                    // Measured above the estimate: others make room now, not at the next load.
                    if let Some(budget) = self.budget {
                        self.make_room(0, budget.share, Some(number), &told);
                    }
                }
                Err(why) => {
                    warn!(model = name, trace_id = trace_id.as_deref(), "cannot load on demand: {why}");
                    self.state.models.failed_on_demand(&name, why, &done);
                }
            }
        }
    }

    /// `name`'s model loaded and handed to the engine.
    fn load(&mut self, name: &str, told: &impl Fn(WorkerMessage)) -> Result<Loaded, LoadError> {
        let Some(entry) = self.catalog.iter().find(|e| e.name == name) else {
            return Err(LoadError::Failed("it is not in this worker's catalog".into()));
        };
        let file = std::fs::metadata(&entry.path).map(|m| m.len()).unwrap_or(0);
        if let Some(budget) = self.budget {
            let need = self.state.models.need(name).unwrap_or(Need { bytes: file, basis: Basis::File });
            // What it holds once loaded (as measured, or at least its file) must fit beside the
            // worker's start, or it never will.
            let sure = match self.state.models.measured_held(name) {
                Some(held) => Need { bytes: held, basis: Basis::Held },
                None => Need { bytes: file, basis: Basis::File },
            };
            budget.fits(name, sure).map_err(|e| LoadError::Failed(e.to_string()))?;
            // The load starts once its need fits the share: idle models are evicted for it,
            // models in use waited for a while (then 503). With nothing left on demand, the
            // load goes on alone in the worker: a peak past the share's room is then the
            // model's own, for the moments of its load.
            let mut waited = Duration::ZERO;
            while !self.make_room(need.bytes, budget.share, None, told) && self.state.models.holds_on_demand() {
                if waited >= IN_USE_WAIT {
                    return Err(LoadError::Busy(format!(
                        "this worker's share of models.memory_budget ({} MiB) is held by models in use",
                        budget.share >> 20
                    )));
                }
                std::thread::sleep(IN_USE_POLL);
                waited += IN_USE_POLL;
            }
        }
        let (before, preparations) = (resident(), crate::runtime::weights::written());
        let (loaded, growth) = peak_growth(|| {
            crate::panics::guarded(|| load(&self.runtime, entry, &self.lanes, &self.trust))
                .unwrap_or(Err(Unloaded::Bug))
        });
        let (model, sessions) = loaded.map_err(|e| {
            if let Unloaded::NotLoaded(refused) = &e {
                if let Some((model, reason)) = refused.refused() {
                    told(WorkerMessage::Refused { model: model.into(), reason: reason.into() });
                }
            }
            LoadError::Failed(e.to_string())
        })?;
        let number = self.state.engine.add(sessions).map_err(LoadError::Failed)?;
        crate::runtime::allocator::trim();
        let cost = grown(resident(), before);
        // Its peak: what its own pages grew to meanwhile, and the weights it mapped. A load
        // that prepared the model's shared weights peaked higher than any later one will
        // (which maps them): only what the model holds is measured of it.
        let (peak, prepared) =
            (cost.total().max(growth + cost.mapped), crate::runtime::weights::written() != preparations);
        if !prepared {
            self.state.models.measured_load(name, peak, cost.total());
        }
        if let Some(budget) = self.budget {
            if let Err(why) = budget.fits(name, Need { bytes: cost.total(), basis: Basis::Held }) {
                self.state.engine.remove(number);
                crate::runtime::allocator::trim();
                return Err(LoadError::Failed(why.to_string()));
            }
        }
        Ok(Loaded { model, number, cost, peak, prepared })
    }

    /// Evicts idle models loaded on demand, but model number `spare`, until the worker's
    /// memory and `need` fit `share`; false when what is left is in use.
    fn make_room(&self, need: u64, share: u64, spare: Option<usize>, told: &impl Fn(WorkerMessage)) -> bool {
        loop {
            let held = resident().total();
            // What requests for models siblings hold weigh (models.placement = "pool").
            self.state.models.set_room(share.saturating_sub(held));
            if held + need <= share {
                return true;
            }
            let Some(evicted) = self.state.models.evict_one(spare) else { return false };
            self.state.engine.remove(evicted.number);
            crate::runtime::allocator::trim();
            info!(model = evicted.name, "evicted ({} MiB) to make room for another model", evicted.cost.total() >> 20);
            told(WorkerMessage::Evicted { model: evicted.name });
        }
    }
}

impl Budget {
    /// Whether a load that needs `need` fits this worker at all.
    fn fits(&self, name: &str, need: Need) -> Result<(), Unloaded> {
        if self.base + need.bytes <= self.share {
            return Ok(());
        }
        Err(Unloaded::OverBudget { name: name.to_string(), need, share: self.share, base: self.base })
    }
}

/// `entry`'s model and its sessions, warmed up.
fn load(runtime: &Runtime, entry: &ModelEntry, lanes: &Lanes, trust: &Trust) -> Result<(Model, Sessions), Unloaded> {
    let (model, mut sessions) = crate::load::load(runtime, entry, lanes, trust)?;
    sessions.warm_up()?;
    Ok((model, sessions))
}

/// The worker's memory now, as PSS (/proc/self/smaps_rollup): its own pages (Pss_Anon +
/// Pss_Shmem) and its share of the file pages it maps (Pss_File). Kernels before 5.9 (RHEL
/// 8's 4.18) give the total only: the private part is then RssAnon + RssShmem from
/// /proc/self/status (anonymous pages are the process's own: their PSS is their RSS).
fn resident() -> ModelCost {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    let kb = |name: &str| kb_field(&rollup, name);
    if let (Some(anon), shmem, Some(file)) = (kb("Pss_Anon:"), kb("Pss_Shmem:"), kb("Pss_File:")) {
        return ModelCost { private: anon + shmem.unwrap_or(0), mapped: file };
    }
    let private = own_pages();
    ModelCost { private, mapped: kb("Pss:").unwrap_or(private).saturating_sub(private) }
}

/// The worker's own pages (RssAnon + RssShmem, from /proc/self/status: microseconds a read).
fn own_pages() -> u64 {
    Status::read().own()
}

/// Field `name` (`"RssAnon:"`) of a /proc file that counts in kB, in bytes.
fn kb_field(text: &str, name: &str) -> Option<u64> {
    let kb: u64 = text.lines().find_map(|l| l.strip_prefix(name))?.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// What /proc/self/status says of the worker's resident pages, in bytes.
#[derive(Debug, Default, Clone, Copy)]
struct Status {
    anon: u64,
    file: u64,
    shmem: u64,
    /// VmHWM: the highest the resident set (all three) reached since start or since
    /// [`reset_high_water`].
    high_water: u64,
}

impl Status {
    fn read() -> Status {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kb = |name: &str| kb_field(&status, name).unwrap_or(0);
        Status { anon: kb("RssAnon:"), file: kb("RssFile:"), shmem: kb("RssShmem:"), high_water: kb("VmHWM:") }
    }

    fn own(&self) -> u64 {
        self.anon + self.shmem
    }
}

/// Sets the kernel's high-water mark of the worker's resident set to where it is now (Linux
/// 4.0 and later); false where it cannot.
fn reset_high_water() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Runs `work`, sampling the worker's own pages ([`own_pages`]) every [`PEAK_SAMPLE_EVERY`]
/// on a thread of its own: returns its result and the most they grew above where they were
/// when it started. A sampler starved of the CPU on a busy machine misses short peaks, so the
/// kernel's high-water mark bounds them too: at the resident set's highest, its own pages were
/// at least the mark less the file pages it mapped (which a load only adds to).
fn peak_growth<T>(work: impl FnOnce() -> T) -> (T, u64) {
    let marked = reset_high_water();
    let before = Status::read();
    let start = before.own();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut peak = start;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(own_pages());
                std::thread::sleep(PEAK_SAMPLE_EVERY);
            }
            peak.max(own_pages())
        });
        let result = work();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let sampled = sampler.join().unwrap_or(start);
        let after = Status::read();
        let marked_peak = if marked { after.high_water.saturating_sub(after.file.max(before.file)) } else { 0 };
        (result, sampled.max(marked_peak).saturating_sub(start))
    })
}

/// How often [`peak_growth`] samples.
const PEAK_SAMPLE_EVERY: Duration = Duration::from_millis(2);

/// What grew from `before` to `after` (what shrank meanwhile, another model's buffers handed
/// back, counts as nothing).
fn grown(after: ModelCost, before: ModelCost) -> ModelCost {
    ModelCost {
        private: after.private.saturating_sub(before.private),
        mapped: after.mapped.saturating_sub(before.mapped),
    }
}
