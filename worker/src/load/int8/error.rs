//! Why a model's int8 preparation failed: one error for the rewrite's, the guard's and the
//! calibration's steps, in a file of its own so that each of them names it without naming
//! the preparation that calls them.

use std::path::PathBuf;

use crate::onnx::OnnxError;
use crate::pipeline::{BuildError, PipelineError};
use crate::runtime::model::ModelError;
use crate::runtime::weights::WeightsError;

/// The preparation failed (with precision = "auto", fp32 is served instead and
/// the report says why; with "int8", the model does not load).
#[derive(Debug, thiserror::Error)]
pub enum Int8Error {
    #[error("cannot {action} {}: {error}", path.display())]
    File { action: &'static str, path: PathBuf, error: std::io::Error },
    #[error("{0}")]
    Report(std::io::Error),
    #[error("{0}")]
    Weights(#[from] WeightsError),
    #[error("{0}")]
    Onnx(#[from] OnnxError),
    #[error("model.toml: {0}")]
    Pipeline(#[from] BuildError),
    #[error("{0}")]
    Session(#[from] ModelError),
    #[error("the int8 model does not load: {0}")]
    Int8Session(ModelError),
    /// A calibration input the pipeline or the model refused.
    #[error("{0}")]
    Input(#[from] PipelineError),
    #[error("a calibration input of another kind than the model's")]
    Kind,
    #[error("quantization.calibration: {}: {error}", file.display())]
    CalibrationFolder { file: PathBuf, error: std::io::Error },
    /// A line of the calibration file (`place`: the file and the line) that cannot be used.
    #[error("{place}: {why}")]
    Calibration { place: String, why: String },
    #[error(
        "the guard generates inputs for float tensors only, and input '{input}' is {datatype}: give your own inputs in [quantization] calibration (KServe v2 inference requests, one per line)"
    )]
    NotFloat { input: String, datatype: String },
    #[error("precision = \"int8\" refused: {0}")]
    Refused(String),
}
