//! A configuration turned into something the supervisor can execute: the CPU placement of each
//! worker, the ONNX Runtime library and the model entries. `inferd check` prints it and
//! `inferd serve` runs it; both refuse the same impossible plans with the same messages.

pub mod cpu;
pub mod memory;

use cpu::{plan, Ask, CpuBudget, Plan, PlanError};
use inferd_config::model::ModelEntry;
use inferd_config::ortlib::{locate, OrtLibError, OrtLibrary};
use inferd_config::{Config, ConfigError};

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cpu plan: {0}")]
    Plan(#[from] PlanError),
    #[error(transparent)]
    OrtLibrary(#[from] OrtLibError),
}

#[derive(Debug, Clone)]
pub struct Resolved {
    pub config: Config,
    pub plan: Plan,
    pub ort: OrtLibrary,
    /// Default model first.
    pub models: Vec<ModelEntry>,
    /// The API keys read at start ([auth]); a reload reads them again.
    /// The public port's API keys and TLS files, read at start.
    pub access: inferd_config::auth::Access,
}

impl Resolved {
    pub fn new(config: Config) -> Result<Resolved, ResolveError> {
        Resolved::with_budget(config, CpuBudget::detect())
    }

    pub fn with_budget(config: Config, budget: CpuBudget) -> Result<Resolved, ResolveError> {
        let plan = plan(&budget, Ask::of(&config.server))?;
        let ort = locate(config.runtime.ort_library.as_deref(), &config.base_dir)?;
        let models = config.model_names().iter().map(|name| config.load_model(name)).collect::<Result<Vec<_>, _>>()?;
        let access = config.access()?;
        Ok(Resolved { config, plan, ort, models, access })
    }
}
