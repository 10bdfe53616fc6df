//! Answers compressed where the client asks, in one place.
//!
//! - HTTP: every answer passes through [`answer`] (called by [`crate::http::handle`]): a
//!   success of at least [`MIN_BYTES`] is compressed in the coding the request's
//!   `Accept-Encoding` prefers ([`Encoding::accepted`]: gzip or deflate, as
//!   `tritonclient.http`'s `response_compression_algorithm` asks), with `Content-Encoding` and a
//!   Content-Length that is the compressed body's. Errors are never compressed:
//!   `tritonclient.http` reads an error's body without looking at its `Content-Encoding`.
//!
//! Compressing costs CPU and memory, so it is bounded: it runs off the I/O thread, at flate2's
//! fastest level, and its output claims the worker's byte budget
//! (server.max_body_bytes_in_flight, as a large JSON answer does) for its worst-case size
//! before it is written, then holds what it took until it is sent. With the budget spent the
//! answer goes as it is: compression is never a reason to refuse a request.
// Sizes here are an answer's: every operation on them is checked all the same.
#![deny(clippy::arithmetic_side_effects)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, VARY};
use hyper::{Response, StatusCode};
use tracing::debug;

use crate::http::encoding::Encoding;
use crate::http::reply::{held, Reply};
use crate::request::app::AppState;
use crate::request::tasks::off_io_thread;

/// Answers smaller than this go as they are: a body under 1 KiB travels
/// in one TCP segment compressed or not, and gzip's own 18 bytes and a trip to the blocking
/// pool are not worth what it would save.
pub const MIN_BYTES: u64 = 1024;

/// The coding an HTTP answer may be compressed in, from the request's `Accept-Encoding`.
pub fn accepted(headers: &HeaderMap) -> Encoding {
    Encoding::accepted(headers.get_all(hyper::header::ACCEPT_ENCODING).iter().filter_map(|v| v.to_str().ok()))
}

/// An HTTP answer compressed in `encoding` where it should be (see the module's doc); any
/// other answer as it was. A success that could have been compressed says `Vary:
/// Accept-Encoding`, compressed or not, so that a cache keeps the two apart.
pub async fn answer(state: &AppState, encoding: Encoding, mut reply: Reply) -> Reply {
    let status = reply.status();
    let headers = reply.headers();
    // A sibling's answer relayed (models.placement) was compressed there, or not, already.
    if !status.is_success() || status == StatusCode::NO_CONTENT || headers.contains_key(CONTENT_ENCODING) {
        return reply;
    }
    let varies = headers
        .get_all(VARY)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.to_ascii_lowercase().contains("accept-encoding")));
    if !varies {
        reply.headers_mut().append(VARY, HeaderValue::from_static("accept-encoding"));
    }
    let size = hyper::body::Body::size_hint(reply.body()).exact().unwrap_or(0);
    if encoding == Encoding::Identity || size < MIN_BYTES {
        return reply;
    }
    let (mut parts, body) = reply.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    match compressed(state, encoding, body.clone(), Framing::Body).await {
        Some(packed) => {
            parts.headers.insert(CONTENT_ENCODING, HeaderValue::from_static(encoding.name()));
            // hyper writes the compressed body's length (a relayed answer carried its own).
            parts.headers.remove(CONTENT_LENGTH);
            Response::from_parts(parts, Full::new(packed))
        }
        None => Response::from_parts(parts, Full::new(body)),
    }
}

/// What the compressed bytes are.
#[derive(Clone, Copy)]
enum Framing {
    /// An HTTP body.
    Body,
}

/// `data` compressed in `encoding` and framed, off the I/O thread, holding its share of the
/// worker's byte budget until it is sent; None (send it as it is) when the budget has no room
/// for its worst case, or compressing failed.
async fn compressed(state: &AppState, encoding: Encoding, data: Bytes, framing: Framing) -> Option<Bytes> {
    let bound = Encoding::bound(data.len() as u64).saturating_add(5);
    let claim = u32::try_from(bound).ok();
    let Some(mut budget) = claim.and_then(|n| state.body_budget.clone().try_acquire_many_owned(n).ok()) else {
        debug!(bytes = data.len(), "an answer goes uncompressed: the worker's byte budget has no room for it");
        return None;
    };
    let work = move || {
        Ok(match framing {
            Framing::Body => encoding.encode(&data, Vec::new()),
        })
    };
    let packed = match off_io_thread("compressing the answer", work).await {
        Ok(Ok(packed)) => packed,
        Ok(Err(e)) => {
            debug!("an answer goes uncompressed: {e}");
            return None;
        }
        Err(e) => {
            debug!("an answer goes uncompressed: {e}");
            return None;
        }
    };
    // Only what was written stays claimed.
    drop(budget.split(budget.num_permits().saturating_sub(packed.len().max(1))));
    Some(held(packed, budget))
}
