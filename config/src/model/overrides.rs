//! The model settings the command line puts over every model's model.toml, or a repository
//! load over one model's ([`ModelOverride`]), checked as the file's own are.

use super::repository::ModelEntry;
use super::schema::Precision;
use crate::ConfigError;

/// Model settings given on the command line (`inferd serve --max-batch-size`, `--precision`,
/// ...), applied over every model's model.toml: how `inferd tune` tries a setting without
/// editing files. A repository load's Triton configuration gives some of them for its model
/// alone (`inferd_ipc::triton`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelOverride {
    pub max_batch_size: Option<usize>,
    pub max_queue_delay_ms: Option<u64>,
    /// Over `[batching] max_queue_size`.
    pub max_queue_size: Option<usize>,
    pub precision: Option<Precision>,
    /// Over `[quantization] min_cosine`.
    pub min_cosine: Option<f64>,
    /// Over `[quantization] max_probability_error`.
    pub max_probability_error: Option<f64>,
    /// Over `[quantization] max_relative_error`.
    pub max_relative_error: Option<f64>,
}

impl ModelOverride {
    /// `entry` with these settings over its own, checked like the file's.
    pub fn apply(&self, mut entry: ModelEntry) -> Result<ModelEntry, ConfigError> {
        let err = |message: String| ConfigError::Model { model: entry.name.clone(), message };
        let b = &mut entry.batching;
        b.max_batch_size = self.max_batch_size.or(b.max_batch_size);
        b.max_queue_delay_ms = self.max_queue_delay_ms.unwrap_or(b.max_queue_delay_ms);
        b.max_queue_size = self.max_queue_size.unwrap_or(b.max_queue_size);
        b.check().map_err(|e| err(e.to_string()))?;
        entry.precision = self.precision.unwrap_or(entry.precision);
        if entry.custom_ops.is_some() && entry.precision != Precision::Fp32 {
            return Err(err("precision int8 or auto is not prepared for graphs with custom operators".into()));
        }
        let q = &mut entry.quantization;
        q.min_cosine = self.min_cosine.unwrap_or(q.min_cosine);
        q.max_probability_error = self.max_probability_error.unwrap_or(q.max_probability_error);
        q.max_relative_error = self.max_relative_error.unwrap_or(q.max_relative_error);
        q.check().map_err(|e| err(e.to_string()))?;
        Ok(entry)
    }
}
