//! Per-model pre- and post-processing: text through a tokenizer ([`text`]), images through a
//! decoder ([`image`]), and the model's outputs turned into embeddings or labelled scores
//! ([`head`]). What goes wrong in them, for a request ([`PipelineError`]) or for a
//! model.toml ([`BuildError`]), is in a file of its own, as is how much of a text is tokenized
//! ([`BYTES_PER_TOKEN`]); embeddings as the codes vector stores keep are in [`codes`].
//!
//! A [`Pipeline`] is built when the model loads, against the model's declared inputs and
//! outputs, so a `model.toml` that does not fit its model is refused at start (and by
//! `inferd check`) instead of failing on the first request. Tokenisation runs on the worker's
//! I/O thread for a request's texts up to 4 KiB in all, on its one blocking thread beyond
//! (request/tasks.rs); the lanes only run the model.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

pub mod bge_m3;
pub mod codes;
pub mod colbert;
pub mod dense;
mod error;
pub mod head;
pub mod image;
pub mod late;
pub mod text;
mod text_bound;

use inferd_config::model::{ModelEntry, Task};

use crate::runtime::tensor::TensorSpec;
pub use error::{BuildError, PipelineError};
pub use head::{cut_dimensions, embeddings, l2_normalize, ranked, scores, sparse, token_embeddings, Head, Producer};
pub use image::{decode_image, ImagePipeline};
pub use text::{Encoded, Piece, Side, Text, TextPipeline};
pub use text_bound::BYTES_PER_TOKEN;

#[derive(Debug)]
pub enum Pipeline {
    /// Tensors in, tensors out.
    Raw,
    Text(Box<TextPipeline>),
    Image(Box<ImagePipeline>),
}

impl Pipeline {
    /// Builds the pipeline `entry` asks for and checks it against the model's inputs and outputs.
    /// `producer` names the operator that computes a graph value (see [`Producer`]).
    pub fn build(
        entry: &ModelEntry,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
        producer: Producer,
    ) -> Result<Pipeline, BuildError> {
        if entry.task == Task::Raw {
            return Ok(Pipeline::Raw);
        }
        let head = Head::build(entry, outputs, producer)?;
        if let Some(t) = &entry.tokenizer {
            return Ok(Pipeline::Text(Box::new(TextPipeline::build(t, inputs, head)?)));
        }
        let config = entry.image.clone().ok_or(BuildError::NoPipeline)?;
        Ok(Pipeline::Image(Box::new(ImagePipeline::build(config, inputs, head)?)))
    }

    pub fn head(&self) -> Option<&Head> {
        match self {
            Pipeline::Raw => None,
            Pipeline::Text(t) => Some(&t.head),
            Pipeline::Image(i) => Some(&i.head),
        }
    }
}
