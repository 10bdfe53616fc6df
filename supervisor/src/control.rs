//! The control socket's protocol and its client: one JSON request line in and one or more
//! JSON response lines out per connection (the server side, which turns a request into an
//! event for the loop: `control_server`), and why the supervisor says no to an action.
//!
//! Requests (`command` is the tag):
//! - `{"command":"status"}`
//! - `{"command":"reload","model":"minilm","path":"/models/minilm-v2","wait":true}` (all optional)
//! - `{"command":"scale","delta":1}`
//! - `{"command":"load","model":"reranker","path":"/models/reranker"}` (path optional) and
//!   `{"command":"unload","model":"reranker"}`: Triton's repository extension (see `admin`);
//!   both answer once every worker runs the new model list.
//! - `{"command":"upgrade","binary":"/usr/bin/inferd"}` (binary optional): answers once the
//!   new supervisor serves, or with why it could not.
//!
//! Responses: zero or more progress lines `{"ok":true,"progress":"worker 1 of 2 ready ..."}`,
//! then one final line: `{"ok":true,"status":{...}}`, `{"ok":true,"message":"..."}` or
//! `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::confine::Unconfined;
use crate::plan::cpu::PlanError;
use crate::status::PoolStatus;
use crate::tcp::PortError;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    Status,
    Reload {
        /// The model to swap; with `path`, required unless the server has one model.
        #[serde(default)]
        model: Option<String>,
        /// A model folder (with model.toml) or an ONNX file; without it the models are read
        /// again from the repository (a forced recycle when nothing changed).
        #[serde(default)]
        path: Option<PathBuf>,
        /// Stream progress until the last worker is replaced; otherwise answer once the new
        /// models have passed validation in the first new worker.
        #[serde(default)]
        wait: bool,
    },
    Scale {
        delta: i32,
    },
    /// Serve `model` in every worker: read again (from `path` when given) if the pool serves
    /// it, else added from the repository (or the folder `path`). A rolling reload.
    Load {
        model: String,
        #[serde(default)]
        path: Option<PathBuf>,
        /// Settings over the model's own until its next load (a Triton configuration's).
        #[serde(default)]
        config: Option<inferd_config::model::ModelOverride>,
    },
    /// Stop serving `model` (not the default one): a rolling reload without it.
    Unload {
        model: String,
    },
    /// Upgrade inferd itself: start `binary` (by default the one this supervisor was started
    /// from) as the new supervisor on this one's sockets, and hand over once it is ready.
    Upgrade {
        #[serde(default)]
        binary: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<PoolStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With `error`: the request was refused before anything changed (an unknown model, a
    /// reload already running, a file that cannot be used), rather than failing on the way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refused: bool,
}

impl Response {
    pub fn error(message: impl Into<String>) -> Response {
        Response { ok: false, error: Some(message.into()), ..Response::default() }
    }

    /// The request cannot be carried out as asked; nothing changed.
    pub fn refused(message: impl Into<String>) -> Response {
        Response { refused: true, ..Response::error(message) }
    }

    pub fn message(message: impl Into<String>) -> Response {
        Response { ok: true, message: Some(message.into()), ..Response::default() }
    }

    pub fn progress(message: impl Into<String>) -> Response {
        Response { ok: true, progress: Some(message.into()), ..Response::default() }
    }
}

/// Where the supervisor's answers to one request go; dropping it ends the connection.
pub type Replies = mpsc::UnboundedSender<Response>;

/// Exit code of a client command (`status`, `reload`, `scale`, `upgrade`) that no server
/// answered.
pub const EXIT_NO_SERVER: i32 = 1;
/// Exit code of a client command that the server answered with no: an action refused or
/// failed (the pool serves as before), a degraded pool for `status`.
pub const EXIT_ANSWERED_NO: i32 = 2;

/// The actions that replace every worker, one by one, as a rolling reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Roll {
    Reload,
    Load,
    Unload,
}

impl std::fmt::Display for Roll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Roll::Reload => "reload",
            Roll::Load => "load",
            Roll::Unload => "unload",
        })
    }
}

/// Why the supervisor said no to an action (reload, load, unload, scale, upgrade), refused
/// whole before anything changed, or to a control connection. Its text is the answer's
/// `error`, sent with `refused` (the admin listener answers it with 400); [`ActionError::exit_code`]
/// is what `inferd reload`, `scale` and `upgrade` exit with for it.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("{0} refused: the pool is starting or stopping")]
    NotSettled(Roll),
    #[error("{0} refused: a reload is already in progress")]
    Rolling(Roll),
    #[error("{0} refused: worker {1} is still draining from the last scale -1; retry once it is gone")]
    Draining(Roll, usize),
    #[error(
        "load refused: {} is not a model folder (a model the server does not serve yet needs its folder: a model.toml, or a published model's files)",
        .0.display()
    )]
    NotAModelFolder(PathBuf),
    #[error("unload refused: this server does not serve a model '{0}'")]
    NotServed(String),
    #[error("unload refused: '{0}' is the default model (models.default), which requests without a model name go to")]
    DefaultModel(String),
    #[error("reload refused: this server has no model '{0}'")]
    NoSuchModel(String),
    #[error("reload refused: --path needs --model when the server has several models")]
    PathNeedsModel,
    /// A model, or the API keys and certificate the new workers would take, cannot be used.
    #[error("{0} refused: {1}")]
    Config(Roll, inferd_config::ConfigError),
    #[error("reload refused: {0}")]
    Unconfined(#[from] Unconfined),
    #[error("scale refused: the pool is starting, reloading or stopping")]
    ScaleNotNow,
    #[error("scale refused: worker {0} is still draining from the last scale -1")]
    ScaleDraining(usize),
    #[error("scale +1 refused: {0}")]
    NoCores(#[from] PlanError),
    #[error("scale +1 refused: {0}")]
    NoPort(#[from] PortError),
    #[error("scale -1 refused: the pool cannot go below 1 worker")]
    LastWorker,
    #[error("scale refused: the step is +1 or -1, not {0}")]
    Step(i32),
    #[error("an upgrade is in progress (to pid {0}): nothing else changes until it ends")]
    DuringUpgrade(u32),
    #[error("the pool is stopping")]
    Stopping,
    #[error("an upgrade is in progress (to pid {0})")]
    Upgrading(u32),
    #[error("this supervisor is taking over from another: wait until it has")]
    TakingOver,
    #[error("this supervisor has handed over to pid {0}")]
    HandedOver(u32),
    #[error("a reload is in progress: upgrade when it is done")]
    ReloadFirst,
    #[error("the pool has not been ready yet")]
    NotReadyYet,
    #[error("{} is not a file", .0.display())]
    NotAFile(PathBuf),
    #[error("{}: {error}", binary.display())]
    NoBinary { binary: PathBuf, error: std::io::Error },
    #[error("the control socket is not this supervisor's to hand over")]
    NotOurSocket,
    /// The channel to the new supervisor, or a descriptor for it, could not be made.
    #[error("{0}")]
    Channel(std::io::Error),
    #[error("cannot make a pipe: {0}")]
    Pipe(std::io::Error),
    #[error("cannot start {}: {error}", binary.display())]
    CannotStart { binary: PathBuf, error: std::io::Error },
    #[error("cannot start {}: its pid never came ({error})", binary.display())]
    NoPid { binary: PathBuf, error: std::io::Error },
    #[error("permission denied: uid {peer} may not control this inferd (run as uid {me})")]
    NotYours { peer: u32, me: u32 },
    #[error("timed out waiting for a request line")]
    NoRequest,
    #[error("bad request: {0}")]
    BadRequest(serde_json::Error),
    #[error("the supervisor is shutting down")]
    ShuttingDown,
}

impl ActionError {
    /// What the `inferd` command that asked exits with (src/exit.rs): every answer of no is
    /// [`EXIT_ANSWERED_NO`].
    pub fn exit_code(&self) -> i32 {
        EXIT_ANSWERED_NO
    }
}

impl From<ActionError> for Response {
    /// The final answer: refused, nothing changed.
    fn from(error: ActionError) -> Response {
        Response::refused(error.to_string())
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

impl ControlError {
    /// What the `inferd` command exits with (src/exit.rs): the server said no
    /// ([`ActionError::exit_code`]), or no server answered.
    pub fn exit_code(&self) -> i32 {
        match self {
            ControlError::Refused(_) => EXIT_ANSWERED_NO,
            ControlError::InUse(_)
            | ControlError::Io { .. }
            | ControlError::NotRunning { .. }
            | ControlError::BadAnswer(_) => EXIT_NO_SERVER,
        }
    }
}

/// Client side, used by the `inferd` commands: sends one request, calls `progress` for each
/// progress line, and returns the final response (an error response becomes `Err`).
pub fn query(path: &Path, request: &Request, mut progress: impl FnMut(&str)) -> Result<Response, ControlError> {
    let io = |error| ControlError::Io { path: path.to_path_buf(), error };
    let mut stream = std::os::unix::net::UnixStream::connect(path).map_err(|error| match error.kind() {
        std::io::ErrorKind::PermissionDenied => ControlError::Refused(format!(
            "permission denied: control socket {} belongs to another user (mode 0600); run as that user or root",
            path.display()
        )),
        _ => ControlError::NotRunning { path: path.to_path_buf(), error },
    })?;
    let mut line = serde_json::to_vec(request).expect("requests serialise");
    line.push(b'\n');
    stream.write_all(&line).map_err(io)?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut answer = String::new();
        if reader.read_line(&mut answer).map_err(io)? == 0 {
            return Err(ControlError::BadAnswer("the server closed the connection without an answer".into()));
        }
        let response: Response =
            serde_json::from_str(&answer).map_err(|e| ControlError::BadAnswer(format!("{e}: {answer:?}")))?;
        match (&response.progress, response.ok, &response.error) {
            (Some(p), true, _) => progress(p),
            (_, false, Some(error)) => return Err(ControlError::Refused(error.clone())),
            _ => return Ok(response),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_action_refused_is_answered_in_its_words_and_exits_with_2() {
        let refused = [
            (ActionError::Rolling(Roll::Load), "load refused: a reload is already in progress"),
            (ActionError::NoSuchModel("m".into()), "reload refused: this server has no model 'm'"),
            (ActionError::LastWorker, "scale -1 refused: the pool cannot go below 1 worker"),
            (ActionError::Step(3), "scale refused: the step is +1 or -1, not 3"),
            (ActionError::Upgrading(7), "an upgrade is in progress (to pid 7)"),
            (ActionError::DuringUpgrade(7), "an upgrade is in progress (to pid 7): nothing else changes until it ends"),
        ];
        for (error, text) in refused {
            assert_eq!(error.exit_code(), 2);
            let response = Response::from(error);
            assert_eq!((response.ok, response.refused, response.error.as_deref()), (false, true, Some(text)));
            assert_eq!(ControlError::Refused(text.into()).exit_code(), EXIT_ANSWERED_NO);
        }
    }
}
