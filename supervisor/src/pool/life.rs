//! The pool's life: its start, its boot, its stop.

use std::time::{Duration, Instant};

use super::error::SupervisorError;

/// The pool's life: its start, its boot, its stop.
pub(super) struct Life {
    started: Instant,
    /// The same, in seconds since the Unix epoch (`process_start_time_seconds`).
    started_unix: f64,
    /// True once every slot has been ready at the same time.
    booted: bool,
    /// SIGTERM, SIGINT, SIGQUIT or a fatal error: the pool is going down (the phase, derived
    /// in [`Supervisor::phase`], says Stopping from then on).
    stopping: bool,
    stop_deadline: Option<Instant>,
    killed_all: bool,
    fatal: Option<SupervisorError>,
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

    /// Whether every slot has been ready at the same time once.
    pub(super) fn booted(&self) -> bool {
        self.booted
    }

    /// Whether the pool is going down.
    pub(super) fn stopping(&self) -> bool {
        self.stopping
    }

    pub(super) fn started(&self) -> Instant {
        self.started
    }

    /// When the pool started, in seconds since the Unix epoch.
    pub(super) fn started_unix(&self) -> f64 {
        self.started_unix
    }

    /// Every slot is ready at once: the pool has booted, if it had not and is not stopping.
    /// Returns whether it just did.
    pub(super) fn all_ready(&mut self) -> bool {
        let now = !self.booted && !self.stopping;
        self.booted |= now;
        now
    }

    /// The pool ends with `error` (the first such error is the one it ends with).
    pub(super) fn fail(&mut self, error: SupervisorError) {
        if self.fatal.is_none() {
            self.fatal = Some(error);
        }
    }

    /// The error the pool ended with, once.
    pub(super) fn take_fatal(&mut self) -> Option<SupervisorError> {
        self.fatal.take()
    }

    /// The pool stops, its workers given `grace` (their own, plus a margin for the supervisor
    /// before it stops waiting). Returns whether it was not stopping yet.
    pub(super) fn stop(&mut self, grace: Duration) -> bool {
        if self.stopping {
            return false;
        }
        self.stopping = true;
        self.stop_deadline = Some(Instant::now() + grace + Duration::from_secs(2));
        true
    }

    /// Every worker was sent SIGKILL.
    pub(super) fn killed_all(&mut self) {
        self.killed_all = true;
    }

    /// Whether the grace period is over at `now` and the remaining workers are to be killed
    /// (once).
    pub(super) fn kill_now(&mut self, now: Instant) -> bool {
        let due = self.stop_deadline.is_some_and(|d| now >= d) && !self.killed_all;
        self.killed_all |= due;
        due
    }
}
