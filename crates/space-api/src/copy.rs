//! Host-side copies between a sandbox and the local filesystem: `space cp`, and every SDK or
//! facade that writes sandbox files onto a host goes through [`download`].
//!
//! Everything a download takes from the sandbox is hostile input: names, modes, link targets,
//! file types, sizes and timing. The rules (docs/THREAT_MODEL.md, "Host-side copies"):
//! - the tree is written into a fresh staging directory beside the destination, one `*at`
//!   call at a time relative to directory descriptors that this copy created, with
//!   `O_NOFOLLOW` and `O_EXCL`: no host symlink is ever followed, and nothing is written
//!   outside the destination. Only when the whole tree has arrived is it renamed into place;
//!   a failed copy removes the staging directory and leaves the destination as it was;
//! - names are single path components (no `/`, `.`, `..`, NUL or empty name, at most 255
//!   bytes), and each may appear once in a directory;
//! - symlinks are recreated as links and never written through;
//! - no set-id, device, FIFO or socket file is created, whatever the options: modes are masked
//!   by the umask as `tar --no-same-permissions` does, and [`DownloadOptions::preserve`] keeps
//!   the permission and sticky bits, never set-uid or set-gid (a root user's copy would
//!   otherwise land a set-uid program the sandbox wrote on the host);
//! - files are new inodes: no hardlink is created, and an existing file at the destination is
//!   replaced by rename, never written through (so a host hardlink to it is left alone);
//! - the whole copy is bounded ([`DownloadOptions::max_bytes`], entries counted too), every
//!   remote call and every chunk by [`DownloadOptions::stall`];
//! - mount points below the source (/proc, /sys, /dev, tmpfs) are not descended into.
//!
//! Uploads get the mirror image in [`upload`]: a symlink in the source tree is not followed
//! unless [`UploadOptions::follow_links`], files are opened with `O_NOFOLLOW`, and devices
//! and FIFOs are refused.

use std::future::Future;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use rustix::fs::{self as rfs, AtFlags, CWD, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use crate::{ByteStream, Client, ClientError, EntryInfo, FileType, MakeDirRequest};

/// How much of the bound one entry (file, directory or symlink) costs besides its bytes, as a
/// tar header does: a tree of a million empty files is bounded too.
pub const ENTRY_COST: u64 = 512;
/// The deepest directory a download creates below its source.
pub const MAX_DEPTH: usize = 256;
/// The longest name one path component may have (Linux's NAME_MAX).
const NAME_MAX: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{path} in the sandbox")]
    Remote {
        path: String,
        #[source]
        source: ClientError,
    },
    #[error("failed to {op} {path}")]
    Local {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{0:?} must be an absolute path inside the sandbox")]
    NotAbsolute(String),
    #[error("the sandbox sent {what} in {dir}: refusing the copy")]
    Hostile { dir: String, what: String },
    #[error(
        "{0} is a device, FIFO or socket in the sandbox: only regular files, directories and symlinks are copied"
    )]
    Special(String),
    #[error("{0} is not a directory in the sandbox")]
    NotADirectory(String),
    #[error("the copy is larger than its bound of {max} bytes (--max-bytes): nothing was written")]
    TooLarge { max: u64 },
    #[error("the sandbox sent nothing for {secs} s while copying {path}: gave up")]
    Stalled { path: String, secs: u64 },
    #[error("{path} is more than {MAX_DEPTH} directories deep: refusing the copy")]
    TooDeep { path: String },
    #[error(
        "{0} is a symlink: a copy never follows one on the host; name the directory it points to"
    )]
    DestinationSymlink(PathBuf),
    #[error("cannot overwrite {what} {path} with {with}")]
    Conflict {
        path: PathBuf,
        what: &'static str,
        with: &'static str,
    },
    #[error("{0} has no parent directory to copy into")]
    NoParent(PathBuf),
    #[error("{0}: not a regular file or directory (a device, FIFO or socket): not copied")]
    LocalSpecial(PathBuf),
}

type Result<T, E = CopyError> = std::result::Result<T, E>;

/// The read side of a sandbox's files that a download needs. [`SandboxFiles`] is the real one,
/// over the REST API; the unit tests use a fake that plays a hostile daemon.
pub trait RemoteFiles {
    /// The entry at `path`, not following a symlink.
    fn stat(&self, path: &str) -> impl Future<Output = Result<EntryInfo, ClientError>> + Send;
    /// The direct children of the directory `path`.
    fn list(&self, path: &str) -> impl Future<Output = Result<Vec<EntryInfo>, ClientError>> + Send;
    /// The bytes of the regular file `path`.
    fn read(&self, path: &str) -> impl Future<Output = Result<ByteStream, ClientError>> + Send;
}

/// One sandbox's files through the REST API.
pub struct SandboxFiles<'a> {
    pub client: &'a Client,
    pub id: &'a str,
}

impl RemoteFiles for SandboxFiles<'_> {
    fn stat(&self, path: &str) -> impl Future<Output = Result<EntryInfo, ClientError>> + Send {
        self.client.stat(self.id, path)
    }
    fn list(&self, path: &str) -> impl Future<Output = Result<Vec<EntryInfo>, ClientError>> + Send {
        self.client.list_dir(self.id, path, Some(1))
    }
    fn read(&self, path: &str) -> impl Future<Output = Result<ByteStream, ClientError>> + Send {
        self.client.read_file(self.id, path)
    }
}

/// The mode bits a preserving download keeps: permissions and sticky, never set-uid or
/// set-gid.
const KEPT_MODE: u32 = 0o1777;

#[derive(Debug, Clone)]
pub struct DownloadOptions {
    /// The most bytes one copy takes: file contents plus [`ENTRY_COST`] per entry.
    pub max_bytes: u64,
    /// Keep the sandbox's permission and sticky bits (never set-id) and modification times.
    pub preserve: bool,
    /// The longest wait for any one answer or chunk from the sandbox.
    pub stall: Duration,
}

/// 8 GiB: more than any agent's working tree, less than a disk.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 30;

impl Default for DownloadOptions {
    fn default() -> Self {
        DownloadOptions {
            max_bytes: DEFAULT_MAX_BYTES,
            preserve: false,
            stall: Duration::from_secs(60),
        }
    }
}

/// What a copy did; `skipped` names what it left out and why (for the user to see).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CopyReport {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
    pub skipped: Vec<(String, &'static str)>,
}

/// A sandbox path, checked and resolved lexically: its components, and whether it names a
/// directory's contents (`/`, or ending in `/.`) rather than the directory itself.
#[derive(Debug, PartialEq, Eq)]
struct RemotePath {
    parts: Vec<String>,
    contents: bool,
}

impl RemotePath {
    fn parse(path: &str) -> Result<RemotePath> {
        if !path.starts_with('/') || path.contains('\0') {
            return Err(CopyError::NotAbsolute(path.to_owned()));
        }
        let mut parts: Vec<String> = Vec::new();
        for c in path.split('/') {
            match c {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                n => parts.push(n.to_owned()),
            }
        }
        let contents = parts.is_empty() || path.ends_with("/.");
        Ok(RemotePath { parts, contents })
    }

    fn path(&self) -> String {
        format!("/{}", self.parts.join("/"))
    }
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// A name the sandbox sent, checked to be one path component.
fn check_name<'n>(dir: &str, name: &'n str) -> Result<&'n str> {
    let bad = if name.is_empty() {
        Some("an empty name")
    } else if name == "." || name == ".." {
        Some("the name . or ..")
    } else if name.contains('/') {
        Some("a name with a /")
    } else if name.contains('\0') {
        Some("a name with a NUL byte")
    } else if name.len() > NAME_MAX {
        Some("a name longer than 255 bytes")
    } else {
        None
    };
    match bad {
        Some(what) => Err(CopyError::Hostile {
            dir: dir.to_owned(),
            what: format!("{what} ({name:?})"),
        }),
        None => Ok(name),
    }
}

fn local<'p>(op: &'static str, path: &'p Path) -> impl FnOnce(Errno) -> CopyError + 'p {
    move |e| CopyError::Local {
        op,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// The process's umask, from /proc (reading it with umask(2) would change it for a moment
/// under every other thread).
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

fn is_dir(st: &rfs::Stat) -> bool {
    rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Directory
}

/// Where the arrived tree goes once it is whole.
enum Commit {
    /// A new entry `name` in `parent` (rename, refusing to replace).
    New { parent: OwnedFd, name: String },
    /// Replace the non-directory `name` in `parent` (rename over it: never written through).
    Replace { parent: OwnedFd, name: String },
    /// Merge into the existing directory (`docker cp` onto a directory that holds the name).
    Merge { dir: OwnedFd },
}

/// Copy `src` in the sandbox to `dst` on the host, as `docker cp` places it: onto an existing
/// directory, the source goes inside it (a directory merging with one of the same name);
/// `/` and `DIR/.` copy a directory's contents; otherwise `dst` is the new name.
pub async fn download(
    remote: &impl RemoteFiles,
    src: &str,
    dst: &Path,
    opts: &DownloadOptions,
) -> Result<CopyReport> {
    let src = RemotePath::parse(src)?;
    let src_path = src.path();
    let mut top = timed(opts, &src_path, remote.stat(&src_path)).await?;
    // The user named it: a mount point is skipped only below the source, not as the source.
    top.mount_point = false;
    let top_is_dir = match top.file_type {
        FileType::Other => return Err(CopyError::Special(src_path)),
        FileType::Dir => true,
        FileType::File | FileType::Symlink => false,
    };
    if src.contents && !top_is_dir {
        return Err(CopyError::NotADirectory(src_path));
    }
    let (commit, shown) = destination(&src, top_is_dir, dst)?;

    // The staging directory: beside the new entry, or inside the directory merged into (the
    // same filesystem either way, so the commit is a rename).
    let home = match &commit {
        Commit::New { parent, .. } | Commit::Replace { parent, .. } => parent,
        Commit::Merge { dir } => dir,
    };
    let stage_name = make_stage(home, &shown)?;
    let stage_path = shown.with_file_name(&stage_name);
    let mut copy = Copy {
        remote,
        opts,
        umask: umask(),
        used: 0,
        report: CopyReport::default(),
    };
    let result = async {
        let stage = rfs::openat(home, stage_name.as_str(), DIR_FLAGS, Mode::empty())
            .map_err(local("open", &stage_path))?;
        copy.entry(&stage, &stage_path, "x", &src_path, &top, 0)
            .await?;
        if top_is_dir {
            copy.tree(&stage, &stage_path.join("x"), &src_path, &top)
                .await?;
        }
        match &commit {
            Commit::New { parent, name } => {
                rfs::renameat_with(&stage, "x", parent, name.as_str(), RenameFlags::NOREPLACE)
                    .map_err(local("rename into place", &shown))?
            }
            Commit::Replace { parent, name } => rfs::renameat(&stage, "x", parent, name.as_str())
                .map_err(local("rename into place", &shown))?,
            Commit::Merge { dir } => {
                let staged = rfs::openat(&stage, "x", DIR_FLAGS, Mode::empty())
                    .map_err(local("open", &stage_path))?;
                // Every conflict is found before anything moves, so a refused merge leaves the
                // destination as it was.
                merge(&staged, dir, &shown, false)?;
                merge(&staged, dir, &shown, true)?;
            }
        }
        Ok(())
    }
    .await;
    let cleaned = remove_tree(home, &stage_name, &stage_path, 0);
    result?;
    cleaned?;
    Ok(copy.report)
}

/// Decide where the copy goes (see [`download`]) and open what it is written relative to.
/// Returns the commit and the path the copy will have, for messages.
fn destination(src: &RemotePath, top_is_dir: bool, dst: &Path) -> Result<(Commit, PathBuf)> {
    let open_dir = |p: &Path| {
        rfs::openat(
            CWD,
            p,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(local("open", p))
    };
    match std::fs::symlink_metadata(dst) {
        Ok(m) if m.file_type().is_symlink() => Err(CopyError::DestinationSymlink(dst.to_owned())),
        Ok(m) if m.is_dir() => {
            let dir =
                rfs::openat(CWD, dst, DIR_FLAGS, Mode::empty()).map_err(local("open", dst))?;
            if src.contents {
                return Ok((Commit::Merge { dir }, dst.to_owned()));
            }
            // Into the directory, under the source's last name as the user wrote it (never a
            // name the sandbox chose).
            let name = src.parts.last().cloned().unwrap_or_default();
            let shown = dst.join(&name);
            match rfs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if is_dir(&st) => {
                    if !top_is_dir {
                        return Err(conflict(shown, "directory", "a non-directory"));
                    }
                    let inner = rfs::openat(&dir, name.as_str(), DIR_FLAGS, Mode::empty())
                        .map_err(local("open", &shown))?;
                    Ok((Commit::Merge { dir: inner }, shown))
                }
                Ok(st) => {
                    if top_is_dir {
                        return Err(conflict(shown, non_dir_kind(&st), "a directory"));
                    }
                    Ok((Commit::Replace { parent: dir, name }, shown))
                }
                Err(Errno::NOENT) => Ok((Commit::New { parent: dir, name }, shown)),
                Err(e) => Err(local("stat", &shown)(e)),
            }
        }
        // A non-directory there is replaced; nothing there is new. Either way `dst` is the name.
        found => {
            let exists = match found {
                Ok(_) => true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                Err(source) => {
                    return Err(CopyError::Local {
                        op: "stat",
                        path: dst.to_owned(),
                        source,
                    });
                }
            };
            if exists && top_is_dir {
                return Err(conflict(dst.to_owned(), "non-directory", "a directory"));
            }
            let (parent, name) = split(dst)?;
            let parent = open_dir(&parent)?;
            let commit = if exists {
                Commit::Replace { parent, name }
            } else {
                Commit::New { parent, name }
            };
            Ok((commit, dst.to_owned()))
        }
    }
}

/// How a conflict names a host entry that is not a directory.
fn non_dir_kind(st: &rfs::Stat) -> &'static str {
    if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Symlink {
        "symlink"
    } else {
        "non-directory"
    }
}

fn conflict(path: PathBuf, what: &'static str, with: &'static str) -> CopyError {
    CopyError::Conflict { path, what, with }
}

/// `a/b` -> (`a`, `b`); `b` -> (`.`, `b`). A path ending in `..` or `/` has no name to create.
fn split(p: &Path) -> Result<(PathBuf, String)> {
    let name = p
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !p.as_os_str().as_encoded_bytes().ends_with(b"/") && *n != "..")
        .ok_or_else(|| CopyError::NoParent(p.to_owned()))?;
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_owned()))
}

/// Create the staging directory in `home`, named after the copy, mode 0700.
fn make_stage(home: &OwnedFd, shown: &Path) -> Result<String> {
    let base = shown
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(64).collect::<String>())
        .unwrap_or_default();
    let pid = std::process::id();
    let mut last = Errno::EXIST;
    for attempt in 0..16u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(".{base}.space-cp-{pid}-{nanos:x}{attempt}");
        match rfs::mkdirat(home, name.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) => return Ok(name),
            Err(Errno::EXIST) => last = Errno::EXIST,
            Err(e) => {
                last = e;
                break;
            }
        }
    }
    Err(local("create a staging directory beside", shown)(last))
}

struct Copy<'r, R> {
    remote: &'r R,
    opts: &'r DownloadOptions,
    umask: u32,
    used: u64,
    report: CopyReport,
}

/// Bound one remote call by the stall time.
async fn timed<T>(
    opts: &DownloadOptions,
    path: &str,
    f: impl Future<Output = Result<T, ClientError>>,
) -> Result<T> {
    match tokio::time::timeout(opts.stall, f).await {
        Ok(r) => r.map_err(|source| CopyError::Remote {
            path: path.to_owned(),
            source,
        }),
        Err(_) => Err(CopyError::Stalled {
            path: path.to_owned(),
            secs: opts.stall.as_secs(),
        }),
    }
}

/// A directory being filled: its descriptor, where it is, and the subdirectories still to
/// fill (already created, mode 0700 until they are full).
struct Frame {
    fd: OwnedFd,
    local: PathBuf,
    remote: String,
    mode: u32,
    mtime_ms: Option<i64>,
    subdirs: std::vec::IntoIter<EntryInfo>,
}

impl<R: RemoteFiles> Copy<'_, R> {
    fn charge(&mut self, bytes: u64) -> Result<()> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.opts.max_bytes {
            return Err(CopyError::TooLarge {
                max: self.opts.max_bytes,
            });
        }
        Ok(())
    }

    /// A sandbox is live: an entry listed a moment ago may be gone when it is read. So is one
    /// whose name is not UTF-8 (the API carries names as text). Either is skipped with a note.
    fn gone_is_skipped<T>(&mut self, remote: &str, r: Result<T>) -> Result<Option<T>> {
        match r {
            Err(CopyError::Remote { source, .. }) if source.status() == Some(404) => {
                let why = if remote.contains(char::REPLACEMENT_CHARACTER) {
                    "its name is not UTF-8"
                } else {
                    "it vanished during the copy"
                };
                self.report.skipped.push((remote.to_owned(), why));
                Ok(None)
            }
            r => r.map(Some),
        }
    }

    fn mode_for(&self, mode: u32) -> u32 {
        if self.opts.preserve {
            mode & KEPT_MODE
        } else {
            mode & 0o777 & !self.umask
        }
    }

    /// Create one entry `name` in `dir` from the sandbox's `e` at `remote`. A directory is made
    /// empty (mode 0700); the caller fills it. Returns whether it made a directory.
    async fn entry(
        &mut self,
        dir: &OwnedFd,
        dir_path: &Path,
        name: &str,
        remote: &str,
        e: &EntryInfo,
        depth: usize,
    ) -> Result<bool> {
        let path = dir_path.join(name);
        let twice = || CopyError::Hostile {
            dir: remote.to_owned(),
            what: "one name twice".to_owned(),
        };
        let skip = match e.file_type {
            FileType::Other => Some("a device, FIFO or socket"),
            FileType::Dir if e.mount_point => Some("a mount point (another filesystem)"),
            _ => None,
        };
        if let Some(why) = skip {
            self.report.skipped.push((remote.to_owned(), why));
            return Ok(false);
        }
        self.charge(ENTRY_COST)?;
        match e.file_type {
            FileType::Dir => {
                if depth >= MAX_DEPTH {
                    return Err(CopyError::TooDeep {
                        path: remote.to_owned(),
                    });
                }
                match rfs::mkdirat(dir, name, Mode::from_raw_mode(0o700)) {
                    Err(Errno::EXIST) => return Err(twice()),
                    r => r.map_err(local("create", &path))?,
                }
                self.report.dirs += 1;
                Ok(true)
            }
            FileType::Symlink => {
                let target = e.symlink_target.as_deref().unwrap_or_default();
                if target.is_empty() || target.contains('\0') {
                    return Err(CopyError::Hostile {
                        dir: remote.to_owned(),
                        what: format!("a symlink target {target:?}"),
                    });
                }
                match rfs::symlinkat(target, dir, name) {
                    Err(Errno::EXIST) => return Err(twice()),
                    r => r.map_err(local("create the symlink", &path))?,
                }
                self.report.symlinks += 1;
                Ok(false)
            }
            FileType::File | FileType::Other => {
                self.file(dir, &path, name, remote, e).await?;
                Ok(false)
            }
        }
    }

    async fn file(
        &mut self,
        dir: &OwnedFd,
        path: &Path,
        name: &str,
        remote: &str,
        e: &EntryInfo,
    ) -> Result<()> {
        let Some(mut stream) = self.gone_is_skipped(
            remote,
            timed(self.opts, remote, self.remote.read(remote)).await,
        )?
        else {
            return Ok(());
        };
        // A new inode: O_EXCL, so nothing that exists is written through, not even a name
        // the sandbox sent twice. The kernel applies the umask to the mode.
        let fd = match rfs::openat(
            dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(e.mode & 0o777),
        ) {
            Err(Errno::EXIST) => {
                return Err(CopyError::Hostile {
                    dir: remote.to_owned(),
                    what: "one name twice".to_owned(),
                });
            }
            r => r.map_err(local("create", path))?,
        };
        let mut file = std::fs::File::from(fd);
        loop {
            let chunk = match tokio::time::timeout(self.opts.stall, stream.next()).await {
                Err(_) => {
                    return Err(CopyError::Stalled {
                        path: remote.to_owned(),
                        secs: self.opts.stall.as_secs(),
                    });
                }
                Ok(None) => break,
                Ok(Some(c)) => c.map_err(|source| CopyError::Remote {
                    path: remote.to_owned(),
                    source,
                })?,
            };
            self.charge(chunk.len() as u64)?;
            self.report.bytes += chunk.len() as u64;
            file.write_all(&chunk).map_err(|source| CopyError::Local {
                op: "write",
                path: path.to_owned(),
                source,
            })?;
        }
        if self.opts.preserve {
            rfs::fchmod(&file, Mode::from_raw_mode(e.mode & KEPT_MODE))
                .map_err(local("chmod", path))?;
            set_mtime(&file, path, e)?;
        }
        self.report.files += 1;
        Ok(())
    }

    /// Fill the (empty, staged) directory `root/x` from the sandbox's directory `remote`,
    /// depth first, holding one descriptor per level.
    async fn tree(
        &mut self,
        root: &OwnedFd,
        local_path: &Path,
        remote: &str,
        top: &EntryInfo,
    ) -> Result<()> {
        let fd =
            rfs::openat(root, "x", DIR_FLAGS, Mode::empty()).map_err(local("open", local_path))?;
        let mut stack = vec![
            self.fill(fd, local_path.to_owned(), remote.to_owned(), top, 0)
                .await?,
        ];
        while let Some(frame) = stack.last_mut() {
            let Some(sub) = frame.subdirs.next() else {
                let frame = stack.pop().expect("a frame");
                let mode = self.mode_for(frame.mode);
                rfs::fchmod(&frame.fd, Mode::from_raw_mode(mode))
                    .map_err(local("chmod", &frame.local))?;
                if let Some(ms) = frame.mtime_ms {
                    set_mtime_ms(&frame.fd, &frame.local, ms)?;
                }
                continue;
            };
            let lpath = frame.local.join(&sub.name);
            let remote = join_remote(&frame.remote, &sub.name);
            let fd = rfs::openat(&frame.fd, sub.name.as_str(), DIR_FLAGS, Mode::empty())
                .map_err(local("open", &lpath))?;
            let depth = stack.len();
            let next = self.fill(fd, lpath, remote, &sub, depth).await?;
            stack.push(next);
        }
        Ok(())
    }

    /// List the sandbox's directory `remote` and create its entries in `fd`; subdirectories
    /// are created empty and returned in the frame, to fill next.
    async fn fill(
        &mut self,
        fd: OwnedFd,
        local: PathBuf,
        remote: String,
        e: &EntryInfo,
        depth: usize,
    ) -> Result<Frame> {
        let entries = self
            .gone_is_skipped(
                &remote,
                timed(self.opts, &remote, self.remote.list(&remote)).await,
            )?
            .unwrap_or_default();
        let mut subdirs = Vec::new();
        for child in entries {
            let name = check_name(&remote, &child.name)?.to_owned();
            let child_remote = join_remote(&remote, &name);
            if self
                .entry(&fd, &local, &name, &child_remote, &child, depth + 1)
                .await?
            {
                subdirs.push(child);
            }
        }
        Ok(Frame {
            fd,
            local,
            remote,
            mode: e.mode,
            mtime_ms: self.opts.preserve.then(|| unix_ms(e)).flatten(),
            subdirs: subdirs.into_iter(),
        })
    }
}

fn unix_ms(e: &EntryInfo) -> Option<i64> {
    crate::unix_ms_from_rfc3339(&e.modified_at)
}

fn set_mtime(fd: &impl AsFd, path: &Path, e: &EntryInfo) -> Result<()> {
    match unix_ms(e) {
        Some(ms) => set_mtime_ms(fd, path, ms),
        None => Ok(()),
    }
}

fn set_mtime_ms(fd: &impl AsFd, path: &Path, ms: i64) -> Result<()> {
    let t = rfs::Timespec {
        tv_sec: ms.div_euclid(1000),
        tv_nsec: (ms.rem_euclid(1000) * 1_000_000) as _,
    };
    rfs::futimens(
        fd,
        &rfs::Timestamps {
            last_access: t,
            last_modification: t,
        },
    )
    .map_err(local("set the times of", path))
}

/// The names in a directory, without `.` and `..`.
fn names(dir: &OwnedFd, path: &Path) -> Result<Vec<std::ffi::CString>> {
    let mut out = Vec::new();
    for e in rfs::Dir::read_from(dir).map_err(local("list", path))? {
        let e = e.map_err(local("list", path))?;
        let n = e.file_name();
        if n != c"." && n != c".." {
            out.push(n.to_owned());
        }
    }
    Ok(out)
}

/// Move the staged directory `from`'s entries into the existing directory `into`: a new name
/// is renamed in, a directory that exists on both sides is merged, a non-directory replaces a
/// non-directory (by rename: a symlink or hardlink there is replaced, never written through).
/// With `apply` false nothing moves: only conflicts are looked for.
fn merge(from: &OwnedFd, into: &OwnedFd, path: &Path, apply: bool) -> Result<()> {
    for name in names(from, path)? {
        let shown = path.join(std::ffi::OsStr::from_bytes(name.as_bytes()));
        let src = rfs::statat(from, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(local("stat", &shown))?;
        let dst = match rfs::statat(into, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Some(st),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(local("stat", &shown)(e)),
        };
        match dst {
            None if apply => rfs::renameat_with(
                from,
                name.as_c_str(),
                into,
                name.as_c_str(),
                RenameFlags::NOREPLACE,
            )
            .map_err(local("rename into place", &shown))?,
            None => {}
            Some(d) if is_dir(&src) && is_dir(&d) => {
                let a = rfs::openat(from, name.as_c_str(), DIR_FLAGS, Mode::empty())
                    .map_err(local("open", &shown))?;
                let b = rfs::openat(into, name.as_c_str(), DIR_FLAGS, Mode::empty())
                    .map_err(local("open", &shown))?;
                if apply {
                    // Its entries move out; its own mode no longer matters.
                    rfs::fchmod(&a, Mode::from_raw_mode(0o700)).map_err(local("chmod", &shown))?;
                }
                merge(&a, &b, &shown, apply)?;
            }
            Some(d) if is_dir(&src) => {
                return Err(conflict(shown, non_dir_kind(&d), "a directory"));
            }
            Some(d) if is_dir(&d) => return Err(conflict(shown, "directory", "a non-directory")),
            Some(_) if apply => rfs::renameat(from, name.as_c_str(), into, name.as_c_str())
                .map_err(local("rename into place", &shown))?,
            Some(_) => {}
        }
    }
    Ok(())
}

/// Remove `name` in `dir` and everything below it, following no symlink.
fn remove_tree(dir: &OwnedFd, name: &str, path: &Path, depth: usize) -> Result<()> {
    let st = match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(local("stat", path)(e)),
    };
    if is_dir(&st) && depth <= MAX_DEPTH + 2 {
        let sub = rfs::openat(dir, name, DIR_FLAGS, Mode::empty()).map_err(local("open", path))?;
        let _ = rfs::fchmod(&sub, Mode::from_raw_mode(0o700));
        for n in names(&sub, path)? {
            let n = n.to_string_lossy().into_owned();
            remove_tree(&sub, &n, &path.join(&n), depth + 1)?;
        }
        rfs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(local("remove", path))
    } else {
        rfs::unlinkat(dir, name, AtFlags::empty()).map_err(local("remove", path))
    }
}

// ---- uploads ----

#[derive(Debug, Clone, Default)]
pub struct UploadOptions {
    /// Follow symlinks inside the source tree (`cp -L`); without it they are skipped with a
    /// note. A directory already on the walk's path is never entered twice.
    pub follow_links: bool,
}

/// Copy the host's `src` (a file, or a directory recursively) to `dst` in the sandbox,
/// keeping permission bits; onto an existing directory it goes inside it, as `docker cp`.
/// `src` itself is followed if it is a symlink (the user named it); below it, see
/// [`UploadOptions::follow_links`]. Devices, FIFOs and sockets are not copied.
pub async fn upload(
    client: &Client,
    id: &str,
    src: &Path,
    dst: &str,
    opts: &UploadOptions,
) -> Result<CopyReport> {
    if !dst.starts_with('/') {
        return Err(CopyError::NotAbsolute(dst.to_owned()));
    }
    let meta = std::fs::metadata(src).map_err(|source| CopyError::Local {
        op: "read",
        path: src.to_owned(),
        source,
    })?;
    if !meta.is_dir() && !meta.is_file() {
        return Err(CopyError::LocalSpecial(src.to_owned()));
    }
    let remote_err = |path: &str| {
        let path = path.to_owned();
        move |source| CopyError::Remote { path, source }
    };
    // Ask for the sandbox first: a 404 from `stat` below would otherwise be taken for "no such
    // path", and an upload to a missing sandbox is refused before its body is read, which the
    // client sees as a broken pipe rather than the server's answer.
    client.get_sandbox(id).await.map_err(remote_err(dst))?;
    let target = if remote_is_dir(client, id, dst).await? {
        let name = std::fs::canonicalize(src)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .ok_or_else(|| CopyError::NoParent(src.to_owned()))?;
        join_remote(dst, &name)
    } else {
        dst.to_owned()
    };
    let mut report = CopyReport::default();
    if meta.is_file() {
        upload_file(client, id, src, &target, true).await?;
        report.files = 1;
        report.bytes = meta.len();
        return Ok(report);
    }
    // Iterative walk: (local dir, remote dir, the (dev, ino) of the dirs above it).
    type Pending = (PathBuf, String, Vec<(u64, u64)>);
    let mut stack: Vec<Pending> = vec![(src.to_path_buf(), target, Vec::new())];
    while let Some((dir, remote, mut above)) = stack.pop() {
        let md = std::fs::metadata(&dir).map_err(|source| CopyError::Local {
            op: "stat",
            path: dir.clone(),
            source,
        })?;
        above.push((md.dev(), md.ino()));
        mkdir_remote(
            client,
            id,
            &remote,
            (md.permissions().mode() & 0o7777) | 0o700,
        )
        .await?;
        report.dirs += 1;
        let list_err = |source| CopyError::Local {
            op: "list",
            path: dir.clone(),
            source,
        };
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(list_err)?
            .collect::<Result<_, _>>()
            .map_err(list_err)?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            let r = join_remote(&remote, &e.file_name().to_string_lossy());
            let lmeta = std::fs::symlink_metadata(&path).map_err(|source| CopyError::Local {
                op: "stat",
                path: path.clone(),
                source,
            })?;
            let meta = if lmeta.file_type().is_symlink() {
                if !opts.follow_links {
                    report
                        .skipped
                        .push((path.display().to_string(), "a symlink (-L follows them)"));
                    continue;
                }
                match std::fs::metadata(&path) {
                    Ok(m) => m,
                    Err(_) => {
                        report
                            .skipped
                            .push((path.display().to_string(), "a dangling symlink"));
                        continue;
                    }
                }
            } else {
                lmeta
            };
            if meta.is_dir() {
                if above.contains(&(meta.dev(), meta.ino())) {
                    report.skipped.push((
                        path.display().to_string(),
                        "a symlink loop (a directory above it)",
                    ));
                } else {
                    stack.push((path, r, above.clone()));
                }
            } else if meta.is_file() {
                upload_file(client, id, &path, &r, opts.follow_links).await?;
                report.files += 1;
                report.bytes += meta.len();
            } else {
                report
                    .skipped
                    .push((path.display().to_string(), "a device, FIFO or socket"));
            }
        }
    }
    Ok(report)
}

async fn remote_is_dir(client: &Client, id: &str, path: &str) -> Result<bool> {
    match client.stat(id, path).await {
        Ok(e) => Ok(e.file_type == FileType::Dir),
        Err(ClientError::Api { status: 404, .. }) => Ok(false),
        Err(source) => Err(CopyError::Remote {
            path: path.to_owned(),
            source,
        }),
    }
}

async fn mkdir_remote(client: &Client, id: &str, path: &str, mode: u32) -> Result<()> {
    let req = MakeDirRequest {
        path: path.to_string(),
        user: None,
        parents: true,
        mode: Some(mode),
    };
    match client.mkdir(id, &req).await {
        Ok(_) => Ok(()),
        Err(ClientError::Api { status: 409, .. }) if remote_is_dir(client, id, path).await? => {
            Ok(())
        }
        Err(source) => Err(CopyError::Remote {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Stream one host file into the sandbox. Without `follow`, opened with O_NOFOLLOW: a file
/// swapped for a symlink after the walk saw it is refused, not followed. A non-regular file
/// (swapped for a FIFO, say) is refused too.
async fn upload_file(
    client: &Client,
    id: &str,
    path: &Path,
    remote: &str,
    follow: bool,
) -> Result<()> {
    let mut flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK;
    if !follow {
        flags |= OFlags::NOFOLLOW;
    }
    let fd = rfs::openat(CWD, path, flags, Mode::empty()).map_err(local("open", path))?;
    let file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(|source| CopyError::Local {
        op: "stat",
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_file() {
        return Err(CopyError::LocalSpecial(path.to_owned()));
    }
    let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
        tokio::fs::File::from_std(file),
        256 * 1024,
    ));
    client
        .write_file(
            id,
            remote,
            Some(meta.permissions().mode() & 0o7777),
            true,
            body,
        )
        .await
        .map_err(|source| CopyError::Remote {
            path: remote.to_owned(),
            source,
        })?;
    Ok(())
}

#[cfg(test)]
#[path = "copy_tests.rs"]
mod tests;
