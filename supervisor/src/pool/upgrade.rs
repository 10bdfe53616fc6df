//! Upgrading inferd itself with no failed request (`inferd upgrade [--binary PATH]`, or
//! SIGUSR2): the running supervisor (the old) starts the new binary as a new supervisor (the
//! new) with the same command line, handing it by descriptor every socket the pool serves on
//! (each slot's HTTP and gRPC sockets, systemd's socket, the control socket, the admin
//! listener), the pool's hand-off socket and its table of API key limits. The sockets never
//! close, so no connection is refused or reset on the way.
//!
//! 1. The new checks its configuration and starts its workers on the inherited sockets, as at
//!    any start, but serves nothing of its own yet (no control socket, no admin listener, no
//!    word to systemd) and never takes a socket out of the port's group: the old's workers
//!    accept on them. Its workers join each slot's socket as they warm up, beside the old's.
//! 2. When its pool is ready it says so on the channel (a socketpair, one JSON line each way:
//!    [`Say`]). The old then tells systemd the new main PID (`MAINPID=`, which a unit with
//!    `NotifyAccess=main` accepts from its main process), answers `inferd upgrade`, stops
//!    serving its control socket and admin listener, and retires its workers as a reload
//!    does (SIGUSR1: each finishes its requests and hands its idle keep-alive connections
//!    through the shared hand-off socket to the new workers); it exits once they are gone,
//!    leaving the sockets and the control socket's file to the new.
//! 3. The new, told (or finding the channel closed: the old is gone), serves the control
//!    socket and the admin listener, and notifies systemd (READY=1, the watchdog) as the
//!    service's main process.
//!
//! Rollback is the default: a new supervisor that exits (a binary that does not start, a
//! configuration it refuses, a model it cannot load) or is not ready within twice
//! server.boot_timeout_secs (then killed; its workers follow by PR_SET_PDEATHSIG) leaves the
//! old serving as before, its workers untouched, and `inferd upgrade` fails with the reason.
//! While an upgrade runs, reloads, scaling and another upgrade are refused.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::sockets::dup_high;
use crate::control::{ActionError, Replies, Response};
use crate::event::{Event, Say, UpgradeEvent};

/// The variable that tells a new supervisor which descriptors it inherits.
pub const UPGRADE_ENV: &str = "INFERD_UPGRADE";

/// What the old supervisor hands the new one, by descriptor number ([`UPGRADE_ENV`], JSON).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Handed {
    old_pid: u32,
    channel: RawFd,
    control: RawFd,
    admin: Option<RawFd>,
    activated: Option<RawFd>,
    handoff: Option<(RawFd, RawFd)>,
    limits: Option<RawFd>,
    /// Each slot's (HTTP, gRPC) sockets.
    slots: Vec<(Option<RawFd>, Option<RawFd>)>,
}

/// The descriptors a new supervisor inherited, owned.
pub struct Inherited {
    pub old_pid: u32,
    pub channel: OwnedFd,
    pub control: OwnedFd,
    pub admin: Option<OwnedFd>,
    pub activated: Option<OwnedFd>,
    pub handoff: Option<(OwnedFd, OwnedFd)>,
    pub limits: Option<OwnedFd>,
    pub slots: Vec<(Option<OwnedFd>, Option<OwnedFd>)>,
}

/// Why the descriptors [`UPGRADE_ENV`] names cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum InheritError {
    #[error("{UPGRADE_ENV} is not what an upgrading inferd passes: {0}")]
    NotHanded(serde_json::Error),
    #[error("{UPGRADE_ENV} names descriptor {0}, which is not open")]
    NotOpen(RawFd),
}

impl Inherited {
    /// The descriptors named by [`UPGRADE_ENV`], if this process was started by an upgrade
    /// (the variable is cleared: call before any thread starts).
    pub fn take() -> Result<Option<Inherited>, InheritError> {
        let Some(text) = std::env::var_os(UPGRADE_ENV) else { return Ok(None) };
        std::env::remove_var(UPGRADE_ENV);
        // systemd's watchdog names its process; once this one is the main process, it is.
        if std::env::var_os("WATCHDOG_USEC").is_some() {
            std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
        }
        let handed: Handed = serde_json::from_str(&text.to_string_lossy()).map_err(InheritError::NotHanded)?;
        let own = |fd: RawFd| -> Result<OwnedFd, InheritError> {
            // Open, and close-on-exec again: workers get theirs by dup2.
            // SAFETY: fcntl on a descriptor number; F_GETFD fails on one that is not open.
            if fd < 3 || unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                return Err(InheritError::NotOpen(fd));
            }
            // SAFETY: the old supervisor handed this descriptor to this process alone.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        let maybe = |fd: Option<RawFd>| fd.map(own).transpose();
        Ok(Some(Inherited {
            old_pid: handed.old_pid,
            channel: own(handed.channel)?,
            control: own(handed.control)?,
            admin: maybe(handed.admin)?,
            activated: maybe(handed.activated)?,
            handoff: handed.handoff.map(|(s, r)| Ok::<_, InheritError>((own(s)?, own(r)?))).transpose()?,
            limits: maybe(handed.limits)?,
            slots: handed
                .slots
                .into_iter()
                .map(|(h, g)| Ok((maybe(h)?, maybe(g)?)))
                .collect::<Result<_, InheritError>>()?,
        }))
    }
}

/// Where an upgrade stands, on either side.
#[derive(Default)]
pub enum Upgrade {
    #[default]
    None,
    /// New side, until the old hands over: the channel, and the pid of the old.
    Candidate { channel: std::os::unix::net::UnixStream, old_pid: u32, told_ready: bool },
    /// New side, once the old has handed over, until it exits: its workers drain.
    TookOver { old_pid: u32 },
    /// Old side: the new supervisor is starting.
    Starting {
        pid: u32,
        binary: PathBuf,
        /// The version it runs, once it said.
        version: Option<String>,
        since: Instant,
        channel: std::os::unix::net::UnixStream,
        replies: Option<Replies>,
        /// What the new said before it exited, or why it was killed.
        failure: Option<String>,
    },
    /// Old side: handed over to `pid`; the old workers drain, then the old exits.
    HandedOver { pid: u32 },
}

impl Upgrade {
    /// Whether another supervisor's workers share the slots' sockets now: then none is taken
    /// out of the port's group.
    pub fn shares_sockets(&self) -> bool {
        !matches!(self, Upgrade::None)
    }

    /// Whether the control socket's file belongs to another supervisor (one this one hands
    /// over to, or the one it has not taken over from yet).
    pub fn socket_is_not_ours(&self) -> bool {
        matches!(self, Upgrade::Candidate { .. } | Upgrade::HandedOver { .. })
    }

    /// For `inferd status`.
    pub fn describe(&self) -> Option<String> {
        match self {
            Upgrade::None => None,
            Upgrade::Candidate { old_pid, .. } => Some(format!("taking over from pid {old_pid}")),
            Upgrade::TookOver { old_pid } => Some(format!("took over from pid {old_pid}, whose workers drain")),
            Upgrade::Starting { pid, binary, version, since, .. } => Some(format!(
                "to pid {pid} (inferd {}, {}): its workers start; {:.0} s so far",
                version.as_deref().unwrap_or("?"),
                binary.display(),
                since.elapsed().as_secs_f64()
            )),
            Upgrade::HandedOver { pid } => Some(format!("handed over to pid {pid}; the old workers drain")),
        }
    }
}

/// Writes one line to the other supervisor (it may be gone: then nothing is said).
fn say(channel: &mut std::os::unix::net::UnixStream, what: &Say) {
    let mut line = serde_json::to_vec(what).expect("messages serialise");
    line.push(b'\n');
    if let Err(e) = channel.write_all(&line) {
        warn!("cannot tell the other supervisor {what:?}: {e}");
    }
}

/// Reads the other supervisor's lines into the loop; `then` runs at end-of-file.
fn listen(
    channel: std::os::unix::net::UnixStream,
    events: mpsc::UnboundedSender<Event>,
    then: impl std::future::Future<Output = UpgradeEvent> + Send + 'static,
) -> std::io::Result<()> {
    channel.set_nonblocking(true)?;
    let stream = tokio::net::UnixStream::from_std(channel)?;
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str::<Say>(&line) {
                Ok(Say::Handover) => {
                    let _ = events.send(Event::Upgrade(UpgradeEvent::HandedOver));
                }
                Ok(said) => {
                    let _ = events.send(Event::Upgrade(UpgradeEvent::Said(said)));
                }
                Err(e) => warn!("the other supervisor said something unreadable ({e}): {line}"),
            }
        }
        let _ = events.send(Event::Upgrade(then.await));
    });
    Ok(())
}

/// The descriptors an upgrade hands to the new supervisor, besides the channel: the control
/// socket and the admin listener (the services'), systemd's socket, the hand-off socket and
/// the table of key limits (the launcher's), and each slot's sockets.
pub(super) struct Handing {
    pub(super) control: Option<RawFd>,
    pub(super) admin: Option<RawFd>,
    pub(super) activated: Option<RawFd>,
    pub(super) handoff: Option<(RawFd, RawFd)>,
    pub(super) limits: Option<RawFd>,
    pub(super) slots: Vec<(Option<RawFd>, Option<RawFd>)>,
}

/// What the loop does for an upgrade's news, beyond the upgrade's own state.
pub(super) enum Step {
    /// Old side: the new supervisor (`pid`, running `version`) is ready: the loop tells
    /// systemd, then [`Upgrade::hand_over`], stops serving and retires its workers.
    HandOver { pid: u32, version: String },
    /// New side: the old handed over or is gone: the loop serves the control socket and the
    /// admin listener, tells systemd, and lets go of the slots' sockets it has no slot for.
    Serve,
}

impl Upgrade {
    /// New side, at start: listens to the old supervisor.
    pub(super) fn candidate(
        channel: OwnedFd,
        old_pid: u32,
        events: mpsc::UnboundedSender<Event>,
    ) -> std::io::Result<Upgrade> {
        let channel = std::os::unix::net::UnixStream::from(channel);
        listen(channel.try_clone()?, events, async { UpgradeEvent::OldGone })?;
        info!("started by an upgrade from pid {old_pid}: serving nothing of its own until its workers are ready");
        let mut upgrade = Upgrade::Candidate { channel, old_pid, told_ready: false };
        upgrade.tell_old(Say::Starting { version: inferd_ipc::version().to_string() });
        Ok(upgrade)
    }

    /// New side: its pool became ready (tells the old), or it fails (tells the old why).
    pub(super) fn tell_old(&mut self, what: Say) {
        if let Upgrade::Candidate { channel, told_ready, .. } = self {
            if matches!(what, Say::Ready { .. }) {
                if *told_ready {
                    return;
                }
                *told_ready = true;
                info!("every worker is ready: asking the old supervisor to hand over");
            }
            say(channel, &what);
        }
    }

    /// Whether an upgrade may start now, as far as upgrades go (one at a time, none while
    /// taking over or handed over).
    pub(super) fn can_start(&self) -> Result<(), ActionError> {
        match self {
            // After a hand-over, the previous old supervisor's workers may still drain.
            Upgrade::None | Upgrade::TookOver { .. } => Ok(()),
            Upgrade::Starting { pid, .. } => Err(ActionError::Upgrading(*pid)),
            Upgrade::Candidate { .. } => Err(ActionError::TakingOver),
            Upgrade::HandedOver { pid } => Err(ActionError::HandedOver(*pid)),
        }
    }

    /// Old side: `inferd upgrade` or SIGUSR2, once [`Upgrade::can_start`] and the pool said
    /// yes: starts `binary` as the new supervisor with `handing`, or refuses whole.
    pub(super) fn start(
        &mut self,
        binary: PathBuf,
        handing: Handing,
        events: mpsc::UnboundedSender<Event>,
        replies: Option<Replies>,
    ) -> Result<(), ActionError> {
        match std::fs::metadata(&binary) {
            Ok(m) if m.is_file() => {}
            Ok(_) => return Err(ActionError::NotAFile(binary)),
            Err(error) => return Err(ActionError::NoBinary { binary, error }),
        }
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(ActionError::Channel)?;
        let theirs = dup_high(theirs.as_raw_fd()).map_err(ActionError::Channel)?;
        let Handing { control, admin, activated, handoff, limits, slots } = handing;
        let Some(control) = control else { return Err(ActionError::NotOurSocket) };
        let handed = Handed {
            old_pid: std::process::id(),
            channel: theirs.as_raw_fd(),
            control,
            admin,
            activated,
            handoff,
            limits,
            slots,
        };
        let fds: Vec<RawFd> =
            [Some(handed.channel), Some(handed.control), handed.admin, handed.activated, handed.limits]
                .into_iter()
                .flatten()
                .chain(handed.handoff.into_iter().flat_map(|(s, r)| [s, r]))
                .chain(handed.slots.iter().flat_map(|(h, g)| [*h, *g]).flatten())
                .collect();
        let mut command = tokio::process::Command::new(&binary);
        command
            .args(std::env::args_os().skip(1))
            .env(UPGRADE_ENV, serde_json::to_string(&handed).expect("serialises"))
            // The new one becomes the watchdog's process once it is the main one; the socket
            // systemd passed comes as `activated`.
            .env_remove("WATCHDOG_PID")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDNAMES")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(false);
        // The new supervisor's pid comes back through this pipe, from the process in between.
        let mut ends = [0; 2];
        // SAFETY: pipe2 fills the two descriptors, which are owned here from then on.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(ActionError::Pipe(std::io::Error::last_os_error()));
        }
        // SAFETY: just made, owned by nothing else.
        let (pid_read, pid_write) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        let pid_write_fd = pid_write.as_raw_fd();
        // SAFETY: only fcntl, fork, write and _exit (async-signal-safe) between fork and exec.
        unsafe {
            command.pre_exec(move || {
                for &fd in &fds {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // Once more, and the process in between exits: the new supervisor is adopted
                // by the service manager (systemd, as PID 1 or the user's subreaper), which
                // therefore supervises it fully once it is told the new MAINPID (a main
                // process that is not its child it would kill at once on stop).
                match libc::fork() {
                    -1 => Err(std::io::Error::last_os_error()),
                    0 => Ok(()),
                    pid => {
                        let bytes = pid.to_ne_bytes();
                        libc::write(pid_write_fd, bytes.as_ptr().cast(), bytes.len());
                        libc::_exit(0)
                    }
                }
            });
        }
        let mut between = match command.spawn() {
            Ok(between) => between,
            Err(error) => return Err(ActionError::CannotStart { binary, error }),
        };
        drop((theirs, pid_write));
        tokio::spawn(async move {
            let _ = between.wait().await;
        });
        let mut bytes = [0u8; 4];
        if let Err(error) = std::io::Read::read_exact(&mut std::fs::File::from(pid_read), &mut bytes) {
            return Err(ActionError::NoPid { binary, error });
        }
        let pid = i32::from_ne_bytes(bytes) as u32;
        let channel = ours.try_clone().map_err(ActionError::Channel)?;
        listen(channel, events, async { UpgradeEvent::Exited }).map_err(ActionError::Channel)?;
        let message = format!(
            "upgrade: started {} as the new supervisor (pid {pid}); the old serves until its workers are ready",
            binary.display()
        );
        info!("{message}");
        if let Some(replies) = &replies {
            let _ = replies.send(Response::progress(message));
        }
        *self = Upgrade::Starting {
            pid,
            binary,
            version: None,
            since: Instant::now(),
            channel: ours,
            replies,
            failure: None,
        };
        Ok(())
    }

    /// What the channel brought: the upgrade's state moves on, and the loop is told what else
    /// to do.
    pub(super) fn on_event(&mut self, event: UpgradeEvent) -> Option<Step> {
        match (event, &mut *self) {
            (UpgradeEvent::Said(Say::Ready { pid: said, version }), Upgrade::Starting { pid, .. }) if said == *pid => {
                return Some(Step::HandOver { pid: said, version });
            }
            (UpgradeEvent::Said(Say::Starting { version: said }), Upgrade::Starting { version, .. }) => {
                *version = Some(said);
            }
            (UpgradeEvent::Said(Say::Failed { error }), Upgrade::Starting { failure, .. }) => {
                *failure = Some(format!("failed: {error}"));
            }
            (UpgradeEvent::Exited, Upgrade::Starting { pid, failure, replies, .. }) => {
                let why = failure.take().unwrap_or_else(|| "exited before it was ready (its log says why)".into());
                let error = format!("upgrade failed: the new supervisor (pid {pid}) {why}; this one serves as before");
                error!("{error}");
                if let Some(replies) = replies.take() {
                    let _ = replies.send(Response::error(error));
                }
                *self = Upgrade::None;
            }
            // Handed over, or the old is gone before it could (then nothing waits any more).
            (event @ (UpgradeEvent::HandedOver | UpgradeEvent::OldGone), Upgrade::Candidate { old_pid, .. }) => {
                let old_pid = *old_pid;
                match event {
                    UpgradeEvent::HandedOver => info!(
                        "pid {old_pid} handed over: this supervisor serves the control socket and tells systemd now"
                    ),
                    _ => warn!("pid {old_pid} went away before it handed over: this supervisor serves on its own"),
                }
                *self = match event {
                    UpgradeEvent::HandedOver => Upgrade::TookOver { old_pid },
                    _ => Upgrade::None,
                };
                return Some(Step::Serve);
            }
            (UpgradeEvent::OldGone, Upgrade::TookOver { old_pid }) => {
                info!("pid {old_pid} exited: the upgrade is complete");
                *self = Upgrade::None;
            }
            (UpgradeEvent::Said(said), _) => warn!("upgrade: the other supervisor said {said:?} out of turn; ignored"),
            (UpgradeEvent::Exited | UpgradeEvent::HandedOver | UpgradeEvent::OldGone, _) => {}
        }
        None
    }

    /// Old side, after [`Step::HandOver`] (systemd told first: the new one's READY=1 must come
    /// from the main process): the service is the new supervisor's, and `inferd upgrade` hears
    /// so.
    pub(super) fn hand_over(&mut self, version: &str) {
        let Upgrade::Starting { pid, channel, replies, .. } = self else { return };
        let pid = *pid;
        say(channel, &Say::Handover);
        let message = format!(
            "upgraded: pid {pid} (inferd {version}) serves now; the old workers (inferd {}) drain",
            inferd_ipc::version()
        );
        info!("{message}");
        if let Some(replies) = replies {
            let _ = replies.send(Response::message(message));
        }
        *self = Upgrade::HandedOver { pid };
    }

    /// Old side, on every tick: a new supervisor not ready in time is killed (its workers
    /// follow it), and the exit that follows fails the upgrade.
    pub(super) fn watch(&mut self, boot_timeout_secs: f64) {
        let limit = Duration::from_secs_f64(2.0 * boot_timeout_secs);
        if let Upgrade::Starting { pid, since, failure, .. } = self {
            if failure.is_none() && since.elapsed() > limit {
                let why = format!("was not ready within {} s (2 x server.boot_timeout_secs): killed", limit.as_secs());
                warn!("upgrade: the new supervisor (pid {pid}) {why}");
                *failure = Some(why);
                let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
            }
        }
    }

    /// Old side, stopping during an upgrade: the new supervisor goes first (its workers follow
    /// it), and `inferd upgrade` is answered now: this one may be gone before the new one's
    /// end is seen.
    pub(super) fn abandon(&mut self) {
        if let Upgrade::Starting { pid, replies, .. } = self {
            let error = format!("upgrade failed: the supervisor is stopping; the new one (pid {pid}) was killed");
            warn!("{error}");
            let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
            if let Some(replies) = replies.take() {
                let _ = replies.send(Response::error(error));
            }
            *self = Upgrade::None;
        }
    }
}
