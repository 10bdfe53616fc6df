//! Request bodies received whole within the worker's limits: `server.max_body_bytes`, the
//! bytes in flight (`server.max_body_bytes_in_flight`), `server.body_timeout_secs`, at most
//! [`MAX_CHUNKS`] chunks, and a compressed body inflated within the same limit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::Request;
use opentelemetry::KeyValue;

use crate::http::encoding::{DecodeError, Encoding};
use crate::request::app::AppState;
use crate::request::error::{ApiError, OverLimit};

/// Set once a request's body has been read whole: a request whose body was left unread is
/// answered with `Connection: close` (see `http::handle`).
#[derive(Clone, Default)]
pub struct Read(pub Arc<AtomicBool>);

impl Read {
    pub fn done(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A request's whole body, refusing more than `server.max_body_bytes` (early when
/// Content-Length says so), inflated when it came compressed; and its share of the worker's
/// body-bytes budget, held until the request is done.
pub struct Body {
    pub bytes: Bytes,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Most non-empty chunks a chunked body may come in (Triton's `kMaxChunkedChunks`, and its
/// words past it): each costs a frame's work whatever its size, so a body of one-byte chunks
/// would cost far more than its bytes. Counted as the data frames hyper yields, which are the
/// chunks as sent unless the network splits one across reads (then it counts twice).
pub const MAX_CHUNKS: usize = 65536;

/// `request`'s body ([`Body`]): it must arrive within `server.body_timeout_secs` (408) and
/// by the request's `deadline` (504); past `server.max_body_bytes`, [`OverLimit`].
pub async fn receive(
    state: &AppState,
    request: Request<Incoming>,
    deadline: Option<Instant>,
) -> Result<Body, ApiError> {
    let limit = state.max_body_bytes;
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let too_large = |inflated| ApiError::from(OverLimit { declared, inflated, limit });
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large(false));
    }
    let content_encoding = request.headers().get(hyper::header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("?"));
    let encoding = Encoding::from_header(content_encoding).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    // Bodies being read or held by this worker may not add up past its budget: many large
    // requests at once get a fast 503 instead of exhausting memory. A compressed body is
    // charged for what it inflates to as it grows, a mebibyte at a time.
    let overloaded = || no_room(state);
    let claim = declared.unwrap_or(limit).max(1).min(u32::MAX as u64) as u32;
    let mut budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| overloaded())?;
    let read = request.extensions().get::<Read>().cloned();
    let chunked = request.headers().get(TRANSFER_ENCODING).is_some_and(|v| v.as_bytes().ends_with(b"chunked"));
    let mut stage = crate::trace::Stage::start("read body");
    let collect = gather(Limited::new(request.into_body(), limit as usize), declared, chunked);
    let timeout = state.body_timeout;
    let begun = Instant::now();
    let due = deadline.filter(|&d| d < begun + timeout);
    let bytes = tokio::time::timeout_at(due.unwrap_or(begun + timeout).into(), collect)
        .await
        .map_err(|_| match due {
            Some(_) => ApiError::DeadlineExceeded(format!(
                "the request's deadline passed after {:?} while its body arrived; it never reached the model",
                begun.elapsed()
            )),
            None => ApiError::Timeout(format!(
                "the request body did not arrive within {timeout:?} (server.body_timeout_secs)"
            )),
        })?
        .map_err(|e| match e {
            Gathered::Chunks => ApiError::BadRequest(format!(
                "Chunked request body exceeds maximum of {MAX_CHUNKS} non-empty chunks. Send fewer or larger HTTP chunks."
            )),
            Gathered::Read(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => too_large(false),
            Gathered::Read(e) => ApiError::BadRequest(format!("could not read the request body: {e}")),
        })?;
    if let Some(read) = read {
        read.0.store(true, Ordering::Relaxed);
    }
    stage.set(KeyValue::new("http.request.body.size", bytes.len() as i64));
    let bytes = match encoding {
        Encoding::Identity => bytes,
        // Inflating megabytes takes milliseconds: off the I/O thread.
        _ => {
            let pool = state.body_budget.clone();
            let (inflated, grown) =
                tokio::task::spawn_blocking(move || inflate_charged(encoding, &bytes, limit, &pool))
                    .await
                    .map_err(|e| ApiError::Internal(format!("inflating the request body: {e}")))?
                    .map_err(|e| match e {
                        DecodeError::TooLarge(_) => too_large(true),
                        DecodeError::NoRoom => overloaded(),
                        _ => ApiError::BadRequest(e.to_string()),
                    })?;
            if let Some(grown) = grown {
                budget.merge(grown);
            }
            Bytes::from(inflated)
        }
    };
    Ok(Body { bytes, _budget: budget })
}

/// Why a body could not be gathered: the connection's error (or the limit's), or too many chunks.
enum Gathered {
    Read(Box<dyn std::error::Error + Send + Sync>),
    Chunks,
}

/// `body`'s bytes in one buffer, copied from each frame as it comes (a frame's buffer is not
/// kept: a list of a million one-byte frames would hold far more than their bytes); a chunked
/// body of more than [`MAX_CHUNKS`] chunks is refused as it passes them.
async fn gather(mut body: Limited<Incoming>, declared: Option<u64>, chunked: bool) -> Result<Bytes, Gathered> {
    // The declared length, up to a mebibyte, up front; past it the buffer grows as bytes come.
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
    let mut chunks = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(Gathered::Read)?.into_data() else { continue };
        if data.is_empty() {
            continue;
        }
        chunks += 1;
        if chunked && chunks > MAX_CHUNKS {
            return Err(Gathered::Chunks);
        }
        bytes.extend_from_slice(&data);
    }
    Ok(Bytes::from(bytes))
}

/// A request refused because the worker's body budget (`server.max_body_bytes_in_flight`)
/// has no room for it now: 503, retry shortly.
pub fn no_room(state: &AppState) -> ApiError {
    ApiError::Overloaded(format!(
        "too many request bytes in flight on this worker (server.max_body_bytes_in_flight = {}); retry shortly",
        state.body_budget_total
    ))
}

/// `body` inflated within `limit` (blocking: call it off the I/O thread), each mebibyte of it
/// charged to the worker's `budget` before it is held; the charge comes back with it
/// ([`DecodeError::NoRoom`] where the budget has no more).
pub fn inflate_charged(
    encoding: Encoding,
    body: &[u8],
    limit: u64,
    budget: &Arc<tokio::sync::Semaphore>,
) -> Result<(Vec<u8>, Option<tokio::sync::OwnedSemaphorePermit>), DecodeError> {
    let mut grown: Option<tokio::sync::OwnedSemaphorePermit> = None;
    let inflated = encoding.decode(body, limit, |more| {
        let Ok(more) = budget.clone().try_acquire_many_owned(u32::try_from(more).unwrap_or(u32::MAX)) else {
            return false;
        };
        match &mut grown {
            Some(held) => held.merge(more),
            None => grown = Some(more),
        }
        true
    })?;
    Ok((inflated, grown))
}
