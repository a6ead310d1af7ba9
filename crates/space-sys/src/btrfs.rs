//! btrfs subvolumes through ioctls (no `btrfs` CLI): create, snapshot, delete (nested
//! subvolumes included), read-only flag, detection.
//!
//! Paths handed to this module are trusted node paths; the final component is never followed
//! when it is a symlink. Paths found *inside* a subvolume (nested subvolumes created by sandbox
//! code) are resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` relative to their
//! parent subvolume, so sandbox-controlled symlinks can never redirect a deletion.

use std::ffi::{CStr, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};

pub mod quota;

/// `BTRFS_SUPER_MAGIC` from `<linux/magic.h>`.
pub const BTRFS_SUPER_MAGIC: i64 = 0x9123_683E;
/// Inode number of the root directory of every subvolume (`BTRFS_FIRST_FREE_OBJECTID`).
pub const SUBVOLUME_ROOT_INO: u64 = 256;

const BTRFS_IOCTL_MAGIC: u32 = 0x94;
const BTRFS_PATH_NAME_MAX: usize = 4087;
const BTRFS_SUBVOL_NAME_MAX: usize = 4039;
const BTRFS_INO_LOOKUP_PATH_MAX: usize = 4080;
const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;
const BTRFS_ROOT_TREE_OBJECTID: u64 = 1;
const BTRFS_ROOT_REF_KEY: u32 = 156;

/// `_IOC(dir, 0x94, nr, size)` as in `<asm-generic/ioctl.h>`.
const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr
}
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `struct btrfs_ioctl_vol_args`.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; BTRFS_PATH_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_vol_args_v2` (the qgroup/size union is `unused[4]` here).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; BTRFS_SUBVOL_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; BTRFS_INO_LOOKUP_PATH_MAX],
}

/// `struct btrfs_ioctl_search_key`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SearchKey {
    tree_id: u64,
    min_objectid: u64,
    max_objectid: u64,
    min_offset: u64,
    max_offset: u64,
    min_transid: u64,
    max_transid: u64,
    min_type: u32,
    max_type: u32,
    nr_items: u32,
    unused: u32,
    unused1: u64,
    unused2: u64,
    unused3: u64,
    unused4: u64,
}

const SEARCH_BUF: usize = 4096 - std::mem::size_of::<SearchKey>();

/// `struct btrfs_ioctl_search_args`.
#[repr(C)]
struct SearchArgs {
    key: SearchKey,
    buf: [u8; SEARCH_BUF],
}

const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);
const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<SearchKey>() == 104);
const _: () = assert!(std::mem::size_of::<SearchArgs>() == 4096);

const IOC_SNAP_CREATE_V2: u32 = ioc(IOC_WRITE, 23, std::mem::size_of::<VolArgsV2>());
const IOC_SUBVOL_CREATE: u32 = ioc(IOC_WRITE, 14, std::mem::size_of::<VolArgs>());
const IOC_SNAP_DESTROY: u32 = ioc(IOC_WRITE, 15, std::mem::size_of::<VolArgs>());
const IOC_TREE_SEARCH: u32 = ioc(IOC_READ | IOC_WRITE, 17, std::mem::size_of::<SearchArgs>());
const IOC_INO_LOOKUP: u32 = ioc(
    IOC_READ | IOC_WRITE,
    18,
    std::mem::size_of::<InoLookupArgs>(),
);
const IOC_SUBVOL_GETFLAGS: u32 = ioc(IOC_READ, 25, std::mem::size_of::<u64>());
const IOC_SUBVOL_SETFLAGS: u32 = ioc(IOC_WRITE, 26, std::mem::size_of::<u64>());

#[derive(Debug, thiserror::Error)]
pub enum BtrfsError {
    #[error("failed to {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid subvolume name {0:?}: must be one non-empty path component")]
    InvalidName(String),
    #[error("{0} is not a btrfs subvolume")]
    NotSubvolume(PathBuf),
}

impl BtrfsError {
    fn io(op: &'static str, path: &Path, source: impl Into<io::Error>) -> Self {
        BtrfsError::Io {
            op,
            path: path.to_path_buf(),
            source: source.into(),
        }
    }

    /// The OS error code, when this is an I/O error.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            BtrfsError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Wraps one btrfs ioctl: `-1` becomes `io::Error::last_os_error()`.
///
/// # Safety
/// `arg` must point to a live, properly sized and aligned value of the struct the kernel
/// expects for `request` (the size encoded in `request`), valid for reads and writes for the
/// duration of the call.
unsafe fn btrfs_ioctl<T>(fd: &impl AsFd, request: u32, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: the fd is owned and open for the duration of the call (borrowed through AsFd);
    // the caller guarantees `arg` matches what `request` expects.
    let rc = unsafe { libc::ioctl(fd.as_fd().as_raw_fd(), request as libc::Ioctl, arg) };
    if rc == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens a directory without following a symlink in the final component.
fn open_dir(path: &Path) -> Result<OwnedFd, BtrfsError> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| BtrfsError::io("open directory", path, e))
}

/// Opens `rel` strictly beneath `dirfd`, never following any symlink on the way.
fn open_beneath(dirfd: &OwnedFd, rel: &Path, display: &Path) -> Result<OwnedFd, BtrfsError> {
    let rel: &Path = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    rustix::fs::openat2(
        dirfd,
        rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| BtrfsError::io("open (beneath, no symlinks)", display, e))
}

fn check_name(name: &str) -> Result<(), BtrfsError> {
    let ok = !name.is_empty()
        && name.len() <= BTRFS_SUBVOL_NAME_MAX
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0');
    if ok {
        Ok(())
    } else {
        Err(BtrfsError::InvalidName(name.to_string()))
    }
}

fn copy_name(dst: &mut [u8], name: &str) {
    // check_name bounds the length below dst.len(), leaving the NUL terminator in place.
    dst[..name.len()].copy_from_slice(name.as_bytes());
}

/// Whether `path` lies on a btrfs filesystem (statfs magic).
pub fn is_btrfs(path: &Path) -> Result<bool, BtrfsError> {
    let st = rustix::fs::statfs(path).map_err(|e| BtrfsError::io("statfs", path, e))?;
    Ok(st.f_type as i64 == BTRFS_SUPER_MAGIC)
}

/// Whether `path` (not followed if a symlink) is the root directory of a btrfs subvolume.
pub fn is_subvolume(path: &Path) -> Result<bool, BtrfsError> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(BtrfsError::io("stat", path, e)),
    };
    if !md.is_dir() || md.ino() != SUBVOLUME_ROOT_INO {
        return Ok(false);
    }
    is_btrfs(path)
}

fn require_subvolume(path: &Path) -> Result<(), BtrfsError> {
    if is_subvolume(path)? {
        Ok(())
    } else {
        Err(BtrfsError::NotSubvolume(path.to_path_buf()))
    }
}

/// Creates an empty subvolume `parent_dir/name` (BTRFS_IOC_SUBVOL_CREATE).
pub fn create_subvolume(parent_dir: &Path, name: &str) -> Result<(), BtrfsError> {
    check_name(name)?;
    let parent = open_dir(parent_dir)?;
    let mut args = VolArgs {
        fd: 0,
        name: [0; BTRFS_PATH_NAME_MAX + 1],
    };
    copy_name(&mut args.name, name);
    // SAFETY: `args` is a live btrfs_ioctl_vol_args (size asserted at compile time), NUL
    // terminated because check_name bounds the name below the buffer size.
    unsafe { btrfs_ioctl(&parent, IOC_SUBVOL_CREATE, &mut args) }
        .map_err(|e| BtrfsError::io("create subvolume", &parent_dir.join(name), e))?;
    Ok(())
}

/// Snapshots subvolume `src_subvol` to `dst_parent_dir/name` (BTRFS_IOC_SNAP_CREATE_V2), read-only
/// when `readonly`. O(1) in the size of the source; it commits a btrfs transaction.
pub fn snapshot(
    src_subvol: &Path,
    dst_parent_dir: &Path,
    name: &str,
    readonly: bool,
) -> Result<(), BtrfsError> {
    check_name(name)?;
    let src = open_dir(src_subvol)?;
    let dst = open_dir(dst_parent_dir)?;
    let mut args = VolArgsV2 {
        fd: i64::from(src.as_raw_fd()),
        transid: 0,
        flags: if readonly { BTRFS_SUBVOL_RDONLY } else { 0 },
        unused: [0; 4],
        name: [0; BTRFS_SUBVOL_NAME_MAX + 1],
    };
    copy_name(&mut args.name, name);
    // SAFETY: `args` is a live btrfs_ioctl_vol_args_v2 (size asserted), its fd field names `src`
    // which stays open across the call, and the name is NUL terminated (bounded by check_name).
    unsafe { btrfs_ioctl(&dst, IOC_SNAP_CREATE_V2, &mut args) }.map_err(|e| {
        BtrfsError::io(
            "snapshot subvolume",
            &PathBuf::from(format!(
                "{} -> {}",
                src_subvol.display(),
                dst_parent_dir.join(name).display()
            )),
            e,
        )
    })?;
    Ok(())
}

fn get_flags(fd: &OwnedFd, path: &Path) -> Result<u64, BtrfsError> {
    let mut flags: u64 = 0;
    // SAFETY: SUBVOL_GETFLAGS writes one u64 through the pointer, which points to `flags`.
    unsafe { btrfs_ioctl(fd, IOC_SUBVOL_GETFLAGS, &mut flags) }
        .map_err(|e| BtrfsError::io("get subvolume flags of", path, e))?;
    Ok(flags)
}

fn set_flags(fd: &OwnedFd, path: &Path, flags: u64) -> Result<(), BtrfsError> {
    let mut flags = flags;
    // SAFETY: SUBVOL_SETFLAGS reads one u64 through the pointer, which points to `flags`.
    unsafe { btrfs_ioctl(fd, IOC_SUBVOL_SETFLAGS, &mut flags) }
        .map_err(|e| BtrfsError::io("set subvolume flags of", path, e))?;
    Ok(())
}

/// Whether the subvolume at `path` is read-only.
pub fn is_readonly(path: &Path) -> Result<bool, BtrfsError> {
    require_subvolume(path)?;
    let fd = open_dir(path)?;
    Ok(get_flags(&fd, path)? & BTRFS_SUBVOL_RDONLY != 0)
}

/// Sets or clears the read-only flag of the subvolume at `path`.
pub fn set_readonly(path: &Path, readonly: bool) -> Result<(), BtrfsError> {
    require_subvolume(path)?;
    let fd = open_dir(path)?;
    set_readonly_fd(&fd, path, readonly)
}

fn set_readonly_fd(fd: &OwnedFd, path: &Path, readonly: bool) -> Result<(), BtrfsError> {
    let flags = get_flags(fd, path)?;
    let new = if readonly {
        flags | BTRFS_SUBVOL_RDONLY
    } else {
        flags & !BTRFS_SUBVOL_RDONLY
    };
    if new != flags {
        set_flags(fd, path, new)?;
    }
    Ok(())
}

/// INO_LOOKUP: the path of directory inode `objectid` inside tree `treeid` (relative to that
/// subvolume's root, with a trailing '/' unless empty), and the tree id actually used
/// (`treeid == 0` means "the subvolume `fd` is in").
fn ino_lookup(
    fd: &OwnedFd,
    path: &Path,
    treeid: u64,
    objectid: u64,
) -> Result<(u64, PathBuf), BtrfsError> {
    let mut args = InoLookupArgs {
        treeid,
        objectid,
        name: [0; BTRFS_INO_LOOKUP_PATH_MAX],
    };
    // SAFETY: `args` is a live btrfs_ioctl_ino_lookup_args (size asserted); the kernel writes a
    // NUL-terminated path into `name` and the tree id into `treeid`.
    unsafe { btrfs_ioctl(fd, IOC_INO_LOOKUP, &mut args) }
        .map_err(|e| BtrfsError::io("look up inode path in", path, e))?;
    let name = CStr::from_bytes_until_nul(&args.name)
        .map_err(|_| BtrfsError::io("decode inode path in", path, io::ErrorKind::InvalidData))?;
    let rel = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    Ok((args.treeid, rel))
}

/// The subvolume id (tree id) of the subvolume `path` is in.
pub fn subvolume_id(path: &Path) -> Result<u64, BtrfsError> {
    let fd = open_dir(path)?;
    Ok(ino_lookup(&fd, path, 0, SUBVOLUME_ROOT_INO)?.0)
}

/// One child subvolume found by [`child_subvolumes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildSubvolume {
    pub id: u64,
    /// Path relative to the parent subvolume's root directory.
    pub rel_path: PathBuf,
}

/// The subvolumes directly nested in the subvolume at `path` (ROOT_REF items of the root tree,
/// found with BTRFS_IOC_TREE_SEARCH; needs CAP_SYS_ADMIN).
pub fn child_subvolumes(path: &Path) -> Result<Vec<ChildSubvolume>, BtrfsError> {
    let fd = open_dir(path)?;
    children_of(&fd, path)
}

fn children_of(fd: &OwnedFd, path: &Path) -> Result<Vec<ChildSubvolume>, BtrfsError> {
    let (parent_id, _) = ino_lookup(fd, path, 0, SUBVOLUME_ROOT_INO)?;
    let mut refs: Vec<(u64, u64, Vec<u8>)> = Vec::new(); // (child id, dirid, name)
    let mut min_offset = 0u64;
    loop {
        let mut args = SearchArgs {
            key: SearchKey {
                tree_id: BTRFS_ROOT_TREE_OBJECTID,
                min_objectid: parent_id,
                max_objectid: parent_id,
                min_offset,
                max_offset: u64::MAX,
                min_transid: 0,
                max_transid: u64::MAX,
                min_type: BTRFS_ROOT_REF_KEY,
                max_type: BTRFS_ROOT_REF_KEY,
                nr_items: 4096,
                ..SearchKey::default()
            },
            buf: [0; SEARCH_BUF],
        };
        // SAFETY: `args` is a live btrfs_ioctl_search_args (size asserted); the kernel fills
        // `buf` with at most `SEARCH_BUF` bytes and sets `key.nr_items` to the item count.
        unsafe { btrfs_ioctl(fd, IOC_TREE_SEARCH, &mut args) }
            .map_err(|e| BtrfsError::io("search subvolume tree of", path, e))?;
        let n = args.key.nr_items;
        if n == 0 {
            break;
        }
        let mut off = 0usize;
        let mut last_offset = None;
        for _ in 0..n {
            // struct btrfs_ioctl_search_header: transid, objectid, offset (u64), type, len (u32).
            let hdr = args.buf.get(off..off + 32).ok_or_else(|| {
                BtrfsError::io("parse search result of", path, io::ErrorKind::InvalidData)
            })?;
            let le64 = |b: &[u8]| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]));
            let objectid = le64(&hdr[8..16]);
            let offset = le64(&hdr[16..24]);
            let typ = u32::from_ne_bytes(hdr[24..28].try_into().unwrap_or([0; 4]));
            let len = u32::from_ne_bytes(hdr[28..32].try_into().unwrap_or([0; 4])) as usize;
            off += 32;
            let item = args.buf.get(off..off + len).ok_or_else(|| {
                BtrfsError::io("parse search result of", path, io::ErrorKind::InvalidData)
            })?;
            off += len;
            last_offset = Some(offset);
            if typ != BTRFS_ROOT_REF_KEY || objectid != parent_id || item.len() < 18 {
                continue;
            }
            // struct btrfs_root_ref (packed, little endian): dirid u64, sequence u64, name_len u16.
            let dirid = u64::from_le_bytes(item[0..8].try_into().unwrap_or([0; 8]));
            let name_len = u16::from_le_bytes([item[16], item[17]]) as usize;
            let name = item.get(18..18 + name_len).ok_or_else(|| {
                BtrfsError::io("parse root ref of", path, io::ErrorKind::InvalidData)
            })?;
            refs.push((offset, dirid, name.to_vec()));
        }
        match last_offset {
            Some(o) if o < u64::MAX => min_offset = o + 1,
            _ => break,
        }
    }
    let mut out = Vec::with_capacity(refs.len());
    for (id, dirid, name) in refs {
        let (_, dir) = ino_lookup(fd, path, parent_id, dirid)?;
        let name = OsStr::from_bytes(&name);
        out.push(ChildSubvolume {
            id,
            rel_path: dir.join(name),
        });
    }
    Ok(out)
}

/// Deletes the subvolume at `path` and every subvolume nested in it, children first
/// (BTRFS_IOC_SNAP_DESTROY on the parent directory). Never follows symlinks: the top-level
/// path's last component must be the subvolume itself, and nested subvolumes are reached with
/// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`. A missing `path` is not an error.
pub fn delete_subvolume(path: &Path) -> Result<(), BtrfsError> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    require_subvolume(path)?;
    let parent_path = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| BtrfsError::InvalidName(path.display().to_string()))?;
    let parent = open_dir(parent_path)?;
    let fd = open_dir(path)?;
    delete_children(&fd, path, 0)?;
    drop(fd);
    destroy_by_name(&parent, name, path)
}

/// Nesting bound: deeper trees than this are refused (a sandbox cannot make us recurse forever).
const MAX_NESTING: usize = 64;

fn delete_children(fd: &OwnedFd, path: &Path, depth: usize) -> Result<(), BtrfsError> {
    if depth > MAX_NESTING {
        return Err(BtrfsError::io(
            "delete nested subvolumes (too deep) of",
            path,
            io::Error::from_raw_os_error(libc::ELOOP),
        ));
    }
    let children = children_of(fd, path)?;
    if children.is_empty() {
        return Ok(());
    }
    // Removing a child's directory entry modifies this subvolume, which must be writable.
    set_readonly_fd(fd, path, false)?;
    for child in children {
        let child_display = path.join(&child.rel_path);
        let (dir_rel, name) = match (child.rel_path.parent(), child.rel_path.file_name()) {
            (Some(d), Some(n)) => (d.to_path_buf(), n.to_owned()),
            _ => continue,
        };
        if child
            .rel_path
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
        {
            continue;
        }
        let dir_fd = open_beneath(fd, &dir_rel, &child_display)?;
        let child_fd = open_beneath(&dir_fd, Path::new(&name), &child_display)?;
        let md = File::from(
            child_fd
                .try_clone()
                .map_err(|e| BtrfsError::io("duplicate fd of", &child_display, e))?,
        )
        .metadata()
        .map_err(|e| BtrfsError::io("stat", &child_display, e))?;
        if md.ino() != SUBVOLUME_ROOT_INO {
            return Err(BtrfsError::NotSubvolume(child_display));
        }
        delete_children(&child_fd, &child_display, depth + 1)?;
        drop(child_fd);
        let name = name
            .to_str()
            .ok_or_else(|| BtrfsError::InvalidName(child_display.display().to_string()))?;
        destroy_by_name(&dir_fd, name, &child_display)?;
    }
    Ok(())
}

fn destroy_by_name(parent: &OwnedFd, name: &str, display: &Path) -> Result<(), BtrfsError> {
    check_name(name)?;
    let mut args = VolArgs {
        fd: 0,
        name: [0; BTRFS_PATH_NAME_MAX + 1],
    };
    copy_name(&mut args.name, name);
    // SAFETY: `args` is a live btrfs_ioctl_vol_args (size asserted) with a NUL-terminated name
    // of one path component; `parent` is an open directory fd.
    unsafe { btrfs_ioctl(parent, IOC_SNAP_DESTROY, &mut args) }
        .map_err(|e| BtrfsError::io("delete subvolume", display, e))?;
    Ok(())
}

// ---------------------------------------------------------------- change detection

/// Whether the tree of the subvolume whose root directory is `path` holds anything written
/// in a transaction after `transid`: one BTRFS_IOC_TREE_SEARCH with `min_transid =
/// transid + 1` and room for one item. The search skips every subtree whose generation is
/// older, so it reads only the changed path (cost: microseconds, independent of the tree
/// size). It sees the live (uncommitted) tree, so an inode update (a write's mtime, a
/// create, an unlink) counts at once, not at the next commit. Needs CAP_SYS_ADMIN.
pub fn changed_since(path: &Path, transid: u64) -> Result<bool, BtrfsError> {
    let fd = open_dir(path)?;
    let mut args = SearchArgs {
        key: SearchKey {
            tree_id: 0,
            min_objectid: 0,
            max_objectid: u64::MAX,
            min_offset: 0,
            max_offset: u64::MAX,
            min_transid: transid.saturating_add(1),
            max_transid: u64::MAX,
            min_type: 0,
            max_type: u32::MAX,
            nr_items: 1,
            ..SearchKey::default()
        },
        buf: [0; SEARCH_BUF],
    };
    // SAFETY: `args` is a live btrfs_ioctl_search_args (size asserted); the kernel fills
    // `buf` with at most `SEARCH_BUF` bytes and sets `key.nr_items` to the item count.
    unsafe { btrfs_ioctl(&fd, IOC_TREE_SEARCH, &mut args) }
        .map_err(|e| BtrfsError::io("search subvolume tree of", path, e))?;
    Ok(args.key.nr_items > 0)
}

// ---- change tracking: subvolume info, tree search from a generation, inode back-references ----

const BTRFS_INODE_ITEM_KEY: u32 = 1;
const BTRFS_INODE_REF_KEY: u32 = 12;
const BTRFS_INODE_EXTREF_KEY: u32 = 13;
const BTRFS_XATTR_ITEM_KEY: u32 = 24;
const BTRFS_DIR_ITEM_KEY: u32 = 84;
const BTRFS_DIR_INDEX_KEY: u32 = 96;
const BTRFS_EXTENT_DATA_KEY: u32 = 108;
/// Highest objectid of an ordinary inode (`BTRFS_LAST_FREE_OBJECTID`, -256).
const BTRFS_LAST_FREE_OBJECTID: u64 = u64::MAX - 255;

/// `struct btrfs_ioctl_timespec`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IoctlTimespec {
    sec: u64,
    nsec: u32,
}

/// `struct btrfs_ioctl_get_subvol_info_args`.
#[repr(C)]
struct SubvolInfoArgs {
    treeid: u64,
    name: [u8; 256],
    parent_id: u64,
    dirid: u64,
    generation: u64,
    flags: u64,
    uuid: [u8; 16],
    parent_uuid: [u8; 16],
    received_uuid: [u8; 16],
    ctransid: u64,
    otransid: u64,
    stransid: u64,
    rtransid: u64,
    ctime: IoctlTimespec,
    otime: IoctlTimespec,
    stime: IoctlTimespec,
    rtime: IoctlTimespec,
    reserved: [u64; 8],
}
const _: () = assert!(std::mem::size_of::<SubvolInfoArgs>() == 504);
const IOC_GET_SUBVOL_INFO: u32 = ioc(IOC_READ, 60, std::mem::size_of::<SubvolInfoArgs>());

/// What [`subvolume_info`] reports about one subvolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubvolumeInfo {
    /// Tree id (subvolume id).
    pub tree_id: u64,
    pub uuid: [u8; 16],
    /// UUID of the subvolume this one was snapshotted from (zero when created empty).
    pub parent_uuid: [u8; 16],
    /// Transaction that created it (for a snapshot: the one that cut it).
    pub otransid: u64,
    /// Last committed generation of the subvolume's root item.
    pub generation: u64,
    /// Last transaction that changed its tree.
    pub ctransid: u64,
}

/// BTRFS_IOC_GET_SUBVOL_INFO on the subvolume root at `path` (never follows a final symlink).
pub fn subvolume_info(path: &Path) -> Result<SubvolumeInfo, BtrfsError> {
    let fd = open_dir(path)?;
    let zero_ts = IoctlTimespec { sec: 0, nsec: 0 };
    let mut args = SubvolInfoArgs {
        treeid: 0,
        name: [0; 256],
        parent_id: 0,
        dirid: 0,
        generation: 0,
        flags: 0,
        uuid: [0; 16],
        parent_uuid: [0; 16],
        received_uuid: [0; 16],
        ctransid: 0,
        otransid: 0,
        stransid: 0,
        rtransid: 0,
        ctime: zero_ts,
        otime: zero_ts,
        stime: zero_ts,
        rtime: zero_ts,
        reserved: [0; 8],
    };
    // SAFETY: `args` is a live btrfs_ioctl_get_subvol_info_args (size asserted against the
    // kernel's 504 bytes); the kernel only writes into it.
    unsafe { btrfs_ioctl(&fd, IOC_GET_SUBVOL_INFO, &mut args) }
        .map_err(|e| BtrfsError::io("get subvolume info of", path, e))?;
    Ok(SubvolumeInfo {
        tree_id: args.treeid,
        uuid: args.uuid,
        parent_uuid: args.parent_uuid,
        otransid: args.otransid,
        generation: args.generation,
        ctransid: args.ctransid,
    })
}

/// Inodes whose items sit in tree blocks written at or after a transaction, found by
/// [`changed_inodes`].
#[derive(Debug, Default, Clone)]
pub struct ChangedInodes {
    /// Every inode with at least one item (inode item, refs, xattrs, extents, dir entries) in
    /// a tree block of generation >= the threshold. A superset of the inodes that changed:
    /// unchanged neighbours in the same leaf are included.
    pub inodes: std::collections::BTreeSet<u64>,
    /// The subset known to be directories (dir entries seen, or a directory inode item).
    pub dirs: std::collections::BTreeSet<u64>,
}

/// Walks the fs tree of subvolume `tree_id` (the volume is reached through `path`) with
/// BTRFS_IOC_TREE_SEARCH and `min_transid`: the kernel skips every tree block older than
/// `min_transid`, so only the leaves written since then are read (the `btrfs subvolume
/// find-new` technique). Needs CAP_SYS_ADMIN.
pub fn changed_inodes(
    path: &Path,
    tree_id: u64,
    min_transid: u64,
) -> Result<ChangedInodes, BtrfsError> {
    let fd = open_dir(path)?;
    let mut out = ChangedInodes::default();
    let mut key = SearchKey {
        tree_id,
        min_objectid: SUBVOLUME_ROOT_INO,
        max_objectid: BTRFS_LAST_FREE_OBJECTID,
        min_offset: 0,
        max_offset: u64::MAX,
        min_transid,
        max_transid: u64::MAX,
        min_type: 0,
        max_type: u32::MAX,
        ..SearchKey::default()
    };
    loop {
        let mut last = None;
        search(&fd, path, &mut key, |objectid, typ, offset, item| {
            last = Some((objectid, typ, offset));
            match typ {
                BTRFS_INODE_ITEM_KEY => {
                    out.inodes.insert(objectid);
                    // struct btrfs_inode_item: mode (le32) at byte 52.
                    if let Some(m) = item.get(52..56) {
                        let mode = u32::from_le_bytes([m[0], m[1], m[2], m[3]]);
                        if mode & libc::S_IFMT == libc::S_IFDIR {
                            out.dirs.insert(objectid);
                        }
                    }
                }
                BTRFS_DIR_ITEM_KEY | BTRFS_DIR_INDEX_KEY => {
                    out.inodes.insert(objectid);
                    out.dirs.insert(objectid);
                }
                BTRFS_INODE_REF_KEY => {
                    out.inodes.insert(objectid);
                    if offset >= SUBVOLUME_ROOT_INO {
                        out.inodes.insert(offset);
                        out.dirs.insert(offset);
                    }
                }
                BTRFS_INODE_EXTREF_KEY | BTRFS_XATTR_ITEM_KEY | BTRFS_EXTENT_DATA_KEY => {
                    out.inodes.insert(objectid);
                }
                _ => {}
            }
        })?;
        // Continue right after the last key returned (objectid, type, offset order).
        let Some((o, t, off)) = last else { break };
        if off < u64::MAX {
            (key.min_objectid, key.min_type, key.min_offset) = (o, t, off + 1);
        } else if t < u32::MAX {
            (key.min_objectid, key.min_type, key.min_offset) = (o, t + 1, 0);
        } else if o < key.max_objectid {
            (key.min_objectid, key.min_type, key.min_offset) = (o + 1, 0, 0);
        } else {
            break;
        }
    }
    Ok(out)
}

/// The directories holding a link to inode `ino` in subvolume `tree_id` (INODE_REF and
/// INODE_EXTREF items; one entry per parent directory). Needs CAP_SYS_ADMIN.
pub fn inode_parents(path: &Path, tree_id: u64, ino: u64) -> Result<Vec<u64>, BtrfsError> {
    let fd = open_dir(path)?;
    let mut parents = Vec::new();
    let mut key = SearchKey {
        tree_id,
        min_objectid: ino,
        max_objectid: ino,
        min_offset: 0,
        max_offset: u64::MAX,
        min_transid: 0,
        max_transid: u64::MAX,
        min_type: BTRFS_INODE_REF_KEY,
        max_type: BTRFS_INODE_EXTREF_KEY,
        ..SearchKey::default()
    };
    loop {
        let mut last = None;
        search(&fd, path, &mut key, |objectid, typ, offset, item| {
            last = Some((typ, offset));
            if objectid != ino {
                return;
            }
            if typ == BTRFS_INODE_REF_KEY {
                parents.push(offset);
            } else if typ == BTRFS_INODE_EXTREF_KEY {
                // A run of struct btrfs_inode_extref: parent u64, index u64, name_len u16, name.
                let mut rest = item;
                while rest.len() >= 18 {
                    parents.push(u64::from_le_bytes(rest[0..8].try_into().unwrap_or([0; 8])));
                    let n = u16::from_le_bytes([rest[16], rest[17]]) as usize;
                    rest = rest.get(18 + n..).unwrap_or(&[]);
                }
            }
        })?;
        let Some((t, off)) = last else { break };
        if off < u64::MAX {
            (key.min_type, key.min_offset) = (t, off + 1);
        } else if t < BTRFS_INODE_EXTREF_KEY {
            (key.min_type, key.min_offset) = (t + 1, 0);
        } else {
            break;
        }
    }
    parents.sort_unstable();
    parents.dedup();
    Ok(parents)
}

/// The path of directory inode `dir_ino` in subvolume `tree_id`, relative to its root (empty
/// for the root itself; no trailing '/'). Needs CAP_SYS_ADMIN.
pub fn dir_path(path: &Path, tree_id: u64, dir_ino: u64) -> Result<PathBuf, BtrfsError> {
    let fd = open_dir(path)?;
    let (_, rel) = ino_lookup(&fd, path, tree_id, dir_ino)?;
    let bytes = rel.as_os_str().as_bytes();
    let trimmed = bytes.strip_suffix(b"/").unwrap_or(bytes);
    Ok(PathBuf::from(OsStr::from_bytes(trimmed)))
}

/// One TREE_SEARCH call with `key` (its `nr_items` is set here); calls `f(objectid, type,
/// offset, item bytes)` for every item returned.
fn search(
    fd: &OwnedFd,
    path: &Path,
    key: &mut SearchKey,
    mut f: impl FnMut(u64, u32, u64, &[u8]),
) -> Result<(), BtrfsError> {
    let mut args = SearchArgs {
        key: SearchKey {
            nr_items: 4096,
            ..*key
        },
        buf: [0; SEARCH_BUF],
    };
    // SAFETY: `args` is a live btrfs_ioctl_search_args (size asserted); the kernel fills
    // `buf` with at most `SEARCH_BUF` bytes and sets `key.nr_items` to the item count.
    unsafe { btrfs_ioctl(fd, IOC_TREE_SEARCH, &mut args) }
        .map_err(|e| BtrfsError::io("search the fs tree of", path, e))?;
    let mut off = 0usize;
    for _ in 0..args.key.nr_items {
        let hdr = args.buf.get(off..off + 32).ok_or_else(|| {
            BtrfsError::io("parse search result of", path, io::ErrorKind::InvalidData)
        })?;
        let u64_at = |i: usize| u64::from_ne_bytes(hdr[i..i + 8].try_into().unwrap_or([0; 8]));
        let objectid = u64_at(8);
        let offset = u64_at(16);
        let typ = u32::from_ne_bytes(hdr[24..28].try_into().unwrap_or([0; 4]));
        let len = u32::from_ne_bytes(hdr[28..32].try_into().unwrap_or([0; 4])) as usize;
        off += 32;
        let item = args.buf.get(off..off + len).ok_or_else(|| {
            BtrfsError::io("parse search result of", path, io::ErrorKind::InvalidData)
        })?;
        off += len;
        f(objectid, typ, offset, item);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loopdev::test_support::BtrfsImage;

    /// Needs root and btrfs-progs (mkfs.btrfs); fails loudly otherwise.
    fn img() -> BtrfsImage {
        BtrfsImage::new().expect("create btrfs test image (needs root, btrfs-progs)")
    }

    #[test]
    fn ioctl_numbers_match_kernel_headers() {
        assert_eq!(IOC_SUBVOL_CREATE, 0x5000_940E);
        assert_eq!(IOC_SNAP_DESTROY, 0x5000_940F);
        assert_eq!(IOC_SNAP_CREATE_V2, 0x5000_9417);
        assert_eq!(IOC_TREE_SEARCH, 0xD000_9411);
        assert_eq!(IOC_INO_LOOKUP, 0xD000_9412);
        assert_eq!(IOC_SUBVOL_GETFLAGS, 0x8008_9419);
        assert_eq!(IOC_SUBVOL_SETFLAGS, 0x4008_941A);
        assert_eq!(IOC_GET_SUBVOL_INFO, 0x81F8_943C);
    }

    #[test]
    fn names_are_single_components() {
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            assert!(
                matches!(check_name(bad), Err(BtrfsError::InvalidName(_))),
                "{bad:?}"
            );
        }
        assert!(check_name("rootfs").is_ok());
    }

    #[test]
    fn changes_after_a_snapshot_are_seen_at_once() {
        let img = img();
        let root = img.mountpoint();
        create_subvolume(root, "sb").unwrap();
        let sb = root.join("sb");
        std::fs::write(sb.join("f"), vec![1u8; 100_000]).unwrap();
        for i in 0..200 {
            std::fs::write(sb.join(format!("g{i}")), b"x").unwrap();
        }
        let check = |snap: &str| {
            let t = subvolume_info(&root.join(snap)).unwrap().otransid;
            changed_since(&sb, t).unwrap()
        };
        snapshot(&sb, root, "s1", true).unwrap();
        assert!(!check("s1"), "nothing written since the snapshot");
        // Timed: the check is one search that reads only changed paths.
        let t0 = std::time::Instant::now();
        for _ in 0..1000 {
            assert!(!check("s1"));
        }
        eprintln!("unchanged check: {:?} each", t0.elapsed() / 1000);
        // An in-place overwrite of an existing file (no commit in between) counts.
        {
            use std::io::{Seek, Write};
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(sb.join("f"))
                .unwrap();
            f.seek(std::io::SeekFrom::Start(5000)).unwrap();
            f.write_all(b"changed").unwrap();
        }
        // An in-place overwrite lives in the page cache and btrfs' delayed inode items
        // until writeback / the next commit: not seen yet, seen after a commit.
        assert!(!check("s1"), "overwrites are only seen once committed");
        File::open(&sb).unwrap().sync_all().unwrap();
        rustix::fs::syncfs(File::open(&sb).unwrap()).unwrap();
        assert!(check("s1"), "a committed overwrite must count");
        snapshot(&sb, root, "s2", true).unwrap();
        assert!(!check("s2"));
        std::fs::remove_file(sb.join("g7")).unwrap();
        assert!(check("s2"), "an unlink must count");
        snapshot(&sb, root, "s3", true).unwrap();
        assert!(!check("s3"));
        std::fs::write(sb.join("new"), b"1").unwrap();
        assert!(check("s3"), "a create must count");
        let t = subvolume_info(&sb).unwrap();
        assert!(t.ctransid > 0 && t.generation > 0);
    }

    #[test]
    fn create_snapshot_readonly_delete() {
        let img = img();
        let root = img.mountpoint();
        assert!(is_btrfs(root).unwrap());
        assert!(!is_btrfs(Path::new("/proc")).unwrap());

        create_subvolume(root, "tmpl").unwrap();
        let tmpl = root.join("tmpl");
        assert!(is_subvolume(&tmpl).unwrap());
        std::fs::write(tmpl.join("hello"), b"world").unwrap();
        set_readonly(&tmpl, true).unwrap();
        assert!(is_readonly(&tmpl).unwrap());
        assert!(std::fs::write(tmpl.join("x"), b"y").is_err());

        snapshot(&tmpl, root, "sb", false).unwrap();
        let sb = root.join("sb");
        assert!(is_subvolume(&sb).unwrap());
        assert!(!is_readonly(&sb).unwrap());
        assert_eq!(std::fs::read(sb.join("hello")).unwrap(), b"world");
        std::fs::write(sb.join("new"), b"1").unwrap();
        assert!(!tmpl.join("new").exists(), "snapshot must be independent");

        snapshot(&sb, root, "ro", true).unwrap();
        assert!(is_readonly(&root.join("ro")).unwrap());
        assert_ne!(subvolume_id(&sb).unwrap(), subvolume_id(&tmpl).unwrap());

        // A plain directory is not a subvolume and cannot be deleted as one.
        std::fs::create_dir(root.join("plain")).unwrap();
        assert!(!is_subvolume(&root.join("plain")).unwrap());
        assert!(matches!(
            delete_subvolume(&root.join("plain")),
            Err(BtrfsError::NotSubvolume(_))
        ));

        for p in [&sb, &root.join("ro"), &tmpl] {
            delete_subvolume(p).unwrap();
            assert!(!p.exists());
        }
        // Missing is fine (idempotent).
        delete_subvolume(&sb).unwrap();
        // Errors carry the path.
        let err = snapshot(&root.join("nope"), root, "x", false).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn delete_removes_nested_subvolumes_without_following_symlinks() {
        let img = img();
        let root = img.mountpoint();
        create_subvolume(root, "outside").unwrap();
        std::fs::write(root.join("outside/keep"), b"k").unwrap();

        create_subvolume(root, "sb").unwrap();
        let sb = root.join("sb");
        std::fs::create_dir_all(sb.join("a/b")).unwrap();
        create_subvolume(&sb.join("a/b"), "n1").unwrap();
        create_subvolume(&sb.join("a/b/n1"), "n2").unwrap();
        create_subvolume(&sb, "top").unwrap();
        std::fs::write(sb.join("a/b/n1/n2/f"), b"x").unwrap();
        set_readonly(&sb.join("a/b/n1/n2"), true).unwrap();
        set_readonly(&sb.join("a/b/n1"), true).unwrap();
        // A symlink pointing out of the sandbox at another subvolume must not be followed.
        std::os::unix::fs::symlink(root.join("outside"), sb.join("link")).unwrap();

        let mut kids: Vec<_> = child_subvolumes(&sb)
            .unwrap()
            .into_iter()
            .map(|c| c.rel_path)
            .collect();
        kids.sort();
        assert_eq!(kids, vec![PathBuf::from("a/b/n1"), PathBuf::from("top")]);

        delete_subvolume(&sb).unwrap();
        assert!(!sb.exists());
        assert_eq!(std::fs::read(root.join("outside/keep")).unwrap(), b"k");
        assert!(
            child_subvolumes(root)
                .unwrap()
                .iter()
                .all(|c| c.rel_path == Path::new("outside"))
        );
    }

    #[test]
    fn top_level_symlink_is_not_followed() {
        let img = img();
        let root = img.mountpoint();
        create_subvolume(root, "real").unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("link")).unwrap();
        assert!(!is_subvolume(&root.join("link")).unwrap());
        assert!(delete_subvolume(&root.join("link")).is_err());
        assert!(root.join("real").exists());
    }
}
