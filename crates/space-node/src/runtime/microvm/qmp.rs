//! A small synchronous QMP client over serde_json: greeting, `qmp_capabilities`, commands with
//! an `id`, events kept aside. Every read has a deadline. Why not the `qapi` crate: decision
//! 0014, "QMP".

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("failed to connect to QMP at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("QMP i/o failed during {op}")]
    Io {
        op: String,
        #[source]
        source: io::Error,
    },
    #[error("QMP connection closed")]
    Closed,
    #[error("no QMP answer to {0} in time")]
    Timeout(String),
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    #[error("QMP {cmd} failed: {desc} ({class})")]
    Command {
        cmd: String,
        class: String,
        desc: String,
    },
}

/// Events taken before the greeting at most: past them, what comes is not QMP.
const MAX_EARLY_EVENTS: usize = 16;

/// One QMP session. QEMU serves one client per QMP socket at a time; others queue.
pub struct Qmp {
    stream: BufReader<UnixStream>,
    /// Bytes of a line not complete yet (a read timed out in the middle of it).
    partial: Vec<u8>,
    next_id: u64,
    /// Events read while waiting for something else, oldest first.
    pub events: Vec<Value>,
}

impl std::fmt::Debug for Qmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qmp")
            .field("next_id", &self.next_id)
            .finish()
    }
}

impl Qmp {
    /// Connect to `path` and negotiate, all within `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path).map_err(|source| QmpError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        Self::handshake(stream, Instant::now() + timeout)
    }

    pub fn handshake(stream: UnixStream, deadline: Instant) -> Result<Self, QmpError> {
        let mut q = Self {
            stream: BufReader::new(stream),
            partial: Vec::new(),
            next_id: 1,
            events: Vec::new(),
        };
        // QEMU can write an event to a new client before its greeting (seen once: a RESUME
        // first, a VM starting under TCG; the greeting and the events come from different
        // threads of QEMU's). The event is this VM's, so it is kept with the others.
        let greeting = loop {
            let m = q
                .read_message(deadline)?
                .ok_or_else(|| QmpError::Timeout("the greeting".into()))?;
            if m.get("event").is_some() && q.events.len() < MAX_EARLY_EVENTS {
                q.events.push(m);
                continue;
            }
            break m;
        };
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "greeting expected, got {greeting}"
            )));
        }
        q.execute("qmp_capabilities", None, deadline)?;
        Ok(q)
    }

    /// The next message, or None when `deadline` passes first.
    pub fn read_message(&mut self, deadline: Instant) -> Result<Option<Value>, QmpError> {
        loop {
            if let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.partial.drain(..=end).collect();
                let text = String::from_utf8_lossy(&line);
                if text.trim().is_empty() {
                    continue;
                }
                return serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| QmpError::Protocol(format!("invalid JSON {text:?}: {e}")));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.stream
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(|source| QmpError::Io {
                    op: "set a read timeout".into(),
                    source,
                })?;
            let buf = match self.stream.fill_buf() {
                Ok(b) => b,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(QmpError::Io {
                        op: "read".into(),
                        source,
                    });
                }
            };
            if buf.is_empty() {
                return Err(QmpError::Closed);
            }
            let n = buf.len();
            self.partial.extend_from_slice(buf);
            self.stream.consume(n);
        }
    }

    /// Run `cmd`; its `return` value, or an error carrying QEMU's class and description.
    /// Events that arrive meanwhile go to [`Qmp::events`].
    pub fn execute(
        &mut self,
        cmd: &str,
        args: Option<Value>,
        deadline: Instant,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut req = json!({ "execute": cmd, "id": id });
        if let Some(a) = args {
            req["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&req)
            .map_err(|e| QmpError::Protocol(format!("cannot encode {cmd}: {e}")))?;
        bytes.push(b'\n');
        self.stream
            .get_mut()
            .write_all(&bytes)
            .map_err(|source| QmpError::Io {
                op: format!("send {cmd}"),
                source,
            })?;
        loop {
            let Some(msg) = self.read_message(deadline)? else {
                return Err(QmpError::Timeout(cmd.to_owned()));
            };
            if msg.get("event").is_some() {
                self.events.push(msg);
                continue;
            }
            if msg.get("id").and_then(Value::as_u64) != Some(id) {
                // An answer to a command of an earlier, timed-out call: not ours.
                continue;
            }
            if let Some(r) = msg.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = msg.get("error") {
                let s = |k: &str| {
                    e.get(k)
                        .and_then(Value::as_str)
                        .unwrap_or("none given")
                        .to_owned()
                };
                return Err(QmpError::Command {
                    cmd: cmd.to_owned(),
                    class: s("class"),
                    desc: s("desc"),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected answer {msg}")));
        }
    }

    /// `query-status`'s `status` ("running", "paused", "prelaunch", ...).
    pub fn status(&mut self, deadline: Instant) -> Result<String, QmpError> {
        let r = self.execute("query-status", None, deadline)?;
        r.get("status")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| QmpError::Protocol(format!("query-status without status: {r}")))
    }
}
