//! Process-level syscalls for space-daemon and space-probe.
//!
//! - Child-side spawn hooks (`pre_exec` closures) as safe functions over `std::process::Command`:
//!   a new session with an optional controlling terminal, and a credential switch.
//! - Taking ownership of an inherited file descriptor (the daemon's channel socket).
//! - Bringing up the loopback interface, sending signals; whether an own child has exited
//!   without reaping it (spaced's liveness check of the inits it launched).
//! - Harmless "is this denied?" probes used by space-probe. Each probe returns `Ok(())` when
//!   the kernel let the call through (isolation broken) and the OS error otherwise. Every
//!   probe is built so that a successful call has no lasting effect (invalid magic numbers,
//!   immediate detach, etc.); see each function.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Mutex;

/// Converts a `-1` return of a libc call into the current OS error.
fn cvt(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Make the child a session leader (hence also a process-group leader: pgid == pid, so the
/// whole tree can be signalled with `kill(-pid)`). When `controlling_tty` is true, the
/// child's stdin (fd 0, which must be a terminal, e.g. a pty slave set with `Command::stdin`)
/// becomes its controlling terminal (TIOCSCTTY).
pub fn set_session(cmd: &mut Command, controlling_tty: bool) {
    // SAFETY: the closure runs in the forked child before exec. It only calls setsid(2) and
    // ioctl(2), which are async-signal-safe; it allocates nothing, takes no locks and
    // `io::Error::last_os_error()` builds an error without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            if controlling_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Switch the child to `uid`/`gid` with exactly the supplementary `groups`, in the only safe
/// order: setgroups, setgid, setuid. Register this after any hook that needs privileges.
pub fn set_credentials(cmd: &mut Command, uid: u32, gid: u32, groups: Vec<u32>) {
    let groups: Vec<libc::gid_t> = groups;
    // SAFETY: the closure runs in the forked child before exec. setgroups/setgid/setuid are
    // async-signal-safe in the single-threaded child (std's own `Command::uid` makes the same
    // calls there). `groups` was allocated before fork and is only read; nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) == -1 {
                return Err(io::Error::last_os_error());
            }
            if libc::setgid(gid) == -1 {
                return Err(io::Error::last_os_error());
            }
            if libc::setuid(uid) == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A resource limit (`setrlimit(2)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rlimit {
    /// `libc::RLIMIT_*`.
    pub resource: libc::__rlimit_resource_t,
    pub soft: u64,
    pub hard: u64,
}

/// What every sandbox starts with unless its create says otherwise (decision 0041): 1,024
/// open files (raisable to 524,288 without privilege, as systemd sets it), no core dumps,
/// and 8 MiB of locked memory.
pub const DEFAULT_RLIMITS: [Rlimit; 3] = [
    Rlimit {
        resource: libc::RLIMIT_NOFILE,
        soft: 1024,
        hard: 524_288,
    },
    Rlimit {
        resource: libc::RLIMIT_CORE,
        soft: 0,
        hard: 0,
    },
    Rlimit {
        resource: libc::RLIMIT_MEMLOCK,
        soft: 8 << 20,
        hard: 8 << 20,
    },
];

/// space-daemon's OOM score adjustment where the node may lower it (decision 0041). Not
/// -1000 (never killed): a sandbox whose only process left is the daemon must still be able
/// to free its memory.
pub const DAEMON_OOM_SCORE_ADJ: i32 = -998;

/// What space-daemon raises every process it starts to: the kernel, short of memory in a
/// sandbox, picks one of them before the daemon even where the daemon could not be lowered.
pub const CHILD_OOM_SCORE_ADJ: i32 = 500;

/// Apply `limits` to this process (the microvm guest's init, which is root of its own kernel
/// and may raise hard limits).
pub fn set_own_rlimits(limits: &[Rlimit]) -> io::Result<()> {
    limits.iter().try_for_each(|l| prlimit(0, l))
}

/// Set one resource limit of process `pid` (0: this one).
pub(crate) fn prlimit(pid: libc::pid_t, l: &Rlimit) -> io::Result<()> {
    let new = libc::rlimit64 {
        rlim_cur: l.soft,
        rlim_max: l.hard,
    };
    // SAFETY: `new` is a live rlimit64; the old-value pointer is NULL (not wanted).
    let r = unsafe { libc::prlimit64(pid, l.resource, &new, std::ptr::null_mut()) };
    cvt(r as libc::c_long).map(drop)
}

/// This process's limit of `resource`.
pub fn getrlimit(resource: libc::__rlimit_resource_t) -> io::Result<Rlimit> {
    let mut old = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a live rlimit64 the kernel fills; no new value is passed.
    let r = unsafe { libc::prlimit64(0, resource, std::ptr::null(), &mut old) };
    cvt(r as libc::c_long)?;
    Ok(Rlimit {
        resource,
        soft: old.rlim_cur,
        hard: old.rlim_max,
    })
}

/// Give the child an OOM score adjustment of [`CHILD_OOM_SCORE_ADJ`], whatever the caller's.
/// Raising one's own value needs no privilege. Best effort: without /proc the child keeps
/// the caller's value.
pub fn raise_oom_score_adj(cmd: &mut Command) {
    const VALUE: &[u8] = b"500";
    const _: () = assert!(
        CHILD_OOM_SCORE_ADJ == 500,
        "VALUE spells CHILD_OOM_SCORE_ADJ"
    );
    // SAFETY: the closure runs in the forked child before exec; open/write/close of a static
    // path and buffer are async-signal-safe and nothing allocates.
    unsafe {
        cmd.pre_exec(|| {
            let fd = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if fd >= 0 {
                libc::write(fd, VALUE.as_ptr().cast(), VALUE.len());
                libc::close(fd);
            }
            Ok(())
        });
    }
}

/// Fds already taken by [`take_inherited_fd`], so no fd gets two owners.
static TAKEN_FDS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());

/// Take ownership of a file descriptor inherited from the parent across exec (e.g. fd 3 named
/// by `SPACE_CHANNEL_FD`), and mark it close-on-exec so children never inherit it.
///
/// Refuses stdio (0..=2), fds that are not open, and fds taken before.
pub fn take_inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 3 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("refusing to take stdio fd {fd}"),
        ));
    }
    let mut taken = TAKEN_FDS.lock().unwrap_or_else(|e| e.into_inner());
    if taken.contains(&fd) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fd {fd} was already taken"),
        ));
    }
    // SAFETY: fcntl(F_GETFD) on any integer is harmless; it only reports whether it is open.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) } as libc::c_long)?;
    let flags = flags as libc::c_int | libc::FD_CLOEXEC;
    // SAFETY: as above; sets FD_CLOEXEC on an fd we just checked is open.
    let ret = unsafe { libc::fcntl(fd, libc::F_SETFD, flags) };
    cvt(ret as libc::c_long)?;
    taken.push(fd);
    // SAFETY: the fd is open (checked above) and was inherited across exec, so nothing in this
    // process owns it yet (std and tokio never adopt fds above 2 on their own); TAKEN_FDS
    // makes sure this function hands it out only once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Bring the loopback interface `lo` up in the current network namespace.
/// Returns `Ok(true)` if it was down and is now up, `Ok(false)` if it was already up.
pub fn set_loopback_up() -> io::Result<bool> {
    crate::netif::set_up("lo")
}

/// Send signal `sig` (0..=64; 0 only checks existence) to process `pid`, or to its whole
/// process group when `group` is true.
pub fn send_signal(pid: i32, sig: i32, group: bool) -> io::Result<()> {
    if pid <= 0 || !(0..=64).contains(&sig) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let target = if group { -pid } else { pid };
    // SAFETY: kill(2) takes plain integers; `target` names one process or one process group
    // (never 0 or -1, which would broadcast), and `sig` is a valid signal number.
    cvt(unsafe { libc::kill(target, sig) } as libc::c_long)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Probes for space-probe. `Ok(())` means the kernel allowed the call.
// ---------------------------------------------------------------------------------------

/// init_module(NULL, 0, ""): the capability check comes first; with the capability the empty
/// image fails with ENOEXEC, so nothing is ever loaded.
pub fn probe_init_module() -> io::Result<()> {
    // SAFETY: a null image with length 0 is never dereferenced; the params string is a valid
    // NUL-terminated static.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_init_module,
            std::ptr::null::<u8>(),
            0usize,
            c"".as_ptr(),
        )
    })?;
    Ok(())
}

/// finit_module(-1, "", 0): EPERM when denied; EBADF means the capability check passed.
pub fn probe_finit_module() -> io::Result<()> {
    // SAFETY: fd -1 is invalid by construction; the params string is a valid static.
    cvt(unsafe { libc::syscall(libc::SYS_finit_module, -1, c"".as_ptr(), 0) })?;
    Ok(())
}

/// bpf(BPF_MAP_CREATE) of a one-entry array map. A created map fd is closed at once.
pub fn probe_bpf() -> io::Result<()> {
    // union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries (u32s).
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&2u32.to_ne_bytes()); // BPF_MAP_TYPE_ARRAY
    attr[4..8].copy_from_slice(&4u32.to_ne_bytes());
    attr[8..12].copy_from_slice(&4u32.to_ne_bytes());
    attr[12..16].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: `attr` is a valid, initialized buffer of the size passed; the kernel only reads it.
    let fd = cvt(unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0, /* BPF_MAP_CREATE */
            attr.as_ptr(),
            attr.len(),
        )
    })?;
    // SAFETY: bpf(2) returned a new fd that nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    Ok(())
}

/// perf_event_open of a software CPU-clock counter on the calling thread (user space only,
/// created disabled). A returned fd is closed at once.
pub fn probe_perf_event_open() -> io::Result<()> {
    // struct perf_event_attr, PERF_ATTR_SIZE_VER5 = 112 bytes = 14 u64 words.
    let mut attr = [0u64; 14];
    attr[0] = 1 /* PERF_TYPE_SOFTWARE */ | (112u64 << 32); // type | size << 32
    attr[1] = 0; // PERF_COUNT_SW_CPU_CLOCK
    attr[5] = 1 | (1 << 5) | (1 << 6); // disabled | exclude_kernel | exclude_hv
    // SAFETY: `attr` is a valid perf_event_attr of the size it declares; the kernel only reads
    // it. pid 0 = self, cpu -1 = any, group_fd -1, PERF_FLAG_FD_CLOEXEC.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), 0, -1, -1, 8) })?;
    // SAFETY: perf_event_open returned a new fd that nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    Ok(())
}

/// keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0): read-only.
pub fn probe_keyctl() -> io::Result<()> {
    // SAFETY: integer arguments only; the operation reads a keyring id and changes nothing.
    cvt(unsafe { libc::syscall(libc::SYS_keyctl, 0, -3, 0) })?;
    Ok(())
}

/// ptrace(PTRACE_SEIZE, pid) (does not stop the tracee), then PTRACE_DETACH at once.
pub fn probe_ptrace_seize(pid: i32) -> io::Result<()> {
    // SAFETY: integer arguments only; SEIZE does not stop the target.
    cvt(unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_SEIZE, pid, 0, 0) })?;
    // SAFETY: detach from the tracee we just seized; integer arguments only. Detaching a
    // seized, running tracee may report ESRCH; there is nothing else to undo.
    let _ = unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_DETACH, pid, 0, 0) };
    Ok(())
}

/// unshare(CLONE_NEWUSER). On success the calling process is in a new user namespace, so call
/// this last (or in a child). Fails with EINVAL in a multi-threaded process.
pub fn probe_unshare_userns() -> io::Result<()> {
    // SAFETY: CLONE_NEWUSER only changes the caller's credentials/namespace; it does not
    // affect memory or file descriptors.
    cvt(unsafe { libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER) })?;
    Ok(())
}

/// reboot(MAGIC1, <invalid magic2>, CAD_OFF): the kernel checks CAP_SYS_BOOT before the magic
/// numbers, so EPERM = denied and EINVAL = the capability check passed. Never reboots.
pub fn probe_reboot() -> io::Result<()> {
    // SAFETY: integer arguments and a null arg pointer, which CAD_OFF never reads.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_reboot,
            libc::LINUX_REBOOT_MAGIC1,
            0x1234_5678, // not a valid magic2
            libc::LINUX_REBOOT_CMD_CAD_OFF,
            std::ptr::null::<u8>(),
        )
    })?;
    Ok(())
}

/// kexec_load(0, huge, NULL, 0): the permission check comes first; with it, the segment count
/// is rejected with EINVAL. Never loads anything.
pub fn probe_kexec_load() -> io::Result<()> {
    // SAFETY: the null segment pointer is never read because the count is rejected first.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_kexec_load,
            0usize,
            usize::MAX,
            std::ptr::null::<u8>(),
            0usize,
        )
    })?;
    Ok(())
}

/// iopl(3); on success drops back to iopl(0) at once.
pub fn probe_iopl() -> io::Result<()> {
    // SAFETY: iopl takes an integer; raising the I/O privilege level has no memory effect.
    cvt(unsafe { libc::iopl(3) } as libc::c_long)?;
    // SAFETY: as above; restore the default level.
    let _ = unsafe { libc::iopl(0) };
    Ok(())
}

/// clock_settime(CLOCK_REALTIME, now): sets the clock to the value just read (a sub-microsecond
/// step if it ever succeeds).
pub fn probe_clock_settime() -> io::Result<()> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, exclusively borrowed timespec.
    cvt(unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) } as libc::c_long)?;
    // SAFETY: `ts` is a valid timespec read just above; the kernel only reads it.
    cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } as libc::c_long)?;
    Ok(())
}

/// Lifts the soft limit on open files to the hard one, and (as root) the hard one to the
/// kernel's `nr_open`, at most 1 Mi. Answers the soft limit now.
pub fn raise_open_file_limit() -> io::Result<Option<u64>> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let cur = getrlimit(Resource::Nofile);
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(1 << 20)
        .min(1 << 20);
    let want = Rlimit {
        current: Some(nr_open),
        maximum: Some(nr_open),
    };
    let fallback = Rlimit {
        current: cur.maximum,
        maximum: cur.maximum,
    };
    setrlimit(Resource::Nofile, want).or_else(|_| setrlimit(Resource::Nofile, fallback))?;
    Ok(getrlimit(Resource::Nofile).current)
}

/// Resident memory of a process (VmRSS in /proc/PID/status).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vmrss(&s)
}

/// VmRSS, in bytes, from the text of `/proc/PID/status`.
pub fn parse_vmrss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes the allocator holds free in its arenas (`mallinfo2`'s `fordblks`), which it keeps
/// until [`release_free_memory`]; None where the C library has no such call.
pub fn free_heap_bytes() -> Option<usize> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics, under its own locks.
        Some(unsafe { libc::mallinfo2() }.fordblks)
    }
    #[cfg(not(target_env = "gnu"))]
    {
        None
    }
}

/// Hands the allocator's free memory back to the kernel (`malloc_trim(0)`: the free top of the
/// heap and every free page inside it). A no-op where the C library has no such call.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists, under its own lock.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether our own child `pid` has exited, without reaping it: `waitid(P_PID, pid, WEXITED |
/// WNOHANG | WNOWAIT)`, one system call and no `/proc` lookup (decision 0066). An error
/// (`ECHILD`) means `pid` is not our unreaped child.
pub fn child_exited(pid: u32) -> io::Result<bool> {
    let exited = crate::ns::waitid(
        libc::P_PID,
        pid as libc::id_t,
        libc::WNOHANG | libc::WNOWAIT,
    )?;
    Ok(exited.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn session_makes_child_group_leader() {
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "test \"$(ps -o pgid= -p $$ | tr -d ' ')\" = \"$$\""]);
        set_session(&mut cmd, false);
        let status = cmd.status().unwrap();
        assert!(status.success(), "{status:?}");
    }

    #[test]
    fn credentials_switch_uid_gid_groups() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo $(id -u) $(id -g) $(id -G)"]);
        set_credentials(&mut cmd, 65534, 65533, vec![65533, 12345]);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{:?}", out);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "65534 65533 65533 12345"
        );
    }

    #[test]
    fn send_signal_rejects_broadcast_and_bad_signal() {
        assert!(send_signal(0, 9, false).is_err());
        assert!(send_signal(-1, 9, false).is_err());
        assert!(send_signal(1, 99, false).is_err());
        let mut child = Command::new("/bin/sleep").arg("10").spawn().unwrap();
        send_signal(child.id() as i32, 9, false).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(9));
    }

    #[test]
    fn take_inherited_fd_refuses_stdio_and_closed() {
        assert!(take_inherited_fd(1).is_err());
        assert!(take_inherited_fd(987_654).is_err());
    }

    /// Running, then exited but left for its owner to reap, then gone; a pid that is not
    /// ours is an error, never an answer.
    #[test]
    fn an_exit_is_seen_without_reaping_the_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!child_exited(pid).unwrap());
        // SAFETY: plain integer arguments, our own unreaped child.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !child_exited(pid).unwrap() {
            assert!(std::time::Instant::now() < deadline, "no exit seen in 10 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Still the owner's to reap, with its status.
        assert!(child.wait().unwrap().code().is_none());
        assert!(child_exited(pid).is_err());
        assert!(child_exited(1).is_err());
    }
}
