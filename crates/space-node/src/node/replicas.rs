//! Replicas (issue 14, decision 0037): a node keeps the snapshots of a sandbox that runs on
//! another node, received by btrfs send as each snapshot is taken, so that the sandbox can
//! be restored here from its newest replicated snapshot when its own node is lost. A child
//! module of `node` (it shares the node's table and locks); the streams are `crate::moves`.

use super::{Node, blocking, remove_sandbox_storage};
use crate::api::moves::{MoveStream, Received};
use crate::api::{NodeError, SandboxSpec, SandboxStatus};
use crate::ids;
use crate::moves;
use crate::storage::{self, StorageError};

impl Node {
    #[tracing::instrument(name = "node.send_replica", skip_all, fields(sandbox = id))]
    pub(super) async fn send_replica_impl(
        &self,
        id: &str,
        have: &[String],
    ) -> Result<MoveStream, NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.require_entry(id)?;
        let (layout, have, id2) = (self.layout.clone(), have.to_vec(), id.to_owned());
        let items = blocking(move || moves::replica_plan(&layout, &id2, &have)).await?;
        Ok(moves::send(items))
    }

    #[tracing::instrument(name = "node.receive_replica", skip_all, fields(sandbox = id))]
    pub(super) async fn receive_replica_impl(
        &self,
        id: &str,
        parts: MoveStream,
    ) -> Result<Received, NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        if self.entry(id).is_some() {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} runs on this node: its replica belongs on another"
            )));
        }
        let dir = moves::replica_dir(&self.layout, id);
        let (subvols, dir2) = (self.subvols.clone(), dir.clone());
        blocking(move || {
            // What an earlier receive left half done goes first.
            moves::trim_replica(&dir2, subvols.as_ref(), None)?;
            Ok(storage::mkdir_p(&dir2, 0o700)?)
        })
        .await?;
        let got = moves::receive(&dir, parts, space_node_api::moves::valid_replica_path).await;
        let (subvols, dir2) = (self.subvols.clone(), dir.clone());
        // A snapshot cut short goes; the whole ones stay, and are what the answer lists.
        let held = blocking(move || moves::trim_replica(&dir2, subvols.as_ref(), None)).await;
        let mut got = got?;
        got.snapshots = held?;
        tracing::info!(
            id,
            bytes = got.bytes,
            snapshots = got.snapshots.len(),
            "replica received"
        );
        Ok(got)
    }

    pub(super) async fn drop_replica_impl(
        &self,
        id: &str,
        keep: &[String],
    ) -> Result<Vec<String>, NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let dir = moves::replica_dir(&self.layout, id);
        let (subvols, keep) = (self.subvols.clone(), keep.to_vec());
        blocking(move || moves::trim_replica(&dir, subvols.as_ref(), Some(&keep))).await
    }

    #[tracing::instrument(name = "node.restore_replica", skip_all, fields(sandbox = %spec.id, snapshot = snap))]
    pub(super) async fn restore_replica_impl(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        ids::validate_sandbox_id(snap)
            .map_err(|_| NodeError::InvalidArgument(format!("invalid snapshot id {snap:?}")))?;
        let replica = moves::replica_dir(&self.layout, &spec.id);
        let snap2 = snap.to_owned();
        self.adopt_with(spec, "restoring", move |layout, subvols, id| {
            let holds = |dir: &std::path::Path| -> Result<bool, NodeError> {
                Ok(moves::snapshots_oldest_first(dir)?
                    .iter()
                    .any(|(s, _)| *s == snap2))
            };
            let dir = layout.sandbox_dir(id);
            let snaps = dir.join("snapshots");
            if holds(&replica.join("snapshots"))? {
                // Leftovers of an earlier life of the sandbox here go first.
                remove_sandbox_storage(layout, subvols, id)?;
                storage::mkdir_private(&dir)?;
                std::fs::rename(replica.join("snapshots"), &snaps)
                    .map_err(|e| StorageError::io("move replica snapshots to", &snaps, e))?;
                storage::remove_tree(&replica)?;
            } else if !holds(&snaps)? {
                // (When the sandbox's directory holds it, a restore before this one moved
                // the snapshots there and stopped: it goes on from there.)
                return Err(NodeError::NotFound {
                    kind: "replicated snapshot",
                    id: format!("{snap2} of sandbox {id}"),
                });
            }
            Ok(snaps.join(&snap2).join("rootfs"))
        })
        .await
    }
}
