//! How the pool ends with an error: the [`SupervisorError`] that `inferd serve` exits with.

use crate::control::ControlError;

/// How the pool ends with an error; `inferd serve` exits with the code src/exit.rs maps it to.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("worker {slot} could not load its model: {error}")]
    ModelLoad { slot: usize, error: String },
    #[error("worker {slot} failed to start: {error}")]
    Boot { slot: usize, error: String },
    #[error("memory plan: {0}")]
    Memory(String),
    /// The port (or the gRPC port) cannot be bound.
    #[error("{0}")]
    Port(String),
    /// Another server listens on the address already.
    #[error(transparent)]
    PortHeld(#[from] crate::port::Held),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
