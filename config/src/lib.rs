//! inferd-config: reading configuration.
//!
//! Owns:
//! - the TOML schema of `inferd.toml` ([`file`]), its validation and command-line overrides;
//! - the model repository layout ([`model`]): `models/<name>/model.toml` + `model.onnx`;
//! - where the ONNX Runtime shared library is found ([`ortlib`]);
//! - who may use the ports and what encrypts them: API keys ([`auth`]), TLS files ([`tls`]).
//!
//! What the supervisor makes of it (the CPU and memory plans) lives in the supervisor's
//! `plan`; what the supervisor and a worker say to each other in the `inferd-ipc` crate.
//!
//! Must not touch: ONNX Runtime, sockets or processes. This crate only reads files.

pub mod auth;
pub mod file;
pub mod model;
pub mod ortlib;
pub mod tls;

pub use file::{Config, ConfigError, Overrides};
