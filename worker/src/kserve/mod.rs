//! KServe v2's inference request once decoded, whatever carried it (JSON and binary data over
//! REST, [`json`], or a raw binary body, [`raw`], or Triton's generate extension, [`generate`]; protobuf over gRPC in `http::grpc`): its tensors, the outputs it asks for
//! and how each goes back.

use serde_json::{Map, Value};

use inferd_ipc::shm::{Place, Registry};

use crate::runtime::tensor::Tensor;

pub mod classification;
pub mod generate;
pub mod json;
pub mod raw;

/// A request tensor, typed and checked against its own shape, not yet against the model.
#[derive(Debug)]
pub struct InputTensor {
    pub tensor: Tensor,
    /// Sent as binary data rather than JSON (BYTES in JSON are text; in binary, raw bytes).
    pub binary: bool,
}

/// One requested output; `binary` is its `binary_data` parameter when given, `shared_memory`
/// the region it is to be written to, `classification` the classes it is answered as
/// ([`classification`]).
#[derive(Debug)]
pub struct WantedOutput {
    pub name: String,
    pub binary: Option<bool>,
    pub shared_memory: Option<Place>,
    pub classification: Option<usize>,
}

impl WantedOutput {
    /// Reads an output's parameters (REST's JSON, gRPC's as JSON values).
    pub fn of(name: String, parameters: Option<&Map<String, Value>>) -> Result<WantedOutput, String> {
        let what = format!("output '{name}'");
        Ok(WantedOutput {
            binary: parameters.and_then(|p| p.get("binary_data")).and_then(Value::as_bool),
            shared_memory: place_of(&what, parameters)?,
            classification: classification::count_of(&what, parameters)?,
            name,
        })
    }
}

/// How an output goes back: in the answer's JSON, as binary data after it (REST; gRPC has only
/// raw contents), or written into a shared-memory region, the answer naming it without data.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    Json,
    Binary,
    SharedMemory(Place),
}

/// Where a request's tensors in shared memory are read: the pool's registry (None: the
/// request's path takes none) and how many bytes one request may take from it (the body's
/// limit, server.max_body_bytes).
pub struct SharedMemory<'a> {
    pub registry: Option<&'a Registry>,
    pub limit: usize,
}

impl SharedMemory<'_> {
    /// No shared memory (a calibration file's requests).
    pub const NONE: SharedMemory<'static> = SharedMemory { registry: None, limit: 0 };

    /// Input `name`'s bytes at `place`; `taken` counts the request's bytes read so far.
    pub fn read(&self, name: &str, place: &Place, taken: &mut usize) -> Result<Vec<u8>, String> {
        let Some(registry) = self.registry else {
            return Err(format!("input '{name}': shared memory is not taken here; send the tensor in the request"));
        };
        let left = self.limit.saturating_sub(*taken);
        let bytes = registry.read(place, left).map_err(|e| format!("input '{name}': {e}"))?;
        *taken = taken.saturating_add(bytes.len());
        Ok(bytes)
    }
}

/// The region an input or output names in its parameters (Triton's `shared_memory_region`,
/// `shared_memory_byte_size`, `shared_memory_offset`), or None.
pub fn place_of(what: &str, parameters: Option<&Map<String, Value>>) -> Result<Option<Place>, String> {
    let Some(parameters) = parameters else { return Ok(None) };
    let Some(region) = parameters.get("shared_memory_region") else { return Ok(None) };
    let region = region.as_str().ok_or_else(|| format!("{what}: Unable to parse 'shared_memory_region'"))?;
    let number = |key: &str, default: Option<u64>| match parameters.get(key) {
        None => default.ok_or_else(|| format!("{what}: shared memory region '{region}' needs '{key}'")),
        Some(v) => v.as_u64().ok_or_else(|| format!("{what}: Unable to parse '{key}' (a whole number of bytes)")),
    };
    Ok(Some(Place {
        region: region.to_string(),
        offset: number("shared_memory_offset", Some(0))?,
        byte_size: number("shared_memory_byte_size", None)?,
    }))
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
/// indices into `available` in the order asked, each with how it goes back.
pub fn select_outputs(parsed: &Parsed, available: &[&str], model: &str) -> Result<Vec<(usize, Delivery)>, String> {
    let by_default = match parsed.binary_output {
        true => Delivery::Binary,
        false => Delivery::Json,
    };
    let Some(wanted) = &parsed.outputs else {
        return Ok((0..available.len()).map(|i| (i, by_default.clone())).collect());
    };
    let mut selection: Vec<(usize, Delivery)> = Vec::with_capacity(wanted.len());
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
        if out.shared_memory.is_some() && out.classification.is_some() {
            return Err(format!(
                "output '{}': Output can't set both 'shared_memory_region' and 'classification'",
                out.name
            ));
        }
        let delivery = match (&out.shared_memory, out.binary) {
            (Some(_), Some(true)) => {
                return Err(format!(
                    "output '{}': Output can't set both 'shared_memory_region' and 'binary_data'",
                    out.name
                ))
            }
            (Some(place), _) => Delivery::SharedMemory(place.clone()),
            (None, Some(true)) => Delivery::Binary,
            (None, Some(false)) => Delivery::Json,
            (None, None) => by_default.clone(),
        };
        selection.push((i, delivery));
    }
    Ok(selection)
}
