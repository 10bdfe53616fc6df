//! Answers as hyper sends them: JSON replies, large JSON answers held against the worker's
//! byte budget until written, and the headers that say how a pipeline ran a request.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use crate::request::app::{AppState, CountedAs};
use crate::request::error::ApiError;
use crate::request::tasks::{off_io_thread, Outcome};

pub type Reply = Response<Full<Bytes>>;

pub fn json_reply(status: StatusCode, body: Vec<u8>) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

impl CountedAs for Reply {
    fn code(&self) -> u16 {
        self.status().as_u16()
    }
}

/// An answer's bytes that hold their share of the worker's byte budget until hyper has sent
/// them (the answer's `Bytes` own them, and are dropped once written or the connection is gone).
struct Held {
    bytes: Vec<u8>,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// `bytes`, holding `budget` until they are sent (large JSON answers, compressed answers).
pub fn held(bytes: Vec<u8>, budget: tokio::sync::OwnedSemaphorePermit) -> Bytes {
    Bytes::from_owner(Held { bytes, _budget: budget })
}

/// A large JSON answer (`/embed_all` gives ~3000 times the bytes of its input, `/tokenize`
/// ~100): `bound`, what its JSON takes at most, is taken from the worker's byte budget
/// (server.max_body_bytes_in_flight, shared with the request bodies) before it is written,
/// 503 when the budget is spent and 413 when it could never fit, and the written JSON holds
/// its share until it has been sent. Written off the I/O thread: a few MB of JSON take
/// milliseconds.
pub async fn large_json<T: serde::Serialize + Send + 'static>(
    state: &AppState,
    value: T,
    bound: u64,
) -> Result<Reply, ApiError> {
    let total = state.body_budget_total;
    if bound > total {
        return Err(ApiError::TooLarge(format!(
            "the answer would take up to {bound} bytes, more than a worker holds at once \
             (server.max_body_bytes_in_flight = {total}); send fewer or shorter inputs"
        )));
    }
    let claim = u32::try_from(bound.max(1)).unwrap_or(u32::MAX);
    let mut budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| {
        ApiError::Overloaded(format!(
            "too many bytes in flight on this worker for an answer of up to {bound} bytes \
             (server.max_body_bytes_in_flight = {total}); retry shortly"
        ))
    })?;
    let json = off_io_thread("writing the answer", move || Ok(serde_json::to_vec(&value).expect("json"))).await?;
    // Only what was written stays claimed.
    drop(budget.split(budget.num_permits().saturating_sub(json.len().max(1))));
    let mut reply = json_reply(StatusCode::OK, Vec::new());
    *reply.body_mut() = Full::new(held(json, budget));
    Ok(reply)
}

/// A pipeline's answer: `body`, JSON, with the headers that say how the pipeline ran it
/// ([`annotate`]).
pub fn ran(body: Vec<u8>, outcome: &Outcome) -> Reply {
    let mut reply = json_reply(StatusCode::OK, body);
    annotate(&mut reply, outcome);
    reply
}

/// `x-inferd-truncated: 0,3` when inputs were truncated, and `Server-Timing` with the time
/// spent preparing the inputs (`prepare`) and in the model (`model`), and of the latter,
/// waiting for a lane (`queue`) and running (`compute`: the whole batch the request joined);
/// what `model` holds beyond both is the answer's way back to the I/O thread.
pub fn annotate<B>(reply: &mut Response<B>, outcome: &Outcome) {
    let headers = reply.headers_mut();
    if !outcome.truncated.is_empty() {
        let list = outcome.truncated.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        if let Ok(v) = HeaderValue::from_str(&list) {
            headers.insert("x-inferd-truncated", v);
        }
    }
    // [cache]: how many rows came from it (only when it was consulted).
    if let Some((hits, rows)) = outcome.cached {
        let said = match hits {
            0 => "miss".to_string(),
            n if n == rows => "hit".to_string(),
            n => format!("partial; hits={n}; rows={rows}"),
        };
        if let Ok(v) = HeaderValue::from_str(&said) {
            headers.insert("x-inferd-cache", v);
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let timing = format!(
        "prepare;dur={:.3}, model;dur={:.3}, queue;dur={:.3}, compute;dur={:.3}",
        ms(outcome.prepare),
        ms(outcome.model),
        ms(outcome.engine.queue),
        ms(outcome.engine.compute)
    );
    if let Ok(v) = HeaderValue::from_str(&timing) {
        headers.insert("server-timing", v);
    }
}
