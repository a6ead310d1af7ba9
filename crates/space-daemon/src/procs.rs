//! The process table: spawning, reaping (the daemon owns ALL reaping: it is PID 1, so
//! orphans re-parent to it), output capture into per-process rings, subscriptions (Exec and
//! Attach streams), stdin, signals and terminal size.
//!
//! Reaping: children are spawned with `std::process::Command` (never `tokio::process`) and
//! reaped only by [`Procs::reap`], which loops `waitpid(-1, WNOHANG)` on every SIGCHLD. Spawning
//! and reaping are serialized by `reap_lock`, because std's spawn waits for a child whose exec
//! failed; holding the lock also stops a pid from being reaped (and reused) while we signal it.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use rustix::process::{WaitOptions, WaitStatus};
use space_proto::{
    ExecRequest, Exit, ProcessEvent, ProcessInfo, Stream as OutStream, process_event,
};
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, watch};

use crate::config::Config;
use crate::exec::{self, ExecError};
use crate::output::{OutputRing, RingRead};

/// Largest output chunk sent in one event, and largest single read from a pipe or pty.
pub const OUTPUT_CHUNK: usize = 64 * 1024;
/// After a process exits, how long to keep reading output that descendants still write to
/// its pipes before declaring it finished.
const EXIT_GRACE: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("no process with pid {0}")]
    NotFound(u32),
    #[error("process {0} has exited")]
    Exited(u32),
    #[error("offset {offset} is beyond the end of the output ({end})")]
    OutOfRange { offset: u64, end: u64 },
    #[error("process {0} was not started with stdin")]
    NoStdin(u32),
    #[error("stdin of process {0} is closed")]
    StdinClosed(u32),
    #[error("process {0} has no terminal")]
    NoTty(u32),
    #[error("process {0} has a terminal: send ^D (0x04) to signal end of input instead")]
    TtyStdin(u32),
    #[error("invalid signal {0}")]
    BadSignal(i32),
    #[error("failed to signal process {pid}")]
    Signal {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("failed to write to stdin of process {pid}")]
    Stdin {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("failed to resize the terminal of process {pid}")]
    Resize {
        pid: u32,
        #[source]
        source: io::Error,
    },
}

/// Events of one process, as streamed by Exec and Attach.
pub type EventStream = Pin<Box<dyn Stream<Item = ProcessEvent> + Send>>;

/// One started process (running, or exited and retained).
pub struct Proc {
    pub pid: u32,
    pub argv: Vec<String>,
    pub tag: String,
    pub tty: bool,
    pub cwd: String,
    pub user: String,
    pub started_unix_ms: u64,
    stdin_requested: bool,
    /// Where WriteStdin goes: the stdin pipe, or the pty master. `None` once closed.
    input: Arc<tokio::sync::Mutex<Option<pipe::Sender>>>,
    /// A handle on the pty master while the process runs (for Resize).
    pty: Mutex<Option<OwnedFd>>,
    state: Mutex<ProcState>,
    changed: watch::Sender<()>,
    /// Signalled when a holding reader moves on or goes away (see [`ProcState::holds`]).
    progress: tokio::sync::Notify,
}

struct ProcState {
    ring: OutputRing,
    /// Set by the reaper (end_offset filled in when finished).
    exit: Option<Exit>,
    /// Exit status known and output drained: the Exit event may be sent.
    finished: bool,
    exit_tx: Option<oneshot::Sender<()>>,
    /// The cursors of live foreground exec streams, by reader id. While one is more than the
    /// ring's capacity behind, the output readers wait for it instead of dropping bytes it has
    /// not read: a foreground exec loses nothing, as over a pipe, and a reader that goes away
    /// (its client left) releases the process at once.
    holds: HashMap<u64, u64>,
    next_hold: u64,
}

impl ProcState {
    /// Whether appending `chunk` more bytes would drop output a holding reader has not read.
    fn held(&self, chunk: usize) -> bool {
        let start = self.ring.start();
        let end = self.ring.end() + chunk as u64;
        self.holds
            .values()
            .any(|&cursor| end - cursor.max(start) > self.ring.cap() as u64)
    }
}

impl Proc {
    fn state(&self) -> MutexGuard<'_, ProcState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn append(&self, stream: OutStream, data: &[u8]) {
        self.state().ring.push(stream, data);
        self.changed.send_replace(());
    }

    fn has_exited(&self) -> bool {
        self.state().exit.is_some()
    }

    pub fn info(&self) -> ProcessInfo {
        let st = self.state();
        ProcessInfo {
            pid: self.pid,
            argv: self.argv.clone(),
            tag: self.tag.clone(),
            tty: self.tty,
            running: st.exit.is_none(),
            exit: st.exit.map(|e| Exit {
                end_offset: st.ring.end(),
                ..e
            }),
            started_unix_ms: self.started_unix_ms,
            output_bytes: st.ring.end(),
            cwd: self.cwd.clone(),
            user: self.user.clone(),
        }
    }
}

/// The table of processes the daemon started.
pub struct Procs {
    cfg: Arc<Config>,
    table: Mutex<HashMap<u32, Arc<Proc>>>,
    reap_lock: Mutex<()>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn exit_from(status: WaitStatus) -> Exit {
    if let Some(code) = status.exit_status() {
        Exit {
            code,
            ..Default::default()
        }
    } else if let Some(sig) = status.terminating_signal() {
        Exit {
            code: 128 + sig,
            signal: sig,
            signaled: true,
            end_offset: 0,
        }
    } else {
        Exit {
            code: -1,
            ..Default::default()
        }
    }
}

fn receiver(fd: OwnedFd) -> io::Result<pipe::Receiver> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    pipe::Receiver::from_owned_fd_unchecked(fd)
}

fn sender(fd: OwnedFd) -> io::Result<pipe::Sender> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    pipe::Sender::from_owned_fd_unchecked(fd)
}

impl Procs {
    pub fn new(cfg: Arc<Config>) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            table: Mutex::new(HashMap::new()),
            reap_lock: Mutex::new(()),
        })
    }

    fn table(&self) -> MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reap_guard(&self) -> MutexGuard<'_, ()> {
        self.reap_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, pid: u32) -> Result<Arc<Proc>, ProcError> {
        self.table()
            .get(&pid)
            .cloned()
            .ok_or(ProcError::NotFound(pid))
    }

    pub fn list(&self) -> Vec<ProcessInfo> {
        let procs: Vec<Arc<Proc>> = self.table().values().cloned().collect();
        let mut infos: Vec<ProcessInfo> = procs.iter().map(|p| p.info()).collect();
        infos.sort_by_key(|i| i.pid);
        infos
    }

    /// Drops every finished process from the table (a warm pool's sandbox handed to its user
    /// forgets the platform's warm-up). Returns how many.
    pub fn forget_exited(&self) -> usize {
        let mut table = self.table();
        let before = table.len();
        table.retain(|_, p| p.state().exit.is_none());
        before - table.len()
    }

    /// Start a process. Must run inside the tokio runtime (the output fds are registered).
    pub fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Arc<Proc>, ExecError> {
        let exec::Prepared {
            mut cmd,
            pty_master,
            stdin_piped: _,
            cwd,
            user,
        } = exec::prepare(&self.cfg, &req)?;
        let program = req.argv[0].clone();
        let (exit_tx, exit_rx) = oneshot::channel();

        let guard = self.reap_guard();
        let mut child = cmd.spawn().map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => ExecError::NotFound(program.clone()),
            _ => ExecError::Spawn {
                program: program.clone(),
                source,
            },
        })?;
        let pid = child.id();
        // The child's ends (pty slave, pipe ends) must not stay open here.
        drop(cmd);
        let wiring = (|| -> io::Result<_> {
            let mut readers = Vec::new();
            let (pty, input) = match pty_master {
                Some(master) => {
                    readers.push((receiver(master.try_clone()?)?, OutStream::Pty));
                    let input = sender(master.try_clone()?)?;
                    (Some(master), Some(input))
                }
                None => {
                    if let Some(out) = child.stdout.take() {
                        readers.push((receiver(out.into())?, OutStream::Stdout));
                    }
                    if let Some(err) = child.stderr.take() {
                        readers.push((receiver(err.into())?, OutStream::Stderr));
                    }
                    let input = child.stdin.take().map(|i| sender(i.into())).transpose()?;
                    (None, input)
                }
            };
            Ok((pty, readers, input))
        })();
        let (pty, readers, input) = match wiring {
            Ok(w) => w,
            Err(source) => {
                // Unreachable in practice (epoll registration failed); don't leave it running.
                let _ = space_sys::process::send_signal(pid as i32, libc::SIGKILL, true);
                return Err(ExecError::Spawn { program, source });
            }
        };
        let proc = Arc::new(Proc {
            pid,
            argv: req.argv.clone(),
            tag: req.tag.clone(),
            tty: req.tty,
            cwd,
            user,
            started_unix_ms: now_ms(),
            stdin_requested: req.stdin || req.tty,
            input: Arc::new(tokio::sync::Mutex::new(input)),
            pty: Mutex::new(pty),
            state: Mutex::new(ProcState {
                ring: OutputRing::new(self.cfg.output_buffer_bytes),
                exit: None,
                finished: false,
                exit_tx: Some(exit_tx),
                holds: HashMap::new(),
                next_hold: 0,
            }),
            changed: watch::channel(()).0,
            progress: tokio::sync::Notify::new(),
        });
        // A retained, exited process with a reused pid is replaced.
        self.table().insert(pid, proc.clone());
        drop(guard);
        tracing::debug!(pid, tty = req.tty, tag = %req.tag, "process started");

        if !req.stdin_data.is_empty() {
            // Take the stdin lock now so stdin_data goes before any WriteStdin.
            let lock = proc.input.clone().try_lock_owned();
            if let Ok(mut input) = lock {
                let data = req.stdin_data;
                let close = !req.stdin && !req.tty;
                tokio::spawn(async move {
                    if let Some(fd) = input.as_ref()
                        && let Err(e) = write_all(fd, &data).await
                    {
                        tracing::debug!(pid, error = %e, "writing stdin_data failed");
                    }
                    if close {
                        *input = None;
                    }
                });
            }
        }

        tokio::spawn(self.clone().supervise(proc.clone(), readers, exit_rx));
        Ok(proc)
    }

    /// Read the process's output until it exits and its pipes close (or the grace period
    /// after exit runs out), then mark it finished and schedule it to be forgotten.
    async fn supervise(
        self: Arc<Self>,
        proc: Arc<Proc>,
        readers: Vec<(pipe::Receiver, OutStream)>,
        mut exit_rx: oneshot::Receiver<()>,
    ) {
        {
            // Scoped: the output fds close when `reading` is dropped.
            let reading = futures::future::join_all(
                readers
                    .into_iter()
                    .map(|(fd, stream)| read_loop(&proc, fd, stream)),
            );
            tokio::pin!(reading);
            tokio::select! {
                _ = &mut reading => { let _ = (&mut exit_rx).await; }
                _ = &mut exit_rx => {
                    // The grace runs while the readers are free: output a holding reader has
                    // yet to take (a foreground exec's) is not cut off by it.
                    while tokio::time::timeout(EXIT_GRACE, &mut reading).await.is_err()
                        && proc.state().held(OUTPUT_CHUNK)
                    {}
                }
            }
        }
        {
            let mut st = proc.state();
            st.finished = true;
            let end = st.ring.end();
            if let Some(e) = st.exit.as_mut() {
                e.end_offset = end;
            }
            st.ring.shrink();
            tracing::debug!(pid = proc.pid, exit = ?st.exit, output_bytes = end, "process finished");
        }
        crate::idle::note_activity();
        if let Ok(mut input) = proc.input.try_lock() {
            *input = None;
        }
        *proc.pty.lock().unwrap_or_else(|e| e.into_inner()) = None;
        proc.changed.send_replace(());
        let retention = self.cfg.exited_retention;
        tokio::time::sleep(retention).await;
        let mut table = self.table();
        if table.get(&proc.pid).is_some_and(|p| Arc::ptr_eq(p, &proc)) {
            table.remove(&proc.pid);
            crate::idle::note_activity();
        }
    }

    /// Reap every exited child (ours and adopted orphans); route statuses of ours.
    pub fn reap(&self) {
        let _guard = self.reap_guard();
        loop {
            // wait(): pid -1, any child. (rustix's waitpid(None) is pid 0: only our own
            // process group, and every child is in its own.)
            match rustix::process::wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    let pid = pid.as_raw_nonzero().get() as u32;
                    let proc = self.table().get(&pid).cloned();
                    match proc {
                        Some(p) => {
                            let mut st = p.state();
                            if st.exit.is_none() {
                                st.exit = Some(exit_from(status));
                                if let Some(tx) = st.exit_tx.take() {
                                    let _ = tx.send(());
                                }
                            }
                        }
                        None => tracing::debug!(pid, "reaped an orphan"),
                    }
                }
                Ok(None) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::CHILD) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid failed");
                    return;
                }
            }
        }
    }

    /// Reap on every SIGCHLD, forever. `sigchld` must be registered before the first spawn.
    pub async fn run_reaper(self: Arc<Self>, mut sigchld: tokio::signal::unix::Signal) {
        loop {
            self.reap();
            if sigchld.recv().await.is_none() {
                return;
            }
        }
    }

    /// Events from `offset`: see [`events`]. Errors for unknown pids and offsets past the end.
    pub fn attach(&self, pid: u32, offset: u64, follow: bool) -> Result<EventStream, ProcError> {
        let proc = self.get(pid)?;
        let end = proc.state().ring.end();
        if offset > end {
            return Err(ProcError::OutOfRange { offset, end });
        }
        Ok(events(proc, offset, follow, false, false))
    }

    pub fn signal(&self, pid: u32, signal: i32, group: bool) -> Result<(), ProcError> {
        if !(0..=64).contains(&signal) {
            return Err(ProcError::BadSignal(signal));
        }
        let proc = self.get(pid)?;
        // Hold the reap lock: an un-reaped pid cannot be reused while we signal it.
        let _guard = self.reap_guard();
        if !group && proc.has_exited() {
            return Err(ProcError::Exited(pid));
        }
        // A group outlives its leader while members remain; the pgid cannot be reused then.
        space_sys::process::send_signal(pid as i32, signal, group).map_err(|source| {
            if source.raw_os_error() == Some(libc::ESRCH) {
                ProcError::Exited(pid)
            } else {
                ProcError::Signal { pid, source }
            }
        })
    }

    pub async fn write_stdin(&self, pid: u32, data: &[u8]) -> Result<(), ProcError> {
        let proc = self.get(pid)?;
        if !proc.stdin_requested {
            return Err(ProcError::NoStdin(pid));
        }
        let input = proc.input.lock().await;
        let Some(fd) = input.as_ref() else {
            return Err(ProcError::StdinClosed(pid));
        };
        write_all(fd, data).await.map_err(|source| {
            if source.raw_os_error() == Some(libc::EPIPE) {
                ProcError::StdinClosed(pid)
            } else {
                ProcError::Stdin { pid, source }
            }
        })
    }

    pub async fn close_stdin(&self, pid: u32) -> Result<(), ProcError> {
        let proc = self.get(pid)?;
        if proc.tty {
            return Err(ProcError::TtyStdin(pid));
        }
        if !proc.stdin_requested {
            return Err(ProcError::NoStdin(pid));
        }
        *proc.input.lock().await = None;
        Ok(())
    }

    pub fn resize(&self, pid: u32, rows: u32, cols: u32) -> Result<(), ProcError> {
        let proc = self.get(pid)?;
        if !proc.tty {
            return Err(ProcError::NoTty(pid));
        }
        let pty = proc.pty.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pty) = pty.as_ref() else {
            return Err(ProcError::Exited(pid));
        };
        exec::set_winsize(pty, rows, cols).map_err(|source| ProcError::Resize { pid, source })
    }
}

async fn read_loop(proc: &Proc, rx: pipe::Receiver, stream: OutStream) {
    let mut buf = vec![0u8; OUTPUT_CHUNK];
    loop {
        // Back-pressure from a foreground exec's reader: the process blocks on its full pipe.
        loop {
            let progressed = proc.progress.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            if !proc.state().held(OUTPUT_CHUNK) {
                break;
            }
            progressed.await;
        }
        if rx.readable().await.is_err() {
            return;
        }
        match rx.try_read(&mut buf) {
            Ok(0) => return,
            Ok(n) => proc.append(stream, &buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            // EIO on a pty master: every slave fd is closed.
            Err(_) => return,
        }
    }
}

async fn write_all(tx: &pipe::Sender, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        tx.writable().await?;
        match tx.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The event stream of `proc` from `offset`: a Gap if that part was dropped, the output, and
/// (when `follow`, or when the process already finished) Exit at the end. With `started`,
/// Started{pid} comes first. Without `hold` the stream only reads the ring: a slow or vanished
/// client never blocks the process, and one that falls behind the ring gets a Gap. With `hold`
/// (a foreground exec) the process waits for this reader while it lives (`ProcState::holds`).
pub fn events(
    proc: Arc<Proc>,
    offset: u64,
    follow: bool,
    started: bool,
    hold: bool,
) -> EventStream {
    struct Sub {
        proc: Arc<Proc>,
        cursor: u64,
        rx: watch::Receiver<()>,
        follow: bool,
        started: bool,
        done: bool,
        hold: Option<u64>,
    }
    impl Sub {
        fn advance(&mut self, st: &mut ProcState, to: u64) {
            self.cursor = to;
            if let Some(h) = self.hold {
                st.holds.insert(h, to);
                self.proc.progress.notify_waiters();
            }
        }
    }
    impl Drop for Sub {
        fn drop(&mut self) {
            if let Some(h) = self.hold {
                self.proc.state().holds.remove(&h);
                self.proc.progress.notify_waiters();
            }
        }
    }
    enum Step {
        Emit(process_event::Event),
        Last(process_event::Event),
        Stop,
        Wait,
    }
    let rx = proc.changed.subscribe();
    let hold = hold.then(|| {
        let mut st = proc.state();
        let h = st.next_hold;
        st.next_hold += 1;
        st.holds.insert(h, offset);
        h
    });
    let sub = Sub {
        proc,
        cursor: offset,
        rx,
        follow,
        started,
        done: false,
        hold,
    };
    Box::pin(futures::stream::unfold(sub, |mut s| async move {
        if s.started {
            s.started = false;
            let ev = process_event::Event::Started(space_proto::Started { pid: s.proc.pid });
            return Some((ProcessEvent { event: Some(ev) }, s));
        }
        if s.done {
            return None;
        }
        loop {
            s.rx.borrow_and_update();
            let step = {
                let proc = s.proc.clone();
                let mut st = proc.state();
                match st.ring.read(s.cursor, OUTPUT_CHUNK) {
                    RingRead::Gap { from, to } => {
                        s.advance(&mut st, to);
                        Step::Emit(process_event::Event::Gap(space_proto::Gap { from, to }))
                    }
                    RingRead::Data {
                        stream,
                        offset,
                        data,
                    } => {
                        s.advance(&mut st, offset + data.len() as u64);
                        Step::Emit(process_event::Event::Output(space_proto::Output {
                            stream: stream as i32,
                            offset,
                            data,
                        }))
                    }
                    RingRead::End if st.finished => {
                        let exit = st.exit.unwrap_or_default();
                        Step::Last(process_event::Event::Exit(exit))
                    }
                    RingRead::End if !s.follow => Step::Stop,
                    RingRead::End => Step::Wait,
                }
            };
            match step {
                Step::Emit(ev) => return Some((ProcessEvent { event: Some(ev) }, s)),
                Step::Last(ev) => {
                    s.done = true;
                    return Some((ProcessEvent { event: Some(ev) }, s));
                }
                Step::Stop => return None,
                Step::Wait => {
                    if s.rx.changed().await.is_err() {
                        return None;
                    }
                }
            }
        }
    }))
}
