//! Keep-alive connections that outlive their worker.
//!
//! An HTTP/1.1 server that closes an idle keep-alive connection races its client: the client
//! may be sending its next request on it at that moment, and that request fails (a broken
//! pipe or a reset, which clients do not retry for a POST). Every pre-fork server closes the
//! idle connections of a worker it retires, so keep-alive clients lose requests on every
//! reload. inferd instead hands them over: a retiring worker (SIGUSR1) stops each connection
//! at a request boundary, takes back its socket and whatever bytes hyper had already read,
//! and sends both through the pool's hand-off socket (a SOCK_SEQPACKET socketpair the
//! supervisor holds open, fds 6 and 7 of every worker; see `inferd_ipc::spec`); a serving
//! sibling receives them and carries on serving the connection as if it had accepted it. The
//! client sees nothing: its socket is never closed.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, ReadBuf};

/// Bytes already read from a connection that fit in one hand-off (hyper's read buffer holds
/// at most a request head and the start of its body; more than this is not handed over).
const MAX_PREFIX: usize = 64 * 1024;
/// First byte of every message: a zero-length datagram would read like the end of the stream.
const TAG: u8 = 1;

/// This worker's ends of the hand-off socket.
pub struct Handoff {
    send: AsyncFd<OwnedFd>,
    recv: AsyncFd<OwnedFd>,
}

/// How long a hand-off waits for room in the socket (the kernel queues at most
/// `net.unix.max_dgram_qlen` messages, 10 by default, until a sibling takes them).
const SEND_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Handoff {
    /// Takes fds `send` and `recv` (the supervisor put the socket there); call once.
    pub fn adopt(send: RawFd, recv: RawFd) -> std::io::Result<Handoff> {
        // SAFETY: the supervisor passed these descriptors to this process for this use only.
        let (send, recv) = unsafe { (OwnedFd::from_raw_fd(send), OwnedFd::from_raw_fd(recv)) };
        for fd in [&send, &recv] {
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))?;
        }
        // SAFETY: an OwnedFd keeps its descriptor open and the same for its whole life.
        let recv = unsafe { AsyncFd::register_with_interest(recv, tokio::io::Interest::READABLE) }
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: as above.
        let send = unsafe { AsyncFd::register_with_interest(send, tokio::io::Interest::WRITABLE) }
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Handoff { send, recv })
    }

    /// Hands `stream` and the bytes already read from it to whichever serving worker takes
    /// them next, waiting up to [`SEND_WAIT`] for room. On an error the caller closes the
    /// connection, as a worker without a hand-off would.
    pub async fn send(&self, stream: std::net::TcpStream, read: &[u8]) -> std::io::Result<()> {
        if read.len() > MAX_PREFIX {
            return Err(std::io::Error::other("too many bytes already read"));
        }
        let tag = [TAG];
        let payload = [IoSlice::new(&tag), IoSlice::new(read)];
        let fds = [stream.as_raw_fd()];
        let attempt = async {
            loop {
                let mut guard = self.send.writable().await?;
                let sent = guard.try_io(|fd| {
                    let rights = [ControlMessage::ScmRights(&fds)];
                    sendmsg::<()>(fd.get_ref().as_raw_fd(), &payload, &rights, MsgFlags::MSG_DONTWAIT, None)
                        .map_err(std::io::Error::from)
                });
                match sent {
                    Ok(result) => return result.map(|_| ()),
                    Err(_would_block) => continue,
                }
            }
        };
        // With nobody taking connections (every worker draining), the connection is closed
        // rather than the drain held up. The descriptor travels in the message; this copy is
        // closed on drop either way.
        tokio::time::timeout(SEND_WAIT, attempt)
            .await
            .map_err(|_| std::io::Error::other("no serving worker took the connection"))?
    }

    /// The next connection handed to this worker, with the bytes already read from it.
    /// Cancel-safe: a message is only taken once it can be taken whole.
    pub async fn recv(&self) -> std::io::Result<(std::net::TcpStream, Vec<u8>)> {
        loop {
            let mut guard = self.recv.readable().await?;
            match guard.try_io(|fd| take(fd.get_ref().as_raw_fd())) {
                Ok(Ok(Some(received))) => return Ok(received),
                Ok(Ok(None)) => continue, // a message without a descriptor: nothing to serve
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// One message off the socket: Ok(None) when it carried no usable connection.
fn take(fd: RawFd) -> std::io::Result<Option<(std::net::TcpStream, Vec<u8>)>> {
    let mut buf = vec![0u8; MAX_PREFIX + 1];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (bytes, fds, truncated) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(fd, &mut iov, Some(&mut space), MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC)?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                fds.extend(received);
            }
        }
        (msg.bytes, fds, msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC))
    };
    // SAFETY: SCM_RIGHTS gave this process these new descriptors; nothing else owns them.
    let mut owned: Vec<OwnedFd> = fds.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }).collect();
    let Some(read) = prefix(buf.get(..bytes).unwrap_or_default(), owned.len(), truncated) else {
        return Ok(None); // dropped: closed
    };
    let read = read.to_vec();
    let stream = std::net::TcpStream::from(owned.remove(0));
    stream.set_nonblocking(true)?;
    Ok(Some((stream, read)))
}

/// The bytes a hand-off message says were read already, if it is one: whole, tagged, with
/// exactly one descriptor (the fuzz target's entry: fuzz/fuzz_targets/handoff.rs).
pub fn prefix(message: &[u8], descriptors: usize, truncated: bool) -> Option<&[u8]> {
    match message {
        [TAG, read @ ..] if !truncated && descriptors == 1 && read.len() <= MAX_PREFIX => Some(read),
        _ => None,
    }
}

/// A connection whose first bytes were read elsewhere (by the worker that handed it over):
/// reads give those bytes first, then the socket's.
pub struct Prefixed<T> {
    prefix: Vec<u8>,
    at: usize,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(prefix: Vec<u8>, inner: T) -> Prefixed<T> {
        Prefixed { prefix, at: 0, inner }
    }

    /// The connection and the bytes of the prefix not read yet.
    pub fn into_parts(self) -> (T, Vec<u8>) {
        let mut prefix = self.prefix;
        prefix.drain(..self.at);
        (self.inner, prefix)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if let Some(left) = this.prefix.get(this.at..).filter(|left| !left.is_empty()) {
            let n = left.len().min(buf.remaining());
            buf.put_slice(&left[..n]);
            this.at = this.at.saturating_add(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

write_through_inner!(Prefixed);
