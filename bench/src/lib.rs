//! The harness of inferd's tests, `inferd tune` and benchmarks: one HTTP client, one way to run
//! an `inferd` process, one kind of client thread, and the measured closed loop built on them.
pub mod clients;
pub mod http;
pub mod load;
pub mod models;
pub mod process;
