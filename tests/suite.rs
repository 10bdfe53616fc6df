//! The integration suite: one test binary whose modules are the files beside this one, each a
//! subject (auth, batching, ... weights), all running the real `inferd` binary through
//! [`common`]. One binary instead of one per file: the suite links once, and a runner that
//! starts each test in a process of its own (cargo-nextest, as `make test` runs it) still
//! keeps tests apart. Run one file's tests with a filter: `cargo nextest run --release
//! --features inferd/test-switches -E 'test(/^chaos::/)'`, or `cargo test --release
//! --features inferd/test-switches --test suite -- chaos::`.

mod common;

mod auth;
mod batching;
mod cache;
mod cgroup_plan;
mod chaos;
mod compat;
mod connections;
mod default_model;
mod deploy;
mod failures;
mod faults;
mod grpc;
mod guards;
mod hostile;
mod keepalive;
mod key_limits;

mod logging;
mod long_texts;
mod memory;
mod metrics;
mod model_budget;
mod on_demand;
mod parsers;
mod pipelines;
mod pool;
mod ports;
mod priority;
mod protocol;
mod published;
mod quantize;
mod races;
mod reload;
mod repository;
mod robustness;
mod shutdown;
mod signatures;
mod structure;
mod systemd;
mod systemd_unit;
mod tls;
mod traces;
mod tune;
mod upgrade;
mod weights;
