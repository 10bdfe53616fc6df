//! models.placement = "pool": the socket a worker takes its siblings' requests on (the
//! sending side, and why requests are forwarded: [`crate::http::forward`]). A sibling's
//! request enters by the same door as any other, marked as forwarded.

use std::net::SocketAddr;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::sync::Arc;

use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::http::forward;
use crate::request::app::AppState;

/// Takes the siblings' requests on this worker's socket at `address` until it drains; each
/// connection holds one of `permits` (server.max_connections, which draining waits for);
/// `drain` ends once the worker drains.
pub fn serve(
    state: Arc<AppState>,
    address: u64,
    http: hyper::server::conn::http1::Builder,
    permits: Arc<Semaphore>,
    drain: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    let listener =
        std::os::unix::net::UnixListener::bind_addr(&UnixAddr::from_abstract_name(forward::socket_name(address))?)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let uid = nix::unistd::geteuid().as_raw();
    tokio::spawn(async move {
        tokio::pin!(drain);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = &mut drain => return,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!("accepting a sibling's request failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            };
            if stream.peer_cred().map_or(true, |c| c.uid() != uid) {
                debug!("refused a connection to the siblings' socket from another user");
                continue;
            }
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                debug!("a sibling's request refused: server.max_connections are open");
                continue;
            };
            let (state, http) = (state.clone(), http.clone());
            tokio::spawn(async move {
                let service = service_fn(move |mut request: Request<hyper::body::Incoming>| {
                    let peer = request
                        .headers_mut()
                        .remove(forward::PEER_HEADER)
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                    request.extensions_mut().insert(forward::Forwarded);
                    crate::http::handle(state.clone(), peer, request)
                });
                if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
                    debug!("a sibling's connection ended: {e}");
                }
                drop(permit);
            });
        }
    });
    Ok(())
}
