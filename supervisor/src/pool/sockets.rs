//! A slot's sockets on the port, and the descriptor numbering every socket a worker gets
//! keeps to ([`dup_high`]): above the numbers a worker's descriptors are moved to.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use inferd_config::file::ServerConfig;

use crate::tcp::PortError;

/// A slot's sockets on the port (HTTP, and gRPC when server.grpc_listen is set): bound with
/// SO_REUSEPORT when the slot is made, handed to each of its workers in turn, each of which
/// puts them into listening once warm, and closed only when the slot goes. A listener that
/// closes while the kernel completes a handshake for it resets that connection, even with
/// net.ipv4.tcp_migrate_req=1 (measured: 2 in 219,000 connections while one listener of two
/// closed every 35 ms); a socket kept open across a replacement closes nothing.
pub(super) struct SlotSockets {
    /// None under socket activation: the workers share systemd's socket instead.
    http: Option<OwnedFd>,
    grpc: Option<OwnedFd>,
}

impl SlotSockets {
    /// Connections waiting in this slot's accept queues (HTTP and gRPC) for its worker to take
    /// them: TCP_INFO's `tcpi_unacked` of a listening socket.
    pub(super) fn waiting(&self) -> u64 {
        [&self.http, &self.grpc].into_iter().flatten().map(|fd| accept_queue(fd.as_raw_fd())).sum()
    }

    /// Sockets inherited from the supervisor this one upgrades (bound, listening, shared with
    /// its workers).
    pub(super) fn inherited(http: Option<OwnedFd>, grpc: Option<OwnedFd>) -> SlotSockets {
        SlotSockets { http, grpc }
    }

    /// The HTTP socket (None under socket activation) and the gRPC one, for a worker.
    pub(super) fn listeners(&self) -> (Option<&OwnedFd>, Option<&OwnedFd>) {
        (self.http.as_ref(), self.grpc.as_ref())
    }

    /// Their descriptors, to hand to a new supervisor.
    pub(super) fn fds(&self) -> (Option<i32>, Option<i32>) {
        (self.http.as_ref().map(|fd| fd.as_raw_fd()), self.grpc.as_ref().map(|fd| fd.as_raw_fd()))
    }

    pub(super) fn bind(server: &ServerConfig, activated: bool) -> Result<SlotSockets, PortError> {
        let http = match activated {
            true => None,
            false => Some(bind_reuseport(server.listen_addr()).map_err(|error| PortError {
                listen: server.listen.clone(),
                grpc: false,
                error,
            })?),
        };
        let grpc = server.grpc_addr().map(bind_reuseport).transpose().map_err(|error| PortError {
            listen: server.grpc_listen.clone(),
            grpc: true,
            error,
        })?;
        Ok(SlotSockets { http, grpc })
    }

    /// Takes the slot out of the port's group when none of its workers accepts any more (its
    /// worker died, or was retired with no successor: `scale -1`, a replacement that waits
    /// for memory) and a sibling's does (`Supervisor::settle_port` decides): connections
    /// waiting in its sockets move to the siblings
    /// (net.ipv4.tcp_migrate_req) and new ones go there, instead of waiting for the slot's
    /// next worker, which puts the sockets back by listening on them.
    ///
    /// Only a listening socket is shut down, and only here (workers never do; the supervisor
    /// is one thread): shutdown() of a socket that is not listening marks it so that every
    /// connection it accepts after its next listen() reads end-of-file at once.
    pub(super) fn leave(&self) {
        use nix::sys::socket::{getsockopt, shutdown, sockopt::AcceptConn, Shutdown};
        for socket in self.http.iter().chain(&self.grpc) {
            if getsockopt(socket, AcceptConn).unwrap_or(false) {
                let _ = shutdown(socket.as_raw_fd(), Shutdown::Read);
            }
        }
    }
}

/// A socket bound to `addr` in the port's SO_REUSEPORT group, not listening yet, numbered
/// above 11 (see `start_process`).
fn bind_reuseport(addr: std::net::SocketAddr) -> std::io::Result<OwnedFd> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    dup_high(socket.as_raw_fd())
}

/// The pool's hand-off socket: a SOCK_SEQPACKET pair, each end above fd 11.
pub(super) fn handoff_socket() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (send, recv) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .map_err(std::io::Error::from)?;
    Ok((dup_high(send.as_raw_fd())?, dup_high(recv.as_raw_fd())?))
}

/// A copy of `fd` numbered above 11 (a worker's descriptors are 3 to 11), close-on-exec.
pub(super) fn dup_high(fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor the caller owns; the result is a new descriptor we own.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 12) };
    if new < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(unsafe { OwnedFd::from_raw_fd(new) })
    }
}

/// The connections waiting in listening socket `fd`'s accept queue (0 when it cannot be read).
fn accept_queue(fd: std::os::fd::RawFd) -> u64 {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are valid for the call; a bad fd is an error, not UB.
    let read = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&raw mut info).cast(), &raw mut len) };
    // On a listening socket (state TCP_LISTEN, 10 in the kernel's enum) the kernel reports
    // its accept queue's length as tcpi_unacked.
    const TCP_LISTEN: u8 = 10;
    if read == 0 && info.tcpi_state == TCP_LISTEN {
        u64::from(info.tcpi_unacked)
    } else {
        0
    }
}
