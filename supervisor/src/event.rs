//! Everything the supervisor's loop reacts to, as its doors and tasks enqueue it: an
//! [`Event`] (a signal, a worker's message or exit, a control request, a scrape, a word from
//! the other supervisor of an upgrade); and what the two supervisors of an upgrade say on
//! their channel ([`Say`]).

use std::process::ExitStatus;

use inferd_ipc::spec::WorkerMessage;
use serde::{Deserialize, Serialize};

use crate::control::{Replies, Request};
use crate::metrics::PoolMetrics;

/// Everything the supervisor's loop reacts to.
#[derive(Debug)]
pub enum Event {
    Signal(i32),
    Message {
        slot: usize,
        pid: u32,
        message: WorkerMessage,
    },
    /// `status` is `None` if waiting for the process failed.
    Exited {
        slot: usize,
        pid: u32,
        status: Option<ExitStatus>,
    },
    Control(Request, Replies),
    /// The admin listener wants the pool's counters and models (a Prometheus scrape, Triton's
    /// statistics or repository index).
    Scrape(tokio::sync::oneshot::Sender<PoolMetrics>),
    /// The other supervisor of an upgrade said something, or is gone.
    Upgrade(UpgradeEvent),
}

/// What an upgrade's channel brings the loop.
#[derive(Debug)]
pub enum UpgradeEvent {
    /// Old side: the new said this.
    Said(Say),
    /// Old side: the new supervisor is gone (its end of the channel closed).
    Exited,
    /// New side: the old handed over.
    HandedOver,
    /// New side: the old is gone (its end of the channel closed).
    OldGone,
}

/// One line on an upgrade's channel between the two supervisors (pool/upgrade.rs).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Say {
    /// New to old: it runs, and checks its configuration and starts its workers.
    Starting { version: String },
    /// New to old: every worker is ready.
    Ready { pid: u32, version: String },
    /// New to old: it cannot serve, and exits.
    Failed { error: String },
    /// Old to new: the service is yours.
    Handover,
}
