//! A KServe v2 inference request once parsed, REST or gRPC alike: the pipeline (text or image)
//! for a pipelined model's BYTES input, the model's own tensors otherwise.

use std::time::Duration;

use base64::Engine as _;
use serde_json::Value;

use crate::kserve::{classification, select_outputs, Delivery, Parsed};
use crate::pipeline::{Head, Pipeline, Side, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, PipelineInput, Rows};
use crate::runtime::engine::Join;
use crate::runtime::tensor::{shape_text, validate_inputs, Tensor, TensorData};

/// A v2 request's answer before it is encoded (as JSON and binary data, or as protobuf).
pub struct Inferred {
    pub id: Option<String>,
    pub outputs: Vec<Tensor>,
    /// (index into `outputs`, how it goes back): the outputs asked for, in the order asked;
    /// those asked into shared memory are written there already.
    pub selection: Vec<(usize, Delivery)>,
    /// How a pipeline ran the request (for the Server-Timing header); `None` for raw tensors.
    pub outcome: Option<tasks::Outcome>,
}

/// Runs a parsed v2 request, REST or gRPC: one BYTES input named as the pipeline's goes
/// through the model's pipeline (text or image), anything else to the model's own tensors.
pub async fn run_v2(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    parsed: Parsed,
) -> Result<Inferred, ApiError> {
    let model = &meta.info.name;
    // Triton's sequence batcher sends a sequence's requests to one stateful instance; inferd's
    // models keep no state between runs, so a request of a sequence would be answered as if
    // alone: refused instead (tritonclient sends the parameters only for a sequence_id not 0).
    let sequence = parsed.parameters.get("sequence_id").filter(|id| !matches!(id.as_u64(), Some(0)) && id != &"");
    if let Some(id) = sequence {
        return Err(ApiError::BadRequest(format!(
            "parameter 'sequence_id' ({id}): inferd has no sequence batcher; its models keep no state between requests"
        )));
    }
    // Triton's per-request timeout, in microseconds from its arrival; 0 is none, as there.
    let call = &match timeout(&parsed.parameters)? {
        Some(timeout) => call.within(timeout),
        None => call.clone(),
    };
    if let Some((input_name, outputs)) = pipeline_io(meta) {
        if parsed.inputs.len() == 1 && parsed.inputs[0].tensor.name == input_name {
            let names: Vec<&str> = outputs.iter().map(|o| o.0).collect();
            let selection = select_outputs(&parsed, &names, model).map_err(ApiError::BadRequest)?;
            let classes = classes_asked(&parsed, &names);
            let truncate = parsed.parameters.get("truncate").and_then(Value::as_bool).unwrap_or(false);
            let id = parsed.id.clone();
            let input = pipeline_input(meta, parsed)?;
            let options = Options { truncate: truncate.then_some(Side::Right), ..Options::default() };
            let outcome = tasks::run_pipeline(state, call, index, meta, input, options).await?;
            let outputs = classified(meta, pipeline_tensors(&outcome.rows), &classes, true)?;
            deliver(state, &outputs, &selection)?;
            return Ok(Inferred { id, outputs, selection, outcome: Some(outcome) });
        }
    }
    let names: Vec<&str> = meta.outputs.iter().map(|o| o.name.as_str()).collect();
    let selection = select_outputs(&parsed, &names, model).map_err(ApiError::BadRequest)?;
    let classes = classes_asked(&parsed, &names);
    let id = parsed.id.clone();
    let given = parsed.inputs.into_iter().map(|input| input.tensor).collect();
    let inputs = validate_inputs(given, &meta.inputs, model).map_err(ApiError::BadRequest)?;
    let (outputs, _) = state.engine.submit(index, inputs, Join::Exact, call.terms).await?;
    let outputs = classified(meta, outputs, &classes, meta.batch_rows().is_ok())?;
    deliver(state, &outputs, &selection)?;
    Ok(Inferred { id, outputs, selection, outcome: None })
}

/// (output index in `names`, classes) of each output asked for as classes (Triton's
/// classification extension); the names are known to be the model's ([`select_outputs`]).
fn classes_asked(parsed: &Parsed, names: &[&str]) -> Vec<(usize, usize)> {
    let asked = parsed.outputs.iter().flatten();
    asked.filter_map(|o| Some((names.iter().position(|n| *n == o.name)?, o.classification?))).collect()
}

/// `outputs` with those asked for as classes answered so ([`classification`]), labelled with
/// the model's labels where they fit; `batched`: the outputs' first dimension is the batch.
fn classified(
    meta: &Model,
    outputs: Vec<Tensor>,
    classes: &[(usize, usize)],
    batched: bool,
) -> Result<Vec<Tensor>, ApiError> {
    let labels = match meta.pipeline.head() {
        Some(Head::Classification { labels, .. }) => Some(labels.as_slice()),
        _ => None,
    };
    let asked = |i: usize| classes.iter().find(|(j, _)| *j == i).map(|&(_, count)| count);
    let each = |(i, tensor): (usize, Tensor)| match asked(i) {
        Some(count) => classification::classify(tensor, count, batched, labels).map_err(ApiError::BadRequest),
        None => Ok(tensor),
    };
    outputs.into_iter().enumerate().map(each).collect()
}

/// Writes the outputs asked into shared memory there (Triton's system shared memory): the
/// answer names them without their data. Each is checked to fit before any is written.
fn deliver(state: &AppState, outputs: &[Tensor], selection: &[(usize, Delivery)]) -> Result<(), ApiError> {
    let mut writes = Vec::new();
    for (i, delivery) in selection {
        let (Delivery::SharedMemory(place), Some(output)) = (delivery, outputs.get(*i)) else { continue };
        let bytes = output.data.to_binary();
        if bytes.len() as u64 > place.byte_size {
            // The registry's own words for it.
            return Err(inferd_ipc::shm::Registry::too_small(place, &output.name, bytes.len()).into());
        }
        writes.push((place, &output.name, bytes));
    }
    if writes.is_empty() {
        return Ok(());
    }
    let Some(registry) = &state.shared_memory else {
        return Err(ApiError::BadRequest("shared memory is not taken here; ask for the outputs in the answer".into()));
    };
    for (place, name, bytes) in writes {
        registry.write(place, name, &bytes)?;
    }
    Ok(())
}

/// KServe's `parameters.timeout` (Triton's): a whole number of microseconds, 0 for none.
fn timeout(parameters: &serde_json::Map<String, Value>) -> Result<Option<Duration>, ApiError> {
    let Some(value) = parameters.get("timeout") else { return Ok(None) };
    let micros = value.as_u64().ok_or_else(|| {
        ApiError::BadRequest(format!(
            "parameter 'timeout' ({value}) must be a whole number of microseconds, 0 or more (0: none)"
        ))
    })?;
    Ok((micros > 0).then(|| Duration::from_micros(micros)))
}

pub type OutputSpec = (&'static str, &'static str, Vec<i64>);

/// The BYTES input a pipelined model takes through `/infer`, and the outputs it returns.
pub fn pipeline_io(meta: &Model) -> Option<(&'static str, Vec<OutputSpec>)> {
    let input = match &*meta.pipeline {
        Pipeline::Raw => return None,
        Pipeline::Text(_) => "text",
        Pipeline::Image(_) => "image",
    };
    let outputs = match meta.pipeline.head()? {
        Head::Embedding { .. } => vec![("embedding", "FP32", vec![-1, -1])],
        Head::Classification { labels, .. } => vec![
            ("label", "BYTES", vec![-1]),
            ("score", "FP32", vec![-1]),
            ("probabilities", "FP32", vec![-1, labels.len() as i64]),
        ],
    };
    Some((input, outputs))
}

/// The pipeline's input from a one-tensor request: UTF-8 texts, or encoded images (raw bytes
/// when sent as binary data, base64 when sent as JSON strings).
fn pipeline_input(meta: &Model, mut parsed: Parsed) -> Result<PipelineInput, ApiError> {
    let input = parsed.inputs.remove(0);
    let name = input.tensor.name;
    let TensorData::Bytes(items) = input.tensor.data else {
        return Err(ApiError::BadRequest(format!(
            "input '{name}': expected BYTES, got {}",
            input.tensor.data.dtype().name()
        )));
    };
    if !matches!(input.tensor.shape.as_slice(), [_] | [_, 1]) {
        return Err(ApiError::BadRequest(format!(
            "input '{name}': expected shape [n] or [n,1], got {}",
            shape_text(&input.tensor.shape)
        )));
    }
    let bad = |i: usize, what: &str| ApiError::BadRequest(format!("input '{name}': element {i} is not {what}"));
    match &*meta.pipeline {
        Pipeline::Text(_) => items
            .into_iter()
            .enumerate()
            .map(|(i, b)| String::from_utf8(b).map(Text::Single).map_err(|_| bad(i, "UTF-8 text")))
            .collect::<Result<_, _>>()
            .map(PipelineInput::Texts),
        _ if input.binary => Ok(PipelineInput::Images(items)),
        _ => items
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                base64::engine::general_purpose::STANDARD.decode(b.trim_ascii()).map_err(|_| bad(i, "base64"))
            })
            .collect::<Result<_, _>>()
            .map(PipelineInput::Images),
    }
}

/// The pipeline's result as v2 output tensors, named as [`pipeline_io`] lists them.
fn pipeline_tensors(rows: &Rows) -> Vec<Tensor> {
    match rows {
        Rows::Embeddings(rows) => {
            let dim = rows.first().map_or(0, Vec::len);
            vec![Tensor {
                name: "embedding".into(),
                shape: vec![rows.len() as i64, dim as i64],
                data: TensorData::F32(rows.concat()),
            }]
        }
        Rows::Tokens(rows) => {
            // Padded to the longest input (not asked for by any v2 route today).
            let width = rows.iter().map(Vec::len).max().unwrap_or(0);
            let dim = rows.iter().flatten().next().map_or(0, Vec::len);
            let mut data = vec![0f32; rows.len() * width * dim];
            for (r, tokens) in rows.iter().enumerate() {
                for (t, vector) in tokens.iter().enumerate() {
                    data[(r * width + t) * dim..][..dim].copy_from_slice(vector);
                }
            }
            vec![Tensor {
                name: "token_embeddings".into(),
                shape: vec![rows.len() as i64, width as i64, dim as i64],
                data: TensorData::F32(data),
            }]
        }
        // No v2 route runs a BGE-M3 model's three outputs (the pipeline refuses it there).
        Rows::BgeM3(_) => Vec::new(),
        Rows::Scores { labels, scores } => {
            let n = scores.len() as i64;
            let best: Vec<usize> = scores
                .iter()
                .map(|row| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i))
                .collect();
            vec![
                Tensor {
                    name: "label".into(),
                    shape: vec![n],
                    data: TensorData::Bytes(best.iter().map(|&i| labels[i].as_bytes().to_vec()).collect()),
                },
                Tensor {
                    name: "score".into(),
                    shape: vec![n],
                    data: TensorData::F32(best.iter().zip(scores).map(|(&i, row)| row[i]).collect()),
                },
                Tensor {
                    name: "probabilities".into(),
                    shape: vec![n, labels.len() as i64],
                    data: TensorData::F32(scores.concat()),
                },
            ]
        }
    }
}
