//! inferd-config: everything inferd decides before a worker process exists.
//!
//! Owns:
//! - the TOML schema of `inferd.toml` ([`file`]), its validation and command-line overrides;
//! - the CPU plan ([`cpu`]): usable cores from the affinity mask and the cgroup CPU quota,
//!   intra-op threads per worker, and the disjoint CPU set each worker is pinned to;
//! - the model repository layout ([`model`]): `models/<name>/model.toml` + `model.onnx`;
//! - where the ONNX Runtime shared library is found ([`ortlib`]);
//! - what the supervisor and a worker say to each other ([`spec`]).
//!
//! Must not touch: ONNX Runtime, sockets or processes. This crate only reads files and the
//! process's own affinity mask, so `inferd check` and the supervisor can use it freely.

pub mod cpu;
pub mod file;
pub mod memory;
pub mod model;
pub mod ortlib;
pub mod resolve;
pub mod spec;
pub mod stats;

pub use file::{Config, ConfigError, Overrides};
pub use resolve::{ResolveError, Resolved};
