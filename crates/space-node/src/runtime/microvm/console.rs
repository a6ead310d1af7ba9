//! The guest's serial console, kept within a bound (decision 0045). The guest's root can
//! write to `/dev/console` as fast as the serial port goes, and a `file` chardev would store
//! all of it in the run dir, which is a tmpfs: host memory. So QEMU's serial chardev is a
//! `socket` that connects to a listener the node made, and the node keeps what arrives in
//! `console.log`, moved to `console.log.1` each time it reaches [`ROTATE_AT`]: at most twice
//! that per VM, the newest output always kept. A node that restarts stops reading; QEMU then
//! drops what the guest writes (a client socket that lost its peer discards output).

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `console.log` is moved aside when it reaches this size.
pub(crate) const ROTATE_AT: u64 = 1 << 20;

/// The listener QEMU's serial chardev connects to, bound before QEMU starts.
#[derive(Debug)]
pub(crate) struct ConsoleListener(UnixListener);

impl ConsoleListener {
    /// Binds `socket` (a stale one removed first).
    pub(crate) fn bind(socket: &Path) -> io::Result<Self> {
        super::remove_if_exists(socket)?;
        UnixListener::bind(socket).map(Self)
    }

    /// Keeps the console in `log` on a thread of its own: it waits up to `accept_within` for
    /// QEMU to connect, then reads until QEMU closes the connection (when it exits).
    pub(crate) fn keep(self, log: PathBuf, accept_within: Duration) {
        let spawned = std::thread::Builder::new()
            .name("vm-console".into())
            .spawn(move || {
                if let Err(e) = keep(self.0, &log, accept_within) {
                    tracing::debug!(log = %log.display(), error = %e, "console no longer kept");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the console's reader: the console is dropped");
        }
    }
}

fn keep(listener: UnixListener, log: &Path, accept_within: Duration) -> io::Result<()> {
    let timeout =
        rustix::event::Timespec::try_from(accept_within).unwrap_or(rustix::event::Timespec {
            tv_sec: 60,
            tv_nsec: 0,
        });
    let mut fds = [rustix::event::PollFd::new(
        &listener,
        rustix::event::PollFlags::IN,
    )];
    if rustix::event::poll(&mut fds, Some(&timeout))? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "QEMU never connected its console",
        ));
    }
    let (mut conn, _) = listener.accept()?;
    // One connection: QEMU does not reconnect.
    drop(listener);
    let mut sink = Rotating::open(log.to_path_buf())?;
    let mut buf = vec![0u8; 16 << 10];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => sink.write(&buf[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A log file moved to `<name>.1` (replacing the one before) when it reaches [`ROTATE_AT`].
struct Rotating {
    path: PathBuf,
    file: fs::File,
    len: u64,
}

impl Rotating {
    fn open(path: PathBuf) -> io::Result<Self> {
        let file = Self::create(&path)?;
        Ok(Self { path, file, len: 0 })
    }

    fn create(path: &Path) -> io::Result<fs::File> {
        fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
    }

    fn write(&mut self, b: &[u8]) -> io::Result<()> {
        if self.len > 0 && self.len + b.len() as u64 > ROTATE_AT {
            fs::rename(&self.path, rotated(&self.path))?;
            self.file = Self::create(&self.path)?;
            self.len = 0;
        }
        self.file.write_all(b)?;
        self.len += b.len() as u64;
        Ok(())
    }
}

/// Where `log` goes when it is rotated.
pub(crate) fn rotated(log: &Path) -> PathBuf {
    let mut s = log.as_os_str().to_owned();
    s.push(".1");
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn the_console_is_kept_within_two_rotations_whatever_the_guest_writes() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("console.sock");
        let log = dir.path().join("console.log");
        let l = ConsoleListener::bind(&sock).unwrap();
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || keep(l.0, &log, Duration::from_secs(10)))
        };
        let mut guest = UnixStream::connect(&sock).unwrap();
        let line = b"flood flood flood flood flood flood flood flood flood flood\n";
        let mut written = 0u64;
        while written < 10 * ROTATE_AT {
            guest.write_all(line).unwrap();
            written += line.len() as u64;
        }
        guest.write_all(b"the last line\n").unwrap();
        drop(guest);
        reader.join().unwrap().unwrap();
        let now = fs::metadata(&log).unwrap().len();
        let before = fs::metadata(rotated(&log)).unwrap().len();
        assert!(now <= ROTATE_AT && before <= ROTATE_AT, "{now} {before}");
        assert!(
            fs::read_to_string(&log)
                .unwrap()
                .ends_with("the last line\n")
        );
    }

    #[test]
    fn a_qemu_that_never_connects_frees_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        let l = ConsoleListener::bind(&dir.path().join("console.sock")).unwrap();
        let e = keep(
            l.0,
            &dir.path().join("console.log"),
            Duration::from_millis(50),
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}
