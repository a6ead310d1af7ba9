//! Filesystem watches (inotify) for the `Watch` RPC: one inotify instance per watch, one
//! watch descriptor per directory. With `recursive`, every directory under the root is
//! watched, and a directory that appears later is added as it appears; what it already holds
//! by then is reported as created, so nothing made in that window goes unseen.
//!
//! The watch runs on its own task and ends when the client drops the stream (the channel
//! closes) or the watched directory goes away.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::io::Errno;
use space_proto::{WatchEvent, WatchKind};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::files::{self, FilesError};

/// Most directories one watch covers (each costs a kernel watch descriptor).
pub const MAX_DIRS: usize = 8192;
/// Events buffered for a slow client before the watch reports an overflow and drops more.
const QUEUE: usize = 4096;

/// What is watched in each directory.
fn flags() -> WatchFlags {
    WatchFlags::CREATE
        | WatchFlags::MODIFY
        | WatchFlags::ATTRIB
        | WatchFlags::DELETE
        | WatchFlags::DELETE_SELF
        | WatchFlags::MOVED_FROM
        | WatchFlags::MOVED_TO
        | WatchFlags::DONT_FOLLOW
        | WatchFlags::ONLYDIR
}

struct Watch {
    fd: AsyncFd<OwnedFd>,
    /// Watch descriptor -> the directory's path relative to the root ("" for the root).
    dirs: HashMap<i32, PathBuf>,
    root: PathBuf,
    recursive: bool,
}

impl Watch {
    /// Adds a watch on `rel` (and, with `recursive`, on every directory below it). With
    /// `report`, entries found below are sent as created (a directory that appeared while
    /// the watch ran).
    fn add_tree(&mut self, rel: &Path, report: bool, out: &mut Vec<WatchEvent>) {
        let mut pending = vec![rel.to_path_buf()];
        while let Some(dir) = pending.pop() {
            if self.dirs.len() >= MAX_DIRS {
                out.push(event(WatchKind::Overflow, "", false));
                return;
            }
            let abs = self.root.join(&dir);
            match inotify::add_watch(self.fd.get_ref(), &abs, flags()) {
                Ok(wd) => {
                    self.dirs.insert(wd, dir.clone());
                }
                // Gone already, or not a directory (a symlink): nothing to watch.
                Err(_) => continue,
            }
            if !self.recursive && !report {
                continue;
            }
            let Ok(entries) = std::fs::read_dir(&abs) else {
                continue;
            };
            for e in entries.flatten() {
                let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
                let child = dir.join(e.file_name());
                if report {
                    out.push(event(WatchKind::Create, &child.to_string_lossy(), is_dir));
                }
                if is_dir && self.recursive {
                    pending.push(child);
                }
            }
        }
    }

    /// Turns one inotify event into what the client sees (and follows new directories).
    fn handle(
        &mut self,
        wd: i32,
        mask: ReadFlags,
        name: Option<&OsStr>,
        out: &mut Vec<WatchEvent>,
    ) {
        if mask.contains(ReadFlags::QUEUE_OVERFLOW) {
            out.push(event(WatchKind::Overflow, "", false));
            return;
        }
        let Some(dir) = self.dirs.get(&wd).cloned() else {
            return;
        };
        if mask.contains(ReadFlags::IGNORED) {
            self.dirs.remove(&wd);
            return;
        }
        let is_dir = mask.contains(ReadFlags::ISDIR);
        let rel = match name {
            Some(n) => dir.join(n),
            None => dir.clone(),
        };
        let text = rel.to_string_lossy();
        if mask.contains(ReadFlags::DELETE_SELF) {
            // The directory itself went away: its parent reports it, unless it is the root.
            if dir.as_os_str().is_empty() {
                out.push(event(WatchKind::Remove, "", true));
            }
            return;
        }
        let kind = if mask.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
            WatchKind::Create
        } else if mask.contains(ReadFlags::DELETE) {
            WatchKind::Remove
        } else if mask.contains(ReadFlags::MOVED_FROM) {
            WatchKind::Rename
        } else if mask.contains(ReadFlags::MODIFY) {
            WatchKind::Write
        } else if mask.contains(ReadFlags::ATTRIB) {
            WatchKind::Chmod
        } else {
            return;
        };
        out.push(event(kind, &text, is_dir));
        if kind == WatchKind::Create && is_dir && self.recursive {
            self.add_tree(&rel, true, out);
        }
    }
}

fn event(kind: WatchKind, name: &str, is_dir: bool) -> WatchEvent {
    WatchEvent {
        kind: kind as i32,
        name: name.to_string(),
        is_dir,
    }
}

/// Starts watching `path` (a directory). Errors (not there, not a directory) come before
/// any event; the first event is STARTED.
pub async fn watch(path: &str, recursive: bool) -> Result<mpsc::Receiver<WatchEvent>, FilesError> {
    let root = files::normalize(path)?;
    let md = files::entry(&root)?;
    if md.r#type != space_proto::FileType::Dir as i32 {
        return Err(FilesError::NotDir(root));
    }
    let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
        .map_err(|e| FilesError::io("watch", &root, e.into()))?;
    // As in vport: `new` is deprecated for `AsRawFd` types whose fd may change under the
    // registration; an `OwnedFd` cannot (the `unsafe` `register` is forbidden here).
    #[allow(deprecated)]
    let fd = AsyncFd::new(fd).map_err(|e| FilesError::io("watch", &root, e))?;
    let mut w = Watch {
        fd,
        dirs: HashMap::new(),
        root,
        recursive,
    };
    let (tx, rx) = mpsc::channel(QUEUE);
    let mut first = Vec::new();
    let w = tokio::task::spawn_blocking(move || {
        w.add_tree(Path::new(""), false, &mut first);
        (w, first)
    })
    .await
    .map_err(FilesError::Task)?;
    let (w, first) = w;
    tokio::spawn(run(w, first, tx));
    Ok(rx)
}

async fn run(mut w: Watch, first: Vec<WatchEvent>, tx: mpsc::Sender<WatchEvent>) {
    let mut out = vec![event(WatchKind::Started, "", true)];
    out.extend(first);
    let mut buf = vec![MaybeUninit::<u8>::uninit(); 16 * 1024];
    let mut overflowed = false;
    loop {
        for ev in out.drain(..) {
            match tx.try_send(ev) {
                Ok(()) => overflowed = false,
                Err(mpsc::error::TrySendError::Closed(_)) => return,
                // A client this far behind loses events, and is told so once.
                Err(mpsc::error::TrySendError::Full(_)) if !overflowed => {
                    overflowed = true;
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let _ = tx.send(event(WatchKind::Overflow, "", false)).await;
                    });
                }
                Err(mpsc::error::TrySendError::Full(_)) => {}
            }
        }
        if w.dirs.is_empty() {
            return; // the watched directory is gone
        }
        let mut guard = tokio::select! {
            _ = tx.closed() => return,
            r = w.fd.readable() => match r {
                Ok(g) => g,
                Err(_) => return,
            },
        };
        let mut raw: Vec<(i32, ReadFlags, Option<Vec<u8>>)> = Vec::new();
        {
            let mut reader = inotify::Reader::new(guard.get_inner(), &mut buf);
            loop {
                match reader.next() {
                    Ok(e) => raw.push((
                        e.wd(),
                        e.events(),
                        e.file_name().map(|n| n.to_bytes().to_vec()),
                    )),
                    Err(Errno::AGAIN) => break,
                    Err(Errno::INTR) => continue,
                    Err(_) => return,
                }
            }
        }
        guard.clear_ready();
        for (wd, mask, name) in raw {
            w.handle(wd, mask, name.as_deref().map(OsStr::from_bytes), &mut out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn next(rx: &mut mpsc::Receiver<WatchEvent>) -> (WatchKind, String) {
        let ev = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .expect("an event within 5 s")
            .expect("the watch is running");
        (WatchKind::try_from(ev.kind).unwrap(), ev.name)
    }

    #[tokio::test]
    async fn a_recursive_watch_sees_changes_in_new_directories() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("old")).unwrap();
        let mut rx = watch(root.to_str().unwrap(), true).await.unwrap();
        assert_eq!(next(&mut rx).await.0, WatchKind::Started);
        std::fs::write(root.join("old/a"), b"1").unwrap();
        assert_eq!(next(&mut rx).await, (WatchKind::Create, "old/a".into()));
        assert_eq!(next(&mut rx).await, (WatchKind::Write, "old/a".into()));
        std::fs::create_dir_all(root.join("new/deeper")).unwrap();
        std::fs::write(root.join("new/deeper/b"), b"2").unwrap();
        let mut seen = Vec::new();
        while !seen.contains(&(WatchKind::Create, "new/deeper/b".to_string())) {
            seen.push(next(&mut rx).await);
        }
        assert!(
            seen.contains(&(WatchKind::Create, "new".into())),
            "{seen:?}"
        );
        std::fs::rename(root.join("old/a"), root.join("c")).unwrap();
        assert_eq!(next(&mut rx).await, (WatchKind::Rename, "old/a".into()));
        assert_eq!(next(&mut rx).await, (WatchKind::Create, "c".into()));
        std::fs::remove_file(root.join("c")).unwrap();
        assert_eq!(next(&mut rx).await, (WatchKind::Remove, "c".into()));
    }

    #[tokio::test]
    async fn a_plain_watch_covers_one_directory_and_missing_ones_fail() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("sub")).unwrap();
        let mut rx = watch(root.to_str().unwrap(), false).await.unwrap();
        assert_eq!(next(&mut rx).await.0, WatchKind::Started);
        std::fs::write(root.join("sub/x"), b"").unwrap();
        std::fs::write(root.join("y"), b"").unwrap();
        assert_eq!(next(&mut rx).await, (WatchKind::Create, "y".into()));
        assert!(
            watch(root.join("nope").to_str().unwrap(), false)
                .await
                .is_err()
        );
        assert!(
            watch(root.join("y").to_str().unwrap(), false)
                .await
                .is_err()
        );
    }
}
