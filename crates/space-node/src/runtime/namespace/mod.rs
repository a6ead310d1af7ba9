//! The namespace runtime: space-daemon as PID 1 of fresh user, pid, mount, uts, ipc, net and
//! cgroup namespaces, on an idmapped btrfs rootfs, with cgroup limits, a trimmed capability
//! set, no_new_privs and a seccomp filter.
//!
//! Who does what (verified on Linux 6.18):
//! - the parent (here) creates the channel socket, the cgroups, and, once the child's user
//!   namespace exists, writes its uid/gid maps, places it in the cgroups and builds the
//!   idmapped rootfs mount (`open_tree(OPEN_TREE_CLONE)` + `mount_setattr(MOUNT_ATTR_IDMAP)`:
//!   only the host side holds CAP_SYS_ADMIN over the btrfs superblock);
//! - the child (`space_sys::ns`) receives that detached mount over a socketpair,
//!   `move_mount`s it in its own mount namespace, pivots into it and builds /proc, /dev, /tmp.
//!
//! Loopback is brought up by the child (SIOCSIFFLAGS) before it drops CAP_NET_ADMIN, so the
//! daemon finds `lo` up.

mod seccomp;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use space_sys::mount::{MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID, idmapped_clone};
use space_sys::ns::{self, InitSpec, NsError, SockFilter, caps};
use space_sys::process::{DAEMON_OOM_SCORE_ADJ, DEFAULT_RLIMITS, Rlimit};

pub use self::seccomp::{
    ALLOWED as SECCOMP_ALLOWED, DENIED as SECCOMP_DENIED, IOCTL_FAMILIES, IoctlFamily,
    SOCKET_FAMILIES, SeccompError,
};
use super::{LaunchPlan, Launched, Runtime, RuntimeError};
use crate::api::Limits;
use crate::cgroup::{CgroupError, CgroupManager, LinuxCgroups};

/// Capabilities the sandbox keeps (decision 0041): what its root needs to install packages,
/// manage its own users and files, and run servers on low ports. Docker's default set less
/// CAP_NET_RAW (raw and packet sockets), CAP_MKNOD (device nodes), CAP_AUDIT_WRITE and
/// CAP_SETFCAP (file capabilities). Everything else, CAP_SYS_ADMIN, CAP_SYS_PTRACE,
/// CAP_SYS_MODULE and CAP_NET_ADMIN included, is dropped from every set.
pub const KEPT_CAPS: [u32; 10] = [
    caps::CHOWN,
    caps::DAC_OVERRIDE,
    caps::FOWNER,
    caps::FSETID,
    caps::KILL,
    caps::SETGID,
    caps::SETUID,
    caps::SETPCAP,
    caps::NET_BIND_SERVICE,
    caps::SYS_CHROOT,
];

/// The kept capabilities as a bit mask (bit n = capability n).
pub fn kept_caps_mask() -> u64 {
    KEPT_CAPS.iter().fold(0, |m, c| m | (1u64 << c))
}

#[derive(Debug, Clone)]
pub struct NamespaceConfig {
    /// Name of the cgroup under which every sandbox gets `<id>` (per v1 controller, or in
    /// the v2 tree).
    pub cgroup_parent: String,
    /// Where the cgroup filesystems are mounted.
    pub cgroup_root: PathBuf,
    /// Mount a read-only sysfs at /sys inside (best effort).
    pub mount_sysfs: bool,
    /// How long destroy waits for processes to die before giving up.
    pub destroy_timeout: Duration,
    /// How long launch waits for the init to reach exec before killing it and failing.
    pub launch_timeout: Duration,
}

impl Default for NamespaceConfig {
    fn default() -> Self {
        Self {
            cgroup_parent: "space".to_owned(),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            mount_sysfs: true,
            destroy_timeout: Duration::from_secs(5),
            launch_timeout: Duration::from_secs(10),
        }
    }
}

/// What we hold for a sandbox launched by this process: its init is our child, whose pid
/// nobody can reuse until we reap it, so a pidfd opened on it later names it. None is held
/// open (issue 16: one open file fewer per sandbox).
#[derive(Debug)]
struct Tracked {
    pid: u32,
    socket: PathBuf,
    /// Reaped already (by [`Runtime::alive`], which found it a zombie): the pid may be
    /// another process's by now, and is never signalled.
    reaped: bool,
}

/// What the sandbox init is confined by beyond its namespaces: the seccomp programs, the
/// masked and read-only paths, the resource limits. Always [`Boundary::hardened`] outside
/// the benchmark that compares it with the boundary before decision 0041.
#[derive(Debug)]
struct Boundary {
    seccomp: Vec<Vec<SockFilter>>,
    masked: Vec<ns::MaskedPath>,
    read_only: &'static [&'static CStr],
    rlimits: &'static [Rlimit],
}

impl Boundary {
    fn hardened() -> Result<Boundary, RuntimeError> {
        Ok(Boundary {
            seccomp: seccomp::programs().map_err(|e| RuntimeError::Setup {
                step: "compile the seccomp filter",
                source: io::Error::other(e),
            })?,
            masked: ns::present_masks(),
            read_only: &ns::READ_ONLY_PATHS,
            rlimits: &DEFAULT_RLIMITS,
        })
    }
}

#[derive(Debug)]
struct Inner {
    cfg: NamespaceConfig,
    cgroups: Arc<dyn CgroupManager>,
    boundary: Boundary,
    dev_null: OwnedFd,
    tracked: Mutex<HashMap<String, Tracked>>,
    /// pid → start time of every tracked init not reaped yet: [`Runtime::alive`] answers for
    /// these with one `waitid` instead of reading `/proc/PID/stat` (decision 0066). Locked
    /// after `tracked` when both are held.
    own: Mutex<HashMap<u32, u64>>,
    /// The mount namespace inits are cloned from (made at the first launch; None when it
    /// could not be made: they are cloned from the node's own then). Decision 0053.
    launcher: std::sync::OnceLock<Option<OwnedFd>>,
}

impl Inner {
    /// The launcher mount namespace ([`space_sys::mntns::launcher`]), made on first use: by
    /// then the node's volume and everything else an init reads by path is mounted.
    fn launcher(&self) -> Option<&OwnedFd> {
        self.launcher
            .get_or_init(|| match space_sys::mntns::launcher() {
                Ok(fd) => Some(fd),
                Err(e) => {
                    tracing::warn!(error = %e, "no launcher mount namespace: sandbox inits copy the node's every mount");
                    None
                }
            })
            .as_ref()
    }
}

/// A pidfd on our own unreaped child `pid` (the pid is still its own until we reap it).
fn child_pidfd(pid: u32) -> Option<OwnedFd> {
    ns::pidfd_open(pid).ok()
}

/// Kills our own unreaped child `pid` and reaps it, waiting at most `timeout` (the reaping
/// goes on in the background after that).
async fn kill_and_reap(pid: u32, timeout: Duration) {
    let Some(pidfd) = child_pidfd(pid) else {
        return;
    };
    // Killing PID 1 of the pid namespace takes every process in it along.
    let _ = ns::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    let _ = tokio::time::timeout(
        timeout,
        tokio::task::spawn_blocking(move || ns::waitid_pidfd(pidfd.as_fd(), 0)),
    )
    .await;
}

#[derive(Debug, Clone)]
pub struct NamespaceRuntime {
    inner: Arc<Inner>,
}

impl NamespaceRuntime {
    /// Reaps init `pid` if it is our own exited child (spaced is its parent, so nobody else
    /// will), and marks it so that its pid is never signalled after. It replaced a task and a
    /// pidfd per init (issue 16); the reconciler's pass asks `alive` of every sandbox, so a
    /// zombie lasts at most one pass.
    fn reap(&self, pid: u32) {
        let mut tracked = self.inner.tracked.lock().unwrap();
        let Some(t) = tracked.values_mut().find(|t| t.pid == pid && !t.reaped) else {
            return;
        };
        if let Some(pidfd) = child_pidfd(pid)
            && matches!(ns::waitid_pidfd(pidfd.as_fd(), libc::WNOHANG), Ok(Some(_)))
        {
            t.reaped = true;
            self.inner.own.lock().unwrap().remove(&pid);
        }
    }

    /// Whether `l` is the init of a tracked sandbox, our own child not reaped yet.
    fn is_own(&self, l: &Launched) -> bool {
        self.inner.own.lock().unwrap().get(&l.init_pid) == Some(&l.start_time)
    }
}

fn setup(step: &'static str) -> impl FnOnce(io::Error) -> RuntimeError {
    move |source| RuntimeError::Setup { step, source }
}

impl From<CgroupError> for RuntimeError {
    fn from(e: CgroupError) -> Self {
        RuntimeError::Cgroup {
            path: e.path(),
            source: io::Error::other(e),
        }
    }
}

impl From<NsError> for RuntimeError {
    fn from(e: NsError) -> Self {
        match e {
            NsError::Parent { op, source } => RuntimeError::Setup { step: op, source },
            NsError::Child { step, source } => RuntimeError::Child {
                step: step.name().to_owned(),
                source,
            },
            died @ NsError::Died(_) => RuntimeError::Child {
                step: "exec space-daemon".to_owned(),
                source: io::Error::other(died),
            },
            nul @ NsError::Nul(_) => RuntimeError::Setup {
                step: "prepare the sandbox init",
                source: io::Error::new(io::ErrorKind::InvalidInput, nul),
            },
        }
    }
}

impl NamespaceRuntime {
    /// The runtime on the host's cgroups (v2 or hybrid v1, detected).
    pub fn new(cfg: NamespaceConfig) -> Result<NamespaceRuntime, RuntimeError> {
        let cgroups = LinuxCgroups::detect(&cfg.cgroup_root, &cfg.cgroup_parent)?;
        Self::with_cgroups(cfg, Arc::new(cgroups))
    }

    /// The runtime on any [`CgroupManager`] (a recording fake in unit tests).
    pub fn with_cgroups(
        cfg: NamespaceConfig,
        cgroups: Arc<dyn CgroupManager>,
    ) -> Result<NamespaceRuntime, RuntimeError> {
        Self::with_boundary(cfg, cgroups, Boundary::hardened()?)
    }

    fn with_boundary(
        cfg: NamespaceConfig,
        cgroups: Arc<dyn CgroupManager>,
        boundary: Boundary,
    ) -> Result<NamespaceRuntime, RuntimeError> {
        let dev_null = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(setup("open /dev/null"))?;
        Ok(NamespaceRuntime {
            inner: Arc::new(Inner {
                cfg,
                cgroups,
                boundary,
                dev_null: dev_null.into(),
                tracked: Mutex::new(HashMap::new()),
                own: Mutex::new(HashMap::new()),
                launcher: std::sync::OnceLock::new(),
            }),
        })
    }

    pub fn cgroups(&self) -> &Arc<dyn CgroupManager> {
        &self.inner.cgroups
    }

    /// Freeze (pause) or thaw every process of a sandbox.
    pub async fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), RuntimeError> {
        let inner = self.inner.clone();
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || inner.cgroups.set_frozen(&id, frozen))
            .await
            .map_err(|e| RuntimeError::Setup {
                step: "join the freezer task",
                source: io::Error::other(e),
            })?
            .map_err(RuntimeError::from)
    }
}

/// `base` with the create's overrides (each soft and hard alike).
fn with_overrides(base: &[Rlimit], r: &crate::api::Rlimits) -> Vec<Rlimit> {
    let mut out = base.to_vec();
    for (resource, value) in [
        (libc::RLIMIT_NOFILE, r.nofile),
        (libc::RLIMIT_CORE, r.core),
        (libc::RLIMIT_MEMLOCK, r.memlock),
    ] {
        let Some(v) = value else { continue };
        let l = Rlimit {
            resource,
            soft: v,
            hard: v,
        };
        match out.iter_mut().find(|o| o.resource == resource) {
            Some(o) => *o = l,
            None => out.push(l),
        }
    }
    out
}

/// Removes what a failed launch created, unless disarmed.
struct Cleanup<'a> {
    inner: &'a Inner,
    id: &'a str,
    cgroup: bool,
    socket: Option<&'a Path>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        if self.cgroup {
            let _ = self
                .inner
                .cgroups
                .kill_all(self.id, self.inner.cfg.destroy_timeout);
            if let Err(e) = self.inner.cgroups.remove(self.id) {
                tracing::warn!(id = self.id, error = %e, "cleanup of a failed launch left cgroups");
            }
        }
        if let Some(s) = self.socket {
            let _ = fs::remove_file(s);
        }
    }
}

fn bind_channel(path: &Path) -> Result<UnixListener, RuntimeError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(setup("create the channel socket directory"))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(setup("restrict the channel socket directory"))?;
    }
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(setup("remove a stale channel socket")(e)),
    }
    let listener = UnixListener::bind(path).map_err(setup("bind the channel socket"))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .map_err(setup("restrict the channel socket"))?;
    Ok(listener)
}

/// What `/proc/PID/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    state: char,
    start_time: u64,
}

fn parse_stat(s: &str) -> Option<ProcStat> {
    // comm (field 2) may hold spaces and parentheses: fields restart after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3), field 22 is the 19th.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

fn read_stat(pid: u32) -> io::Result<ProcStat> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&s).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed stat"))
}

fn is_alive(l: &Launched) -> bool {
    matches!(read_stat(l.init_pid), Ok(st) if st.start_time == l.start_time && st.state != 'Z' && st.state != 'X')
}

fn validate(plan: &LaunchPlan) -> Result<(), RuntimeError> {
    let bad = |what: &str| RuntimeError::Setup {
        step: "validate the launch plan",
        source: io::Error::new(io::ErrorKind::InvalidInput, what.to_owned()),
    };
    if plan.id.is_empty() || plan.id.contains('/') || plan.id.starts_with('.') {
        return Err(bad("bad sandbox id"));
    }
    if plan.id_count == 0 || plan.uid_base.checked_add(plan.id_count).is_none() {
        return Err(bad("bad uid range"));
    }
    Ok(())
}

fn launch_blocking(inner: &Inner, plan: &LaunchPlan) -> Result<(Launched, OwnedFd), RuntimeError> {
    validate(plan)?;
    fs::create_dir_all(&plan.run_dir).map_err(setup("create the run dir"))?;
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(plan.run_dir.join("daemon.log"))
        .map_err(setup("open the daemon log"))?;
    let listener = bind_channel(&plan.channel_socket)?;
    let mut cleanup = Cleanup {
        inner,
        id: &plan.id,
        cgroup: false,
        socket: Some(&plan.channel_socket),
    };
    // Mark first: a half-created cgroup is removed too.
    cleanup.cgroup = true;
    inner.cgroups.create(&plan.id, &plan.limits)?;

    let mut env: Vec<(String, String)> = plan
        .env
        .iter()
        .filter(|(k, _)| k != "SPACE_CHANNEL_FD")
        .cloned()
        .collect();
    env.push(("SPACE_CHANNEL_FD".into(), ns::CHANNEL_FD.to_string()));
    // The node names the sandbox (its API id, which a warm pool's sandbox gets only when
    // handed out); the runtime's own name is the fallback.
    if !env.iter().any(|(k, _)| k == "SPACE_SANDBOX_ID") {
        env.push(("SPACE_SANDBOX_ID".into(), plan.id.clone()));
    }
    let argv = ["space-daemon".to_owned()];
    // The init sets its own open-files limit once it has closed the fds it inherited (see
    // `InitSpec::open_files`); the host only raises the hard limit beforehand where the
    // sandbox's goes above the node's own.
    let (nofile, rlimits): (Vec<_>, Vec<_>) =
        with_overrides(inner.boundary.rlimits, &plan.limits.rlimits)
            .into_iter()
            .partition(|l| l.resource == libc::RLIMIT_NOFILE);
    let open_files = nofile.first().copied();
    let cgroup_fd = inner.cgroups.clone_target(&plan.id);
    let spec = InitSpec {
        rootfs: &plan.rootfs,
        daemon_binary: &plan.daemon_binary,
        hostname: &plan.hostname,
        argv: &argv,
        env: &env,
        stdin: inner.dev_null.as_fd(),
        stdout: log.as_fd(),
        channel: listener.as_fd(),
        seccomp: &inner.boundary.seccomp,
        keep_caps: kept_caps_mask(),
        devpts_gid: (plan.id_count > 5).then_some(5),
        mount_sysfs: inner.cfg.mount_sysfs,
        masked: &inner.boundary.masked,
        read_only: inner.boundary.read_only,
        cgroup: cgroup_fd.as_ref().map(|fd| fd.as_fd()),
        netns: plan.netns.as_ref().map(|n| ns::NetnsJoin {
            ns: n.ns.as_fd(),
            home: n.home.as_fd(),
        }),
        open_files,
        // Cloned inside the launcher namespace, the init's mount namespace copies a few dozen
        // mounts instead of the node's own, which holds one per network slot (decision 0053).
        mount_ns: inner.launcher().map(|m| m.as_fd()),
    };
    // The parent's half of the handshake, while the cloned init waits for it.
    let between = |child: &ns::InitChild| -> Result<(), RuntimeError> {
        child.write_id_maps(plan.uid_base, plan.id_count)?;
        child.set_rlimits(&rlimits)?;
        if let Some(l) = open_files {
            let own = space_sys::process::getrlimit(libc::RLIMIT_NOFILE)
                .map_err(setup("read the node's open-files limit"))?;
            if l.hard > own.hard {
                child.set_rlimits(&[Rlimit {
                    soft: own.soft,
                    ..l
                }])?;
            }
        }
        child.lower_oom_score_adj(DAEMON_OOM_SCORE_ADJ)?;
        if cgroup_fd.is_none() {
            inner.cgroups.add_process(&plan.id, child.pid())?;
        }
        let userns = child.open_userns()?;
        // nodev, but set-uid bits count: sudo inside becomes the sandbox's own root
        // (decision 0021), though the volume itself is nosuid on the host.
        let rootfs = idmapped_clone(
            &plan.rootfs,
            userns.as_fd(),
            MOUNT_ATTR_NODEV,
            MOUNT_ATTR_NOSUID,
        )
        .map_err(|e| RuntimeError::Setup {
            step: "create the idmapped rootfs mount",
            source: io::Error::other(e),
        })?;
        child.release(rootfs.as_fd())?;
        Ok(())
    };
    let (pid, pidfd) = ns::launch_sandbox_init(&spec, inner.cfg.launch_timeout, between)?;
    let start_time = match read_stat(pid) {
        Ok(st) => st.start_time,
        Err(e) => {
            let _ = ns::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
            let _ = ns::waitid_pidfd(pidfd.as_fd(), 0);
            return Err(setup("read the init's start time")(e));
        }
    };
    cleanup.cgroup = false;
    cleanup.socket = None;
    drop(listener);
    Ok((
        Launched {
            init_pid: pid,
            start_time,
        },
        pidfd,
    ))
}

/// Kill an init we did not start (adopted after a restart), checking its identity through a
/// pidfd so a recycled pid is never signalled, and wait (bounded) until it is gone.
async fn kill_adopted(l: &Launched, timeout: Duration) {
    let Ok(pidfd) = ns::pidfd_open(l.init_pid) else {
        return;
    };
    // The pidfd pins the process: if the start time still matches now, it is our init.
    if !is_alive(l) {
        return;
    }
    let _ = ns::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(200);
    while is_alive(l) && Instant::now() < deadline {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[async_trait]
impl Runtime for NamespaceRuntime {
    fn kind(&self) -> crate::api::RuntimeKind {
        crate::api::RuntimeKind::Namespace
    }

    async fn launch(&self, plan: &LaunchPlan) -> Result<Launched, RuntimeError> {
        let inner = self.inner.clone();
        let owned = plan.clone();
        let (launched, pidfd) =
            tokio::task::spawn_blocking(move || launch_blocking(&inner, &owned))
                .await
                .map_err(|e| RuntimeError::Setup {
                    step: "join the launch task",
                    source: io::Error::other(e),
                })??;
        // Exits are noticed (and reaped) by `alive`, which the node's reconciler asks of
        // every sandbox each pass: no open file or task per init (issue 16).
        drop(pidfd);
        let old = self.inner.tracked.lock().unwrap().insert(
            plan.id.clone(),
            Tracked {
                pid: launched.init_pid,
                socket: plan.channel_socket.clone(),
                reaped: false,
            },
        );
        {
            let mut own = self.inner.own.lock().unwrap();
            if let Some(old) = old.as_ref().filter(|o| !o.reaped) {
                own.remove(&old.pid);
            }
            own.insert(launched.init_pid, launched.start_time);
        }
        if let Some(old) = old.filter(|o| !o.reaped) {
            // A relaunch of a live id: the old init must not linger unowned.
            tokio::spawn(kill_and_reap(old.pid, Duration::MAX));
        }
        tracing::debug!(id = %plan.id, pid = launched.init_pid, "sandbox init running");
        Ok(launched)
    }

    async fn destroy(&self, id: &str, launched: Option<&Launched>) -> Result<(), RuntimeError> {
        let timeout = self.inner.cfg.destroy_timeout;
        // A frozen (paused) init would not act on SIGKILL until thawed (cgroup v1): thaw
        // first; the processes get a moment of CPU before the kill lands.
        if self.inner.cgroups.is_frozen(id) == Some(true)
            && let Err(e) = NamespaceRuntime::set_frozen(self, id, false).await
        {
            tracing::warn!(id, error = %e, "thawing a paused sandbox before destroying it failed");
        }
        let tracked = self.inner.tracked.lock().unwrap().remove(id);
        if let Some(t) = tracked {
            // No longer in the map, so `alive` will not reap it: this does.
            if !t.reaped {
                self.inner.own.lock().unwrap().remove(&t.pid);
                kill_and_reap(t.pid, timeout).await;
            }
            match fs::remove_file(&t.socket) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(setup("remove the channel socket")(e)),
            }
        } else if let Some(l) = launched {
            kill_adopted(l, timeout).await;
        }
        let inner = self.inner.clone();
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || -> Result<(), CgroupError> {
            inner.cgroups.kill_all(&id, timeout)?;
            inner.cgroups.remove(&id)
        })
        .await
        .map_err(|e| RuntimeError::Setup {
            step: "join the destroy task",
            source: io::Error::other(e),
        })??;
        Ok(())
    }

    fn alive(&self, launched: &Launched) -> bool {
        // Our own unreaped child keeps its pid until we reap it: one waitid, no /proc
        // lookup, which the reconciler's pass would do for every sandbox (decision 0066).
        if self.is_own(launched) {
            match space_sys::process::child_exited(launched.init_pid) {
                Ok(false) => return true,
                Ok(true) => {
                    self.reap(launched.init_pid);
                    return false;
                }
                // Not ours after all (reaped meanwhile): /proc says.
                Err(_) => {}
            }
        }
        match read_stat(launched.init_pid) {
            Ok(st) if st.start_time == launched.start_time => {
                if st.state == 'Z' {
                    self.reap(launched.init_pid);
                }
                st.state != 'Z' && st.state != 'X'
            }
            _ => false,
        }
    }

    async fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), RuntimeError> {
        NamespaceRuntime::set_frozen(self, id, frozen).await
    }

    fn is_frozen(&self, id: &str) -> bool {
        self.inner.cgroups.is_frozen(id).unwrap_or(false)
    }

    fn memory_bytes(&self, id: &str) -> Option<u64> {
        self.inner.cgroups.memory_bytes(id)
    }

    fn memory_cache_bytes(&self, id: &str) -> Option<u64> {
        self.inner.cgroups.memory_cache_bytes(id)
    }

    fn cpu_usage_usec(&self, id: &str) -> Option<u64> {
        self.inner.cgroups.cpu_usage_usec(id)
    }

    async fn personalize(
        &self,
        id: &str,
        launched: &Launched,
        limits: Option<&Limits>,
        hostname: &str,
    ) -> Result<(), RuntimeError> {
        let inner = self.inner.clone();
        let (id, limits, hostname, pid) = (
            id.to_owned(),
            limits.copied(),
            hostname.to_owned(),
            launched.init_pid,
        );
        tokio::task::spawn_blocking(move || -> Result<(), RuntimeError> {
            if let Some(l) = limits {
                // Idempotent: applies the limits to the existing cgroups.
                inner.cgroups.create(&id, &l)?;
                // The init's resource limits, which the processes it starts from now on
                // inherit (a pooled sandbox has run only the node's warm-up command).
                ns::set_rlimits_of(pid, &with_overrides(inner.boundary.rlimits, &l.rlimits))
                    .map_err(RuntimeError::from)?;
            }
            ns::set_hostname_of(pid, &hostname).map_err(setup("set the sandbox's hostname"))
        })
        .await
        .map_err(|e| RuntimeError::Setup {
            step: "join the personalize task",
            source: io::Error::other(e),
        })?
    }
}
