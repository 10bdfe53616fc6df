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
//! goes up it; this file declares them and re-exports, and holds no item of its own):
//! - [`pool`]: the loop, and the parts of its state, each a type in its own file;
//! - [`admin`], [`control_server`], [`signals`], [`systemd`]: the doors: the admin listener,
//!   the control socket and signals turn requests into events; systemd's socket activation
//!   and notifications;
//! - [`event`]: the [`Event`]s the doors and the pool's tasks enqueue for the loop;
//!   [`control`]: the control socket's requests and answers, and its client (the `inferd`
//!   commands');
//! - [`metrics`], [`status`], [`triton`]: what the pool tells: the Prometheus text,
//!   `inferd status`, Triton's statistics and repository index;
//! - [`plan`]: the pool's CPU and memory plan; [`confine`]: where a model may be loaded
//!   from; [`tcp`]: the port's sysctl; [`port`]: whether another server holds the port;
//!   [`trace`]: the supervisor's own spans.
//!
//! Must not touch: ONNX Runtime (a process that ran a session must never fork).

mod admin;
mod confine;
pub mod control;
mod control_server;
mod event;
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
mod triton;

pub use event::Event;
pub use pool::{run, SupervisorError};
