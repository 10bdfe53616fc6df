//! `models.placement = "pool"`: requests a worker sends to the sibling that holds their model
//! (see [`crate::request::models::Models::elsewhere`]), and the socket it takes its siblings'
//! on.
//!
//! Why forward a request rather than hand its connection over as a retiring worker does
//! (`http::handoff`): the model is known only once hyper has parsed the request (its path, or
//! for OpenAI's route its body), and hyper answers every request it parsed on the connection
//! it read it from. The request is therefore sent whole, over one Unix connection per
//! request, to the sibling's abstract socket `inferd-place-<address>` (its address is random,
//! offered in the pool's table), and the sibling's answer relayed. The sibling serves it as
//! any request (its API keys and counters), except that it never forwards it again (without
//! the model, it loads it itself) and does not apply its key's limits again (this worker
//! admitted it, and holds its place in the key's concurrency until the answer is relayed). A sibling that cannot be reached, or goes away
//! before it answers, leaves the request to this worker. Only a process of this user may
//! connect.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::{HeaderMap, Method, Request, Uri};
use hyper_util::rt::TokioIo;
use tracing::debug;

use crate::http::reply::Reply;
use crate::request::app::AppState;
use crate::request::door::DEADLINE_HEADER;
use crate::request::error::ApiError;

/// Set on a request that reached this worker from a sibling: never forwarded again.
#[derive(Clone, Copy)]
pub struct Forwarded;

/// The client's address, for the sibling's access log (read from a sibling's request only).
pub const PEER_HEADER: &str = "x-inferd-forwarded-for";

/// Headers of one hop that are not relayed.
const HOP: [HeaderName; 3] = [CONNECTION, TRANSFER_ENCODING, HeaderName::from_static("keep-alive")];

/// The abstract socket name of the worker at `address`.
pub fn socket_name(address: u64) -> String {
    format!("inferd-place-{address:016x}")
}

/// A random address for this worker (std's per-process random hasher keys).
pub fn new_address() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id()).max(1)
}

/// A request's head, kept while its body is read.
pub struct Head {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    peer: SocketAddr,
}

impl Head {
    /// `request`'s head, from `peer`.
    pub fn of<B>(request: &Request<B>, peer: SocketAddr) -> Head {
        Head { method: request.method().clone(), uri: request.uri().clone(), headers: request.headers().clone(), peer }
    }
}

/// Whether `request` may be sent to a sibling: placement is on, and it did not come from one.
pub fn forwardable<B>(state: &AppState, request: &Request<B>) -> bool {
    state.models.placed() && request.extensions().get::<Forwarded>().is_none()
}

/// A connection to a sibling, ready for one request.
pub struct Sibling(hyper::client::conn::http1::SendRequest<Full<Bytes>>);

/// Connects to the sibling at `address`; an error: serve the request here.
pub async fn connect(address: u64) -> std::io::Result<Sibling> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr as Address};
    // Non-blocking: a sibling whose queue is full (stuck) is unreachable at once (EAGAIN),
    // never waited for on the I/O thread.
    let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
    let fd = socket(AddressFamily::Unix, SockType::Stream, flags, None)?;
    connect(fd.as_raw_fd(), &Address::new_abstract(socket_name(address).as_bytes())?)?;
    let stream = tokio::net::UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            debug!("a connection to a sibling ended: {e}");
        }
    });
    Ok(Sibling(sender))
}

/// The sibling holding `name` connected, if one holds it (and this worker has no room for it).
pub async fn sibling_for(state: &AppState, name: &str) -> Option<Sibling> {
    let address = state.models.elsewhere(name)?;
    match connect(address).await {
        Ok(sibling) => Some(sibling),
        Err(e) => {
            debug!(model = name, "the sibling holding the model cannot be reached ({e}): served here");
            state.stats.forward(1);
            None
        }
    }
}

/// Sends the request of `head` and `body` to `sibling` and relays its answer. A sibling that
/// goes away before it answers (killed, crashed) leaves the request to this worker: it is
/// sent again to this worker's own socket, which serves it here (inference has no side
/// effect to repeat). Its `deadline` goes with it as the milliseconds left of it.
pub async fn send(
    state: &AppState,
    sibling: Sibling,
    head: Head,
    body: Bytes,
    deadline: Option<Instant>,
) -> Result<Reply, ApiError> {
    let mut headers = head.headers;
    for name in HOP.iter().chain([&CONTENT_LENGTH, &HeaderName::from_static("grpc-timeout")]) {
        headers.remove(name);
    }
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(Instant::now()).as_millis();
        if left == 0 {
            return Err(ApiError::DeadlineExceeded(
                "the request's deadline passed before it reached the worker that holds its model".into(),
            ));
        }
        headers.insert(DEADLINE_HEADER, HeaderValue::from(left as u64));
    }
    if let Ok(peer) = HeaderValue::from_str(&head.peer.to_string()) {
        headers.insert(PEER_HEADER, peer);
    }
    // Traced: the sibling's server span is this request's child.
    crate::trace::inject(&mut headers);
    let request = || {
        let mut request = Request::new(Full::new(body.clone()));
        *request.method_mut() = head.method.clone();
        *request.uri_mut() = head.uri.clone();
        *request.headers_mut() = headers.clone();
        request
    };
    match relay(sibling, request()).await {
        Ok(reply) => {
            state.stats.forward(0);
            return Ok(reply);
        }
        Err(e) => debug!("the sibling holding the model went away before it answered ({e}): served here"),
    }
    state.stats.forward(2);
    let here = match state.models.address() {
        Some(address) => connect(address).await.map_err(|e| e.to_string()),
        None => Err("placement is off".into()),
    };
    let answered = match here {
        Ok(here) => relay(here, request()).await.map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    answered.map_err(|e| {
        ApiError::Overloaded(format!(
            "the worker that held the model went away, and this one cannot serve it ({e}); retry"
        ))
    })
}

/// `request` sent on `sibling`, and its answer, whole.
async fn relay(sibling: Sibling, request: Request<Full<Bytes>>) -> Result<Reply, hyper::Error> {
    let Sibling(mut sender) = sibling;
    let response = sender.send_request(request).await?;
    let (mut parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    for name in &HOP {
        parts.headers.remove(name);
    }
    Ok(Reply::from_parts(parts, Full::new(body)))
}
