//! Answers compressed where the client asks, in one place per protocol.
//!
//! - HTTP: every answer passes through [`answer`] (called by [`crate::http::handle`]): a
//!   success of an inference route (`Kind::compress`: as Triton, which compresses infer answers
//!   alone; metadata, statistics and the repository's answers never are) of at least
//!   [`MIN_BYTES`] is compressed in the coding the request's
//!   `Accept-Encoding` prefers ([`Encoding::accepted`]: gzip or deflate, as
//!   `tritonclient.http`'s `response_compression_algorithm` asks), with `Content-Encoding` and a
//!   Content-Length that is the compressed body's. Errors are never compressed:
//!   `tritonclient.http` reads an error's body without looking at its `Content-Encoding`.
//! - gRPC: [`grpc_answer`] (called by [`crate::http::grpc::serve`]) mirrors the request: a
//!   call whose message came compressed (`grpc-encoding` gzip or deflate, as tritonclient.grpc's
//!   `compression_algorithm` sends it) and whose `grpc-accept-encoding` lists that coding gets
//!   its answer message compressed the same way (the frame's flag byte 1, `grpc-encoding` on the
//!   answer's headers). grpcio lists `gzip` and `deflate` in every call's
//!   `grpc-accept-encoding`, so that header alone says nothing of what a client wants; Triton
//!   compresses answers only when its operator sets `--grpc-infer-response-compression-level`.
//!   The gRPC spec lets a server compress with any coding the client accepts; inferd does it
//!   where the client showed it wants compression by compressing its own message.
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

use crate::http::encoding::{EncodeError, Encoding};
use crate::http::reply::{held, Reply};
use crate::request::app::AppState;
use crate::request::tasks::off_io_thread;

/// Answers (and gRPC messages) smaller than this go as they are: a body under 1 KiB travels
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

/// The coding a gRPC call's answer may be compressed in: the request message's own
/// `grpc-encoding`, gzip or deflate, when the call's `grpc-accept-encoding` lists it too.
/// Read before the intake takes `grpc-encoding` off the request.
pub fn grpc_accepted(headers: &HeaderMap) -> Encoding {
    let sent = headers.get("grpc-encoding").and_then(|v| v.to_str().ok()).map(str::trim);
    let encoding = match sent {
        Some("gzip") => Encoding::Gzip,
        Some("deflate") => Encoding::Deflate,
        _ => return Encoding::Identity,
    };
    let listed = headers
        .get_all("grpc-accept-encoding")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| coding.trim() == encoding.name());
    match listed {
        true => encoding,
        false => Encoding::Identity,
    }
}

/// A gRPC answer with its message compressed in `encoding` (a unary answer: its one message,
/// then its trailers), when it is one of at least [`MIN_BYTES`]; a trailers-only answer (an
/// error) and any other as they were.
pub async fn grpc_answer(
    state: &AppState,
    encoding: Encoding,
    answer: hyper::Response<tonic::body::Body>,
) -> hyper::Response<tonic::body::Body> {
    if encoding == Encoding::Identity || answer.headers().contains_key("grpc-status") {
        return answer;
    }
    let (mut parts, body) = answer.into_parts();
    let collected = match body.collect().await {
        Ok(collected) => collected,
        // What tonic would have ended the stream with.
        Err(status) => return status.into_http(),
    };
    let trailers = collected.trailers().cloned();
    let data = collected.to_bytes();
    let message = match &data[..] {
        [0, l0, l1, l2, l3, message @ ..]
            if message.len() == u32::from_be_bytes([*l0, *l1, *l2, *l3]) as usize
                && message.len() as u64 >= MIN_BYTES =>
        {
            Some(data.slice(5..))
        }
        _ => None,
    };
    let packed = match message {
        Some(message) => compressed(state, encoding, message, Framing::GrpcMessage).await,
        None => None,
    };
    let data = match packed {
        Some(frame) => {
            parts.headers.insert("grpc-encoding", HeaderValue::from_static(encoding.name()));
            frame
        }
        None => data,
    };
    let body = Full::new(data).with_trailers(std::future::ready(trailers.map(Ok)));
    hyper::Response::from_parts(parts, tonic::body::Body::new(body))
}

/// What the compressed bytes are.
#[derive(Clone, Copy)]
enum Framing {
    /// An HTTP body.
    Body,
    /// A gRPC message, in its frame: flag byte 1 (compressed), its length, then it.
    GrpcMessage,
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
            Framing::GrpcMessage => grpc_frame(encoding, &data),
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

/// `message` compressed in `encoding`, in a gRPC frame of its own.
fn grpc_frame(encoding: Encoding, message: &[u8]) -> Result<Vec<u8>, EncodeError> {
    let mut frame = encoding.encode(message, vec![1, 0, 0, 0, 0])?;
    let size = frame.len().saturating_sub(5);
    let length = u32::try_from(size).map_err(|_| EncodeError::FrameTooLarge(size))?;
    frame[1..5].copy_from_slice(&length.to_be_bytes());
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_call_is_answered_compressed_only_as_its_request_was() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.append(*name, HeaderValue::from_static(value));
            }
            map
        };
        // grpcio's own list, with a message it compressed (tritonclient.grpc compression_algorithm).
        let accepts = ("grpc-accept-encoding", "identity,deflate,gzip");
        assert_eq!(grpc_accepted(&headers(&[accepts, ("grpc-encoding", "gzip")])), Encoding::Gzip);
        assert_eq!(grpc_accepted(&headers(&[accepts, ("grpc-encoding", "deflate")])), Encoding::Deflate);
        // The list alone (every grpcio call sends it) is not a request for compression.
        assert_eq!(grpc_accepted(&headers(&[accepts])), Encoding::Identity);
        assert_eq!(grpc_accepted(&headers(&[accepts, ("grpc-encoding", "identity")])), Encoding::Identity);
        // A coding the client does not say it reads.
        assert_eq!(grpc_accepted(&headers(&[("grpc-encoding", "gzip")])), Encoding::Identity);
        assert_eq!(
            grpc_accepted(&headers(&[("grpc-accept-encoding", "identity, deflate"), ("grpc-encoding", "gzip")])),
            Encoding::Identity
        );
    }

    #[test]
    fn a_grpc_frame_says_compressed_and_its_length() {
        let message = b"0123456789".repeat(300);
        let frame = grpc_frame(Encoding::Gzip, &message).unwrap();
        let length = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
        assert_eq!((frame[0], length), (1, frame.len().saturating_sub(5)));
        assert_eq!(Encoding::Gzip.decode(&frame[5..], 1 << 20, |_| true).unwrap(), message);
    }
}
