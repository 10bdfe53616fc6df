//! `net.ipv4.tcp_migrate_req`: when a SO_REUSEPORT listener closes, connections still in its
//! accept queue are reset unless this is 1, in which case the kernel moves them to another
//! listener of the same group. A slot left without a worker (crash, SIGTERM, `scale -1`) takes
//! its socket out of the group while a sibling serves (pool/mod.rs, `settle_port`), so inferd
//! wants it on. And why a slot's socket on the port cannot be had ([`PortError`]).

use tracing::{info, warn};

const SYSCTL: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

pub fn ensure_migrate_req(set: bool) {
    match std::fs::read_to_string(SYSCTL).map(|v| v.trim().to_string()) {
        Ok(v) if v == "1" => {}
        Ok(_) if set => match std::fs::write(SYSCTL, "1") {
            Ok(()) => {
                info!("set net.ipv4.tcp_migrate_req=1: connections queued on a stopping worker move to its siblings")
            }
            Err(e) => warn!(
                "net.ipv4.tcp_migrate_req is 0 and cannot be set ({e}): connections queued on a stopping worker \
                 may be reset; run `sysctl -w net.ipv4.tcp_migrate_req=1` (see the Sockets section of docs/architecture.md)"
            ),
        },
        Ok(_) => warn!("net.ipv4.tcp_migrate_req is 0: connections queued on a stopping worker may be reset"),
        Err(e) => warn!("cannot read {SYSCTL} ({e}): this kernel may reset connections queued on a stopping worker"),
    }
}

/// A slot's socket that cannot be bound on the port (`server.listen` or, for gRPC,
/// `server.grpc_listen`).
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {listen}{}: {error}", if *.grpc { " (gRPC)" } else { "" })]
pub struct PortError {
    pub listen: String,
    pub grpc: bool,
    pub error: std::io::Error,
}
