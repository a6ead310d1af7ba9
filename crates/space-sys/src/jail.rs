//! A jail for a helper process (QEMU): its own mount namespace holding only the files it
//! needs on a tmpfs root, its own IPC and UTS namespaces, a cgroup entered before exec, an
//! unprivileged uid/gid and `no_new_privs`. Modelled on Firecracker's jailer, done in a
//! `pre_exec` hook of a [`Command`] instead of a separate binary.
//!
//! Everything the child needs (C strings, flags, cgroup fds) is prepared by [`jail_command`]
//! before the fork; the hook runs only raw, async-signal-safe syscalls on that data. A failing
//! step writes `space jail: <step> failed` to the child's stderr (already redirected by
//! `Command` when the hook runs) and returns the errno, which `Command::spawn` reports.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::mount::{raw_mount, raw_pivot_root_dot, raw_umount_detach};

/// How a host path appears inside the jail (always at the same path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindMode {
    /// Read-only, executables allowed (`/usr`, a binary): nosuid, nodev.
    ReadOnlyExec,
    /// Read-only data: nosuid, nodev, noexec.
    ReadOnly,
    /// Writable data: nosuid, nodev, noexec.
    ReadWrite,
    /// A device node, writable: nosuid, noexec (not nodev).
    Device,
}

/// One step of building the jail's root, in order. Paths are as seen inside the jail
/// (absolute); sources are host paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JailOp {
    /// `mkdir` (mode 0755); an existing directory is fine.
    Mkdir(PathBuf),
    /// Create an empty file (a bind target); an existing file is fine.
    Touch(PathBuf),
    /// Bind `src` (recursively) at `dst`, then remount it with `mode`'s flags.
    Bind {
        src: PathBuf,
        dst: PathBuf,
        mode: BindMode,
    },
    /// `symlink(target, link)`.
    Symlink { target: PathBuf, link: PathBuf },
}

/// What [`jail_command`] sets up.
#[derive(Debug)]
pub struct JailSpec<'a> {
    /// An empty host directory; the child mounts its tmpfs root over it (in its own mount
    /// namespace, so several children may share it).
    pub mountpoint: &'a Path,
    pub ops: &'a [JailOp],
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the caller's are all dropped).
    pub groups: &'a [u32],
    /// `cgroup.procs` files, opened for writing; the child writes `0` (itself) to each.
    pub cgroup_procs: Vec<OwnedFd>,
    /// A network namespace the child enters (as root, before anything else); None: it stays
    /// in the caller's.
    pub netns: Option<OwnedFd>,
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail path {0:?} contains a NUL byte")]
    Nul(PathBuf),
    #[error("jail path {0:?} is not absolute")]
    Relative(PathBuf),
}

/// A prepared op: C strings of full paths (under the mountpoint for targets).
#[derive(Debug)]
enum RawOp {
    Mkdir(CString),
    Touch(CString),
    Bind {
        src: CString,
        dst: CString,
        remount: libc::c_ulong,
    },
    Symlink {
        target: CString,
        link: CString,
    },
}

#[derive(Debug)]
struct Prepared {
    mountpoint: CString,
    ops: Vec<RawOp>,
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    cgroup_procs: Vec<OwnedFd>,
    netns: Option<OwnedFd>,
}

fn cstr(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::Nul(p.to_owned()))
}

/// `mountpoint` + `inside` (absolute).
fn under(mountpoint: &Path, inside: &Path) -> Result<CString, JailError> {
    let rel = inside
        .strip_prefix("/")
        .map_err(|_| JailError::Relative(inside.to_owned()))?;
    cstr(&mountpoint.join(rel))
}

fn remount_flags(mode: BindMode) -> libc::c_ulong {
    let base = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID;
    base | match mode {
        BindMode::ReadOnlyExec => libc::MS_RDONLY | libc::MS_NODEV,
        BindMode::ReadOnly => libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOEXEC,
        BindMode::ReadWrite => libc::MS_NODEV | libc::MS_NOEXEC,
        BindMode::Device => libc::MS_NOEXEC,
    }
}

fn prepare(spec: JailSpec<'_>) -> Result<Prepared, JailError> {
    let mp = spec.mountpoint;
    let ops = spec
        .ops
        .iter()
        .map(|op| {
            Ok(match op {
                JailOp::Mkdir(p) => RawOp::Mkdir(under(mp, p)?),
                JailOp::Touch(p) => RawOp::Touch(under(mp, p)?),
                JailOp::Bind { src, dst, mode } => RawOp::Bind {
                    src: cstr(src)?,
                    dst: under(mp, dst)?,
                    remount: remount_flags(*mode),
                },
                JailOp::Symlink { target, link } => RawOp::Symlink {
                    target: cstr(target)?,
                    link: under(mp, link)?,
                },
            })
        })
        .collect::<Result<Vec<_>, JailError>>()?;
    Ok(Prepared {
        mountpoint: cstr(mp)?,
        ops,
        uid: spec.uid,
        gid: spec.gid,
        groups: spec.groups.to_vec(),
        cgroup_procs: spec.cgroup_procs,
        netns: spec.netns,
    })
}

/// Makes `cmd` start jailed as `spec` says. Set `cmd`'s program to a path that exists inside
/// the jail (an absolute path under a bound directory); the hook changes the working directory
/// to the new `/`. Errors: a path that cannot be passed to the kernel.
pub fn jail_command(cmd: &mut Command, spec: JailSpec<'_>) -> Result<(), JailError> {
    let prepared = prepare(spec)?;
    // SAFETY: the hook runs in the forked child before exec. It allocates nothing and takes no
    // lock: it only reads `prepared` (allocated above, moved into the closure, alive in the
    // child's copy of memory) and calls raw syscalls (write, unshare, mount, mkdir, open,
    // close, symlink, setns, chdir, pivot_root, umount2, setgroups, setresgid, setresuid, prctl),
    // all async-signal-safe. `io::Error::last_os_error()` reads errno without allocating.
    unsafe {
        cmd.pre_exec(move || child_setup(&prepared));
    }
    Ok(())
}

/// Makes `cmd`'s program inherit `fds` at their current numbers (close-on-exec is cleared in
/// the child only, so no other child gets them). Works with or without [`jail_command`]: a
/// jail changes neither the descriptors nor the right to clear that flag on them.
pub fn inherit_fds(cmd: &mut Command, fds: Vec<OwnedFd>) {
    // SAFETY: the hook runs in the forked child before exec and only calls fcntl on fds that
    // `fds` (moved into the closure, alive in the child's copy of memory) keeps open.
    unsafe {
        cmd.pre_exec(move || keep_open(&fds));
    }
}

/// Clears close-on-exec on each of `fds` (in a forked child: raw fcntl only).
fn keep_open(fds: &[OwnedFd]) -> io::Result<()> {
    for fd in fds {
        // SAFETY: plain integer arguments on an fd owned by the caller.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) };
        step(b"space jail: keep a descriptor open failed\n", cvt(r))?;
    }
    Ok(())
}

/// Writes a static message to the child's stderr (raw write, no allocation).
fn say(msg: &'static [u8]) {
    // SAFETY: `msg` is a valid static byte slice; write only reads it.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

fn step<T>(msg: &'static [u8], r: io::Result<T>) -> io::Result<T> {
    if r.is_err() {
        say(msg);
    }
    r
}

fn cvt(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn child_setup(p: &Prepared) -> io::Result<()> {
    // Enter the cgroups first, as root, before anything can allocate memory in the child.
    for fd in &p.cgroup_procs {
        // SAFETY: `fd` is an open fd owned by `p`; the buffer is a static one-byte string.
        let n = unsafe { libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) };
        step(
            b"space jail: enter the cgroup failed\n",
            cvt(if n < 0 { -1 } else { 0 }),
        )?;
    }
    if let Some(ns) = &p.netns {
        // SAFETY: plain integer arguments; `ns` is an open fd owned by `p`.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        step(b"space jail: enter the network namespace failed\n", cvt(r))?;
    }
    // SAFETY: plain flag argument; the child is single-threaded after fork.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS) };
    step(b"space jail: unshare failed\n", cvt(r))?;
    step(
        b"space jail: make / rprivate failed\n",
        raw_mount(c"none", c"/", None, libc::MS_REC | libc::MS_PRIVATE, None),
    )?;
    step(
        b"space jail: mount the tmpfs root failed\n",
        raw_mount(
            c"space-jail",
            &p.mountpoint,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(c"mode=0755,size=1m,nr_inodes=4096"),
        ),
    )?;
    for op in &p.ops {
        match op {
            RawOp::Mkdir(path) => {
                // SAFETY: `path` is NUL-terminated and outlives the call.
                let r = unsafe { libc::mkdir(path.as_ptr(), 0o755) };
                if r < 0 {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        say(b"space jail: mkdir failed\n");
                        return Err(e);
                    }
                }
            }
            RawOp::Touch(path) => {
                // SAFETY: `path` is NUL-terminated; the returned fd is closed right away.
                let fd = unsafe {
                    libc::open(
                        path.as_ptr(),
                        libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                        0o600,
                    )
                };
                step(b"space jail: create a bind target failed\n", cvt(fd))?;
                // SAFETY: `fd` was just opened here and is not used again.
                unsafe { libc::close(fd) };
            }
            RawOp::Bind { src, dst, remount } => {
                step(
                    b"space jail: bind mount failed\n",
                    raw_mount(src, dst, None, libc::MS_BIND | libc::MS_REC, None),
                )?;
                step(
                    b"space jail: remount a bind failed\n",
                    raw_mount(c"none", dst, None, *remount, None),
                )?;
            }
            RawOp::Symlink { target, link } => {
                // SAFETY: both are NUL-terminated and outlive the call.
                let r = unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) };
                step(b"space jail: symlink failed\n", cvt(r))?;
            }
        }
    }
    // The root itself becomes read-only: nothing can be added to the jail from inside.
    step(
        b"space jail: make the root read-only failed\n",
        raw_mount(
            c"none",
            &p.mountpoint,
            None,
            libc::MS_REMOUNT
                | libc::MS_BIND
                | libc::MS_RDONLY
                | libc::MS_NOSUID
                | libc::MS_NODEV
                | libc::MS_NOEXEC,
            None,
        ),
    )?;
    // SAFETY: `mountpoint` is NUL-terminated and outlives the call.
    let r = unsafe { libc::chdir(p.mountpoint.as_ptr()) };
    step(b"space jail: chdir to the new root failed\n", cvt(r))?;
    step(b"space jail: pivot_root failed\n", raw_pivot_root_dot())?;
    step(
        b"space jail: detach the old root failed\n",
        raw_umount_detach(c"."),
    )?;
    // SAFETY: static NUL-terminated path.
    let r = unsafe { libc::chdir(c"/".as_ptr()) };
    step(b"space jail: chdir / failed\n", cvt(r))?;
    // SAFETY: `groups` is a live slice of gid_t of the given length.
    let r = unsafe { libc::setgroups(p.groups.len(), p.groups.as_ptr()) };
    step(b"space jail: setgroups failed\n", cvt(r))?;
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::setresgid(p.gid, p.gid, p.gid) };
    step(b"space jail: setresgid failed\n", cvt(r))?;
    // SAFETY: plain integer arguments; leaving uid 0 clears every capability set.
    let r = unsafe { libc::setresuid(p.uid, p.uid, p.uid) };
    step(b"space jail: setresuid failed\n", cvt(r))?;
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    step(b"space jail: no_new_privs failed\n", cvt(r))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_land_under_the_mountpoint() {
        let ops = [
            JailOp::Mkdir("/run".into()),
            JailOp::Bind {
                src: "/usr".into(),
                dst: "/usr".into(),
                mode: BindMode::ReadOnlyExec,
            },
        ];
        let p = prepare(JailSpec {
            mountpoint: Path::new("/j"),
            ops: &ops,
            uid: 5,
            gid: 6,
            groups: &[],
            cgroup_procs: Vec::new(),
            netns: None,
        })
        .unwrap();
        match &p.ops[0] {
            RawOp::Mkdir(c) => assert_eq!(c.as_bytes(), b"/j/run"),
            other => panic!("{other:?}"),
        }
        match &p.ops[1] {
            RawOp::Bind { src, dst, remount } => {
                assert_eq!(src.as_bytes(), b"/usr");
                assert_eq!(dst.as_bytes(), b"/j/usr");
                assert_ne!(remount & libc::MS_RDONLY, 0);
                assert_eq!(remount & libc::MS_NOEXEC, 0);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn relative_and_nul_paths_are_refused() {
        let bad = [JailOp::Mkdir("run".into())];
        let e = prepare(JailSpec {
            mountpoint: Path::new("/j"),
            ops: &bad,
            uid: 1,
            gid: 1,
            groups: &[],
            cgroup_procs: Vec::new(),
            netns: None,
        })
        .unwrap_err();
        assert!(matches!(e, JailError::Relative(_)), "{e}");
        let nul = [JailOp::Touch(PathBuf::from("/a\0b"))];
        let e = prepare(JailSpec {
            mountpoint: Path::new("/j"),
            ops: &nul,
            uid: 1,
            gid: 1,
            groups: &[],
            cgroup_procs: Vec::new(),
            netns: None,
        })
        .unwrap_err();
        assert!(matches!(e, JailError::Nul(_)), "{e}");
    }
}
