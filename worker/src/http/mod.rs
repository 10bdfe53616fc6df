//! HTTP for one worker: KServe v2 REST, text-embeddings-inference's, OpenAI's and Cohere's
//! routes. [`handle`] is every HTTP request's side of the door ([`crate::request::door`]):
//! its id and span, its entry, its answer or its error body in its protocol's style, its
//! access line, the headers every answer carries and its compression where the client asks
//! for it ([`compress`]); [`dispatch`] serves it by its [`route`].

pub mod body;
pub mod cohere;
pub mod compress;
pub mod dispatch;
pub mod encoding;
pub mod forward;
pub mod grpc;
pub mod handoff;
pub mod model_config;
pub mod openai;
pub mod reply;
pub mod route;
pub mod shared_memory;
pub mod tei;
pub mod trace_setting;
pub mod v2;
pub mod write_timeout;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH};
use hyper::{Method, Request};
use opentelemetry::KeyValue;
use serde_json::json;

use crate::http::reply::{json_reply, Reply};
use crate::http::route::Route;
use crate::request::app::AppState;
use crate::request::door::{self, Answered, Arrival, Visit, REQUEST_ID_HEADER};
use crate::request::error::ApiError;

/// Every request: let in by the door, routed, answered, its id echoed, its failure logged
/// with that id, and its access line written (log.access_log).
pub async fn handle(
    state: Arc<AppState>,
    peer: SocketAddr,
    mut request: Request<Incoming>,
) -> Result<Reply, Infallible> {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = route::parse(&segments);
    let encoding = compress::accepted(request.headers());
    // Its server span, when the worker traces: the client's trace continued.
    let visit = Visit::open(&state, request.headers(), |id| span(&request, route.as_ref(), &method, &path, peer, id));
    // A request this worker may forward carries its id to the sibling that serves it.
    if state.models.placed() {
        request.headers_mut().insert(REQUEST_ID_HEADER, visit.id.clone());
    }
    // A body left unread (an error answered before it was read, or a failed read) means hyper
    // closes the connection after the answer: the answer must say so, or a keep-alive client
    // sends its next request into a closing socket.
    let body_read = match hyper::body::Body::is_end_stream(request.body()) {
        true => None,
        false => {
            let flag = body::Read::default();
            request.extensions_mut().insert(flag.clone());
            Some(flag)
        }
    };
    let arrival = Arrival {
        headers: request.headers(),
        probe: route.as_ref().is_some_and(|r| r.kind().probe),
        forwarded: request.extensions().get::<forward::Forwarded>().is_some(),
        api: route.as_ref().map(|r| r.kind().api),
        grpc: false,
    };
    let (routed, call) = match door::enter(&state, &visit, &arrival) {
        Err(e) => (Err(e), None),
        Ok(entered) => {
            let routed = visit.serve(dispatch::routed(&state, peer, request, &entered.call)).await;
            // A key with a rate: its standing, on every answer.
            let routed = routed.map(|mut reply| {
                if let Some(headers) = &entered.admission.headers {
                    headers.apply(reply.headers_mut());
                }
                reply
            });
            (routed, Some(entered.call))
        }
    };
    let style = route.as_ref().map_or(route::ErrorStyle::V2, |r| r.kind().style);
    let mut refused = "";
    let reply = match routed {
        Ok(reply) => reply,
        Err(e) => {
            if let ApiError::Unauthorized(refusal) = &e {
                refused = refusal.as_str();
            }
            visit.failed(method.as_str(), &path, &e);
            error_reply(&e, style)
        }
    };
    // An inference's answer: compressed where the client asks (errors are not).
    let mut reply = match route.as_ref().is_some_and(|r| r.kind().compress) {
        true => compress::answer(&state, encoding, reply).await,
        false => reply,
    };
    let headers = reply.headers_mut();
    if let Some(waited) = call.as_ref().and_then(|c| c.load_wait()) {
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
    headers.insert(REQUEST_ID_HEADER, visit.id.clone());
    if body_read.is_some_and(|read| !read.done()) {
        headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    let default;
    let model = match (call.as_ref().and_then(|c| c.model()), route.as_ref().and_then(Route::model)) {
        (Some(found), _) => found,
        (None, Some(Some(name))) => name,
        (None, Some(None)) => {
            default = state.models.default_model();
            &default.info.name
        }
        (None, None) => "",
    };
    let status = reply.status();
    let bytes = hyper::body::Body::size_hint(reply.body()).exact().unwrap_or(0);
    // The span's closing attributes, only where there is a span.
    let mut attributes = Vec::new();
    let mut error = None;
    if visit.span.is_some() {
        attributes.push(KeyValue::new("http.response.status_code", i64::from(status.as_u16())));
        attributes.push(KeyValue::new("http.response.body.size", bytes as i64));
        if let Some(version) = reply.headers().get("x-inferd-model-version").and_then(|v| v.to_str().ok()) {
            attributes.push(KeyValue::new("inferd.model.version", version.to_string()));
        }
        if status.is_server_error() {
            attributes.push(KeyValue::new("error.type", status.as_u16().to_string()));
            error = Some(status.to_string());
        }
    }
    let answered = Answered {
        peer: Some(peer),
        method: method.as_str(),
        path: &path,
        model,
        status: status.as_u16(),
        bytes,
        key: call.as_ref().and_then(|c| c.key.as_deref()),
        refused,
    };
    visit.close(&state, answered, attributes, error);
    Ok(reply)
}

/// A request's server span, named by HTTP's conventions (`POST /v2/models/{model}/infer`),
/// with what is known before it is routed.
fn span(
    request: &Request<Incoming>,
    route: Option<&Route>,
    method: &Method,
    path: &str,
    peer: SocketAddr,
    id: &HeaderValue,
) -> (String, Vec<KeyValue>) {
    let template = route.map(Route::template);
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
    if let Some(Some(model)) = route.and_then(Route::model) {
        attributes.push(KeyValue::new("inferd.model", model.to_string()));
    }
    if let Some(agent) = header(hyper::header::USER_AGENT) {
        attributes.push(KeyValue::new("user_agent.original", agent.to_string()));
    }
    if let Some(size) = header(CONTENT_LENGTH).and_then(|v| v.parse::<i64>().ok()) {
        attributes.push(KeyValue::new("http.request.body.size", size));
    }
    (name, attributes)
}

fn error_reply(e: &ApiError, style: route::ErrorStyle) -> Reply {
    let body = match style {
        route::ErrorStyle::V2 => json!({ "error": e.to_string() }),
        route::ErrorStyle::Tei => tei::error_body(e),
        route::ErrorStyle::OpenAi => openai::error_body(e),
        route::ErrorStyle::Cohere => cohere::error_body(e),
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
