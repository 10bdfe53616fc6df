//! KServe v2's REST handlers: server and model metadata, and inference over JSON (and binary
//! tensors); its codec is [`crate::kserve::json`].

use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, StatusCode};
use serde_json::{json, Value};

use inferd_ipc::triton::{load_parameters, not_done};

use crate::http::body;
use crate::http::reply::{annotate, json_reply, Reply};
use crate::kserve::generate;
use crate::kserve::json as kserve;
use crate::kserve::Delivery;
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::{ApiError, OverLimit};
use crate::request::infer::{pipeline_io, run_v2};
use crate::request::model::Model;
use crate::runtime::tensor::{DataType, Tensor, TensorSpec};

/// The KServe v2 extensions (Triton's names) the main port serves, over REST and gRPC alike.
pub const EXTENSIONS: [&str; 8] = [
    "binary_tensor_data",
    "parameters",
    "classification",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "model_repository",
    "trace",
];

pub fn server_metadata(state: &AppState) -> Reply {
    let body = json!({
        "name": state.server_name,
        "version": inferd_ipc::version(),
        "extensions": EXTENSIONS,
        "models": state.models.loaded().iter().map(|m| m.info.name.clone()).collect::<Vec<_>>(),
        "loadable": state.models.loadable(),
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

/// Triton's statistics of every model the pool serves, or of one (of one version): the pool's
/// counters, as the supervisor sums them over its workers.
pub async fn statistics(state: &AppState, model: Option<&str>, version: Option<&str>) -> Result<Reply, ApiError> {
    let stats = state.supervisor.statistics(model, version).await?;
    Ok(json_reply(StatusCode::OK, serde_json::to_vec(&json!({ "model_stats": stats })).expect("json")))
}

/// What `POST /v2/repository/index` may ask: only the models ready now (Triton's `ready`).
#[derive(serde::Deserialize)]
struct IndexRequest {
    #[serde(default)]
    ready: bool,
}

/// Triton's repository index, from the supervisor, which reads the repository. An empty body
/// asks for every model.
pub async fn repository_index(state: &AppState, request: Request<Incoming>) -> Result<Reply, ApiError> {
    let body = receive(state, request, None, false).await?;
    let asked = match body.bytes.iter().all(u8::is_ascii_whitespace) {
        true => IndexRequest { ready: false },
        false => {
            let mut reader = serde_json::Deserializer::from_slice(&body.bytes);
            let invalid = |e: &dyn std::fmt::Display| {
                ApiError::BadRequest(format!("the repository index request is not valid: {e}"))
            };
            let asked = serde_path_to_error::deserialize::<_, IndexRequest>(&mut reader).map_err(|e| {
                // Triton's words for a `ready` that is no boolean (its L0_http test sends one
                // nested 250000 lists deep: refused at the first, nothing recursed).
                let ready =
                    e.path().iter().any(|s| matches!(s, serde_path_to_error::Segment::Map { key } if key == "ready"));
                match ready {
                    true => {
                        ApiError::BadRequest(format!("Invalid value for 'ready': expected a boolean ({})", e.inner()))
                    }
                    false => invalid(&e),
                }
            })?;
            reader.end().map_err(|e| invalid(&e))?;
            asked
        }
    };
    let index = state.supervisor.index(asked.ready).await?;
    Ok(json_reply(StatusCode::OK, serde_json::to_vec(&index).expect("json")))
}

/// Triton's repository `load` (`load` true) or `unload` of `name`, with
/// admin.model_control_on_main_port: the supervisor's rolling reload, answered once every
/// worker runs the new model list (this one drains meanwhile and answers before it leaves).
/// The body, `{"parameters": {...}}` or empty, is read as the admin listener reads it
/// ([`load_parameters`]).
pub async fn repository_change(
    state: &AppState,
    name: &str,
    load: bool,
    request: Request<Incoming>,
) -> Result<Reply, ApiError> {
    let body = receive(state, request, None, false).await?;
    let body: Value = match body.bytes.iter().all(u8::is_ascii_whitespace) {
        true => json!({}),
        false => serde_json::from_slice(&body.bytes)
            .map_err(|e| ApiError::BadRequest(format!("the request body is not JSON: {e}")))?,
    };
    if !body.is_object() {
        return Err(ApiError::BadRequest("the request body must be a JSON object".into()));
    }
    let asked =
        load_parameters(body.get("parameters"), load).map_err(|e| ApiError::BadRequest(not_done(name, load, e)))?;
    let message = state.supervisor.change_repository(name, load, asked).await?;
    Ok(json_reply(StatusCode::OK, serde_json::to_vec(&json!({ "message": message })).expect("json")))
}

/// A model this worker loads on the first request for it, not loaded yet: its metadata says
/// so (what it takes and gives is known once it is loaded), and `/ready` with `ready` says
/// whether a request for it would be served (after its load).
pub fn not_loaded(name: &str, ready: Option<bool>) -> Reply {
    let body = match ready {
        None => json!({"name": name, "versions": [], "platform": "onnxruntime_onnx", "loaded": false}),
        Some(ready) => json!({"ready": ready, "loaded": false}),
    };
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

pub fn model_metadata(meta: &Model) -> Reply {
    let pipeline = pipeline_io(meta).map(|(input, outputs)| {
        let outputs: Vec<Value> = outputs
            .iter()
            .map(|(name, datatype, shape)| json!({"name": name, "datatype": datatype, "shape": shape}))
            .collect();
        json!({
            "task": meta.task,
            "inputs": [{"name": input, "datatype": "BYTES", "shape": [-1]}],
            "outputs": outputs,
        })
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&kserve::ModelMetadata::of(meta, pipeline)).expect("json"))
}

/// `POST /v2/models/{model}/infer`: JSON, or JSON and binary tensors
/// (`Inference-Header-Content-Length`), or only one input's binary data (that header 0).
pub async fn infer(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    request: Request<Incoming>,
) -> Result<Reply, ApiError> {
    let header_length = match request.headers().get(kserve::HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| ApiError::BadRequest("Inference-Header-Content-Length must be a byte count".into()))?,
        ),
    };
    let body = receive(state, request, call.terms.deadline, header_length == Some(0)).await?;
    let parsed = match header_length {
        Some(0) => crate::kserve::raw::parse(&body, meta),
        _ => {
            let shared = state.shared_memory_reader();
            kserve::parse(&body, header_length, &shared)
        }
    }
    .map_err(ApiError::BadRequest)?;
    let inferred = run_v2(state, call, index, meta, parsed).await?;
    let mut reply = infer_reply(meta, inferred.id, inferred.outputs, &inferred.selection);
    if let Some(outcome) = &inferred.outcome {
        annotate(&mut reply, outcome);
    }
    Ok(reply)
}

/// Triton's generate extension, `POST /v2/models/{model}/generate` (one JSON answer) and
/// `/generate_stream` (that answer as a server-sent event): its codec is
/// [`crate::kserve::generate`]. The members may name the model's own inputs or, for a model with
/// a pipeline, its input (`text`, `image`). A model answers once, so the stream holds one event;
/// an error, before or during the run, is a JSON error with its status, as Triton answers one
/// that comes before the first event.
pub async fn generate(
    state: &AppState,
    call: &Call,
    index: usize,
    meta: &Model,
    request: Request<Incoming>,
    stream: bool,
) -> Result<Reply, ApiError> {
    let body = receive(state, request, call.terms.deadline, false).await?;
    let pipeline = pipeline_io(meta).map(|(name, _)| TensorSpec {
        name: name.to_string(),
        datatype: "BYTES".into(),
        shape: vec![-1],
        dtype: Some(DataType::Bytes),
        first_dim: String::new(),
        optional: false,
    });
    let inputs: Vec<TensorSpec> = pipeline.into_iter().chain(meta.inputs.iter().cloned()).collect();
    let limit = usize::try_from(state.max_body_bytes).unwrap_or(usize::MAX);
    let parsed = generate::parse(&body.bytes, &inputs, limit).map_err(ApiError::BadRequest)?;
    let inferred = run_v2(state, call, index, meta, parsed).await?;
    let answer = generate::response(&meta.info.name, &meta.info.version, inferred.id, inferred.outputs);
    let mut reply = match stream {
        false => json_reply(StatusCode::OK, answer),
        true => {
            let event = [&b"data: "[..], &answer, b"\n\n"].concat();
            let mut reply = json_reply(StatusCode::OK, event);
            reply.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
            reply
        }
    };
    if let Some(outcome) = &inferred.outcome {
        annotate(&mut reply, outcome);
    }
    Ok(reply)
}

/// A KServe route's body ([`body::receive`]), one past `server.max_body_bytes` refused in
/// Triton's words and status ([`over_limit`]); `raw`: a raw binary infer request's.
async fn receive(
    state: &AppState,
    request: Request<Incoming>,
    deadline: Option<std::time::Instant>,
    raw: bool,
) -> Result<body::Body, ApiError> {
    body::receive(state, request, deadline).await.map_err(|e| match e {
        ApiError::BodyTooLarge(over) => ApiError::BadRequest(over_limit(&over, raw)),
        e => e,
    })
}

/// A body past `server.max_body_bytes` in Triton's words and status (400), which its HTTP QA
/// tests match (on each route that reads JSON: infer, generate, the repository's index, load
/// and unload): its `--http-max-input-size` is inferd's `--max-body-bytes`.
fn over_limit(over: &OverLimit, raw: bool) -> String {
    let limit = over.limit;
    let size = match over.declared {
        Some(n) => format!("{n} bytes"),
        None => format!("more than {limit} bytes"),
    };
    let what = match (over.inflated, raw) {
        (true, _) => format!("Decompressed data size exceeds the maximum allowed value of {limit} bytes."),
        (false, true) => {
            format!("Raw input has a byte_size ({size}) that exceeds the maximum allowed value of {limit} bytes.")
        }
        (false, false) => {
            format!("request JSON size of {size} exceeds the maximum allowed input size of {limit} bytes.")
        }
    };
    format!("{what} Use --http-max-input-size to increase the limit. It is server.max_body_bytes in inferd.toml.")
}

fn infer_reply(meta: &Model, id: Option<String>, outputs: Vec<Tensor>, selection: &[(usize, Delivery)]) -> Reply {
    let (body, header_length) = kserve::infer_response(meta, id, outputs, selection);
    let mut reply = json_reply(StatusCode::OK, body);
    if let Some(n) = header_length {
        let headers = reply.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        headers.insert(kserve::HEADER_LENGTH, HeaderValue::from(n));
    }
    reply
}
