//! A model as the handlers see it ([`Model`]): what its sessions take and give, and the
//! pipeline around them, built from model.toml against those inputs and outputs
//! ([`pipeline`]). What a load makes ([`crate::load`]).

use std::sync::Arc;

use inferd_config::model::ModelEntry;

use crate::onnx::OnnxError;
use crate::pipeline::{BuildError, Pipeline};
use crate::runtime::model::ModelMeta;
use crate::runtime::tensor::TensorSpec;

/// A model as the handlers see it: what its sessions take and give ([`ModelMeta`], which it
/// dereferences to) and the pipeline around them. Made by the loader ([`crate::load`]).
#[derive(Debug, Clone)]
pub struct Model {
    pub meta: ModelMeta,
    /// Tokenizer or image decoding in front of the model, and pooling or scoring behind it.
    pub pipeline: Arc<Pipeline>,
}

impl std::ops::Deref for Model {
    type Target = ModelMeta;

    fn deref(&self) -> &ModelMeta {
        &self.meta
    }
}

/// The pipeline around a model whose sessions take and give what `meta` says. `Err`:
/// model.toml does not fit the model. Built once per load (and once by the int8 guard), so
/// what computes an output is read from the file when asked, not kept.
pub(crate) fn pipeline(entry: &ModelEntry, meta: &ModelMeta) -> Result<Pipeline, BuildError> {
    let producer = |value: &str| {
        let bytes = std::fs::read(&entry.path).map_err(|error| OnnxError::Read { path: entry.path.clone(), error })?;
        crate::onnx::producer_of(&bytes, value)
    };
    // A pipeline feeds the inputs a request must give; optional ones keep their initializers.
    let required: Vec<TensorSpec> = meta.inputs.iter().filter(|s| !s.optional).cloned().collect();
    Pipeline::build(entry, &required, &meta.outputs, &producer)
}
