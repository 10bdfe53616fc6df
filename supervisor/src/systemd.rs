//! What systemd and inferd say to each other: the notify protocol (sd_notify(3)) and socket
//! activation (sd_listen_fds(3)). Both are no-ops without systemd: no `NOTIFY_SOCKET`, no
//! `LISTEN_FDS`.
//!
//! The supervisor is the service's main process and the only one that notifies; its workers
//! get neither variable. What it says follows the pool's phase: READY=1 once every worker has
//! been warm at the same time, RELOADING=1 (with MONOTONIC_USEC) while a rolling reload runs
//! and READY=1 after it, STOPPING=1 when it drains. WATCHDOG=1 is sent from the supervisor's
//! own loop (its tick), so a loop that hangs stops the pings and systemd restarts it.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use sd_notify::NotifyState;
use tracing::warn;

use crate::status::Phase;

/// Variables only the supervisor may read: a worker that inherited them could notify for the
/// service or take the socket for its own.
pub const VARIABLES: [&str; 6] =
    ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"];

/// How often STATUS= is refreshed when nothing else changed.
const STATUS_EVERY: Duration = Duration::from_secs(5);
/// While the pool starts, EXTEND_TIMEOUT_USEC is sent this often, asking for this much more.
/// A worker that does not boot is killed by the supervisor's own `boot_timeout_secs`; this
/// only keeps a slow model's warm-up from tripping `TimeoutStartSec=` while the loop is alive.
const EXTEND_EVERY: Duration = Duration::from_secs(5);
const EXTEND_BY: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct Notifier {
    enabled: bool,
    /// Ping interval: a quarter of WATCHDOG_USEC, so that a late tick or two still pings
    /// within half of it.
    watchdog: Option<Duration>,
    last_ping: Option<Instant>,
    status: String,
    status_sent: Option<Instant>,
    extended: Option<Instant>,
    told: Option<Phase>,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET` and `WATCHDOG_USEC`/`WATCHDOG_PID` (for this process only).
    pub fn from_env() -> Notifier {
        let enabled = std::env::var_os("NOTIFY_SOCKET").is_some();
        let mut usec = 0;
        let watchdog =
            (sd_notify::watchdog_enabled(false, &mut usec) && usec > 0).then(|| Duration::from_micros(usec) / 4);
        Notifier {
            enabled,
            watchdog,
            last_ping: None,
            status: String::new(),
            status_sent: None,
            extended: None,
            told: None,
        }
    }

    /// An upgrade handed the service to `pid`: systemd watches it from now on (`MAINPID=`,
    /// accepted from the main process), and this one says nothing more. A last WATCHDOG=1
    /// in the same message (authorised with it) restarts the watchdog's period at the
    /// hand-over, so that the new one has a whole period for its first ping however long ago
    /// this one's last was.
    pub fn hand_over(&mut self, pid: u32) {
        if self.enabled {
            let status = format!("handed over to pid {pid}");
            let mut states = vec![NotifyState::MainPid(pid), NotifyState::Status(&status)];
            if self.watchdog.is_some() {
                states.push(NotifyState::Watchdog);
            }
            if let Err(e) = sd_notify::notify(false, &states) {
                warn!("cannot tell systemd the new main pid {pid}: {e}");
            }
        }
        self.enabled = false;
        self.watchdog = None;
    }

    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Called on every tick of the supervisor's loop and after every event: tells systemd
    /// about a phase change, refreshes STATUS= (`status`: the pool in one line), extends the
    /// start-up timeout while the pool starts, and pings the watchdog when due.
    pub fn update(&mut self, phase: Phase, status: impl FnOnce() -> String) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let mut states = Vec::new();
        let before = self.told.replace(phase);
        if before != Some(phase) {
            let serving = |p: Option<Phase>| matches!(p, Some(Phase::Ready | Phase::Degraded));
            match phase {
                // READY=1 after start-up and after each reload; not between ready and degraded.
                Phase::Ready | Phase::Degraded if !serving(before) => states.push(NotifyState::Ready),
                Phase::Reloading => {
                    states.push(NotifyState::Reloading);
                    match NotifyState::monotonic_usec_now() {
                        Ok(at) => states.push(at),
                        Err(e) => warn!("cannot read the monotonic clock for systemd: {e}"),
                    }
                }
                Phase::Stopping => states.push(NotifyState::Stopping),
                _ => {}
            }
        }
        if !states.is_empty() || self.status_sent.is_none_or(|t| now - t >= STATUS_EVERY) {
            let line = status();
            self.status_sent = Some(now);
            if !states.is_empty() || line != self.status {
                self.status = line;
                states.push(NotifyState::Status(&self.status));
            }
        }
        if phase == Phase::Starting && self.extended.is_none_or(|t| now - t >= EXTEND_EVERY) {
            self.extended = Some(now);
            states.push(NotifyState::ExtendTimeoutUsec(EXTEND_BY.as_micros() as u32));
        }
        if let Some(every) = self.watchdog {
            if self.last_ping.is_none_or(|t| now - t >= every) {
                self.last_ping = Some(now);
                states.push(NotifyState::Watchdog);
            }
        }
        if !states.is_empty() {
            if let Err(e) = sd_notify::notify(false, &states) {
                warn!("cannot notify systemd ({e}): {states:?}");
            }
        }
    }
}

/// The listening socket systemd passed (socket activation), if it passed one; `Err` if it
/// passed something inferd cannot serve on. Clears `LISTEN_*` so that nothing else takes it:
/// call before any other thread starts.
pub fn listener() -> std::io::Result<Option<std::net::TcpListener>> {
    let fds: Vec<RawFd> = sd_notify::listen_fds()?.collect();
    let fd = match fds[..] {
        [] => return Ok(None),
        [fd] => fd,
        _ => {
            return Err(std::io::Error::other(format!(
                "systemd passed {} sockets (LISTEN_FDS); inferd serves on exactly one",
                fds.len()
            )))
        }
    };
    // SAFETY: LISTEN_PID named this process, so fd 3 is ours (sd_listen_fds(3)); nothing else
    // in the process uses it.
    let socket = socket2::Socket::from(unsafe { OwnedFd::from_raw_fd(fd) });
    socket.set_nonblocking(true)?;
    let kind = socket.r#type()?;
    let listening = socket.is_listener()?;
    let addr = socket.local_addr()?.as_socket();
    if kind != socket2::Type::STREAM || !listening || addr.is_none() {
        return Err(std::io::Error::other(
            "the socket systemd passed is not a listening TCP socket (ListenStream= with an address or port)",
        ));
    }
    Ok(Some(socket.into()))
}
