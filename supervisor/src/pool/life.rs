//! The pool's life: its start, its boot, its stop.

use std::time::Instant;

use super::SupervisorError;

/// The pool's life: its start, its boot, its stop.
pub(super) struct Life {
    pub(super) started: Instant,
    /// The same, in seconds since the Unix epoch (`process_start_time_seconds`).
    pub(super) started_unix: f64,
    /// True once every slot has been ready at the same time.
    pub(super) booted: bool,
    /// SIGTERM, SIGINT, SIGQUIT or a fatal error: the pool is going down (the phase, derived
    /// in [`Supervisor::phase`], says Stopping from then on).
    pub(super) stopping: bool,
    pub(super) stop_deadline: Option<Instant>,
    pub(super) killed_all: bool,
    pub(super) fatal: Option<SupervisorError>,
}

impl Life {
    pub(super) fn new() -> Life {
        Life {
            started: Instant::now(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            booted: false,
            stopping: false,
            stop_deadline: None,
            killed_all: false,
            fatal: None,
        }
    }
}

impl Life {
    /// Booted and not stopping: operator actions may change the pool.
    pub(super) fn settled(&self) -> bool {
        self.booted && !self.stopping
    }
}
