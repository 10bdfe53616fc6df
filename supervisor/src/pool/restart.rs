//! The restart policy: how a dead worker's exit is told, and how soon its slot starts the
//! next one. A worker that reports a model-load or boot failure before the pool was ever
//! ready stops the whole server with that error; later, the slot is retried with backoff
//! while the others keep serving. And the loop's tick, which paces the escalation of a
//! stuck worker.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::Signal;

/// The loop's tick: how often it starts the workers due, kills stuck ones and checks the
/// guards; a stuck worker still there a tick after SIGABRT gets SIGKILL.
pub(super) const TICK: Duration = Duration::from_millis(200);
/// A worker that served at least this long, and longer than its own boot took, was not
/// crash-looping: its slot's backoff resets. (Workers killed from outside every couple of
/// seconds are replaced at once; a worker dying right after each boot is backed off.)
pub(super) const STABLE_AFTER: Duration = Duration::from_secs(1);
/// Consecutive deaths of one slot during start-up after which the server gives up.
pub(super) const MAX_BOOT_CRASHES: u32 = 5;
/// After a failed recycling replacement, the slot is not recycled again for this long.
pub(super) const RECYCLE_PAUSE: Duration = Duration::from_secs(30);

/// 0 for the first failure, then 0.5 s doubling up to 30 s.
pub(super) fn backoff(failures: u32) -> Duration {
    match failures {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(500u64.saturating_mul(1 << (n - 2).min(6))).min(Duration::from_secs(30)),
    }
}

pub(super) fn signal_name(signal: i32) -> &'static str {
    Signal::try_from(signal).map(|s| s.as_str()).unwrap_or("signal")
}

pub(super) fn describe_exit(status: Option<ExitStatus>) -> String {
    match status {
        None => "exited (status unknown)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(sig)) => format!("was killed by {}", signal_name(sig)),
            _ => format!("exited ({s})"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let delays: Vec<u64> = (1..=10).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(delays, vec![0, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
    }

    #[test]
    fn exits_are_described() {
        assert_eq!(describe_exit(Some(ExitStatus::from_raw(3 << 8))), "exited with code 3");
        assert_eq!(describe_exit(Some(ExitStatus::from_raw(9))), "was killed by SIGKILL");
    }
}
