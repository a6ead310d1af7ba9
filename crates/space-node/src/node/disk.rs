//! How a sandbox's files are kept on the node, by runtime kind (decision 0057): the one place
//! where node code tells a namespace sandbox from a microvm in storage. Create, snapshot,
//! rollback, fork, move and adopt ask the sandbox's [`Disk`] and branch on nothing else.
//!
//! - [`Tree`] (namespace): the rootfs is a btrfs subvolume `rootfs/` the runtime mounts. A
//!   snapshot or a move copy is a read-only snapshot of it, charged to the sandbox's quota
//!   group; the node reads its files (diff, a template from a snapshot).
//! - [`Image`] (microvm): the guest kernel mounts an ext4 image `disk.ext4`, reflinked (O(1)
//!   on btrfs). A snapshot or a move copy is a read-only subvolume holding a reflink of the
//!   image and, when the memory was kept, the VM's checkpoint in `vm/`, so that `btrfs send`
//!   carries both.
//!
//! The disk is chosen by the record's kind, not by the node's runtime: a node whose microvm
//! runtime is off (or not made yet) still recovers, moves and removes a microvm's files.

use std::path::{Path, PathBuf};

use super::moves::RESUME;
use super::snapshots::{VM_DIR, write_identity};
use super::{SANDBOX_DISK, template_disk};
use crate::api::{NodeError, RuntimeKind};
use crate::storage::{self, Layout, StorageError, Subvolumes};

/// Where a sandbox's files are: its dirs (`layout`), the btrfs calls (`subvols`), its id.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub layout: &'a Layout,
    pub subvols: &'a dyn Subvolumes,
    pub id: &'a str,
}

impl<'a> At<'a> {
    pub fn new(layout: &'a Layout, subvols: &'a dyn Subvolumes, id: &'a str) -> Self {
        Self {
            layout,
            subvols,
            id,
        }
    }

    fn dir(&self) -> PathBuf {
        self.layout.sandbox_dir(self.id)
    }

    fn rootfs(&self) -> PathBuf {
        self.layout.sandbox_rootfs(self.id)
    }

    fn image(&self) -> PathBuf {
        self.dir().join(SANDBOX_DISK)
    }
}

/// What a sandbox's files are and how they are made, copied and replaced. Every method runs
/// blocking file work (call it from `blocking`). A *copy* is a read-only subvolume: a
/// snapshot's `rootfs`, a move's `base` or `final`, or an adopted microvm's `resume`.
pub(crate) trait Disk: Send + Sync {
    /// Its files are a directory tree the node reads: a diff, a template from a snapshot.
    fn is_tree(&self) -> bool;

    /// The guest keeps its own page cache, which a snapshot must have flushed first; and its
    /// copies may hold the memory too (a checkpoint in `vm/`).
    fn in_guest(&self) -> bool;

    /// The block device the runtime gives the sandbox (`LaunchPlan::disk`), if any.
    fn device(&self, at: At) -> Option<PathBuf>;

    /// A new sandbox's files from template version `tmpl_rootfs`; with `from`, a template
    /// checkpoint it will be restored from (an image takes the disk that checkpoint had).
    fn make(&self, at: At, tmpl_rootfs: &Path, from: Option<&Path>) -> Result<(), NodeError>;

    /// A fork's files from its source's snapshot `copy`; a tree is given the fork's
    /// `hostname` and a fresh machine-id (a guest takes them when it starts).
    fn fork_from(&self, at: At, copy: &Path, hostname: &str) -> Result<(), StorageError>;

    /// A moved sandbox's files from the `copy` that came (its memory kept for its next start).
    fn adopt_from(&self, at: At, copy: &Path) -> Result<(), StorageError>;

    /// The sandbox's files replaced by those of `copy` (a rollback, or a boot after a memory
    /// restore failed: the failed guest may have written to its disk).
    fn replace_with(&self, at: At, copy: &Path) -> Result<(), StorageError>;

    /// The subvolume a copy `name` in `dir` is filled in while the sandbox is stopped, made
    /// before it stops (for an image: the checkpoint goes there). None: nothing to fill.
    fn begin_copy(&self, at: At, dir: &Path, name: &str) -> Result<Option<PathBuf>, StorageError>;

    /// Seals the stopped sandbox's files as the read-only copy `name` in `dir`; `charged`:
    /// the copy stays charged to the sandbox's quota group (a snapshot, not a move copy).
    fn seal_copy(&self, at: At, dir: &Path, name: &str, charged: bool) -> Result<(), StorageError>;

    /// Brings files an older node left in another shape up to date (at recovery).
    fn upgrade(&self, _at: At) -> Result<(), StorageError> {
        Ok(())
    }
}

/// The disk of a sandbox of runtime `kind`.
pub(crate) fn of(kind: RuntimeKind) -> &'static dyn Disk {
    match kind {
        RuntimeKind::Namespace => &Tree,
        RuntimeKind::Microvm => &Image,
    }
}

/// The kind of sandbox a received `copy` holds: what came is what it is.
pub(crate) fn kind_of_copy(copy: &Path) -> RuntimeKind {
    if copy.join(SANDBOX_DISK).is_file() {
        RuntimeKind::Microvm
    } else {
        RuntimeKind::Namespace
    }
}

/// A namespace sandbox's rootfs subvolume.
pub(crate) struct Tree;

impl Disk for Tree {
    fn is_tree(&self) -> bool {
        true
    }

    fn in_guest(&self) -> bool {
        false
    }

    fn device(&self, _at: At) -> Option<PathBuf> {
        None
    }

    fn make(&self, at: At, tmpl_rootfs: &Path, _from: Option<&Path>) -> Result<(), NodeError> {
        at.subvols
            .snapshot(tmpl_rootfs, &at.dir(), "rootfs", false)?;
        Ok(())
    }

    fn fork_from(&self, at: At, copy: &Path, hostname: &str) -> Result<(), StorageError> {
        at.subvols.snapshot(copy, &at.dir(), "rootfs", false)?;
        write_identity(&at.rootfs(), hostname)
    }

    fn adopt_from(&self, at: At, copy: &Path) -> Result<(), StorageError> {
        at.subvols.snapshot(copy, &at.dir(), "rootfs", false)
    }

    fn replace_with(&self, at: At, copy: &Path) -> Result<(), StorageError> {
        let (dir, sv) = (at.dir(), at.subvols);
        let (new, old) = (dir.join("rootfs.new"), dir.join("rootfs.old"));
        for p in [&new, &old] {
            if sv.is_subvolume(p) {
                sv.delete(p)?;
            }
        }
        sv.snapshot(copy, &dir, "rootfs.new", false)?;
        // The rootfs it replaces stays in the group while snapshots share its extents.
        crate::quota::join(at.layout, sv, at.id, &new)?;
        let rootfs = at.rootfs();
        match std::fs::rename(&rootfs, &old) {
            Ok(()) => {}
            // A node killed between the two renames of an earlier replace left no rootfs:
            // this replace puts one in place all the same (found by the SIGKILL chaos test).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StorageError::io("move aside", &rootfs, e)),
        }
        std::fs::rename(&new, &rootfs)
            .map_err(|e| StorageError::io("move into place", &rootfs, e))?;
        if let Err(e) = sv.delete(&old) {
            tracing::warn!(error = %e, "failed to delete the replaced rootfs");
        }
        Ok(())
    }

    fn begin_copy(
        &self,
        _at: At,
        _dir: &Path,
        _name: &str,
    ) -> Result<Option<PathBuf>, StorageError> {
        Ok(None)
    }

    fn seal_copy(&self, at: At, dir: &Path, name: &str, charged: bool) -> Result<(), StorageError> {
        at.subvols.snapshot(&at.rootfs(), dir, name, true)?;
        if charged {
            // What the snapshot keeps alive stays charged to the sandbox (decision 0043).
            crate::quota::join(at.layout, at.subvols, at.id, &dir.join(name))?;
        }
        Ok(())
    }
}

/// A microvm's ext4 disk image (decision 0014).
pub(crate) struct Image;

impl Disk for Image {
    fn is_tree(&self) -> bool {
        false
    }

    fn in_guest(&self) -> bool {
        true
    }

    fn device(&self, at: At) -> Option<PathBuf> {
        Some(at.image())
    }

    fn make(&self, at: At, tmpl_rootfs: &Path, from: Option<&Path>) -> Result<(), NodeError> {
        // The template's ext4 image (made once, next to its rootfs), then a reflink copy of
        // it. A restore takes the disk the checkpointed guest had mounted. (A checkpoint
        // discarded meanwhile: the template's; the restore then fails on the missing state
        // and it boots.)
        let image = match from.map(|d| d.join(SANDBOX_DISK)) {
            Some(d) if d.is_file() => d,
            _ => {
                let image = template_disk(tmpl_rootfs);
                crate::runtime::microvm::ensure_template_disk(tmpl_rootfs, &image)
                    .map_err(|e| NodeError::Internal(format!("template disk: {e}")))?;
                image
            }
        };
        let disk = at.image();
        crate::runtime::microvm::clone_disk(&image, &disk)
            .map_err(|e| StorageError::io("reflink", &disk, e))?;
        Ok(())
    }

    fn fork_from(&self, at: At, copy: &Path, _hostname: &str) -> Result<(), StorageError> {
        // Its hostname and a fresh identity (machine-id included) come with Personalize when
        // it starts (decision 0014).
        storage::clone_file_atomic(&copy.join(SANDBOX_DISK), &at.image())
    }

    fn adopt_from(&self, at: At, copy: &Path) -> Result<(), StorageError> {
        storage::clone_file_atomic(&copy.join(SANDBOX_DISK), &at.image())?;
        if copy
            .join(VM_DIR)
            .join(crate::runtime::microvm::STATE_FILE)
            .is_file()
        {
            // Its memory: its next start restores it (`restart`).
            at.subvols.snapshot(copy, &at.dir(), RESUME, true)?;
        }
        Ok(())
    }

    fn replace_with(&self, at: At, copy: &Path) -> Result<(), StorageError> {
        storage::clone_file_atomic(&copy.join(SANDBOX_DISK), &at.image())
    }

    fn begin_copy(&self, at: At, dir: &Path, name: &str) -> Result<Option<PathBuf>, StorageError> {
        // Filled while the VM is stopped (its checkpoint), then sealed.
        storage::new_vm_subvolume(at.subvols, dir, name).map(Some)
    }

    fn seal_copy(
        &self,
        at: At,
        dir: &Path,
        name: &str,
        _charged: bool,
    ) -> Result<(), StorageError> {
        // A reflink of the image: O(1), and consistent (the VM is stopped).
        storage::seal_vm_subvolume(at.subvols, dir, name, &at.image())
    }

    fn upgrade(&self, at: At) -> Result<(), StorageError> {
        super::snapshots::upgrade_vm_snapshots(at.layout, at.subvols, at.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::fake::DirSubvolumes;

    #[test]
    fn a_copy_says_what_kind_of_sandbox_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(kind_of_copy(dir.path()), RuntimeKind::Namespace);
        std::fs::write(dir.path().join(SANDBOX_DISK), b"ext4").unwrap();
        assert_eq!(kind_of_copy(dir.path()), RuntimeKind::Microvm);
        for kind in RuntimeKind::ALL {
            assert_eq!(of(kind).is_tree(), kind == RuntimeKind::Namespace);
            assert_eq!(of(kind).in_guest(), kind == RuntimeKind::Microvm);
        }
    }

    #[test]
    fn a_tree_is_sealed_replaced_and_forked_with_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout {
            volume: dir.path().join("vol"),
            run_dir: dir.path().join("run"),
        };
        let subvols = DirSubvolumes::default();
        let tmpl = dir.path().join("tmpl");
        std::fs::create_dir_all(tmpl.join("etc")).unwrap();
        std::fs::write(tmpl.join("etc/hostname"), "template\n").unwrap();
        let at = At::new(&layout, &subvols, "s1");
        storage::mkdir_p(&at.dir(), 0o700).unwrap();
        assert_eq!(Tree.device(at), None);
        Tree.make(at, &tmpl, None).unwrap();
        std::fs::write(at.rootfs().join("work"), "kept").unwrap();
        let snaps = dir.path().join("snaps");
        std::fs::create_dir(&snaps).unwrap();
        assert_eq!(Tree.begin_copy(at, &snaps, "one").unwrap(), None);
        Tree.seal_copy(at, &snaps, "one", false).unwrap();
        std::fs::write(at.rootfs().join("work"), "broken").unwrap();
        Tree.replace_with(at, &snaps.join("one")).unwrap();
        assert_eq!(
            std::fs::read_to_string(at.rootfs().join("work")).unwrap(),
            "kept"
        );
        assert!(
            !at.dir().join("rootfs.old").exists(),
            "the replaced rootfs is deleted"
        );

        // Killed between the renames of a replace: no rootfs, the old one aside. The next
        // replace still puts the copy in place.
        std::fs::write(at.rootfs().join("work"), "broken").unwrap();
        std::fs::rename(at.rootfs(), at.dir().join("rootfs.old")).unwrap();
        Tree.replace_with(at, &snaps.join("one")).unwrap();
        assert_eq!(
            std::fs::read_to_string(at.rootfs().join("work")).unwrap(),
            "kept"
        );

        let fork = At { id: "s2", ..at };
        storage::mkdir_p(&fork.dir(), 0o700).unwrap();
        Tree.fork_from(fork, &snaps.join("one"), "forked").unwrap();
        assert_eq!(
            std::fs::read_to_string(fork.rootfs().join("work")).unwrap(),
            "kept"
        );
        assert_eq!(
            std::fs::read_to_string(fork.rootfs().join("etc/hostname")).unwrap(),
            "forked\n"
        );
    }
}
