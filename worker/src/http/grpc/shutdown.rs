//! A gRPC connection's inbound frames, looked at before h2 reads them, for one race in the
//! graceful close (GOAWAY) that h2 0.4.20 gets wrong.
//!
//! To close a connection gracefully, h2 sends GOAWAY(2^31-1) and a PING; once the PING's ACK
//! comes back it accepts no more streams, and a HEADERS frame after the ACK is ignored (the
//! final GOAWAY tells the client which streams were not taken, and gRPC clients retry those
//! on a new connection). grpc-core clients write a PING's ACK ahead of frames already queued,
//! so a stream opened in that moment arrives just after the ACK with its first frames:
//! HEADERS, DATA and often a WINDOW_UPDATE. h2 ignores the first two but takes the
//! WINDOW_UPDATE for a frame on an idle stream, a connection error: it answers
//! GOAWAY(PROTOCOL_ERROR) and drops the connection, and every call still in progress on it
//! fails. Measured before this module: in 160 rolling reloads under four tritonclient
//! threads, 8 dropped a connection so, and 2 calls failed (CI failed on one such).
//!
//! [`ShutdownFrames`] passes the client's bytes through unchanged but for such a frame: a
//! WINDOW_UPDATE that follows the ACK of h2's shutdown PING, for a stream above the highest
//! one opened before it, becomes a frame of an unknown type, which HTTP/2 receivers ignore
//! (RFC 9113 §4.1, §5.5). Nothing before that ACK is touched.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", which the client sends before its first frame.
const PREFACE_LEN: usize = 24;
const HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const PING: u8 = 0x6;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
/// Neither a frame type of RFC 9113 nor a registered extension's.
const UNKNOWN: u8 = 0xfe;
/// The payload of the PING h2 sends with its first GOAWAY (h2's `Ping::SHUTDOWN`, not public
/// in its stable API). tests/grpc.rs checks that a drained connection's PING carries it.
pub const H2_SHUTDOWN_PING: [u8; 8] = [0x0b, 0x7b, 0xa2, 0xf0, 0x8b, 0x9b, 0xfe, 0x54];

/// Where the client's byte stream stands, between calls to [`Frames::scan`].
#[derive(Default)]
pub struct Frames {
    /// Bytes of the preface still to pass.
    preface: usize,
    /// Bytes of the current frame's payload still to pass.
    payload: usize,
    /// The payload so far of a PING ACK being passed.
    ping: Option<([u8; 8], usize)>,
    /// The highest stream a HEADERS frame opened while h2 still accepted streams.
    opened: u32,
    /// Set once the ACK of h2's shutdown PING passed: the highest stream h2 took.
    last: Option<u32>,
    /// WINDOW_UPDATE frames made unknown.
    pub hidden: u64,
}

impl Frames {
    pub fn new() -> Frames {
        Frames { preface: PREFACE_LEN, ..Frames::default() }
    }

    /// Passes over the client's next bytes, hiding the WINDOW_UPDATE frames h2 would fail on.
    /// Returns how many of `bytes` are decided; the rest (fewer than nine) begin a frame header
    /// not complete yet, and are to be given again, at the front, with the bytes that follow.
    pub fn scan(&mut self, bytes: &mut [u8]) -> usize {
        let mut at = 0usize;
        while at < bytes.len() {
            let rest = &mut bytes[at..];
            if self.preface > 0 {
                let n = self.preface.min(rest.len());
                self.preface = self.preface.saturating_sub(n);
                at = at.saturating_add(n);
            } else if self.payload > 0 {
                let n = self.payload.min(rest.len());
                if let Some((seen, filled)) = &mut self.ping {
                    let take = n.min(seen.len().saturating_sub(*filled));
                    seen[*filled..filled.saturating_add(take)].copy_from_slice(&rest[..take]);
                    *filled = filled.saturating_add(take);
                }
                self.payload = self.payload.saturating_sub(n);
                at = at.saturating_add(n);
                if self.payload == 0 {
                    self.end_of_frame();
                }
            } else if rest.len() < HEADER_LEN {
                return at;
            } else {
                let header = &mut rest[..HEADER_LEN];
                self.payload = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
                let (kind, flags) = (header[3], header[4]);
                let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
                match (kind, self.last) {
                    (HEADERS, None) => self.opened = self.opened.max(stream),
                    (PING, None) if flags & ACK != 0 && self.payload == H2_SHUTDOWN_PING.len() => {
                        self.ping = Some(([0; 8], 0));
                    }
                    (WINDOW_UPDATE, Some(last)) if stream > last => {
                        header[3] = UNKNOWN;
                        self.hidden = self.hidden.saturating_add(1);
                    }
                    _ => {}
                }
                at = at.saturating_add(HEADER_LEN);
                if self.payload == 0 {
                    self.end_of_frame();
                }
            }
        }
        at
    }

    fn end_of_frame(&mut self) {
        if let Some((seen, _)) = self.ping.take() {
            if seen == H2_SHUTDOWN_PING {
                self.last = Some(self.opened);
            }
        }
    }
}

/// Room for what one read brings; the client's frames pass through it.
const BUFFER: usize = 16 * 1024;

/// A gRPC connection's socket, read through [`Frames`].
pub struct ShutdownFrames<S> {
    inner: S,
    frames: Frames,
    buffer: Box<[u8]>,
    /// `buffer[given..decided]` is for h2 to read; `buffer[decided..end]` waits for more bytes.
    given: usize,
    decided: usize,
    end: usize,
}

impl<S> ShutdownFrames<S> {
    pub fn new(inner: S) -> ShutdownFrames<S> {
        ShutdownFrames {
            inner,
            frames: Frames::new(),
            buffer: vec![0; BUFFER].into_boxed_slice(),
            given: 0,
            decided: 0,
            end: 0,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ShutdownFrames<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.given < this.decided {
                let n = out.remaining().min(this.decided.saturating_sub(this.given));
                let until = this.given.saturating_add(n);
                out.put_slice(&this.buffer[this.given..until]);
                this.given = until;
                return Poll::Ready(Ok(()));
            }
            // All that was decided is given: what waits goes to the front, and more is read.
            this.buffer.copy_within(this.decided..this.end, 0);
            this.end = this.end.saturating_sub(this.decided);
            (this.given, this.decided) = (0, 0);
            let mut read = ReadBuf::new(&mut this.buffer[this.end..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                if this.end == 0 {
                    return Poll::Ready(Ok(()));
                }
                // The client closed within a frame header: h2 gets what there is.
                this.decided = this.end;
                continue;
            }
            this.end = this.end.saturating_add(n);
            let hidden = this.frames.hidden;
            this.decided = this.frames.scan(&mut this.buffer[..this.end]);
            if this.frames.hidden > hidden {
                tracing::debug!("a WINDOW_UPDATE for a stream opened after the shutdown PING's ACK, hidden from h2");
            }
        }
    }
}

write_through_inner!(ShutdownFrames);

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = len.to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(stream.to_be_bytes());
        out.extend(payload);
        out
    }

    /// A client's bytes: preface, SETTINGS, streams 1 and 3 opened with a WINDOW_UPDATE each,
    /// a keep-alive PING ACK, the shutdown PING's ACK, then stream 5 (after it) with a
    /// WINDOW_UPDATE, a late one for stream 3 and one for the connection.
    fn conversation() -> (Vec<u8>, Vec<usize>) {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut updates = Vec::new();
        let mut push = |bytes: &mut Vec<u8>, f: Vec<u8>, update: bool| {
            if update {
                updates.push(bytes.len());
            }
            bytes.extend(f);
        };
        push(&mut bytes, frame(0x4, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]), false);
        for stream in [1, 3] {
            push(&mut bytes, frame(HEADERS, 0x4, stream, b"headers"), false);
            push(&mut bytes, frame(WINDOW_UPDATE, 0, stream, &[0, 0, 1, 0]), true);
        }
        push(&mut bytes, frame(PING, ACK, 0, &[0x3b, 0x7c, 0xdb, 0x7a, 0x0b, 0x87, 0x16, 0xb4]), false);
        push(&mut bytes, frame(PING, ACK, 0, &H2_SHUTDOWN_PING), false);
        push(&mut bytes, frame(HEADERS, 0x4, 5, b"headers"), false);
        push(&mut bytes, frame(0x0, 0x1, 5, &[0; 300]), false);
        push(&mut bytes, frame(WINDOW_UPDATE, 0, 5, &[0, 0, 1, 0]), true);
        push(&mut bytes, frame(WINDOW_UPDATE, 0, 3, &[0, 0, 1, 0]), true);
        push(&mut bytes, frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]), true);
        (bytes, updates)
    }

    fn kinds_at(bytes: &[u8], at: &[usize]) -> Vec<u8> {
        at.iter().map(|&i| bytes[i + 3]).collect()
    }

    #[test]
    fn only_the_window_update_of_a_stream_opened_after_the_shutdown_ack_is_hidden() {
        let (original, updates) = conversation();
        let mut bytes = original.clone();
        let mut frames = Frames::new();
        assert_eq!(frames.scan(&mut bytes), bytes.len());
        assert_eq!(kinds_at(&bytes, &updates), [WINDOW_UPDATE, WINDOW_UPDATE, UNKNOWN, WINDOW_UPDATE, WINDOW_UPDATE]);
        assert_eq!(frames.hidden, 1);
        // One byte changed, nothing else.
        let changed: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] != original[i]).collect();
        assert_eq!(changed, [updates[2] + 3]);
    }

    #[test]
    fn the_answer_is_the_same_however_the_bytes_are_cut() {
        let (original, _) = conversation();
        let mut whole = original.clone();
        Frames::new().scan(&mut whole);
        // Every cut in two, and a cut every 1..=10 bytes, as reads may bring them.
        let mut cuts: Vec<Vec<usize>> = (1..original.len()).map(|c| vec![c]).collect();
        cuts.extend((1..=10).map(|step| (step..original.len()).step_by(step).collect()));
        for cut in cuts {
            let mut frames = Frames::new();
            let (mut out, mut held) = (Vec::new(), Vec::new());
            let mut from = 0;
            for to in cut.iter().copied().chain([original.len()]) {
                held.extend_from_slice(&original[from..to]);
                let decided = frames.scan(&mut held);
                out.extend(held.drain(..decided));
                assert!(held.len() < HEADER_LEN);
                from = to;
            }
            assert!(held.is_empty(), "{cut:?}");
            assert_eq!(out, whole, "{cut:?}");
        }
    }

    #[test]
    fn nothing_is_hidden_without_h2s_shutdown_ack() {
        let (mut bytes, updates) = conversation();
        // The shutdown ACK's payload, changed by one bit: an ordinary PING ACK.
        let at = bytes.windows(8).position(|w| w == H2_SHUTDOWN_PING).unwrap();
        bytes[at] ^= 1;
        Frames::new().scan(&mut bytes);
        assert!(kinds_at(&bytes, &updates).iter().all(|&k| k == WINDOW_UPDATE));
    }

    #[tokio::test]
    async fn the_socket_passes_every_byte_through_reads_of_any_size() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (original, _) = conversation();
        let mut whole = original.clone();
        Frames::new().scan(&mut whole);
        let (mut near, far) = tokio::io::duplex(7);
        let writer = tokio::spawn(async move {
            near.write_all(&original).await.unwrap();
        });
        let mut socket = ShutdownFrames::new(far);
        let mut got = Vec::new();
        let mut chunk = [0u8; 5];
        loop {
            let n = socket.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        writer.await.unwrap();
        assert_eq!(got, whole);
    }
}
