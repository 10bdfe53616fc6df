//! What a worker tells its supervisor: [`WorkerMessage`] lines on their socketpair, and why
//! a boot failed ([`Failure`]).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use inferd_ipc::spec::{FailureKind, WorkerMessage};
use tracing::warn;

/// Writes [`WorkerMessage`] lines to the supervisor. Writes are small and the supervisor reads
/// continuously; a 1 s write timeout keeps a stopped supervisor from blocking the worker.
pub(super) struct Reporter(pub(super) Mutex<UnixStream>);

impl Reporter {
    pub(super) fn send(&self, message: &WorkerMessage) {
        let mut line = serde_json::to_vec(message).expect("messages serialise");
        line.push(b'\n');
        let mut stream = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = stream.write_all(&line) {
            warn!("cannot report to the supervisor: {e}");
        }
    }
}

pub(super) struct Failure {
    pub(super) kind: FailureKind,
    pub(super) error: String,
}

pub(super) fn failure(kind: FailureKind) -> impl FnOnce(String) -> Failure {
    move |error| Failure { kind, error }
}
