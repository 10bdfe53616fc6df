//! The control socket: a Unix stream socket, mode 0600, one JSON request line in and one JSON
//! response line out per connection. Only the user running inferd (or root) is answered; the
//! peer's uid is checked with SO_PEERCRED on top of the file mode.
//!
//! Requests: `{"command":"status"}`. Responses: `{"ok":true,"status":{...}}` or
//! `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::status::PoolStatus;
use crate::Event;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    Status,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<PoolStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn error(message: impl Into<String>) -> Response {
        Response { ok: false, status: None, error: Some(message.into()) }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("another inferd is already running with control socket {0}")]
    InUse(PathBuf),
    #[error("control socket {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("inferd is not running: nothing listens on control socket {path} ({error})")]
    NotRunning { path: PathBuf, error: std::io::Error },
    #[error("bad answer from the control socket: {0}")]
    BadAnswer(String),
    #[error("{0}")]
    Refused(String),
}

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

/// Accepts control connections and turns each request into an [`Event::Control`].
pub async fn serve(listener: UnixListener, events: mpsc::UnboundedSender<Event>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
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
    let response = if peer != me && peer != 0 {
        Response::error(format!("permission denied: uid {peer} may not control this inferd (run as uid {me})"))
    } else {
        let mut line = String::new();
        let mut reader = tokio::io::BufReader::new(read);
        match tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await {
            Err(_) => Response::error("timed out waiting for a request line"),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
                Err(e) => Response::error(format!("bad request: {e}")),
                Ok(request) => {
                    let (reply, answer) = oneshot::channel();
                    if events.send(Event::Control(request, reply)).is_err() {
                        Response::error("the supervisor is shutting down")
                    } else {
                        answer.await.unwrap_or_else(|_| Response::error("the supervisor is shutting down"))
                    }
                }
            },
        }
    };
    let mut line = serde_json::to_vec(&response).expect("responses serialise");
    line.push(b'\n');
    write.write_all(&line).await?;
    write.shutdown().await
}

/// Client side, used by `inferd status`: one request, one response.
pub fn query(path: &Path, request: &Request) -> Result<Response, ControlError> {
    let io = |error| ControlError::Io { path: path.to_path_buf(), error };
    let mut stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|error| ControlError::NotRunning { path: path.to_path_buf(), error })?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(io)?;
    let mut line = serde_json::to_vec(request).expect("requests serialise");
    line.push(b'\n');
    stream.write_all(&line).map_err(io)?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).map_err(io)?;
    let response: Response =
        serde_json::from_str(&answer).map_err(|e| ControlError::BadAnswer(format!("{e}: {answer:?}")))?;
    match (response.ok, &response.error) {
        (false, Some(error)) => Err(ControlError::Refused(error.clone())),
        _ => Ok(response),
    }
}
