//! The supervisor's own traces ([tracing]; docs/operations.md, "Traces"): a rolling reload is
//! one trace, with a span per slot from the start of its new worker to that worker's
//! promotion, and the reload's span ending once every replaced worker stopped taking
//! connections. Exported by inferd_telemetry's pipeline, as the workers' spans are; its spans
//! exported and dropped are counted into the pool's `inferd_trace_spans_*_total`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use inferd_config::file::TracingConfig;
use inferd_telemetry::Pipeline;
use opentelemetry::trace::{SpanKind, TraceContextExt};
use opentelemetry::{Context, KeyValue};

static TRACER: OnceLock<Pipeline> = OnceLock::new();
/// The supervisor's spans exported and dropped.
static SPANS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Starts tracing in the supervisor when [tracing] or the environment asks for it (read at
/// start: a reload does not change it).
pub fn init(config: &TracingConfig) {
    let count = Arc::new(|dropped: bool, n: u64| {
        SPANS[usize::from(dropped)].fetch_add(n, Ordering::Relaxed);
    });
    if let Some(pipeline) = Pipeline::start(config, vec![KeyValue::new("inferd.role", "supervisor")], count) {
        let _ = TRACER.set(pipeline);
    }
}

/// The supervisor's spans (exported, dropped).
pub fn spans() -> (u64, u64) {
    (SPANS[0].load(Ordering::Relaxed), SPANS[1].load(Ordering::Relaxed))
}

/// Exports what is queued before the supervisor exits, within `limit`.
pub fn shutdown(limit: Duration) {
    if let Some(pipeline) = TRACER.get() {
        pipeline.shutdown(limit);
    }
}

/// A span, the root of a new trace (`parent`: None) or a child; None with tracing off.
pub fn start(name: String, parent: Option<&Context>, attributes: Vec<KeyValue>) -> Option<Context> {
    let pipeline = TRACER.get()?;
    let parent = parent.cloned().unwrap_or_default();
    Some(pipeline.start_span(name, SpanKind::Internal, &parent, None, attributes, Vec::new()))
}

/// Something that happened within `cx`'s span.
pub fn event(cx: &Option<Context>, name: &'static str, attributes: Vec<KeyValue>) {
    if let Some(cx) = cx {
        cx.span().add_event(name, attributes);
    }
}

/// Ends `cx`'s span with `attributes`, and an error status when `error` says one.
pub fn end(cx: Option<Context>, attributes: Vec<KeyValue>, error: Option<String>) {
    if let Some(cx) = cx {
        inferd_telemetry::end_span(&cx, attributes, error);
    }
}
