//! Sandbox cgroups: cpu, memory (no swap), pids and a freezer, on pure cgroup v2 or on the
//! hybrid v1 layout (v1 controllers under `<root>/<controller>`). The kernel interface sits
//! behind [`CgroupManager`]; [`RecordingCgroups`] is the fake for unit tests.
//!
//! Layout: v1 `<root>/{memory,cpu,pids,freezer}/<parent>/<id>` (plus `cpuacct` when the host
//! mounts it apart from `cpu`, for CPU usage), v2 `<root>/<parent>/<id>`.
//! A zero limit means "no limit".

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::api::Limits;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("failed to {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no usable cgroup hierarchy under {0} (need v2, or v1 memory/cpu/pids/freezer)")]
    NoHierarchy(PathBuf),
    #[error("cgroup {0} still has processes after the kill deadline")]
    Busy(PathBuf),
    #[error("invalid cgroup name {0:?}")]
    InvalidName(String),
}

impl CgroupError {
    /// The path the error is about (for `RuntimeError::Cgroup`).
    pub fn path(&self) -> PathBuf {
        match self {
            CgroupError::Io { path, .. } => path.clone(),
            CgroupError::NoHierarchy(p) | CgroupError::Busy(p) => p.clone(),
            CgroupError::InvalidName(n) => PathBuf::from(n),
        }
    }
}

/// What the runtime needs from cgroups. Every method is idempotent on `id`.
pub trait CgroupManager: Send + Sync + std::fmt::Debug {
    /// Create the sandbox's cgroups and apply `limits`.
    fn create(&self, id: &str, limits: &Limits) -> Result<(), CgroupError>;
    /// Move `pid` into the sandbox's cgroups.
    fn add_process(&self, id: &str, pid: u32) -> Result<(), CgroupError>;
    /// SIGKILL everything in the sandbox's cgroups and wait (up to `timeout`) until empty.
    fn kill_all(&self, id: &str, timeout: Duration) -> Result<(), CgroupError>;
    /// Remove the sandbox's cgroups (they must be empty). Missing ones are fine.
    fn remove(&self, id: &str) -> Result<(), CgroupError>;
    /// Freeze or thaw every process of the sandbox (returns once the state is reached).
    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError>;
    /// Whether the sandbox's cgroup is frozen now (read from the kernel the first time, so it
    /// survives a node restart). `None` when unknown (no such cgroup).
    fn is_frozen(&self, _id: &str) -> Option<bool> {
        None
    }
    /// Memory charged to the sandbox, in bytes.
    fn memory_bytes(&self, id: &str) -> Option<u64>;
    /// The page cache part of [`memory_bytes`](Self::memory_bytes), in bytes. `None` when
    /// unknown.
    fn memory_cache_bytes(&self, _id: &str) -> Option<u64> {
        None
    }
    /// CPU time used by the sandbox's processes so far, in microseconds (monotonic while the
    /// cgroup lives). `None` when unknown.
    fn cpu_usage_usec(&self, _id: &str) -> Option<u64> {
        None
    }
    /// On cgroup v2, the sandbox's cgroup directory opened for `CLONE_INTO_CGROUP`; the
    /// child then starts inside it and `add_process` is skipped. `None` elsewhere.
    fn clone_target(&self, _id: &str) -> Option<OwnedFd> {
        None
    }
}

/// Which cgroup layout the host uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// v1 controllers a sandbox is placed into.
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// Optional v1 controller for CPU usage; when co-mounted with `cpu` its files are in `cpu`.
const V1_CPUACCT: &str = "cpuacct";
/// v2 controllers enabled for sandboxes.
const V2_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];
const CFS_PERIOD_US: u64 = 100_000;

/// The real cgroup filesystem.
#[derive(Debug)]
pub struct LinuxCgroups {
    root: PathBuf,
    parent: String,
    version: CgroupVersion,
    /// v2: the controllers of [`V2_CONTROLLERS`] the host offers (limits of the others are
    /// skipped). v1: [`V1_CONTROLLERS`], plus `cpuacct` when it is mounted on its own.
    enabled: Vec<&'static str>,
    /// The freezer state of each sandbox as last written by [`CgroupManager::set_frozen`] or
    /// first read from the kernel. Only this process writes it, and the reconciler's pass
    /// asks every sandbox's: a map lookup instead of a file read each (decision 0066).
    frozen: Mutex<HashMap<String, bool>>,
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CgroupError {
    let path = path.to_owned();
    move |source| CgroupError::Io { op, path, source }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err("write", path))
}

fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err("create", path)(e)),
    }
}

fn valid_name(name: &str) -> Result<(), CgroupError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(CgroupError::InvalidName(name.to_owned()));
    }
    Ok(())
}

/// Values written for `limits`: (memory bytes or None, cpu quota µs or None, pids or None).
fn limit_values(limits: &Limits) -> (Option<u64>, Option<u64>, Option<u32>) {
    let mem = (limits.memory_mib > 0).then(|| limits.memory_mib.saturating_mul(1 << 20));
    let cpu = (limits.cpu_millis > 0).then(|| u64::from(limits.cpu_millis) * CFS_PERIOD_US / 1000);
    let pids = (limits.pids > 0).then_some(limits.pids);
    (mem, cpu, pids)
}

impl LinuxCgroups {
    /// Detect the layout under `root` (normally /sys/fs/cgroup) and create `<parent>`.
    pub fn detect(root: &Path, parent: &str) -> Result<LinuxCgroups, CgroupError> {
        valid_name(parent)?;
        let version = if root.join("cgroup.controllers").exists() {
            CgroupVersion::V2
        } else if V1_CONTROLLERS
            .iter()
            .all(|c| root.join(c).join("cgroup.procs").exists())
        {
            CgroupVersion::V1
        } else {
            return Err(CgroupError::NoHierarchy(root.to_owned()));
        };
        let mut me = LinuxCgroups {
            root: root.to_owned(),
            parent: parent.to_owned(),
            version,
            enabled: Vec::new(),
            frozen: Mutex::new(HashMap::new()),
        };
        me.init_parent()?;
        Ok(me)
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    fn init_parent(&mut self) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V1 => {
                self.enabled = V1_CONTROLLERS.to_vec();
                // A separate cpuacct hierarchy (not `cpu,cpuacct`, whose files show in `cpu`).
                if !self.root.join("cpu").join("cpuacct.usage").exists()
                    && self.root.join(V1_CPUACCT).join("cpuacct.usage").exists()
                {
                    self.enabled.push(V1_CPUACCT);
                }
                for c in &self.enabled {
                    mkdir(&self.root.join(c).join(&self.parent))?;
                }
            }
            CgroupVersion::V2 => {
                let parent = self.root.join(&self.parent);
                mkdir(&parent)?;
                let available = fs::read_to_string(self.root.join("cgroup.controllers"))
                    .map_err(io_err("read", &self.root.join("cgroup.controllers")))?;
                self.enabled = V2_CONTROLLERS
                    .into_iter()
                    .filter(|c| available.split_whitespace().any(|a| a == *c))
                    .collect();
                if self.enabled.is_empty() {
                    return Ok(());
                }
                let line = self
                    .enabled
                    .iter()
                    .map(|c| format!("+{c}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                for dir in [&self.root, &parent] {
                    let f = dir.join("cgroup.subtree_control");
                    let current = fs::read_to_string(&f).unwrap_or_default();
                    if self
                        .enabled
                        .iter()
                        .all(|c| current.split_whitespace().any(|a| a == *c))
                    {
                        continue;
                    }
                    write(&f, &line)?;
                }
            }
        }
        Ok(())
    }

    /// Every directory of the sandbox (one per v1 controller, or the one v2 directory).
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        match self.version {
            CgroupVersion::V1 => self
                .enabled
                .iter()
                .map(|c| self.root.join(c).join(&self.parent).join(id))
                .collect(),
            CgroupVersion::V2 => vec![self.root.join(&self.parent).join(id)],
        }
    }

    fn v1(&self, controller: &str, id: &str) -> PathBuf {
        self.root.join(controller).join(&self.parent).join(id)
    }

    fn v2(&self, id: &str) -> PathBuf {
        self.root.join(&self.parent).join(id)
    }

    /// The directory whose `cgroup.procs` lists all the sandbox's processes.
    fn procs_dir(&self, id: &str) -> PathBuf {
        match self.version {
            CgroupVersion::V1 => self.v1("freezer", id),
            CgroupVersion::V2 => self.v2(id),
        }
    }

    fn procs(&self, id: &str) -> Result<Vec<i32>, CgroupError> {
        let path = self.procs_dir(id).join("cgroup.procs");
        match fs::read_to_string(&path) {
            Ok(s) => Ok(s.lines().filter_map(|l| l.trim().parse().ok()).collect()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(io_err("read", &path)(e)),
        }
    }

    /// Drops the remembered freezer state of `id`: the next [`CgroupManager::is_frozen`]
    /// reads the kernel.
    fn forget_frozen(&self, id: &str) {
        self.frozen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    fn read_frozen(&self, id: &str) -> Option<bool> {
        match self.version {
            CgroupVersion::V1 => {
                let s = fs::read_to_string(self.v1("freezer", id).join("freezer.state")).ok()?;
                // FREEZING counts as frozen: a pause was asked for and not undone.
                Some(s.trim() != "THAWED")
            }
            CgroupVersion::V2 => {
                let s = fs::read_to_string(self.v2(id).join("cgroup.freeze")).ok()?;
                Some(s.trim() == "1")
            }
        }
    }

    /// Writes the freezer state and waits (5 s at most) until the kernel has reached it.
    fn write_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        match self.version {
            CgroupVersion::V1 => {
                let state = self.v1("freezer", id).join("freezer.state");
                let want = if frozen { "FROZEN" } else { "THAWED" };
                write(&state, want)?;
                self.wait_state(&state, want, deadline)
            }
            CgroupVersion::V2 => {
                let d = self.v2(id);
                write(&d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
                self.wait_state(
                    &d.join("cgroup.events"),
                    if frozen { "frozen 1" } else { "frozen 0" },
                    deadline,
                )
            }
        }
    }

    /// [`CgroupManager::kill_all`]'s work.
    fn kill_everything(&self, id: &str, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        let dir = self.procs_dir(id);
        if !dir.exists() {
            return Ok(());
        }
        let mut pause = Duration::from_micros(200);
        loop {
            let procs = self.procs(id)?;
            if procs.is_empty() {
                return Ok(());
            }
            match self.version {
                CgroupVersion::V2 => {
                    let kill = dir.join("cgroup.kill");
                    if kill.exists() {
                        write(&kill, "1")?;
                    } else {
                        for pid in &procs {
                            let _ = rustix::process::kill_process(
                                rustix::process::Pid::from_raw(*pid)
                                    .ok_or_else(|| CgroupError::Busy(dir.clone()))?,
                                rustix::process::Signal::KILL,
                            );
                        }
                    }
                }
                CgroupVersion::V1 => {
                    // Freeze so nothing forks while we kill, kill, thaw so the kills land.
                    let state = dir.join("freezer.state");
                    let _ = write(&state, "FROZEN");
                    for pid in self.procs(id)? {
                        if let Some(p) = rustix::process::Pid::from_raw(pid) {
                            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                        }
                    }
                    let _ = write(&state, "THAWED");
                }
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Busy(dir));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn wait_state(&self, path: &Path, want: &str, deadline: Instant) -> Result<(), CgroupError> {
        let mut pause = Duration::from_micros(200);
        loop {
            let s = fs::read_to_string(path).map_err(io_err("read", path))?;
            if s.contains(want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Busy(path.to_owned()));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl CgroupManager for LinuxCgroups {
    fn create(&self, id: &str, limits: &Limits) -> Result<(), CgroupError> {
        valid_name(id)?;
        self.forget_frozen(id);
        let (mem, cpu, pids) = limit_values(limits);
        match self.version {
            CgroupVersion::V1 => {
                for c in &self.enabled {
                    mkdir(&self.v1(c, id))?;
                }
                let m = self.v1("memory", id);
                let mem_s = mem.map_or_else(|| "-1".to_owned(), |b| b.to_string());
                // memsw >= limit must hold at every moment: when lowering, limit goes first;
                // when raising from a smaller value, memsw goes first. Writing limit, memsw,
                // limit covers both.
                let memsw = m.join("memory.memsw.limit_in_bytes");
                write(&m.join("memory.limit_in_bytes"), &mem_s)
                    .or_else(|_| write(&memsw, &mem_s))?;
                if memsw.exists() {
                    write(&memsw, &mem_s)?;
                    write(&m.join("memory.limit_in_bytes"), &mem_s)?;
                }
                let cpu_dir = self.v1("cpu", id);
                write(
                    &cpu_dir.join("cpu.cfs_period_us"),
                    &CFS_PERIOD_US.to_string(),
                )?;
                write(
                    &cpu_dir.join("cpu.cfs_quota_us"),
                    &cpu.map_or_else(|| "-1".to_owned(), |q| q.to_string()),
                )?;
                write(
                    &self.v1("pids", id).join("pids.max"),
                    &pids.map_or_else(|| "max".to_owned(), |p| p.to_string()),
                )?;
            }
            CgroupVersion::V2 => {
                let d = self.v2(id);
                mkdir(&d)?;
                if self.enabled.contains(&"memory") {
                    write(
                        &d.join("memory.max"),
                        &mem.map_or_else(|| "max".to_owned(), |b| b.to_string()),
                    )?;
                    let swap = d.join("memory.swap.max");
                    if swap.exists() {
                        write(&swap, "0")?;
                    }
                }
                if self.enabled.contains(&"cpu") {
                    write(
                        &d.join("cpu.max"),
                        &format!(
                            "{} {CFS_PERIOD_US}",
                            cpu.map_or_else(|| "max".to_owned(), |q| q.to_string())
                        ),
                    )?;
                }
                if self.enabled.contains(&"pids") {
                    write(
                        &d.join("pids.max"),
                        &pids.map_or_else(|| "max".to_owned(), |p| p.to_string()),
                    )?;
                }
            }
        }
        Ok(())
    }

    fn add_process(&self, id: &str, pid: u32) -> Result<(), CgroupError> {
        valid_name(id)?;
        for d in self.dirs(id) {
            write(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    fn kill_all(&self, id: &str, timeout: Duration) -> Result<(), CgroupError> {
        valid_name(id)?;
        // It freezes and thaws (v1) behind set_frozen's back: a state read meanwhile is
        // not kept.
        self.forget_frozen(id);
        let killed = self.kill_everything(id, timeout);
        self.forget_frozen(id);
        killed
    }

    fn remove(&self, id: &str) -> Result<(), CgroupError> {
        valid_name(id)?;
        self.forget_frozen(id);
        let deadline = Instant::now() + Duration::from_secs(2);
        for d in self.dirs(id) {
            let mut pause = Duration::from_micros(200);
            loop {
                match fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    // Exiting tasks can pin a cgroup for a moment after they are gone.
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io_err("remove", &d)(e)),
                }
            }
        }
        Ok(())
    }

    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError> {
        valid_name(id)?;
        // Forgotten while it changes, so a reader meanwhile asks the kernel; remembered once
        // reached. A reader that read the old state stores it under the map's lock, before
        // this store can take it: the last store is this one.
        self.forget_frozen(id);
        let reached = self.write_frozen(id, frozen);
        if reached.is_ok() {
            self.frozen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.to_owned(), frozen);
        }
        reached
    }

    fn is_frozen(&self, id: &str) -> Option<bool> {
        valid_name(id).ok()?;
        let mut known = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&f) = known.get(id) {
            return Some(f);
        }
        // Read and stored under the lock (see set_frozen).
        let f = self.read_frozen(id)?;
        known.insert(id.to_owned(), f);
        Some(f)
    }

    fn memory_bytes(&self, id: &str) -> Option<u64> {
        valid_name(id).ok()?;
        let path = match self.version {
            CgroupVersion::V1 => self.v1("memory", id).join("memory.usage_in_bytes"),
            CgroupVersion::V2 => self.v2(id).join("memory.current"),
        };
        fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    fn memory_cache_bytes(&self, id: &str) -> Option<u64> {
        valid_name(id).ok()?;
        let (path, key) = match self.version {
            // `total_cache` counts the cgroup's descendants too, as usage_in_bytes does.
            CgroupVersion::V1 => (self.v1("memory", id).join("memory.stat"), "total_cache"),
            CgroupVersion::V2 => (self.v2(id).join("memory.stat"), "file"),
        };
        stat_field(&fs::read_to_string(path).ok()?, key)
    }

    fn cpu_usage_usec(&self, id: &str) -> Option<u64> {
        valid_name(id).ok()?;
        match self.version {
            CgroupVersion::V1 => {
                let dir = if self.enabled.contains(&V1_CPUACCT) {
                    self.v1(V1_CPUACCT, id)
                } else {
                    self.v1("cpu", id)
                };
                parse_cpuacct_usage(&fs::read_to_string(dir.join("cpuacct.usage")).ok()?)
            }
            CgroupVersion::V2 => {
                parse_cpu_stat_usage(&fs::read_to_string(self.v2(id).join("cpu.stat")).ok()?)
            }
        }
    }

    fn clone_target(&self, id: &str) -> Option<OwnedFd> {
        if self.version != CgroupVersion::V2 || valid_name(id).is_err() {
            return None;
        }
        fs::File::open(self.v2(id)).ok().map(OwnedFd::from)
    }
}

/// The value of line `key` of a flat-keyed cgroup file (`memory.stat`, `cpu.stat`).
fn stat_field(s: &str, key: &str) -> Option<u64> {
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// v1 `cpuacct.usage` (nanoseconds) as microseconds.
fn parse_cpuacct_usage(s: &str) -> Option<u64> {
    s.trim().parse::<u64>().ok().map(|ns| ns / 1000)
}

/// The `usage_usec` line of a v2 `cpu.stat`.
fn parse_cpu_stat_usage(s: &str) -> Option<u64> {
    stat_field(s, "usage_usec")
}

/// One call seen by [`RecordingCgroups`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupCall {
    Create(String, Limits),
    AddProcess(String, u32),
    KillAll(String),
    Remove(String),
    SetFrozen(String, bool),
}

/// A fake [`CgroupManager`] that records calls and can be told to fail one kind of call.
#[derive(Debug, Default)]
pub struct RecordingCgroups {
    calls: Mutex<Vec<CgroupCall>>,
    fail: Mutex<Option<&'static str>>,
    memory: Mutex<Option<u64>>,
    cpu: Mutex<Option<u64>>,
}

impl RecordingCgroups {
    pub fn new() -> Self {
        Self::default()
    }

    /// Make every later call of `method` ("create", "add_process", ...) fail with EIO.
    pub fn fail_on(&self, method: &'static str) {
        *self.fail.lock().unwrap() = Some(method);
    }

    pub fn set_memory(&self, bytes: Option<u64>) {
        *self.memory.lock().unwrap() = bytes;
    }

    pub fn set_cpu_usage(&self, usec: Option<u64>) {
        *self.cpu.lock().unwrap() = usec;
    }

    pub fn calls(&self) -> Vec<CgroupCall> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, method: &'static str, call: CgroupCall) -> Result<(), CgroupError> {
        self.calls.lock().unwrap().push(call);
        if *self.fail.lock().unwrap() == Some(method) {
            return Err(CgroupError::Io {
                op: method,
                path: PathBuf::from("/fake"),
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        Ok(())
    }
}

impl CgroupManager for RecordingCgroups {
    fn create(&self, id: &str, limits: &Limits) -> Result<(), CgroupError> {
        self.record("create", CgroupCall::Create(id.to_owned(), *limits))
    }
    fn add_process(&self, id: &str, pid: u32) -> Result<(), CgroupError> {
        self.record("add_process", CgroupCall::AddProcess(id.to_owned(), pid))
    }
    fn kill_all(&self, id: &str, _timeout: Duration) -> Result<(), CgroupError> {
        self.record("kill_all", CgroupCall::KillAll(id.to_owned()))
    }
    fn remove(&self, id: &str) -> Result<(), CgroupError> {
        self.record("remove", CgroupCall::Remove(id.to_owned()))
    }
    fn is_frozen(&self, id: &str) -> Option<bool> {
        let calls = self.calls.lock().unwrap();
        calls.iter().rev().find_map(|c| match c {
            CgroupCall::SetFrozen(i, f) if i == id => Some(*f),
            _ => None,
        })
    }

    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError> {
        self.record("set_frozen", CgroupCall::SetFrozen(id.to_owned(), frozen))
    }
    fn memory_bytes(&self, _id: &str) -> Option<u64> {
        *self.memory.lock().unwrap()
    }
    fn cpu_usage_usec(&self, _id: &str) -> Option<u64> {
        *self.cpu.lock().unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(p: &Path) -> String {
        fs::read_to_string(p).unwrap().trim().to_owned()
    }

    fn fake_v1_root() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for c in V1_CONTROLLERS {
            fs::create_dir_all(t.path().join(c)).unwrap();
            fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        t
    }

    #[test]
    fn detects_v1_and_writes_limits_without_swap() {
        let t = fake_v1_root();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        assert_eq!(cg.version(), CgroupVersion::V1);
        // Pretend the kernel has swap accounting: the file exists once the dir does.
        let mem = t.path().join("memory/space/sb1");
        fs::create_dir_all(&mem).unwrap();
        fs::write(mem.join("memory.memsw.limit_in_bytes"), "").unwrap();
        let limits = Limits {
            cpu_millis: 1500,
            memory_mib: 256,
            pids: 64,
            rlimits: Default::default(),
            disk_mib: None,
        };
        cg.create("sb1", &limits).unwrap();
        assert_eq!(read(&mem.join("memory.limit_in_bytes")), "268435456");
        assert_eq!(read(&mem.join("memory.memsw.limit_in_bytes")), "268435456");
        let cpu = t.path().join("cpu/space/sb1");
        assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");
        assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "150000");
        assert_eq!(read(&t.path().join("pids/space/sb1/pids.max")), "64");
        assert!(t.path().join("freezer/space/sb1").is_dir());

        cg.add_process("sb1", 4242).unwrap();
        for c in V1_CONTROLLERS {
            assert_eq!(
                read(&t.path().join(c).join("space/sb1/cgroup.procs")),
                "4242"
            );
        }
    }

    /// The freezer state is read from the kernel once, then known from what this process
    /// writes (decision 0066); what could change it behind set_frozen's back forgets it.
    #[test]
    fn the_freezer_state_is_read_once_then_known() {
        let t = fake_v1_root();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        assert_eq!(cg.is_frozen("sb3"), None, "no cgroup, nothing known");
        cg.create("sb3", &Limits::default()).unwrap();
        let state = t.path().join("freezer/space/sb3/freezer.state");
        fs::write(&state, "THAWED\n").unwrap();
        assert_eq!(cg.is_frozen("sb3"), Some(false));
        // Known now: a change nobody made through set_frozen is not read again...
        fs::write(&state, "FROZEN\n").unwrap();
        assert_eq!(cg.is_frozen("sb3"), Some(false));
        // ...and what set_frozen reached is what is known.
        cg.set_frozen("sb3", true).unwrap();
        assert_eq!(read(&state), "FROZEN");
        assert_eq!(cg.is_frozen("sb3"), Some(true));
        cg.set_frozen("sb3", false).unwrap();
        assert_eq!(cg.is_frozen("sb3"), Some(false));
        // kill_all freezes and thaws on its own: the kernel is asked again after it.
        fs::write(&state, "FROZEN\n").unwrap();
        cg.kill_all("sb3", Duration::from_secs(1)).unwrap();
        assert_eq!(cg.is_frozen("sb3"), Some(true));
        // A state set_frozen could not reach is not remembered either.
        fs::remove_dir_all(t.path().join("freezer/space/sb3")).unwrap();
        assert!(cg.set_frozen("sb3", false).is_err());
        assert_eq!(cg.is_frozen("sb3"), None);
    }

    #[test]
    fn zero_limits_mean_unlimited() {
        let t = fake_v1_root();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        cg.create(
            "sb2",
            &Limits {
                cpu_millis: 0,
                memory_mib: 0,
                pids: 0,
                rlimits: Default::default(),
                disk_mib: None,
            },
        )
        .unwrap();
        assert_eq!(
            read(&t.path().join("memory/space/sb2/memory.limit_in_bytes")),
            "-1"
        );
        assert_eq!(read(&t.path().join("cpu/space/sb2/cpu.cfs_quota_us")), "-1");
        assert_eq!(read(&t.path().join("pids/space/sb2/pids.max")), "max");
    }

    #[test]
    fn detects_v2_enables_controllers_and_writes_limits() {
        let t = tempfile::tempdir().unwrap();
        fs::write(
            t.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        assert_eq!(cg.version(), CgroupVersion::V2);
        assert_eq!(
            read(&t.path().join("cgroup.subtree_control")),
            "+cpu +memory +pids"
        );
        assert_eq!(
            read(&t.path().join("space/cgroup.subtree_control")),
            "+cpu +memory +pids"
        );
        let d = t.path().join("space/sb3");
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("memory.swap.max"), "max").unwrap();
        cg.create(
            "sb3",
            &Limits {
                cpu_millis: 500,
                memory_mib: 64,
                pids: 10,
                rlimits: Default::default(),
                disk_mib: None,
            },
        )
        .unwrap();
        assert_eq!(read(&d.join("memory.max")), "67108864");
        assert_eq!(read(&d.join("memory.swap.max")), "0");
        assert_eq!(read(&d.join("cpu.max")), "50000 100000");
        assert_eq!(read(&d.join("pids.max")), "10");
        assert_eq!(cg.dirs("sb3"), vec![d.clone()]);
        fs::write(d.join("memory.current"), "12345\n").unwrap();
        assert_eq!(cg.memory_bytes("sb3"), Some(12345));
        assert_eq!(cg.memory_cache_bytes("sb3"), None);
        fs::write(d.join("memory.stat"), "anon 100\nfile 4096\nkernel 8\n").unwrap();
        assert_eq!(cg.memory_cache_bytes("sb3"), Some(4096));
        assert_eq!(cg.cpu_usage_usec("sb3"), None);
        fs::write(
            d.join("cpu.stat"),
            "usage_usec 987654\nuser_usec 900000\nsystem_usec 87654\n",
        )
        .unwrap();
        assert_eq!(cg.cpu_usage_usec("sb3"), Some(987654));
    }

    #[test]
    fn parses_cpu_usage_files() {
        assert_eq!(
            parse_cpuacct_usage("18900066905239\n"),
            Some(18_900_066_905)
        );
        assert_eq!(parse_cpuacct_usage("999"), Some(0));
        assert_eq!(parse_cpuacct_usage("garbage"), None);
        assert_eq!(
            parse_cpu_stat_usage("usage_usec 5\nuser_usec 3\nsystem_usec 2\n"),
            Some(5)
        );
        // A key that merely starts with usage_usec does not count.
        assert_eq!(parse_cpu_stat_usage("usage_usec_x 9\nuser_usec 3\n"), None);
        assert_eq!(parse_cpu_stat_usage(""), None);
    }

    #[test]
    fn v1_uses_a_separate_cpuacct_hierarchy_for_cpu_usage() {
        let t = fake_v1_root();
        fs::create_dir_all(t.path().join("cpuacct")).unwrap();
        fs::write(t.path().join("cpuacct/cpuacct.usage"), "0").unwrap();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        cg.create("sb5", &Limits::default()).unwrap();
        let acct = t.path().join("cpuacct/space/sb5");
        assert!(acct.is_dir());
        assert!(cg.dirs("sb5").contains(&acct));
        cg.add_process("sb5", 77).unwrap();
        assert_eq!(read(&acct.join("cgroup.procs")), "77");
        fs::write(acct.join("cpuacct.usage"), "2500000\n").unwrap();
        assert_eq!(cg.cpu_usage_usec("sb5"), Some(2500));
    }

    #[test]
    fn v1_reads_cpu_usage_from_a_co_mounted_cpu_cpuacct() {
        let t = fake_v1_root();
        fs::write(t.path().join("cpu/cpuacct.usage"), "0").unwrap();
        // The `cpuacct` name is a link to the same hierarchy; it must not be used twice.
        fs::create_dir_all(t.path().join("cpuacct")).unwrap();
        fs::write(t.path().join("cpuacct/cpuacct.usage"), "0").unwrap();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        cg.create("sb6", &Limits::default()).unwrap();
        assert_eq!(cg.dirs("sb6").len(), V1_CONTROLLERS.len());
        fs::write(t.path().join("cpu/space/sb6/cpuacct.usage"), "7000").unwrap();
        assert_eq!(cg.cpu_usage_usec("sb6"), Some(7));
    }

    #[test]
    fn rejects_path_like_ids_and_missing_hierarchies() {
        let t = fake_v1_root();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        assert!(matches!(
            cg.create("../x", &Limits::default()),
            Err(CgroupError::InvalidName(_))
        ));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            LinuxCgroups::detect(empty.path(), "space"),
            Err(CgroupError::NoHierarchy(_))
        ));
    }

    #[test]
    fn remove_is_idempotent() {
        let t = fake_v1_root();
        let cg = LinuxCgroups::detect(t.path(), "space").unwrap();
        for c in V1_CONTROLLERS {
            fs::create_dir_all(t.path().join(c).join("space/sb4")).unwrap();
        }
        cg.remove("sb4").unwrap();
        cg.remove("sb4").unwrap();
        assert!(!t.path().join("memory/space/sb4").exists());
    }

    #[test]
    fn recording_fake_records_and_fails_on_demand() {
        let f = RecordingCgroups::new();
        f.create("a", &Limits::default()).unwrap();
        f.fail_on("add_process");
        assert!(f.add_process("a", 1).is_err());
        assert_eq!(
            f.calls(),
            vec![
                CgroupCall::Create("a".into(), Limits::default()),
                CgroupCall::AddProcess("a".into(), 1)
            ]
        );
    }
}
