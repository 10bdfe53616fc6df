//! The door every request enters by, whatever its protocol (HTTP's routes in `http`, gRPC's
//! calls in `http::grpc::serve`, a request a sibling forwards): its id, its API key checked, its
//! priority and deadline read, and its place in its key's limits taken, before anything else
//! reads it; what it learned is one [`Call`] that every stage is handed. Then, once it is
//! answered, its failure logged with its id and its access line written ([`Visit`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;
use hyper::HeaderMap;
use opentelemetry::KeyValue;
use tracing::{debug, info, warn};

use inferd_config::auth::{bearer, KeySettings};
use inferd_config::restricted::{Api, GRPC_PREFIX};
use inferd_ipc::limits::{now_ns, KeyLimits, Over, Pass};

use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::{ApiError, RateHeaders};
use crate::runtime::engine::Terms;

/// Header with the request's id, echoed in its answer and named in its log lines.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Header with the request's priority: 0 (the default) the highest, up to 255, no higher than
/// its key's ([`Terms::priority`]).
pub const PRIORITY_HEADER: &str = "x-inferd-priority";

/// Header with the client's time budget for a request, in milliseconds from its arrival: a
/// request still waiting for the model when it runs out is dropped and answered 504. gRPC's
/// `grpc-timeout` says the same.
pub const DEADLINE_HEADER: &str = "x-inferd-deadline-ms";

/// A request at the door: what every protocol knows of it before reading its body.
pub struct Arrival<'a> {
    pub headers: &'a HeaderMap,
    /// A health or readiness probe: served without a key unless `[auth] protect_health`, and
    /// neither limited nor counted by key.
    pub probe: bool,
    /// Sent by a sibling (models.placement = "pool"), which admitted it and holds its place
    /// in its key's limits until the answer is relayed.
    pub forwarded: bool,
    /// Its API category ([[auth.restricted]]); None: a path no route serves.
    pub api: Option<Api>,
    /// A gRPC call: a restriction's header is read with Triton's gRPC prefix.
    pub grpc: bool,
}

/// A request let in: what the door learned, and its place in its key's limits until dropped.
pub struct Entered<'s> {
    pub call: Call,
    pub admission: Admission<'s>,
}

/// Lets a request of `visit` in, or says why not: its key ([auth]), its priority, its
/// deadline and its key's limits, checked in that order.
pub fn enter<'s>(state: &'s AppState, visit: &Visit, arrival: &Arrival) -> Result<Entered<'s>, ApiError> {
    let headers = arrival.headers;
    let authorization = headers.get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
    let key = authorize(state, authorization, arrival.probe)?;
    if !arrival.forwarded {
        restrict(state, arrival)?;
    }
    if let (Some(key), Some(cx)) = (key, &visit.span) {
        use opentelemetry::trace::TraceContextExt;
        cx.span().set_attribute(KeyValue::new("inferd.api_key.name", key.name.clone()));
    }
    let asked = match headers.get(PRIORITY_HEADER) {
        None => 0,
        Some(v) => v.to_str().ok().and_then(|v| v.trim().parse::<u8>().ok()).ok_or_else(|| {
            ApiError::BadRequest(format!("{PRIORITY_HEADER} must be a whole number from 0 (the highest) to 255"))
        })?,
    };
    let floor = key.map_or(0, |k| k.priority);
    let priority = asked.max(floor);
    let deadline = deadline(headers)?;
    let admission = match arrival.probe || arrival.forwarded {
        true => Admission::default(),
        false => admit(state, key, priority)?,
    };
    let id = visit.id.to_str().unwrap_or_default().to_string();
    let fresh = no_cache(headers.get(hyper::header::CACHE_CONTROL));
    let call = Call::new(id, Terms { priority, deadline }, floor, key.map(|k| k.name.clone()), fresh);
    Ok(Entered { call, admission })
}

/// Whether the request carries the header its API category needs ([[auth.restricted]]); a
/// forwarded request was checked by the sibling that let it in.
fn restrict(state: &AppState, arrival: &Arrival) -> Result<(), ApiError> {
    let Some(restriction) = arrival.api.and_then(|api| state.restricted.of_api(api)) else { return Ok(()) };
    let header = match arrival.grpc {
        true => format!("{GRPC_PREFIX}{}", restriction.header),
        false => restriction.header.clone(),
    };
    match restriction.admits(arrival.headers.get(&header).map(HeaderValue::as_bytes)) {
        true => Ok(()),
        false => Err(ApiError::Restricted { header }),
    }
}

/// Whether `Cache-Control` asks for a fresh answer.
fn no_cache(value: Option<&HeaderValue>) -> bool {
    value.and_then(|v| v.to_str().ok()).is_some_and(|v| {
        v.split(',').map(str::trim).any(|d| d.eq_ignore_ascii_case("no-cache") || d.eq_ignore_ascii_case("no-store"))
    })
}

/// The request's deadline: [`DEADLINE_HEADER`] or gRPC's `grpc-timeout`, the earlier of the two.
fn deadline(headers: &HeaderMap) -> Result<Option<Instant>, ApiError> {
    let now = Instant::now();
    let http = match headers.get(DEADLINE_HEADER) {
        None => None,
        Some(value) => {
            let ms = value.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).ok_or_else(|| {
                ApiError::BadRequest(format!("{DEADLINE_HEADER} must be a whole number of milliseconds"))
            })?;
            Some(now + Duration::from_millis(ms))
        }
    };
    let grpc = match headers.get("grpc-timeout") {
        None => None,
        Some(value) => Some(grpc_timeout(value).and_then(|t| now.checked_add(t)).ok_or_else(|| {
            ApiError::BadRequest(format!("grpc-timeout {value:?} is not 1-8 digits and a unit (H, M, S, m, u, n)"))
        })?),
    };
    Ok(http.into_iter().chain(grpc).min())
}

/// gRPC's `grpc-timeout`: an integer of at most 8 digits and a unit (H M S m u n).
fn grpc_timeout(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().saturating_sub(1));
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Whether a request whose `Authorization` header (or gRPC metadata) is `authorization`
/// may be served ([auth]); `health`: a health or readiness route. A refusal is counted by
/// its reason; the key itself is never logged.
/// The key's settings when keys are on and the route needs one.
fn authorize<'s>(
    state: &'s AppState,
    authorization: Option<&[u8]>,
    health: bool,
) -> Result<Option<&'s KeySettings>, ApiError> {
    let Some(keys) = &state.api_keys else { return Ok(None) };
    if health && !keys.protect_health {
        return Ok(None);
    }
    keys.check(authorization.and_then(bearer)).map(Some).map_err(|refusal| {
        state.stats.count_auth_refusal(refusal);
        ApiError::Unauthorized(refusal)
    })
}

/// Admits a request of `key` (None: no keys on this route) at `priority` within the key's
/// rate and concurrency, pool-wide, and counts it by key name and priority. The answer
/// holds the request's place in the key's concurrency until dropped, and the `RateLimit`
/// header to send with it.
fn admit<'s>(state: &'s AppState, key: Option<&KeySettings>, priority: u8) -> Result<Admission<'s>, ApiError> {
    let Some(seat) = &state.limits else { return Ok(Admission::default()) };
    let (name, limits) = match key {
        Some(k) => (
            k.name.as_str(),
            KeyLimits { rate: k.rate.map(|r| (r.interval_ns(), r.burst)), concurrency: k.concurrency },
        ),
        None => ("", KeyLimits { rate: None, concurrency: None }),
    };
    let policy = key.and_then(|k| k.rate).map(|rate| {
        let window = (rate.interval_ns() as u128 * rate.burst as u128).div_ceil(1_000_000_000);
        format!("\"key\";q={};w={window}", rate.burst)
    });
    let admitted = seat.admit(name, priority, limits, now_ns()).map_err(|over| match over {
        Over::Rate { retry_ns } => ApiError::TooManyRequests(
            format!(
                "API key {name:?} is over its rate of {}: the next request is admitted in {:.3} s",
                key.and_then(|k| k.rate).map_or(String::new(), |r| r.to_string()),
                retry_ns as f64 / 1e9
            ),
            RateHeaders {
                policy: policy.clone().unwrap_or_default(),
                state: format!("\"key\";r=0;t={}", seconds(retry_ns)),
                retry_after: Some(seconds(retry_ns)),
            },
        ),
        Over::Concurrency { limit } => ApiError::TooManyRequests(
            format!(
                "API key {name:?} has {limit} requests in flight, its concurrency limit: retry when one is answered"
            ),
            RateHeaders { policy: String::new(), state: String::new(), retry_after: Some(1) },
        ),
    })?;
    static WARNED: AtomicBool = AtomicBool::new(false);
    if admitted.untracked && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::error!(
            key = name,
            "the pool's table of API key limits is full: keys it has no room for are served without their \
             limits (a restart of the supervisor empties it)"
        );
    }
    let headers = admitted.standing.zip(policy).map(|(standing, policy)| RateHeaders {
        policy,
        state: format!("\"key\";r={};t={}", standing.remaining, seconds(standing.reset_ns)),
        retry_after: None,
    });
    Ok(Admission { _pass: admitted.pass, headers })
}

/// Whole seconds, rounded up, at least 1 (Retry-After and `RateLimit`'s `t`).
fn seconds(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

/// A request admitted within its key's limits.
#[derive(Default)]
pub struct Admission<'a> {
    /// Its place in its key's concurrency, given back when dropped.
    _pass: Option<Pass<'a>>,
    /// Its key's standing against its rate, when the key has one.
    pub headers: Option<RateHeaders>,
}

/// A request from its arrival to its access line: its id, when it came, and its server span
/// (when the worker traces).
pub struct Visit {
    pub id: HeaderValue,
    started: Instant,
    pub span: Option<opentelemetry::Context>,
}

/// What the access line of an answered request says beside the visit's own facts.
pub struct Answered<'a> {
    pub peer: Option<SocketAddr>,
    pub method: &'a str,
    pub path: &'a str,
    /// The model it was for ("" when none or unknown).
    pub model: &'a str,
    pub status: u16,
    pub bytes: u64,
    /// Its API key's name, when it got past the key check.
    pub key: Option<&'a str>,
    /// Why its key was refused ("missing", "invalid"), else "".
    pub refused: &'a str,
}

impl Visit {
    /// A request arrives with these headers: its id is the client's `X-Request-Id` where
    /// usable, else a new one; `span`, when the worker traces: the server span's name and
    /// attributes (the client's trace continued from `traceparent`).
    pub fn open(
        state: &AppState,
        headers: &HeaderMap,
        span: impl FnOnce(&HeaderValue) -> (String, Vec<KeyValue>),
    ) -> Visit {
        let id = state.request_ids.for_request(headers.get(REQUEST_ID_HEADER));
        let span = match crate::trace::enabled() {
            true => {
                let (name, attributes) = span(&id);
                crate::trace::server_span(headers, name, attributes)
            }
            false => None,
        };
        Visit { id, started: Instant::now(), span }
    }

    /// `work` served in the visit's span, a bug that panics in it costing this request (500),
    /// not the worker (panics.rs).
    pub async fn serve<T>(&self, work: impl std::future::Future<Output = Result<T, ApiError>>) -> Result<T, ApiError> {
        let guarded = crate::panics::guarded_future(work);
        crate::trace::in_request(self.span.clone(), guarded).await.unwrap_or_else(|_| {
            Err(ApiError::Internal("internal error: the server hit a bug serving this request (logged)".into()))
        })
    }

    /// The visit's trace and span ids, when it is traced.
    fn trace_ids(&self) -> (Option<String>, Option<String>) {
        use opentelemetry::trace::TraceContextExt;
        match &self.span {
            Some(cx) => {
                let span = cx.span();
                let ids = span.span_context();
                (Some(ids.trace_id().to_string()), Some(ids.span_id().to_string()))
            }
            None => (None, None),
        }
    }

    /// A failure, logged with the request's ids: a warning for the server's (5xx), a debug
    /// line for a refusal.
    pub fn failed(&self, method: &str, path: &str, e: &ApiError) {
        let (trace_id, span_id) = self.trace_ids();
        let (trace_id, span_id) = (trace_id.as_deref(), span_id.as_deref());
        let request_id = self.id.to_str().unwrap_or_default();
        let status = e.status().as_u16();
        if e.status().is_server_error() {
            warn!(request_id, trace_id, span_id, method, path, status, "request failed: {e}");
        } else {
            debug!(request_id, trace_id, span_id, method, path, status, "request refused: {e}");
        }
    }

    /// The request answered: its access line (log.access_log), and its span ended with
    /// `attributes` (and `error`, the server's failure, if any).
    pub fn close(self, state: &AppState, answered: Answered, attributes: Vec<KeyValue>, error: Option<String>) {
        if state.access_log {
            let (trace_id, span_id) = self.trace_ids();
            let Answered { peer, method, path, model, status, bytes, key, refused } = answered;
            info!(
                target: "inferd::access",
                client = peer.map(|p| p.to_string()),
                method,
                path,
                status,
                bytes,
                duration_ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0,
                model,
                worker = state.worker,
                request_id = self.id.to_str().unwrap_or_default(),
                trace_id = trace_id.as_deref(),
                span_id = span_id.as_deref(),
                key = key.unwrap_or_default(),
                auth_refused = refused,
                "{method} {path} {status}"
            );
        }
        if let Some(cx) = &self.span {
            inferd_telemetry::end_span(cx, attributes, error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn deadlines_come_from_either_header_and_the_earlier_wins() {
        let now = Instant::now();
        let at = deadline(&headers(&[("grpc-timeout", "1500m")])).unwrap().unwrap();
        assert!(at >= now + Duration::from_millis(1500) && at < now + Duration::from_secs(60));
        assert!(deadline(&headers(&[("grpc-timeout", "2H")])).unwrap().unwrap() >= now + Duration::from_secs(7200));
        let both = deadline(&headers(&[("grpc-timeout", "2H"), (DEADLINE_HEADER, "250")])).unwrap().unwrap();
        assert!(both < now + Duration::from_secs(60), "the earlier of the two");
        assert_eq!(deadline(&HeaderMap::new()).unwrap(), None);
        for bad in ["", "m", "123456789m", "10x", "-5S", "1.5S"] {
            let refused = deadline(&headers(&[("grpc-timeout", bad)])).unwrap_err().to_string();
            assert!(refused.contains("grpc-timeout") && refused.contains("1-8 digits"), "{bad}: {refused}");
        }
        for bad in ["", "soon", "-1", "1.5"] {
            let refused = deadline(&headers(&[(DEADLINE_HEADER, bad)])).unwrap_err().to_string();
            assert!(refused.contains("whole number of milliseconds"), "{bad}: {refused}");
        }
    }

    #[test]
    fn cache_control_asks_for_a_fresh_answer_by_either_directive() {
        for fresh in ["no-cache", "No-Store", "max-age=0, no-cache"] {
            assert!(no_cache(Some(&HeaderValue::from_static(fresh))), "{fresh}");
        }
        for cached in ["max-age=60", "public", ""] {
            assert!(!no_cache(Some(&HeaderValue::from_static(cached))), "{cached}");
        }
        assert!(!no_cache(None));
    }
}
