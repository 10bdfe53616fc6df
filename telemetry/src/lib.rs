//! The OTLP export of inferd's traces, shared by the supervisor and the workers ([tracing];
//! docs/operations.md, "Traces"): whether tracing is on, the SDK's sampler and resource, and
//! the export itself, which never stands in a request's way.
//!
//! An ended span goes into a bounded queue ([`Queue`], tracing.max_queued_spans) or, full, is
//! dropped and counted; one thread (`inferd-otlp`, with a small runtime of its own for the
//! exporter) wakes every [`FLUSH_EVERY`] and sends what is queued in batches of up to
//! [`BATCH`] spans, each export bounded by its timeout (a failed or timed-out export drops
//! its spans, counted). A collector that is down, slow or hanging therefore costs no request
//! and no memory growth. The SDK's own sampler (parent-based: a sampled parent is always
//! followed; roots by ratio), id generator and OTLP exporters (gRPC by tonic, HTTP/protobuf
//! by hyper) do the protocol.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use inferd_config::file::TracingConfig;
use opentelemetry::trace::{Link, SpanKind, TraceContextExt as _, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _, SpanProcessor};
use opentelemetry_sdk::Resource;
use tracing::{info, warn};

mod tls;

/// Spans sent in one export at most.
const BATCH: usize = 512;
/// How often the export thread sends what is queued.
const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// tracing.max_queued_spans when 0 (the SDK's batch processor's default).
const QUEUED: usize = 2048;

/// Ends `cx`'s span with `attributes`, and an error status when `error` says one.
pub fn end_span(cx: &Context, attributes: Vec<KeyValue>, error: Option<String>) {
    use opentelemetry::trace::{Status, TraceContextExt};
    let span = cx.span();
    for attribute in attributes {
        span.set_attribute(attribute);
    }
    if let Some(message) = error {
        span.set_status(Status::error(message));
    }
    span.end();
}

/// Spans exported (`false`) or dropped (`true`), `n` at a time: where the process counts them.
pub type Count = Arc<dyn Fn(bool, u64) + Send + Sync>;

/// A process's tracer, and its provider (to shut down).
pub struct Pipeline {
    pub provider: SdkTracerProvider,
    pub tracer: SdkTracer,
}

impl Pipeline {
    /// Starts the export when [tracing] or the environment turns tracing on; `attributes`:
    /// the process's resource beside service.name, service.version, host.name and process.pid.
    pub fn start(config: &TracingConfig, attributes: Vec<KeyValue>, count: Count) -> Option<Pipeline> {
        if !wanted(config) {
            return None;
        }
        let protocol = protocol(config);
        let mut resource = Resource::builder()
            .with_attributes([
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                KeyValue::new(
                    "host.name",
                    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string(),
                ),
                KeyValue::new("process.pid", i64::from(std::process::id())),
            ])
            .with_attributes(attributes);
        match (&config.service_name, std::env::var_os("OTEL_SERVICE_NAME")) {
            (Some(name), _) => resource = resource.with_service_name(name.clone()),
            (None, None) => resource = resource.with_service_name("inferd"),
            (None, Some(_)) => {}
        }
        let resource = resource.build();
        let capacity = match config.max_queued_spans {
            0 => QUEUED,
            n => n,
        };
        let (queue, spans) = sync_channel(capacity);
        let export = Export { config: config.clone(), protocol: protocol.clone(), resource: resource.clone() };
        let finished = Arc::new(Mutex::new(None::<SyncSender<()>>));
        let (done, counted) = (finished.clone(), count.clone());
        let thread = std::thread::Builder::new().name("inferd-otlp".into()).spawn(move || {
            export.run(spans, &*counted);
            if let Some(tell) = done.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = tell.send(());
            }
        });
        if let Err(e) = thread {
            warn!("tracing is off: cannot start its export thread: {e}");
            return None;
        }
        let processor = Queue { queue: Mutex::new(Some(queue)), count, finished };
        let provider = SdkTracerProvider::builder()
            .with_sampler(sampler(config))
            .with_resource(resource)
            .with_span_processor(processor)
            .build();
        let tracer = provider.tracer("inferd");
        info!(protocol, "tracing: spans exported over OTLP");
        Some(Pipeline { provider, tracer })
    }

    /// Starts a span of `kind` named `name`, the child of `parent`'s span (an empty context:
    /// the root of a new trace), at `started` (None: now), linked to `links`; returned in a
    /// context of its own (end it with [`end_span`]).
    pub fn start_span(
        &self,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        parent: &Context,
        started: Option<SystemTime>,
        attributes: Vec<KeyValue>,
        links: Vec<Link>,
    ) -> Context {
        let mut builder = self.tracer.span_builder(name).with_kind(kind).with_attributes(attributes).with_links(links);
        if let Some(started) = started {
            builder = builder.with_start_time(started);
        }
        parent.with_span(builder.start_with_context(&self.tracer, parent))
    }

    /// Exports what is queued, within `limit` (before the process exits).
    pub fn shutdown(&self, limit: Duration) {
        let _ = self.provider.shutdown_with_timeout(limit);
    }
}

/// Whether [tracing] (or the environment) turns tracing on.
fn wanted(config: &TracingConfig) -> bool {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) && config.enabled != Some(true) {
        return false;
    }
    config.enabled.unwrap_or_else(|| {
        config.endpoint.is_some()
            || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
            || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
    })
}

/// The share of new traces (requests without a sampled parent) that are recorded, as [tracing]
/// or the environment sets it; None: tracing is off.
pub fn root_ratio(config: &TracingConfig) -> Option<f64> {
    if !wanted(config) {
        return None;
    }
    if let Some(r) = config.sample_ratio {
        return Some(r);
    }
    Some(match std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_default().trim() {
        "always_off" | "parentbased_always_off" => 0.0,
        "traceidratio" | "parentbased_traceidratio" => env_ratio(),
        _ => 1.0,
    })
}

/// OTEL_TRACES_SAMPLER_ARG as a ratio (1 when unset or not a number).
fn env_ratio() -> f64 {
    let arg = std::env::var("OTEL_TRACES_SAMPLER_ARG").ok();
    arg.and_then(|a| a.trim().parse::<f64>().ok()).unwrap_or(1.0).clamp(0.0, 1.0)
}

/// The sampler: [tracing] sample_ratio, else OTEL_TRACES_SAMPLER (and _ARG), else parent-based
/// always-on.
fn sampler(config: &TracingConfig) -> Sampler {
    if let Some(r) = config.sample_ratio {
        return Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r)));
    }
    match std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_default().trim() {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(env_ratio()),
        "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        "parentbased_traceidratio" => Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(env_ratio()))),
        _ => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
    }
}

/// `grpc` or `http/protobuf`, as [tracing] or the environment says.
fn protocol(config: &TracingConfig) -> String {
    let env = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    config
        .protocol
        .clone()
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into())
}

/// Why the export thread has no exporter (it then drops every span, counted).
#[derive(Debug, thiserror::Error)]
enum ExporterError {
    #[error("TLS to the collector: {0}")]
    Client(tls::ClientError),
    #[error("{0}")]
    Connector(#[from] inferd_config::tls::TlsError),
    #[error("OTLP protocol '{0}' is not one of grpc, http/protobuf")]
    Protocol(String),
    #[error("{0}")]
    Build(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// What the export thread needs to make its exporter.
struct Export {
    config: TracingConfig,
    protocol: String,
    resource: Resource,
}

impl Export {
    fn timeout(&self) -> Duration {
        let env = std::env::var("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .ok()
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        self.config.timeout_secs.map(Duration::from_secs_f64).or(env).unwrap_or(Duration::from_secs(10))
    }

    /// The exporter (in the export thread's runtime: tonic's channel needs one).
    fn exporter(&self) -> Result<opentelemetry_otlp::SpanExporter, ExporterError> {
        use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
        use opentelemetry_otlp::{WithHttpConfig as _, WithTonicConfig as _};
        let timeout = self.timeout();
        let endpoint = self.config.endpoint.clone().or_else(|| {
            ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
                .iter()
                .find_map(|v| std::env::var(v).ok().filter(|e| !e.trim().is_empty()))
        });
        let tls = match endpoint.as_deref().is_some_and(|e| e.trim().starts_with("https://")) {
            true => Some(tls::client(&self.config).map_err(ExporterError::Client)?),
            false => None,
        };
        let built = match self.protocol.as_str() {
            "grpc" => {
                let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic().with_timeout(timeout);
                if let Some(endpoint) = &self.config.endpoint {
                    builder = builder.with_endpoint(endpoint.clone());
                }
                if let Some(tls) = &tls {
                    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.roots));
                    if let Some((chain, key)) = &tls.identity {
                        config = config.identity(Identity::from_pem(chain, key));
                    }
                    builder = builder.with_tls_config(config);
                }
                builder.build()
            }
            "http/protobuf" => {
                let mut builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_timeout(timeout);
                if let Some(endpoint) = &self.config.endpoint {
                    builder = builder.with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')));
                }
                if let Some(tls) = &tls {
                    let connector = tls::Connector::new(tls)?;
                    builder =
                        builder.with_http_client(opentelemetry_http::hyper::HyperClient::new(connector, timeout, None));
                }
                builder.build()
            }
            other => return Err(ExporterError::Protocol(other.to_string())),
        };
        let mut exporter = built?;
        exporter.set_resource(&self.resource);
        Ok(exporter)
    }

    /// Sends the queue's spans in batches until every sender is gone.
    fn run(&self, spans: Receiver<SpanData>, count: &(dyn Fn(bool, u64) + Send + Sync)) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(e) => return warn!("tracing: no runtime for the exporter ({e}); spans are dropped"),
        };
        let exporter = match runtime.block_on(async { self.exporter() }) {
            Ok(exporter) => exporter,
            Err(e) => {
                warn!("tracing: cannot make the OTLP exporter ({e}); spans are dropped");
                // Keep taking spans, so that the queue stays free and they are counted.
                for _ in spans.iter() {
                    count(true, 1);
                }
                return;
            }
        };
        // An export may retry within its timeout: twice that, and a second, bounds it.
        let limit = self.timeout() * 2 + Duration::from_secs(1);
        let mut failing = false;
        let mut closed = false;
        while !closed {
            // The thread sleeps between exports rather than waking for each span: a wake per
            // span would take the worker's own core from its requests (the thread shares it).
            std::thread::sleep(FLUSH_EVERY);
            let mut batch = Vec::new();
            loop {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
                if batch.len() < BATCH {
                    continue;
                }
                self.send(&runtime, &exporter, std::mem::take(&mut batch), limit, count, &mut failing);
            }
            if !batch.is_empty() {
                self.send(&runtime, &exporter, batch, limit, count, &mut failing);
            }
        }
    }

    /// One export, bounded by `limit`, its spans counted as exported or dropped.
    fn send(
        &self,
        runtime: &tokio::runtime::Runtime,
        exporter: &opentelemetry_otlp::SpanExporter,
        batch: Vec<SpanData>,
        limit: Duration,
        count: &(dyn Fn(bool, u64) + Send + Sync),
        failing: &mut bool,
    ) {
        let n = batch.len() as u64;
        let sent = runtime.block_on(async { tokio::time::timeout(limit, exporter.export(batch)).await });
        match sent {
            Ok(Ok(())) => {
                count(false, n);
                if std::mem::take(failing) {
                    info!("tracing: the collector takes spans again");
                }
            }
            outcome => {
                count(true, n);
                if !std::mem::replace(failing, true) {
                    let why = match outcome {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {limit:?}"),
                    };
                    warn!("tracing: spans dropped, the collector did not take them: {why}");
                }
            }
        }
    }
}

/// The span processor: ended spans into the export thread's bounded queue, or dropped.
struct Queue {
    queue: Mutex<Option<SyncSender<SpanData>>>,
    count: Count,
    /// Told when the export thread has sent what was queued (shutdown).
    finished: Arc<Mutex<Option<SyncSender<()>>>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Queue")
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let sent = match queue.as_ref() {
            Some(queue) => queue.try_send(span),
            None => return (self.count)(true, 1),
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = sent {
            (self.count)(true, 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let (tell, told) = sync_channel(1);
        *self.finished.lock().unwrap_or_else(|e| e.into_inner()) = Some(tell);
        // The export thread sends what is left, then finds the queue closed.
        drop(self.queue.lock().unwrap_or_else(|e| e.into_inner()).take());
        told.recv_timeout(timeout).map_err(|_| OTelSdkError::Timeout(timeout))
    }
}
