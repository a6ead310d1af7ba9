//! `NodeApi::diff_sandbox` for the node (decision 0011): resolves snapshot ids and the
//! creation base to subvolume paths and runs [`crate::diff::diff_trees`] off the runtime.

use super::{Node, blocking};
use crate::api::NodeError;
use crate::diff::{self, Change};
use crate::ids;

impl Node {
    pub(super) async fn diff_impl(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<Change>, NodeError> {
        ids::validate_sandbox_id(id)?;
        let entry = self.entry(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.to_string(),
        })?;
        if !self.disk(&entry.record).is_tree() {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is a {}: its files are a disk image, and a diff compares the \
                 directory trees of namespace sandboxes",
                entry.record.runtime
            )));
        }
        let snap_path = |snap: &str| -> Result<std::path::PathBuf, NodeError> {
            ids::validate_sandbox_id(snap)
                .map_err(|_| NodeError::InvalidArgument(format!("invalid snapshot id {snap:?}")))?;
            let p = self
                .layout
                .sandbox_dir(id)
                .join("snapshots")
                .join(snap)
                .join("rootfs");
            if self.subvols.is_subvolume(&p) {
                Ok(p)
            } else {
                Err(NodeError::NotFound {
                    kind: "snapshot",
                    id: snap.to_string(),
                })
            }
        };
        // Creation: the pinned template version the sandbox (or the fork's source) was made of.
        let a = match from {
            Some(s) => snap_path(s)?,
            None => self
                .layout
                .template_version_dir(&entry.record.spec.template, entry.record.template_version)
                .join("rootfs"),
        };
        let b = match to {
            Some(s) => snap_path(s)?,
            None => self.layout.sandbox_rootfs(id),
        };
        blocking(move || {
            let t0 = std::time::Instant::now();
            let (mut changes, stats) = diff::diff_trees(&a, &b)
                .map_err(|e| NodeError::Internal(format!("diff failed: {e}")))?;
            diff::add_text_diffs(&a, &b, &mut changes);
            tracing::debug!(
                changes = changes.len(),
                pruned = stats.pruned,
                dirs_read = stats.dirs_read,
                elapsed_us = t0.elapsed().as_micros() as u64,
                "diff computed"
            );
            Ok(changes)
        })
        .await
    }
}
