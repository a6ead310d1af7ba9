//! A sandbox's storage sent to, and received from, another node (issue 14, decision 0035).
//!
//! ```text
//! sandboxes/<id>/outgoing/base     read-only copy of rootfs, taken for step Base (source)
//! sandboxes/<id>/outgoing/final    read-only copy of rootfs, taken for step Final (source)
//! sandboxes/<id>/incoming/base     the same, received (target)
//! sandboxes/<id>/incoming/final
//! replicas/<id>/snapshots/<snap>/  a replica's snapshots (rootfs, snapshot.json), kept for
//!                                  a sandbox on another node (decision 0037)
//! ```
//!
//! What travels is `btrfs send` streams (btrfs-progs: the kernel makes the stream, and only
//! `btrfs receive` applies one), each incremental against the one before it: a sandbox's
//! snapshots oldest first, then `base` against its newest snapshot, then `final` against
//! `base`, which carries only what changed while the base was on its way. The target
//! receives with `btrfs receive --chroot` into a directory of the sandbox's own, and a
//! source may only name the few places [`valid_move_path`] allows.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use bytes::Bytes;
use space_node_api::moves::{MovePart, MoveStep, MoveStream, Received};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

use crate::api::NodeError;
use crate::storage::{self, Layout, StorageError, Subvolumes};

const OUTGOING: &str = "outgoing";
const INCOMING: &str = "incoming";
/// Bytes per `Data` part.
const CHUNK: usize = 256 << 10;
/// The largest file a move may carry (a snapshot's record is a few hundred bytes).
const MAX_FILE: u64 = 1 << 20;

const REPLICAS: &str = "replicas";

pub(crate) fn outgoing_dir(layout: &Layout, id: &str) -> PathBuf {
    layout.sandbox_dir(id).join(OUTGOING)
}

pub(crate) fn incoming_dir(layout: &Layout, id: &str) -> PathBuf {
    layout.sandbox_dir(id).join(INCOMING)
}

/// Where this node keeps its replica of sandbox `id`, which runs on another node.
pub(crate) fn replica_dir(layout: &Layout, id: &str) -> PathBuf {
    layout.volume.join(REPLICAS).join(id)
}

/// The received copy of the sandbox's disk a target adopts.
pub(crate) fn received_final(layout: &Layout, id: &str) -> PathBuf {
    incoming_dir(layout, id).join(MoveStep::Final.as_str())
}

/// Deletes the subvolumes of a move (sent or received; a microvm's copies being filled too)
/// and their directory.
pub(crate) fn remove_move_dir(dir: &Path, subvols: &dyn Subvolumes) -> Result<(), StorageError> {
    for step in [MoveStep::Base, MoveStep::Final] {
        for sub in [
            dir.join(step.as_str()),
            storage::filling(dir, step.as_str()),
        ] {
            if subvols.is_subvolume(&sub) {
                subvols.delete(&sub)?;
            }
        }
    }
    storage::remove_tree(dir)
}

/// Makes a move's read-only copy of the sandbox's disk, `name` in the directory given (the
/// rootfs's snapshot, or a microvm's image in a subvolume).
pub(crate) type MakeCopy<'a> = &'a dyn Fn(&Path, &str) -> Result<(), StorageError>;

/// Both move directories of sandbox `id` (before its directory is removed).
pub(crate) fn remove_moves(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
) -> Result<(), StorageError> {
    remove_move_dir(&outgoing_dir(layout, id), subvols)?;
    remove_move_dir(&incoming_dir(layout, id), subvols)
}

/// One thing a send carries.
#[derive(Debug)]
pub(crate) enum Item {
    File {
        /// Where the target writes it, relative to the sandbox's dir.
        rel: String,
        path: PathBuf,
    },
    Subvolume {
        /// The dir the target receives it in, relative to the sandbox's dir.
        rel: String,
        path: PathBuf,
        parent: Option<PathBuf>,
    },
}

/// The whole snapshots (a record that reads and a subvolume) in `dir`, a sandbox's or a
/// replica's `snapshots`, oldest first.
pub(crate) fn snapshots_oldest_first(dir: &Path) -> Result<Vec<(String, u64)>, NodeError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StorageError::io("read directory", dir, e).into()),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| StorageError::io("read directory", dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        let record = ent.path().join("snapshot.json");
        let Ok(rec) = storage::read_json::<serde_json::Value>(&record) else {
            continue;
        };
        if !ent.path().join("rootfs").is_dir() {
            continue;
        }
        let at = rec
            .get("created_unix_ms")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        out.push((name, at));
    }
    out.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    Ok(out)
}

/// Takes the read-only copy of the sandbox's disk that step `step` sends (with `copy`), and
/// lists what the step carries. `Final` needs the `Base` copy taken before. A `Base` leaves
/// out the snapshots in `have` (the target's replica holds them, decision 0056), and sends
/// what follows each of them incremental against it.
pub(crate) fn plan(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
    step: MoveStep,
    have: &[String],
    copy: MakeCopy<'_>,
) -> Result<Vec<Item>, NodeError> {
    let out = outgoing_dir(layout, id);
    let base = out.join(MoveStep::Base.as_str());
    let taken = out.join(step.as_str());
    let mut items = Vec::new();
    let parent = match step {
        MoveStep::Base => {
            // A move tried before and not finished: start over.
            remove_move_dir(&out, subvols)?;
            storage::mkdir_private(&out)?;
            let mut newest: Option<PathBuf> = None;
            for (snap, _) in snapshots_oldest_first(&layout.sandbox_dir(id).join("snapshots"))? {
                let dir = layout.sandbox_dir(id).join("snapshots").join(&snap);
                if have.contains(&snap) {
                    newest = Some(dir.join("rootfs"));
                    continue;
                }
                items.push(Item::File {
                    rel: format!("snapshots/{snap}/snapshot.json"),
                    path: dir.join("snapshot.json"),
                });
                let rootfs = dir.join("rootfs");
                items.push(Item::Subvolume {
                    rel: format!("snapshots/{snap}"),
                    path: rootfs.clone(),
                    parent: newest.replace(rootfs),
                });
            }
            newest
        }
        MoveStep::Final => {
            if !subvols.is_subvolume(&base) {
                return Err(NodeError::Conflict(format!(
                    "sandbox {id} has no base sent: a move sends its base step first"
                )));
            }
            if subvols.is_subvolume(&taken) {
                subvols.delete(&taken)?;
            }
            Some(base)
        }
    };
    copy(&out, step.as_str())?;
    items.push(Item::Subvolume {
        rel: INCOMING.into(),
        path: taken,
        parent,
    });
    Ok(items)
}

/// Moves the snapshots `have` of this node's replica of sandbox `id` into the sandbox's own
/// directory (a move's target, decision 0056), and deletes the rest of the replica. Conflict
/// when the replica lacks one of them (whole): the sender would leave it out.
pub(crate) fn take_from_replica(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
    have: &[String],
) -> Result<(), NodeError> {
    let replica = replica_dir(layout, id);
    if !have.is_empty() {
        let whole: Vec<String> = snapshots_oldest_first(&replica.join("snapshots"))?
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        if let Some(missing) = have.iter().find(|s| !whole.contains(s)) {
            return Err(NodeError::Conflict(format!(
                "this node's replica of sandbox {id} does not hold snapshot {missing}: the move \
                 must send it"
            )));
        }
        let snaps = layout.sandbox_dir(id).join("snapshots");
        storage::mkdir_private(&snaps)?;
        for s in have {
            let (from, to) = (replica.join("snapshots").join(s), snaps.join(s));
            std::fs::rename(&from, &to)
                .map_err(|e| StorageError::io("move a replica snapshot to", &to, e))?;
        }
    }
    if replica.exists() {
        trim_replica(&replica, subvols, Some(&[]))?;
    }
    Ok(())
}

/// What a replication of sandbox `id` sends to a replica that holds `have` (decision 0037):
/// each snapshot it lacks, oldest first, incremental against the newest one before it that
/// the replica will hold. A snapshot's record follows its subvolume, so a replica counts a
/// snapshot whole only once its subvolume was received whole.
pub(crate) fn replica_plan(
    layout: &Layout,
    id: &str,
    have: &[String],
) -> Result<Vec<Item>, NodeError> {
    let dir = layout.sandbox_dir(id).join("snapshots");
    let mut items = Vec::new();
    let mut newest: Option<PathBuf> = None;
    for (snap, _) in snapshots_oldest_first(&dir)? {
        let rootfs = dir.join(&snap).join("rootfs");
        if have.contains(&snap) {
            newest = Some(rootfs);
            continue;
        }
        items.push(Item::Subvolume {
            rel: format!("snapshots/{snap}"),
            path: rootfs.clone(),
            parent: newest.replace(rootfs),
        });
        items.push(Item::File {
            rel: format!("snapshots/{snap}/snapshot.json"),
            path: dir.join(&snap).join("snapshot.json"),
        });
    }
    Ok(items)
}

/// Deletes the snapshots in replica directory `dir` that are not whole (a receive cut short)
/// or, with `keep`, not in it; the directory itself when nothing is kept. Answers the whole
/// snapshots left, oldest first.
pub(crate) fn trim_replica(
    dir: &Path,
    subvols: &dyn Subvolumes,
    keep: Option<&[String]>,
) -> Result<Vec<String>, NodeError> {
    let snaps = dir.join("snapshots");
    let whole: Vec<String> = snapshots_oldest_first(&snaps)?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let rd = match std::fs::read_dir(&snaps) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            storage::remove_tree(dir)?;
            return Ok(Vec::new());
        }
        Err(e) => return Err(StorageError::io("read directory", &snaps, e).into()),
    };
    let mut left = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| StorageError::io("read directory", &snaps, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        let kept = whole.contains(&name) && keep.is_none_or(|k| k.contains(&name));
        if kept {
            left.push(name);
            continue;
        }
        let rootfs = ent.path().join("rootfs");
        if subvols.is_subvolume(&rootfs) {
            subvols.delete(&rootfs)?;
        }
        storage::remove_tree(&ent.path())?;
    }
    if left.is_empty() {
        storage::remove_tree(dir)?;
    }
    Ok(whole.into_iter().filter(|s| left.contains(s)).collect())
}

/// Sends `items` as a stream of parts: `btrfs send` runs for each subvolume as the stream
/// is read (a bounded channel: a slow receiver slows the sender, nothing piles up).
pub(crate) fn send(items: Vec<Item>) -> MoveStream {
    let (tx, rx) = mpsc::channel::<Result<MovePart, NodeError>>(8);
    tokio::task::spawn_blocking(move || {
        let result = items.into_iter().try_for_each(|item| send_item(item, &tx));
        let last = match result {
            Ok(()) => Ok(MovePart::End),
            // The receiver went away: nothing to tell.
            Err(None) => return,
            Err(Some(e)) => Err(e),
        };
        let _ = tx.blocking_send(last);
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// One item onto `tx`. Err(None): the receiving end is gone.
fn send_item(
    item: Item,
    tx: &mpsc::Sender<Result<MovePart, NodeError>>,
) -> Result<(), Option<NodeError>> {
    let put = |part: MovePart| tx.blocking_send(Ok(part)).map_err(|_| None);
    match item {
        Item::File { rel, path } => {
            let data = std::fs::read(&path)
                .map_err(|e| Some(StorageError::io("read", &path, e).into()))?;
            put(MovePart::File { path: rel })?;
            put(MovePart::Data(Bytes::from(data)))
        }
        Item::Subvolume { rel, path, parent } => {
            put(MovePart::Subvolume { path: rel })?;
            let mut cmd = Command::new("btrfs");
            cmd.args(["send", "-q"]);
            if let Some(p) = &parent {
                cmd.arg("-p").arg(p);
            }
            cmd.arg(&path)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = cmd.spawn().map_err(|e| {
                Some(NodeError::Internal(format!(
                    "cannot run btrfs send (btrfs-progs): {e}"
                )))
            })?;
            let mut stdout = child.stdout.take().expect("piped");
            let mut buf = vec![0u8; CHUNK];
            let pumped = loop {
                match stdout.read(&mut buf) {
                    Ok(0) => break Ok(()),
                    Ok(n) => {
                        if put(MovePart::Data(Bytes::copy_from_slice(&buf[..n]))).is_err() {
                            break Err(None);
                        }
                    }
                    Err(e) => break Err(Some(StorageError::io("send", &path, e).into())),
                }
            };
            if pumped.is_err() {
                let _ = child.kill();
            }
            let out = child
                .wait_with_output()
                .map_err(|e| Some(StorageError::io("send", &path, e).into()))?;
            pumped?;
            if !out.status.success() {
                return Err(Some(NodeError::Internal(format!(
                    "btrfs send {} failed: {}",
                    path.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ))));
            }
            Ok(())
        }
    }
}

/// Where the parts of the item being received go.
enum Sink {
    None,
    File {
        file: tokio::fs::File,
        path: PathBuf,
        written: u64,
    },
    Receive {
        child: tokio::process::Child,
        stdin: tokio::process::ChildStdin,
        dir: PathBuf,
    },
}

impl Sink {
    async fn write(&mut self, data: &[u8]) -> Result<(), NodeError> {
        match self {
            Sink::None => Err(NodeError::InvalidArgument(
                "a move's data came before the item it belongs to".into(),
            )),
            Sink::File {
                file,
                path,
                written,
            } => {
                *written += data.len() as u64;
                if *written > MAX_FILE {
                    return Err(NodeError::InvalidArgument(format!(
                        "{} is larger than a move's file may be ({MAX_FILE} bytes)",
                        path.display()
                    )));
                }
                file.write_all(data)
                    .await
                    .map_err(|e| StorageError::io("write", path, e).into())
            }
            Sink::Receive { stdin, dir, .. } => stdin.write_all(data).await.map_err(|e| {
                NodeError::Internal(format!("btrfs receive in {}: {e}", dir.display()))
            }),
        }
    }

    /// Ends the item: the file flushed, or the receive's input closed and its exit checked.
    async fn finish(self) -> Result<(), NodeError> {
        match self {
            Sink::None => Ok(()),
            Sink::File { mut file, path, .. } => file
                .flush()
                .await
                .map_err(|e| StorageError::io("write", &path, e).into()),
            Sink::Receive {
                child, stdin, dir, ..
            } => {
                drop(stdin);
                let out = child.wait_with_output().await.map_err(|e| {
                    NodeError::Internal(format!("btrfs receive in {}: {e}", dir.display()))
                })?;
                if out.status.success() {
                    Ok(())
                } else {
                    Err(NodeError::Internal(format!(
                        "btrfs receive in {} failed: {}",
                        dir.display(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    )))
                }
            }
        }
    }

    async fn abort(self) {
        if let Sink::Receive { mut child, .. } = self {
            let _ = child.kill().await;
        }
    }
}

/// Where a stream may write, relative to the directory it is received in (see
/// `space_node_api::moves::valid_move_path`).
pub(crate) type PathCheck = fn(&str, bool) -> bool;

/// Applies a stream's parts under `sandbox_dir` where `valid` allows; the caller has made the
/// directory.
pub(crate) async fn receive(
    sandbox_dir: &Path,
    mut parts: MoveStream,
    valid: PathCheck,
) -> Result<Received, NodeError> {
    let mut got = Received::default();
    let mut sink = Sink::None;
    let result = async {
        loop {
            let part = match parts.next().await {
                Some(p) => p?,
                None => {
                    return Err(NodeError::Unavailable {
                        id: sandbox_dir
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                        reason: "the move's stream ended before its end".into(),
                    });
                }
            };
            match part {
                MovePart::Data(d) => {
                    got.bytes += d.len() as u64;
                    sink.write(&d).await?;
                }
                MovePart::End => {
                    std::mem::replace(&mut sink, Sink::None).finish().await?;
                    return Ok(());
                }
                MovePart::File { path } => {
                    std::mem::replace(&mut sink, Sink::None).finish().await?;
                    sink = open_file(checked(sandbox_dir, &path, false, valid)?).await?;
                }
                MovePart::Subvolume { path } => {
                    std::mem::replace(&mut sink, Sink::None).finish().await?;
                    sink = start_receive(checked(sandbox_dir, &path, true, valid)?).await?;
                    got.subvolumes += 1;
                }
            }
        }
    }
    .await;
    match result {
        Ok(()) => Ok(got),
        Err(e) => {
            sink.abort().await;
            Err(e)
        }
    }
}

fn checked(
    sandbox_dir: &Path,
    rel: &str,
    subvolume: bool,
    valid: PathCheck,
) -> Result<PathBuf, NodeError> {
    if !valid(rel, subvolume) {
        return Err(NodeError::InvalidArgument(format!(
            "a move may not write {} {rel:?}",
            if subvolume {
                "a subvolume in"
            } else {
                "the file"
            }
        )));
    }
    Ok(sandbox_dir.join(rel))
}

fn mkdirs(dir: &Path) -> Result<(), NodeError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .create(dir)
        .map_err(|e| StorageError::io("create directory", dir, e).into())
}

async fn open_file(path: PathBuf) -> Result<Sink, NodeError> {
    if let Some(parent) = path.parent() {
        mkdirs(parent)?;
    }
    let file = tokio::fs::File::create(&path)
        .await
        .map_err(|e| StorageError::io("create", &path, e))?;
    Ok(Sink::File {
        file,
        path,
        written: 0,
    })
}

async fn start_receive(dir: PathBuf) -> Result<Sink, NodeError> {
    mkdirs(&dir)?;
    // --chroot: the stream's paths cannot leave `dir`.
    let mut child = tokio::process::Command::new("btrfs")
        .args(["receive", "-q", "--chroot"])
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| NodeError::Internal(format!("cannot run btrfs receive (btrfs-progs): {e}")))?;
    let stdin = child.stdin.take().expect("piped");
    Ok(Sink::Receive { child, stdin, dir })
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_node_api::moves::valid_move_path;

    fn stream(parts: Vec<MovePart>) -> MoveStream {
        Box::pin(tokio_stream::iter(parts.into_iter().map(Ok)))
    }

    /// A snapshot directory as `snapshots_oldest_first` counts one whole.
    fn whole_snapshot(dir: &Path, at: u64) {
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        std::fs::write(
            dir.join("snapshot.json"),
            format!(r#"{{"created_unix_ms": {at}}}"#),
        )
        .unwrap();
    }

    #[test]
    fn a_base_leaves_out_what_the_targets_replica_holds_and_the_target_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout {
            volume: dir.path().to_owned(),
            run_dir: dir.path().join("run"),
        };
        let subvols = crate::storage::fake::DirSubvolumes::default();
        let snaps = layout.sandbox_dir("sb").join("snapshots");
        for (i, s) in ["s1", "s2", "s3"].iter().enumerate() {
            whole_snapshot(&snaps.join(s), i as u64 + 1);
        }
        std::fs::create_dir_all(layout.sandbox_rootfs("sb")).unwrap();
        let copy = |out: &Path, name: &str| -> Result<(), StorageError> {
            std::fs::create_dir_all(out.join(name)).map_err(|e| StorageError::io("mk", out, e))
        };
        let have = ["s1".to_owned(), "s2".to_owned()];
        let items = plan(&layout, &subvols, "sb", MoveStep::Base, &have, &copy).unwrap();
        let sent: Vec<(String, Option<PathBuf>)> = items
            .iter()
            .filter_map(|i| match i {
                Item::Subvolume { rel, parent, .. } => Some((rel.clone(), parent.clone())),
                Item::File { .. } => None,
            })
            .collect();
        // s3 only, incremental against s2 (the newest the target holds); the disk after it.
        assert_eq!(
            sent,
            [
                (
                    "snapshots/s3".to_owned(),
                    Some(snaps.join("s2").join("rootfs"))
                ),
                (INCOMING.to_owned(), Some(snaps.join("s3").join("rootfs"))),
            ]
        );

        // The target: its replica holds s1 and s2 (and s0, which the sandbox no longer has).
        let target = tempfile::tempdir().unwrap();
        let tl = Layout {
            volume: target.path().to_owned(),
            run_dir: target.path().join("run"),
        };
        let replica = replica_dir(&tl, "sb").join("snapshots");
        for (i, s) in ["s0", "s1", "s2"].iter().enumerate() {
            whole_snapshot(&replica.join(s), i as u64);
        }
        // (A base's receive makes the sandbox's directory first.)
        std::fs::create_dir_all(tl.sandbox_dir("sb")).unwrap();
        // One it lacks is refused, and nothing moves.
        let e = take_from_replica(&tl, &subvols, "sb", &["s1".into(), "s9".into()]).unwrap_err();
        assert!(e.to_string().contains("s9"), "{e}");
        assert!(replica.join("s1").exists());
        take_from_replica(&tl, &subvols, "sb", &have).unwrap();
        let own = tl.sandbox_dir("sb").join("snapshots");
        assert!(own.join("s1/rootfs").is_dir() && own.join("s2/snapshot.json").is_file());
        assert!(!own.join("s0").exists());
        assert!(
            !replica_dir(&tl, "sb").exists(),
            "the rest of the replica stayed"
        );
    }

    #[tokio::test]
    async fn a_hostile_stream_writes_nothing_outside_its_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = dir.path().join("sb");
        std::fs::create_dir(&sandbox).unwrap();
        for path in [
            "../escape",
            "/etc/passwd",
            "snapshots/../../escape",
            "rootfs/x",
        ] {
            let e = receive(
                &sandbox,
                stream(vec![
                    MovePart::File { path: path.into() },
                    MovePart::Data(Bytes::from_static(b"x")),
                    MovePart::End,
                ]),
                valid_move_path,
            )
            .await
            .unwrap_err();
            assert!(matches!(e, NodeError::InvalidArgument(_)), "{path}: {e}");
            let e = receive(
                &sandbox,
                stream(vec![MovePart::Subvolume { path: path.into() }]),
                valid_move_path,
            )
            .await
            .unwrap_err();
            assert!(matches!(e, NodeError::InvalidArgument(_)), "{path}: {e}");
        }
        assert!(!dir.path().join("escape").exists());
        // Data before any item, an oversized record, and a stream cut before its end.
        let e = receive(
            &sandbox,
            stream(vec![MovePart::Data(Bytes::from_static(b"x"))]),
            valid_move_path,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, NodeError::InvalidArgument(_)), "{e}");
        let big = Bytes::from(vec![0u8; (MAX_FILE + 1) as usize]);
        let e = receive(
            &sandbox,
            stream(vec![
                MovePart::File {
                    path: "snapshots/abc/snapshot.json".into(),
                },
                MovePart::Data(big),
                MovePart::End,
            ]),
            valid_move_path,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, NodeError::InvalidArgument(_)), "{e}");
        let e = receive(
            &sandbox,
            stream(vec![
                MovePart::File {
                    path: "snapshots/abc/snapshot.json".into(),
                },
                MovePart::Data(Bytes::from_static(b"{}")),
            ]),
            valid_move_path,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, NodeError::Unavailable { .. }), "{e}");
        // A whole one lands where it says.
        let got = receive(
            &sandbox,
            stream(vec![
                MovePart::File {
                    path: "snapshots/abc/snapshot.json".into(),
                },
                MovePart::Data(Bytes::from_static(b"{}")),
                MovePart::End,
            ]),
            valid_move_path,
        )
        .await
        .unwrap();
        assert_eq!(got.bytes, 2);
        assert_eq!(
            std::fs::read(sandbox.join("snapshots/abc/snapshot.json")).unwrap(),
            b"{}"
        );
    }
}
