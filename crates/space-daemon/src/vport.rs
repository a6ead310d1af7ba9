//! The guest channel of a microvm (issue 6): the virtio-serial port named [`PORT_NAME`], one
//! host connection (one HTTP/2 session) at a time.
//!
//! How the guest sees the host through a virtio-serial port (Linux `virtio_console`, QEMU 7.2,
//! host side a `socket` chardev in server mode), checked under QEMU:
//! - the port is opened once and stays open; nothing tells the guest "a new client" except the
//!   host-connected state, which `poll` reports as `POLLHUP` while no host is connected;
//! - while no host is connected, `read` returns 0 once the data the old host sent is consumed
//!   (so EOF ends the session), and `write` blocks (`EAGAIN` with `O_NONBLOCK`); what the
//!   guest had queued is discarded by QEMU when the host goes, so nothing of the old session
//!   reaches the next host;
//! - `POLLHUP` is not final (the host may come back), while tokio treats a hang-up as final
//!   for a registration: every session gets its own registration (a `dup` of the port), and
//!   once it saw a hang-up the session reads EOF and its writes fail.
//!
//! The loop ([`sessions`]): wait until a host is connected, hand tonic one [`Session`] (a
//! fresh HTTP/2 server connection), wait until tonic drops it, repeat. The guest cannot close
//! the port, so a session that the server ended (the client's GOAWAY, a protocol error) leaves
//! the host's bytes in flight, and the next host may already be sending: every session first
//! discards input up to the HTTP/2 client preface ([`PREFACE`]), which starts every client
//! connection. The service (and the process table) is shared by all sessions.
//!
//! A host may also take over before the guest saw the last one leave: a disconnect and a
//! connect in quick succession, or a VM restored from a memory checkpoint, whose guest was in
//! the middle of a session with the host of the checkpoint (after the restore QEMU tells the
//! guest "connected", never "gone"). So a session also watches its input frame by frame: a
//! frame header starting with `P` (a length of at least 5 MiB, which no client may send: the
//! server's `SETTINGS_MAX_FRAME_SIZE` is h2's 16 KiB) is the first byte of a new client's
//! preface. The session then ends (EOF to the server), hands the bytes from there on to the
//! next session, and drops whatever the server still writes (meant for the last host).
//! A race remains only when the switch falls in the middle of a frame (the old host's last
//! frame cut off): the new client's first bytes are then taken for that frame's, it fails,
//! and must reconnect.
//!
//! The other way round, what the server writes after its host left goes to whichever host
//! QEMU has connected by then. The guest cannot tell when that happened (QEMU's
//! disconnect-connect reaches it late, or not at all), so a session stops writing once its
//! client sent GOAWAY: an HTTP/2 client (h2, so tonic and the node) sends it only when it
//! closes the connection with no stream left open, so nothing written after it has a
//! reader, and the server's own GOAWAY in reply, written after the client went, would
//! otherwise reach the next client first and end its connection after one call.

use std::fs;
use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use futures::Stream;
use rustix::event::{PollFd, PollFlags};
use rustix::fs::{FileType, Mode, OFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// The name of the guest channel's port (QEMU `virtserialport,name=space.0`).
pub const PORT_NAME: &str = "space.0";
/// Where the kernel lists virtio-serial ports.
pub const SYS_VIRTIO_PORTS: &str = "/sys/class/virtio-ports";
/// How often the host-connected state is polled while no host is connected.
const HOST_POLL: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum VportError {
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "no virtio-serial port named {name} under {dir} after {waited:?} (is virtio_console \
         loaded, and does QEMU have a virtserialport named {name}?)"
    )]
    NotFound {
        name: String,
        dir: PathBuf,
        waited: Duration,
    },
    #[error("{path} holds {value:?}, not MAJOR:MINOR")]
    BadDev { path: PathBuf, value: String },
    #[error("failed to create the device node {path}")]
    Mknod {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("failed to open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A port found under `/sys/class/virtio-ports`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortLocation {
    /// `/dev/vportNpM`.
    pub dev: PathBuf,
    pub major: u32,
    pub minor: u32,
}

/// The port named `name`: `sys_dir/<x>/name == name` gives `dev_dir/<x>` and the numbers in
/// `sys_dir/<x>/dev`. `None` while no such port exists (yet).
pub fn find_port(
    sys_dir: &Path,
    dev_dir: &Path,
    name: &str,
) -> Result<Option<PortLocation>, VportError> {
    let entries = match fs::read_dir(sys_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(VportError::Read {
                path: sys_dir.to_owned(),
                source,
            });
        }
    };
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    dirs.sort();
    for dir in dirs {
        let name_file = dir.join("name");
        let Ok(port_name) = fs::read_to_string(&name_file) else {
            continue; // a port without a name (or one going away)
        };
        if port_name.trim_end_matches('\n') != name {
            continue;
        }
        let dev_file = dir.join("dev");
        let value = fs::read_to_string(&dev_file).map_err(|source| VportError::Read {
            path: dev_file.clone(),
            source,
        })?;
        let (major, minor) = parse_dev(value.trim()).ok_or_else(|| VportError::BadDev {
            path: dev_file.clone(),
            value: value.clone(),
        })?;
        let file_name = dir.file_name().unwrap_or_default();
        return Ok(Some(PortLocation {
            dev: dev_dir.join(file_name),
            major,
            minor,
        }));
    }
    Ok(None)
}

fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// [`find_port`], retried until it appears (the driver probes asynchronously) or `timeout`.
pub fn wait_for_port(
    sys_dir: &Path,
    dev_dir: &Path,
    name: &str,
    timeout: Duration,
) -> Result<PortLocation, VportError> {
    let start = Instant::now();
    loop {
        if let Some(loc) = find_port(sys_dir, dev_dir, name)? {
            return Ok(loc);
        }
        if start.elapsed() >= timeout {
            return Err(VportError::NotFound {
                name: name.to_owned(),
                dir: sys_dir.to_owned(),
                waited: timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Creates the character device node when devtmpfs did not (there is no udev in the guest).
pub fn ensure_node(loc: &PortLocation) -> Result<(), VportError> {
    if fs::symlink_metadata(&loc.dev).is_ok() {
        return Ok(());
    }
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &loc.dev,
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o600),
        rustix::fs::makedev(loc.major, loc.minor),
    )
    .map_err(|e| VportError::Mknod {
        path: loc.dev.clone(),
        source: e.into(),
    })
}

/// What serves sessions: the real port, or a stand-in in tests.
pub trait Port: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Waits until a host is connected and returns a fresh session's byte stream.
    fn connect(&mut self) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

/// The virtio-serial port, opened once (non-blocking) for the daemon's lifetime.
#[derive(Debug)]
pub struct VirtioPort {
    fd: OwnedFd,
    path: PathBuf,
}

impl VirtioPort {
    pub fn open(path: &Path) -> Result<Self, VportError> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
            Mode::empty(),
        )
        .map_err(|e| VportError::Open {
            path: path.to_owned(),
            source: e.into(),
        })?;
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }

    /// Whether a host is connected now (the port polls without `POLLHUP`).
    fn host_connected(&self) -> io::Result<bool> {
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN | PollFlags::OUT)];
        rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default()))?;
        Ok(!fds[0].revents().contains(PollFlags::HUP))
    }
}

impl Port for VirtioPort {
    type Io = PortIo;

    async fn connect(&mut self) -> io::Result<PortIo> {
        let start = Instant::now();
        let mut told = false;
        while !self.host_connected()? {
            if !told && start.elapsed() >= Duration::from_secs(1) {
                tracing::info!(port = %self.path.display(), "waiting for the host to connect");
                told = true;
            }
            tokio::time::sleep(HOST_POLL).await;
        }
        // A registration of its own: tokio keeps a hang-up seen on a registration forever.
        let fd = rustix::io::fcntl_dupfd_cloexec(&self.fd, 3)?;
        // `new` is deprecated for arbitrary `AsRawFd` types, whose fd may change or close
        // under the registration; an `OwnedFd` cannot, which is the contract of the `unsafe`
        // `register` (this crate forbids `unsafe`).
        #[allow(deprecated)]
        let fd = AsyncFd::new(fd)?;
        Ok(PortIo { fd })
    }
}

/// One session's view of the port (a registration of its own).
#[derive(Debug)]
pub struct PortIo {
    fd: AsyncFd<OwnedFd>,
}

fn stale() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        "the host hung up during this session",
    )
}

impl AsyncRead for PortIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            if guard.ready().is_read_closed() {
                // The host hung up: EOF for this session, even if a new host is already
                // sending (that is the next session's preface).
                return Poll::Ready(Ok(()));
            }
            let unfilled = buf.initialize_unfilled();
            match guard
                .try_io(|fd| rustix::io::read(fd.get_ref(), &mut *unfilled).map_err(Into::into))
            {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_) => {}
            }
        }
    }
}

impl AsyncWrite for PortIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            if guard.ready().is_write_closed() {
                // Never write to the next host what this session meant for the last one.
                return Poll::Ready(Err(stale()));
            }
            if let Ok(r) =
                guard.try_io(|fd| rustix::io::write(fd.get_ref(), buf).map_err(Into::into))
            {
                return Poll::Ready(r);
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A port cannot be half-closed; the host ends the connection.
        Poll::Ready(Ok(()))
    }
}

/// The first bytes of every HTTP/2 client connection (RFC 9113, 3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Where a session stands with the client preface.
#[derive(Debug)]
enum Preface {
    /// Not seen yet: the bytes read so far that may still start it, and how many were dropped.
    Seeking {
        tail: Vec<u8>,
        discarded: usize,
    },
    /// Seen: these bytes (from the preface on) go to the server before anything else.
    Replay(Vec<u8>),
    Done,
}

impl Preface {
    fn new() -> Self {
        Preface::Seeking {
            tail: Vec::new(),
            discarded: 0,
        }
    }

    /// Feeds bytes read while seeking; switches to `Replay` once the preface is complete.
    fn feed(&mut self, data: &[u8]) {
        let Preface::Seeking { tail, discarded } = self else {
            return;
        };
        tail.extend_from_slice(data);
        if let Some(i) = tail.windows(PREFACE.len()).position(|w| w == PREFACE) {
            if i + *discarded > 0 {
                tracing::warn!(
                    discarded = i + *discarded,
                    "discarded bytes before the client preface (the last session's)"
                );
            }
            let rest = tail.split_off(i);
            *self = Preface::Replay(rest);
            return;
        }
        // Keep the longest suffix that is a beginning of the preface.
        let keep = (1..PREFACE.len().min(tail.len() + 1))
            .rev()
            .find(|&k| tail.ends_with(&PREFACE[..k]))
            .unwrap_or(0);
        *discarded += tail.len() - keep;
        tail.drain(..tail.len() - keep);
    }
}

/// An HTTP/2 GOAWAY frame's type (RFC 9113, 6.8).
const GOAWAY: u8 = 0x7;

/// Follows the frames a client sends after its preface, to see a new client's preface begin
/// where the next frame header should (see the module's doc), and the client's GOAWAY.
#[derive(Debug)]
struct Frames {
    /// The client sent a GOAWAY: it is leaving.
    goaway: bool,
    /// Bytes of the preface still to pass.
    skip: usize,
    /// Header bytes of the current frame seen so far.
    header: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to pass.
    left: usize,
}

impl Frames {
    fn new() -> Self {
        Self {
            goaway: false,
            skip: PREFACE.len(),
            header: [0; 9],
            have: 0,
            left: 0,
        }
    }

    /// Passes `data` (the next bytes to the server); returns the offset in it where a new
    /// client's preface starts, if it does.
    fn scan(&mut self, data: &[u8]) -> Option<usize> {
        let mut i = 0;
        while i < data.len() {
            if self.skip > 0 || self.left > 0 {
                let pending = if self.skip > 0 {
                    &mut self.skip
                } else {
                    &mut self.left
                };
                let n = (*pending).min(data.len() - i);
                *pending -= n;
                i += n;
                continue;
            }
            if self.have == 0 && data[i] == PREFACE[0] {
                return Some(i);
            }
            self.header[self.have] = data[i];
            self.have += 1;
            i += 1;
            if self.have == self.header.len() {
                let h = self.header;
                self.left = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                self.goaway |= h[3] == GOAWAY;
                self.have = 0;
            }
        }
        None
    }
}

/// Bytes one session read that belong to the next one (a new client's preface onwards).
pub type Carry = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

/// One HTTP/2 session's byte stream: input before the client preface is dropped (see the
/// module's doc); tells [`sessions`] when tonic drops it, and whether the host hung up (EOF,
/// or a reset) before.
#[derive(Debug)]
pub struct Session<T> {
    io: T,
    preface: Preface,
    frames: Frames,
    host_gone: bool,
    /// A new client's preface came in: EOF to the server, its writes dropped.
    superseded: bool,
    carry: Carry,
    /// Bytes passed to and from the server, for the log.
    read: u64,
    written: u64,
    ended: Option<oneshot::Sender<bool>>,
}

impl<T> Session<T> {
    fn new(io: T, ended: oneshot::Sender<bool>, carry: Carry) -> Self {
        let mut preface = Preface::new();
        let carried = std::mem::take(&mut *carry.lock().unwrap_or_else(|e| e.into_inner()));
        if !carried.is_empty() {
            preface.feed(&carried);
        }
        Self {
            io,
            preface,
            frames: Frames::new(),
            host_gone: false,
            superseded: false,
            carry,
            read: 0,
            written: 0,
            ended: Some(ended),
        }
    }

    /// Checks `data`, about to go to the server, for a new client's preface at a frame
    /// boundary; returns how many of its bytes go to the server (the rest is carried to
    /// the next session, and this one is superseded).
    fn pass(&mut self, data: &[u8]) -> usize {
        match self.frames.scan(data) {
            None => data.len(),
            Some(at) => {
                tracing::warn!(
                    carried = data.len() - at,
                    "a new host's preface arrived in the middle of a session: ending it"
                );
                self.carry
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&data[at..]);
                self.superseded = true;
                at
            }
        }
    }
}

fn is_hangup(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::UnexpectedEof
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for Session<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.superseded {
            return Poll::Ready(Ok(()));
        }
        loop {
            match &mut this.preface {
                Preface::Done => break,
                Preface::Replay(bytes) => {
                    let mut rest = std::mem::take(bytes);
                    let chunk: Vec<u8> = rest.drain(..rest.len().min(buf.remaining())).collect();
                    let keep = this.pass(&chunk);
                    buf.put_slice(&chunk[..keep]);
                    this.preface = if this.superseded {
                        // What the replay still held belongs to the new client too.
                        this.carry
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .append(&mut rest);
                        Preface::Done
                    } else if rest.is_empty() {
                        Preface::Done
                    } else {
                        Preface::Replay(rest)
                    };
                    return Poll::Ready(Ok(()));
                }
                Preface::Seeking { .. } => {
                    let mut chunk = [0u8; 4096];
                    let mut rb = ReadBuf::new(&mut chunk);
                    match ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb)) {
                        Ok(()) if rb.filled().is_empty() => {
                            this.host_gone = true;
                            return Poll::Ready(Ok(()));
                        }
                        Ok(()) => this.preface.feed(rb.filled()),
                        Err(e) => {
                            this.host_gone |= is_hangup(&e);
                            return Poll::Ready(Err(e));
                        }
                    }
                }
            }
        }
        let before = buf.filled().len();
        let wanted = buf.remaining() > 0;
        let r = ready!(Pin::new(&mut this.io).poll_read(cx, buf));
        let got = buf.filled()[before..].to_vec();
        let keep = this.pass(&got);
        buf.set_filled(before + keep);
        this.read += keep as u64;
        match &r {
            Ok(()) if wanted && got.is_empty() => this.host_gone = true,
            Err(e) if is_hangup(e) => this.host_gone = true,
            _ => {}
        }
        Poll::Ready(r)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Session<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.superseded || self.frames.goaway {
            // Meant for the last host (or for a client that has left): never for the next.
            return Poll::Ready(Ok(buf.len()));
        }
        let r = ready!(Pin::new(&mut self.io).poll_write(cx, buf));
        if let Ok(n) = &r {
            self.written += *n as u64;
        }
        if let Err(e) = &r
            && is_hangup(e)
        {
            self.host_gone = true;
        }
        Poll::Ready(r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T> Drop for Session<T> {
    fn drop(&mut self) {
        tracing::info!(
            host_gone = self.host_gone,
            read = self.read,
            written = self.written,
            preface_seen = !matches!(self.preface, Preface::Seeking { .. }),
            superseded = self.superseded,
            "session closed"
        );
        if let Some(tx) = self.ended.take() {
            let _ = tx.send(self.host_gone);
        }
    }
}

impl<T> tonic::transport::server::Connected for Session<T> {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

/// The sessions on `port`, one at a time: the next is yielded only once tonic dropped the
/// previous one. Never ends, never fails: errors waiting for a host are logged and retried.
pub fn sessions<P: Port>(port: P) -> impl Stream<Item = io::Result<Session<P::Io>>> {
    struct State<P> {
        port: P,
        previous: Option<(oneshot::Receiver<bool>, Instant)>,
        count: u64,
        carry: Carry,
    }
    let state = State {
        port,
        previous: None,
        count: 0,
        carry: Carry::default(),
    };
    futures::stream::unfold(state, |mut st| async move {
        if let Some((ended, since)) = st.previous.take() {
            let host_gone = ended.await.unwrap_or(true);
            tracing::info!(
                session = st.count,
                host_gone,
                secs = since.elapsed().as_secs_f64(),
                "session ended"
            );
        }
        loop {
            match st.port.connect().await {
                Ok(io) => {
                    st.count += 1;
                    tracing::info!(session = st.count, "host connected");
                    let (tx, rx) = oneshot::channel();
                    st.previous = Some((rx, Instant::now()));
                    let session = Session::new(io, tx, st.carry.clone());
                    return Some((Ok(session), st));
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot wait for the host; retrying in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    })
}

/// Finds (waiting up to `timeout`), creates if needed, and opens the channel port.
pub fn open_channel(timeout: Duration) -> Result<VirtioPort, VportError> {
    let loc = wait_for_port(
        Path::new(SYS_VIRTIO_PORTS),
        Path::new("/dev"),
        PORT_NAME,
        timeout,
    )?;
    ensure_node(&loc)?;
    VirtioPort::open(&loc.dev)
}

/// The `guest_daemon` fuzz target's check of how a session reads its host's bytes (first byte:
/// the chunk size, 1 to 64; the rest: what the host sends). Fed in chunks or whole, the
/// preface is found at the same offset, the first one in the stream, and the frame scan after
/// it sees a new client's preface at the same offset.
pub(crate) fn check_chunking(data: &[u8]) {
    let Some((&k, stream)) = data.split_first() else {
        return;
    };
    let k = usize::from(k % 64) + 1;
    let first = stream.windows(PREFACE.len()).position(|w| w == PREFACE);
    // Where each way of feeding saw the preface start.
    let seen = |p: &Preface, fed: usize| match p {
        Preface::Replay(v) => {
            assert!(v.starts_with(PREFACE));
            Some(fed - v.len())
        }
        Preface::Seeking { tail, discarded } => {
            assert_eq!(tail.len() + discarded, fed);
            assert!(tail.len() < PREFACE.len() && PREFACE.starts_with(tail));
            None
        }
        Preface::Done => unreachable!("feed never ends a preface"),
    };
    let mut whole = Preface::new();
    whole.feed(stream);
    assert_eq!(seen(&whole, stream.len()), first);
    let mut parts = Preface::new();
    let mut fed = 0;
    for c in stream.chunks(k) {
        parts.feed(c);
        fed += c.len();
        if matches!(parts, Preface::Replay(_)) {
            break;
        }
    }
    assert_eq!(seen(&parts, fed), first);

    let after = first.map_or(stream, |i| &stream[i..]);
    let mut whole = Frames::new();
    let at = whole.scan(after);
    let mut parts = Frames::new();
    let mut base = 0;
    let mut at_parts = None;
    for c in after.chunks(k) {
        if let Some(i) = parts.scan(c) {
            at_parts = Some(base + i);
            break;
        }
        base += c.len();
    }
    assert_eq!(at, at_parts);
}

#[cfg(test)]
mod tests;
