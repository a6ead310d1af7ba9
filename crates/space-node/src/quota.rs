//! Disk quotas per sandbox (decision 0043). A sandbox with a disk limit has one quota group:
//! its live rootfs, every snapshot of it and every rootfs it had before a rollback are in it,
//! and under simple quotas each is charged what it wrote, for as long as it is kept. So what a
//! snapshot keeps alive stays charged to the sandbox, and a write past the limit fails inside
//! with `EDQUOT` ("Disk quota exceeded"), in that sandbox only.
//!
//! The group's id is kept in `<sandbox dir>/disk-group`, next to the subvolumes it holds, so
//! every path that makes or removes one of them (snapshot, rollback, fork, move, remove,
//! recovery) finds it without the record.

use std::path::{Path, PathBuf};

use crate::api::{Limits, NodeError, RuntimeKind};
use crate::storage::{self, Layout, StorageError, Subvolumes};

const GROUP_FILE: &str = "disk-group";

/// Why a disk limit cannot be had on this node.
pub(crate) const UNSUPPORTED: &str = "this node has no disk quotas (spaced --disk-quotas off, \
     or a kernel before Linux 6.7 without btrfs simple quotas): a disk limit cannot be kept here";

/// A disk limit needs quotas on the volume, and applies to namespace sandboxes: a microvm's
/// disk is its own ext4 image, bounded by the image's size.
pub(crate) fn check_limit(
    limits: &Limits,
    kind: RuntimeKind,
    subvols: &dyn Subvolumes,
) -> Result<(), NodeError> {
    match limits.disk_mib {
        None => Ok(()),
        Some(_) if kind == RuntimeKind::Microvm => Err(NodeError::InvalidArgument(
            "disk_mib applies to namespace sandboxes: a microvm's disk is its own ext4 image, \
             bounded by the image's size"
                .to_owned(),
        )),
        Some(0) => Err(NodeError::InvalidArgument(
            "disk_mib must be positive".into(),
        )),
        Some(_) if subvols.quotas().is_none() => {
            Err(NodeError::InvalidArgument(UNSUPPORTED.into()))
        }
        Some(_) => Ok(()),
    }
}

/// The volume's subvolumes, with simple quotas turned on when `quotas`; a volume that
/// cannot have them (an older kernel) is opened without, with a warning.
pub(crate) fn open_btrfs(root: &Path, quotas: bool) -> storage::Btrfs {
    if !quotas {
        return storage::Btrfs::default();
    }
    storage::Btrfs::with_quotas(root).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "disk quotas are off: a create with a disk limit will be refused");
        storage::Btrfs::default()
    })
}

fn group_file(layout: &Layout, id: &str) -> PathBuf {
    layout.sandbox_dir(id).join(GROUP_FILE)
}

/// The quota group of sandbox `id`, if it has one.
pub(crate) fn group_of(layout: &Layout, id: &str) -> Option<u64> {
    std::fs::read_to_string(group_file(layout, id))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Gives sandbox `id` the disk limit `limit_mib`: its group is made from its rootfs first when
/// it has none (no limit and no group: nothing to do). Every subvolume already in its
/// directory joins the group, so a sandbox that comes from another node or had snapshots
/// before its first limit is charged for them too.
pub(crate) fn set_limit(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
    limit_mib: Option<u64>,
) -> Result<(), StorageError> {
    let existing = group_of(layout, id);
    if existing.is_none() && limit_mib.is_none() {
        return Ok(());
    }
    let Some(q) = subvols.quotas() else {
        return Err(StorageError::Unsupported(UNSUPPORTED.into()));
    };
    let group = match existing {
        Some(g) => g,
        None => {
            let g = q.create(&layout.sandbox_rootfs(id))?;
            for sub in subvolumes_in(subvols, &layout.sandbox_dir(id)) {
                q.join(g, &sub)?;
            }
            // A crash before this leaves a group no sandbox names: `sweep` takes it.
            storage::write_json_atomic(&group_file(layout, id), &g, false)?;
            g
        }
    };
    q.limit(group, limit_mib.map(|m| m << 20))
}

/// Puts the new subvolume `subvol` of sandbox `id` (a snapshot, a rolled-back rootfs) into
/// its group, when it has one.
pub(crate) fn join(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
    subvol: &Path,
) -> Result<(), StorageError> {
    match (subvols.quotas(), group_of(layout, id)) {
        (Some(q), Some(g)) => q.join(g, subvol),
        _ => Ok(()),
    }
}

/// Bytes charged to sandbox `id`'s group (its rootfs, snapshots and earlier rootfs), when it
/// has one.
pub(crate) fn usage(layout: &Layout, subvols: &dyn Subvolumes, id: &str) -> Option<u64> {
    let g = group_of(layout, id)?;
    subvols.quotas()?.usage(g).ok().flatten()
}

/// Destroys sandbox `id`'s group, after its subvolumes are gone.
pub(crate) fn remove(
    layout: &Layout,
    subvols: &dyn Subvolumes,
    id: &str,
) -> Result<(), StorageError> {
    match (subvols.quotas(), group_of(layout, id)) {
        (Some(q), Some(g)) => q.destroy(g),
        _ => Ok(()),
    }
}

/// At start: destroys every group no sandbox dir names (left by a crash between a remove's
/// subvolumes and its group). Returns how many.
pub(crate) fn sweep(layout: &Layout, subvols: &dyn Subvolumes) -> Result<usize, StorageError> {
    let Some(q) = subvols.quotas() else {
        return Ok(0);
    };
    let mut named = std::collections::HashSet::new();
    let dir = layout.sandboxes();
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for ent in rd.flatten() {
            if let Some(g) = ent.file_name().to_str().and_then(|id| group_of(layout, id)) {
                named.insert(g);
            }
        }
    }
    let mut swept = 0;
    for g in q.groups()? {
        if !named.contains(&g) {
            q.destroy(g)?;
            swept += 1;
        }
    }
    Ok(swept)
}

/// The subvolumes in a sandbox's directory (its rootfs, its snapshots' rootfs, what a move
/// brought), never descending into one.
fn subvolumes_in(subvols: &dyn Subvolumes, dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for ent in rd.flatten() {
            let p = ent.path();
            if !ent.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if subvols.is_subvolume(&p) {
                out.push(p);
            } else if depth < 3 {
                stack.push((p, depth + 1));
            }
        }
    }
    out
}
