//! The sandbox init: `clone3` into fresh user, pid, mount, uts, ipc and net namespaces, set the
//! sandbox up from the inside, and `execve` space-daemon as its PID 1.
//!
//! The caller (spaced) is a multithreaded tokio process, so the cloned child may neither
//! allocate nor take locks until it execs. [`launch_sandbox_init`] therefore prepares every
//! C string, pointer array and seccomp program *before* cloning; the child then runs only raw
//! syscalls on that prepared data (see `child_main`). On x86_64 the child shares the
//! caller's memory until its exec (`CLONE_VM | CLONE_VFORK`, on a stack of its own, decision
//! 0061): it writes nothing but that stack, and its errno is the blocked cloning thread's.
//!
//! Handshake (the parent side is [`InitChild`]):
//! 1. A fresh thread clones (and, sharing memory, stays blocked until the exec); the child
//!    says it runs on a `SOCK_SEQPACKET` socketpair and blocks on it.
//! 2. The calling thread writes uid_map/gid_map, places the child into its cgroups, builds the
//!    idmapped rootfs mount (it needs the child's userns fd, and CAP_SYS_ADMIN over the btrfs
//!    superblock, which only the host side has), and passes it with [`InitChild::release`].
//! 3. The child attaches the rootfs, pivots, mounts /proc, /dev, ..., drops privileges,
//!    installs seccomp and execs. Failures are written as `(step, errno)` to a CLOEXEC pipe;
//!    EOF on that pipe means exec succeeded ([`InitChild::wait_exec`]).

use std::ffi::{CStr, CString, c_char, c_int};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use crate::mount::{
    MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY, MountAttr,
    OPEN_TREE_CLOEXEC, OPEN_TREE_CLONE, raw_close, raw_fsmount, raw_mount, raw_mount_setattr,
    raw_move_mount, raw_open_tree, raw_pivot_root_dot, raw_umount_detach,
};
use crate::process::{Rlimit, getrlimit, prlimit};

mod clone;
use clone::{ChildStack, SHARE_UNTIL_EXEC, clone_init, wait_hello};

/// Linux capability numbers (`<linux/capability.h>`).
pub mod caps {
    pub const CHOWN: u32 = 0;
    pub const DAC_OVERRIDE: u32 = 1;
    pub const DAC_READ_SEARCH: u32 = 2;
    pub const FOWNER: u32 = 3;
    pub const FSETID: u32 = 4;
    pub const KILL: u32 = 5;
    pub const SETGID: u32 = 6;
    pub const SETUID: u32 = 7;
    pub const SETPCAP: u32 = 8;
    pub const NET_BIND_SERVICE: u32 = 10;
    pub const NET_ADMIN: u32 = 12;
    pub const NET_RAW: u32 = 13;
    pub const SYS_MODULE: u32 = 16;
    pub const SYS_CHROOT: u32 = 18;
    pub const SYS_PTRACE: u32 = 19;
    pub const SYS_ADMIN: u32 = 21;
    pub const MKNOD: u32 = 27;
    pub const AUDIT_WRITE: u32 = 29;
    pub const SETFCAP: u32 = 31;
}

/// One classic-BPF instruction, layout-compatible with `struct sock_filter`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SockFilter {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

/// Everything the sandbox init needs. Paths are host paths as seen by the caller.
#[derive(Debug)]
pub struct InitSpec<'a> {
    /// Directory the rootfs mount is attached over (inside the child's mount namespace),
    /// then pivoted into. Normally the rootfs subvolume path itself.
    pub rootfs: &'a Path,
    /// Host file bind-mounted read-only at [`DAEMON_PATH`] and exec'd.
    pub daemon_binary: &'a Path,
    pub hostname: &'a str,
    pub argv: &'a [String],
    pub env: &'a [(String, String)],
    /// Becomes fd 0.
    pub stdin: BorrowedFd<'a>,
    /// Becomes fds 1 and 2.
    pub stdout: BorrowedFd<'a>,
    /// Becomes fd 3 (the guest channel's listening socket).
    pub channel: BorrowedFd<'a>,
    /// Seccomp programs, installed in order right before exec.
    pub seccomp: &'a [Vec<SockFilter>],
    /// Capabilities kept (bit n = capability n) in every set, including bounding and ambient.
    pub keep_caps: u64,
    /// `gid=` of the devpts instance (the tty group, 5), when mapped.
    pub devpts_gid: Option<u32>,
    /// Mount a read-only sysfs at /sys (skipped silently if the kernel refuses).
    pub mount_sysfs: bool,
    /// Paths covered inside (those of [`MASKED_PATHS`] this kernel has, normally: see
    /// [`present_masks`]) and bound read-only ([`READ_ONLY_PATHS`]).
    pub masked: &'a [MaskedPath],
    pub read_only: &'a [&'a CStr],
    /// A cgroup v2 directory to start the child in (`CLONE_INTO_CGROUP`): no migration
    /// afterwards, so no wait for an RCU grace period in the kernel.
    pub cgroup: Option<BorrowedFd<'a>>,
    /// A network namespace (owned by the node, pinned) for the child to live in instead of a
    /// fresh one, with `home` the namespace the calling thread returns to. The calling thread
    /// enters it around `clone3` (the child, already in its own user namespace, could not).
    /// The sandbox then has no capability over its network: addresses, routes and firewall
    /// rules stay the node's. Its loopback is the node's job too.
    pub netns: Option<NetnsJoin<'a>>,
    /// The open-files limit (`RLIMIT_NOFILE`), which the child sets itself once it has
    /// closed the fds it inherited: until then it holds a copy of every fd of the caller,
    /// which on a busy node are more than a sandbox's limit allows, and its setup would fail
    /// with EMFILE. The hard limit is clamped to the one the child has; raise that first with
    /// [`InitChild::set_rlimits`] where it must go higher.
    pub open_files: Option<Rlimit>,
    /// The mount namespace to clone the init from (the node's launcher namespace, which
    /// holds none of the node's per-slot mounts: decision 0053); None: the caller's.
    pub mount_ns: Option<BorrowedFd<'a>>,
}

/// See [`InitSpec::netns`].
#[derive(Debug, Clone, Copy)]
pub struct NetnsJoin<'a> {
    pub ns: BorrowedFd<'a>,
    pub home: BorrowedFd<'a>,
}

/// Where space-daemon appears inside the sandbox.
pub const DAEMON_PATH: &str = "/.space/space-daemon";
/// The fd number of the guest channel inside the sandbox.
pub const CHANNEL_FD: RawFd = 3;

/// The step of the child's setup that failed.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitStep {
    Signals = 1,
    WaitParent,
    Setsid,
    SetIds,
    CgroupNs,
    Hostname,
    Loopback,
    MountPrivate,
    CloneDevices,
    CloneDaemon,
    MountProc,
    AttachRootfs,
    PivotRoot,
    DetachOldRoot,
    AttachProc,
    MountDev,
    BindDevices,
    MountDevpts,
    DevSymlinks,
    MountShm,
    MountTmp,
    MaskPaths,
    ReadOnlyPaths,
    BindDaemon,
    Fds,
    OpenFiles,
    Seccomp,
    CapBounding,
    CapSet,
    Ambient,
    Exec,
}

impl InitStep {
    const ALL: [InitStep; 31] = [
        InitStep::Signals,
        InitStep::WaitParent,
        InitStep::Setsid,
        InitStep::SetIds,
        InitStep::CgroupNs,
        InitStep::Hostname,
        InitStep::Loopback,
        InitStep::MountPrivate,
        InitStep::CloneDevices,
        InitStep::CloneDaemon,
        InitStep::MountProc,
        InitStep::AttachRootfs,
        InitStep::PivotRoot,
        InitStep::DetachOldRoot,
        InitStep::AttachProc,
        InitStep::MountDev,
        InitStep::BindDevices,
        InitStep::MountDevpts,
        InitStep::DevSymlinks,
        InitStep::MountShm,
        InitStep::MountTmp,
        InitStep::MaskPaths,
        InitStep::ReadOnlyPaths,
        InitStep::BindDaemon,
        InitStep::Fds,
        InitStep::OpenFiles,
        InitStep::Seccomp,
        InitStep::CapBounding,
        InitStep::CapSet,
        InitStep::Ambient,
        InitStep::Exec,
    ];

    fn from_u32(v: u32) -> Option<InitStep> {
        InitStep::ALL.iter().copied().find(|s| *s as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            InitStep::Signals => "reset signals",
            InitStep::WaitParent => "wait for the parent",
            InitStep::Setsid => "start a session",
            InitStep::SetIds => "become root in the user namespace",
            InitStep::CgroupNs => "unshare the cgroup namespace",
            InitStep::Hostname => "set the hostname",
            InitStep::Loopback => "bring up loopback",
            InitStep::MountPrivate => "make mounts private",
            InitStep::CloneDevices => "clone the host device nodes",
            InitStep::CloneDaemon => "clone the daemon binary mount",
            InitStep::MountProc => "create the proc mount",
            InitStep::AttachRootfs => "attach the idmapped rootfs",
            InitStep::PivotRoot => "pivot_root",
            InitStep::DetachOldRoot => "detach the old root",
            InitStep::AttachProc => "mount /proc",
            InitStep::MountDev => "mount /dev",
            InitStep::BindDevices => "bind the device nodes",
            InitStep::MountDevpts => "mount /dev/pts",
            InitStep::DevSymlinks => "create /dev symlinks",
            InitStep::MountShm => "make /dev/shm",
            InitStep::MountTmp => "mount /tmp",
            InitStep::MaskPaths => "mask paths of /proc and /sys",
            InitStep::ReadOnlyPaths => "make paths of /proc read-only",
            InitStep::BindDaemon => "bind the daemon binary",
            InitStep::Fds => "set up file descriptors",
            InitStep::OpenFiles => "set the open-files limit",
            InitStep::CapBounding => "drop the capability bounding set",
            InitStep::CapSet => "set capabilities",
            InitStep::Ambient => "raise ambient capabilities",
            InitStep::Seccomp => "install the seccomp filter",
            InitStep::Exec => "exec space-daemon",
        }
    }
}

impl std::fmt::Display for InitStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error("failed to {op}")]
    Parent {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("sandbox init failed to {step}")]
    Child {
        step: InitStep,
        #[source]
        source: io::Error,
    },
    #[error("sandbox init was killed before its exec (signal {0})")]
    Died(i32),
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
}

fn parent_err(op: &'static str) -> impl FnOnce(io::Error) -> NsError {
    move |source| NsError::Parent { op, source }
}

/// Host device nodes bound into the sandbox's /dev (same path inside).
const DEV_NODES: [&CStr; 6] = [
    c"/dev/null",
    c"/dev/zero",
    c"/dev/full",
    c"/dev/random",
    c"/dev/urandom",
    c"/dev/tty",
];

const DEV_SYMLINKS: [(&CStr, &CStr); 5] = [
    (c"pts/ptmx", c"/dev/ptmx"),
    (c"/proc/self/fd", c"/dev/fd"),
    (c"/proc/self/fd/0", c"/dev/stdin"),
    (c"/proc/self/fd/1", c"/dev/stdout"),
    (c"/proc/self/fd/2", c"/dev/stderr"),
];

/// Hidden inside the sandbox (decision 0041): what OCI runtimes mask by default, plus what
/// reveals kernel addresses (`kallsyms`, `modules`) or host devices and paths (the host's
/// block devices, whose loop entries name their backing files). A file is covered with
/// /dev/null, a directory with an empty read-only tmpfs; a path this kernel lacks is skipped.
pub const MASKED_PATHS: [&CStr; 21] = [
    c"/proc/acpi",
    c"/proc/asound",
    c"/proc/interrupts",
    c"/proc/kcore",
    c"/proc/keys",
    c"/proc/key-users",
    c"/proc/latency_stats",
    c"/proc/timer_list",
    c"/proc/timer_stats",
    c"/proc/sched_debug",
    c"/proc/scsi",
    c"/proc/kallsyms",
    c"/proc/modules",
    c"/proc/vmallocinfo",
    c"/proc/iomem",
    c"/sys/firmware",
    c"/sys/devices/virtual/powercap",
    c"/sys/devices/virtual/block",
    c"/sys/block",
    c"/sys/class/block",
    c"/sys/fs",
];

/// A path to mask, and whether it is a directory (covered by an empty tmpfs) or a file
/// (covered by /dev/null).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskedPath {
    pub path: &'static CStr,
    pub dir: bool,
}

/// The paths of [`MASKED_PATHS`] that exist on this host, typed. /proc's and these /sys
/// entries are the kernel's, the same inside a sandbox as outside, so the init skips the
/// lookups of paths this kernel lacks and never tries a file's mask on a directory.
pub fn present_masks() -> Vec<MaskedPath> {
    MASKED_PATHS
        .iter()
        .filter_map(|p| {
            let md = std::fs::symlink_metadata(std::ffi::OsStr::from_bytes(p.to_bytes())).ok()?;
            Some(MaskedPath {
                path: p,
                dir: md.is_dir(),
            })
        })
        .collect()
}

/// Read-only inside the sandbox (what OCI runtimes make read-only by default): no sysctl,
/// sysrq or IRQ affinity write reaches the kernel even if a permission check were missed.
pub const READ_ONLY_PATHS: [&CStr; 5] = [
    c"/proc/bus",
    c"/proc/fs",
    c"/proc/irq",
    c"/proc/sys",
    c"/proc/sysrq-trigger",
];

/// Data prepared in the parent before `clone3`; the child only reads it.
struct Prepared {
    rootfs: CString,
    daemon_binary: CString,
    hostname: CString,
    devpts_opts: CString,
    exec_path: CString,
    argv_ptrs: Vec<*const c_char>,
    envp_ptrs: Vec<*const c_char>,
    fprogs: Vec<libc::sock_fprog>,
    keep_caps: u64,
    last_cap: u32,
    mount_sysfs: bool,
    masked: Vec<MaskedPath>,
    read_only: Vec<CString>,
    /// A fresh network namespace (bring its loopback up) rather than the node's slot.
    own_netns: bool,
    open_files: Option<Rlimit>,
    stdin: RawFd,
    stdout: RawFd,
    channel: RawFd,
    err_w: RawFd,
    err_r: RawFd,
    sync_child: RawFd,
    sync_parent: RawFd,
}

/// The parent's handle on a cloned sandbox init that has not exec'd yet.
#[derive(Debug)]
pub struct InitChild {
    pid: libc::pid_t,
    pidfd: OwnedFd,
    sync: OwnedFd,
    err: OwnedFd,
}

fn last_cap() -> u32 {
    static LAST: OnceLock<u32> = OnceLock::new();
    *LAST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(40)
    })
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

#[repr(C)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

fn cstring(s: &[u8], what: &'static str) -> Result<CString, NsError> {
    CString::new(s).map_err(|_| NsError::Nul(what))
}

/// Launches a sandbox init: clones it (it waits for [`InitChild::release`] before touching
/// anything), runs `between` (the parent's half of the handshake, which ends in
/// [`InitChild::release`]) while it waits, and returns the init's pid and pidfd once it has
/// exec'd. A failure of the clone, of `between`, of the child's setup, or no exec within
/// `timeout`, kills and reaps the child before the error is returned.
///
/// On x86_64 the child shares the caller's memory until it execs (`CLONE_VM | CLONE_VFORK`,
/// on a stack of its own), as `posix_spawn` does: a fork-like clone copied the page tables
/// of the whole node (tens of MiB of heap on a busy one) for every sandbox and unmapped them
/// again at the exec, a fifth of a pool build's CPU (decision 0061). The cloning thread is
/// a fresh one, blocked until the exec; `between` runs on the calling thread.
pub fn launch_sandbox_init<E: From<NsError>>(
    spec: &InitSpec<'_>,
    timeout: std::time::Duration,
    between: impl FnOnce(&InitChild) -> Result<(), E>,
) -> Result<(u32, OwnedFd), E> {
    let deadline = std::time::Instant::now() + timeout;
    // ---- everything the child needs, allocated here, before the clone ----
    let argv: Vec<CString> = spec
        .argv
        .iter()
        .map(|a| cstring(a.as_bytes(), "argv"))
        .collect::<Result<_, _>>()?;
    let envp: Vec<CString> = spec
        .env
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}").as_bytes(), "env"))
        .collect::<Result<_, _>>()?;
    let mut argv_ptrs: Vec<*const c_char> = argv.iter().map(|c| c.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const c_char> = envp.iter().map(|c| c.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let mut devpts = String::from("newinstance,ptmxmode=0666,mode=0620");
    if let Some(gid) = spec.devpts_gid {
        devpts.push_str(&format!(",gid={gid}"));
    }
    let fprogs = spec
        .seccomp
        .iter()
        .map(|p| {
            Ok(libc::sock_fprog {
                len: u16::try_from(p.len()).map_err(|_| NsError::Parent {
                    op: "load the seccomp program",
                    source: io::Error::from_raw_os_error(libc::E2BIG),
                })?,
                // The kernel only reads the program; the cast keeps the layout (repr(C)).
                filter: p.as_ptr() as *mut libc::sock_filter,
            })
        })
        .collect::<Result<Vec<_>, NsError>>()?;

    let (err_r, err_w) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| NsError::Parent {
            op: "create the error pipe",
            source: e.into(),
        })?;
    let (sync_parent, sync_child) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| NsError::Parent {
        op: "create the sync socketpair",
        source: e.into(),
    })?;

    let prepared = Prepared {
        rootfs: cstring(spec.rootfs.as_os_str().as_bytes(), "rootfs path")?,
        daemon_binary: cstring(spec.daemon_binary.as_os_str().as_bytes(), "daemon path")?,
        hostname: cstring(spec.hostname.as_bytes(), "hostname")?,
        devpts_opts: cstring(devpts.as_bytes(), "devpts options")?,
        exec_path: cstring(DAEMON_PATH.as_bytes(), "daemon path")?,
        argv_ptrs,
        envp_ptrs,
        fprogs,
        keep_caps: spec.keep_caps,
        last_cap: last_cap(),
        mount_sysfs: spec.mount_sysfs,
        masked: spec.masked.to_vec(),
        read_only: spec.read_only.iter().map(|p| (*p).to_owned()).collect(),
        own_netns: spec.netns.is_none(),
        open_files: spec.open_files,
        stdin: spec.stdin.as_raw_fd(),
        stdout: spec.stdout.as_raw_fd(),
        channel: spec.channel.as_raw_fd(),
        err_w: err_w.as_raw_fd(),
        err_r: err_r.as_raw_fd(),
        sync_child: sync_child.as_raw_fd(),
        sync_parent: sync_parent.as_raw_fd(),
    };

    // Written by the kernel during the clone, before the child runs: the child's pidfd
    // (CLONE_PIDFD) and pid (CLONE_PARENT_SETTID). The calling thread reads them once the
    // child has said it runs.
    let pidfd_slot = std::sync::atomic::AtomicI32::new(-1);
    let pid_slot = std::sync::atomic::AtomicI32::new(0);
    let into_cgroup = spec.cgroup.map_or(0, |_| CLONE_INTO_CGROUP);
    let stack = ChildStack::new().map_err(parent_err("map the init's stack"))?;
    let args = CloneArgs {
        flags: into_cgroup
            | SHARE_UNTIL_EXEC
            | (libc::CLONE_NEWUSER
                | libc::CLONE_NEWPID
                | libc::CLONE_NEWNS
                | libc::CLONE_NEWUTS
                | libc::CLONE_NEWIPC
                | libc::CLONE_PIDFD
                | libc::CLONE_PARENT_SETTID) as u64
            | if spec.netns.is_some() {
                0
            } else {
                libc::CLONE_NEWNET as u64
            },
        pidfd: pidfd_slot.as_ptr() as u64,
        child_tid: 0,
        parent_tid: pid_slot.as_ptr() as u64,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack.base(),
        stack_size: stack.size(),
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: spec.cgroup.map_or(0, |fd| fd.as_raw_fd() as u64),
    };
    let (mount_ns, netns) = (spec.mount_ns, spec.netns);
    let prepared = &prepared;
    std::thread::scope(|s| {
        // The cloning thread: in the launcher mount namespace and the slot's network
        // namespace for the clone (the child inherits both), blocked in it until the exec
        // where the child shares its memory. It closes its ends of the pipe and socket once
        // the clone returns, so the calling thread sees EOF on them then.
        let cloner = s.spawn(move || {
            let r = clone_init(&args, prepared, mount_ns, netns);
            drop(err_w);
            drop(sync_child);
            r
        });
        let hello = wait_hello(sync_parent.as_fd(), deadline);
        let (pid, pidfd) = (
            pid_slot.load(std::sync::atomic::Ordering::Acquire),
            pidfd_slot.load(std::sync::atomic::Ordering::Acquire),
        );
        if pidfd < 0 {
            // No child yet: the clone failed (its error), or is slow past the deadline (a
            // child it makes yet finds this end closed and leaves quietly).
            drop(sync_parent);
            let cloned = cloner.join();
            let late = pidfd_slot.load(std::sync::atomic::Ordering::Acquire);
            if late >= 0 {
                // Made after all, and gone: reap it.
                // SAFETY: the pidfd the kernel stored for the clone, owned by nobody else.
                let late = unsafe { OwnedFd::from_raw_fd(late) };
                let _ = waitid_pidfd(late.as_fd(), 0);
            }
            return Err(E::from(match (cloned, hello) {
                (Ok(Err(e)), _) => e,
                (_, Err(e)) => parent_err("wait for the sandbox init to start")(e),
                _ => NsError::Parent {
                    op: "clone3 the sandbox init",
                    source: io::Error::other("no child and no error"),
                },
            }));
        }
        let child = InitChild {
            pid,
            // SAFETY: with CLONE_PIDFD the kernel stored a fresh pidfd that nobody else owns.
            pidfd: unsafe { OwnedFd::from_raw_fd(pidfd) },
            sync: sync_parent,
            err: err_r,
        };
        let released = match hello {
            // The child runs and waits for the release.
            Ok(true) => between(&child),
            // It ended before it said so: its error pipe says why (below).
            Ok(false) => Ok(()),
            Err(e) => Err(E::from(parent_err("wait for the sandbox init to start")(e))),
        };
        if let Err(e) = released {
            child.kill_and_reap();
            // Dead and reaped: the clone has returned.
            let _ = cloner.join();
            return Err(e);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        // Exec'd, failed or killed on the deadline: in each case the clone returns.
        let exec = child.wait_exec(left);
        let _ = cloner.join();
        let pidfd = exec.map_err(E::from)?;
        Ok((pid as u32, pidfd))
    })
}

impl InitChild {
    /// Host pid of the init.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// The child's user namespace (`/proc/PID/ns/user`).
    pub fn open_userns(&self) -> Result<OwnedFd, NsError> {
        let path = format!("/proc/{}/ns/user", self.pid);
        std::fs::File::open(path)
            .map(OwnedFd::from)
            .map_err(parent_err("open the sandbox user namespace"))
    }

    /// Map ids 0..count inside to base..base+count outside, for users and groups.
    /// `setgroups` stays "allow": the mapping is written by a privileged parent, and the
    /// child needs setgroups(0, NULL) to drop the host's supplementary groups (and sandboxed
    /// software needs it to switch users).
    pub fn write_id_maps(&self, base: u32, count: u32) -> Result<(), NsError> {
        let line = format!("0 {base} {count}\n");
        for (file, op) in [("uid_map", "write uid_map"), ("gid_map", "write gid_map")] {
            std::fs::write(format!("/proc/{}/{file}", self.pid), &line).map_err(parent_err(op))?;
        }
        Ok(())
    }

    /// Set the init's resource limits (its children inherit them), from the host before the
    /// init runs. Raising a hard limit needs CAP_SYS_RESOURCE in the initial user namespace;
    /// a node without it (some container hosts drop it) clamps each limit to its own hard
    /// limit instead. Returns the limits set.
    pub fn set_rlimits(&self, limits: &[Rlimit]) -> Result<Vec<Rlimit>, NsError> {
        set_rlimits_of(self.pid as u32, limits)
    }

    /// Lower the init's OOM score adjustment, if the node may (CAP_SYS_RESOURCE): the value
    /// is then also the floor the init's descendants inherit; they may raise theirs
    /// (space-daemon raises every child's) and lower it again only down to the floor.
    /// Returns false when the node lacks the privilege, which leaves the node's own value.
    pub fn lower_oom_score_adj(&self, adj: i32) -> Result<bool, NsError> {
        match std::fs::write(format!("/proc/{}/oom_score_adj", self.pid), adj.to_string()) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => Ok(false),
            Err(e) => Err(parent_err("set the sandbox init's OOM score adjustment")(e)),
        }
    }

    /// Hand over the detached rootfs mount; this lets the child proceed.
    pub fn release(&self, rootfs: BorrowedFd<'_>) -> Result<(), NsError> {
        send_fd(self.sync.as_raw_fd(), rootfs.as_raw_fd())
            .map_err(parent_err("hand the rootfs mount to the sandbox init"))
    }

    /// Wait until the child has exec'd (the CLOEXEC error pipe hits EOF) or reported a
    /// failure. On success returns the pidfd of the running init.
    pub fn wait_exec(self, timeout: std::time::Duration) -> Result<OwnedFd, NsError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut buf = [0u8; 8];
        let mut got = 0;
        while got < buf.len() {
            // Bounded: a child stuck before exec (it never should be) must not hang a create.
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.err.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd on the stack; the count matches.
            let r =
                unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
            if r == 0 {
                return self.fail(
                    "wait for the sandbox init to exec (timed out)",
                    io::Error::from(io::ErrorKind::TimedOut),
                );
            }
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return self.fail("poll the init error pipe", e);
            }
            // SAFETY: reads into the live stack buffer within its bounds.
            let n = unsafe {
                libc::read(
                    self.err.as_raw_fd(),
                    buf[got..].as_mut_ptr().cast(),
                    buf.len() - got,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return self.fail("read the init error pipe", e);
            }
            if n == 0 {
                break;
            }
            got += n as usize;
        }
        if got == buf.len() {
            let step = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
            let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
            self.kill_and_reap();
            return Err(NsError::Child {
                step: InitStep::from_u32(step).unwrap_or(InitStep::Exec),
                source: io::Error::from_raw_os_error(errno),
            });
        }
        // EOF: exec'd, unless the child was killed before it (it never exits without a word
        // before its exec). A program that exec'd and already exited is the caller's to reap
        // (its liveness says so), as is one killed just after its exec: the same death.
        match waitid_full(self.pidfd.as_fd(), libc::WNOHANG | libc::WNOWAIT) {
            Ok(Some((code, status))) if code != libc::CLD_EXITED => {
                self.kill_and_reap();
                Err(NsError::Died(status))
            }
            _ => Ok(self.pidfd),
        }
    }

    /// The parent's failure at `op`: the child is killed and reaped first.
    fn fail<T>(&self, op: &'static str, source: io::Error) -> Result<T, NsError> {
        self.kill_and_reap();
        Err(NsError::Parent { op, source })
    }

    /// SIGKILL the child and reap it (used on every failure path).
    pub fn kill_and_reap(&self) {
        let _ = pidfd_send_signal(self.pidfd.as_fd(), libc::SIGKILL);
        let _ = waitid_pidfd(self.pidfd.as_fd(), 0);
    }
}

/// `pidfd_send_signal(pidfd, sig, NULL, 0)`.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, sig: c_int) -> io::Result<()> {
    // SAFETY: plain integer arguments and a NULL siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `waitid(P_PIDFD, pidfd, WEXITED | extra)`. Returns the raw wait status (exit code or
/// signal in `si_status`) when a child exited, `None` under `WNOHANG` when it still runs.
pub fn waitid_pidfd(pidfd: BorrowedFd<'_>, extra: c_int) -> io::Result<Option<i32>> {
    Ok(waitid_full(pidfd, extra)?.map(|(_, status)| status))
}

/// [`waitid_pidfd`] with how the child ended: `(si_code, si_status)`, the code one of
/// `CLD_EXITED`, `CLD_KILLED` or `CLD_DUMPED`.
fn waitid_full(pidfd: BorrowedFd<'_>, extra: c_int) -> io::Result<Option<(i32, i32)>> {
    waitid(libc::P_PIDFD, pidfd.as_raw_fd() as libc::id_t, extra)
}

/// `waitid(idtype, id, WEXITED | extra)`, retried on `EINTR`: `(si_code, si_status)` of a
/// child that exited, `None` under `WNOHANG` when none has.
pub(crate) fn waitid(
    idtype: libc::idtype_t,
    id: libc::id_t,
    extra: c_int,
) -> io::Result<Option<(i32, i32)>> {
    loop {
        // SAFETY: siginfo_t is plain data, zeroed so si_pid reads 0 when nothing was waited.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a live, writable siginfo_t.
        let r = unsafe { libc::waitid(idtype, id, &mut info, libc::WEXITED | extra) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: waitid filled `info` (or left it zeroed); reading the union fields of a
        // SIGCHLD siginfo is what the accessors are for.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        return Ok(if pid == 0 {
            None
        } else {
            Some((info.si_code, status))
        });
    }
}

/// `pidfd_open(pid, 0)`.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: a fresh fd returned by the kernel, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
    }
}

#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

fn send_fd(sock: RawFd, fd: RawFd) -> io::Result<()> {
    let mut byte = [1u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: msghdr is plain data; every pointer set below refers to a live local buffer of
    // the stated length; the CMSG_* helpers compute offsets inside `cbuf`, which is large
    // enough and 8-byte aligned for one SCM_RIGHTS message with a single fd.
    let r = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<c_int>(), fd);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Receive one byte and, with it, one fd. `Ok(None)` on EOF (the parent gave up).
fn recv_fd(sock: RawFd) -> io::Result<Option<RawFd>> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = CmsgBuf([0; 64]);
    loop {
        // SAFETY: as in `send_fd`: all pointers refer to live local buffers of the stated
        // sizes; CMSG_FIRSTHDR returns NULL or a header inside `cbuf`, checked before use.
        let (r, fd) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.0.as_mut_ptr().cast();
            msg.msg_controllen = cbuf.0.len() as _;
            let r = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            let mut fd = -1;
            if r > 0 {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                if !cmsg.is_null()
                    && (*cmsg).cmsg_level == libc::SOL_SOCKET
                    && (*cmsg).cmsg_type == libc::SCM_RIGHTS
                {
                    fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<c_int>());
                }
            }
            (r, fd)
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Ok(None);
        }
        if fd < 0 {
            return Err(io::Error::from_raw_os_error(libc::EPROTO));
        }
        return Ok(Some(fd));
    }
}

// ---- the child: raw syscalls only, no allocation, no locks --------------------------------

fn errno() -> io::Error {
    io::Error::last_os_error()
}

fn check(r: c_int) -> io::Result<c_int> {
    if r == -1 { Err(errno()) } else { Ok(r) }
}

fn checkl(r: libc::c_long) -> io::Result<libc::c_long> {
    if r == -1 { Err(errno()) } else { Ok(r) }
}

fn child_main(p: &Prepared) -> ! {
    let mut err_fd = p.err_w;
    let (step, e) = match child_setup(p, &mut err_fd) {
        Ok(never) => match never {},
        Err(f) => f,
    };
    if let Some(code) = e.raw_os_error() {
        let mut buf = [0u8; 8];
        buf[..4].copy_from_slice(&(step as u32).to_ne_bytes());
        buf[4..].copy_from_slice(&code.to_ne_bytes());
        // SAFETY: writes 8 bytes from a live stack buffer to the error pipe (atomic: < PIPE_BUF).
        unsafe { libc::write(err_fd, buf.as_ptr().cast(), buf.len()) };
    }
    // SAFETY: _exit never returns and runs no atexit handlers (none may run in this child).
    unsafe { libc::_exit(127) }
}

type StepResult<T> = Result<T, (InitStep, io::Error)>;

trait At<T> {
    fn at(self, step: InitStep) -> StepResult<T>;
}

impl<T> At<T> for io::Result<T> {
    fn at(self, step: InitStep) -> StepResult<T> {
        self.map_err(|e| (step, e))
    }
}

fn mkdir_p(path: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated and only read.
    if unsafe { libc::mkdir(path.as_ptr(), mode) } == -1 {
        let e = errno();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    Ok(())
}

fn touch(path: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated; the returned fd is closed right away.
    let fd = check(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            mode as libc::c_uint,
        )
    })?;
    raw_close(fd);
    Ok(())
}

/// `struct ifreq` reduced to what SIOCSIFFLAGS reads (name + flags), padded to full size.
#[repr(C)]
struct IfreqFlags {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn loopback_up() -> io::Result<()> {
    // SAFETY: plain integer arguments; the fd is closed below.
    let s =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    let mut ifr = IfreqFlags {
        name: [0; 16],
        flags: libc::IFF_UP as libc::c_short,
        _pad: [0; 22],
    };
    ifr.name[..2].copy_from_slice(b"lo");
    // SAFETY: `ifr` is a live struct with the layout of `struct ifreq` (40 bytes).
    let r = check(unsafe { libc::ioctl(s, libc::SIOCSIFFLAGS, &mut ifr as *mut IfreqFlags) });
    raw_close(s);
    r.map(drop)
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Where the masks' empty directory is made, in /dev's tmpfs, and removed once bound.
const MASK_SOURCE: &CStr = c"/dev/.space-mask";

/// Covers a path (resolved inside the sandbox root): a file with /dev/null, a directory with
/// an empty read-only directory. The first directory masked gets a read-only bind of an empty
/// directory of /dev's tmpfs ([`MASK_SOURCE`]; no superblock of its own); later ones are
/// bound from it (`empty_dir`), read-only as it is. A missing path is fine.
fn mask_path(m: &MaskedPath, empty_dir: &mut Option<&'static CStr>) -> io::Result<()> {
    let r = match (m.dir, *empty_dir) {
        (false, _) => raw_mount(c"/dev/null", m.path, None, libc::MS_BIND, None),
        (true, Some(dir)) => raw_mount(dir, m.path, None, libc::MS_BIND, None),
        (true, None) => mkdir_p(MASK_SOURCE, 0o555)
            .and_then(|()| raw_mount(MASK_SOURCE, m.path, None, libc::MS_BIND, None))
            .and_then(|()| remount_read_only(m.path))
            .map(|()| *empty_dir = Some(m.path)),
    };
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// Binds `path` onto itself and makes that bind read-only. A missing path is fine.
fn read_only_path(path: &CStr) -> io::Result<()> {
    match raw_mount(path, path, None, libc::MS_BIND | libc::MS_REC, None) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        other => other?,
    }
    remount_read_only(path)
}

/// Makes the bind mount at `path` read-only (and nosuid, nodev, noexec).
fn remount_read_only(path: &CStr) -> io::Result<()> {
    raw_mount(
        path,
        path,
        None,
        libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC,
        None,
    )
}

fn child_setup(p: &Prepared, err_fd: &mut RawFd) -> StepResult<std::convert::Infallible> {
    use InitStep::*;

    // Say that we run: the parent then reads our pid and pidfd (stored by clone3 before we
    // started) and does its half of the handshake. Nothing more to do if it is gone.
    let hello = 1u8;
    // SAFETY: writes one byte from a live stack byte to the sync socket.
    unsafe { libc::write(p.sync_child, (&hello as *const u8).cast(), 1) };

    // Signals: default dispositions, then unblock (the parent blocked all around clone3).
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installs SIG_DFL; the zeroed sigaction is a valid "default, no flags".
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    // SAFETY: an empty set on the stack, passed by pointer to rt_sigprocmask.
    check(unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut())
    })
    .at(Signals)?;

    // Our copies of the parent's ends must go, or EOF would never arrive.
    raw_close(p.sync_parent);
    raw_close(p.err_r);

    let rootfs_fd = match recv_fd(p.sync_child).at(WaitParent)? {
        Some(fd) => fd,
        // The parent gave up: leave quietly.
        // SAFETY: _exit never returns.
        None => unsafe { libc::_exit(0) },
    };

    // SAFETY: no arguments.
    check(unsafe { libc::setsid() }).at(Setsid)?;
    // We are in our cgroups now (the parent placed us before releasing): make them our root.
    // SAFETY: plain integer argument.
    check(unsafe { libc::unshare(libc::CLONE_NEWCGROUP) }).at(CgroupNs)?;
    let host = p.hostname.as_bytes();
    // SAFETY: pointer and length of the live hostname buffer.
    check(unsafe { libc::sethostname(host.as_ptr().cast(), host.len()) }).at(Hostname)?;
    if p.own_netns {
        loopback_up().at(Loopback)?;
    }

    raw_mount(c"none", c"/", None, libc::MS_REC | libc::MS_PRIVATE, None).at(MountPrivate)?;

    // Detached mounts that must be made while the host root is still visible: the device
    // nodes and daemon binary (host paths), and proc (the kernel only lets a user namespace
    // mount proc while a fully visible proc is in its mount namespace).
    let mut dev_fds = [-1; DEV_NODES.len()];
    for (i, node) in DEV_NODES.iter().enumerate() {
        dev_fds[i] = raw_open_tree(libc::AT_FDCWD, node, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
            .at(CloneDevices)?;
    }
    let daemon_fd = raw_open_tree(
        libc::AT_FDCWD,
        &p.daemon_binary,
        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
    )
    .at(CloneDaemon)?;
    raw_mount_setattr(
        daemon_fd,
        c"",
        libc::AT_EMPTY_PATH as u32,
        &MountAttr {
            attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            ..MountAttr::default()
        },
    )
    .at(CloneDaemon)?;
    let proc_fd = raw_fsmount(
        c"proc",
        MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
    )
    .at(MountProc)?;
    let sys_fd = if p.mount_sysfs {
        raw_fsmount(
            c"sysfs",
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        )
        .unwrap_or(-1)
    } else {
        -1
    };

    // The idmapped rootfs: attach, enter (through the mount fd, which now names the attached
    // mount's root: no second path walk), pivot, drop the host.
    raw_move_mount(rootfs_fd, &p.rootfs).at(AttachRootfs)?;
    // SAFETY: `rootfs_fd` is a live fd (the mount's root directory).
    check(unsafe { libc::fchdir(rootfs_fd) }).at(PivotRoot)?;
    raw_pivot_root_dot().at(PivotRoot)?;
    raw_umount_detach(c".").at(DetachOldRoot)?;
    // SAFETY: static NUL-terminated path.
    check(unsafe { libc::chdir(c"/".as_ptr()) }).at(DetachOldRoot)?;

    // Only now become root of the user namespace. Every host path above was walked with the
    // host fsuid 0 (still ours until here), so node directories of mode 0700 are no obstacle;
    // from here on files are created inside the sandbox as its root (0 on disk).
    // Raw syscalls, not the libc wrappers: glibc's setres[ug]id/setgroups broadcast the change
    // to every thread it believes exists (SIGSETXID) and wait for them; this child inherited
    // the multithreaded parent's thread list without its threads and would wait forever.
    // SAFETY: plain integer arguments / a NULL list of length 0.
    unsafe {
        checkl(libc::syscall(libc::SYS_setresgid, 0, 0, 0)).at(SetIds)?;
        checkl(libc::syscall(
            libc::SYS_setgroups,
            0,
            std::ptr::null::<libc::gid_t>(),
        ))
        .at(SetIds)?;
        checkl(libc::syscall(libc::SYS_setresuid, 0, 0, 0)).at(SetIds)?;
    }

    // From here every path resolves inside the sandbox root, so symlinks planted in the
    // rootfs cannot point anywhere else.
    mkdir_p(c"/proc", 0o555).at(AttachProc)?;
    raw_move_mount(proc_fd, c"/proc").at(AttachProc)?;
    // Best effort: /sys is optional (a user namespace may mount sysfs only over a network
    // namespace it owns).
    let have_sys =
        sys_fd >= 0 && mkdir_p(c"/sys", 0o555).is_ok() && raw_move_mount(sys_fd, c"/sys").is_ok();

    // One tmpfs holds /dev, /dev/shm and /tmp (and lends the masks their empty directory):
    // every superblock a sandbox mounts is a memcg-aware shrinker, and each memory cgroup on
    // the host keeps a slot for every shrinker there is, so a superblock per sandbox costs
    // memory that grows with the square of the sandboxes on the node (decisions 0060, 0063).
    // It is mounted at /dev just long enough to make its `dev` and `tmp` directories and
    // clone a mount of each; then /dev shows `dev` and /tmp shows `tmp`, and its root is
    // mounted nowhere, so neither directory shows inside the other. Its size is the default,
    // half of RAM, charged to the sandbox's memory cgroup like any tmpfs page.
    mkdir_p(c"/dev", 0o755).at(MountDev)?;
    raw_mount(
        c"tmpfs",
        c"/dev",
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(c"mode=755"),
    )
    .at(MountDev)?;
    mkdir_p(c"/dev/dev", 0o755).at(MountDev)?;
    let dev_tree = raw_open_tree(
        libc::AT_FDCWD,
        c"/dev/dev",
        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
    )
    .at(MountDev)?;
    mkdir_p(c"/dev/tmp", 0o1777).at(MountTmp)?;
    // SAFETY: NUL-terminated and only read. (mkdir's mode passes through the umask.)
    check(unsafe { libc::chmod(c"/dev/tmp".as_ptr(), 0o1777) }).at(MountTmp)?;
    let tmp_tree = raw_open_tree(
        libc::AT_FDCWD,
        c"/dev/tmp",
        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
    )
    .at(MountTmp)?;
    // /tmp runs programs (builds run scripts there); /dev does not.
    raw_mount_setattr(
        tmp_tree,
        c"",
        libc::AT_EMPTY_PATH as u32,
        &MountAttr {
            attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            attr_clr: MOUNT_ATTR_NOEXEC,
            ..MountAttr::default()
        },
    )
    .at(MountTmp)?;
    raw_umount_detach(c"/dev").at(MountDev)?;
    raw_move_mount(dev_tree, c"/dev").at(MountDev)?;
    for (i, node) in DEV_NODES.iter().enumerate() {
        touch(node, 0o666).at(BindDevices)?;
        raw_move_mount(dev_fds[i], node).at(BindDevices)?;
    }
    mkdir_p(c"/dev/pts", 0o755).at(MountDevpts)?;
    raw_mount(
        c"devpts",
        c"/dev/pts",
        Some(c"devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&p.devpts_opts),
    )
    .at(MountDevpts)?;
    for (target, link) in DEV_SYMLINKS {
        // SAFETY: both NUL-terminated and only read.
        check(unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) }).at(DevSymlinks)?;
    }
    // A directory of /dev's tmpfs: nosuid and noexec, as Docker mounts it.
    mkdir_p(c"/dev/shm", 0o1777).at(MountShm)?;
    // SAFETY: NUL-terminated and only read. (mkdir's mode passes through the umask.)
    check(unsafe { libc::chmod(c"/dev/shm".as_ptr(), 0o1777) }).at(MountShm)?;
    mkdir_p(c"/tmp", 0o1777).at(MountTmp)?;
    raw_move_mount(tmp_tree, c"/tmp").at(MountTmp)?;

    let mut empty_dir = None;
    for m in &p.masked {
        if !have_sys && m.path.to_bytes().starts_with(b"/sys/") {
            continue;
        }
        mask_path(m, &mut empty_dir).at(MaskPaths)?;
    }
    // The masks keep the directory they show; its name goes, so nothing is ever put in it
    // (a removed directory takes no new entries).
    // SAFETY: NUL-terminated and only read.
    if unsafe { libc::rmdir(MASK_SOURCE.as_ptr()) } == -1 {
        let e = errno();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(e).at(MaskPaths);
        }
    }
    for path in &p.read_only {
        read_only_path(path).at(ReadOnlyPaths)?;
    }

    mkdir_p(c"/.space", 0o755).at(BindDaemon)?;
    touch(&p.exec_path, 0o755).at(BindDaemon)?;
    raw_move_mount(daemon_fd, &p.exec_path).at(BindDaemon)?;

    // fds: 0 = stdin, 1/2 = log, 3 = channel, 4 = error pipe (CLOEXEC); nothing else.
    // Move the sources out of the way first so no dup2 clobbers a source still needed.
    // SAFETY: fcntl/dup2/dup3/close_range on fds this process holds; integer arguments only.
    unsafe {
        let hi = |fd: RawFd| check(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10));
        let stdin = hi(p.stdin).at(Fds)?;
        let stdout = hi(p.stdout).at(Fds)?;
        let chan = hi(p.channel).at(Fds)?;
        let err = hi(*err_fd).at(Fds)?;
        check(libc::dup2(stdin, 0)).at(Fds)?;
        check(libc::dup2(stdout, 1)).at(Fds)?;
        check(libc::dup2(stdout, 2)).at(Fds)?;
        check(libc::dup2(chan, CHANNEL_FD)).at(Fds)?;
        check(libc::dup3(err, 4, libc::O_CLOEXEC)).at(Fds)?;
        *err_fd = 4;
        checkl(libc::syscall(libc::SYS_close_range, 5u32, u32::MAX, 0u32)).at(Fds)?;
    }
    // Only now, holding five fds, may the open-files limit go below what the caller held.
    if let Some(want) = p.open_files {
        let have = getrlimit(libc::RLIMIT_NOFILE).at(OpenFiles)?;
        let hard = want.hard.min(have.hard);
        let set = Rlimit {
            soft: want.soft.min(hard),
            hard,
            ..want
        };
        prlimit(0, &set).at(OpenFiles)?;
    }

    // The seccomp filter first, while this process still holds every capability of its user
    // namespace: without no_new_privs (below) installing a filter needs CAP_SYS_ADMIN there.
    // The filter allows what follows (prctl, capset, execve).
    for prog in &p.fprogs {
        // SAFETY: `prog` points to a live sock_fprog whose filter array (owned by the spec,
        // borrowed for the whole spawn) has `len` instructions; the kernel copies it.
        checkl(unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                prog as *const libc::sock_fprog,
            )
        })
        .at(Seccomp)?;
    }

    // Capabilities: bounding set first (needs CAP_SETPCAP), then the process sets.
    for cap in 0..=p.last_cap {
        if cap < 64 && p.keep_caps & (1u64 << cap) != 0 {
            continue;
        }
        // SAFETY: integer arguments.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r == -1 {
            let e = errno();
            // Caps beyond what this kernel knows are fine to skip.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err((CapBounding, e));
            }
        }
    }
    let lo = p.keep_caps as u32;
    let hi = (p.keep_caps >> 32) as u32;
    let mut data = [
        CapData {
            effective: lo,
            permitted: lo,
            inheritable: lo,
        },
        CapData {
            effective: hi,
            permitted: hi,
            inheritable: hi,
        },
    ];
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: header and a two-element data array, both live, as capset(2) v3 expects.
    checkl(unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_mut_ptr()) }).at(CapSet)?;
    // No no_new_privs (decision 0021): set-uid programs inside (sudo) may become the sandbox's
    // root, whose capabilities are the bounding set just dropped to, in a user namespace whose
    // root is an unprivileged uid on the host. The seccomp filter, already installed, stays
    // on across every exec.
    for cap in 0..=p.last_cap.min(63) {
        if p.keep_caps & (1u64 << cap) == 0 {
            continue;
        }
        // SAFETY: integer arguments.
        check(unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                cap as libc::c_ulong,
                0,
                0,
            )
        })
        .at(Ambient)?;
    }

    // SAFETY: path, argv and envp are NUL-terminated strings / NULL-terminated pointer arrays
    // prepared before the clone and alive until the exec (shared or copied memory).
    unsafe {
        libc::execve(
            p.exec_path.as_ptr(),
            p.argv_ptrs.as_ptr(),
            p.envp_ptrs.as_ptr(),
        )
    };
    Err((Exec, errno()))
}

/// Set the resource limits of process `pid` (a sandbox's init) from the host; see
/// [`InitChild::set_rlimits`] for the clamping. Returns the limits set.
pub fn set_rlimits_of(pid: u32, limits: &[Rlimit]) -> Result<Vec<Rlimit>, NsError> {
    let pid = pid as libc::pid_t;
    let mut set = Vec::with_capacity(limits.len());
    for l in limits {
        let l = match prlimit(pid, l) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                let own = getrlimit(l.resource)
                    .map_err(parent_err("read the node's own resource limits"))?;
                let hard = l.hard.min(own.hard);
                let clamped = Rlimit {
                    soft: l.soft.min(hard),
                    hard,
                    ..*l
                };
                prlimit(pid, &clamped).map_err(parent_err("set the sandbox's resource limits"))?;
                clamped
            }
            other => {
                other.map_err(parent_err("set the sandbox's resource limits"))?;
                *l
            }
        };
        set.push(l);
    }
    Ok(set)
}

/// Sets the hostname of the UTS namespace of process `pid` (a sandbox's init) from the host:
/// a fresh thread enters that namespace and calls sethostname, so the caller's thread keeps
/// its own. Needs CAP_SYS_ADMIN over the namespace's user namespace (the host's root has it
/// over every sandbox's); the sandbox itself does not need any capability for it.
pub fn set_hostname_of(pid: u32, hostname: &str) -> io::Result<()> {
    if hostname.is_empty() || hostname.len() > 64 || hostname.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "hostname must be 1-64 bytes without NUL",
        ));
    }
    let uts = std::fs::File::open(format!("/proc/{pid}/ns/uts"))?;
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<()> {
            // SAFETY: plain integer arguments; `uts` is a live fd for the duration of the call.
            // Only this short-lived thread changes namespace.
            if unsafe { libc::setns(uts.as_raw_fd(), libc::CLONE_NEWUTS) } == -1 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: the pointer and length describe `hostname`'s live bytes.
            if unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) } == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("hostname thread panicked")))
    })
}
