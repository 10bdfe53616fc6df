//! Triton's model configuration extension: `GET /v2/models/{name}/config` and gRPC's
//! `ModelConfig` answer the configuration inferd resolved for a model in the shape of Triton's
//! `ModelConfig` (its JSON form over HTTP, its message over gRPC), so clients that size their
//! requests from it (tritonclient's image_client, Triton's aio tests) work unchanged.
//!
//! What it says, from what inferd serves ([`Config::of`]):
//! - `max_batch_size`: 0 for a model without a batch dimension (`ModelMeta::batch_rows`), its
//!   rows a run otherwise; for a text model, the inputs a request may carry
//!   (`server.max_batch_inputs`);
//! - `input` / `output`: each tensor a client sends and gets, its Triton type and its `dims`
//!   without the batch dimension where there is one (a text model's one BYTES input per row
//!   is `dims: [1]` reshaped to `[]`, as Triton writes a scalar per row);
//! - an image model's (`[image]`) `input` is its own pixel tensor, its `format` the image's
//!   layout (`FORMAT_NCHW`, `FORMAT_NHWC`), as Triton's image clients (image_client.py) expect:
//!   they make the tensor themselves; the model takes encoded images beside it;
//! - `dynamic_batching` with the model's `max_queue_delay_ms`, where it batches;
//! - one CPU instance group, the platform `onnxruntime_onnx` and the backend `onnxruntime`.

use serde_json::{json, Value};

use inferd_config::model::Layout;

use crate::pipeline::Pipeline;
use crate::request::infer::pipeline_io;
use crate::request::model::Model;

/// A tensor as the configuration lists it.
pub struct TensorConfig {
    pub name: String,
    /// KServe v2's datatype (`FP32`, `BYTES`, ...).
    pub datatype: String,
    pub dims: Vec<i64>,
    /// The shape the model sees where it differs from `dims` (a pipeline's scalar per row).
    pub reshape: Option<Vec<i64>>,
    /// An image input's layout (Triton's `format`); None: `FORMAT_NONE`.
    pub format: Option<Layout>,
    /// An input a request may leave out (Triton's `optional`).
    pub optional: bool,
}

impl TensorConfig {
    /// Triton's `DataType` name for its datatype (`BYTES` is `TYPE_STRING`).
    pub fn triton_type(&self) -> String {
        match self.datatype.as_str() {
            "BYTES" => "TYPE_STRING".to_string(),
            other => format!("TYPE_{other}"),
        }
    }
}

/// The configuration of one model, whatever carries it.
pub struct Config {
    pub name: String,
    pub max_batch_size: usize,
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
    /// `max_queue_delay_ms` in microseconds, where the model batches.
    pub batching_delay_us: Option<u64>,
}

/// Triton's name of an input's format.
pub fn format_name(layout: Option<Layout>) -> &'static str {
    match layout {
        None => "FORMAT_NONE",
        Some(Layout::Nchw) => "FORMAT_NCHW",
        Some(Layout::Nhwc) => "FORMAT_NHWC",
    }
}

/// `dims` of a tensor whose first dimension is the batch where `batched`.
fn dims(shape: &[i64], batched: bool) -> Vec<i64> {
    let skip = usize::from(batched && !shape.is_empty());
    shape[skip..].to_vec()
}

impl Config {
    /// `meta`'s configuration; `max_batch_inputs` is `server.max_batch_inputs` (a pipelined
    /// model's batch).
    pub fn of(meta: &Model, max_batch_inputs: usize) -> Config {
        let batch = meta.batch_rows().ok();
        let tensor = |name: &str, datatype: &str, shape: &[i64], batched: bool| TensorConfig {
            name: name.to_string(),
            datatype: datatype.to_string(),
            dims: dims(shape, batched),
            reshape: None,
            format: None,
            optional: false,
        };
        let raw = |format: Option<Layout>| {
            let batched = batch.is_some();
            let of = |specs: &[crate::runtime::tensor::TensorSpec], format: Option<Layout>| {
                let each = |t: &crate::runtime::tensor::TensorSpec| TensorConfig {
                    format,
                    optional: t.optional,
                    ..tensor(&t.name, &t.datatype, &t.shape, batched)
                };
                specs.iter().map(each).collect()
            };
            (batch.unwrap_or(0), of(&meta.inputs, format), of(&meta.outputs, None))
        };
        let (max_batch_size, inputs, outputs) = match (&*meta.pipeline, pipeline_io(meta)) {
            // Triton's image clients send the pixel tensor they made themselves (image_client.py
            // reads its layout from `format`); inferd takes it beside encoded images.
            (Pipeline::Image(image), _) => raw(Some(image.config.layout)),
            (_, Some((name, outputs))) => {
                let input = TensorConfig {
                    name: name.to_string(),
                    datatype: "BYTES".into(),
                    dims: vec![1],
                    reshape: Some(Vec::new()),
                    format: None,
                    optional: false,
                };
                let outputs =
                    outputs.iter().map(|(name, datatype, shape)| tensor(name, datatype, shape, true)).collect();
                (max_batch_inputs, vec![input], outputs)
            }
            (_, None) => raw(None),
        };
        Config {
            name: meta.info.name.clone(),
            max_batch_size,
            inputs,
            outputs,
            batching_delay_us: batch.map(|_| meta.batching.max_queue_delay_ms.saturating_mul(1000)),
        }
    }

    /// Triton's JSON form (`GET /v2/models/{name}/config`).
    pub fn to_json(&self) -> Value {
        let tensor = |t: &TensorConfig, input: bool| {
            let mut v = json!({"name": t.name, "data_type": t.triton_type(), "dims": t.dims});
            if input {
                v["format"] = json!(format_name(t.format));
                v["optional"] = json!(t.optional);
            }
            if let Some(shape) = &t.reshape {
                v["reshape"] = json!({"shape": shape});
            }
            v
        };
        let mut config = json!({
            "name": self.name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": self.max_batch_size,
            "input": self.inputs.iter().map(|t| tensor(t, true)).collect::<Vec<_>>(),
            "output": self.outputs.iter().map(|t| tensor(t, false)).collect::<Vec<_>>(),
            "instance_group": [{"name": self.name, "kind": "KIND_CPU", "count": 1}],
            "default_model_filename": "model.onnx",
            "parameters": {},
        });
        if let Some(delay) = self.batching_delay_us {
            config["dynamic_batching"] = json!({"max_queue_delay_microseconds": delay});
        }
        config
    }
}
