//! The daemon's own log, bounded. In a namespace sandbox its stderr is `daemon.log` in the
//! node's run dir, a file on the host (on tmpfs, so in the host's memory), and what the
//! sandbox's clients ask of the daemon makes it log: a log that only grew would let a tenant
//! fill the host a line at a time. Once the file passes [`LOG_MAX`] it is cut back to empty,
//! with a line that says so. (In a microvm stderr is the serial console, which the node keeps
//! within 2 MiB itself, decision 0045; a device is never cut.)

use std::io::{self, Write};
use std::os::fd::AsFd;
use std::sync::Mutex;

/// The most the log file holds before it is cut.
pub const LOG_MAX: u64 = 1 << 20;
/// How many bytes are written between two looks at the file's size.
const CHECK_EVERY: u64 = 16 << 10;

/// A writer that cuts the regular file behind it once it passes `max` bytes.
#[derive(Debug)]
pub struct BoundedLog<F> {
    inner: Mutex<(F, u64)>,
    max: u64,
}

impl<F: Write + AsFd> BoundedLog<F> {
    pub fn new(file: F, max: u64) -> Self {
        Self {
            inner: Mutex::new((file, 0)),
            max,
        }
    }

    /// Writes `buf` whole (one log line), then cuts the file when it has grown past the
    /// bound.
    pub fn write_line(&self, buf: &[u8]) -> io::Result<()> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (file, since) = &mut *g;
        file.write_all(buf)?;
        *since += buf.len() as u64;
        if *since >= CHECK_EVERY.min(self.max) {
            *since = 0;
            let st = rustix::fs::fstat(file.as_fd())?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
                && st.st_size as u64 > self.max
            {
                rustix::fs::ftruncate(file.as_fd(), 0)?;
                // The file is opened to append, so this goes to its start.
                writeln!(
                    file,
                    "space-daemon: the log passed {} bytes and was cut",
                    self.max
                )?;
            }
        }
        Ok(())
    }
}

/// The daemon's stderr, bounded at [`LOG_MAX`], for `tracing_subscriber`.
pub fn stderr() -> &'static BoundedLog<io::Stderr> {
    static LOG: std::sync::OnceLock<BoundedLog<io::Stderr>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| BoundedLog::new(io::stderr(), LOG_MAX))
}

/// One event's writer: its bytes go to the log in one write.
pub struct Line(Vec<u8>);

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let _ = stderr().write_line(&self.0);
    }
}

/// Makes a [`Line`] per event.
pub fn make_writer() -> Line {
    Line(Vec::with_capacity(256))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_file_is_cut_past_its_bound_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("daemon.log");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let log = BoundedLog::new(file, 64 << 10);
        let line = [b'x'; 999];
        for _ in 0..1000 {
            log.write_line(&line).unwrap();
            let len = std::fs::metadata(&path).unwrap().len();
            assert!(len <= (64 << 10) + CHECK_EVERY + 1000, "{len}");
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("space-daemon: the log passed 65536 bytes and was cut\n"));
    }

    #[test]
    fn a_device_is_never_cut() {
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        let log = BoundedLog::new(dev, 10);
        for _ in 0..100 {
            log.write_line(b"a line\n").unwrap();
        }
    }
}
