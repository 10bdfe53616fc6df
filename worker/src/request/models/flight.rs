//! On demand, a load is one flight for every request that waits for it ([`OnDemand`]): the
//! first request for a model not loaded queues its load for the worker's loader thread
//! ([`crate::request::on_demand`]), later ones wait for the same outcome. Bounded: a few loads
//! queued at once ([`LOADS_QUEUED`]), as many requests waiting as `server.max_queue`, each for
//! at most `models.load_timeout_secs`; past those a request is answered 503 with Retry-After.
//! A model that failed to load is answered 500 with the reason, and not loaded again until
//! its files change.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use inferd_config::file::Eviction;
use tokio::sync::watch;

use crate::load::Model;
use crate::request::call::Call;
use crate::request::error::ApiError;

use super::need::{Need, Needs};

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

/// What the models loaded on demand need: what may be loaded, the loads in flight and their
/// bounds, and which model goes first when one must.
pub struct OnDemand {
    /// The repository's models besides those loaded at boot, and the files whose change
    /// lifts a refusal.
    pub(super) catalog: Vec<(String, Vec<std::path::PathBuf>)>,
    /// Loads asked for and not done, by model.
    pub(super) flights: Mutex<HashMap<String, watch::Receiver<Outcome>>>,
    /// Loads that failed, the model's files as they were then and why, by model.
    failed: Mutex<HashMap<String, (Vec<Stamp>, String)>>,
    queue: std::sync::mpsc::SyncSender<Load>,
    /// Requests waiting for a load, and how many may (server.max_queue).
    waiting: AtomicUsize,
    max_waiting: usize,
    /// models.load_timeout_secs.
    timeout: Duration,
    pub(super) eviction: Eviction,
    /// What the worker's share of models.memory_budget had free when the loader last looked
    /// (u64::MAX: no budget), and the loads' peaks it measured.
    pub(super) room: AtomicU64,
    pub(super) needs: Mutex<Needs>,
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

    /// What `name`'s load needs ([`Needs::of`]), by its file as it is now.
    pub(super) fn need(&self, name: &str) -> Need {
        let file = self.catalog.iter().find(|(n, _)| n == name).and_then(|(_, files)| files.first());
        let bytes = file.and_then(|f| std::fs::metadata(f).ok()).map_or(0, |m| m.len());
        self.needs.lock().unwrap_or_else(|e| e.into_inner()).of(name, bytes)
    }

    pub(super) fn lists(&self, name: &str) -> bool {
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

    /// `name`'s load failed for `reason`: refused with it until the model's files change.
    pub(super) fn failed(&self, name: &str, reason: &str) {
        if let Some((_, files)) = self.catalog.iter().find(|(n, _)| n == name) {
            let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
            failed.insert(name.to_string(), (stamps(files), reason.to_string()));
        }
    }

    /// Waits for `name`'s load, queuing it when none is in flight (`loaded`: the model with
    /// its number, counted as used, when it is loaded now).
    pub(super) async fn wait(
        &self,
        name: &str,
        call: &Call,
        loaded: impl Fn() -> Option<(usize, Arc<Model>)>,
    ) -> Result<(usize, Arc<Model>), ApiError> {
        let busy =
            |why: String| ApiError::Overloaded(format!("model '{name}' is not loaded yet: {why}; retry shortly"));
        let failed = |why: String| ApiError::Internal(format!("model '{name}' could not be loaded: {why}"));
        if let Some(why) = self.refusal(name) {
            return Err(failed(why));
        }
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(busy(format!(
                "{} requests already wait for models to load (server.max_queue)",
                self.max_waiting
            )));
        }
        let _waiting = Waiting(&self.waiting);
        let mut outcome = {
            let mut flights = self.flights.lock().unwrap_or_else(|e| e.into_inner());
            match flights.get(name) {
                Some(flight) => flight.clone(),
                None => {
                    // Loaded between the lookup and this lock: no new flight.
                    if let Some(found) = loaded() {
                        return Ok(found);
                    }
                    let (done, flight) = watch::channel(None);
                    self.queue
                        .try_send(Load { name: name.to_string(), done, trace: crate::trace::current() })
                        .map_err(|_| busy(format!("{LOADS_QUEUED} other models wait for this worker's loader")))?;
                    flights.insert(name.to_string(), flight.clone());
                    flight
                }
            }
        };
        let limit = self.timeout;
        let waited = Instant::now();
        // The wait ends at the load's time limit, or at the request's deadline if that is
        // sooner (the load goes on for the requests after it).
        let until = call.terms.deadline.filter(|&d| d < waited + limit);
        let landed =
            match tokio::time::timeout_at(until.unwrap_or(waited + limit).into(), outcome.wait_for(Option::is_some))
                .await
            {
                Ok(Ok(done)) => done.clone(),
                Ok(Err(_)) => return Err(failed("the loader has stopped".into())),
                Err(_) if until.is_some() => {
                    return Err(ApiError::DeadlineExceeded(format!(
                    "the request's deadline passed after {:?} while model '{name}' loaded; it never reached the model",
                    call.arrived.elapsed()
                )))
                }
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
}

/// A request counted among those waiting for a load while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
