//! inferd-supervisor: the process that owns the pool. It never loads ONNX Runtime and never
//! serves inference; it plans the pool from the configuration and the machine ([`plan`]: CPU
//! placement, memory budget), starts K workers (each a fresh exec of the `inferd` binary),
//! restarts them when they die, answers the control socket and the admin listener (Prometheus
//! `GET /metrics`, Triton's statistics and model repository), tells systemd how the pool is
//! (sd_notify), and stops them on SIGTERM/SIGINT.
//!
//! One loop, events in, decisions out ([`pool::Supervisor::run`]): signal handlers, control
//! connections, metrics scrapes, worker messages and worker exits only enqueue an [`Event`];
//! the loop drains the queue and, on every tick, starts workers whose backoff has expired,
//! kills those that overran their boot or grace timeout, watches memory and recycles. A
//! rolling reload is a new generation of workers started and retired by the same loop.
//!
//! Layout, by layer, from the loop down (each module uses only those of its own layer or
//! below; `layers`, a test in `make test`, reads this list and fails on a `crate::` path that
//! goes up it; this file's own items, the [`Event`] every door sends, are every layer's):
//! - [`pool`]: the loop, and the parts of its state, each a type in its own file;
//! - [`admin`], [`control`], [`signals`], [`systemd`]: the doors: the admin listener, the
//!   control socket and signals turn requests into events; systemd's socket activation and
//!   notifications;
//! - [`metrics`], [`status`]: what the pool tells: the Prometheus text and `inferd status`;
//! - [`plan`]: the pool's CPU and memory plan; [`confine`]: where a model may be loaded
//!   from; [`tcp`]: the port's sysctl; [`port`]: whether another server holds the port;
//!   [`trace`]: the supervisor's own spans.
//!
//! Must not touch: ONNX Runtime (a process that ran a session must never fork).

mod admin;
mod confine;
pub mod control;
#[cfg(test)]
mod layers;
mod metrics;
pub mod plan;
pub mod pool;
pub mod port;
mod signals;
pub mod status;
mod systemd;
mod tcp;
mod trace;

use std::process::ExitStatus;

use inferd_ipc::spec::WorkerMessage;

pub use pool::{run, SupervisorError};

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
    Control(control::Request, control::Replies),
    /// The admin listener wants the pool's counters and models (a Prometheus scrape, Triton's
    /// statistics or repository index).
    Scrape(tokio::sync::oneshot::Sender<metrics::PoolMetrics>),
    /// The other supervisor of an upgrade said something, or is gone.
    Upgrade(pool::UpgradeEvent),
}
