//! File operations of the guest channel. Paths are absolute, normalized lexically; file data
//! is streamed in chunks and never held whole in memory. All blocking I/O runs on tokio's
//! blocking pool.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use space_proto::{EntryInfo, FileType, WriteFileOpen};
use tokio::sync::mpsc;

use crate::users::{self, UserError};

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },
    #[error("failed to {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{0}: is a directory")]
    IsDir(PathBuf),
    #[error("{0}: not a directory")]
    NotDir(PathBuf),
    #[error("{0}: not a regular file (a device, FIFO or socket): refusing to read it")]
    NotRegular(PathBuf),
    #[error("{0}: already exists")]
    Exists(PathBuf),
    #[error("refusing to remove or rename /")]
    Root,
    #[error("offset {offset} is beyond the end of {path} ({size} bytes)")]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        size: u64,
    },
    #[error("invalid write stream: {0}")]
    Protocol(&'static str),
    #[error("invalid file metadata: {0}")]
    Metadata(String),
    #[error(transparent)]
    User(#[from] UserError),
    #[error("file operation task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl FilesError {
    pub fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        FilesError::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FilesError + 'a {
    move |source| FilesError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Validate and lexically normalize an absolute path ("." and ".." resolved; never above "/").
pub fn normalize(path: &str) -> Result<PathBuf, FilesError> {
    let invalid = |reason| FilesError::InvalidPath {
        path: path.to_owned(),
        reason,
    };
    if path.is_empty() {
        return Err(invalid("empty"));
    }
    if path.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    if !path.starts_with('/') {
        return Err(invalid("must be absolute"));
    }
    let mut out = PathBuf::from("/");
    for c in Path::new(path).components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// Run blocking file work on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FilesError> + Send + 'static,
) -> Result<T, FilesError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(FilesError::Task)?
}

/// The EntryInfo of `path` (lstat: a symlink is described, not followed).
pub fn entry(path: &Path) -> Result<EntryInfo, FilesError> {
    let md = fs::symlink_metadata(path).map_err(io_err("stat", path))?;
    let parent_dev = path
        .parent()
        .and_then(|p| fs::symlink_metadata(p).ok())
        .map_or(md.dev(), |p| p.dev());
    Ok(entry_from(path, &md, parent_dev))
}

/// `parent_dev` is the device of the directory holding `path`: an entry on another device is
/// a mount point (/proc, /sys, /dev, a tmpfs), which a download does not descend into.
fn entry_from(path: &Path, md: &fs::Metadata, parent_dev: u64) -> EntryInfo {
    let ft = md.file_type();
    let kind = if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    let symlink_target = if ft.is_symlink() {
        fs::read_link(path)
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        String::new()
    };
    let modified_unix_ms = md
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as i64);
    EntryInfo {
        name: path
            .file_name()
            .map_or_else(|| "/".to_owned(), |n| n.to_string_lossy().into_owned()),
        path: path.to_string_lossy().into_owned(),
        r#type: kind as i32,
        size: md.len(),
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        modified_unix_ms,
        symlink_target,
        mount_point: ft.is_dir() && md.dev() != parent_dev,
        // Named by the service (users::Names), which reads /etc/passwd once per reply.
        owner: String::new(),
        group: String::new(),
        metadata: if ft.is_symlink() {
            Default::default()
        } else {
            read_metadata(path)
        },
    }
}

/// The prefix of the extended attributes that hold a file's metadata (E2B's convention, so
/// that code inside sees what it would see on E2B).
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";
/// Bounds on what one write may set: keys, bytes of a key, bytes of a value.
const METADATA_MAX_KEYS: usize = 64;
const METADATA_MAX_KEY: usize = 200;
const METADATA_MAX_VALUE: usize = 4096;

/// `path`'s `user.e2b.*` extended attributes, by key. Unreadable ones (a filesystem without
/// xattrs, a value that is not UTF-8) are left out: metadata never fails a stat.
fn read_metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let mut names = vec![0u8; 4096];
    let Ok(n) = rustix::fs::llistxattr(path, &mut names) else {
        return out;
    };
    let mut value = vec![0u8; METADATA_MAX_VALUE];
    for name in names[..n.min(names.len())].split(|b| *b == 0) {
        let Some(key) = name.strip_prefix(METADATA_XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let (Ok(key), Ok(full)) = (std::str::from_utf8(key), std::str::from_utf8(name)) else {
            continue;
        };
        if let Ok(len) = rustix::fs::lgetxattr(path, full, &mut value)
            && let Ok(v) = std::str::from_utf8(&value[..len.min(value.len())])
        {
            out.insert(key.to_owned(), v.to_owned());
        }
    }
    out
}

/// Checks the metadata of a write: keys are HTTP tokens (lowercased here), values printable
/// ASCII, within the bounds above.
pub(crate) fn check_metadata(
    m: &std::collections::HashMap<String, String>,
) -> Result<Vec<(String, String)>, FilesError> {
    if m.len() > METADATA_MAX_KEYS {
        return Err(FilesError::Metadata(format!(
            "at most {METADATA_MAX_KEYS} keys"
        )));
    }
    const TCHAR: &[u8] = b"!#$%&'*+-.^_`|~";
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let token = !k.is_empty()
            && k.len() <= METADATA_MAX_KEY
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || TCHAR.contains(&b));
        if !token {
            return Err(FilesError::Metadata(format!(
                "key {k:?}: 1..={METADATA_MAX_KEY} letters, digits or !#$%&'*+-.^_`|~"
            )));
        }
        if v.len() > METADATA_MAX_VALUE || !v.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err(FilesError::Metadata(format!(
                "value of {k:?}: up to {METADATA_MAX_VALUE} printable ASCII characters"
            )));
        }
        out.push((
            format!("{METADATA_XATTR_PREFIX}{}", k.to_ascii_lowercase()),
            v.clone(),
        ));
    }
    Ok(out)
}

fn set_metadata(file: &File, path: &Path, attrs: &[(String, String)]) -> Result<(), FilesError> {
    for (name, value) in attrs {
        rustix::fs::fsetxattr(
            file,
            name.as_str(),
            value.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .map_err(|e| io_err("set metadata on", path)(e.into()))?;
    }
    Ok(())
}

pub async fn stat(path: &str) -> Result<EntryInfo, FilesError> {
    let path = normalize(path)?;
    blocking(move || entry(&path)).await
}

/// A file opened for streaming: chunks arrive on the receiver; an error ends the stream.
pub type Chunks = mpsc::Receiver<Result<Vec<u8>, FilesError>>;

/// The most a read "to the end" takes of a file that is empty when opened: procfs and sysfs
/// files say 0 and hold a few KiB.
pub const EMPTY_FILE_READ_MAX: u64 = 16 << 20;

/// Open `path` and stream `length` bytes (0 = to the end) from `offset` in chunks of
/// `chunk` bytes. Open errors are returned before any chunk.
///
/// A read never goes past the end the file had when it was opened (or
/// [`EMPTY_FILE_READ_MAX`] past `offset` for a file that was empty then): a sandbox
/// appending to the file as fast as it is read cannot make a download that never ends.
pub async fn read_file(
    path: &str,
    offset: u64,
    length: u64,
    chunk: usize,
) -> Result<Chunks, FilesError> {
    let path = normalize(path)?;
    let (file, path, end) = blocking(move || {
        // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(io_err("open", &path))?;
        let md = file.metadata().map_err(io_err("stat", &path))?;
        if md.is_dir() {
            return Err(FilesError::IsDir(path));
        }
        // A device or FIFO never ends or blocks: only regular files are read (procfs and sysfs
        // files are regular).
        if !md.is_file() {
            return Err(FilesError::NotRegular(path));
        }
        if offset > md.len() {
            return Err(FilesError::OutOfRange {
                path,
                offset,
                size: md.len(),
            });
        }
        let end = match md.len() {
            0 => offset.saturating_add(EMPTY_FILE_READ_MAX),
            n => n,
        };
        Ok((file, path, end))
    })
    .await?;
    let (tx, rx) = mpsc::channel(2);
    tokio::task::spawn_blocking(move || {
        let mut file = file;
        if offset > 0
            && let Err(e) = file.seek(SeekFrom::Start(offset))
        {
            let _ = tx.blocking_send(Err(io_err("seek", &path)(e)));
            return;
        }
        let mut left = match length {
            0 => end - offset,
            n => n.min(end - offset),
        };
        while left > 0 {
            let want = (chunk as u64).min(left) as usize;
            let mut buf = vec![0u8; want];
            let mut got = 0;
            // Fill the chunk (short reads happen on pipes and special files).
            while got < want {
                match file.read(&mut buf[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let _ = tx.blocking_send(Err(io_err("read", &path)(e)));
                        return;
                    }
                }
            }
            if got == 0 {
                return;
            }
            buf.truncate(got);
            left -= got as u64;
            if tx.blocking_send(Ok(buf)).is_err() {
                return; // the client went away
            }
            if got < want {
                return;
            }
        }
    });
    Ok(rx)
}

/// A message for the blocking writer of [`write_file`].
pub enum WriteMsg {
    Data(Vec<u8>),
    /// All data was sent: make the file visible.
    Commit,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Start writing a file. Data goes to the returned sender; the file becomes visible (atomic
/// rename of a temp file in the same directory, unless `append`) only after `Commit`. If the
/// sender is dropped without `Commit`, nothing changes.
pub async fn write_file(
    root: PathBuf,
    open: WriteFileOpen,
) -> Result<
    (
        mpsc::Sender<WriteMsg>,
        tokio::task::JoinHandle<Result<EntryInfo, FilesError>>,
    ),
    FilesError,
> {
    let path = normalize(&open.path)?;
    if path.parent().is_none() {
        return Err(FilesError::IsDir(path));
    }
    check_metadata(&open.metadata)?;
    let owner = if open.user.is_empty() {
        None
    } else {
        let u = users::lookup(&root, &open.user)?;
        Some((u.uid, u.gid))
    };
    let (tx, rx) = mpsc::channel::<WriteMsg>(4);
    let task = tokio::task::spawn_blocking(move || write_blocking(path, open, owner, rx));
    Ok((tx, task))
}

fn write_blocking(
    path: PathBuf,
    open: WriteFileOpen,
    owner: Option<(u32, u32)>,
    mut rx: mpsc::Receiver<WriteMsg>,
) -> Result<EntryInfo, FilesError> {
    let parent = path.parent().unwrap_or(Path::new("/")).to_owned();
    if open.make_parents {
        make_dirs(&parent, 0o755, owner)?;
    } else {
        match fs::metadata(&parent) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(FilesError::NotDir(parent)),
            Err(e) => return Err(io_err("open parent directory", &parent)(e)),
        }
    }
    // Write through a symlink to its target, like a shell redirection would.
    let target = match fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(&path).unwrap_or(path.clone()),
        _ => path.clone(),
    };
    let existing = fs::metadata(&target).ok();
    if existing.as_ref().is_some_and(|m| m.is_dir()) {
        return Err(FilesError::IsDir(target));
    }
    let mode = if open.mode != 0 {
        open.mode & 0o7777
    } else {
        existing.as_ref().map_or(0o644, |m| m.mode() & 0o7777)
    };
    let metadata = check_metadata(&open.metadata)?;

    if open.append {
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(mode)
            .open(&target)
            .map_err(io_err("open", &target))?;
        if !receive(&mut file, &mut rx, &target)? {
            return Err(FilesError::Protocol("stream ended without commit"));
        }
        if existing.is_none() {
            set_mode_owner(&file, &target, mode, owner)?;
        } else if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                .map_err(io_err("chown", &target))?;
        }
        set_metadata(&file, &target, &metadata)?;
        return entry(&target);
    }

    let tparent = target.parent().unwrap_or(Path::new("/"));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = tparent.join(format!(
        ".{name}.space-tmp.{}.{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        if !receive(&mut file, &mut rx, &target)? {
            return Err(FilesError::Protocol("stream ended without commit"));
        }
        set_mode_owner(&file, &tmp, mode, owner)?;
        set_metadata(&file, &target, &metadata)?;
        drop(file);
        fs::rename(&tmp, &target).map_err(io_err("rename into place", &target))
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    entry(&target)
}

/// Write data messages into `file` until Commit (true) or the sender is dropped (false).
fn receive(
    file: &mut File,
    rx: &mut mpsc::Receiver<WriteMsg>,
    path: &Path,
) -> Result<bool, FilesError> {
    while let Some(msg) = rx.blocking_recv() {
        match msg {
            WriteMsg::Data(d) => file.write_all(&d).map_err(io_err("write", path))?,
            WriteMsg::Commit => return Ok(true),
        }
    }
    Ok(false)
}

fn set_mode_owner(
    file: &File,
    path: &Path,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> Result<(), FilesError> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(file, Some(uid), Some(gid)).map_err(io_err("chown", path))?;
    }
    // After chown (which clears set-id bits), and explicitly: the umask does not apply.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

/// mkdir -p with `mode` and `owner` applied to each directory it creates.
fn make_dirs(dir: &Path, mode: u32, owner: Option<(u32, u32)>) -> Result<(), FilesError> {
    let mut missing = Vec::new();
    let mut cur = dir;
    loop {
        match fs::metadata(cur) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => return Err(FilesError::NotDir(cur.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(cur.to_owned()),
            Err(e) => return Err(io_err("stat", cur)(e)),
        }
        match cur.parent() {
            Some(p) => cur = p,
            None => break,
        }
    }
    for d in missing.iter().rev() {
        match fs::DirBuilder::new().mode(mode).create(d) {
            Ok(()) => {}
            // Lost a race with another creator: fine if it is a directory.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && d.is_dir() => continue,
            Err(e) => return Err(io_err("create directory", d)(e)),
        }
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(d, Some(uid), Some(gid)).map_err(io_err("chown", d))?;
        }
        fs::set_permissions(d, fs::Permissions::from_mode(mode)).map_err(io_err("chmod", d))?;
    }
    Ok(())
}

pub async fn list_dir(path: &str, depth: u32) -> Result<Vec<EntryInfo>, FilesError> {
    let path = normalize(path)?;
    blocking(move || {
        let md = fs::metadata(&path).map_err(io_err("stat", &path))?;
        if !md.is_dir() {
            return Err(FilesError::NotDir(path));
        }
        let mut out = Vec::new();
        list_into(&path, md.dev(), depth.max(1), &mut out)?;
        Ok(out)
    })
    .await
}

fn list_into(
    dir: &Path,
    dir_dev: u64,
    depth: u32,
    out: &mut Vec<EntryInfo>,
) -> Result<(), FilesError> {
    let mut children: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err("list", dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    children.sort();
    for child in children {
        // Entries can vanish while listing; skip them.
        let Ok(md) = fs::symlink_metadata(&child) else {
            continue;
        };
        out.push(entry_from(&child, &md, dir_dev));
        if depth > 1 && md.is_dir() {
            // Unreadable subdirectories are listed but not descended into.
            let _ = list_into(&child, md.dev(), depth - 1, out);
        }
    }
    Ok(())
}

pub async fn make_dir(
    root: PathBuf,
    path: &str,
    mode: u32,
    parents: bool,
    user: &str,
) -> Result<EntryInfo, FilesError> {
    let path = normalize(path)?;
    let owner = if user.is_empty() {
        None
    } else {
        let u = users::lookup(&root, user)?;
        Some((u.uid, u.gid))
    };
    let mode = if mode == 0 { 0o755 } else { mode & 0o7777 };
    blocking(move || {
        if fs::symlink_metadata(&path).is_ok() {
            return Err(FilesError::Exists(path));
        }
        if parents {
            make_dirs(&path, mode, owner)?;
        } else {
            fs::DirBuilder::new()
                .mode(mode)
                .create(&path)
                .map_err(io_err("create directory", &path))?;
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(io_err("chown", &path))?;
            }
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(io_err("chmod", &path))?;
        }
        entry(&path)
    })
    .await
}

pub async fn remove(path: &str, recursive: bool) -> Result<(), FilesError> {
    let path = normalize(path)?;
    if path == Path::new("/") {
        return Err(FilesError::Root);
    }
    blocking(move || {
        let md = fs::symlink_metadata(&path).map_err(io_err("remove", &path))?;
        if md.is_dir() {
            if recursive {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_dir(&path)
            }
        } else {
            fs::remove_file(&path)
        }
        .map_err(io_err("remove", &path))
    })
    .await
}

pub async fn rename(from: &str, to: &str, overwrite: bool) -> Result<EntryInfo, FilesError> {
    let from = normalize(from)?;
    let to = normalize(to)?;
    if from == Path::new("/") || to == Path::new("/") {
        return Err(FilesError::Root);
    }
    blocking(move || {
        fs::symlink_metadata(&from).map_err(io_err("rename", &from))?;
        if overwrite {
            fs::rename(&from, &to).map_err(io_err("rename to", &to))?;
        } else {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &from,
                rustix::fs::CWD,
                &to,
                rustix::fs::RenameFlags::NOREPLACE,
            )
            .map_err(|e| {
                if e == rustix::io::Errno::EXIST {
                    FilesError::Exists(to.clone())
                } else {
                    io_err("rename to", &to)(e.into())
                }
            })?;
        }
        entry(&to)
    })
    .await
}

/// syncfs(2) on the filesystem holding "/".
pub async fn sync() -> Result<(), FilesError> {
    blocking(|| {
        let root = Path::new("/");
        let dir = File::open(root).map_err(io_err("open", root))?;
        rustix::fs::syncfs(&dir).map_err(|e| io_err("sync", root)(e.into()))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_rejects_and_resolves() {
        assert!(matches!(normalize(""), Err(FilesError::InvalidPath { .. })));
        assert!(matches!(
            normalize("a/b"),
            Err(FilesError::InvalidPath { .. })
        ));
        assert!(matches!(
            normalize("/a\0b"),
            Err(FilesError::InvalidPath { .. })
        ));
        assert_eq!(normalize("/a/./b/../c/").unwrap(), PathBuf::from("/a/c"));
        assert_eq!(normalize("/../../etc").unwrap(), PathBuf::from("/etc"));
        assert_eq!(normalize("//").unwrap(), PathBuf::from("/"));
    }

    #[tokio::test]
    async fn only_regular_files_are_read_and_mount_points_are_marked() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        // No writer: a blocking open would never return.
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            read_file(fifo.to_str().unwrap(), 0, 0, 4096),
        )
        .await
        .expect("a FIFO read returns at once");
        assert!(matches!(read, Err(FilesError::NotRegular(_))));
        assert!(matches!(
            read_file("/dev/zero", 0, 0, 4096).await,
            Err(FilesError::NotRegular(_))
        ));
        // A procfs file says it is empty and is read whole.
        let mut rx = read_file("/proc/self/status", 0, 0, 4096).await.unwrap();
        let mut status = Vec::new();
        while let Some(c) = rx.recv().await {
            status.extend(c.unwrap());
        }
        assert!(String::from_utf8_lossy(&status).contains("Name:"));
        // /proc is another filesystem than /; a plain directory is not.
        let root = list_dir("/", 1).await.unwrap();
        let proc = root.iter().find(|e| e.name == "proc").unwrap();
        assert!(proc.mount_point);
        let listed = list_dir(dir.path().to_str().unwrap(), 1).await.unwrap();
        assert!(listed.iter().all(|e| !e.mount_point));
        assert!(entry(Path::new("/proc")).unwrap().mount_point);
    }

    /// A file the sandbox appends to while it is read ends where it ended at the open.
    #[tokio::test]
    async fn a_read_stops_at_the_end_the_file_had_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("growing");
        std::fs::write(&path, b"0123456789ab").unwrap();
        let mut rx = read_file(path.to_str().unwrap(), 0, 0, 4).await.unwrap();
        // The reader has filled the channel (two chunks) and holds a third: append now.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut f, &[b'x'; 1 << 20]).unwrap();
        let mut got = Vec::new();
        while let Some(c) = rx.recv().await {
            got.extend(c.unwrap());
        }
        assert_eq!(got, b"0123456789ab");
        // From an offset, and with a length past the end.
        let mut rx = read_file(path.to_str().unwrap(), 8, 100, 4).await.unwrap();
        let mut got = Vec::new();
        while let Some(c) = rx.recv().await {
            got.extend(c.unwrap());
        }
        assert_eq!(got.len(), 100);
    }
}
