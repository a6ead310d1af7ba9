//! The escape battery beyond the original checks: one attempt per probe, grouped by class.
//! docs/THREAT_MODEL.md lists every probe and what stops it; `space-probe --list` prints the
//! names, and a test holds the two together.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use space_sys::probe as raw;

use crate::{Args, Check, denied};

/// Exactly ENOSYS: the filter makes the call look absent (libc then falls back).
fn enosys(r: &io::Result<()>) -> Check {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => Check::ok(format!("ENOSYS: {e}")),
        Ok(()) => Check::fail("the call succeeded"),
        Err(e) => Check::fail(format!("not ENOSYS: {e}")),
    }
}

/// Refused for lack of privilege or resource (EPERM, EACCES, ENOMEM, EAGAIN).
fn refused(r: &io::Result<()>) -> Check {
    match r {
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EPERM | libc::EACCES | libc::ENOMEM | libc::EAGAIN)
            ) =>
        {
            Check::ok(format!("refused: {e}"))
        }
        other => denied(other),
    }
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("space-probe-{name}-{}", std::process::id()))
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in a temp path")
}

/// An ioctl on /dev/null: a filtered request is EPERM; one that reaches the device is ENOTTY.
fn ioctl_on_dev_null(request: u64) -> Check {
    match std::fs::File::open("/dev/null") {
        Ok(f) => denied(&raw::ioctl(f.as_raw_fd(), request)),
        Err(e) => Check::fail(format!("no /dev/null: {e}")),
    }
}

fn ioctl_on(path: &str, request: u64) -> Check {
    match std::fs::File::open(path) {
        Ok(f) => denied(&raw::ioctl(f.as_raw_fd(), request)),
        Err(e) => Check::fail(format!("cannot open {path}: {e}")),
    }
}

fn ioctl_on_pty(request: u64) -> Check {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/ptmx")
    {
        Ok(f) => denied(&raw::ioctl(f.as_raw_fd(), request)),
        Err(e) => Check::fail(format!("no /dev/ptmx: {e}")),
    }
}

/// BTRFS_IOC_SNAP_CREATE_V2 of `/` named "." (btrfs refuses that name, so nothing is made
/// even where the filter is absent).
fn btrfs_snapshot() -> Check {
    match std::fs::File::open("/") {
        Ok(root) => {
            let mut args = vec![0u8; 4096]; // btrfs_ioctl_vol_args_v2; name at offset 56
            args[0..8].copy_from_slice(&(root.as_raw_fd() as i64).to_ne_bytes());
            args[56] = b'.';
            denied(&raw::ioctl_buf(root.as_raw_fd(), 0x5000_9417, &mut args))
        }
        Err(e) => Check::fail(format!("cannot open /: {e}")),
    }
}

fn btrfs_subvol_create() -> Check {
    match std::fs::File::open("/") {
        Ok(root) => denied(&raw::btrfs_subvol_create(root.as_raw_fd())),
        Err(e) => Check::fail(format!("cannot open /: {e}")),
    }
}

/// Opening a kernel tunable for writing: refused by permission (EACCES), a read-only mount
/// (EROFS), or absent. Nothing is ever written.
fn open_for_write_denied(path: &str) -> Check {
    match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(_) => Check::fail(format!("{path} opened for writing")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Check::ok(format!("{path} absent")),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EACCES | libc::EPERM | libc::EROFS)
            ) =>
        {
            Check::ok(format!("{path}: {e}"))
        }
        Err(e) => Check::fail(format!("{path}: {e}")),
    }
}

/// A file that must read as empty (masked) or be absent.
fn reads_empty(path: &str) -> Check {
    match std::fs::read(path) {
        Ok(b) if b.is_empty() => Check::ok(format!("{path} is empty")),
        Ok(b) => Check::fail(format!("{path} has {} bytes", b.len())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Check::ok(format!("{path} absent")),
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => Check::ok(format!("{path}: {e}")),
        Err(e) => Check::fail(format!("{path}: {e}")),
    }
}

/// A directory that must be empty (masked) or absent.
fn dir_empty(path: &str) -> Check {
    match std::fs::read_dir(path) {
        Ok(rd) => {
            let n = rd.count();
            if n == 0 {
                Check::ok(format!("{path} is empty"))
            } else {
                Check::fail(format!("{path} lists {n} entries"))
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Check::ok(format!("{path} absent")),
        Err(e) => Check::fail(format!("{path}: {e}")),
    }
}

/// /proc/kallsyms shows no kernel address: masked, absent, or all zeros.
fn kallsyms_hidden() -> Check {
    match std::fs::read_to_string("/proc/kallsyms") {
        Ok(text) => {
            let leaked = text
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|a| a.chars().any(|c| c != '0'))
                .count();
            if leaked == 0 {
                Check::ok(format!("{} bytes, no address", text.len()))
            } else {
                Check::fail(format!("{leaked} symbols with addresses"))
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Check::ok("absent"),
        Err(e) => Check::fail(e.to_string()),
    }
}

/// Every path of /proc/self/cgroup is the namespace's root.
fn cgroupns_root() -> Check {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let not_root: Vec<&str> = text
        .lines()
        .filter(|l| l.rsplit(':').next().is_some_and(|p| p != "/"))
        .collect();
    Check {
        ok: !text.is_empty() && not_root.is_empty(),
        detail: format!(
            "{} lines; not at the root: {not_root:?}",
            text.lines().count()
        ),
    }
}

/// No cgroup filesystem with a `release_agent` (the cgroup v1 escape) is reachable.
fn release_agent_unreachable() -> Check {
    let mut found = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for e in rd.flatten() {
            let p = e.path().join("release_agent");
            if p.exists() {
                found.push(p.display().to_string());
            }
        }
    }
    if Path::new("/sys/fs/cgroup/release_agent").exists() {
        found.push("/sys/fs/cgroup/release_agent".into());
    }
    let writable: Vec<&String> = found
        .iter()
        .filter(|p| std::fs::OpenOptions::new().write(true).open(p).is_ok())
        .collect();
    Check {
        ok: writable.is_empty(),
        detail: format!("release_agent files {found:?}; writable {writable:?}"),
    }
}

fn cgroup_mount_denied() -> Check {
    let dir = scratch("cg");
    let _ = std::fs::create_dir(&dir);
    let r = rustix::mount::mount(
        "cgroup",
        &dir,
        "cgroup",
        rustix::mount::MountFlags::empty(),
        Some(c"none,name=space-probe"),
    )
    .map_err(io::Error::from);
    if r.is_ok() {
        let _ = rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::DETACH);
    }
    let _ = std::fs::remove_dir(&dir);
    denied(&r)
}

/// /dev holds only the harmless nodes: null, zero, full, random, urandom, tty, the pty
/// multiplexer and the sandbox's own ptys.
fn dev_nodes_safe() -> Check {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    const ALLOWED: [(u64, u64); 8] = [
        (1, 3),
        (1, 5),
        (1, 7),
        (1, 8),
        (1, 9),
        (5, 0),
        (5, 1),
        (5, 2),
    ];
    let mut bad = Vec::new();
    let mut stack = vec![PathBuf::from("/dev")];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            let ft = md.file_type();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_char_device() || ft.is_block_device() {
                let (major, minor) = (libc::major(md.rdev()) as u64, libc::minor(md.rdev()) as u64);
                // 136..=143: Unix98 pty slaves.
                if ft.is_block_device()
                    || !(ALLOWED.contains(&(major, minor)) || (136..=143).contains(&major))
                {
                    bad.push(format!("{} ({major}:{minor})", e.path().display()));
                }
            }
        }
    }
    Check {
        ok: bad.is_empty(),
        detail: format!("unexpected device nodes: {bad:?}"),
    }
}

fn mknod_device_denied() -> Check {
    let p = scratch("mknod");
    denied(&raw::mknod_char(&cpath(&p)))
}

fn file_caps_denied() -> Check {
    let p = scratch("fcaps");
    if let Err(e) = std::fs::write(&p, b"x") {
        return Check::fail(format!("cannot write {}: {e}", p.display()));
    }
    let r = raw::set_file_caps(&cpath(&p));
    let _ = std::fs::remove_file(&p);
    denied(&r)
}

fn uid_map_rewrite_denied() -> Check {
    match std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/uid_map")
    {
        Ok(mut f) => {
            use std::io::Write;
            denied(&f.write_all(b"0 0 1\n"))
        }
        Err(e) => denied(&Err(e)),
    }
}

/// Lowering one's own OOM score below the floor (-1000) is refused; restored if it was not.
fn oom_lower_denied() -> Check {
    let path = "/proc/self/oom_score_adj";
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let r = std::fs::write(path, "-1000");
    if r.is_ok() {
        let _ = std::fs::write(path, old.trim());
    }
    denied(&r)
}

fn mlock_over_limit() -> Check {
    // 64 MiB: above the 8 MiB RLIMIT_MEMLOCK a sandbox gets.
    refused(&raw::mlock(64 << 20))
}

/// A chroot into a subdirectory and the classic `..` walk out of it end at the sandbox's
/// own root: the host's marker stays invisible. Needs CAP_SYS_CHROOT (root inside); a user
/// is refused the chroot itself, which holds too.
fn chroot_escape_contained(args: &Args) -> Check {
    let dir = scratch("chroot");
    let _ = std::fs::create_dir(&dir);
    let r = rustix::process::chroot(&dir).map_err(io::Error::from);
    if let Err(e) = r {
        let _ = std::fs::remove_dir(&dir);
        return refused(&Err(e));
    }
    for _ in 0..64 {
        let _ = std::env::set_current_dir("..");
    }
    let back = rustix::process::chroot(".").map_err(io::Error::from);
    let visible: Vec<&String> = args
        .host_markers
        .iter()
        .filter(|m| std::fs::symlink_metadata(m).is_ok())
        .collect();
    let _ = std::env::set_current_dir("/");
    let _ = std::fs::remove_dir(&dir);
    Check {
        ok: back.is_ok() && visible.is_empty() && Path::new("/proc/self").exists(),
        detail: format!(
            "escaped to the namespace root ({back:?}); host markers visible: {visible:?}"
        ),
    }
}

/// Signal 0 to a host pid: another pid namespace's process does not exist here.
fn host_pid_unsignalable(args: &Args) -> Check {
    let Some(pid) = args.host_pid else {
        return Check::ok("no --host-pid given");
    };
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return Check::fail(format!("bad pid {pid}"));
    };
    // A pid inside may carry the same number: it must then not be the host's process.
    let own = std::fs::read_to_string(format!("/proc/{}/cmdline", pid.as_raw_nonzero()))
        .unwrap_or_default();
    match rustix::process::test_kill_process(pid) {
        Err(e) if e == rustix::io::Errno::SRCH => Check::ok("no such process here"),
        Err(e) => Check::ok(format!("refused: {e}")),
        Ok(()) => Check {
            ok: !own.contains("space-tests") && !own.contains("it-"),
            detail: format!("a process with that number exists here: {own:?}"),
        },
    }
}

/// Connect to an abstract unix socket the host listens on: abstract names belong to a
/// network namespace, and the sandbox has its own.
fn host_abstract_socket_unreachable(args: &Args) -> Check {
    let Some(name) = &args.host_abstract else {
        return Check::ok("no --host-abstract given");
    };
    use std::os::linux::net::SocketAddrExt;
    let addr = match std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()) {
        Ok(a) => a,
        Err(e) => return Check::fail(e.to_string()),
    };
    match std::os::unix::net::UnixStream::connect_addr(&addr) {
        Ok(_) => Check::fail("connected to the host's abstract socket"),
        Err(e) => Check::ok(format!("refused: {e}")),
    }
}

/// One probe: its name, its class, and the attempt.
pub type Probe = (&'static str, &'static str, fn(&Args) -> Check);

/// The probes of this module, in the order they run (the original checks of main.rs run
/// before, and the ones that change the probe's own namespaces after).
pub const PROBES: &[Probe] = &[
    // Syscalls outside the allowlist.
    ("io_uring_denied", "syscall", |_| {
        denied(&raw::io_uring_setup())
    }),
    ("userfaultfd_denied", "syscall", |_| {
        denied(&raw::userfaultfd())
    }),
    ("name_to_handle_at_denied", "syscall", |_| {
        denied(&raw::name_to_handle_at())
    }),
    ("open_by_handle_at_denied", "syscall", |_| {
        denied(&raw::open_by_handle_at())
    }),
    ("process_vm_readv_denied", "syscall", |_| {
        denied(&raw::process_vm_readv())
    }),
    ("pidfd_getfd_denied", "syscall", |_| {
        denied(&raw::pidfd_getfd())
    }),
    ("kcmp_denied", "syscall", |_| denied(&raw::kcmp())),
    ("swapon_denied", "syscall", |_| denied(&raw::swapon())),
    ("acct_denied", "syscall", |_| denied(&raw::acct())),
    ("syslog_denied", "syscall", |_| denied(&raw::syslog())),
    ("fanotify_denied", "syscall", |_| {
        denied(&raw::fanotify_init())
    }),
    ("add_key_denied", "syscall", |_| denied(&raw::add_key())),
    ("request_key_denied", "syscall", |_| {
        denied(&raw::request_key())
    }),
    ("quotactl_denied", "syscall", |_| denied(&raw::quotactl())),
    ("adjtimex_denied", "syscall", |_| denied(&raw::adjtimex())),
    ("setdomainname_denied", "syscall", |_| {
        denied(&raw::setdomainname())
    }),
    ("mbind_denied", "syscall", |_| denied(&raw::mbind())),
    ("clone3_enosys", "syscall", |_| enosys(&raw::clone3())),
    ("clone_newuser_denied", "syscall", |_| {
        denied(&raw::clone_newuser())
    }),
    ("personality_denied", "syscall", |_| {
        denied(&raw::personality())
    }),
    #[cfg(target_arch = "x86_64")]
    ("x32_abi_denied", "syscall", |_| enosys(&raw::x32_syscall())),
    // Mounts.
    ("fsopen_denied", "mount", |_| denied(&raw::fsopen())),
    ("open_tree_denied", "mount", |_| denied(&raw::open_tree())),
    ("pivot_root_denied", "mount", |_| denied(&raw::pivot_root())),
    ("cgroup_mount_denied", "cgroup", |_| cgroup_mount_denied()),
    // ioctls outside the named families.
    ("tiocsti_denied", "ioctl", |_| denied(&raw::tiocsti())),
    ("tioclinux_denied", "ioctl", |_| ioctl_on_pty(0x541C)),
    ("btrfs_subvol_create_denied", "ioctl", |_| {
        btrfs_subvol_create()
    }),
    ("btrfs_snapshot_denied", "ioctl", |_| btrfs_snapshot()),
    ("btrfs_tree_search_denied", "ioctl", |_| {
        ioctl_on("/", 0xd000_9411)
    }),
    ("tun_ioctl_denied", "ioctl", |_| {
        ioctl_on_dev_null(0x4004_54ca)
    }),
    ("kvm_ioctl_denied", "ioctl", |_| ioctl_on_dev_null(0xae00)),
    ("loop_ioctl_denied", "ioctl", |_| ioctl_on_dev_null(0x4c82)),
    ("ns_ioctl_denied", "ioctl", |_| {
        ioctl_on("/proc/self/ns/user", 0xb701)
    }),
    ("fs_uuid_ioctl_denied", "ioctl", |_| {
        ioctl_on("/", 0x8011_1500)
    }),
    // Sockets.
    ("vsock_denied", "socket", |_| {
        denied(&raw::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0))
    }),
    ("af_alg_denied", "socket", |_| {
        denied(&raw::socket(libc::AF_ALG, libc::SOCK_SEQPACKET, 0))
    }),
    ("af_key_denied", "socket", |_| {
        denied(&raw::socket(libc::AF_KEY, libc::SOCK_RAW, 2))
    }),
    ("packet_socket_denied", "socket", |_| {
        denied(&raw::socket(libc::AF_PACKET, libc::SOCK_RAW, 0))
    }),
    ("raw_socket_denied", "socket", |_| {
        denied(&raw::socket(
            libc::AF_INET,
            libc::SOCK_RAW,
            libc::IPPROTO_ICMP,
        ))
    }),
    ("interface_flags_denied", "socket", |_| {
        denied(&raw::set_loopback_flags())
    }),
    // Capabilities the sandbox does not hold.
    ("mknod_device_denied", "capability", |_| {
        mknod_device_denied()
    }),
    ("file_caps_denied", "capability", |_| file_caps_denied()),
    ("uid_map_rewrite_denied", "capability", |_| {
        uid_map_rewrite_denied()
    }),
    // /proc and /sys.
    ("core_pattern_write_denied", "proc-sys", |_| {
        open_for_write_denied("/proc/sys/kernel/core_pattern")
    }),
    ("modprobe_path_write_denied", "proc-sys", |_| {
        open_for_write_denied("/proc/sys/kernel/modprobe")
    }),
    ("sysrq_trigger_denied", "proc-sys", |_| {
        open_for_write_denied("/proc/sysrq-trigger")
    }),
    ("uevent_helper_write_denied", "proc-sys", |_| {
        open_for_write_denied("/sys/kernel/uevent_helper")
    }),
    ("kallsyms_hidden", "proc-sys", |_| kallsyms_hidden()),
    ("kcore_hidden", "proc-sys", |_| reads_empty("/proc/kcore")),
    ("proc_keys_hidden", "proc-sys", |_| {
        reads_empty("/proc/keys")
    }),
    ("timer_list_hidden", "proc-sys", |_| {
        reads_empty("/proc/timer_list")
    }),
    ("sys_firmware_hidden", "proc-sys", |_| {
        dir_empty("/sys/firmware")
    }),
    ("host_block_devices_hidden", "proc-sys", |_| {
        let a = dir_empty("/sys/block");
        let b = dir_empty("/sys/class/block");
        Check {
            ok: a.ok && b.ok,
            detail: format!("{}; {}", a.detail, b.detail),
        }
    }),
    // cgroups and devices.
    ("cgroupns_root", "cgroup", |_| cgroupns_root()),
    ("release_agent_unreachable", "cgroup", |_| {
        release_agent_unreachable()
    }),
    ("dev_nodes_safe", "device", |_| dev_nodes_safe()),
    // Resource limits.
    ("nofile_hard_raise_denied", "rlimit", |_| {
        denied(&raw::raise_hard_limit(libc::RLIMIT_NOFILE))
    }),
    ("core_limit_raise_denied", "rlimit", |_| {
        denied(&raw::raise_hard_limit(libc::RLIMIT_CORE))
    }),
    ("nice_denied", "rlimit", |_| refused(&raw::nice_minus_20())),
    ("mlock_over_limit_refused", "rlimit", |_| mlock_over_limit()),
    ("oom_lower_denied", "rlimit", |_| oom_lower_denied()),
    // The host, seen from inside.
    ("host_pid_unsignalable", "host", host_pid_unsignalable),
    ("host_abstract_socket_unreachable", "host", |a| {
        host_abstract_socket_unreachable(a)
    }),
    ("chroot_escape_contained", "host", chroot_escape_contained),
];
