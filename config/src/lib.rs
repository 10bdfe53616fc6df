//! inferd-config: reading configuration.
//!
//! Owns:
//! - the TOML schema of `inferd.toml` ([`file`](mod@file)), its validation and command-line
//!   overrides, where it is looked for (`discover.rs`) and what goes wrong reading it
//!   (`error.rs`: [`ConfigError`]), both re-exported by [`file`](mod@file);
//! - the model repository layout ([`model`]): `models/<name>/model.toml` + `model.onnx`;
//! - where the ONNX Runtime shared library is found ([`ortlib`]);
//! - who may use the ports and what encrypts them: API keys ([`auth`]), TLS files ([`tls`]);
//! - which models may be served: the key model signatures must verify against ([`signing`]).
//!
//! What the supervisor makes of it (the CPU and memory plans) lives in the supervisor's
//! `plan`; what the supervisor and a worker say to each other in the `inferd-ipc` crate.
//!
//! Dependencies go one way: [`file`](mod@file) (the whole configuration) uses [`auth`],
//! [`tls`] and [`model`] (and [`auth`] uses [`tls`]); all of them name their failures with
//! `error.rs`, which names the places `discover.rs` looks in.
//!
//! Must not touch: ONNX Runtime, sockets or processes. This crate only reads files.

pub mod auth;
mod discover;
mod error;
pub mod file;
pub mod model;
pub mod ortlib;
pub mod restricted;
pub mod signing;
pub mod tls;

pub use error::ConfigError;
pub use file::{Config, Overrides};
