//! HTTP routing for one worker: KServe v2 REST, text-embeddings-inference's and OpenAI's routes
//! (handled in `tei` and `openai`), and each protocol's error bodies.

pub mod body;
pub mod cohere;
pub mod encoding;
pub mod forward;
pub mod grpc;
pub mod handoff;
pub mod kserve;
pub mod model_config;
pub mod openai;
pub mod reply;
pub mod tei;
pub mod write_timeout;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use opentelemetry::KeyValue;
use serde_json::{json, Value};
use tracing::{debug, info, warn};

use inferd_config::model::Task;
use inferd_ipc::stats::Endpoint;

use crate::http::reply::{annotate, json_reply, Reply};
use crate::request::app::{counted, found_index, ApiError, AppState, Model};
use crate::request::infer::{pipeline_io, run_v2};
use crate::request::models::LOAD_WAIT;
use crate::runtime::engine::PRIORITY;
use crate::runtime::tensor::Tensor;

fn error_reply(e: &ApiError, style: ErrorStyle) -> Reply {
    let body = match style {
        ErrorStyle::V2 => json!({ "error": e.to_string() }),
        ErrorStyle::Tei => tei::error_body(e),
        ErrorStyle::OpenAi => openai::error_body(e),
        ErrorStyle::Cohere => cohere::error_body(e),
    };
    let mut reply = json_reply(e.status(), serde_json::to_vec(&body).expect("json"));
    if matches!(e, ApiError::Overloaded(_)) {
        reply.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if matches!(e, ApiError::Unauthorized(_)) {
        reply.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if let ApiError::TooManyRequests(_, headers) = e {
        headers.apply(reply.headers_mut());
    }
    reply
}

pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Every request: routed, answered, its id echoed, its failure logged with that id, and its
/// access line written (log.access_log).
pub async fn handle(
    state: Arc<AppState>,
    peer: SocketAddr,
    mut request: Request<Incoming>,
) -> Result<Reply, Infallible> {
    let started = Instant::now();
    let id = state.request_ids.for_request(request.headers().get(REQUEST_ID_HEADER));
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    // A request this worker may forward carries its id to the sibling that serves it.
    if state.models.placed() {
        request.headers_mut().insert(REQUEST_ID_HEADER, id.clone());
    }
    // A body left unread (an error answered before it was read, or a failed read) means hyper
    // closes the connection after the answer: the answer must say so, or a keep-alive client
    // sends its next request into a closing socket.
    let body_read = match hyper::body::Body::is_end_stream(request.body()) {
        true => None,
        false => {
            let flag = BodyRead::default();
            request.extensions_mut().insert(flag.clone());
            Some(flag)
        }
    };
    // Its server span, when the worker traces: the client's trace continued.
    let traced = match crate::trace::enabled() {
        true => server_span(&request, &method, &path, peer, &id),
        false => None,
    };
    // A bug that panics in a handler costs this request (500), not the worker (panics.rs).
    // How long it waited for its model to load on demand, if it did (models.rs).
    // `Cache-Control: no-cache`: answered without the cache of answers ([cache]).
    let bypass = crate::request::cache::no_cache(request.headers().get(hyper::header::CACHE_CONTROL));
    // The name of the API key it came with, for its access line (route sets it).
    let work = LOAD_WAIT.scope(Default::default(), async {
        let routed = crate::panics::guarded_future(route(&state, peer, request, &id));
        let routed = KEY_NAME.scope(Default::default(), async {
            (crate::request::cache::BYPASS.scope(bypass, routed).await, KEY_NAME.with(std::cell::RefCell::take))
        });
        let (routed, key) = routed.await;
        (routed, LOAD_WAIT.with(std::cell::Cell::get), key)
    });
    let (routed, loading, key) = crate::trace::in_request(traced.clone(), work).await;
    let routed = routed.unwrap_or_else(|_| {
        Err(ApiError::Internal("internal error: the server hit a bug serving this request (logged)".into()))
    });
    // A traced request's ids, in its log lines (recorded only when it is traced).
    let (trace_id, span_id) = match &traced {
        Some(cx) => {
            use opentelemetry::trace::TraceContextExt;
            let span = cx.span();
            let ids = span.span_context();
            (Some(ids.trace_id().to_string()), Some(ids.span_id().to_string()))
        }
        None => (None, None),
    };
    let (trace_id, span_id) = (trace_id.as_deref(), span_id.as_deref());
    let mut refused = "";
    let mut reply = match routed {
        Ok(reply) => reply,
        Err(e) => {
            if let ApiError::Unauthorized(refusal) = &e {
                refused = refusal.as_str();
            }
            let request_id = id.to_str().unwrap_or_default();
            if e.status().is_server_error() {
                let status = e.status().as_u16();
                warn!(request_id, trace_id, span_id, method = %method, path, status, "request failed: {e}");
            } else {
                let status = e.status().as_u16();
                debug!(request_id, trace_id, span_id, method = %method, path, status, "request refused: {e}");
            }
            let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
            error_reply(&e, parse_route(&segments).map_or(ErrorStyle::V2, |r| r.error_style()))
        }
    };
    if state.access_log {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let default = state.models.default_model();
        let model = match parse_route(&segments).and_then(|r| r.model()) {
            Some(Some(name)) => name,
            Some(None) => &default.info.name,
            None => "",
        };
        info!(
            target: "inferd::access",
            client = %peer,
            method = %method,
            path,
            status = reply.status().as_u16(),
            bytes = hyper::body::Body::size_hint(reply.body()).exact().unwrap_or(0),
            duration_ms = (started.elapsed().as_secs_f64() * 1e4).round() / 10.0,
            model,
            worker = state.worker,
            request_id = id.to_str().unwrap_or_default(),
            trace_id,
            span_id,
            key = key.as_deref().unwrap_or_default(),
            auth_refused = refused,
            "{method} {path} {}",
            reply.status().as_u16()
        );
    }
    let headers = reply.headers_mut();
    if let Some(waited) = loading {
        // Server-Timing's `load`: this request waited that long for its model to load.
        let load = format!("load;dur={:.3}", waited.as_secs_f64() * 1e3);
        let timing = match headers.get("server-timing").and_then(|v| v.to_str().ok()) {
            Some(timing) => format!("{timing}, {load}"),
            None => load,
        };
        if let Ok(v) = HeaderValue::from_str(&timing) {
            headers.insert("server-timing", v);
        }
    }
    // A forwarded request's answer names the sibling that served it.
    if !headers.contains_key("x-inferd-worker") {
        headers.insert("x-inferd-worker", HeaderValue::from(state.worker));
        // And the inferd version that served it (an upgrade's progress shows in the answers).
        if let Ok(version) = HeaderValue::from_str(inferd_ipc::version()) {
            headers.insert("x-inferd-version", version);
        }
    }
    headers.insert(REQUEST_ID_HEADER, id);
    if body_read.is_some_and(|read| !read.0.load(Ordering::Relaxed)) {
        headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    if let Some(cx) = &traced {
        let status = reply.status();
        let mut attributes = vec![
            KeyValue::new("http.response.status_code", i64::from(status.as_u16())),
            KeyValue::new(
                "http.response.body.size",
                hyper::body::Body::size_hint(reply.body()).exact().unwrap_or(0) as i64,
            ),
        ];
        if let Some(version) = reply.headers().get("x-inferd-model-version").and_then(|v| v.to_str().ok()) {
            attributes.push(KeyValue::new("inferd.model.version", version.to_string()));
        }
        let error = status.is_server_error().then(|| {
            attributes.push(KeyValue::new("error.type", status.as_u16().to_string()));
            status.to_string()
        });
        inferd_telemetry::end_span(cx, attributes, error);
    }
    Ok(reply)
}

/// A request's server span, named by HTTP's conventions (`POST /v2/models/{model}/infer`),
/// with what is known before it is routed.
fn server_span(
    request: &Request<Incoming>,
    method: &Method,
    path: &str,
    peer: SocketAddr,
    id: &HeaderValue,
) -> Option<opentelemetry::Context> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let parsed = parse_route(&segments);
    let template = parsed.as_ref().map(Route::template);
    let name = match template {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    let header = |name| request.headers().get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let mut attributes = vec![
        KeyValue::new("http.request.method", method.to_string()),
        KeyValue::new("url.path", path.to_string()),
        KeyValue::new("network.protocol.version", "1.1"),
        KeyValue::new("client.address", peer.ip().to_string()),
        KeyValue::new("client.port", i64::from(peer.port())),
        KeyValue::new("inferd.request_id", id.to_str().unwrap_or_default().to_string()),
    ];
    if let Some(route) = template {
        attributes.push(KeyValue::new("http.route", route));
    }
    if let Some(Some(model)) = parsed.as_ref().and_then(Route::model) {
        attributes.push(KeyValue::new("inferd.model", model.to_string()));
    }
    if let Some(agent) = header(hyper::header::USER_AGENT) {
        attributes.push(KeyValue::new("user_agent.original", agent.to_string()));
    }
    if let Some(size) = header(CONTENT_LENGTH).and_then(|v| v.parse::<i64>().ok()) {
        attributes.push(KeyValue::new("http.request.body.size", size));
    }
    crate::trace::server_span(request.headers(), name, attributes)
}

/// Set once a request's body has been read whole (see [`handle`]).
#[derive(Clone, Default)]
struct BodyRead(Arc<AtomicBool>);

/// The endpoints; `/versions/{v}` is accepted wherever the protocol allows it, and a missing
/// model name means the default model.
enum Route<'a> {
    Server,
    Live,
    Ready,
    Model(&'a str, Option<&'a str>),
    ModelReady(&'a str, Option<&'a str>),
    /// Triton's model configuration extension ([`model_config`]).
    ModelConfig(&'a str, Option<&'a str>),
    Infer(&'a str, Option<&'a str>),
    Embed(Option<&'a str>),
    Predict(Option<&'a str>),
    /// OpenAI's `POST /v1/embeddings`; the model is named in the body.
    OpenAiEmbeddings,
    /// text-embeddings-inference's routes for the default model.
    Info,
    Tokenize,
    Decode,
    Similarity,
    EmbedAll,
    EmbedSparse(Option<&'a str>),
    Rerank(Option<&'a str>),
    /// Cohere's `POST /v1/rerank` and `/v2/rerank`; the model is named in the body.
    CohereRerank(cohere::Version),
    /// `POST /` and SageMaker's `POST /invocations`: `/embed` or `/predict` by the default
    /// model's task.
    Invocations,
    /// SageMaker's health check.
    Ping,
}

/// The shape of an error body: KServe v2's `{"error"}`, text-embeddings-inference's (with
/// `error_type`), OpenAI's or Cohere's.
#[derive(Clone, Copy)]
enum ErrorStyle {
    V2,
    Tei,
    OpenAi,
    Cohere,
}

impl<'a> Route<'a> {
    /// The model the route is for: `Some(Some(name))` named in the path, `Some(None)` the
    /// default model unless the path names one (TEI's routes), None for the other routes
    /// (OpenAI's names its model in the body).
    fn model(&self) -> Option<Option<&'a str>> {
        match *self {
            Route::Model(m, _) | Route::ModelReady(m, _) | Route::ModelConfig(m, _) | Route::Infer(m, _) => {
                Some(Some(m))
            }
            Route::Embed(m) | Route::Predict(m) | Route::Rerank(m) | Route::EmbedSparse(m) => Some(m),
            Route::Similarity | Route::EmbedAll | Route::Info | Route::Tokenize | Route::Decode => Some(None),
            _ => None,
        }
    }

    /// The route as OpenTelemetry's `http.route` names it: the path's template.
    fn template(&self) -> &'static str {
        match self {
            Route::Server => "/v2",
            Route::Live => "/v2/health/live",
            Route::Ready => "/v2/health/ready",
            Route::Model(_, None) => "/v2/models/{model}",
            Route::Model(_, Some(_)) => "/v2/models/{model}/versions/{version}",
            Route::ModelReady(_, None) => "/v2/models/{model}/ready",
            Route::ModelReady(_, Some(_)) => "/v2/models/{model}/versions/{version}/ready",
            Route::ModelConfig(_, None) => "/v2/models/{model}/config",
            Route::ModelConfig(_, Some(_)) => "/v2/models/{model}/versions/{version}/config",
            Route::Infer(_, None) => "/v2/models/{model}/infer",
            Route::Infer(_, Some(_)) => "/v2/models/{model}/versions/{version}/infer",
            Route::Embed(None) => "/embed",
            Route::Embed(Some(_)) => "/v2/models/{model}/embed",
            Route::Predict(None) => "/predict",
            Route::Predict(Some(_)) => "/v2/models/{model}/predict",
            Route::OpenAiEmbeddings => "/v1/embeddings",
            Route::Info => "/info",
            Route::Tokenize => "/tokenize",
            Route::Decode => "/decode",
            Route::Similarity => "/similarity",
            Route::EmbedAll => "/embed_all",
            Route::EmbedSparse(None) => "/embed_sparse",
            Route::EmbedSparse(Some(_)) => "/v2/models/{model}/embed_sparse",
            Route::Rerank(None) => "/rerank",
            Route::Rerank(Some(_)) => "/v2/models/{model}/rerank",
            Route::CohereRerank(cohere::Version::V1) => "/v1/rerank",
            Route::CohereRerank(cohere::Version::V2) => "/v2/rerank",
            Route::Invocations => "/invocations",
            Route::Ping => "/ping",
        }
    }

    fn error_style(&self) -> ErrorStyle {
        match self {
            Route::OpenAiEmbeddings => ErrorStyle::OpenAi,
            Route::CohereRerank(_) => ErrorStyle::Cohere,
            Route::Embed(_)
            | Route::Predict(_)
            | Route::Info
            | Route::Tokenize
            | Route::Decode
            | Route::Similarity
            | Route::EmbedAll
            | Route::EmbedSparse(_)
            | Route::Rerank(_)
            | Route::Invocations
            | Route::Ping => ErrorStyle::Tei,
            _ => ErrorStyle::V2,
        }
    }
}

fn parse_route<'a>(segments: &[&'a str]) -> Option<Route<'a>> {
    Some(match *segments {
        ["v2"] => Route::Server,
        ["v2", "health", "live"] | ["health"] => Route::Live,
        ["v2", "health", "ready"] => Route::Ready,
        ["v2", "models", name] => Route::Model(name, None),
        ["v2", "models", name, "versions", v] => Route::Model(name, Some(v)),
        ["v2", "models", name, "ready"] => Route::ModelReady(name, None),
        ["v2", "models", name, "versions", v, "ready"] => Route::ModelReady(name, Some(v)),
        ["v2", "models", name, "config"] => Route::ModelConfig(name, None),
        ["v2", "models", name, "versions", v, "config"] => Route::ModelConfig(name, Some(v)),
        ["v2", "models", name, "infer"] => Route::Infer(name, None),
        ["v2", "models", name, "versions", v, "infer"] => Route::Infer(name, Some(v)),
        ["embed"] => Route::Embed(None),
        ["v2", "models", name, "embed"] => Route::Embed(Some(name)),
        ["predict"] => Route::Predict(None),
        ["v2", "models", name, "predict"] => Route::Predict(Some(name)),
        ["v1", "embeddings"] | ["embeddings"] => Route::OpenAiEmbeddings,
        ["info"] => Route::Info,
        ["tokenize"] => Route::Tokenize,
        ["decode"] => Route::Decode,
        ["similarity"] => Route::Similarity,
        ["embed_all"] => Route::EmbedAll,
        ["embed_sparse"] => Route::EmbedSparse(None),
        ["v2", "models", name, "embed_sparse"] => Route::EmbedSparse(Some(name)),
        ["rerank"] => Route::Rerank(None),
        ["v1", "rerank"] => Route::CohereRerank(cohere::Version::V1),
        ["v2", "rerank"] => Route::CohereRerank(cohere::Version::V2),
        ["v2", "models", name, "rerank"] => Route::Rerank(Some(name)),
        ["invocations"] | [""] => Route::Invocations,
        ["ping"] => Route::Ping,
        _ => return None,
    })
}

/// Header with the request's priority: 0 (the default) the highest, up to 255 ([`PRIORITY`]).
pub const PRIORITY_HEADER: &str = "x-inferd-priority";

tokio::task_local! {
    /// The name of the API key the request came with ([auth]; its access line says it).
    static KEY_NAME: std::cell::RefCell<Option<String>>;
    /// The highest priority the request's key allows (0 without keys).
    static KEY_FLOOR: u8;
}

/// The request, its API key checked, served at its priority ([`PRIORITY_HEADER`], no higher
/// than its key's).
async fn route(
    state: &AppState,
    peer: SocketAddr,
    request: Request<Incoming>,
    id: &HeaderValue,
) -> Result<Reply, ApiError> {
    let segments: Vec<&str> = request.uri().path().trim_matches('/').split('/').collect();
    let health =
        matches!(parse_route(&segments), Some(Route::Live | Route::Ready | Route::ModelReady(..) | Route::Ping));
    let authorization = request.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
    let key = state.authorize(authorization, health)?;
    if let Some(key) = key {
        let _ = KEY_NAME.try_with(|k| *k.borrow_mut() = Some(key.name.clone()));
        crate::trace::attribute(KeyValue::new("inferd.api_key.name", key.name.clone()));
    }
    let asked = match request.headers().get(PRIORITY_HEADER) {
        None => 0,
        Some(v) => v.to_str().ok().and_then(|v| v.trim().parse::<u8>().ok()).ok_or_else(|| {
            ApiError::BadRequest(format!("{PRIORITY_HEADER} must be a whole number from 0 (the highest) to 255"))
        })?,
    };
    let floor = key.map_or(0, |k| k.priority);
    let priority = asked.max(floor);
    // Probes are neither limited nor counted by key, nor is a request a sibling forwarded
    // (it admitted the request, and holds its place until the answer is relayed).
    let admission = match health || request.extensions().get::<forward::Forwarded>().is_some() {
        true => None,
        false => Some(state.admit(key, priority)?),
    };
    let mut reply = KEY_FLOOR.scope(floor, PRIORITY.scope(priority, routed(state, peer, request, id))).await?;
    if let Some(headers) = admission.and_then(|a| a.headers) {
        headers.apply(reply.headers_mut());
    }
    Ok(reply)
}

async fn routed(
    state: &AppState,
    peer: SocketAddr,
    request: Request<Incoming>,
    id: &HeaderValue,
) -> Result<Reply, ApiError> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = parse_route(&segments).ok_or_else(|| ApiError::NotFound(format!("no route for {method} {path}")))?;
    let allowed = match route {
        Route::Infer(..)
        | Route::Embed(_)
        | Route::Predict(_)
        | Route::OpenAiEmbeddings
        | Route::Tokenize
        | Route::Decode
        | Route::Similarity
        | Route::EmbedAll
        | Route::EmbedSparse(_)
        | Route::Rerank(_)
        | Route::CohereRerank(_)
        | Route::Invocations => method == Method::POST,
        _ => method == Method::GET || method == Method::HEAD,
    };
    if !allowed {
        return Err(ApiError::MethodNotAllowed(method, path.clone()));
    }
    let ready = state.ready.load(Ordering::Relaxed);
    let deadline = deadline(&request)?;
    // models.placement = "pool": a request for a model a sibling holds (and this worker could
    // only load by evicting others) is that sibling's. Its head is copied only when it goes
    // (or, for OpenAI's route, whose body names the model, before that body is read).
    let forwardable = forward::forwardable(state, &request);
    let named = match route {
        Route::Infer(name, _)
        | Route::Embed(Some(name))
        | Route::Predict(Some(name))
        | Route::Rerank(Some(name))
        | Route::EmbedSparse(Some(name)) => Some(name),
        _ => None,
    };
    if let (Some(name), true) = (named, forwardable) {
        if let Some(sibling) = forward::sibling_for(state, name).await {
            let head = forward::Head::of(&request, peer);
            let body = read_body(state, request).await?;
            return forward::send(state, sibling, head, body.bytes.clone()).await;
        }
    }
    match route {
        Route::Server => Ok(server_metadata(state)),
        Route::Live => Ok(json_reply(StatusCode::OK, b"{\"live\":true}".to_vec())),
        Route::Ready => Ok(readiness(ready)),
        // A model loaded on demand is not loaded by being asked about.
        Route::Model(name, None) if state.models.loads_on_demand(name) => Ok(not_loaded(name, None)),
        Route::ModelReady(name, None) if state.models.loads_on_demand(name) => Ok(not_loaded(name, Some(ready))),
        Route::ModelConfig(name, None) if state.models.loads_on_demand(name) => Ok(not_loaded(name, None)),
        Route::Model(name, version) => {
            state.models.find(name, version).await.map(|(_, m)| versioned(model_metadata(&m), &m))
        }
        Route::ModelReady(name, version) => {
            state.models.find(name, version).await.map(|(_, m)| versioned(readiness(ready), &m))
        }
        Route::ModelConfig(name, version) => state.models.find(name, version).await.map(|(_, m)| {
            let config = model_config::Config::of(&m, state.max_batch_inputs).to_json();
            versioned(json_reply(StatusCode::OK, serde_json::to_vec(&config).expect("json")), &m)
        }),
        Route::Infer(name, version) => {
            let found = state.models.find(name, version).await;
            let row = found_index(state, &found);
            let work = async {
                let (index, meta) = found?;
                kserve_infer(state, index, &meta, request, deadline).await.map(|r| versioned(r, &meta))
            };
            counted(state, row, Endpoint::Infer, work).await
        }
        Route::Embed(name) => tei_route(state, name, request, deadline, Endpoint::Embed, tei::embed).await,
        Route::Predict(name) => tei_route(state, name, request, deadline, Endpoint::Predict, tei::predict).await,
        Route::OpenAiEmbeddings => {
            // The model is named in the body; a name this server does not load (a client's
            // default) means the default model.
            let head = forwardable.then(|| forward::Head::of(&request, peer));
            let body = match read_body(state, request).await {
                Ok(body) => body,
                Err(e) => return counted(state, 0, Endpoint::OpenAiEmbeddings, async { Err(e) }).await,
            };
            let request = openai::parse(&body);
            let wanted = request.as_ref().ok().and_then(|r| r.model.as_deref());
            if let (Some(head), Some(name)) = (head, wanted) {
                if let Some(sibling) = forward::sibling_for(state, name).await {
                    return forward::send(state, sibling, head, body.bytes.clone()).await;
                }
            }
            let found = match wanted {
                Some(name) => state.models.find(name, None).await.ok(),
                None => None,
            };
            let found = found.unwrap_or_else(|| (0, state.models.default_model()));
            let work = async {
                let reply = openai::embeddings(state, (found.0, &found.1), request?, deadline).await?;
                Ok(versioned(reply, &found.1))
            };
            counted(state, state.engine.row(found.0), Endpoint::OpenAiEmbeddings, work).await
        }
        Route::Info => Ok(tei::info(state, &state.models.default_model())),
        Route::Tokenize => tei::tokenize(state, &state.models.default_model(), &read_body(state, request).await?).await,
        Route::Decode => tei::decode(state, &state.models.default_model(), &read_body(state, request).await?),
        Route::Similarity => tei_route(state, None, request, deadline, Endpoint::Similarity, tei::similarity).await,
        Route::Rerank(name) => tei_route(state, name, request, deadline, Endpoint::Rerank, tei::rerank).await,
        Route::CohereRerank(version) => {
            // The model is named in the body: what fails before it is known counts under the
            // default model, as OpenAI's route does.
            let found = async {
                let request = cohere::parse(&read_body(state, request).await?, version)?;
                let found = cohere::model_for(state, request.model.as_deref()).await?;
                Ok((request, found))
            };
            let (request, (index, meta)) = match found.await {
                Ok(found) => found,
                Err(e) => return counted(state, 0, Endpoint::CohereRerank, async { Err(e) }).await,
            };
            // v2's `priority`, over the header's (no higher than the key's either).
            let priority = match request.priority {
                Some(p) => p.max(KEY_FLOOR.try_with(|f| *f).unwrap_or(0)),
                None => PRIORITY.try_with(|p| *p).unwrap_or(0),
            };
            let work = PRIORITY.scope(priority, async {
                let id = id.to_str().unwrap_or_default();
                let reply = cohere::rerank(state, (index, &meta), request, version, id, deadline).await?;
                Ok(versioned(reply, &meta))
            });
            counted(state, state.engine.row(index), Endpoint::CohereRerank, work).await
        }
        Route::EmbedAll => tei_route(state, None, request, deadline, Endpoint::EmbedAll, tei::embed_all).await,
        Route::EmbedSparse(name) => {
            tei_route(state, name, request, deadline, Endpoint::EmbedSparse, tei::embed_sparse).await
        }
        Route::Invocations => {
            let meta = &state.models.default_model();
            let embedding = match meta.task {
                Task::Embedding => true,
                Task::Classification => false,
                Task::Raw => {
                    return Err(ApiError::BadRequest(format!(
                        "the default model '{}' has no pipeline; send its tensors to /v2/models/{0}/infer",
                        meta.info.name
                    )))
                }
            };
            let work = async {
                let body = read_body(state, request).await?;
                let reply = match embedding {
                    true => tei::embed(state, 0, meta, &body, deadline).await,
                    false => tei::predict(state, 0, meta, &body, deadline).await,
                };
                reply.map(|r| versioned(r, meta))
            };
            counted(state, 0, Endpoint::Invocations, work).await
        }
        Route::Ping => Ok(readiness(ready)),
    }
}

/// A TEI route: the model `name` names (None: the default model) looked up, the body read and
/// `handler` run on them, all counted under `endpoint`; the answer carries the model's version.
async fn tei_route(
    state: &AppState,
    name: Option<&str>,
    request: Request<Incoming>,
    deadline: Option<Instant>,
    endpoint: Endpoint,
    handler: impl AsyncFnOnce(&AppState, usize, &Model, &[u8], Option<Instant>) -> Result<Reply, ApiError>,
) -> Result<Reply, ApiError> {
    let found = match name {
        Some(name) => state.models.find(name, None).await,
        None => Ok((0, state.models.default_model())),
    };
    let row = found_index(state, &found);
    let work = async {
        let (index, meta) = found?;
        let body = read_body(state, request).await?;
        handler(state, index, &meta, &body, deadline).await.map(|r| versioned(r, &meta))
    };
    counted(state, row, endpoint, work).await
}

/// Header with the client's time budget for a request, in milliseconds from its arrival: a
/// request still waiting for the model when it runs out is dropped and answered 504.
pub const DEADLINE_HEADER: &str = "x-inferd-deadline-ms";

fn deadline(request: &Request<Incoming>) -> Result<Option<Instant>, ApiError> {
    let Some(value) = request.headers().get(DEADLINE_HEADER) else { return Ok(None) };
    let ms = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| ApiError::BadRequest(format!("{DEADLINE_HEADER} must be a whole number of milliseconds")))?;
    Ok(Some(Instant::now() + std::time::Duration::from_millis(ms)))
}

/// `x-inferd-model-version: <version label>+<sha256 prefix>`: which model answered, so a
/// client can see a rolling reload arrive.
fn versioned(mut reply: Reply, meta: &Model) -> Reply {
    if let Ok(v) = HeaderValue::from_str(&meta.info.full_version()) {
        reply.headers_mut().insert("x-inferd-model-version", v);
    }
    reply
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
        "version": inferd_ipc::version(),
        "extensions": ["binary_tensor_data"],
        "models": state.models.loaded().iter().map(|m| m.info.name.clone()).collect::<Vec<_>>(),
        "loadable": state.models.loadable(),
    });
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

/// A model this worker loads on the first request for it, not loaded yet: its metadata says
/// so (what it takes and gives is known once it is loaded), and `/ready` with `ready` says
/// whether a request for it would be served (after its load).
fn not_loaded(name: &str, ready: Option<bool>) -> Reply {
    let body = match ready {
        None => json!({"name": name, "versions": [], "platform": "onnxruntime_onnx", "loaded": false}),
        Some(ready) => json!({"ready": ready, "loaded": false}),
    };
    json_reply(StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

fn model_metadata(meta: &Model) -> Reply {
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

/// The whole body, refusing more than `server.max_body_bytes` (early when Content-Length says so).
/// The body and its share of the worker's body-bytes budget, held until the request is done.
struct Body {
    bytes: Bytes,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

async fn read_body(state: &AppState, request: Request<Incoming>) -> Result<Body, ApiError> {
    let limit = state.max_body_bytes;
    let too_large = || {
        ApiError::TooLarge(format!("request body is larger than the limit of {limit} bytes (server.max_body_bytes)"))
    };
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    let content_encoding = request.headers().get(hyper::header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("?"));
    let encoding =
        encoding::Encoding::from_header(content_encoding).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    // Bodies being read or held by this worker may not add up past its budget: many large
    // requests at once get a fast 503 instead of exhausting memory. A compressed body is
    // charged for what it may inflate to: the limit.
    let size = if encoding == encoding::Encoding::Identity { declared.unwrap_or(limit) } else { limit };
    let claim = size.max(1).min(u32::MAX as u64) as u32;
    let budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| {
        ApiError::Overloaded(format!(
            "too many request bytes in flight on this worker (server.max_body_bytes_in_flight = {}); retry shortly",
            state.body_budget_total
        ))
    })?;
    let read = request.extensions().get::<BodyRead>().cloned();
    let mut stage = crate::trace::Stage::start("read body");
    let collect = Limited::new(request.into_body(), limit as usize).collect();
    let timeout = state.body_timeout;
    let bytes = tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| {
            ApiError::Timeout(format!("the request body did not arrive within {timeout:?} (server.body_timeout_secs)"))
        })?
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                too_large()
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes();
    if let Some(read) = read {
        read.0.store(true, Ordering::Relaxed);
    }
    stage.set(KeyValue::new("http.request.body.size", bytes.len() as i64));
    let bytes = match encoding {
        encoding::Encoding::Identity => bytes,
        // Inflating megabytes takes milliseconds: off the I/O thread.
        _ => tokio::task::spawn_blocking(move || encoding.decode(&bytes, limit))
            .await
            .map_err(|e| ApiError::Internal(format!("inflating the request body: {e}")))?
            .map(Bytes::from)
            .map_err(|e| match e {
                encoding::DecodeError::TooLarge(_) => ApiError::TooLarge(e.to_string()),
                _ => ApiError::BadRequest(e.to_string()),
            })?,
    };
    Ok(Body { bytes, _budget: budget })
}

async fn kserve_infer(
    state: &AppState,
    index: usize,
    meta: &Model,
    request: Request<Incoming>,
    deadline: Option<Instant>,
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
    let body = read_body(state, request).await?;
    let parsed = kserve::parse(&body, header_length).map_err(ApiError::BadRequest)?;
    let inferred = run_v2(state, index, meta, parsed, deadline).await?;
    let mut reply = infer_reply(meta, inferred.id, inferred.outputs, &inferred.selection);
    if let Some(outcome) = &inferred.outcome {
        annotate(&mut reply, outcome);
    }
    Ok(reply)
}

fn infer_reply(meta: &Model, id: Option<String>, outputs: Vec<Tensor>, selection: &[(usize, bool)]) -> Reply {
    let (body, header_length) = kserve::infer_response(meta, id, outputs, selection);
    let mut reply = json_reply(StatusCode::OK, body);
    if let Some(n) = header_length {
        let headers = reply.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        headers.insert(kserve::HEADER_LENGTH, HeaderValue::from(n));
    }
    reply
}
