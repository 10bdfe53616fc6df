//! The [`Supervisor`]: the loop's state, one part per concept, each a type in its own file
//! (see mod.rs); the loop's two files (mod.rs, events.rs) are its methods.

use tokio::sync::mpsc;

use super::life::Life;
use super::memory::MemoryWatch;
use super::reload::ReloadState;
use super::saturation::Saturation;
use super::services::Services;
use super::slot::Pool;
use super::sockets::SlotSockets;
use super::spawn::Launcher;
use super::totals::Totals;
use super::upgrade::Upgrade;
use crate::event::Event;
use crate::plan::Resolved;
use crate::systemd::Notifier;

/// The supervisor's state, in one part per concept (see the list of files in mod.rs).
pub struct Supervisor {
    pub(super) resolved: Resolved,
    /// What starting a worker takes (spawn.rs).
    pub(super) launcher: Launcher,
    /// The slots and what their workers run (slot.rs).
    pub(super) pool: Pool,
    pub(super) life: Life,
    /// The reload in progress, and how the reloads so far ended (reload.rs).
    pub(super) reload: ReloadState,
    /// The memory guard's state (memory.rs).
    pub(super) memory: MemoryWatch,
    /// What the pool has counted beyond its live workers' counters (report.rs).
    pub(super) totals: Totals,
    /// The saturation gauges' samples (saturation.rs).
    pub(super) saturation: Saturation,
    pub(super) notifier: Notifier,
    /// Test switch: SIGUSR2 blocks the loop (INFERD_TEST_HANG_ON_SIGUSR2=1), to show that a
    /// hung loop stops the watchdog pings.
    pub(super) hang_on_sigusr2: bool,
    /// The control socket and the admin listener.
    pub(super) services: Services,
    pub(super) events: mpsc::UnboundedSender<Event>,
    /// An upgrade of inferd itself, on either side (upgrade.rs).
    pub(super) upgrade: Upgrade,
    /// Slots' sockets inherited beyond this pool's slots (upgrade.rs).
    pub(super) extra_sockets: Vec<SlotSockets>,
}
