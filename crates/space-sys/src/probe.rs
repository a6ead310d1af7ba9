//! Raw attempts for space-probe's escape battery (docs/THREAT_MODEL.md lists them all).
//!
//! Each function makes one call a sandbox must not be able to make and returns `Ok(())` when
//! the kernel allowed it. Every one is harmless if it is allowed, because the probe's negative
//! control runs it on the host as root: it asks for nothing, names a path that does not exist,
//! passes arguments the kernel rejects after its permission check, restores what it changed,
//! or closes what it got.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(r: libc::c_long) -> io::Result<libc::c_long> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A returned fd, closed at once.
fn close_fd(r: libc::c_long) -> io::Result<()> {
    let fd = cvt(r)? as RawFd;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(())
}

/// A path that exists nowhere, for calls whose permission check precedes the lookup.
const NOWHERE: &CStr = c"/nonexistent-space-probe";

pub fn io_uring_setup() -> io::Result<()> {
    let mut params = [0u8; 120]; // struct io_uring_params
    // SAFETY: `params` is a zeroed buffer of the size of io_uring_params, written by the
    // kernel; a created ring's fd is closed.
    close_fd(unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) })
}

pub fn userfaultfd() -> io::Result<()> {
    // SAFETY: integer flags only; a created fd is closed.
    close_fd(unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) })
}

/// struct file_handle with room for a 64-byte handle.
#[repr(C)]
struct FileHandle {
    handle_bytes: u32,
    handle_type: i32,
    f_handle: [u8; 64],
}

pub fn name_to_handle_at() -> io::Result<()> {
    let mut h = FileHandle {
        handle_bytes: 64,
        handle_type: 0,
        f_handle: [0; 64],
    };
    let mut mount_id: libc::c_int = 0;
    // SAFETY: a static path, and live buffers of the sizes the kernel expects.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            &mut h,
            &mut mount_id,
            0,
        )
    })
    .map(drop)
}

/// The "shocker" escape: open a file by a forged handle (inode 2, the root of most
/// filesystems) relative to a mount.
pub fn open_by_handle_at() -> io::Result<()> {
    let mut h = FileHandle {
        handle_bytes: 8,
        handle_type: 1, // FILEID_INO32_GEN
        f_handle: [0; 64],
    };
    h.f_handle[0] = 2;
    let root = std::fs::File::open("/")?;
    // SAFETY: a live fd and a live handle buffer; a returned fd is closed.
    close_fd(unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            root.as_raw_fd(),
            &h,
            libc::O_RDONLY,
        )
    })
}

/// Read one byte of pid 1's memory at an address that is never mapped (EFAULT if allowed).
pub fn process_vm_readv() -> io::Result<()> {
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: 8 as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: one live local iovec of one byte; the remote iovec is only read by the kernel.
    cvt(unsafe { libc::syscall(libc::SYS_process_vm_readv, 1, &local, 1, &remote, 1, 0) }).map(drop)
}

/// Take a copy of pid 1's fd 0 through a pidfd.
pub fn pidfd_getfd() -> io::Result<()> {
    // SAFETY: integer arguments; the pidfd is closed when `pidfd` drops.
    let pidfd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, 1, 0) })? as RawFd;
    // SAFETY: the kernel just returned this fd.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: integer arguments; a returned fd is closed.
    close_fd(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), 0, 0) })
}

pub fn kcmp() -> io::Result<()> {
    // SAFETY: integer arguments only (KCMP_FILE of fd 0 in both).
    cvt(unsafe { libc::syscall(libc::SYS_kcmp, libc::getpid(), 1, 0, 0, 0) }).map(drop)
}

pub fn swapon() -> io::Result<()> {
    // SAFETY: a static path that does not exist.
    cvt(unsafe { libc::syscall(libc::SYS_swapon, NOWHERE.as_ptr(), 0) }).map(drop)
}

pub fn acct() -> io::Result<()> {
    // SAFETY: a static path that does not exist (never NULL, which would switch accounting
    // off on a host that has it on).
    cvt(unsafe { libc::syscall(libc::SYS_acct, NOWHERE.as_ptr()) }).map(drop)
}

/// syslog(SYSLOG_ACTION_SIZE_BUFFER): the kernel log's size, read-only.
pub fn syslog() -> io::Result<()> {
    // SAFETY: integer arguments only, no buffer for this action.
    cvt(unsafe { libc::syscall(libc::SYS_syslog, 10, std::ptr::null_mut::<u8>(), 0) }).map(drop)
}

pub fn fsopen() -> io::Result<()> {
    // SAFETY: a static fs type name; a created context fd is closed.
    close_fd(unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), 0) })
}

/// A detached clone of the root mount (closed at once, never attached).
pub fn open_tree() -> io::Result<()> {
    const OPEN_TREE_CLONE: u32 = 1;
    // SAFETY: a static path and integer flags; a returned fd is closed.
    close_fd(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as u32,
        )
    })
}

pub fn pivot_root() -> io::Result<()> {
    // SAFETY: static paths that do not exist.
    cvt(unsafe { libc::syscall(libc::SYS_pivot_root, NOWHERE.as_ptr(), NOWHERE.as_ptr()) })
        .map(drop)
}

/// clone3 with a size the kernel rejects after its checks (EINVAL if it is not filtered).
pub fn clone3() -> io::Result<()> {
    let args = [0u64; 11];
    // SAFETY: a live, zeroed clone_args; size 0 makes the kernel refuse before it clones.
    cvt(unsafe { libc::syscall(libc::SYS_clone3, args.as_ptr(), 0usize) }).map(drop)
}

/// clone(CLONE_NEWUSER | CLONE_FS): an invalid pair (EINVAL) if the flag is not filtered,
/// so no child is ever made.
pub fn clone_newuser() -> io::Result<()> {
    let flags = (libc::CLONE_NEWUSER | libc::CLONE_FS) as libc::c_ulong;
    // SAFETY: integer arguments; the kernel refuses this flag pair before it clones.
    cvt(unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) }).map(drop)
}

/// personality(READ_IMPLIES_EXEC), restored at once if it was allowed.
pub fn personality() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let old = cvt(unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) })?;
    // SAFETY: as above.
    let r = cvt(unsafe { libc::syscall(libc::SYS_personality, 0x0040_0000u64) });
    if r.is_ok() {
        // SAFETY: as above; puts the old persona back.
        unsafe { libc::syscall(libc::SYS_personality, old as u64) };
    }
    r.map(drop)
}

/// getpid through the x32 ABI's number.
#[cfg(target_arch = "x86_64")]
pub fn x32_syscall() -> io::Result<()> {
    // SAFETY: getpid takes no arguments.
    cvt(unsafe { libc::syscall(0x4000_0000 | libc::SYS_getpid) }).map(drop)
}

/// mbind(MPOL_DEFAULT) of nothing.
pub fn mbind() -> io::Result<()> {
    // SAFETY: a NULL, zero-length range and no node mask.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_mbind,
            0usize,
            0usize,
            0,
            std::ptr::null::<u64>(),
            0,
            0,
        )
    })
    .map(drop)
}

pub fn fanotify_init() -> io::Result<()> {
    // SAFETY: integer flags (FAN_CLASS_NOTIF, O_RDONLY); a created fd is closed.
    close_fd(unsafe { libc::syscall(libc::SYS_fanotify_init, 0, libc::O_RDONLY) })
}

/// add_key to this process's own keyring (gone with the process).
pub fn add_key() -> io::Result<()> {
    const KEY_SPEC_PROCESS_KEYRING: i32 = -2;
    // SAFETY: static strings and a one-byte payload.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_add_key,
            c"user".as_ptr(),
            c"space-probe".as_ptr(),
            c"x".as_ptr(),
            1usize,
            KEY_SPEC_PROCESS_KEYRING,
        )
    })
    .map(drop)
}

pub fn request_key() -> io::Result<()> {
    // SAFETY: static strings; no callout info.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_request_key,
            c"user".as_ptr(),
            c"space-probe-none".as_ptr(),
            std::ptr::null::<u8>(),
            0,
        )
    })
    .map(drop)
}

/// quotactl(Q_GETFMT) on a path that does not exist.
pub fn quotactl() -> io::Result<()> {
    let mut fmt = 0u32;
    let cmd = (0x80_0004u32 << 8) as libc::c_int; // QCMD(Q_GETFMT, USRQUOTA)
    // SAFETY: a static path and a live u32 for the answer.
    cvt(unsafe { libc::syscall(libc::SYS_quotactl, cmd, NOWHERE.as_ptr(), 0, &mut fmt) }).map(drop)
}

/// adjtimex with no modes: a pure read of the clock's state.
pub fn adjtimex() -> io::Result<()> {
    // SAFETY: a zeroed struct timex (modes 0: change nothing) the kernel fills.
    let mut tx: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: a live timex.
    cvt(unsafe { libc::syscall(libc::SYS_adjtimex, &mut tx) }).map(drop)
}

/// setdomainname to the value it has.
pub fn setdomainname() -> io::Result<()> {
    let uts = rustix::system::uname();
    let name = uts.domainname().to_bytes();
    // SAFETY: pointer and length of a live buffer.
    cvt(unsafe { libc::syscall(libc::SYS_setdomainname, name.as_ptr(), name.len()) }).map(drop)
}

/// One ioctl on `fd` with a zeroed 256-byte argument buffer.
pub fn ioctl(fd: RawFd, request: u64) -> io::Result<()> {
    let mut arg = [0u8; 256];
    // SAFETY: a live buffer larger than any argument struct of the requests probed; the fds
    // probed are /dev/null, a directory, a pty or nsfs file, where none of them acts.
    cvt(unsafe { libc::syscall(libc::SYS_ioctl, fd, request, arg.as_mut_ptr()) }).map(drop)
}

/// One ioctl on `fd` with the caller's argument buffer.
pub fn ioctl_buf(fd: RawFd, request: u64, arg: &mut [u8]) -> io::Result<()> {
    // SAFETY: a live buffer the caller sized for the request.
    cvt(unsafe { libc::syscall(libc::SYS_ioctl, fd, request, arg.as_mut_ptr()) }).map(drop)
}

/// BTRFS_IOC_SUBVOL_CREATE in `dir` with the name ".", which btrfs refuses (EINVAL) after
/// the syscall filter: no subvolume is ever made.
pub fn btrfs_subvol_create(dir: RawFd) -> io::Result<()> {
    let mut args = [0u8; 4096]; // struct btrfs_ioctl_vol_args: fd, name[4088]
    args[8] = b'.';
    // SAFETY: a live vol_args buffer of its full size.
    cvt(unsafe { libc::syscall(libc::SYS_ioctl, dir, 0x5000_940eu64, args.as_mut_ptr()) }).map(drop)
}

/// TIOCSTI (fake terminal input) of one byte into a fresh pty of our own.
pub fn tiocsti() -> io::Result<()> {
    let ptmx = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/ptmx")?;
    let byte = b'x';
    // SAFETY: a live one-byte buffer; the pty is ours and closed afterwards.
    cvt(unsafe { libc::syscall(libc::SYS_ioctl, ptmx.as_raw_fd(), 0x5412u64, &byte) }).map(drop)
}

pub fn socket(family: i32, kind: i32, protocol: i32) -> io::Result<()> {
    // SAFETY: integer arguments; a created socket is closed.
    close_fd(unsafe {
        libc::syscall(
            libc::SYS_socket,
            family,
            kind | libc::SOCK_CLOEXEC,
            protocol,
        )
    })
}

/// SIOCSIFFLAGS on `lo` with the flags it has (needs CAP_NET_ADMIN).
pub fn set_loopback_flags() -> io::Result<()> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))?;
    let mut req = [0u8; 40]; // struct ifreq: name[16], then the union
    req[..2].copy_from_slice(b"lo");
    // SAFETY: a live ifreq buffer on our own socket.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_ioctl,
            sock.as_raw_fd(),
            0x8913u64,
            req.as_mut_ptr(),
        )
    })?;
    // SAFETY: as above: SIOCSIFFLAGS with the flags just read.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_ioctl,
            sock.as_raw_fd(),
            0x8914u64,
            req.as_mut_ptr(),
        )
    })
    .map(drop)
}

/// mknod of a character device (1:3, what /dev/null is) at `path`, removed if it was made.
pub fn mknod_char(path: &CStr) -> io::Result<()> {
    let dev = libc::makedev(1, 3);
    // SAFETY: a live path; integer mode and device.
    let r = cvt(unsafe {
        libc::syscall(
            libc::SYS_mknodat,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::S_IFCHR | 0o600,
            dev,
        )
    });
    if r.is_ok() {
        // SAFETY: a live path.
        unsafe { libc::unlink(path.as_ptr()) };
    }
    r.map(drop)
}

/// Give `path` file capabilities (a v2 `security.capability` with CAP_SYS_ADMIN).
pub fn set_file_caps(path: &CStr) -> io::Result<()> {
    let mut v = [0u8; 20]; // struct vfs_cap_data, revision 2
    v[0..4].copy_from_slice(&0x0200_0001u32.to_le_bytes()); // VFS_CAP_REVISION_2 | EFFECTIVE
    v[4..8].copy_from_slice(&(1u32 << 21).to_le_bytes()); // permitted: CAP_SYS_ADMIN
    // SAFETY: a live path, a static name and a live value buffer.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_setxattr,
            path.as_ptr(),
            c"security.capability".as_ptr(),
            v.as_ptr(),
            v.len(),
            0,
        )
    })
    .map(drop)
}

/// Raise this process's hard limit of `resource` by one (needs CAP_SYS_RESOURCE), put back
/// if it was allowed.
pub fn raise_hard_limit(resource: libc::__rlimit_resource_t) -> io::Result<()> {
    let mut cur = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a live rlimit64 the kernel fills.
    cvt(unsafe { libc::syscall(libc::SYS_prlimit64, 0, resource, 0usize, &mut cur) })?;
    if cur.rlim_max == libc::RLIM64_INFINITY {
        return Ok(());
    }
    let new = libc::rlimit64 {
        rlim_cur: cur.rlim_cur,
        rlim_max: cur.rlim_max + 1,
    };
    // SAFETY: a live rlimit64 the kernel reads.
    let r = cvt(unsafe { libc::syscall(libc::SYS_prlimit64, 0, resource, &new, 0usize) });
    if r.is_ok() {
        // SAFETY: as above, with the old limits.
        unsafe { libc::syscall(libc::SYS_prlimit64, 0, resource, &cur, 0usize) };
    }
    r.map(drop)
}

/// Nice -20 for this process (needs CAP_SYS_NICE), put back to 0 if it was allowed.
pub fn nice_minus_20() -> io::Result<()> {
    // SAFETY: integer arguments only, on this process.
    let r = cvt(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -20) } as libc::c_long);
    if r.is_ok() {
        // SAFETY: as above.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 0) };
    }
    r.map(drop)
}

/// Lock `bytes` of fresh memory (over RLIMIT_MEMLOCK it is refused), unlocked and freed.
pub fn mlock(bytes: usize) -> io::Result<()> {
    let buf = vec![0u8; bytes];
    // SAFETY: a live buffer of `bytes` bytes; unlocked before it is freed.
    let r = cvt(unsafe { libc::mlock(buf.as_ptr().cast(), bytes) } as libc::c_long);
    if r.is_ok() {
        // SAFETY: as above.
        unsafe { libc::munlock(buf.as_ptr().cast(), bytes) };
    }
    r.map(drop)
}

/// unshare(CLONE_NEWNS | CLONE_NEWNET) one at a time: `flag` only changes the caller's own
/// namespaces (run last by the probe).
pub fn unshare(flag: libc::c_int) -> io::Result<()> {
    // SAFETY: a namespace flag only changes which namespaces this process is in; it does not
    // touch memory or file descriptors.
    cvt(unsafe { libc::syscall(libc::SYS_unshare, flag) }).map(drop)
}
