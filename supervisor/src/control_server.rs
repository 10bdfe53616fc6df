//! The control socket's server side: the socket, mode 0600, and its connections, each one
//! JSON request line in and one or more JSON response lines out (the protocol: `control`).
//! Only the user running inferd (or root) is answered; the peer's uid is checked with
//! SO_PEERCRED on top of the file mode. A request only becomes an [`Event::Control`]: the
//! loop answers it.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tracing::warn;

use crate::control::{ActionError, ControlError, Request, Response};
use crate::event::Event;

/// Creates the socket (and its folder), replacing a stale file left by a dead server.
pub fn bind(path: &Path) -> Result<UnixListener, ControlError> {
    let io = |error| ControlError::Io { path: path.to_path_buf(), error };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ControlError::InUse(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(io)?;
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

/// The next connection `accept` gives. A failed accept (no descriptors left, say) is logged
/// and retried after 100 ms instead of at once: the supervisor's listeners share its only
/// thread, which a spinning accept loop would take.
pub(crate) async fn accept_patiently<T, F: Future<Output = std::io::Result<T>>>(
    listener: &str,
    mut accept: impl FnMut() -> F,
) -> T {
    loop {
        match accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                warn!("{listener}: accept failed ({e}); retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Accepts control connections and turns each request into an [`Event::Control`].
pub async fn serve(listener: UnixListener, events: mpsc::UnboundedSender<Event>) {
    loop {
        let (stream, _) = accept_patiently("control socket", || listener.accept()).await;
        let events = events.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, events).await {
                warn!("control connection: {e}");
            }
        });
    }
}

async fn answer(stream: UnixStream, events: mpsc::UnboundedSender<Event>) -> std::io::Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    let peer = stream.peer_cred()?.uid();
    let (read, mut write) = stream.into_split();
    let (replies, mut answers) = mpsc::unbounded_channel();
    // A refusal is the one answer: its sender goes with it, so the loop below ends after it.
    let refuse = |replies: mpsc::UnboundedSender<Response>, error: ActionError| {
        let _ = replies.send(Response::error(error.to_string()));
    };
    if peer != me && peer != 0 {
        refuse(replies, ActionError::NotYours { peer, me });
    } else {
        let mut line = String::new();
        // One request line of at most 64 KiB: a client cannot make the supervisor buffer more.
        let mut reader = tokio::io::BufReader::new(tokio::io::AsyncReadExt::take(read, 64 * 1024));
        match tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await {
            Err(_) => refuse(replies, ActionError::NoRequest),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
                Err(e) => refuse(replies, ActionError::BadRequest(e)),
                Ok(request) => {
                    if let Err(mpsc::error::SendError(Event::Control(_, replies))) =
                        events.send(Event::Control(request, replies))
                    {
                        refuse(replies, ActionError::ShuttingDown);
                    }
                }
            },
        }
    }
    while let Some(response) = answers.recv().await {
        let mut line = serde_json::to_vec(&response).expect("responses serialise");
        line.push(b'\n');
        write.write_all(&line).await?;
    }
    write.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A request that is refused gets its one answer and the connection ends: nothing waits
    /// for a reply that cannot come.
    #[tokio::test]
    async fn a_refused_request_is_answered_and_its_connection_closed() {
        let (events, _queue) = mpsc::unbounded_channel();
        for request in ["not json\n", "{\"command\": \"fly\"}\n"] {
            let (mut client, server) = UnixStream::pair().unwrap();
            let served = tokio::spawn(answer(server, events.clone()));
            client.write_all(request.as_bytes()).await.unwrap();
            let mut text = String::new();
            tokio::time::timeout(Duration::from_secs(10), client.read_to_string(&mut text))
                .await
                .expect("the connection was left open after the refusal")
                .unwrap();
            assert!(text.contains("error") && text.ends_with('\n') && text.lines().count() == 1, "{text:?}");
            served.await.unwrap().unwrap();
        }
    }
}
