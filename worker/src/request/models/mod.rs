//! The models a worker serves ([`Models`]): those it loaded at boot (the default first, then
//! `models.load`), pinned, and, with `[models] on_demand`, every other model of the
//! repository, loaded on the first request that names it and evicted when a load needs its
//! memory; and their lookup by name. A model's number is the engine's number for it
//! ([`crate::runtime::engine`]), never given to another model; those loaded at boot are
//! numbered from 0 in order, which is also their row in the shared counters.
//!
//! Each part in a file of its own, under [`Models`], which ties them together: the models
//! loaded now as the registry holds them (registry.rs), the on-demand single flight
//! (flight.rs: one load per model at a time, its waiters and their bounds, [`OnDemand`]), what
//! a load needs of the memory budget (need.rs) and eviction within the memory budget (eviction.rs, [`Models::evict_one`]). The loader thread
//! that serves the flights' loads: [`crate::request::on_demand`].

mod eviction;
mod flight;
mod need;
mod registry;

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use inferd_ipc::spec::ModelCost;
use tokio::sync::watch;

use crate::load::Model;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::placement::Placement;
pub use eviction::Evicted;
pub use flight::{Load, LoadError, OnDemand, Outcome, LOADS_QUEUED};
pub use need::{Basis, Need, FIRST_LOAD_FACTOR};
use registry::{Entry, Registry};

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

pub struct Models {
    registry: RwLock<Registry>,
    on_demand: Option<OnDemand>,
    /// models.placement = "pool": where siblings hold models (set once the worker serves).
    placement: std::sync::OnceLock<Placement>,
    /// What `used` counts from.
    started: Instant,
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
        if on_demand.room.load(Ordering::Relaxed) >= on_demand.need(name).bytes {
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

    /// What a load of `name` needs of the worker's share (what the loader measured, or its
    /// estimate); None without models on demand.
    pub fn need(&self, name: &str) -> Option<Need> {
        self.on_demand.as_ref().map(|on_demand| on_demand.need(name))
    }

    /// `name`'s load took `peak` of the worker's share and left `held` in it.
    pub fn measured_load(&self, name: &str, peak: u64, held: u64) {
        if let Some(on_demand) = &self.on_demand {
            on_demand.needs.lock().unwrap_or_else(|e| e.into_inner()).record(name, peak, held);
        }
    }

    /// What `name` held once loaded, when a load of it was measured here.
    pub fn measured_held(&self, name: &str) -> Option<u64> {
        self.on_demand.as_ref()?.needs.lock().unwrap_or_else(|e| e.into_inner()).held(name)
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
                Some(on_demand) => on_demand.wait(name, call, || self.use_loaded(name)).await?,
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
                        "Request for unknown model: '{name}' is not found; this server has {}{more}",
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
            on_demand.failed(name, reason);
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
        let entry = eviction::take(&mut registry, policy, spare)?;
        if let Some(placement) = self.placement.get() {
            placement.released(&entry.model.info.name);
        }
        Some(Evicted { number: entry.number, name: entry.model.info.name.clone(), cost: entry.cost })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use inferd_config::file::Eviction;

    use super::*;
    use crate::runtime::model::ModelMeta;

    fn model(name: &str) -> Model {
        let meta = ModelMeta::for_tests(name, &[], &[]);
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
        assert!(unknown.contains("unknown model: 'z' is not found") && unknown.contains("a, b, c"), "{unknown}");
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
