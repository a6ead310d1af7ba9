//! Gives the allocator's free memory back to the kernel once the daemon goes quiet (decision
//! 0063). A sandbox's daemon is idle most of its life, and a node holds thousands of them:
//! each should hold what it uses, not what its busiest moment used. An idle daemon never
//! wakes for this: the trim follows activity, it does not poll.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tonic::transport::server::Connected;

/// How long nothing must happen before the trim.
pub const TRIM_AFTER: Duration = Duration::from_secs(2);

static ACTIVITY: Notify = Notify::const_new();

/// Something happened that allocates or frees memory: a call came in, a process ended or was
/// forgotten, a connection closed.
pub fn note_activity() {
    ACTIVITY.notify_one();
}

/// Forever: after each spell of activity, once nothing has happened for [`TRIM_AFTER`], hands
/// the allocator's free pages back.
pub async fn trim_when_idle() {
    loop {
        ACTIVITY.notified().await;
        while tokio::time::timeout(TRIM_AFTER, ACTIVITY.notified())
            .await
            .is_ok()
        {}
        space_sys::process::release_free_memory();
    }
}

/// A connection that counts as activity when it closes: its buffers are freed then, and the
/// node closes an idle sandbox's connection for exactly that (decision 0064).
pub struct Noted<IO>(pub IO);

impl<IO> Drop for Noted<IO> {
    fn drop(&mut self) {
        note_activity();
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Noted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Noted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Noted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.connect_info()
    }
}
