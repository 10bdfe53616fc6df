//! The worker's loader thread (`inferd-load`), with `[models] on_demand`: loads the models
//! requests ask for ([`crate::request::models`]), one at a time, each as boot loads a model
//! (its sessions for every lane, warmed up), then hands its sessions to the engine and the
//! model to the handlers. A load that fails or panics costs that model's requests (500 with
//! the reason), never the worker.

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use inferd_config::model::ModelEntry;
use inferd_ipc::spec::ModelInfo;
use tracing::{info, warn};

use super::Lanes;
use crate::request::app::{AppState, Model};
use crate::request::models::Load;
use crate::runtime::engine::Sessions;
use crate::runtime::model::Runtime;

/// Serves loads from `queue` until every sender is gone; `catalog`: what may be loaded,
/// `told`: called with each model loaded (the worker reports it to the supervisor).
pub fn run(
    runtime: Runtime,
    catalog: Vec<ModelEntry>,
    lanes: Lanes,
    state: Arc<AppState>,
    queue: Receiver<Load>,
    told: impl Fn(&ModelInfo),
) {
    while let Ok(Load { name, done }) = queue.recv() {
        let started = Instant::now();
        let loaded = match catalog.iter().find(|e| e.name == name) {
            Some(entry) => crate::panics::guarded(|| load(&runtime, entry, &lanes))
                .unwrap_or_else(|_| Err("the server hit a bug loading it (logged)".into())),
            None => Err("it is not in this worker's catalog".into()),
        };
        let added = loaded.and_then(|(model, sessions)| Ok((model, state.engine.add(sessions)?)));
        match added {
            Ok((model, index)) => {
                let info = model.info.clone();
                info!(model = name, "loaded on demand in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
                state.models.loaded_on_demand(model, index, &done);
                told(&info);
            }
            Err(why) => {
                warn!(model = name, "cannot load on demand: {why}");
                state.models.failed_on_demand(&name, why, &done);
            }
        }
    }
}

/// `entry`'s model and its sessions, warmed up.
fn load(runtime: &Runtime, entry: &ModelEntry, lanes: &Lanes) -> Result<(Model, Sessions), String> {
    let (model, mut sessions) = super::load(runtime, entry, lanes).map_err(|e| e.to_string())?;
    sessions.warm_up().map_err(|e| e.to_string())?;
    Ok((model, sessions))
}
