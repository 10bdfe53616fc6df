//! The models a worker serves: those it loaded at boot (the default first, then
//! `models.load`) and, with `[models] on_demand`, every other model of the repository, loaded
//! on the first request that names it. A model's number is its place here, the engine's
//! number for it and its row in the shared counters.
//!
//! On demand, a load is one flight for every request that waits for it: the first request
//! for a model not loaded queues its load for the worker's loader thread
//! ([`crate::load::on_demand`]), later ones wait for the same outcome. Bounded: a few loads
//! queued at once ([`LOADS_QUEUED`]), as many requests waiting as `server.max_queue`, each for
//! at most `models.load_timeout_secs`; past those a request is answered 503 with Retry-After.
//! A model that failed to load is answered 500 with the reason for [`FAILED_FOR`], not loaded
//! again on every request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::request::app::{ApiError, Model};

/// Loads queued for the loader thread at once, beyond the one it runs.
pub const LOADS_QUEUED: usize = 4;

/// How long a model that failed to load is answered with that failure before a request may
/// load it again (a broken folder costs one load per this long, not one per request).
pub const FAILED_FOR: Duration = Duration::from_secs(30);

/// A load's outcome: the model's number, or why it failed; `None` while it runs.
pub type Outcome = Option<Result<usize, String>>;

/// A load for the loader thread: which model, and where its outcome goes.
pub struct Load {
    pub name: String,
    pub done: watch::Sender<Outcome>,
}

pub struct Models {
    loaded: RwLock<Vec<Arc<Model>>>,
    on_demand: Option<OnDemand>,
}

/// What the models loaded on demand need: what may be loaded, the loads in flight and their
/// bounds.
pub struct OnDemand {
    /// The repository's models besides those loaded at boot.
    names: Vec<String>,
    /// Loads asked for and not done, by model.
    flights: Mutex<HashMap<String, watch::Receiver<Outcome>>>,
    /// Loads that failed, when and why, by model.
    failed: Mutex<HashMap<String, (Instant, String)>>,
    queue: std::sync::mpsc::SyncSender<Load>,
    /// Requests waiting for a load, and how many may (server.max_queue).
    waiting: AtomicUsize,
    max_waiting: usize,
    /// models.load_timeout_secs.
    timeout: Duration,
}

impl OnDemand {
    /// `names`: what may be loaded; `queue`: to the loader thread.
    pub fn new(
        names: Vec<String>,
        queue: std::sync::mpsc::SyncSender<Load>,
        max_waiting: usize,
        timeout: Duration,
    ) -> OnDemand {
        OnDemand {
            names,
            flights: Mutex::default(),
            failed: Mutex::default(),
            queue,
            waiting: AtomicUsize::new(0),
            max_waiting,
            timeout,
        }
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
    /// `loaded`: the models loaded at boot, the default first.
    pub fn new(loaded: Vec<Model>, on_demand: Option<OnDemand>) -> Models {
        Models { loaded: RwLock::new(loaded.into_iter().map(Arc::new).collect()), on_demand }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Model>>> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The default model.
    pub fn default_model(&self) -> Arc<Model> {
        self.read()[0].clone()
    }

    /// Every model loaded now, by number.
    pub fn loaded(&self) -> Vec<Arc<Model>> {
        self.read().clone()
    }

    /// The models that may be loaded on demand and are not loaded yet.
    pub fn loadable(&self) -> Vec<String> {
        let loaded = self.read();
        let names = self.on_demand.as_ref().map_or(&[][..], |d| &d.names);
        names.iter().filter(|n| !loaded.iter().any(|m| &m.info.name == *n)).cloned().collect()
    }

    /// Whether `name` is a model this worker loads on demand and has not loaded yet.
    pub fn loads_on_demand(&self, name: &str) -> bool {
        let listed = self.on_demand.as_ref().is_some_and(|d| d.names.iter().any(|n| n == name));
        listed && self.get(name).is_none()
    }

    /// A loaded model by name.
    pub fn get(&self, name: &str) -> Option<(usize, Arc<Model>)> {
        self.read().iter().enumerate().find(|(_, m)| m.info.name == name).map(|(i, m)| (i, m.clone()))
    }

    /// Finds a model by name (and version, when the path names one), loading it first when it
    /// is one the worker loads on demand.
    pub async fn find(&self, name: &str, version: Option<&str>) -> Result<(usize, Arc<Model>), ApiError> {
        let (index, model) = match self.get(name) {
            Some(found) => found,
            None => match self.on_demand.as_ref().filter(|d| d.names.iter().any(|n| n == name)) {
                Some(on_demand) => {
                    let index = self.load(on_demand, name).await?;
                    (index, self.read()[index].clone())
                }
                None => {
                    let mut known: Vec<String> = self.read().iter().map(|m| m.info.name.clone()).collect();
                    known.extend(self.loadable());
                    return Err(ApiError::NotFound(format!(
                        "unknown model '{name}'; this server has {}",
                        known.join(", ")
                    )));
                }
            },
        };
        match version {
            Some(v) if v != model.info.version => Err(ApiError::NotFound(format!(
                "model '{name}' has no version '{v}'; it serves version '{}'",
                model.info.version
            ))),
            _ => Ok((index, model)),
        }
    }

    /// Waits for `name`'s load, queuing it when none is in flight.
    async fn load(&self, on_demand: &OnDemand, name: &str) -> Result<usize, ApiError> {
        let busy =
            |why: String| ApiError::Overloaded(format!("model '{name}' is not loaded yet: {why}; retry shortly"));
        if let Some((at, why)) = on_demand.failed.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            if at.elapsed() < FAILED_FOR {
                return Err(ApiError::Internal(format!("model '{name}' could not be loaded: {why}")));
            }
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
                    if let Some((index, _)) = self.get(name) {
                        return Ok(index);
                    }
                    let (done, flight) = watch::channel(None);
                    on_demand
                        .queue
                        .try_send(Load { name: name.to_string(), done })
                        .map_err(|_| busy(format!("{LOADS_QUEUED} other models wait for this worker's loader")))?;
                    flights.insert(name.to_string(), flight.clone());
                    flight
                }
            }
        };
        let limit = on_demand.timeout;
        let landed = match tokio::time::timeout(limit, outcome.wait_for(Option::is_some)).await {
            Ok(Ok(done)) => done.clone(),
            Ok(Err(_)) => {
                return Err(ApiError::Internal(format!("model '{name}' was not loaded: the loader has stopped")))
            }
            Err(_) => {
                let why = format!("its load takes longer than models.load_timeout_secs = {}", limit.as_secs_f64());
                return Err(busy(why));
            }
        };
        match landed.expect("waited for it") {
            Ok(index) => Ok(index),
            Err(why) => Err(ApiError::Internal(format!("model '{name}' could not be loaded: {why}"))),
        }
    }

    /// A model the loader thread loaded (and the engine took as its next model, `index`):
    /// served from now on, and its flight's requests told.
    pub fn loaded_on_demand(&self, model: Model, index: usize, done: &watch::Sender<Outcome>) {
        let name = model.info.name.clone();
        {
            let mut loaded = self.loaded.write().unwrap_or_else(|e| e.into_inner());
            assert_eq!(loaded.len(), index, "the engine numbers models as they are added here");
            loaded.push(Arc::new(model));
        }
        self.land(&name, done, Ok(index));
    }

    /// A load that failed: its flight's requests told, and the next ones for [`FAILED_FOR`].
    pub fn failed_on_demand(&self, name: &str, why: String, done: &watch::Sender<Outcome>) {
        if let Some(on_demand) = &self.on_demand {
            let mut failed = on_demand.failed.lock().unwrap_or_else(|e| e.into_inner());
            failed.insert(name.to_string(), (Instant::now(), why.clone()));
        }
        self.land(name, done, Err(why));
    }

    /// Ends `name`'s flight: a request from now on finds the model loaded, or its failure.
    fn land(&self, name: &str, done: &watch::Sender<Outcome>, outcome: Result<usize, String>) {
        if let Some(on_demand) = &self.on_demand {
            on_demand.flights.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        }
        done.send_replace(Some(outcome));
    }
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
            weights: String::new(),
            precision: String::new(),
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

    /// `a` loaded, `b` and `c` on demand; the loads queued come out of the receiver.
    fn models(timeout: Duration) -> (Arc<Models>, std::sync::mpsc::Receiver<Load>) {
        let (queue, loads) = std::sync::mpsc::sync_channel(LOADS_QUEUED);
        let on_demand = OnDemand::new(vec!["b".into(), "c".into()], queue, 16, timeout);
        (Arc::new(Models::new(vec![model("a")], Some(on_demand))), loads)
    }

    #[tokio::test]
    async fn requests_for_a_model_not_loaded_wait_for_one_load() {
        let (models, loads) = models(Duration::from_secs(30));
        assert_eq!(models.loadable(), ["b", "c"]);
        let waiting: Vec<_> = (0..10)
            .map(|_| {
                let models = models.clone();
                tokio::spawn(async move { models.find("b", None).await.map(|(i, m)| (i, m.info.name.clone())) })
            })
            .collect();
        // Every request is waiting once the first load is queued; one load for all of them.
        let load = tokio::task::spawn_blocking(move || (loads.recv().unwrap(), loads)).await.unwrap();
        let (Load { name, done }, loads) = load;
        assert_eq!(name, "b");
        tokio::time::sleep(Duration::from_millis(50)).await;
        models.loaded_on_demand(model("b"), 1, &done);
        for request in waiting {
            assert_eq!(request.await.unwrap().unwrap(), (1, "b".to_string()));
        }
        assert!(loads.try_recv().is_err(), "a second load of the same model");
        assert_eq!(models.loadable(), ["c"]);
        // Loaded: found at once; an unknown model names what there is.
        assert_eq!(models.find("b", None).await.unwrap().0, 1);
        let unknown = models.find("z", None).await.unwrap_err().to_string();
        assert!(unknown.contains("unknown model 'z'") && unknown.contains("a, b, c"), "{unknown}");
    }

    #[tokio::test]
    async fn a_failed_load_is_answered_with_its_reason_and_not_queued_again_at_once() {
        let (models, loads) = models(Duration::from_secs(30));
        let request = tokio::spawn({
            let models = models.clone();
            async move { models.find("c", None).await.map(|_| ()) }
        });
        let Load { name, done } = tokio::task::spawn_blocking(move || loads.recv().unwrap()).await.unwrap();
        models.failed_on_demand(&name, "the file is not ONNX".into(), &done);
        let error = request.await.unwrap().unwrap_err();
        assert!(matches!(&error, ApiError::Internal(m) if m.contains("not ONNX")), "{error:?}");
        // Within FAILED_FOR: the same answer, without a load (none could be received here).
        let again = models.find("c", None).await.unwrap_err();
        assert!(matches!(&again, ApiError::Internal(m) if m.contains("not ONNX")), "{again:?}");
    }

    #[tokio::test]
    async fn past_its_bounds_a_request_is_refused_at_once_or_after_the_load_timeout() {
        let (models, loads) = models(Duration::from_millis(50));
        // Nobody serves the loads: the request waits out the timeout, 503.
        let late = models.find("b", None).await.unwrap_err();
        assert!(matches!(&late, ApiError::Overloaded(m) if m.contains("load_timeout_secs")), "{late:?}");
        // The loader's queue full: refused without waiting.
        let (queue, _full) = std::sync::mpsc::sync_channel(0);
        let on_demand = OnDemand::new(vec!["b".into()], queue, 16, Duration::from_secs(30));
        let full = Models::new(vec![model("a")], Some(on_demand));
        let refused = full.find("b", None).await.unwrap_err();
        assert!(
            matches!(&refused, ApiError::Overloaded(m) if m.contains("wait for this worker's loader")),
            "{refused:?}"
        );
        drop(loads);
    }
}
