//! KServe v2's inference request once decoded, whatever carried it (JSON and binary data over
//! REST, [`json`], or a raw binary body, [`raw`]; protobuf over gRPC in `http::grpc`): its tensors, the outputs it asks for
//! and how each goes back.

use serde_json::{Map, Value};

use crate::runtime::tensor::Tensor;

pub mod json;
pub mod raw;

/// A request tensor, typed and checked against its own shape, not yet against the model.
#[derive(Debug)]
pub struct InputTensor {
    pub tensor: Tensor,
    /// Sent as binary data rather than JSON (BYTES in JSON are text; in binary, raw bytes).
    pub binary: bool,
}

/// One requested output; `binary` is its `binary_data` parameter when given.
#[derive(Debug)]
pub struct WantedOutput {
    pub name: String,
    pub binary: Option<bool>,
}

#[derive(Debug)]
pub struct Parsed {
    pub id: Option<String>,
    pub parameters: Map<String, Value>,
    pub inputs: Vec<InputTensor>,
    /// `None`: every output.
    pub outputs: Option<Vec<WantedOutput>>,
    /// The request's `binary_data_output` parameter: outputs go binary unless they say otherwise.
    pub binary_output: bool,
}

/// Resolves the requested outputs against the names the model (or its pipeline) produces:
/// indices into `available` in the order asked, each with whether it goes out as binary data.
pub fn select_outputs(parsed: &Parsed, available: &[&str], model: &str) -> Result<Vec<(usize, bool)>, String> {
    let Some(wanted) = &parsed.outputs else {
        return Ok((0..available.len()).map(|i| (i, parsed.binary_output)).collect());
    };
    let mut selection: Vec<(usize, bool)> = Vec::with_capacity(wanted.len());
    for out in wanted {
        let Some(i) = available.iter().position(|n| *n == out.name) else {
            return Err(format!(
                "unknown output '{}'; model '{model}' has outputs {}",
                out.name,
                available.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
            ));
        };
        // As Triton: an output asked for twice is a mistake in the request, not a wish.
        if selection.iter().any(|(j, _)| *j == i) {
            return Err(format!("output '{}' already exists in request: ask for each output once", out.name));
        }
        selection.push((i, out.binary.unwrap_or(parsed.binary_output)));
    }
    Ok(selection)
}
