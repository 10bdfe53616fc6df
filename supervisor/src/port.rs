//! Whether another server already listens on the address inferd is to serve on. Its slots'
//! sockets join the port with SO_REUSEPORT, and the kernel lets any socket of the same user
//! join that group: a second server started on a port the first serves would take half of its
//! connections without a word. So a supervisor that starts afresh (not one handed its sockets
//! by `inferd upgrade`, and not on a socket systemd passed) first binds the address once
//! without SO_REUSEPORT: that fails while any socket listens there, inferd's own, another
//! inferd's or any other program's. With SO_REUSEADDR, as inferd's own sockets have it, so
//! that connections in TIME_WAIT from a server that just stopped do not count. A server still
//! warming up (its sockets bound, not yet listening) is not seen: the kernel does not list
//! such sockets.

use std::net::{IpAddr, SocketAddr};

/// An address another socket listens on, and who holds it where /proc says.
#[derive(Debug, thiserror::Error)]
#[error(
    "{addr}{} is already served by {holder}: a second server would share its connections (SO_REUSEPORT); \
     stop that one, or give this one another address (server.{})",
    if *.grpc { " (gRPC)" } else { "" },
    if *.grpc { "grpc_listen" } else { "listen" }
)]
pub struct Held {
    pub addr: SocketAddr,
    pub grpc: bool,
    /// "pid 812 (inferd)", or what is known when /proc does not tell.
    pub holder: String,
}

/// `Err` when a socket that is not this process's listens on `addr`. An address that cannot be
/// bound for another reason passes: binding the slots' sockets says why.
pub fn check_free(addr: SocketAddr, grpc: bool) -> Result<(), Held> {
    use socket2::{Domain, Socket, Type};
    let probe = || -> std::io::Result<()> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())
    };
    match probe() {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Held { addr, grpc, holder: holder(addr) }),
        _ => Ok(()),
    }
}

/// Who listens on `addr`: the processes holding the listening socket, from the kernel's TCP
/// tables and each process's descriptors.
fn holder(addr: SocketAddr) -> String {
    let inodes = listening_inodes(addr);
    let mut pids = Vec::new();
    if !inodes.is_empty() {
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let fds = std::fs::read_dir(entry.path().join("fd")).into_iter().flatten().flatten();
            let holds = fds.filter_map(|fd| std::fs::read_link(fd.path()).ok()).any(|link| {
                let link = link.to_string_lossy();
                link.strip_prefix("socket:[")
                    .and_then(|s| s.strip_suffix(']'))
                    .is_some_and(|n| inodes.iter().any(|i| i == n))
            });
            if holds {
                pids.push(pid);
            }
        }
    }
    pids.sort_unstable();
    let named: Vec<String> = pids
        .iter()
        .take(3)
        .map(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            format!("pid {pid} ({})", comm.trim())
        })
        .collect();
    match named.len() {
        0 => "another socket (its process is not visible to this one)".into(),
        _ if pids.len() > named.len() => format!("{} and {} more", named.join(", "), pids.len() - named.len()),
        _ => named.join(", "),
    }
}

/// The inodes of the listening TCP sockets whose address conflicts with `addr`: its port, and
/// its address or a wildcard on either side.
fn listening_inodes(addr: SocketAddr) -> Vec<String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            let (Some(local), Some(&"0A"), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9)) else {
                continue;
            };
            if let Some(listening) = parse_local(local) {
                let wildcard = |ip: IpAddr| ip.is_unspecified();
                let same_ip = listening.ip() == addr.ip() || wildcard(listening.ip()) || wildcard(addr.ip());
                if listening.port() == addr.port() && same_ip {
                    inodes.push(inode.to_string());
                }
            }
        }
    }
    inodes
}

/// A local address as /proc/net/tcp{,6} writes it: the address's 32-bit words in the host's
/// byte order (little-endian here), in hex, `:`, the port in hex.
fn parse_local(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> =
        (0..ip.len() / 8).map(|i| u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok()).collect::<Option<_>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            // A v4 address as a dual-stack socket lists it.
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_addresses_are_read() {
        assert_eq!(parse_local("0100007F:4753"), Some("127.0.0.1:18259".parse().unwrap()));
        assert_eq!(parse_local("00000000:1F40"), Some("0.0.0.0:8000".parse().unwrap()));
        assert_eq!(parse_local("00000000000000000000000000000000:1F40"), Some("[::]:8000".parse().unwrap()));
        assert_eq!(parse_local("00000000000000000000000001000000:0050"), Some("[::1]:80".parse().unwrap()));
        assert_eq!(parse_local("0000000000000000FFFF00000100007F:0050"), Some("127.0.0.1:80".parse().unwrap()));
        assert_eq!(parse_local("zz:1"), None);
    }

    #[test]
    fn a_listener_of_this_process_is_found_and_named_a_bound_socket_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let held = check_free(addr, true).unwrap_err();
        assert!(held.holder.contains(&format!("pid {}", std::process::id())), "{held}");
        assert!(held.to_string().contains("(gRPC)") && held.to_string().contains("server.grpc_listen"), "{held}");
        // The wildcard address of the same port conflicts too.
        assert!(check_free(SocketAddr::new([0, 0, 0, 0].into(), addr.port()), false).is_err());
        drop(listener);
        assert!(check_free(addr, false).is_ok(), "a closed listener holds nothing");
    }
}
