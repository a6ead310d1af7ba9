//! Memory checkpoints (issue 6, item 7): with file-backed guest RAM
//! ([`super::MicrovmConfig::memory_dir`]) and QEMU's `x-ignore-shared` migration capability,
//! a checkpoint writes only device state (tens of KiB) and copies the memory file (a reflink
//! on btrfs), and a restore starts a new QEMU on a copy of that file with `-incoming defer`.
//! Two restores of one checkpoint are a fork. See decision 0014, "Memory checkpoints".
//!
//! A checkpoint directory holds:
//! - `state`: QEMU's migration stream without RAM (devices, CPU, the RAM block list);
//! - `state.sha256`: the state file's SHA-256 (hex), checked before a restore starts QEMU;
//! - `mem`: the guest RAM, a copy of the memory file taken while the VM was paused.
//!
//! A VM whose RAM is mapped privately ([`RestoreMode::Private`]) has no file that is its RAM:
//! its checkpoint has no `mem`, and `state` carries the RAM (QEMU asked which through QOM).
//! A restore of such a checkpoint loads it into a fresh shared memory file.
//!
//! The migration stream goes over a unix socket in the VM's run dir (QEMU's seccomp sandbox
//! denies `exec:` and QEMU 7.2 has no `file:` URI): on save QEMU connects to a socket the
//! node listens on; on restore QEMU listens (`migrate-incoming`) and the node feeds it.
//!
//! Readiness after a restore: the guest does not boot again, so it prints no
//! [`super::READY_MARKER`], and its channel port was open already (no `VSERPORT_CHANGE`).
//! `restore` returns once the guest answers an HTTP/2 client preface on the channel socket
//! with a SETTINGS frame: that is the daemon's own loop serving again, which is what the
//! node's connect needs. The guest takes each new host connection from its preface.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::qemu::{self, BootTimes, Extras};
use super::qmp::{Qmp, QmpError};
use super::{
    LaunchPlan, Launched, MicrovmRuntime, RuntimeError, Tracked, clone_disk, kill_started,
    prepare_dirs, remove_if_exists, setup, setup_msg, start_qemu, validate,
};
use crate::ids::hex;

/// The device state file in a checkpoint directory.
pub const STATE_FILE: &str = "state";
/// The guest RAM file in a checkpoint directory.
pub const MEM_FILE: &str = "mem";
/// The SHA-256 of the state file, in hex: QEMU checks the stream's structure but not the
/// bytes inside device sections, so a flipped byte could otherwise restore a broken VM.
pub const STATE_SUM_FILE: &str = "state.sha256";
/// How long a checkpoint may take from `stop` to the state file written.
pub const SAVE_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest state file a restore accepts when RAM is not in it (device state is tens of
/// KiB); a stream with the RAM may hold the guest's RAM size on top.
pub const MAX_STATE_BYTES: u64 = 64 << 20;
/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame (length 0, type 4, no flags, stream 0).
const H2_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

/// How the memory file reached the checkpoint (or the restored VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryCopy {
    /// FICLONE: O(1) in the file's size (btrfs, XFS), after writing back its dirty pages.
    Reflink,
    /// A byte copy (the source is on tmpfs or another filesystem).
    Copy,
    /// No memory file: the RAM is in the state stream (a VM whose RAM is mapped privately
    /// cannot leave it out; see [`RestoreMode::Private`]).
    InStream,
}

/// What a checkpoint wrote and what it cost.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    pub state_bytes: u64,
    pub mem_bytes: u64,
    pub mem_copy: MemoryCopy,
    /// `stop` until every vCPU is paused.
    pub pause: Duration,
    /// The migration (device state) until QEMU reported it completed.
    pub save: Duration,
    /// The memory file's copy.
    pub mem: Duration,
    /// From the first QMP command to the end (resumed or left paused).
    pub total: Duration,
    /// Whether the VM runs again (else it is left paused).
    pub resumed: bool,
}

/// What a restore cost, from the spawn of the new QEMU.
#[derive(Debug, Clone, Copy)]
pub struct RestoreTimes {
    pub mem_copy: MemoryCopy,
    /// Copying the checkpoint's memory into the new VM's memory file.
    pub mem: Duration,
    /// Spawn until QMP answered.
    pub qmp_ready: Duration,
    /// Spawn until the device state was loaded.
    pub loaded: Duration,
    /// Spawn until the guest answered on its channel ([`RestoreMode::Shared`]; with
    /// [`RestoreMode::Private`], until the VM ran again).
    pub serving: Duration,
}

/// Creates an empty memory file of `memory_mib` for a fresh VM (a new inode: a QEMU that
/// still maps the old one keeps it).
pub(super) fn fresh_memory_file(path: &Path, memory_mib: u64) -> Result<(), RuntimeError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(setup("create the memory file directory"))?;
    }
    remove_if_exists(path).map_err(setup("remove a stale memory file"))?;
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(setup("create the memory file"))?;
    f.set_len(memory_mib << 20)
        .map_err(setup("size the memory file"))?;
    Ok(())
}

/// Copies `src` to a new file `dst`: a reflink when the filesystem can, else its data
/// ranges only (pages a guest never touched are holes in the memory file and stay holes).
pub(super) fn copy_memory(src: &Path, dst: &Path) -> io::Result<MemoryCopy> {
    match clone_disk(src, dst) {
        Ok(()) => return Ok(MemoryCopy::Reflink),
        // `dst` is someone else's: never overwritten, never removed.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(e),
        // clone_disk removed the file it created.
        Err(_) => {}
    }
    let from = fs::File::open(src)?;
    let len = from.metadata()?.len();
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    to.set_len(len)?;
    copy_data_ranges(&from, &to, len).inspect_err(|_| {
        let _ = fs::remove_file(dst);
    })?;
    Ok(MemoryCopy::Copy)
}

/// Copies every data range of `from` (SEEK_DATA/SEEK_HOLE) to the same offsets in `to`
/// (pread/pwrite: copy_file_range refuses to cross filesystems, tmpfs to btrfs included).
fn copy_data_ranges(from: &fs::File, to: &fs::File, len: u64) -> io::Result<()> {
    use rustix::fs::{SeekFrom, seek};
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let start = match seek(from, SeekFrom::Data(pos)) {
            Ok(s) => s,
            // ENXIO: only a hole is left.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = seek(from, SeekFrom::Hole(start))?.min(len);
        let mut off = start;
        while off < end {
            let n = ((end - off) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], off)?;
            to.write_all_at(&buf[..n], off)?;
            off += n as u64;
        }
        pos = end;
    }
    Ok(())
}

fn qmp_err(step: &'static str) -> impl Fn(QmpError) -> RuntimeError {
    move |e| setup_msg(step, io::ErrorKind::Other, e.to_string())
}

/// Sets `x-ignore-shared` on or off (on: RAM in a shared file stays out of the stream; both
/// ends need it). Set either way: a restored QEMU keeps what its incoming migration used.
fn set_ignore_shared(q: &mut Qmp, on: bool, deadline: Instant) -> Result<(), QmpError> {
    q.execute(
        "migrate-set-capabilities",
        Some(json!({"capabilities": [{"capability": "x-ignore-shared", "state": on}]})),
        deadline,
    )
    .map(|_| ())
}

/// The file the guest's RAM lives in and whether it is mapped shared (QOM properties of the
/// memory backend); None: anonymous RAM.
fn ram_backing(q: &mut Qmp, deadline: Instant) -> Result<Option<(PathBuf, bool)>, QmpError> {
    let path = format!("/objects/{}", qemu::MEMORY_BACKEND_ID);
    let file = match q.execute(
        "qom-get",
        Some(json!({"path": path, "property": "mem-path"})),
        deadline,
    ) {
        Ok(Value::String(f)) => PathBuf::from(f),
        Ok(_) | Err(QmpError::Command { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let share = q.execute(
        "qom-get",
        Some(json!({"path": path, "property": "share"})),
        deadline,
    )?;
    Ok(Some((file, share == Value::Bool(true))))
}

/// Bytes per second a migration with the RAM in its stream may use (QEMU's cap, set high:
/// the stream goes to a local file).
const MAX_STREAM_BANDWIDTH: u64 = 64 << 30;

/// Polls `query-migrate` until the migration completes. Err: its failure, or the deadline.
fn wait_migrated(
    q: &mut Qmp,
    deadline: Instant,
    mut alive: impl FnMut() -> bool,
) -> Result<(), String> {
    let mut pause = Duration::from_millis(1);
    loop {
        if !alive() {
            return Err("QEMU exited".to_owned());
        }
        let r: Value = q
            .execute("query-migrate", None, deadline)
            .map_err(|e| e.to_string())?;
        match r.get("status").and_then(Value::as_str) {
            Some("completed") => return Ok(()),
            Some(s @ ("failed" | "cancelled")) => {
                let why = r
                    .get("error-desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given");
                return Err(format!("the migration {s}: {why}"));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("the migration did not complete in time ({r})"));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Accepts one connection on `listener` before `deadline` and copies it into `out`.
/// Gives up waiting for QEMU's connection as soon as `give_up` is set.
fn receive_stream(
    listener: UnixListener,
    out: &Path,
    deadline: Instant,
    give_up: &AtomicBool,
) -> io::Result<u64> {
    listener.set_nonblocking(true)?;
    let mut conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    && Instant::now() < deadline
                    && !give_up.load(Ordering::Relaxed) =>
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "QEMU did not connect to the migration socket in time",
                ));
            }
            Err(e) => return Err(e),
        }
    };
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)?;
    let mut hashing = HashingWriter {
        inner: &mut f,
        sum: Sha256::new(),
    };
    let n = io::copy(&mut conn, &mut hashing)?;
    let sum = hex(&hashing.sum.finalize());
    f.sync_all()?;
    let sum_path = out.with_file_name(STATE_SUM_FILE);
    fs::write(&sum_path, format!("{sum}\n"))?;
    Ok(n)
}

struct HashingWriter<'a> {
    inner: &'a mut fs::File,
    sum: Sha256,
}

impl Write for HashingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sum.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

pub(super) fn checkpoint_blocking(
    rt: &MicrovmRuntime,
    id: &str,
    dir: &Path,
    resume: bool,
) -> Result<CheckpointInfo, RuntimeError> {
    let step = "checkpoint the VM";
    let bad = |kind: io::ErrorKind, what: String| setup_msg(step, kind, what);
    let Some(mem_file) = rt.memory_file(id) else {
        return Err(bad(
            io::ErrorKind::Unsupported,
            "checkpoints need file-backed guest RAM (MicrovmConfig::memory_dir)".to_owned(),
        ));
    };
    let Some(qmp_path) = rt.inner.qmp_path(id) else {
        return Err(bad(io::ErrorKind::NotFound, format!("no VM {id:?}")));
    };
    let run_dir = qmp_path.parent().map(Path::to_path_buf).unwrap_or_default();
    fs::create_dir_all(dir).map_err(setup("create the checkpoint dir"))?;
    let (state, mem) = (dir.join(STATE_FILE), dir.join(MEM_FILE));
    for p in [&state, &mem, &dir.join(STATE_SUM_FILE)] {
        if p.exists() {
            return Err(bad(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists: a checkpoint needs an empty directory",
                    p.display()
                ),
            ));
        }
    }
    let t0 = Instant::now();
    let deadline = t0 + SAVE_TIMEOUT;
    let mut q = Qmp::connect(&qmp_path, super::QMP_TIMEOUT).map_err(qmp_err(step))?;
    let was = q.status(deadline).map_err(qmp_err(step))?;
    // A VM whose RAM is a shared file (booted in `memory_dir`, or restored `SharedFile`):
    // the stream leaves RAM out and the file is copied (reflinked where it can be). Else
    // (restored `Private`): the RAM goes into the stream. QEMU says which.
    let backing = ram_backing(&mut q, deadline).map_err(qmp_err(step))?;
    let (shared, mem_file) = match backing {
        Some((path, true)) => (true, path),
        _ => (false, mem_file),
    };
    if was == super::POSTMIGRATE {
        return Err(bad(
            io::ErrorKind::Other,
            format!("VM {id} was left stopped by a checkpoint: resume it before the next"),
        ));
    }
    if was != "running" && was != "paused" {
        return Err(bad(
            io::ErrorKind::Other,
            format!("VM {id} is {was:?}, neither running nor paused"),
        ));
    }
    let result = (|| {
        q.execute("stop", None, deadline).map_err(qmp_err(step))?;
        let pause = t0.elapsed();
        set_ignore_shared(&mut q, shared, deadline).map_err(qmp_err(step))?;
        if !shared {
            // QEMU's default cap (32 MiB/s in 7.2) would make a RAM stream take seconds.
            q.execute(
                "migrate-set-parameters",
                Some(json!({"max-bandwidth": MAX_STREAM_BANDWIDTH})),
                deadline,
            )
            .map_err(qmp_err(step))?;
        }
        let sock = run_dir.join("migrate-out.sock");
        remove_if_exists(&sock).map_err(setup("remove a stale migration socket"))?;
        let listener = UnixListener::bind(&sock).map_err(setup("listen for the migration"))?;
        // The jailed QEMU runs as the run dir's owner.
        let owner = fs::metadata(&run_dir).map_err(setup("stat the run dir"))?;
        std::os::unix::fs::chown(&sock, Some(owner.uid()), Some(owner.gid()))
            .map_err(setup("give the migration socket to QEMU's uid"))?;
        let t_save = Instant::now();
        let out = state.clone();
        let give_up = Arc::new(AtomicBool::new(false));
        let stop_waiting = give_up.clone();
        let receiver =
            std::thread::spawn(move || receive_stream(listener, &out, deadline, &stop_waiting));
        let started = q.execute(
            "migrate",
            Some(json!({"uri": format!("unix:{}", sock.display())})),
            deadline,
        );
        let migrated = started
            .map_err(|e| e.to_string())
            .and_then(|_| wait_migrated(&mut q, deadline, || true));
        if migrated.is_err() {
            let _ = q.execute("migrate_cancel", None, deadline);
            // Unblock the receiver if QEMU never connected.
            give_up.store(true, Ordering::Relaxed);
        }
        let received = receiver
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the migration receiver panicked")));
        let _ = fs::remove_file(&sock);
        migrated.map_err(|why| {
            bad(
                io::ErrorKind::Other,
                format!("saving the device state failed: {why}"),
            )
        })?;
        let state_bytes = received.map_err(setup("receive the device state"))?;
        let save = t_save.elapsed();
        let t_mem = Instant::now();
        let (mem_copy, mem_bytes) = if shared {
            let how = copy_memory(&mem_file, &mem).map_err(setup("copy the memory file"))?;
            let len = fs::metadata(&mem)
                .map_err(setup("stat the memory copy"))?
                .len();
            (how, len)
        } else {
            (MemoryCopy::InStream, 0)
        };
        let mem_d = t_mem.elapsed();
        Ok(CheckpointInfo {
            state_bytes,
            mem_bytes,
            mem_copy,
            pause,
            save,
            mem: mem_d,
            total: Duration::ZERO,
            resumed: false,
        })
    })();
    // Whatever happened, the VM runs again if it ran before and the caller wants it to.
    let resumed = resume && was == "running";
    if resumed {
        q.execute("cont", None, Instant::now() + super::QMP_TIMEOUT)
            .map_err(qmp_err("resume the VM after its checkpoint"))?;
    }
    match result {
        Ok(info) => Ok(CheckpointInfo {
            total: t0.elapsed(),
            resumed,
            ..info
        }),
        Err(e) => {
            let _ = fs::remove_file(&state);
            let _ = fs::remove_file(dir.join(STATE_SUM_FILE));
            let _ = fs::remove_file(&mem);
            Err(e)
        }
    }
}

/// Sends the client preface and waits for the guest's SETTINGS frame, at most `timeout`.
fn h2_answers(channel: &Path, timeout: Duration) -> io::Result<()> {
    let mut s = UnixStream::connect(channel)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(H2_PREFACE)?;
    s.write_all(&H2_SETTINGS)?;
    let deadline = Instant::now() + timeout;
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head)?;
        if head[3] == 4 {
            return Ok(());
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as u64;
        io::copy(&mut (&mut s).take(len), &mut io::sink())?;
        if Instant::now() >= deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
    }
}

/// Retries [`h2_answers`] (2 s a try) until `deadline`.
fn wait_serving(channel: &Path, deadline: Instant, pidfd: &OwnedFd) -> Result<(), String> {
    loop {
        if qemu::exited(pidfd.as_fd()).is_some() {
            return Err("QEMU exited after the restore".to_owned());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let err = match h2_answers(
            channel,
            left.min(Duration::from_secs(2))
                .max(Duration::from_millis(10)),
        ) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "the guest did not answer an HTTP/2 preface on its channel in time ({err})"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens the state file after checking its size and its SHA-256 against `state.sha256`.
fn open_state(dir: &Path, max: u64) -> Result<(fs::File, u64), RuntimeError> {
    let bad = |kind: io::ErrorKind, what: String| setup_msg("read the checkpoint", kind, what);
    let path = dir.join(STATE_FILE);
    let f = fs::File::open(&path)
        .map_err(|e| bad(e.kind(), format!("cannot open {}: {e}", path.display())))?;
    let len = f.metadata().map_err(setup("stat the state file"))?.len();
    if len == 0 || len > max {
        return Err(bad(
            io::ErrorKind::InvalidData,
            format!(
                "{} holds {len} bytes; this state file may hold 1 to {max}",
                path.display()
            ),
        ));
    }
    let sum_path = dir.join(STATE_SUM_FILE);
    let want = fs::read_to_string(&sum_path)
        .map_err(|e| bad(e.kind(), format!("cannot read {}: {e}", sum_path.display())))?;
    let mut sum = Sha256::new();
    io::copy(&mut (&f), &mut sum).map_err(setup("read the state file"))?;
    let got = hex(&sum.finalize());
    if got != want.trim() {
        return Err(bad(
            io::ErrorKind::InvalidData,
            format!(
                "{} is corrupted: its SHA-256 is {got}, {} says {}",
                path.display(),
                sum_path.display(),
                want.trim()
            ),
        ));
    }
    let mut f = f;
    io::Seek::seek(&mut f, io::SeekFrom::Start(0)).map_err(setup("rewind the state file"))?;
    Ok((f, len))
}

/// Checks the checkpoint in `dir` for a VM of `memory_mib` as a restore would, before
/// starting anything: the state file's size and SHA-256, and the memory file's size (when
/// the RAM is not in the stream).
pub fn verify(dir: &Path, memory_mib: u64) -> Result<(), RuntimeError> {
    open_checkpoint(dir, memory_mib).map(drop)
}

/// [`verify`], returning the state file (checked, at its start) and whether the RAM is in it
/// (no `mem`).
fn open_checkpoint(dir: &Path, memory_mib: u64) -> Result<(fs::File, bool), RuntimeError> {
    let mem = dir.join(MEM_FILE);
    let want = memory_mib << 20;
    let in_stream = !mem.exists();
    let max = if in_stream {
        MAX_STATE_BYTES + want
    } else {
        MAX_STATE_BYTES
    };
    let (state, _) = open_state(dir, max)?;
    if !in_stream {
        let len = fs::metadata(&mem)
            .map_err(|e| {
                setup_msg(
                    "read the checkpoint",
                    e.kind(),
                    format!("cannot stat {}: {e}", mem.display()),
                )
            })?
            .len();
        if len != want {
            return Err(setup_msg(
                "read the checkpoint",
                io::ErrorKind::InvalidInput,
                format!(
                    "{} holds {len} bytes but the plan gives the guest {memory_mib} MiB: a \
                     restore needs the checkpointed VM's memory size",
                    mem.display()
                ),
            ));
        }
    }
    Ok((state, in_stream))
}

/// Where a restored VM's RAM lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMode {
    /// In its memory file in `memory_dir` (`share=on`), a copy of the checkpoint's: the VM
    /// can be checkpointed again.
    Shared,
    /// Mapped privately (`share=off`) from a reflink of the checkpoint's memory next to the
    /// VM's disk ([`PRIVATE_MEM_FILE`]): O(1) on btrfs, pages read on first touch, writes the
    /// VM's own anonymous memory. Such a VM cannot be checkpointed with `x-ignore-shared`.
    /// The restore returns once the VM runs again (`cont`), without waiting for the guest's
    /// answer on its channel: the caller's first connection is that check (the node's
    /// connect has its own deadline), which saves a second HTTP/2 session per restore.
    Private,
    /// Like [`RestoreMode::Private`] (a reflink next to the disk, returns at `cont`), but
    /// mapped `share=on`: the guest's writes go to the file, so the VM can be checkpointed
    /// with `x-ignore-shared` and its file reflinked (O(1) on btrfs after writing back its
    /// dirty pages), at the price of that writeback while it runs.
    SharedFile,
}

/// A privately mapped VM's memory file, in the directory of its disk.
pub const PRIVATE_MEM_FILE: &str = "vm.mem";

pub(super) fn restore_blocking(
    rt: &MicrovmRuntime,
    plan: &LaunchPlan,
    dir: &Path,
    mode: RestoreMode,
) -> Result<(Launched, Tracked, RestoreTimes), RuntimeError> {
    let step = "restore the VM";
    let bad = |kind: io::ErrorKind, what: String| setup_msg(step, kind, what);
    let disk = validate(plan)?;
    let spec = rt.spec(plan, disk);
    let mem_file = match mode {
        RestoreMode::Shared => rt.memory_file(&plan.id),
        RestoreMode::Private | RestoreMode::SharedFile => {
            disk.parent().map(|d| d.join(PRIVATE_MEM_FILE))
        }
    };
    let Some(mem_file) = mem_file else {
        return Err(bad(
            io::ErrorKind::Unsupported,
            "restores need file-backed guest RAM (MicrovmConfig::memory_dir)".to_owned(),
        ));
    };
    let mem_src = dir.join(MEM_FILE);
    // No memory file: the RAM is in the stream; the VM gets a fresh memory file of its own
    // in `memory_dir` (shared, so it can be checkpointed without RAM in the stream again).
    let (mut state, in_stream) = open_checkpoint(dir, spec.memory_mib)?;
    let (private, mem_file) = if in_stream {
        match rt.memory_file(&plan.id) {
            Some(m) => (false, m),
            None => {
                return Err(bad(
                    io::ErrorKind::Unsupported,
                    "restores need file-backed guest RAM (MicrovmConfig::memory_dir)".to_owned(),
                ));
            }
        }
    } else {
        (mode == RestoreMode::Private, mem_file)
    };
    prepare_dirs(plan, &spec)?;
    if let Some(d) = mem_file.parent() {
        fs::create_dir_all(d).map_err(setup("create the memory file directory"))?;
    }
    remove_if_exists(&mem_file).map_err(setup("remove a stale memory file"))?;
    let t_mem = Instant::now();
    let mem_copy = if in_stream {
        fresh_memory_file(&mem_file, spec.memory_mib)?;
        MemoryCopy::InStream
    } else {
        copy_memory(&mem_src, &mem_file).map_err(setup("copy the checkpoint's memory"))?
    };
    let mem_d = t_mem.elapsed();
    let extras = Extras {
        memory_file: Some(&mem_file),
        incoming: true,
        private_memory: private,
        tap_fd: None,
    };
    let log = plan.run_dir.join("qemu.log");
    let (pidfd, pid, spawn_took) = match start_qemu(rt, plan, &spec, extras, &log) {
        Ok(s) => s,
        Err(e) => {
            let _ = fs::remove_file(&mem_file);
            return Err(e);
        }
    };
    let t0 = Instant::now();
    let fail = |pidfd: &OwnedFd, why: String| {
        kill_started(rt, plan, &spec, pidfd);
        let _ = fs::remove_file(&mem_file);
        let _ = fs::remove_file(plan.run_dir.join("migrate-in.sock"));
        RuntimeError::NotReady(format!("{why}; QEMU said: {:?}", qemu::tail_of(&log, 1024)))
    };
    let deadline = t0 + rt.inner.cfg.boot_timeout;
    // QMP first (QEMU answers it while it waits for the incoming stream).
    let mut pause = Duration::from_millis(1);
    let mut q = loop {
        if qemu::exited(pidfd.as_fd()).is_some() {
            return Err(fail(&pidfd, "QEMU exited before answering QMP".to_owned()));
        }
        match Qmp::connect(
            &spec.qmp,
            deadline.saturating_duration_since(Instant::now()),
        ) {
            Ok(q) => break q,
            Err(QmpError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(fail(&pidfd, format!("QMP did not answer ({e})"))),
        }
    };
    let qmp_ready = t0.elapsed();
    let sock = plan.run_dir.join("migrate-in.sock");
    let _ = remove_if_exists(&sock);
    let started = set_ignore_shared(&mut q, !in_stream, deadline).and_then(|()| {
        q.execute(
            "migrate-incoming",
            Some(json!({"uri": format!("unix:{}", sock.display())})),
            deadline,
        )
    });
    if let Err(e) = started {
        return Err(fail(
            &pidfd,
            format!("cannot start the incoming migration: {e}"),
        ));
    }
    let fed = UnixStream::connect(&sock).and_then(|mut s| {
        s.set_write_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))?;
        io::copy(&mut state, &mut s)?;
        s.shutdown(std::net::Shutdown::Write)
    });
    let _ = fs::remove_file(&sock);
    // A QEMU that rejects the stream exits (7.2 has no exit-on-error=false); a broken pipe
    // while feeding it says the same.
    let loaded = wait_migrated(&mut q, deadline, || qemu::exited(pidfd.as_fd()).is_none());
    if let Err(why) = loaded {
        let fed = fed
            .err()
            .map(|e| format!(" (feeding it: {e})"))
            .unwrap_or_default();
        return Err(fail(
            &pidfd,
            format!("QEMU refused the checkpoint's device state: {why}{fed}"),
        ));
    }
    let loaded = t0.elapsed();
    if let Err(e) = q.execute("cont", None, deadline) {
        return Err(fail(&pidfd, format!("cannot resume the restored VM: {e}")));
    }
    if mode == RestoreMode::Shared
        && let Err(why) = wait_serving(&spec.channel_socket, deadline, &pidfd)
    {
        return Err(fail(&pidfd, why));
    }
    let serving = t0.elapsed();
    let start_time = match qemu::read_stat(pid) {
        Ok(st) => st.start_time,
        Err(e) => {
            kill_started(rt, plan, &spec, &pidfd);
            let _ = fs::remove_file(&mem_file);
            return Err(setup("read QEMU's start time")(e));
        }
    };
    tracing::info!(
        id = %plan.id,
        pid,
        checkpoint = %dir.display(),
        mem_copy = ?mem_copy,
        mem_ms = mem_d.as_secs_f64() * 1e3,
        spawn_ms = spawn_took.as_secs_f64() * 1e3,
        loaded_ms = loaded.as_secs_f64() * 1e3,
        serving_ms = serving.as_secs_f64() * 1e3,
        "microvm restored"
    );
    let boot = BootTimes {
        spawn: spawn_took,
        qmp_ready,
        guest_ready: serving,
        ready_by: "restore",
    };
    let (launched, tracked) = Tracked::started(pid, start_time, pidfd, &spec, boot);
    Ok((
        launched,
        tracked,
        RestoreTimes {
            mem_copy,
            mem: mem_d,
            qmp_ready,
            loaded,
            serving,
        },
    ))
}

impl MicrovmRuntime {
    /// Checkpoints VM `id` into the empty (or new) directory `dir`: pauses it, saves its
    /// device state without RAM (`x-ignore-shared`) to `<dir>/state` and copies its memory
    /// file to `<dir>/mem` (a reflink when the memory file's filesystem can, see
    /// [`CheckpointInfo::mem_copy`]). With `resume` a VM that was running runs again after;
    /// else it stays paused. Needs [`super::MicrovmConfig::memory_dir`]. On error nothing is
    /// left in `dir` and the VM is resumed as asked.
    pub async fn checkpoint(
        &self,
        id: &str,
        dir: &Path,
        resume: bool,
    ) -> Result<CheckpointInfo, RuntimeError> {
        let (rt, id, dir) = (self.clone(), id.to_owned(), dir.to_path_buf());
        tokio::task::spawn_blocking(move || checkpoint_blocking(&rt, &id, &dir, resume))
            .await
            .map_err(super::join_error("join the checkpoint task"))?
    }

    /// Starts a new VM for `plan` from the checkpoint in `dir`: same devices, its memory file
    /// a copy (reflink) of `<dir>/mem`, its device state from `<dir>/state`. Returns once the
    /// guest answers on its channel (see the module documentation). A state file QEMU rejects
    /// gives `RuntimeError::NotReady` and leaves nothing running. Restoring one checkpoint
    /// under two ids forks the VM. `plan` must give the checkpointed VM's memory size.
    pub async fn restore(&self, plan: &LaunchPlan, dir: &Path) -> Result<Launched, RuntimeError> {
        self.restore_timed(plan, dir, RestoreMode::Shared)
            .await
            .map(|(l, _)| l)
    }

    /// [`MicrovmRuntime::restore`] in `mode`, with what it cost.
    pub async fn restore_timed(
        &self,
        plan: &LaunchPlan,
        dir: &Path,
        mode: RestoreMode,
    ) -> Result<(Launched, RestoreTimes), RuntimeError> {
        self.inner.ensure_reaper();
        let (rt, owned, d) = (self.clone(), plan.clone(), dir.to_path_buf());
        let (launched, tracked, times) =
            tokio::task::spawn_blocking(move || restore_blocking(&rt, &owned, &d, mode))
                .await
                .map_err(super::join_error("join the restore task"))??;
        self.inner.track(&plan.id, tracked);
        Ok((launched, times))
    }

    /// The memory file VM `id` runs on, with file-backed RAM.
    pub fn memory_file_of(&self, id: &str) -> Option<PathBuf> {
        self.memory_file(id)
    }
}
