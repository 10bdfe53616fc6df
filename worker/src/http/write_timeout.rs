//! A connection whose writes may stall only so long: a client that stops reading an answer
//! (`/embed_all` returns ~1000 times its request) would otherwise hold the answer's memory and
//! a connection slot for as long as it likes. hyper has no write timeout of its own.

use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

pub struct WriteTimeout<T> {
    inner: T,
    limit: Duration,
    /// Armed when a write (or flush) cannot go on, disarmed as soon as one makes progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteTimeout<T> {
    pub fn new(inner: T, limit: Duration) -> WriteTimeout<T> {
        WriteTimeout { inner, limit, stalled: None }
    }

    pub fn into_inner(self) -> T {
        self.inner
    }

    /// `poll` is a write that returned `result`: Pending arms the clock, anything else
    /// disarms it; past the limit, the write fails (and hyper closes the connection).
    fn watch<R>(&mut self, cx: &mut Context<'_>, result: Poll<std::io::Result<R>>) -> Poll<std::io::Result<R>> {
        if result.is_ready() {
            self.stalled = None;
            return result;
        }
        let limit = self.limit;
        let clock = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match clock.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing of the answer for {limit:?} (server.write_timeout_secs)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteTimeout<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, result)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, result)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, result)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_reads_fails_after_the_limit() {
        // A pipe of 64 bytes whose far end never reads.
        let (near, _far) = tokio::io::duplex(64);
        let mut conn = WriteTimeout::new(near, Duration::from_secs(30));
        let started = tokio::time::Instant::now();
        let e = conn.write_all(&[0u8; 4096]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn progress_resets_the_clock() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut conn = WriteTimeout::new(near, Duration::from_secs(30));
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let mut total = 0;
            while total < 4096 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                total += tokio::io::AsyncReadExt::read(&mut far, &mut buf).await.unwrap();
            }
        });
        // 64 reads, 20 s apart: 21 minutes in all, never 30 s without progress.
        conn.write_all(&[0u8; 4096]).await.unwrap();
        reader.await.unwrap();
    }
}
