//! A model as the handlers see it: its sessions' inputs and outputs and the pipeline around
//! them.

use std::sync::Arc;

use inferd_config::model::Task;

use crate::pipeline::{Head, Pipeline, TextPipeline};
use crate::request::error::ApiError;
use crate::runtime::model::ModelMeta;

/// A model as the handlers see it: what its sessions take and give ([`ModelMeta`], which it
/// dereferences to) and the pipeline around them. Made by the loader ([`crate::load`]).
#[derive(Debug, Clone)]
pub struct Model {
    pub meta: ModelMeta,
    /// Tokenizer or image decoding in front of the model, and pooling or scoring behind it.
    pub pipeline: Arc<Pipeline>,
}

impl Model {
    /// Its text pipeline where it is a cross-encoder (a text classification model with one
    /// label), what reranking needs (TEI's `/rerank`, Cohere's); `endpoint` names the route
    /// in the refusal otherwise.
    pub fn cross_encoder(&self, endpoint: &str) -> Result<&TextPipeline, ApiError> {
        let name = &self.info.name;
        match (&*self.pipeline, self.task) {
            (Pipeline::Text(p), Task::Classification) => match &p.head {
                Head::Classification { labels, .. } if labels.len() == 1 => Ok(p),
                Head::Classification { labels, .. } => Err(ApiError::BadRequest(format!(
                    "{endpoint} needs a cross-encoder (a classification model with one label), but '{name}' has {} \
                     labels",
                    labels.len()
                ))),
                Head::Embedding { .. } => Err(ApiError::BadRequest(format!("'{name}' is not a cross-encoder"))),
            },
            _ => Err(ApiError::BadRequest(format!(
                "{endpoint} needs a cross-encoder (a text classification model with one label); '{name}' is not one"
            ))),
        }
    }
}

impl std::ops::Deref for Model {
    type Target = ModelMeta;

    fn deref(&self) -> &ModelMeta {
        &self.meta
    }
}
