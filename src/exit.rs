//! How a command ends: every error `serve`, `check`, `reload`, `scale` and `status` can end
//! with, and the one mapping from it to the exit code that scripts and systemd read
//! (docs/operations.md, "Exit codes"; the unit's RestartPreventExitStatus lists 3, 4 and 78).

use std::process::ExitCode;

use inferd_config::ConfigError;
use inferd_ipc::spec::{EXIT_BOOT, EXIT_CONFIG, EXIT_MODEL_LOAD};
use inferd_supervisor::control::ControlError;
use inferd_supervisor::plan::ResolveError;
use inferd_supervisor::SupervisorError;
use inferd_worker::load::NotLoaded;
use inferd_worker::runtime::model::ModelError;

/// Exit code of a client command that the server answered with no (see `control`).
pub use inferd_supervisor::control::EXIT_ANSWERED_NO;

#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The configuration, its models' files, the CPU plan or the ONNX Runtime library.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The running pool ended with an error.
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    /// `check` loading ONNX Runtime or a model as a worker would.
    #[error("{context}: {error}")]
    Model { context: String, error: NotLoaded },
    /// A control-socket command.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Anything else: an I/O error, a bad argument value.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl From<ConfigError> for Failure {
    fn from(error: ConfigError) -> Failure {
        Failure::Resolve(ResolveError::Config(error))
    }
}

impl From<std::io::Error> for Failure {
    fn from(error: std::io::Error) -> Failure {
        Failure::Other(error.into())
    }
}

impl Failure {
    pub fn code(&self) -> i32 {
        match self {
            Failure::Resolve(ResolveError::Config(ConfigError::Model { .. })) => EXIT_MODEL_LOAD,
            Failure::Resolve(ResolveError::Config(_) | ResolveError::Plan(_)) => EXIT_CONFIG,
            Failure::Resolve(ResolveError::OrtLibrary(_)) => EXIT_BOOT,
            Failure::Supervisor(error) => match error {
                SupervisorError::ModelLoad { .. } => EXIT_MODEL_LOAD,
                SupervisorError::Boot { .. } | SupervisorError::Port(_) | SupervisorError::Control(_) => EXIT_BOOT,
                SupervisorError::Memory(_) | SupervisorError::PortHeld(_) => EXIT_CONFIG,
                SupervisorError::Io(_) => 1,
            },
            Failure::Model { error: NotLoaded::Model(ModelError::Runtime { .. }), .. } => EXIT_BOOT,
            Failure::Model { .. } => EXIT_MODEL_LOAD,
            Failure::Control(error) => error.exit_code(),
            Failure::Other(_) => 1,
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(self.code() as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_failure_has_its_documented_code() {
        let config = Failure::from(ConfigError::NotFound);
        assert_eq!(config.code(), 78);
        let model = Failure::from(ConfigError::Model { model: "m".into(), message: "no model.onnx".into() });
        assert_eq!(model.code(), 3);
        let port = Failure::from(SupervisorError::Port("cannot listen on 127.0.0.1:1".into()));
        assert_eq!(port.code(), 4);
        let runtime = Failure::Model {
            context: "check".into(),
            error: ModelError::Runtime { path: "/x".into(), message: "not a library".into() }.into(),
        };
        assert_eq!(runtime.code(), 4);
        assert_eq!(Failure::from(ControlError::Refused("a reload is running".into())).code(), 2);
        let gone = ControlError::NotRunning { path: "/s".into(), error: std::io::ErrorKind::NotFound.into() };
        assert_eq!(Failure::from(gone).code(), 1);
    }
}
