//! The models a worker serves: those it loaded at boot (the default first, then
//! `models.load`), pinned, and, with `[models] on_demand`, every other model of the
//! repository, loaded on the first request that names it and evicted when a load needs its
//! memory. A model's number is the engine's number for it ([`crate::runtime::engine`]),
//! never given to another model; those loaded at boot are numbered from 0 in order, which is
//! also their row in the shared counters.
//!
//! On demand, a load is one flight for every request that waits for it: the first request
//! for a model not loaded queues its load for the worker's loader thread
//! ([`crate::load::on_demand`]), later ones wait for the same outcome. Bounded: a few loads
//! queued at once ([`LOADS_QUEUED`]), as many requests waiting as `server.max_queue`, each for
//! at most `models.load_timeout_secs`; past those a request is answered 503 with Retry-After.
//! A model that failed to load is answered 500 with the reason, and not loaded again until
//! its files change.
//!
//! Eviction ([`Models::evict_one`]): only a model loaded on demand, and only while no request
//! holds it: a handler holds the model's `Arc` from its lookup to its answer, so a model whose
//! `Arc` only the registry holds has no request between those, and the registry's write lock
//! keeps new lookups out while it goes. A job of a request whose client went away may still
//! wait in the engine: it finds the model's number gone and is answered to nobody, never run
//! on another model.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use inferd_config::file::Eviction;
use inferd_ipc::spec::ModelCost;
use tokio::sync::watch;

use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::placement::Placement;

/// How many of its models a 404 for an unknown model names.
const KNOWN_NAMED: usize = 20;

/// Why `name` cannot name a model folder, if it cannot: a request for it is answered at once,
/// nothing looked up.
fn unlike_a_name(name: &str) -> Option<&'static str> {
    // Every request passes here: percent escapes are matched in place, nothing allocated.
    let escaped = |code: &[u8]| name.as_bytes().windows(code.len()).any(|w| w.eq_ignore_ascii_case(code));
    if name.len() > 255 {
        Some("a model's name is a folder's name, at most 255 bytes")
    } else if name.contains(['/', '\\']) || escaped(b"%2f") || escaped(b"%5c") {
        Some("a model's name has no '/'")
    } else if name == "." || name.contains("..") || escaped(b"%2e%2e") {
        Some("a model's name is not '.' or '..'")
    } else if name.contains('\0') || name.contains("%00") {
        Some("a model's name has no NUL")
    } else {
        None
    }
}

/// Before a model's first load, the room it is given: this many times its file. A first load
/// may prepare the model's shared weights (an optimising session of its own, which holds the
/// weights, their pre-packed form and the file it writes), and that is its peak: measured on
/// generated MLPs of 24 MiB, the worker's PSS rose by 4.1 times the file during the load, and
/// stayed 1.5 to 3 times the file above where it was once the model was warm.
pub const FIRST_LOAD_FACTOR: u64 = 5;

/// Loads queued for the loader thread at once, beyond the one it runs.
pub const LOADS_QUEUED: usize = 4;

/// Why a load gave no model: one that failed (500; not tried again until the model's files
/// change), or one that cannot be done now (503 with Retry-After).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Failed(String),
    #[error("{0}")]
    Busy(String),
}

/// A load's outcome: the model's number and the model, or why not; `None` while it runs. The
/// model held here is in use (not evicted) until every request that waited for it has it.
pub type Outcome = Option<Result<(usize, Arc<Model>), LoadError>>;

/// A load for the loader thread: which model, and where its outcome goes.
pub struct Load {
    pub name: String,
    pub done: watch::Sender<Outcome>,
    /// The span of the request that asked for it, when traced: the load is its child.
    pub trace: Option<opentelemetry::trace::SpanContext>,
}

pub struct Models {
    registry: RwLock<Registry>,
    on_demand: Option<OnDemand>,
    /// models.placement = "pool": where siblings hold models (set once the worker serves).
    placement: std::sync::OnceLock<Placement>,
    /// What `used` counts from.
    started: Instant,
}

/// The models loaded now: those loaded at boot first, then those loaded on demand in the
/// order they loaded (SIEVE's queue, oldest first).
struct Registry {
    entries: Vec<Entry>,
    /// SIEVE's hand: the place it looks at next among the models loaded on demand (0: the
    /// first after the pinned ones).
    hand: usize,
}

/// A model loaded now.
struct Entry {
    /// The engine's number for it.
    number: usize,
    model: Arc<Model>,
    /// Loaded at boot: never evicted.
    pinned: bool,
    /// What it holds (zero for a pinned model: the worker's own memory counts it).
    cost: ModelCost,
    /// Used since SIEVE's hand last passed it.
    visited: AtomicBool,
    /// When a request last looked it up (ms since the registry was made).
    used: AtomicU64,
}

impl Entry {
    fn new(number: usize, model: Model, pinned: bool, cost: ModelCost) -> Entry {
        let model = Arc::new(model);
        Entry { number, model, pinned, cost, visited: AtomicBool::new(false), used: AtomicU64::new(0) }
    }

    /// No request holds it: only the registry has the model.
    fn idle(&self) -> bool {
        Arc::strong_count(&self.model) == 1
    }
}

/// A model the loader evicted, for it to drop from the engine and report.
#[derive(Debug)]
pub struct Evicted {
    pub number: usize,
    pub name: String,
    pub cost: ModelCost,
}

/// What the models loaded on demand need: what may be loaded, the loads in flight and their
/// bounds, and which model goes first when one must.
pub struct OnDemand {
    /// The repository's models besides those loaded at boot, and the files whose change
    /// lifts a refusal.
    catalog: Vec<(String, Vec<std::path::PathBuf>)>,
    /// Loads asked for and not done, by model.
    flights: Mutex<HashMap<String, watch::Receiver<Outcome>>>,
    /// Loads that failed, the model's files as they were then and why, by model.
    failed: Mutex<HashMap<String, (Vec<Stamp>, String)>>,
    queue: std::sync::mpsc::SyncSender<Load>,
    /// Requests waiting for a load, and how many may (server.max_queue).
    waiting: AtomicUsize,
    max_waiting: usize,
    /// models.load_timeout_secs.
    timeout: Duration,
    eviction: Eviction,
    /// What the worker's share of models.memory_budget had free when the loader last looked
    /// (u64::MAX: no budget), and the room each model's load took when it last loaded.
    room: AtomicU64,
    needs: Mutex<HashMap<String, u64>>,
}

/// A file as a refusal saw it: its size and modification time (None: missing).
type Stamp = Option<(u64, SystemTime)>;

fn stamps(files: &[std::path::PathBuf]) -> Vec<Stamp> {
    files
        .iter()
        .map(|f| std::fs::metadata(f).ok().map(|m| (m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH))))
        .collect()
}

impl OnDemand {
    /// `catalog`: what may be loaded, each with the files it is loaded from; `queue`: to the
    /// loader thread.
    pub fn new(
        catalog: Vec<(String, Vec<std::path::PathBuf>)>,
        queue: std::sync::mpsc::SyncSender<Load>,
        max_waiting: usize,
        timeout: Duration,
        eviction: Eviction,
    ) -> OnDemand {
        OnDemand {
            catalog,
            flights: Mutex::default(),
            failed: Mutex::default(),
            queue,
            waiting: AtomicUsize::new(0),
            max_waiting,
            timeout,
            eviction,
            room: AtomicU64::new(u64::MAX),
            needs: Mutex::default(),
        }
    }

    /// The room `name`'s load takes: as its last load here measured, or before its first,
    /// [`FIRST_LOAD_FACTOR`] times its file.
    fn need(&self, name: &str) -> u64 {
        if let Some(&need) = self.needs.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            return need;
        }
        let file = self.catalog.iter().find(|(n, _)| n == name).and_then(|(_, files)| files.first());
        file.and_then(|f| std::fs::metadata(f).ok()).map_or(0, |m| m.len()).saturating_mul(FIRST_LOAD_FACTOR)
    }

    fn lists(&self, name: &str) -> bool {
        self.catalog.iter().any(|(n, _)| n == name)
    }

    /// Why `name` failed to load, while its files are as they were then.
    fn refusal(&self, name: &str) -> Option<String> {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let (then, why) = failed.get(name)?;
        let files = &self.catalog.iter().find(|(n, _)| n == name)?.1;
        if *then == stamps(files) {
            return Some(why.clone());
        }
        failed.remove(name);
        None
    }
}

/// A request counted among those waiting for a load while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Models {
    /// `loaded`: the models loaded at boot, the default first, numbered from 0.
    pub fn new(loaded: Vec<Model>, on_demand: Option<OnDemand>) -> Models {
        let entries = loaded.into_iter().enumerate().map(|(i, m)| Entry::new(i, m, true, ModelCost::default()));
        Models {
            registry: RwLock::new(Registry { entries: entries.collect(), hand: 0 }),
            on_demand,
            placement: std::sync::OnceLock::new(),
            started: Instant::now(),
        }
    }

    /// With models.placement = "pool": from now on, the models this worker loads on demand are
    /// offered to its siblings, and theirs found.
    pub fn place(&self, placement: Placement) {
        if self.on_demand.is_some() && self.placement.set(placement).is_ok() {
            for entry in self.read().entries.iter().filter(|e| !e.pinned) {
                self.placement.get().expect("set").held(&entry.model.info.name);
            }
        }
    }

    /// Whether requests may be sent to siblings (models.placement = "pool").
    pub fn placed(&self) -> bool {
        self.placement.get().is_some()
    }

    /// Where this worker takes its siblings' requests (models.placement = "pool").
    pub fn address(&self) -> Option<u64> {
        self.placement.get().map(|p| p.address)
    }

    /// Where to send a request for `name` instead of loading it here: a serving sibling that
    /// holds it, when this worker does not, loads it in no flight, and has no free room for it
    /// in its share (with room, it loads its own copy: the pool then serves the model on both
    /// workers' cores).
    pub fn elsewhere(&self, name: &str) -> Option<u64> {
        let placement = self.placement.get()?;
        let on_demand = self.on_demand.as_ref()?;
        if self.get(name).is_some() || !on_demand.lists(name) {
            return None;
        }
        if on_demand.flights.lock().unwrap_or_else(|e| e.into_inner()).contains_key(name) {
            return None;
        }
        if on_demand.room.load(Ordering::Relaxed) >= on_demand.need(name) {
            return None;
        }
        placement.holder(name)
    }

    /// The loader's view of the worker's share: `room` free in it now.
    pub fn set_room(&self, room: u64) {
        if let Some(on_demand) = &self.on_demand {
            on_demand.room.store(room, Ordering::Relaxed);
        }
    }

    /// The room `name`'s load took, as the loader measured it.
    pub fn set_need(&self, name: &str, need: u64) {
        if let Some(on_demand) = &self.on_demand {
            on_demand.needs.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), need);
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The default model.
    pub fn default_model(&self) -> Arc<Model> {
        self.read().entries[0].model.clone()
    }

    /// Every model loaded now.
    pub fn loaded(&self) -> Vec<Arc<Model>> {
        self.read().entries.iter().map(|e| e.model.clone()).collect()
    }

    /// Whether any model loaded on demand is loaded now.
    pub fn holds_on_demand(&self) -> bool {
        self.read().entries.iter().any(|e| !e.pinned)
    }

    /// The models that may be loaded on demand and are not loaded now.
    pub fn loadable(&self) -> Vec<String> {
        let registry = self.read();
        let catalog = self.on_demand.as_ref().map_or(&[][..], |d| &d.catalog);
        let loaded = |n: &String| registry.entries.iter().any(|e| &e.model.info.name == n);
        catalog.iter().map(|(n, _)| n).filter(|n| !loaded(n)).cloned().collect()
    }

    /// Whether `name` is a model this worker loads on demand and has not loaded now.
    pub fn loads_on_demand(&self, name: &str) -> bool {
        self.on_demand.as_ref().is_some_and(|d| d.lists(name)) && self.get(name).is_none()
    }

    /// A loaded model by name, with its number.
    pub fn get(&self, name: &str) -> Option<(usize, Arc<Model>)> {
        self.read().entries.iter().find(|e| e.model.info.name == name).map(|e| (e.number, e.model.clone()))
    }

    /// A loaded model by name, counted as used (by the eviction policy).
    fn use_loaded(&self, name: &str) -> Option<(usize, Arc<Model>)> {
        let registry = self.read();
        let entry = registry.entries.iter().find(|e| e.model.info.name == name)?;
        entry.visited.store(true, Ordering::Relaxed);
        entry.used.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        Some((entry.number, entry.model.clone()))
    }

    /// Finds a model by name (and version, when the path names one), loading it first when it
    /// is one the worker loads on demand (how long `call` waited for that, it records).
    pub async fn find(&self, name: &str, version: Option<&str>, call: &Call) -> Result<(usize, Arc<Model>), ApiError> {
        if let Some(problem) = unlike_a_name(name) {
            let shown = name.chars().take(64).collect::<String>().escape_debug().to_string();
            return Err(ApiError::NotFound(format!("no model is named '{shown}': {problem}")));
        }
        let (number, model) = match self.use_loaded(name) {
            Some(found) => found,
            None => match self.on_demand.as_ref().filter(|d| d.lists(name)) {
                Some(on_demand) => self.load(on_demand, name, call).await?,
                None => {
                    let mut known: Vec<String> =
                        self.read().entries.iter().map(|e| e.model.info.name.clone()).collect();
                    known.extend(self.loadable());
                    // A repository of thousands: the answer names a few (GET /v2 lists them all).
                    let more = match known.len().saturating_sub(KNOWN_NAMED) {
                        0 => String::new(),
                        more => format!(" and {more} more (GET /v2 lists them)"),
                    };
                    known.truncate(KNOWN_NAMED);
                    return Err(ApiError::NotFound(format!(
                        "unknown model '{name}'; this server has {}{more}",
                        known.join(", ")
                    )));
                }
            },
        };
        call.found(name);
        match version {
            Some(v) if v != model.info.version => Err(ApiError::NotFound(format!(
                "model '{name}' has no version '{v}'; it serves version '{}'",
                model.info.version
            ))),
            _ => Ok((number, model)),
        }
    }

    /// Waits for `name`'s load, queuing it when none is in flight.
    async fn load(&self, on_demand: &OnDemand, name: &str, call: &Call) -> Result<(usize, Arc<Model>), ApiError> {
        let busy =
            |why: String| ApiError::Overloaded(format!("model '{name}' is not loaded yet: {why}; retry shortly"));
        let failed = |why: String| ApiError::Internal(format!("model '{name}' could not be loaded: {why}"));
        if let Some(why) = on_demand.refusal(name) {
            return Err(failed(why));
        }
        if on_demand.waiting.fetch_add(1, Ordering::Relaxed) >= on_demand.max_waiting {
            on_demand.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(busy(format!(
                "{} requests already wait for models to load (server.max_queue)",
                on_demand.max_waiting
            )));
        }
        let _waiting = Waiting(&on_demand.waiting);
        let mut outcome = {
            let mut flights = on_demand.flights.lock().unwrap_or_else(|e| e.into_inner());
            match flights.get(name) {
                Some(flight) => flight.clone(),
                None => {
                    // Loaded between the lookup and this lock: no new flight.
                    if let Some(found) = self.use_loaded(name) {
                        return Ok(found);
                    }
                    let (done, flight) = watch::channel(None);
                    on_demand
                        .queue
                        .try_send(Load { name: name.to_string(), done, trace: crate::trace::current() })
                        .map_err(|_| busy(format!("{LOADS_QUEUED} other models wait for this worker's loader")))?;
                    flights.insert(name.to_string(), flight.clone());
                    flight
                }
            }
        };
        let limit = on_demand.timeout;
        let waited = Instant::now();
        let landed = match tokio::time::timeout(limit, outcome.wait_for(Option::is_some)).await {
            Ok(Ok(done)) => done.clone(),
            Ok(Err(_)) => return Err(failed("the loader has stopped".into())),
            Err(_) => {
                let why = format!("its load takes longer than models.load_timeout_secs = {}", limit.as_secs_f64());
                return Err(busy(why));
            }
        };
        call.waited_for_load(waited.elapsed());
        match landed.expect("waited for it") {
            Ok(found) => Ok(found),
            Err(LoadError::Busy(why)) => Err(busy(why)),
            Err(LoadError::Failed(why)) => Err(failed(why)),
        }
    }

    /// A model the loader thread loaded (the engine's number `number`, holding `cost`): served
    /// from now on, and its flight's requests told.
    pub fn loaded_on_demand(&self, model: Model, number: usize, cost: ModelCost, done: &watch::Sender<Outcome>) {
        let name = model.info.name.clone();
        let entry = Entry::new(number, model, false, cost);
        // Used now, by the requests that wait for it: not the next to go.
        entry.visited.store(true, Ordering::Relaxed);
        entry.used.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        let found = (number, entry.model.clone());
        self.write().entries.push(entry);
        if let Some(placement) = self.placement.get() {
            placement.held(&name);
        }
        self.land(&name, done, Ok(found));
    }

    /// A load that failed: its flight's requests told, and the next ones until the model's
    /// files change.
    pub fn failed_on_demand(&self, name: &str, why: LoadError, done: &watch::Sender<Outcome>) {
        if let (Some(on_demand), LoadError::Failed(reason)) = (&self.on_demand, &why) {
            if let Some((_, files)) = on_demand.catalog.iter().find(|(n, _)| n == name) {
                let mut failed = on_demand.failed.lock().unwrap_or_else(|e| e.into_inner());
                failed.insert(name.to_string(), (stamps(files), reason.clone()));
            }
        }
        self.land(name, done, Err(why));
    }

    /// Ends `name`'s flight: a request from now on finds the model loaded, or its failure.
    fn land(&self, name: &str, done: &watch::Sender<Outcome>, outcome: Result<(usize, Arc<Model>), LoadError>) {
        if let Some(on_demand) = &self.on_demand {
            on_demand.flights.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        }
        done.send_replace(Some(outcome));
    }

    /// Takes the next idle model loaded on demand out of the registry, by models.eviction,
    /// sparing model number `spare`; None when every other model loaded on demand is in use
    /// (or there is none). The caller drops it from the engine.
    pub fn evict_one(&self, spare: Option<usize>) -> Option<Evicted> {
        let policy = self.on_demand.as_ref()?.eviction;
        let mut registry = self.write();
        let Registry { entries, hand } = &mut *registry;
        let first = entries.iter().position(|e| !e.pinned)?;
        let may_go = |e: &Entry| e.idle() && Some(e.number) != spare;
        let place = match policy {
            Eviction::Lru => {
                let idle = entries.iter().enumerate().skip(first).filter(|(_, e)| may_go(e));
                idle.min_by_key(|(_, e)| e.used.load(Ordering::Relaxed)).map(|(i, _)| i)
            }
            Eviction::Sieve => sieve(&entries[first..], hand, may_go).map(|i| first + i),
        }?;
        let entry = entries.remove(place);
        if let Some(placement) = self.placement.get() {
            placement.released(&entry.model.info.name);
        }
        Some(Evicted { number: entry.number, name: entry.model.info.name.clone(), cost: entry.cost })
    }
}

/// SIEVE (Zhang et al., NSDI '24) over `queue` (oldest first): the hand walks from the oldest
/// to the newest and round again, clearing the mark of each model used since it last passed
/// and stopping at the first one not used since that `may_go`; where it stops is returned, and
/// the hand stays there (the next model moves into the place once this one is removed).
/// Models that may not go (in use) are passed over with their marks. None after two rounds
/// without one.
fn sieve(queue: &[Entry], hand: &mut usize, may_go: impl Fn(&Entry) -> bool) -> Option<usize> {
    for _ in 0..2 * queue.len() {
        if *hand >= queue.len() {
            *hand = 0;
        }
        let entry = &queue[*hand];
        if may_go(entry) && !entry.visited.swap(false, Ordering::Relaxed) {
            return Some(*hand);
        }
        *hand += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::model::ModelMeta;

    fn model(name: &str) -> Model {
        let info = inferd_ipc::spec::ModelInfo {
            name: name.into(),
            version: "1".into(),
            sha256: "0".into(),
            weights: Default::default(),
            precision: Default::default(),
        };
        let meta = ModelMeta {
            info,
            task: inferd_config::model::Task::Raw,
            inputs: Vec::new(),
            outputs: Vec::new(),
            batching: Default::default(),
        };
        Model { meta, pipeline: Arc::new(crate::pipeline::Pipeline::Raw) }
    }

    fn on_demand(
        names: &[&str],
        queue: std::sync::mpsc::SyncSender<Load>,
        timeout: Duration,
        eviction: Eviction,
    ) -> OnDemand {
        let catalog =
            names.iter().map(|n| (n.to_string(), vec![std::path::PathBuf::from(format!("/nonexistent/{n}"))]));
        OnDemand::new(catalog.collect(), queue, 16, timeout, eviction)
    }

    /// `a` loaded, `b` and `c` on demand; the loads queued come out of the receiver.
    fn models(timeout: Duration) -> (Arc<Models>, std::sync::mpsc::Receiver<Load>) {
        let (queue, loads) = std::sync::mpsc::sync_channel(LOADS_QUEUED);
        (Arc::new(Models::new(vec![model("a")], Some(on_demand(&["b", "c"], queue, timeout, Eviction::Sieve)))), loads)
    }

    #[tokio::test]
    async fn requests_for_a_model_not_loaded_wait_for_one_load() {
        let (models, loads) = models(Duration::from_secs(30));
        assert_eq!(models.loadable(), ["b", "c"]);
        let waiting: Vec<_> = (0..10)
            .map(|_| {
                let models = models.clone();
                tokio::spawn(async move {
                    models.find("b", None, &Call::default()).await.map(|(i, m)| (i, m.info.name.clone()))
                })
            })
            .collect();
        // Every request is waiting once the first load is queued; one load for all of them.
        let load = tokio::task::spawn_blocking(move || (loads.recv().unwrap(), loads)).await.unwrap();
        let (Load { name, done, .. }, loads) = load;
        assert_eq!(name, "b");
        tokio::time::sleep(Duration::from_millis(50)).await;
        models.loaded_on_demand(model("b"), 1, ModelCost::default(), &done);
        for request in waiting {
            assert_eq!(request.await.unwrap().unwrap(), (1, "b".to_string()));
        }
        assert!(loads.try_recv().is_err(), "a second load of the same model");
        assert_eq!(models.loadable(), ["c"]);
        // Loaded: found at once; an unknown model names what there is.
        assert_eq!(models.find("b", None, &Call::default()).await.unwrap().0, 1);
        let unknown = models.find("z", None, &Call::default()).await.unwrap_err().to_string();
        assert!(unknown.contains("unknown model 'z'") && unknown.contains("a, b, c"), "{unknown}");
    }

    #[tokio::test]
    async fn a_failed_load_is_answered_with_its_reason_and_not_queued_again_at_once() {
        let (models, loads) = models(Duration::from_secs(30));
        let request = tokio::spawn({
            let models = models.clone();
            async move { models.find("c", None, &Call::default()).await.map(|_| ()) }
        });
        let Load { name, done, .. } = tokio::task::spawn_blocking(move || loads.recv().unwrap()).await.unwrap();
        models.failed_on_demand(&name, LoadError::Failed("the file is not ONNX".into()), &done);
        let error = request.await.unwrap().unwrap_err();
        assert!(matches!(&error, ApiError::Internal(m) if m.contains("not ONNX")), "{error:?}");
        // Its files unchanged: the same answer, without a load (none could be received here).
        let again = models.find("c", None, &Call::default()).await.unwrap_err();
        assert!(matches!(&again, ApiError::Internal(m) if m.contains("not ONNX")), "{again:?}");
    }

    #[tokio::test]
    async fn past_its_bounds_a_request_is_refused_at_once_or_after_the_load_timeout() {
        let (models, loads) = models(Duration::from_millis(50));
        // Nobody serves the loads: the request waits out the timeout, 503.
        let late = models.find("b", None, &Call::default()).await.unwrap_err();
        assert!(matches!(&late, ApiError::Overloaded(m) if m.contains("load_timeout_secs")), "{late:?}");
        // The loader's queue full: refused without waiting.
        let (queue, _full) = std::sync::mpsc::sync_channel(0);
        let full =
            Models::new(vec![model("a")], Some(on_demand(&["b"], queue, Duration::from_secs(30), Eviction::Sieve)));
        let refused = full.find("b", None, &Call::default()).await.unwrap_err();
        assert!(
            matches!(&refused, ApiError::Overloaded(m) if m.contains("wait for this worker's loader")),
            "{refused:?}"
        );
        drop(loads);
    }

    /// `pinned` loaded at boot, then each of `loaded` on demand (numbered from 10), by `eviction`.
    fn loaded(eviction: Eviction, loaded: &[&str]) -> Models {
        let (queue, _) = std::sync::mpsc::sync_channel(1);
        let models =
            Models::new(vec![model("pinned")], Some(on_demand(loaded, queue, Duration::from_secs(1), eviction)));
        for (i, name) in loaded.iter().enumerate() {
            let (done, _) = watch::channel(None);
            models.loaded_on_demand(model(name), 10 + i, ModelCost { private: 1, mapped: 2 }, &done);
        }
        models
    }

    fn evictions(models: &Models) -> Vec<String> {
        std::iter::from_fn(|| models.evict_one(None).map(|e| e.name)).collect()
    }

    #[tokio::test]
    async fn sieve_evicts_in_load_order_passing_over_models_used_since_the_hand_last_passed() {
        let models = loaded(Eviction::Sieve, &["b", "c", "d", "e"]);
        // A load marks a model used; the hand's first round clears those marks.
        for name in ["b", "c", "d", "e"] {
            models
                .read()
                .entries
                .iter()
                .find(|e| e.model.info.name == name)
                .unwrap()
                .visited
                .store(false, Ordering::Relaxed);
        }
        // c used: the hand passes over it once; b, the oldest, goes first.
        models.find("c", None, &Call::default()).await.unwrap();
        let first = models.evict_one(None).unwrap();
        assert_eq!((first.name.as_str(), first.number, first.cost.total()), ("b", 10, 3));
        // A model held by a request is never evicted; the pinned one never.
        let (_, held) = models.find("d", None, &Call::default()).await.unwrap();
        assert_eq!(evictions(&models), ["e", "c"]);
        assert_eq!(models.get("d").map(|(n, _)| n), Some(12));
        drop(held);
        assert_eq!(evictions(&models), ["d"]);
        assert!(models.evict_one(None).is_none());
        assert_eq!(models.loaded().iter().map(|m| m.info.name.clone()).collect::<Vec<_>>(), ["pinned"]);
        assert_eq!(models.loadable(), ["b", "c", "d", "e"]);
    }

    #[tokio::test]
    async fn lru_evicts_the_model_used_longest_ago() {
        let models = loaded(Eviction::Lru, &["b", "c", "d"]);
        for name in ["d", "b", "c"] {
            models.find(name, None, &Call::default()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        assert_eq!(models.evict_one(Some(12)).map(|e| e.name).as_deref(), Some("b"), "d spared");
        assert_eq!(evictions(&models), ["d", "c"]);
    }
}
