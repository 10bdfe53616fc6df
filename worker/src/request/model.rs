//! What the handlers ask of a model beyond what it takes and gives, answered in their error's
//! terms: whether it is a cross-encoder. The model itself is what a load makes
//! ([`crate::load::model`]), named here as the handlers import it.

use inferd_config::model::Task;

pub use crate::load::model::Model;
use crate::pipeline::{Head, Pipeline, TextPipeline};
use crate::request::error::ApiError;

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
