//! HTTP routing for one worker: the KServe v2 REST endpoints and the one mapping from errors to
//! status codes ([`ApiError::status`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use crate::engine::Engine;
use crate::model::{ModelError, ModelMeta};
use crate::protocol;

/// Everything a request handler may touch.
pub struct AppState {
    pub worker: usize,
    pub models: Vec<ModelMeta>,
    pub engine: Engine,
    pub max_body_bytes: u64,
    /// False until warm-up is done and again once draining starts; `/v2/health/ready` follows it.
    pub ready: AtomicBool,
    /// Inference requests answered, whatever their status.
    pub requests: AtomicU64,
    pub in_flight: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("request body is larger than the limit of {0} bytes (server.max_body_bytes)")]
    TooLarge(u64),
    #[error("method {0} is not allowed on {1}")]
    MethodNotAllowed(Method, String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// The only place an error becomes a status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed(..) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::InvalidInput { .. } => ApiError::BadRequest(e.to_string()),
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

type Reply = Response<Full<Bytes>>;

fn json_reply(status: StatusCode, body: Vec<u8>) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_reply(e: &ApiError) -> Reply {
    json_reply(e.status(), serde_json::to_vec(&json!({ "error": e.to_string() })).expect("json"))
}

pub async fn handle(state: Arc<AppState>, request: Request<Incoming>) -> Result<Reply, Infallible> {
    let mut reply = route(&state, request).await.unwrap_or_else(|e| error_reply(&e));
    reply.headers_mut().insert("x-inferd-worker", HeaderValue::from(state.worker));
    Ok(reply)
}

/// The endpoints; `/versions/{v}` is accepted wherever the protocol allows it.
enum Route<'a> {
    Server,
    Live,
    Ready,
    Model(&'a str, Option<&'a str>),
    ModelReady(&'a str, Option<&'a str>),
    Infer(&'a str, Option<&'a str>),
}

fn parse_route<'a>(segments: &[&'a str]) -> Option<Route<'a>> {
    Some(match *segments {
        ["v2"] => Route::Server,
        ["v2", "health", "live"] => Route::Live,
        ["v2", "health", "ready"] => Route::Ready,
        ["v2", "models", name] => Route::Model(name, None),
        ["v2", "models", name, "versions", v] => Route::Model(name, Some(v)),
        ["v2", "models", name, "ready"] => Route::ModelReady(name, None),
        ["v2", "models", name, "versions", v, "ready"] => Route::ModelReady(name, Some(v)),
        ["v2", "models", name, "infer"] => Route::Infer(name, None),
        ["v2", "models", name, "versions", v, "infer"] => Route::Infer(name, Some(v)),
        _ => return None,
    })
}

async fn route(state: &AppState, request: Request<Incoming>) -> Result<Reply, ApiError> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = parse_route(&segments).ok_or_else(|| ApiError::NotFound(format!("no route for {method} {path}")))?;
    let allowed = match route {
        Route::Infer(..) => method == Method::POST,
        _ => method == Method::GET || method == Method::HEAD,
    };
    if !allowed {
        return Err(ApiError::MethodNotAllowed(method, path.clone()));
    }
    let ready = state.ready.load(Ordering::Relaxed);
    match route {
        Route::Server => Ok(server_metadata(state)),
        Route::Live => Ok(json_reply(StatusCode::OK, b"{\"live\":true}".to_vec())),
        Route::Ready => Ok(readiness(ready)),
        Route::Model(name, version) => model(state, name, version).map(model_metadata),
        Route::ModelReady(name, version) => model(state, name, version).map(|_| readiness(ready)),
        Route::Infer(name, version) => infer(state, name, version, request).await,
    }
}

fn readiness(ready: bool) -> Reply {
    if ready {
        json_reply(StatusCode::OK, b"{\"ready\":true}".to_vec())
    } else {
        json_reply(StatusCode::SERVICE_UNAVAILABLE, b"{\"ready\":false}".to_vec())
    }
}

fn server_metadata(state: &AppState) -> Reply {
    let body = json!({
        "name": "inferd",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": [],
        "models": state.models.iter().map(|m| &m.info.name).collect::<Vec<_>>(),
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

fn model_metadata(meta: (usize, &ModelMeta)) -> Reply {
    json_reply(StatusCode::OK, serde_json::to_vec(&protocol::ModelMetadata::of(meta.1)).expect("json"))
}

/// Finds a model by name (and version, when the path names one).
fn model<'a>(state: &'a AppState, name: &str, version: Option<&str>) -> Result<(usize, &'a ModelMeta), ApiError> {
    let (index, meta) = state.models.iter().enumerate().find(|(_, m)| m.info.name == name).ok_or_else(|| {
        let known: Vec<&str> = state.models.iter().map(|m| m.info.name.as_str()).collect();
        ApiError::NotFound(format!("unknown model '{name}'; this server has {}", known.join(", ")))
    })?;
    match version {
        Some(v) if v != meta.info.version => Err(ApiError::NotFound(format!(
            "model '{name}' has no version '{v}'; it serves version '{}'",
            meta.info.version
        ))),
        _ => Ok((index, meta)),
    }
}

async fn infer(
    state: &AppState,
    name: &str,
    version: Option<&str>,
    request: Request<Incoming>,
) -> Result<Reply, ApiError> {
    state.in_flight.fetch_add(1, Ordering::Relaxed);
    let result = infer_inner(state, name, version, request).await;
    state.in_flight.fetch_sub(1, Ordering::Relaxed);
    state.requests.fetch_add(1, Ordering::Relaxed);
    result
}

async fn infer_inner(
    state: &AppState,
    name: &str,
    version: Option<&str>,
    request: Request<Incoming>,
) -> Result<Reply, ApiError> {
    let (index, meta) = model(state, name, version)?;
    if request.headers().contains_key("inference-header-content-length") {
        return Err(ApiError::BadRequest(
            "binary tensor data (Inference-Header-Content-Length) is not supported yet; send JSON tensors".into(),
        ));
    }
    let limit = state.max_body_bytes;
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(ApiError::TooLarge(limit));
    }
    let body = Limited::new(request.into_body(), limit as usize)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                ApiError::TooLarge(limit)
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes();
    let valid = protocol::parse_infer(&body, meta).map_err(ApiError::BadRequest)?;
    let outputs = state.engine.infer(index, valid.inputs).await?;
    Ok(json_reply(StatusCode::OK, protocol::infer_response(meta, valid.id, &valid.outputs, outputs)))
}
