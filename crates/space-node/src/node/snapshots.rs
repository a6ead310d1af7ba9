//! Disk snapshots, rollback and fork on the node. [`SnapshotStore`] owns the snapshot tree
//! on disk (records, subvolumes, sizes); the node's operations here (snapshot, rollback,
//! fork) stop and start the sandbox around it with the node's table, locks and launch path.
//!
//! ```text
//! sandboxes/<id>/snapshots/<snap>/snapshot.json   written before the snapshot, so the
//!                                                 snapshot's own commit makes it durable
//! sandboxes/<id>/snapshots/<snap>/rootfs          read-only subvolume: the sandbox's
//!                                                 rootfs, or a microvm's disk image
//!                                                 (`disk.ext4`) and checkpoint (`vm/`)
//! ```
//!
//! A microvm's snapshot is a subvolume too, so that `btrfs send` carries it to another node
//! (moves and replicas) as it carries a namespace sandbox's, incremental against the one
//! before it: the disk images of two snapshots share every extent the VM did not write in
//! between, and a send against a parent sends only the others (decision 0038).
//!
//! A snapshot is consistent across the sandbox's processes: the sandbox's cgroup is frozen
//! around `BTRFS_IOC_SNAP_CREATE_V2`, which itself flushes the source's dirty data and
//! commits the transaction (docs/decisions/0007-snapshots.md).

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::Rng;
use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use crate::api::GuestChannel;

use super::disk::{At, Disk};
use super::{Entry, Node, blocking, check_spec};
use crate::api::{NodeError, SandboxSpec, SandboxStatus, SnapshotInfo, TemplateInfo};
use crate::ids;
use crate::state::now_unix_ms;
use crate::storage::{
    self, Layout, StorageError, Subvolumes, clone_file_atomic, filling, new_vm_subvolume,
    seal_vm_subvolume,
};

const SNAPSHOTS: &str = "snapshots";
const SNAPSHOT_RECORD: &str = "snapshot.json";

/// The node's record of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SnapshotRecord {
    pub id: String,
    pub sandbox_id: String,
    pub created_unix_ms: u64,
    /// Referenced bytes, filled in the first time someone asks (the snapshot is read-only,
    /// so the figure never changes).
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// A microvm checkpoint: `vm/` holds the VM's device state and RAM (decision 0014).
    #[serde(default)]
    pub memory: bool,
}

/// Asks a guest to flush its filesystem to its disk: a VM's writes may still sit in its own
/// page cache, where neither a snapshot of its disk nor a stop would keep them. False when
/// there is no client or the guest did not answer within 10 s.
pub(crate) async fn flush_guest(client: Option<GuestChannel>) -> bool {
    let Some(mut guest) = client.map(GuestChannel::client) else {
        return false;
    };
    let sync = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        guest.sync(space_proto::Empty {}),
    )
    .await;
    matches!(sync, Ok(Ok(_)))
}

pub(crate) fn snapshots_dir(layout: &Layout, id: &str) -> PathBuf {
    layout.sandbox_dir(id).join(SNAPSHOTS)
}

pub(crate) fn snapshot_dir(layout: &Layout, id: &str, snap: &str) -> PathBuf {
    snapshots_dir(layout, id).join(snap)
}

pub(crate) fn snapshot_rootfs(layout: &Layout, id: &str, snap: &str) -> PathBuf {
    snapshot_dir(layout, id, snap).join("rootfs")
}

/// A microvm sandbox's snapshot: a reflink copy of its disk image (decision 0014), in the
/// snapshot's subvolume.
pub(crate) fn snapshot_disk(layout: &Layout, id: &str, snap: &str) -> PathBuf {
    snapshot_rootfs(layout, id, snap).join(super::SANDBOX_DISK)
}

/// Where a microvm checkpoint's VM state lies, in a subvolume next to its disk image.
pub(crate) const VM_DIR: &str = "vm";

/// A microvm checkpoint's VM state next to its disk image: `state`, `state.sha256` and
/// `mem` (or the RAM in `state`), as `runtime::microvm::checkpoint` writes them.
pub(crate) fn snapshot_vm_dir(layout: &Layout, id: &str, snap: &str) -> PathBuf {
    snapshot_rootfs(layout, id, snap).join(VM_DIR)
}

/// Moves the microvm snapshots of sandbox `id` that a node before decision 0038 left as plain
/// files (`snapshots/<snap>/disk.ext4`, `vm/`) into a read-only subvolume each, by reflink.
/// Idempotent: a step cut short is redone from the old files, which go last.
pub(crate) fn upgrade_vm_snapshots(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
) -> Result<(), StorageError> {
    let dir = snapshots_dir(layout, id);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Ok(());
    };
    for ent in rd.flatten() {
        let (old_disk, old_vm) = (
            ent.path().join(super::SANDBOX_DISK),
            ent.path().join(VM_DIR),
        );
        if !old_disk.is_file() {
            continue;
        }
        let sub = new_vm_subvolume(subvols, &ent.path(), "rootfs")?;
        if let Ok(files) = std::fs::read_dir(&old_vm) {
            storage::mkdir_private(&sub.join(VM_DIR))?;
            for f in files.flatten() {
                clone_file_atomic(&f.path(), &sub.join(VM_DIR).join(f.file_name()))?;
            }
        }
        seal_vm_subvolume(subvols, &ent.path(), "rootfs", &old_disk)?;
        storage::remove_tree(&old_vm)?;
        std::fs::remove_file(&old_disk).map_err(|e| StorageError::io("remove", &old_disk, e))?;
        tracing::info!(sandbox = id, snapshot = %ent.file_name().to_string_lossy(), "microvm snapshot moved into a subvolume");
    }
    Ok(())
}

fn internal(what: &str) -> impl FnOnce(crate::runtime::RuntimeError) -> NodeError + '_ {
    move |e| NodeError::Internal(format!("failed to {what}: {e}"))
}

/// Deletes one snapshot (subvolume, then its dir). Missing is fine.
fn remove_snapshot(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
    snap: &str,
) -> Result<(), StorageError> {
    let dir = snapshot_dir(layout, id, snap);
    for sub in [dir.join("rootfs"), filling(&dir, "rootfs")] {
        if subvols.is_subvolume(&sub) {
            subvols.delete(&sub)?;
        }
    }
    storage::remove_tree(&dir)
}

/// The snapshot tree of every sandbox on the node: the service that owns it. Its methods
/// block (file system and btrfs calls): the node calls them from [`blocking`] on a clone.
#[derive(Clone)]
pub(super) struct SnapshotStore {
    layout: Layout,
    subvols: Arc<dyn Subvolumes>,
}

impl SnapshotStore {
    pub(super) fn new(layout: Layout, subvols: Arc<dyn Subvolumes>) -> Self {
        Self { layout, subvols }
    }

    /// What a snapshot holds: its rootfs subvolume, or for a microvm sandbox its disk image.
    fn payload(&self, id: &str, snap: &str) -> PathBuf {
        let disk = snapshot_disk(&self.layout, id, snap);
        if disk.is_file() {
            disk
        } else {
            snapshot_rootfs(&self.layout, id, snap)
        }
    }

    fn info(&self, rec: &SnapshotRecord) -> SnapshotInfo {
        SnapshotInfo {
            id: rec.id.clone(),
            sandbox_id: rec.sandbox_id.clone(),
            created_unix_ms: rec.created_unix_ms,
            size_bytes: rec.size_bytes,
            path: self.payload(&rec.sandbox_id, &rec.id),
            memory: rec.memory,
        }
    }

    /// The payload of snapshot `snap` of `id`, or not found.
    fn require(&self, id: &str, snap: &str) -> Result<PathBuf, NodeError> {
        let path = self.payload(id, snap);
        if path.is_file() || self.subvols.is_subvolume(&path) {
            Ok(path)
        } else {
            Err(NodeError::NotFound {
                kind: "snapshot",
                id: snap.to_string(),
            })
        }
    }

    /// The snapshot when it was taken already and is whole (a retried snapshot).
    fn existing(&self, id: &str, snap: &str) -> Option<SnapshotInfo> {
        let dir = snapshot_dir(&self.layout, id, snap);
        if !self.subvols.is_subvolume(&dir.join("rootfs")) {
            return None;
        }
        let rec = storage::read_json::<SnapshotRecord>(&dir.join(SNAPSHOT_RECORD)).ok()?;
        Some(self.info(&rec))
    }

    /// Step 1 of a snapshot: its directory and record (a leftover of an interrupted one with
    /// this id is removed first), and the subvolume `disk` fills while the sandbox is
    /// stopped, if any (a microvm's checkpoint goes there). The record goes first: the
    /// snapshot ioctl commits the btrfs transaction, which makes it durable together with
    /// the snapshot, at no extra flush.
    fn begin(
        &self,
        rec: &SnapshotRecord,
        disk: &dyn Disk,
    ) -> Result<Option<PathBuf>, StorageError> {
        let (id, snap) = (&rec.sandbox_id, &rec.id);
        self.remove(id, snap)?;
        storage::mkdir_p(&snapshots_dir(&self.layout, id), 0o700)?;
        let dir = snapshot_dir(&self.layout, id, snap);
        storage::mkdir_private(&dir)?;
        storage::write_json_atomic(&dir.join(SNAPSHOT_RECORD), rec, false)?;
        disk.begin_copy(self.at(id), &dir, "rootfs")
    }

    /// Step 2, with the sandbox stopped: its files sealed read-only as the snapshot, charged
    /// to its quota group.
    fn seal(&self, id: &str, snap: &str, disk: &dyn Disk) -> Result<(), StorageError> {
        let dir = snapshot_dir(&self.layout, id, snap);
        disk.seal_copy(self.at(id), &dir, "rootfs", true)
    }

    fn at<'a>(&'a self, id: &'a str) -> At<'a> {
        At::new(&self.layout, self.subvols.as_ref(), id)
    }

    /// Deletes one snapshot. Missing is fine.
    fn remove(&self, id: &str, snap: &str) -> Result<(), StorageError> {
        remove_snapshot(&self.layout, self.subvols.as_ref(), id, snap)
    }

    /// The whole snapshots of `id`, oldest first; with `with_size`, sizes not known yet are
    /// measured and kept in the record (a snapshot never changes).
    fn list(&self, id: &str, with_size: bool) -> Result<Vec<SnapshotInfo>, StorageError> {
        let dir = snapshots_dir(&self.layout, id);
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StorageError::io("read directory", &dir, e)),
        };
        let mut out = Vec::new();
        for ent in rd.flatten() {
            let rec_path = ent.path().join(SNAPSHOT_RECORD);
            let Ok(mut rec) = storage::read_json::<SnapshotRecord>(&rec_path) else {
                continue;
            };
            let payload = self.payload(id, &rec.id);
            if !payload.is_dir() && !payload.is_file() {
                continue; // interrupted
            }
            if with_size && rec.size_bytes.is_none() {
                match self.size_of(id, &rec.id, &payload) {
                    Ok(n) => {
                        rec.size_bytes = Some(n);
                        if let Err(e) = storage::write_json_atomic(&rec_path, &rec, false) {
                            tracing::warn!(error = %e, "failed to cache a snapshot's size");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "failed to size a snapshot"),
                }
            }
            out.push(self.info(&rec));
        }
        out.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
        Ok(out)
    }

    /// Bytes a snapshot references: a rootfs's files, or a microvm's disk image and its
    /// checkpoint's state and RAM.
    fn size_of(&self, id: &str, snap: &str, payload: &Path) -> Result<u64, StorageError> {
        if !payload.is_file() {
            return referenced_bytes(payload);
        }
        let vm = snapshot_vm_dir(&self.layout, id, snap);
        let vm_bytes: u64 = std::fs::read_dir(&vm)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.blocks() * 512)
                    .sum()
            })
            .unwrap_or(0);
        std::fs::metadata(payload)
            .map(|m| m.blocks() * 512 + vm_bytes)
            .map_err(|e| StorageError::io("stat", payload, e))
    }
}

/// Deletes every snapshot of a sandbox (called before its dir is removed: read-only
/// subvolumes cannot be unlinked file by file).
pub(crate) fn remove_all_snapshots(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
) -> Result<(), StorageError> {
    let dir = snapshots_dir(layout, id);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StorageError::io("read directory", &dir, e)),
    };
    for ent in rd {
        let ent = ent.map_err(|e| StorageError::io("read directory", &dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        remove_snapshot(layout, subvols, id, &name)?;
    }
    storage::remove_tree(&dir)
}

/// Everything a sandbox keeps on disk and under the run dir: its rootfs, its move copies,
/// its snapshots and its directories.
pub(super) fn remove_sandbox_storage(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
) -> Result<(), StorageError> {
    let resume = layout.sandbox_dir(id).join(super::moves::RESUME);
    for sub in [layout.sandbox_rootfs(id), resume] {
        if subvols.is_subvolume(&sub) {
            subvols.delete(&sub)?;
        }
    }
    crate::moves::remove_moves(layout, subvols, id)?;
    remove_all_snapshots(layout, subvols, id)?;
    // After its subvolumes (a crash between leaves a group `quota::sweep` takes at start).
    crate::quota::remove(layout, subvols, id)?;
    storage::remove_tree(&layout.sandbox_dir(id))?;
    storage::remove_tree(&layout.run_sandbox_dir(id))?;
    Ok(())
}

/// Bytes referenced by the files under `root` (allocated blocks; hard links once; symlinks
/// not followed).
pub(crate) fn referenced_bytes(root: &Path) -> Result<u64, StorageError> {
    let mut total = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd =
            std::fs::read_dir(&dir).map_err(|e| StorageError::io("read directory", &dir, e))?;
        for ent in rd {
            let ent = ent.map_err(|e| StorageError::io("read directory", &dir, e))?;
            let path = ent.path();
            let md =
                std::fs::symlink_metadata(&path).map_err(|e| StorageError::io("stat", &path, e))?;
            if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
                continue;
            }
            total += md.blocks() * 512;
            if md.is_dir() {
                stack.push(path);
            }
        }
    }
    Ok(total)
}

/// 32 lowercase hex digits (a systemd machine id).
fn new_machine_id() -> String {
    let mut rng = rand::rng();
    (0..32)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect()
}

/// Writes `data` as a fresh file `rel` inside `root`, as host root (on-disk uid 0, so root
/// inside the sandbox). The parent is resolved inside `root` (`RESOLVE_IN_ROOT`), so a
/// symlink planted by sandbox code cannot redirect the write outside the sandbox; whatever
/// is at the final name is unlinked first (never followed). A missing parent directory is
/// skipped (returns false).
fn write_in_root(root: &Path, rel: &str, data: &[u8]) -> Result<bool, StorageError> {
    let path = root.join(rel);
    let (parent, name) = rel.rsplit_once('/').unwrap_or((".", rel));
    let rootfd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| StorageError::io("open", root, e.into()))?;
    let dirfd = match rustix::fs::openat2(
        &rootfd,
        parent,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => return Ok(false),
        Err(e) => {
            return Err(StorageError::io(
                "open (in the sandbox root)",
                &path,
                e.into(),
            ));
        }
    };
    match rustix::fs::unlinkat(&dirfd, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(StorageError::io("replace", &path, e.into())),
    }
    let fd = rustix::fs::openat(
        &dirfd,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o444),
    )
    .map_err(|e| StorageError::io("create", &path, e.into()))?;
    let mut f = std::fs::File::from(fd);
    f.write_all(data)
        .map_err(|e| StorageError::io("write", &path, e))?;
    Ok(true)
}

/// Gives a fork's rootfs its own identity: /etc/hostname and /etc/machine-id. (The kernel
/// RNG is per host and reseeded continuously, so no random seed file is needed.)
pub(crate) fn write_identity(rootfs: &Path, hostname: &str) -> Result<(), StorageError> {
    write_in_root(rootfs, "etc/hostname", format!("{hostname}\n").as_bytes())?;
    let mid = new_machine_id();
    write_in_root(rootfs, "etc/machine-id", format!("{mid}\n").as_bytes())?;
    Ok(())
}

impl Node {
    pub(super) fn require_entry(&self, id: &str) -> Result<Entry, NodeError> {
        self.entry(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.to_string(),
        })
    }

    fn require_snapshot(&self, id: &str, snap: &str) -> Result<PathBuf, NodeError> {
        self.snapshots.require(id, snap)
    }

    /// `import_template` of a snapshot: the new version's rootfs is a btrfs snapshot of the
    /// sandbox's snapshot subvolume (no copy), with the defaults of the sandbox's template.
    pub(super) async fn template_from_snapshot(
        &self,
        name: &str,
        source: &str,
        snap: &str,
        defaults: Option<crate::api::TemplateDefaults>,
    ) -> Result<TemplateInfo, NodeError> {
        ids::validate_template_name(name)?;
        ids::validate_sandbox_id(source)?;
        ids::validate_sandbox_id(snap)?;
        let lock = self.lock_for(source);
        let _guard = lock.lock().await;
        let src = self.require_entry(source)?;
        if !self.disk(&src.record).is_tree() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {source} is a microvm: its snapshots are disk images, and a template is \
                 made from a namespace sandbox's snapshot"
            )));
        }
        let rootfs = self.require_snapshot(source, snap)?;
        let defaults = defaults.unwrap_or_else(|| {
            self.templates
                .get(&src.record.spec.template, src.record.template_version)
                .map(|t| t.defaults)
                .unwrap_or_default()
        });
        let (store, name, desc) = (
            self.templates.clone(),
            name.to_owned(),
            format!("snapshot:{source}/{snap}"),
        );
        let info =
            blocking(move || Ok(store.from_subvolume(&name, &rootfs, &desc, defaults)?)).await?;
        Ok(info)
    }

    /// A snapshot of sandbox `id`; with `memory`, a running (or paused) microvm's memory is
    /// kept too (a checkpoint, `vm/`).
    pub(super) async fn snapshot_impl(
        &self,
        id: &str,
        snap: &str,
        memory: bool,
    ) -> Result<SnapshotInfo, NodeError> {
        ids::validate_sandbox_id(id)?;
        ids::validate_sandbox_id(snap)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let entry = self.require_entry(id)?;
        let disk = self.disk(&entry.record);
        if let Some(info) = self.snapshots.existing(id, snap) {
            return Ok(info);
        }
        let running = self.is_running(&entry.record);
        let keep_memory = memory && disk.in_guest() && running;
        let rec = SnapshotRecord {
            id: snap.to_string(),
            sandbox_id: id.to_string(),
            created_unix_ms: now_unix_ms(),
            size_bytes: None,
            memory: keep_memory,
        };
        // Freeze so that every process's writes so far are in and none is half done
        // across files; a sandbox that is paused already stays as it is.
        let name = entry.record.runtime_name().to_owned();
        let freeze = running && !self.rt(&entry.record).is_frozen(&name);
        if freeze
            && disk.in_guest()
            && entry.client.is_some()
            && !flush_guest(entry.client.clone()).await
        {
            return Err(NodeError::Unavailable {
                id: id.to_string(),
                reason: "the guest did not flush its disk for the snapshot".into(),
            });
        }
        let t0 = std::time::Instant::now();
        let (store, rec2) = (self.snapshots.clone(), rec.clone());
        let filling = blocking(move || Ok(store.begin(&rec2, disk)?)).await?;
        // Stop the sandbox: a microvm checkpoint stops the VM itself (device state and RAM
        // into `vm/`, the channel to the guest stays connected); else the freezer.
        let rt = self.rt(&entry.record);
        let stopped = if let Some(filling) = filling.filter(|_| keep_memory) {
            rt.checkpoint(&name, &filling.join(VM_DIR), false)
                .await
                .map_err(internal("checkpoint the VM"))
        } else if freeze {
            rt.set_frozen(&name, true)
                .await
                .map_err(internal("freeze the sandbox for a snapshot"))
        } else {
            Ok(())
        };
        let (store, id2, snap2) = (self.snapshots.clone(), id.to_owned(), snap.to_owned());
        let res = match stopped {
            Ok(()) => blocking(move || Ok(store.seal(&id2, &snap2, disk)?)).await,
            Err(e) => Err(e),
        };
        // A checkpoint leaves the VM stopped; thawing a frozen sandbox or a stopped VM is
        // the same call.
        if freeze && let Err(e) = rt.set_frozen(&name, false).await {
            tracing::error!(id, error = %e, "failed to thaw the sandbox after a snapshot");
            if res.is_ok() {
                return Err(internal("thaw the sandbox after a snapshot")(e));
            }
        }
        if let Err(e) = res {
            let (store, id2, snap2) = (self.snapshots.clone(), id.to_owned(), snap.to_owned());
            let _ = blocking(move || Ok(store.remove(&id2, &snap2)?)).await;
            return Err(e);
        }
        tracing::info!(
            id,
            snapshot = snap,
            memory = keep_memory,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "snapshot taken"
        );
        Ok(self.snapshots.info(&rec))
    }

    pub(super) async fn changed_since_snapshot_impl(
        &self,
        id: &str,
        owner: &str,
        snap: &str,
    ) -> Result<bool, NodeError> {
        ids::validate_sandbox_id(id)?;
        ids::validate_sandbox_id(owner)?;
        ids::validate_sandbox_id(snap)?;
        self.require_entry(id)?;
        let rootfs = self.layout.sandbox_rootfs(id);
        let snap_rootfs = snapshot_rootfs(&self.layout, owner, snap);
        blocking(move || {
            let since = match space_sys::btrfs::subvolume_info(&snap_rootfs) {
                Ok(t) => t.otransid,
                Err(e) => {
                    tracing::debug!(error = %e, "no snapshot generation: counting as changed");
                    return Ok(true);
                }
            };
            Ok(space_sys::btrfs::changed_since(&rootfs, since).unwrap_or(true))
        })
        .await
    }

    pub(super) async fn list_snapshots_impl(
        &self,
        id: &str,
        with_size: bool,
    ) -> Result<Vec<SnapshotInfo>, NodeError> {
        ids::validate_sandbox_id(id)?;
        self.require_entry(id)?;
        let (store, id) = (self.snapshots.clone(), id.to_string());
        blocking(move || Ok(store.list(&id, with_size)?)).await
    }

    pub(super) async fn delete_snapshot_impl(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        ids::validate_sandbox_id(id)?;
        ids::validate_sandbox_id(snap)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let (store, id, snap) = (self.snapshots.clone(), id.to_string(), snap.to_string());
        blocking(move || Ok(store.remove(&id, &snap)?)).await
    }

    /// The VM checkpoint of snapshot `snap` of `owner` when it has one (a microvm's memory
    /// snapshot), checked as a restore for `limits` would check it: a corrupted or
    /// mismatched one is refused before anything is stopped.
    fn memory_of(
        &self,
        rec: &super::SandboxRecord,
        owner: &str,
        snap: &str,
        limits: &crate::api::Limits,
    ) -> Result<Option<PathBuf>, NodeError> {
        let dir = snapshot_vm_dir(&self.layout, owner, snap);
        if !self.disk(rec).in_guest() || !dir.join(crate::runtime::microvm::STATE_FILE).exists() {
            return Ok(None);
        }
        self.rt(rec).verify_checkpoint(&dir, limits).map_err(|e| {
            NodeError::Conflict(format!(
                "the memory of snapshot {snap} cannot be restored ({e}); nothing was changed"
            ))
        })?;
        Ok(Some(dir))
    }

    /// Launches `rec` from the VM checkpoint `memory` when given; if that restore fails
    /// (QEMU refuses the stream, or the guest does not answer), boots the files of `copy`
    /// (the snapshot the checkpoint is part of) afresh instead (the failed guest may have
    /// written to its disk), so the sandbox runs with the snapshot's files but fresh
    /// processes (`restored: false`).
    pub(super) async fn launch_from(
        &self,
        rec: &mut super::SandboxRecord,
        memory: Option<&Path>,
        copy: &Path,
    ) -> Result<(crate::runtime::Launched, GuestChannel), NodeError> {
        let Some(dir) = memory else {
            return self.launch(rec, None).await;
        };
        match self.launch(rec, Some(dir)).await {
            Ok(x) => Ok(x),
            Err(e) => {
                tracing::warn!(
                    id = %rec.spec.id,
                    checkpoint = %dir.display(),
                    error = %e,
                    "restoring the VM's memory failed: booting its disk instead"
                );
                let (disk, copy) = (self.disk(rec), copy.to_path_buf());
                let (layout, subvols, id) = (
                    self.layout.clone(),
                    self.subvols.clone(),
                    rec.spec.id.clone(),
                );
                blocking(move || {
                    let at = At::new(&layout, subvols.as_ref(), &id);
                    Ok(disk.replace_with(at, &copy)?)
                })
                .await?;
                self.launch(rec, None).await
            }
        }
    }

    pub(super) async fn rollback_impl(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        check_spec(spec)?;
        ids::validate_sandbox_id(snap)?;
        let id = spec.id.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        let mut entry = self.require_entry(&id)?;
        crate::quota::check_limit(&spec.limits, entry.record.runtime, self.subvols.as_ref())?;
        let disk = self.disk(&entry.record);
        self.require_snapshot(&id, snap)?;
        let source = snapshot_rootfs(&self.layout, &id, snap);
        let memory = self.memory_of(&entry.record, &id, snap, &spec.limits)?;
        self.rt(&entry.record)
            .destroy(entry.record.runtime_name(), entry.record.launched.as_ref())
            .await
            .map_err(internal("stop the sandbox for a rollback"))?;
        entry.record.launched = None;
        entry.client = None;
        entry.record.spec = spec.clone();
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), entry.clone());
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.clone());
        let disk_mib = spec.limits.disk_mib;
        let source2 = source.clone();
        blocking(move || {
            let at = At::new(&layout, subvols.as_ref(), &id2);
            disk.replace_with(at, &source2)?;
            Ok(crate::quota::set_limit(
                &layout,
                subvols.as_ref(),
                &id2,
                disk_mib,
            )?)
        })
        .await?;
        self.persist(&id, false).await?;
        let (launched, client) = self
            .launch_from(&mut entry.record, memory.as_deref(), &source)
            .await?;
        entry.record.launched = Some(launched);
        entry.client = Some(client);
        let status = self.status_of(&entry.record);
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), entry);
        self.persist(&id, false).await?;
        tracing::info!(
            id,
            snapshot = snap,
            memory = status.restored,
            "sandbox rolled back"
        );
        Ok(status)
    }

    pub(super) async fn fork_impl(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        check_spec(spec)?;
        ids::validate_sandbox_id(source)?;
        ids::validate_sandbox_id(snap)?;
        let id = spec.id.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        if let Some(entry) = self.entry(&id) {
            return Ok(self.status_of(&entry.record));
        }
        self.check_free_memory()?;
        let src = self.require_entry(source)?;
        crate::quota::check_limit(&spec.limits, src.record.runtime, self.subvols.as_ref())?;
        let disk = self.disk(&src.record);
        self.require_snapshot(source, snap)?;
        let copy = snapshot_rootfs(&self.layout, source, snap);
        let memory = self.memory_of(&src.record, source, snap, &spec.limits)?;
        let uid_base = self.allocate_uids()?;
        let mut rec = self.new_record(spec, src.record.template_version, uid_base);
        // A fork runs where its source ran.
        rec.runtime = src.record.runtime;
        let result = async {
            let (layout, subvols, rec2) = (self.layout.clone(), self.subvols.clone(), rec.clone());
            let copy2 = copy.clone();
            blocking(move || {
                let id = &rec2.spec.id;
                let dir = layout.sandbox_dir(id);
                if dir.exists() {
                    remove_sandbox_storage(&layout, subvols.as_ref(), id)?;
                }
                storage::mkdir_private(&dir)?;
                let at = At::new(&layout, subvols.as_ref(), id);
                disk.fork_from(at, &copy2, &rec2.spec.hostname)?;
                // Its own group and limit: what it shares with the source stays the source's.
                crate::quota::set_limit(&layout, subvols.as_ref(), id, rec2.spec.limits.disk_mib)?;
                storage::write_json_atomic(&layout.sandbox_record(id), &rec2, false)?;
                Ok(())
            })
            .await?;
            self.launch_from(&mut rec, memory.as_deref(), &copy).await
        }
        .await;
        match result {
            Ok((launched, client)) => {
                let status = self.register_launched(rec, launched, client).await;
                tracing::info!(id, source, snapshot = snap, uid_base, "sandbox forked");
                self.sync_record_in_background(&id);
                Ok(status)
            }
            Err(err) => {
                tracing::warn!(id, error = %err, "fork failed; rolling back");
                self.undo_new_sandbox(&id, uid_base).await;
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_ids_are_32_hex_and_distinct() {
        let (a, b) = (new_machine_id(), new_machine_id());
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
    }

    #[test]
    fn identity_writes_stay_inside_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("victim"), "keep").unwrap();
        // A planted symlink at the file itself, and one escaping through `..`.
        std::os::unix::fs::symlink(outside.join("victim"), root.join("etc/hostname")).unwrap();
        std::os::unix::fs::symlink("../../outside/mid", root.join("etc/machine-id")).unwrap();
        write_identity(&root, "host1").unwrap();
        assert_eq!(
            std::fs::read_to_string(outside.join("victim")).unwrap(),
            "keep"
        );
        assert!(!outside.join("mid").exists());
        assert_eq!(
            std::fs::read_to_string(root.join("etc/hostname")).unwrap(),
            "host1\n"
        );
        let mid = std::fs::read_to_string(root.join("etc/machine-id")).unwrap();
        assert_eq!(mid.trim().len(), 32);
        assert!(
            !std::fs::symlink_metadata(root.join("etc/machine-id"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        // /etc itself a symlink out of the root: resolved inside the root instead.
        let evil = tmp.path().join("evil");
        std::fs::create_dir_all(&evil).unwrap();
        std::os::unix::fs::symlink(&outside, evil.join("etc")).unwrap();
        write_identity(&evil, "h").unwrap();
        assert!(!outside.join("hostname").exists());
        // No /etc at all: skipped, not an error.
        let bare = tmp.path().join("bare");
        std::fs::create_dir_all(&bare).unwrap();
        write_identity(&bare, "h").unwrap();
    }

    #[test]
    fn referenced_bytes_counts_hard_links_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a"), vec![1u8; 64 * 1024]).unwrap();
        let one = referenced_bytes(d).unwrap();
        std::fs::hard_link(d.join("sub/a"), d.join("b")).unwrap();
        assert_eq!(referenced_bytes(d).unwrap(), one);
        assert!(one >= 64 * 1024);
    }
}
