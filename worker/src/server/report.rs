//! Why a boot failed ([`Failure`]), told to the supervisor in a `WorkerMessage::Failed` line
//! (written by `request::link`).

use inferd_ipc::spec::FailureKind;

pub(super) struct Failure {
    pub(super) kind: FailureKind,
    pub(super) error: String,
}

pub(super) fn failure(kind: FailureKind) -> impl FnOnce(String) -> Failure {
    move |error| Failure { kind, error }
}
