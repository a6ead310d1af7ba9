//! The new mount API (`open_tree`, `move_mount`, `mount_setattr`, `fsopen`/`fsmount`) and the
//! classic `mount(2)` family, wrapped once.
//!
//! Two kinds of wrappers live here:
//! - path-taking helpers for normal (parent-side) Rust code, returning [`MountError`] that
//!   names the path;
//! - `pub(crate)` raw helpers taking `&CStr` and returning `io::Result`, used by the sandbox
//!   init child between `clone3` and `execve`. They never allocate (an OS `io::Error` is a
//!   plain integer), so they are safe to call in a forked child of a multithreaded process.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `OPEN_TREE_CLONE`: create a detached copy of the mount at the path.
pub const OPEN_TREE_CLONE: u32 = 1;
/// `OPEN_TREE_CLOEXEC` (= `O_CLOEXEC`).
pub const OPEN_TREE_CLOEXEC: u32 = libc::O_CLOEXEC as u32;
/// `AT_RECURSIVE`: clone or change a whole mount tree.
pub const AT_RECURSIVE: u32 = 0x8000;
/// `MOVE_MOUNT_F_EMPTY_PATH`: the source is the fd itself.
pub const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

pub(crate) const FSOPEN_CLOEXEC: u32 = 0x1;
pub(crate) const FSMOUNT_CLOEXEC: u32 = 0x1;
pub(crate) const FSCONFIG_CMD_CREATE: u32 = 6;

/// `struct mount_attr` (MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MountAttr {
    pub attr_set: u64,
    pub attr_clr: u64,
    pub propagation: u64,
    pub userns_fd: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("failed to {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("path {0} contains a NUL byte")]
    Nul(PathBuf),
}

fn cpath(path: &Path) -> Result<CString, MountError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| MountError::Nul(path.to_owned()))
}

/// A detached copy (`open_tree(OPEN_TREE_CLONE)`) of the mount at `path`, with `CLOEXEC`.
pub fn open_tree_clone(path: &Path, recursive: bool) -> Result<OwnedFd, MountError> {
    let c = cpath(path)?;
    let mut flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC;
    if recursive {
        flags |= AT_RECURSIVE;
    }
    raw_open_tree(libc::AT_FDCWD, &c, flags)
        .map(|fd| {
            // SAFETY: `fd` was just returned by open_tree and is owned by nobody else.
            unsafe { OwnedFd::from_raw_fd(fd) }
        })
        .map_err(|source| MountError::Io {
            op: "clone the mount tree at",
            path: path.to_owned(),
            source,
        })
}

/// Set (and clear) mount attributes on a detached or attached mount fd. With
/// `MOUNT_ATTR_IDMAP` in `set`, `userns` supplies the idmapping.
pub fn set_mount_attrs(
    mount: BorrowedFd<'_>,
    set: u64,
    clear: u64,
    userns: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: clear,
        propagation: 0,
        userns_fd: userns.map_or(0, |fd| fd.as_raw_fd() as u64),
    };
    raw_mount_setattr(mount.as_raw_fd(), c"", libc::AT_EMPTY_PATH as u32, &attr)
}

/// A detached, idmapped copy of the mount at `path`: ids on disk are read through the
/// mappings of `userns` (disk uid 0 = uid 0 inside `userns`). `set` attributes (e.g.
/// `MOUNT_ATTR_NODEV`) are set and `clear` ones (e.g. the volume's `MOUNT_ATTR_NOSUID`)
/// cleared at the same time.
pub fn idmapped_clone(
    path: &Path,
    userns: BorrowedFd<'_>,
    set: u64,
    clear: u64,
) -> Result<OwnedFd, MountError> {
    let fd = open_tree_clone(path, false)?;
    set_mount_attrs(
        std::os::fd::AsFd::as_fd(&fd),
        MOUNT_ATTR_IDMAP | set,
        clear,
        Some(userns),
    )
    .map_err(|source| MountError::Io {
        op: "idmap the mount of",
        path: path.to_owned(),
        source,
    })?;
    Ok(fd)
}

/// Attach a detached mount `fd` at `target`.
pub fn move_mount_to(fd: BorrowedFd<'_>, target: &Path) -> Result<(), MountError> {
    let c = cpath(target)?;
    raw_move_mount(fd.as_raw_fd(), &c).map_err(|source| MountError::Io {
        op: "attach a mount at",
        path: target.to_owned(),
        source,
    })
}

/// `umount2(path, MNT_DETACH)`.
pub fn detach(path: &Path) -> Result<(), MountError> {
    let c = cpath(path)?;
    raw_umount_detach(&c).map_err(|source| MountError::Io {
        op: "detach the mount at",
        path: path.to_owned(),
        source,
    })
}

// ---- raw, allocation-free helpers (usable between clone and exec) -------------------------

fn cvt(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_int(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

pub(crate) fn raw_open_tree(dirfd: RawFd, path: &CStr, flags: u32) -> io::Result<RawFd> {
    // SAFETY: `path` is a valid NUL-terminated string that outlives the call; open_tree only
    // reads it. The returned fd (if any) is handed to the caller.
    let r = unsafe { libc::syscall(libc::SYS_open_tree, dirfd, path.as_ptr(), flags) };
    cvt(r).map(|fd| fd as RawFd)
}

pub(crate) fn raw_move_mount(from: RawFd, to: &CStr) -> io::Result<()> {
    // SAFETY: both path arguments are valid NUL-terminated strings ("" and `to`) that outlive
    // the call; the kernel only reads them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            from,
            c"".as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    cvt(r).map(drop)
}

pub(crate) fn raw_mount_setattr(
    dirfd: RawFd,
    path: &CStr,
    flags: u32,
    attr: &MountAttr,
) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated, `attr` points to a live `struct mount_attr` whose size
    // is passed alongside; the kernel only reads both.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    cvt(r).map(drop)
}

/// `fsopen(fstype)` + `fsconfig(CREATE)` + `fsmount(attrs)`: a detached new mount of
/// `fstype`. Returns the mount fd (CLOEXEC). The intermediate fs-context fd is closed.
pub(crate) fn raw_fsmount(fstype: &CStr, attrs: u64) -> io::Result<RawFd> {
    // SAFETY: `fstype` is NUL-terminated and only read.
    let fs =
        cvt(unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) })? as RawFd;
    // SAFETY: `fs` is the fs-context fd just opened; CMD_CREATE takes no key/value.
    let created = cvt(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs,
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    });
    let mounted = created.and_then(|_| {
        // SAFETY: `fs` is a created fs context; plain integer arguments.
        cvt(unsafe { libc::syscall(libc::SYS_fsmount, fs, FSMOUNT_CLOEXEC, attrs) })
    });
    raw_close(fs);
    mounted.map(|fd| fd as RawFd)
}

pub(crate) fn raw_mount(
    source: &CStr,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    // SAFETY: all pointers are NUL-terminated strings (or NULL) that outlive the call; mount
    // only reads them.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.map_or(std::ptr::null(), CStr::as_ptr),
            flags,
            data.map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    cvt_int(r).map(drop)
}

pub(crate) fn raw_umount_detach(target: &CStr) -> io::Result<()> {
    // SAFETY: `target` is NUL-terminated and only read.
    cvt_int(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }).map(drop)
}

pub(crate) fn raw_pivot_root_dot() -> io::Result<()> {
    // SAFETY: both arguments are the static string "."; pivot_root only reads them.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) };
    cvt(r).map(drop)
}

pub(crate) fn raw_close(fd: RawFd) {
    // SAFETY: the caller owns `fd` and does not use it afterwards.
    unsafe { libc::close(fd) };
}
