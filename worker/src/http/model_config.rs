//! Triton's model configuration extension: `GET /v2/models/{name}/config` answers the
//! configuration inferd resolved for a model in the JSON form of Triton's `ModelConfig`, so
//! clients that size their requests from it (tritonclient's image_client, Triton's aio tests)
//! work unchanged against inferd.
//!
//! What it says, from what inferd serves:
//! - `max_batch_size`: 0 for a model without a batch dimension (`ModelMeta::batch_rows`), its
//!   rows a run otherwise; for a pipelined model (text, images), the inputs a request may
//!   carry (`server.max_batch_inputs`);
//! - `input` / `output`: each tensor a client sends and gets, its Triton type and its `dims`
//!   without the batch dimension where there is one (a pipeline's one BYTES input per row is
//!   `dims: [1]` reshaped to `[]`, as Triton writes a scalar per row);
//! - `dynamic_batching` with the model's `max_queue_delay_ms`, where it batches;
//! - one CPU instance group, the platform `onnxruntime_onnx` and the backend `onnxruntime`.

use serde_json::{json, Value};

use crate::request::app::Model;
use crate::request::infer::pipeline_io;

/// Triton's `DataType` for a KServe v2 datatype (`BYTES` is `TYPE_STRING`).
fn triton_type(datatype: &str) -> String {
    match datatype {
        "BYTES" => "TYPE_STRING".into(),
        other => format!("TYPE_{other}"),
    }
}

/// `dims` of a tensor whose first dimension is the batch where `batched`.
fn dims(shape: &[i64], batched: bool) -> Vec<i64> {
    let skip = usize::from(batched && !shape.is_empty());
    shape[skip..].to_vec()
}

/// The model's configuration in Triton's JSON form; `max_batch_inputs` is
/// `server.max_batch_inputs` (a pipelined model's batch).
pub fn of(meta: &Model, max_batch_inputs: usize) -> Value {
    let batch = meta.batch_rows().ok();
    let (max_batch_size, input, output) = match pipeline_io(meta) {
        Some((name, outputs)) => {
            let input = vec![json!({
                "name": name, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1],
                "reshape": {"shape": []},
            })];
            let output: Vec<Value> = outputs
                .iter()
                .map(|(name, datatype, shape)| json!({"name": name, "data_type": triton_type(datatype), "dims": dims(shape, true)}))
                .collect();
            (max_batch_inputs, input, output)
        }
        None => {
            let batched = batch.is_some();
            let input: Vec<Value> = meta
                .inputs
                .iter()
                .map(|t| {
                    json!({"name": t.name, "data_type": triton_type(&t.datatype), "format": "FORMAT_NONE",
                           "dims": dims(&t.shape, batched)})
                })
                .collect();
            let output: Vec<Value> = meta
                .outputs
                .iter()
                .map(
                    |t| json!({"name": t.name, "data_type": triton_type(&t.datatype), "dims": dims(&t.shape, batched)}),
                )
                .collect();
            (batch.unwrap_or(0), input, output)
        }
    };
    let mut config = json!({
        "name": meta.info.name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": max_batch_size,
        "input": input,
        "output": output,
        "instance_group": [{"name": meta.info.name, "kind": "KIND_CPU", "count": 1}],
        "default_model_filename": "model.onnx",
        "parameters": {},
    });
    if batch.is_some() {
        let delay_us = meta.batching.max_queue_delay_ms.saturating_mul(1000);
        config["dynamic_batching"] = json!({"max_queue_delay_microseconds": delay_us});
    }
    config
}
