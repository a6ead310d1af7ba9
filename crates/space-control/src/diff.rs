//! `GET /v1/sandboxes/{id}/diff?from=SNAP&to=SNAP` (decision 0011): the paths added, modified
//! and deleted between two of the sandbox's snapshots, or from its creation (`from` absent)
//! and/or to the live filesystem (`to` absent).

use space_api::DiffEntry;
use space_node_api::diff::ChangeKind;

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};

impl Engine {
    /// 404 for an unknown sandbox or snapshot, 400 for another sandbox's snapshot.
    pub async fn diff(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> ControlResult<Vec<DiffEntry>> {
        if self.store.get_sandbox(id).await?.is_none() {
            return Err(ControlError::not_found(format!("sandbox {id} not found")));
        }
        for snap in [from, to].into_iter().flatten() {
            match self.store.get_snapshot(snap).await? {
                None => {
                    return Err(ControlError::not_found(format!(
                        "snapshot {snap} not found"
                    )));
                }
                Some(s) if s.sandbox_id != id => {
                    return Err(ControlError::invalid(format!(
                        "snapshot {snap} belongs to sandbox {}, not to {id}",
                        s.sandbox_id
                    )));
                }
                Some(_) => {}
            }
        }
        let changes = self.node.diff_sandbox(id, from, to).await?;
        Ok(changes
            .into_iter()
            .map(|c| DiffEntry {
                path: c.path,
                change: match c.kind {
                    ChangeKind::Added => "added",
                    ChangeKind::Modified => "modified",
                    ChangeKind::Deleted => "deleted",
                }
                .to_string(),
                kind: if c.is_dir { "dir" } else { "file" }.to_string(),
                text_diff: c.text_diff,
            })
            .collect())
    }
}
