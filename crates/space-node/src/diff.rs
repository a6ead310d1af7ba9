//! Change tracking between two btrfs trees of one sandbox (decision 0011): which paths were
//! added, modified and deleted, computed from btrfs metadata.
//!
//! When one tree descends from the other (two snapshots of the same rootfs, a snapshot and
//! the live rootfs it was cut from, the template and a rootfs made from it), every tree block
//! of either side older than the base's creation transaction is shared with the base, so
//! `BTRFS_IOC_TREE_SEARCH` with `min_transid` lists only the leaves written since (the
//! `btrfs subvolume find-new` technique). The inodes in those leaves, their parent
//! directories (INODE_REF / INODE_EXTREF) and the changed directories are the only places
//! read: those directories are listed in both trees and compared by name, inode number and
//! `lstat` data; every other subtree is skipped without being opened. For trees without such
//! a relation (after a rollback, a fork's template), a full metadata walk compares both
//! trees the same way. Symlinks are never followed (every open is
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from the tree's root). File contents are
//! read only by [`add_text_diffs`]: small regular text files that were modified, both sides.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub use space_node_api::diff::{Change, ChangeKind, TEXT_DIFF_MAX_FILE, TEXT_DIFFS_MAX};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use space_sys::btrfs;

/// How a diff was computed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiffStats {
    /// The btrfs metadata search found a common base (false: full walk).
    pub pruned: bool,
    /// Directories listed (in both trees together).
    pub dirs_read: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error(transparent)]
    Btrfs(#[from] btrfs::BtrfsError),
    #[error("failed to {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(op: &'static str, path: &Path, e: impl Into<std::io::Error>) -> DiffError {
    DiffError::Io {
        op,
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// The first transaction in which `a` and `b` (subvolume roots) may differ, when one
/// descends from the other; `None` when no such relation is known. A snapshot is cut inside
/// the commit of its `otransid` once all writers of that transaction are done, and btrfs
/// COWs every shared block before the next write, so writes after it carry a later
/// generation: `otransid + 1` is exact.
fn base_transid(a: &btrfs::SubvolumeInfo, b: &btrfs::SubvolumeInfo) -> Option<u64> {
    let zero = [0u8; 16];
    if a.parent_uuid != zero && a.parent_uuid == b.parent_uuid {
        // Two snapshots of the same source: the older one is the common base.
        return Some(a.otransid.min(b.otransid) + 1);
    }
    if a.parent_uuid == b.uuid {
        // `a` was snapshotted from `b` (a snapshot of the live rootfs, or a rootfs of its
        // template): `b` at that transaction is `a`.
        return Some(a.otransid + 1);
    }
    if b.parent_uuid == a.uuid {
        return Some(b.otransid + 1);
    }
    None
}

/// The changes from tree `from` to tree `to` (both subvolume roots on the same btrfs volume),
/// sorted by path.
pub fn diff_trees(from: &Path, to: &Path) -> Result<(Vec<Change>, DiffStats), DiffError> {
    let ia = btrfs::subvolume_info(from)?;
    let ib = btrfs::subvolume_info(to)?;
    let mut w = Walker::new(from, to)?;
    match base_transid(&ia, &ib) {
        Some(min_transid) => {
            w.full = false;
            w.stats.pruned = true;
            let mut dirs: BTreeSet<Vec<u8>> = BTreeSet::new();
            for (path, info) in [(from, &ia), (to, &ib)] {
                let ch = btrfs::changed_inodes(path, info.tree_id, min_transid)?;
                let mut dir_inos: BTreeSet<u64> = ch.dirs.clone();
                for &ino in ch.inodes.difference(&ch.dirs) {
                    dir_inos.extend(btrfs::inode_parents(path, info.tree_id, ino)?);
                }
                for ino in dir_inos {
                    match btrfs::dir_path(path, info.tree_id, ino) {
                        Ok(p) => {
                            dirs.insert(p.as_os_str().as_bytes().to_vec());
                        }
                        // Gone between the search and the lookup (live tree), or an orphan.
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                w.changed.extend(ch.inodes);
            }
            for rel in dirs {
                w.compare_dir_at(&rel)?;
            }
        }
        None => w.compare_dir_at(b"")?,
    }
    Ok(w.finish())
}

/// A plain recursive walk of both trees comparing every entry (the naive baseline, used by
/// the benchmark and when no common base is known).
pub fn diff_trees_full(from: &Path, to: &Path) -> Result<(Vec<Change>, DiffStats), DiffError> {
    let mut w = Walker::new(from, to)?;
    w.compare_dir_at(b"")?;
    Ok(w.finish())
}

/// Gives the first [`TEXT_DIFFS_MAX`] modified files of `changes` whose two sides (`from`,
/// `to`) are small UTF-8 text their unified diff. A side that cannot be read as such (a
/// symlink on the way, not a regular file, too large, binary) leaves the change without one.
pub fn add_text_diffs(from: &Path, to: &Path, changes: &mut [Change]) {
    let (Ok(ra), Ok(rb)) = (open_root(from), open_root(to)) else {
        return;
    };
    let mut done = 0;
    for c in changes
        .iter_mut()
        .filter(|c| c.kind == ChangeKind::Modified && !c.is_dir)
    {
        if done == TEXT_DIFFS_MAX {
            break;
        }
        let rel = c.path.trim_start_matches('/');
        let (Some(a), Some(b)) = (read_small_text(&ra, rel), read_small_text(&rb, rel)) else {
            continue;
        };
        done += 1;
        let diff = similar::TextDiff::from_lines(&a, &b);
        let mut text = diff
            .unified_diff()
            .context_radius(3)
            .header(&format!("a{}", c.path), &format!("b{}", c.path))
            .to_string();
        if text.len() as u64 > TEXT_DIFF_MAX_FILE {
            let mut end = TEXT_DIFF_MAX_FILE as usize;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push_str("\n[the diff goes on]\n");
        }
        c.text_diff = Some(text);
    }
}

/// `rel` beneath `root` when it is a regular file of at most [`TEXT_DIFF_MAX_FILE`] bytes of
/// UTF-8 without NUL.
fn read_small_text(root: &OwnedFd, rel: &str) -> Option<String> {
    use std::io::Read;
    let fd = rustix::fs::openat2(
        root,
        rel,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
        || st.st_size as u64 > TEXT_DIFF_MAX_FILE
    {
        return None;
    }
    let mut buf = Vec::new();
    std::fs::File::from(fd)
        .take(TEXT_DIFF_MAX_FILE + 1)
        .read_to_end(&mut buf)
        .ok()?;
    if buf.len() as u64 > TEXT_DIFF_MAX_FILE || buf.contains(&0) {
        return None;
    }
    String::from_utf8(buf).ok()
}

fn open_root(path: &Path) -> Result<OwnedFd, DiffError> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open", path, e))
}

/// `rel` beneath `root` as a directory, following no symlink; `None` when it is not there or
/// not a directory.
fn open_dir_beneath(root: &OwnedFd, rel: &[u8]) -> Option<OwnedFd> {
    let rel: &[u8] = if rel.is_empty() { b"." } else { rel };
    rustix::fs::openat2(
        root,
        std::ffi::OsStr::from_bytes(rel),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Entry {
    ino: u64,
    is_dir: bool,
    kind: FileType,
}

/// The stat data compared for "modified": content and metadata changes move mtime or ctime.
type StatKey = (u32, u32, u32, i64, i64, i64, i64, i64, u64);

fn stat_key(dir: &OwnedFd, name: &[u8]) -> Option<StatKey> {
    let st = rustix::fs::statat(
        dir,
        std::ffi::OsStr::from_bytes(name),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .ok()?;
    Some((
        st.st_mode,
        st.st_uid,
        st.st_gid,
        st.st_size,
        st.st_mtime,
        st.st_mtime_nsec as i64,
        st.st_ctime,
        st.st_ctime_nsec as i64,
        st.st_rdev,
    ))
}

struct Walker {
    a_root: OwnedFd,
    b_root: OwnedFd,
    a_path: PathBuf,
    b_path: PathBuf,
    /// Inodes with items written since the base (either tree); only used when `!full`.
    changed: BTreeSet<u64>,
    /// Compare every entry's stat data (no base known, or a replaced directory).
    full: bool,
    out: BTreeMap<Vec<u8>, (ChangeKind, bool)>,
    stats: DiffStats,
}

fn join(rel: &[u8], name: &[u8]) -> Vec<u8> {
    if rel.is_empty() {
        name.to_vec()
    } else {
        let mut p = rel.to_vec();
        p.push(b'/');
        p.extend_from_slice(name);
        p
    }
}

impl Walker {
    /// A walker comparing every entry until told which inodes changed.
    fn new(from: &Path, to: &Path) -> Result<Walker, DiffError> {
        Ok(Walker {
            a_root: open_root(from)?,
            b_root: open_root(to)?,
            a_path: from.to_path_buf(),
            b_path: to.to_path_buf(),
            changed: BTreeSet::new(),
            full: true,
            out: BTreeMap::new(),
            stats: DiffStats::default(),
        })
    }

    /// The changes found, as absolute paths inside the sandbox, and the walk's statistics.
    fn finish(self) -> (Vec<Change>, DiffStats) {
        let changes = self
            .out
            .into_iter()
            .map(|(p, (kind, is_dir))| Change {
                text_diff: None,
                path: format!("/{}", String::from_utf8_lossy(&p)),
                kind,
                is_dir,
            })
            .collect();
        (changes, self.stats)
    }
    fn list(&mut self, dir: OwnedFd, display: &Path) -> Result<HashMap<Vec<u8>, Entry>, DiffError> {
        self.stats.dirs_read += 1;
        let mut out = HashMap::new();
        let mut d = rustix::fs::Dir::new(dir).map_err(|e| io_err("read directory", display, e))?;
        for ent in d.by_ref() {
            let ent = ent.map_err(|e| io_err("read directory", display, e))?;
            let name = ent.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let kind = ent.file_type();
            out.insert(
                name.to_vec(),
                Entry {
                    ino: ent.ino(),
                    is_dir: kind == FileType::Directory,
                    kind,
                },
            );
        }
        Ok(out)
    }

    /// Compares the directory at `rel` in both trees, when it is the same directory (same
    /// inode) on both sides; otherwise its parent reports it.
    fn compare_dir_at(&mut self, rel: &[u8]) -> Result<(), DiffError> {
        let (Some(da), Some(db)) = (
            open_dir_beneath(&self.a_root, rel),
            open_dir_beneath(&self.b_root, rel),
        ) else {
            return Ok(());
        };
        let same = match (rustix::fs::fstat(&da), rustix::fs::fstat(&db)) {
            (Ok(sa), Ok(sb)) => sa.st_ino == sb.st_ino,
            _ => false,
        };
        if !same && !rel.is_empty() {
            return Ok(());
        }
        let full = self.full || !same;
        self.compare_open(da, db, rel, full)
    }

    fn compare_open(
        &mut self,
        da: OwnedFd,
        db: OwnedFd,
        rel: &[u8],
        full: bool,
    ) -> Result<(), DiffError> {
        let disp_a = self.a_path.join(std::ffi::OsStr::from_bytes(rel));
        let disp_b = self.b_path.join(std::ffi::OsStr::from_bytes(rel));
        // Keep fds for stat; listing consumes a duplicate.
        let ea = self.list(
            rustix::io::dup(&da).map_err(|e| io_err("dup", &disp_a, e))?,
            &disp_a,
        )?;
        let eb = self.list(
            rustix::io::dup(&db).map_err(|e| io_err("dup", &disp_b, e))?,
            &disp_b,
        )?;
        for (name, a) in &ea {
            let path = join(rel, name);
            match eb.get(name) {
                None => self.mark_subtree(&da, name, &path, *a, ChangeKind::Deleted, true)?,
                Some(b) if a.ino != b.ino || a.kind != b.kind => {
                    if a.is_dir && b.is_dir {
                        // Replaced by another directory: compare it entry by entry.
                        self.changed_meta(&da, &db, name, &path, true, true);
                        let (Some(ca), Some(cb)) = (sub_dir(&da, name), sub_dir(&db, name)) else {
                            continue;
                        };
                        self.compare_open(ca, cb, &path, true)?;
                    } else {
                        self.out
                            .insert(path.clone(), (ChangeKind::Modified, b.is_dir));
                        if a.is_dir {
                            self.mark_subtree(&da, name, &path, *a, ChangeKind::Deleted, false)?;
                        }
                        if b.is_dir {
                            self.mark_subtree(&db, name, &path, *b, ChangeKind::Added, false)?;
                        }
                    }
                }
                Some(b) => {
                    if full || self.changed.contains(&a.ino) {
                        self.changed_meta(&da, &db, name, &path, a.is_dir, false);
                    }
                    if full
                        && a.is_dir
                        && let (Some(ca), Some(cb)) = (sub_dir(&da, name), sub_dir(&db, name))
                    {
                        self.compare_open(ca, cb, &path, true)?;
                    }
                    let _ = b;
                }
            }
        }
        for (name, b) in &eb {
            if !ea.contains_key(name) {
                let path = join(rel, name);
                self.mark_subtree(&db, name, &path, *b, ChangeKind::Added, true)?;
            }
        }
        Ok(())
    }

    /// Records `Modified` when the stat data of `name` differs (for directories only their
    /// mode and owner count: their mtime moves with every entry change, reported itself).
    fn changed_meta(
        &mut self,
        da: &OwnedFd,
        db: &OwnedFd,
        name: &[u8],
        path: &[u8],
        is_dir: bool,
        _replaced: bool,
    ) {
        let (Some(sa), Some(sb)) = (stat_key(da, name), stat_key(db, name)) else {
            return;
        };
        let differs = if is_dir {
            (sa.0, sa.1, sa.2) != (sb.0, sb.1, sb.2)
        } else {
            sa != sb
        };
        if differs {
            self.out
                .entry(path.to_vec())
                .or_insert((ChangeKind::Modified, is_dir));
        }
    }

    /// Records `kind` for `path` (when `include_self`) and everything beneath it.
    fn mark_subtree(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        path: &[u8],
        e: Entry,
        kind: ChangeKind,
        include_self: bool,
    ) -> Result<(), DiffError> {
        if include_self {
            self.out.insert(path.to_vec(), (kind, e.is_dir));
        }
        if !e.is_dir {
            return Ok(());
        }
        let Some(fd) = sub_dir(parent, name) else {
            return Ok(());
        };
        let disp = Path::new(std::ffi::OsStr::from_bytes(path)).to_path_buf();
        let dup = rustix::io::dup(&fd).map_err(|e| io_err("dup", &disp, e))?;
        let entries = self.list(dup, &disp)?;
        for (child, ce) in entries {
            let p = join(path, &child);
            self.mark_subtree(&fd, &child, &p, ce, kind, true)?;
        }
        Ok(())
    }
}

fn sub_dir(parent: &OwnedFd, name: &[u8]) -> Option<OwnedFd> {
    rustix::fs::openat(
        parent,
        std::ffi::OsStr::from_bytes(name),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

#[cfg(test)]
#[path = "diff_tests.rs"]
mod tests;
