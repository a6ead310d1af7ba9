//! Applies one image layer (a tar stream, any compression) to a rootfs on the host, as root,
//! treating every byte of it as hostile (decision 0017):
//! - every path is resolved from the rootfs's directory descriptor with `RESOLVE_BENEATH`, so
//!   no entry is ever written outside it: `..` components and absolute names are refused, and
//!   so is an entry whose parent resolves through a symlink leading out of the tree;
//! - the last component is never followed: files are created `O_EXCL|O_NOFOLLOW` after what
//!   was there is removed, so a symlink an earlier entry or layer planted is replaced, never
//!   written through;
//! - whiteouts (`.wh.NAME`) remove what lower layers made, opaque markers (`.wh..wh..opq`)
//!   empty a directory of everything lower layers put in it;
//! - hardlinks, xattrs (file capabilities included), owners, modes and mtimes are kept;
//!   device nodes are dropped with a note (a sandbox never gets a host device from an image).

#[doc(hidden)]
pub mod fuzzing;

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{
    self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags,
};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

/// A layer that cannot be applied: what is wrong, and with which entry.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("layer entry {entry:?} {reason}")]
    Entry { entry: String, reason: String },
    #[error("cannot read the layer: {0}")]
    Stream(String),
    #[error("{op} {path:?}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: io::Error,
    },
}

/// What a layer did, for the template's progress output.
#[derive(Debug, Default)]
pub struct LayerStats {
    pub entries: u64,
    pub bytes: u64,
    /// The digest of the uncompressed stream (`sha256:...`), the image config's diff id.
    pub diff_id: String,
    pub notes: Vec<String>,
}

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";
/// Device nodes named one by one in the note before the rest are only counted.
const NAMED_DEVICES: usize = 5;

/// Applies the (gzip-, zstd- or un-compressed: detected from its first bytes) layer `layer`
/// to the directory `root`.
pub fn apply_layer(root: &Path, layer: impl Read) -> Result<LayerStats, UnpackError> {
    let root_fd = rfs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open", root.display().to_string(), e))?;
    let mut input = BufReader::with_capacity(256 * 1024, layer);
    let magic = input
        .fill_buf()
        .map_err(|e| UnpackError::Stream(e.to_string()))?;
    let decoded: Box<dyn Read> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(input))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(
            zstd::stream::read::Decoder::with_buffer(input)
                .map_err(|e| UnpackError::Stream(e.to_string()))?,
        )
    } else {
        Box::new(input)
    };
    let mut hashed = Hashing::new(decoded);
    let mut unpacker = Unpacker {
        root: root_fd,
        created: HashSet::new(),
        parent: None,
        devices: Vec::new(),
        stats: LayerStats::default(),
    };
    {
        let mut archive = tar::Archive::new(&mut hashed);
        let entries = archive
            .entries()
            .map_err(|e| UnpackError::Stream(e.to_string()))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| UnpackError::Stream(e.to_string()))?;
            unpacker.entry(&mut entry)?;
        }
    }
    // The tar's end-of-archive blocks and any padding count towards the diff id.
    io::copy(&mut hashed, &mut io::sink()).map_err(|e| UnpackError::Stream(e.to_string()))?;
    let mut stats = unpacker.finish();
    stats.diff_id = hashed.digest();
    Ok(stats)
}

/// A reader that hashes (sha256) and counts what passes through it.
pub struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    pub bytes: u64,
}

impl<R: Read> Hashing<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// `sha256:<hex>` of everything read so far.
    pub fn digest(&self) -> String {
        format!("sha256:{:x}", self.hasher.clone().finalize())
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A reader of a blob that fails at its end when what was read does not hash to `digest`
/// (a truncated or corrupted blob never passes as complete).
pub struct Verifying<R> {
    inner: Hashing<R>,
    digest: String,
}

impl<R: Read> Verifying<R> {
    pub fn new(inner: R, digest: &str) -> Self {
        Self {
            inner: Hashing::new(inner),
            digest: digest.to_string(),
        }
    }
}

impl<R: Read> Read for Verifying<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            let got = self.inner.digest();
            if got != self.digest {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the blob is {} bytes with digest {got}, the manifest says {} \
                         (truncated or corrupted)",
                        self.inner.bytes, self.digest
                    ),
                ));
            }
        }
        Ok(n)
    }
}

fn io_err(op: &'static str, path: String, e: impl Into<io::Error>) -> UnpackError {
    UnpackError::Io {
        op,
        path,
        source: e.into(),
    }
}

fn shown(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

/// The components of an entry's name: `.` and empty ones dropped; `..` and absolute names
/// refused.
fn components(raw: &[u8]) -> Result<Vec<&[u8]>, String> {
    if raw.starts_with(b"/") {
        return Err("is an absolute path".into());
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("climbs out of the image with `..`".into()),
            c => out.push(c),
        }
    }
    Ok(out)
}

struct Unpacker {
    root: OwnedFd,
    /// Paths this layer created (an opaque marker keeps them).
    created: HashSet<Vec<u8>>,
    /// The last parent directory resolved (entries come grouped by directory).
    parent: Option<(Vec<u8>, OwnedFd)>,
    devices: Vec<String>,
    stats: LayerStats,
}

impl Unpacker {
    fn finish(mut self) -> LayerStats {
        if !self.devices.is_empty() {
            let n = self.devices.len();
            let mut named: Vec<_> = self.devices.iter().take(NAMED_DEVICES).cloned().collect();
            if n > NAMED_DEVICES {
                named.push(format!("and {} more", n - NAMED_DEVICES));
            }
            self.stats.notes.push(format!(
                "dropped {n} device node{} (sandboxes get their own /dev): {}",
                if n == 1 { "" } else { "s" },
                named.join(", ")
            ));
        }
        self.stats
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let raw = entry.path_bytes().into_owned();
        let refuse = |reason: String| UnpackError::Entry {
            entry: shown(&raw),
            reason,
        };
        let comps = components(&raw).map_err(refuse)?;
        let Some((name, dirs)) = comps.split_last() else {
            // The root itself (`./`): its metadata is the rootfs's own.
            return Ok(());
        };
        let dir_path = dirs.join(&b'/');
        let full = comps.join(&b'/');
        self.stats.entries += 1;
        let kind = entry.header().entry_type();
        if name.starts_with(WHITEOUT) {
            let parent = self.parent_dir(&dir_path, &raw, false)?;
            if *name == OPAQUE {
                return self.opaque(&parent, &dir_path);
            }
            let target = &name[WHITEOUT.len()..];
            if target.is_empty() || target == b"." || target == b".." {
                return Err(refuse("is a whiteout of no name".into()));
            }
            return self.remove(&parent, target, &raw);
        }
        if kind.is_character_special() || kind.is_block_special() {
            self.devices.push(format!("/{}", shown(&full)));
            return Ok(());
        }
        let parent = self.parent_dir(&dir_path, &raw, true)?;
        let name_os = OsStr::from_bytes(name);
        let existing = rfs::statat(&parent, name_os, AtFlags::SYMLINK_NOFOLLOW).ok();
        let existing_dir =
            existing.is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory);
        if !(kind.is_dir() && existing_dir) && existing.is_some() {
            self.remove(&parent, name, &raw)?;
        }
        let h = entry.header();
        let mode = Mode::from_raw_mode(h.mode().map_err(|e| refuse(e.to_string()))? & 0o7777);
        let uid = h.uid().map_err(|e| refuse(e.to_string()))? as u32;
        let gid = h.gid().map_err(|e| refuse(e.to_string()))? as u32;
        let mtime = h.mtime().unwrap_or(0) as i64;
        let owner = (Some(rfs::Uid::from_raw(uid)), Some(rfs::Gid::from_raw(gid)));
        let at = |op, e: Errno| io_err(op, shown(&raw), e);
        let fd = if kind.is_file() || kind == tar::EntryType::Continuous {
            let fd = rfs::openat(
                &parent,
                name_os,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
            .map_err(|e| at("create", e))?;
            let mut file = std::fs::File::from(fd);
            let n = io::copy(entry, &mut file).map_err(|e| io_err("write", shown(&raw), e))?;
            self.stats.bytes += n;
            Some(OwnedFd::from(file))
        } else if kind.is_dir() {
            if !existing_dir {
                rfs::mkdirat(&parent, name_os, Mode::from_raw_mode(0o700))
                    .map_err(|e| at("mkdir", e))?;
            }
            Some(
                rfs::openat(
                    &parent,
                    name_os,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| at("open", e))?,
            )
        } else if kind.is_symlink() {
            let target = entry
                .link_name_bytes()
                .ok_or_else(|| refuse("is a symlink with no target".into()))?;
            rfs::symlinkat(OsStr::from_bytes(&target), &parent, name_os)
                .map_err(|e| at("symlink", e))?;
            None
        } else if kind.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .ok_or_else(|| refuse("is a hardlink with no target".into()))?
                .into_owned();
            let tcomps = components(&target)
                .map_err(|r| refuse(format!("is a hardlink whose target {r}")))?;
            let Some((tname, tdirs)) = tcomps.split_last() else {
                return Err(refuse("is a hardlink to the root".into()));
            };
            let tparent = self.parent_dir(&tdirs.join(&b'/'), &raw, false)?;
            rfs::linkat(
                &tparent,
                OsStr::from_bytes(tname),
                &parent,
                name_os,
                AtFlags::empty(),
            )
            .map_err(|e| {
                refuse(format!(
                    "is a hardlink to {:?}, which cannot be linked: {e}",
                    shown(&target)
                ))
            })?;
            self.created.insert(full);
            // A hardlink shares its target's inode: owner, mode and xattrs are the target's.
            return Ok(());
        } else if kind.is_fifo() {
            rfs::mknodat(&parent, name_os, FileType::Fifo, mode, 0).map_err(|e| at("mkfifo", e))?;
            None
        } else if kind.is_pax_global_extensions()
            || kind.is_pax_local_extensions()
            || kind.is_gnu_longname()
            || kind.is_gnu_longlink()
        {
            return Ok(());
        } else {
            self.stats.notes.push(format!(
                "skipped /{} (tar entry type {:?} is not supported)",
                shown(&full),
                kind
            ));
            return Ok(());
        };
        self.created.insert(full.clone());
        let Some(fd) = fd else {
            // A symlink or FIFO: owner and mtime only, never through the link.
            rfs::chownat(
                &parent,
                name_os,
                owner.0,
                owner.1,
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| at("chown", e))?;
            if kind.is_fifo() {
                rfs::chmodat(&parent, name_os, mode, AtFlags::empty())
                    .map_err(|e| at("chmod", e))?;
            }
            let _ = rfs::utimensat(&parent, name_os, &times(mtime), AtFlags::SYMLINK_NOFOLLOW);
            return Ok(());
        };
        // chown before chmod (it clears set-id bits) and before xattrs (it drops
        // security.capability).
        rfs::fchown(&fd, owner.0, owner.1).map_err(|e| at("chown", e))?;
        rfs::fchmod(&fd, mode).map_err(|e| at("chmod", e))?;
        self.xattrs(entry, &fd, &full)?;
        let _ = rfs::futimens(&fd, &times(mtime));
        Ok(())
    }

    /// Sets the entry's `SCHILY.xattr.*` PAX records on `fd`.
    fn xattrs<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        fd: &OwnedFd,
        full: &[u8],
    ) -> Result<(), UnpackError> {
        let Ok(Some(exts)) = entry.pax_extensions() else {
            return Ok(());
        };
        for ext in exts.flatten() {
            let Some(name) = ext.key_bytes().strip_prefix(b"SCHILY.xattr.") else {
                continue;
            };
            if let Err(e) = rfs::fsetxattr(
                fd,
                OsStr::from_bytes(name),
                ext.value_bytes(),
                XattrFlags::empty(),
            ) {
                self.stats.notes.push(format!(
                    "xattr {} of /{} not kept: {e}",
                    shown(name),
                    shown(full)
                ));
            }
        }
        Ok(())
    }

    /// The directory `dir` (components joined by `/`, empty for the root) resolved beneath the
    /// root; with `create`, missing directories are made (0755, root's), as tar does.
    fn parent_dir(
        &mut self,
        dir: &[u8],
        entry: &[u8],
        create: bool,
    ) -> Result<OwnedFd, UnpackError> {
        if let Some((p, fd)) = &self.parent
            && p == dir
        {
            return fd.try_clone().map_err(|e| io_err("dup", shown(entry), e));
        }
        let fd = match self.resolve(dir) {
            Err(Errno::NOENT) if create => self.create_dirs(dir, entry)?,
            Err(e) => return Err(self.resolve_error(dir, entry, e)),
            Ok(fd) => fd,
        };
        let keep = fd.try_clone().map_err(|e| io_err("dup", shown(entry), e))?;
        self.parent = Some((dir.to_vec(), keep));
        Ok(fd)
    }

    fn resolve(&self, dir: &[u8]) -> Result<OwnedFd, Errno> {
        let path: &OsStr = if dir.is_empty() {
            OsStr::new(".")
        } else {
            OsStr::from_bytes(dir)
        };
        rfs::openat2(
            &self.root,
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
    }

    fn resolve_error(&self, dir: &[u8], entry: &[u8], e: Errno) -> UnpackError {
        let reason = match e {
            Errno::XDEV => format!(
                "is written through a symlink that leads outside the image (in /{})",
                shown(dir)
            ),
            Errno::NOTDIR => format!("has a parent /{} that is not a directory", shown(dir)),
            Errno::NOENT => format!("refers to /{}, which does not exist", shown(dir)),
            Errno::LOOP => format!("has a parent /{} with a symlink loop", shown(dir)),
            e => format!("has a parent /{} that cannot be opened: {e}", shown(dir)),
        };
        UnpackError::Entry {
            entry: shown(entry),
            reason,
        }
    }

    /// Makes every missing directory of `dir`, each one resolved beneath the root again.
    fn create_dirs(&self, dir: &[u8], entry: &[u8]) -> Result<OwnedFd, UnpackError> {
        let comps: Vec<&[u8]> = dir.split(|b| *b == b'/').collect();
        let mut fd = self
            .resolve(b"")
            .map_err(|e| self.resolve_error(b"", entry, e))?;
        for i in 0..comps.len() {
            let prefix = comps[..=i].join(&b'/');
            fd = match self.resolve(&prefix) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    match rfs::mkdirat(&fd, OsStr::from_bytes(comps[i]), Mode::from_raw_mode(0o755))
                    {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io_err("mkdir", shown(&prefix), e)),
                    }
                    self.resolve(&prefix)
                        .map_err(|e| self.resolve_error(&prefix, entry, e))?
                }
                Err(e) => return Err(self.resolve_error(&prefix, entry, e)),
            };
        }
        Ok(fd)
    }

    /// [`remove_at`], forgetting the cached parent (it may be what goes).
    fn remove(&mut self, dir: &OwnedFd, name: &[u8], shown_path: &[u8]) -> Result<(), UnpackError> {
        self.parent = None;
        remove_at(dir, name, shown_path)
    }

    /// An opaque marker: everything in `dir` that this layer did not create goes.
    fn opaque(&mut self, parent: &OwnedFd, dir: &[u8]) -> Result<(), UnpackError> {
        for name in dir_names(parent, dir)? {
            let mut full = dir.to_vec();
            if !full.is_empty() {
                full.push(b'/');
            }
            full.extend_from_slice(&name);
            if !self.created.contains(&full) {
                self.remove(parent, &name, &full)?;
            }
        }
        Ok(())
    }
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

/// The names in directory `fd` (not `.` or `..`).
fn dir_names(fd: &OwnedFd, shown_path: &[u8]) -> Result<Vec<Vec<u8>>, UnpackError> {
    let dir =
        rfs::Dir::read_from(fd).map_err(|e| io_err("read directory", shown(shown_path), e))?;
    let mut out = Vec::new();
    for ent in dir {
        let ent = ent.map_err(|e| io_err("read directory", shown(shown_path), e))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(n.to_vec());
        }
    }
    Ok(out)
}

/// Removes `name` in `dir` (a whole tree if it is a directory), never following a symlink;
/// missing is fine.
pub(crate) fn remove_at(
    dir: &impl AsFd,
    name: &[u8],
    shown_path: &[u8],
) -> Result<(), UnpackError> {
    let os = OsStr::from_bytes(name);
    match rfs::unlinkat(dir, os, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => return Ok(()),
        Err(Errno::ISDIR) | Err(Errno::PERM) => {}
        Err(e) => return Err(io_err("remove", shown(shown_path), e)),
    }
    let sub = match rfs::openat(
        dir,
        os,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io_err("open", shown(shown_path), e)),
    };
    for child in dir_names(&sub, shown_path)? {
        remove_at(&sub, &child, shown_path)?;
    }
    drop(sub);
    match rfs::unlinkat(dir, os, AtFlags::REMOVEDIR) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(io_err("remove", shown(shown_path), e)),
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
