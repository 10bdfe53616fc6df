//! OpenTelemetry traces of a worker's requests ([tracing]; docs/operations.md, "Traces").
//!
//! Each request gets one server span, continuing the client's W3C `traceparent` when it sends
//! one (a malformed one starts a new trace), and within it a span per stage, made where the
//! stage's time is measured ([`stage`]); a model run that serves several requests is one span,
//! the child of its first traced request and linked to each ([`Run`]). The request's context
//! travels with its task ([`in_request`]), so that code below the HTTP layer finds its parent
//! without being handed it.
//!
//! Export is inferd_telemetry's ([`Pipeline`]: a bounded queue whose overflow is dropped and
//! counted, sent by a thread of its own), and never stands in a request's way. With tracing
//! off no tracer exists, and each request pays for one empty task-local.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use inferd_config::file::TracingConfig;
use inferd_ipc::stats::WorkerCounters;
use inferd_telemetry::Pipeline;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Link, SpanContext, SpanKind, TraceContextExt};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The worker's tracer, once [`init`] has made it (never, with tracing off).
static TRACER: OnceLock<Pipeline> = OnceLock::new();

/// Starts tracing in this worker when [tracing] or the environment asks for it. `worker`: the
/// slot's index, in every span's resource; spans exported and dropped are counted in the
/// worker's shared counters.
pub fn init(config: &TracingConfig, worker: usize, counters: Arc<WorkerCounters>) {
    let count = Arc::new(move |dropped: bool, n: u64| counters.spans(dropped, n));
    if let Some(pipeline) = Pipeline::start(config, vec![KeyValue::new("inferd.worker", worker as i64)], count) {
        let _ = TRACER.set(pipeline);
    }
}

tokio::task_local! {
    /// The traced request this task serves, if any (see [`in_request`]).
    static REQUEST: Option<Context>;
}

/// Whether this worker traces (then, and only then, requests make spans).
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// Exports what is queued before the worker exits, within `limit`.
pub fn shutdown(limit: Duration) {
    if let Some(pipeline) = TRACER.get() {
        pipeline.shutdown(limit);
    }
}

/// A request's headers (HTTP, or gRPC metadata as HTTP/2 headers) as the propagator reads them.
struct Headers<'a>(&'a hyper::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Headers a request sent on carries: the traceparent of the request this task serves.
struct Inject<'a>(&'a mut hyper::HeaderMap);

impl opentelemetry::propagation::Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (hyper::header::HeaderName::from_bytes(key.as_bytes()), value.parse()) {
            self.0.insert(name, value);
        }
    }
}

/// Puts the traced request's context (`traceparent`, `tracestate`) on `headers` of a request
/// sent on its behalf (to a sibling: its server span is then this one's child).
pub fn inject(headers: &mut hyper::HeaderMap) {
    if let Some(cx) = request() {
        TraceContextPropagator::new().inject_context(&cx, &mut Inject(headers));
    }
}

/// A request's server span, started when tracing is on: `name` (`POST /v2/models/{model}/infer`,
/// or the gRPC method), its parent from the request's `traceparent` and `tracestate`.
pub fn server_span(headers: &hyper::HeaderMap, name: String, attributes: Vec<KeyValue>) -> Option<Context> {
    let pipeline = TRACER.get()?;
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    Some(pipeline.start_span(name, SpanKind::Server, &parent, None, attributes, Vec::new()))
}

/// Runs `work` as the request of `cx` (None: not traced): [`stage`] and [`current`] find it.
pub async fn in_request<T>(cx: Option<Context>, work: impl std::future::Future<Output = T>) -> T {
    REQUEST.scope(cx, work).await
}

/// The sampled span of the request this task serves, if any.
fn request() -> Option<Context> {
    REQUEST.try_with(|cx| cx.clone()).ok().flatten().filter(|cx| cx.span().span_context().is_sampled())
}

/// Sets `attribute` on the server span of the request this task serves (when traced).
pub fn attribute(attribute: KeyValue) {
    if let Some(cx) = request() {
        cx.span().set_attribute(attribute);
    }
}

/// The span context of the request this task serves, when it is traced and sampled (for a
/// model run to link to).
pub fn current() -> Option<SpanContext> {
    request().map(|cx| cx.span().span_context().clone())
}

/// A stage of the request this task serves, from `started` to `ended`, as a child of its
/// server span (nothing when it is not traced).
pub fn stage(name: &'static str, started: SystemTime, ended: SystemTime, attributes: Vec<KeyValue>) {
    let (Some(pipeline), Some(cx)) = (TRACER.get(), request()) else { return };
    let cx = pipeline.start_span(name, SpanKind::Internal, &cx, Some(started), attributes, Vec::new());
    cx.span().end_with_timestamp(ended);
}

/// Work done for a traced request on another thread (an on-demand load): `name`, from
/// `started` to now, the child of `parent`'s span (nothing when it is None).
pub fn child_of(
    parent: Option<&SpanContext>,
    name: &'static str,
    started: SystemTime,
    attributes: Vec<KeyValue>,
    error: Option<String>,
) {
    let (Some(pipeline), Some(parent)) = (TRACER.get(), parent) else { return };
    let parent = Context::new().with_remote_span_context(parent.clone());
    let cx = pipeline.start_span(name, SpanKind::Internal, &parent, Some(started), Vec::new(), Vec::new());
    inferd_telemetry::end_span(&cx, attributes, error);
}

/// Times a stage of the request this task serves: the span goes out when it is dropped.
pub struct Stage {
    name: &'static str,
    started: SystemTime,
    attributes: Vec<KeyValue>,
}

impl Stage {
    pub fn start(name: &'static str) -> Stage {
        // Untraced, a stage reads no clock and keeps nothing.
        let started = if enabled() { SystemTime::now() } else { SystemTime::UNIX_EPOCH };
        Stage { name, started, attributes: Vec::new() }
    }

    pub fn set(&mut self, attribute: KeyValue) {
        if enabled() {
            self.attributes.push(attribute);
        }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if TRACER.get().is_some() {
            stage(self.name, self.started, SystemTime::now(), std::mem::take(&mut self.attributes));
        }
    }
}

/// A model run serving the jobs whose requests' span contexts are `traced`: the child of the
/// first and linked to each (OpenTelemetry's guidance for batches). Ended by [`Run::end`].
pub struct Run {
    span: Option<Context>,
}

impl Run {
    pub fn start(traced: Vec<SpanContext>) -> Run {
        let (Some(pipeline), Some(first)) = (TRACER.get(), traced.first().cloned()) else {
            return Run { span: None };
        };
        let parent = Context::new().with_remote_span_context(first);
        let links = traced.into_iter().map(Link::with_context).collect();
        Run { span: Some(pipeline.start_span("model run", SpanKind::Internal, &parent, None, Vec::new(), links)) }
    }

    pub fn end(self, attributes: Vec<KeyValue>) {
        if let Some(cx) = self.span {
            inferd_telemetry::end_span(&cx, attributes, None);
        }
    }
}
