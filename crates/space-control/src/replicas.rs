//! Replicas, and what happens to a lost node's sandboxes (issue 14, decision 0037).
//!
//! A sandbox created with `replicas: 1` has each of its snapshots sent to a second node by
//! btrfs send, incremental against the newest snapshot that node holds already, relayed by
//! the control replica as moves are (decision 0035). When the sandbox's node is lost (silent
//! for `--node-lost-after`), the sandbox is restored on its replica's node from the newest
//! replicated snapshot, and its events say which one; a sandbox without a replica is marked
//! `lost`, never recreated empty. A lost node that comes back has its stale copies removed.
//!
//! All of it is reconciler steps (level-triggered, each under the sandbox's lease):
//! - `Replicate`: the replica lacks a snapshot the sandbox has, holds one it no longer has,
//!   or sits on a node that cannot keep it (lost, or the sandbox's own after a move);
//! - `Restore`: the sandbox's node is lost, or a restore was begun and not finished;
//! - `RemoveStray`: a node holds a sandbox the store places on another node.

use std::collections::{BTreeSet, HashMap};

use space_api::{ReplicaStatus, SandboxState, rfc3339_from_unix_ms};
use space_node_api::{NodeApi, NodeError, Phase};
use sqlx::Row;

use crate::engine::{Engine, node_spec};
use crate::error::{ControlError, ControlResult};
use crate::reconcile::Step;
use crate::scheduler::Need;
use crate::store::{SandboxRow, Store, StoreError, now_ms};

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

/// A sandbox's replica as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRow {
    pub sandbox_id: String,
    pub node_id: String,
    /// The newest snapshot the replica holds whole.
    pub snapshot_id: String,
    /// Every snapshot it holds whole, oldest first.
    pub snapshots: Vec<String>,
    /// Bytes the last replication that sent anything sent.
    pub last_bytes: u64,
    pub updated_at: i64,
}

impl ReplicaRow {
    pub fn dto(&self) -> ReplicaStatus {
        ReplicaStatus {
            node: self.node_id.clone(),
            snapshot_id: self.snapshot_id.clone(),
            snapshots: self.snapshots.len() as u32,
            last_bytes: self.last_bytes,
            updated_at: rfc3339_from_unix_ms(self.updated_at),
        }
    }
}

const COLUMNS: &str = "sandbox_id, node_id, snapshot_id, snapshots, last_bytes, updated_at";

fn decode(r: &sqlx::any::AnyRow) -> Result<ReplicaRow, StoreError> {
    let snapshots: String = r.try_get("snapshots").map_err(q("decode replica"))?;
    Ok(ReplicaRow {
        sandbox_id: r.try_get("sandbox_id").map_err(q("decode replica"))?,
        node_id: r.try_get("node_id").map_err(q("decode replica"))?,
        snapshot_id: r.try_get("snapshot_id").map_err(q("decode replica"))?,
        snapshots: serde_json::from_str(&snapshots).unwrap_or_default(),
        last_bytes: r
            .try_get::<i64, _>("last_bytes")
            .map_err(q("decode replica"))?
            .max(0) as u64,
        updated_at: r.try_get("updated_at").map_err(q("decode replica"))?,
    })
}

impl Store {
    pub async fn get_replica(&self, id: &str) -> Result<Option<ReplicaRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandbox_replicas WHERE sandbox_id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get replica"))?;
        row.as_ref().map(decode).transpose()
    }

    pub async fn all_replicas(&self) -> Result<HashMap<String, ReplicaRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM sandbox_replicas"))
            .fetch_all(self.pool())
            .await
            .map_err(q("list replicas"))?;
        rows.iter()
            .map(|r| decode(r).map(|r| (r.sandbox_id.clone(), r)))
            .collect()
    }

    pub async fn put_replica(&self, r: &ReplicaRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandbox_replicas (sandbox_id, node_id, snapshot_id, snapshots, \
             last_bytes, updated_at) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (sandbox_id) DO UPDATE SET node_id = excluded.node_id, \
             snapshot_id = excluded.snapshot_id, snapshots = excluded.snapshots, \
             last_bytes = excluded.last_bytes, updated_at = excluded.updated_at",
        )
        .bind(&r.sandbox_id)
        .bind(&r.node_id)
        .bind(&r.snapshot_id)
        .bind(serde_json::to_string(&r.snapshots).unwrap_or_default())
        .bind(r.last_bytes as i64)
        .bind(r.updated_at)
        .execute(self.pool())
        .await
        .map_err(q("put replica"))?;
        Ok(())
    }

    pub async fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandbox_replicas WHERE sandbox_id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("delete replica"))?;
        Ok(())
    }

    /// Every sandbox's snapshot ids, oldest first.
    pub async fn snapshot_ids_by_sandbox(
        &self,
    ) -> Result<HashMap<String, Vec<String>>, StoreError> {
        let rows = sqlx::query("SELECT sandbox_id, id FROM snapshots ORDER BY created_at, id")
            .fetch_all(self.pool())
            .await
            .map_err(q("list snapshot ids"))?;
        let mut out: HashMap<String, Vec<String>> = HashMap::new();
        for r in &rows {
            let sandbox: String = r.try_get(0).map_err(q("list snapshot ids"))?;
            out.entry(sandbox)
                .or_default()
                .push(r.try_get(1).map_err(q("list snapshot ids"))?);
        }
        Ok(out)
    }

    /// Forgets the snapshots of sandbox `id` not in `keep` (those its restore did not bring
    /// back), and points its head at `head`.
    async fn keep_only_snapshots(
        &self,
        id: &str,
        keep: &[String],
        head: &str,
    ) -> Result<Vec<String>, StoreError> {
        let mut gone = Vec::new();
        for s in self.list_snapshots(id).await? {
            if !keep.contains(&s.id) {
                self.delete_snapshot(&s.id).await?;
                gone.push(s.id);
            }
        }
        self.set_snapshot_head(id, head).await?;
        Ok(gone)
    }
}

/// Whether a sandbox in `state` has storage worth replicating or restoring.
fn live(row: &SandboxRow) -> bool {
    row.deleted_at.is_none()
        && matches!(
            row.state,
            SandboxState::Running | SandboxState::Paused | SandboxState::Stopped
        )
}

impl Engine {
    /// The steps of replication and node loss for one reconcile pass, from every row (those
    /// on unreachable nodes too) and what the nodes reported. Empty all-in-one.
    pub(crate) async fn replication_pass(
        &self,
        rows: &[SandboxRow],
        observed: &space_node_api::Observation,
    ) -> ControlResult<Vec<Step>> {
        let Some(nodes) = &self.cluster_nodes else {
            return Ok(Vec::new());
        };
        let mut steps: Vec<Step> = observed
            .strays
            .iter()
            .map(|(node, id)| Step::RemoveStray {
                id: id.clone(),
                node: node.clone(),
            })
            .collect();
        let lost = nodes.lost_members();
        let replicated = rows.iter().any(|r| r.spec.replicas > 0);
        if lost.is_empty() && !replicated {
            return Ok(steps);
        }
        let placements = self.store.placements().await?;
        let replicas = self.store.all_replicas().await?;
        let snapshots = if replicated {
            self.store.snapshot_ids_by_sandbox().await?
        } else {
            HashMap::new()
        };
        let seen: BTreeSet<&str> = observed.sandboxes.iter().map(|s| s.id.as_str()).collect();
        for row in rows.iter().filter(|r| live(r)) {
            let Some(home) = placements.get(&row.id) else {
                continue;
            };
            let replica = replicas.get(&row.id);
            // A restore begun (the claim moved to the replica's node) and not finished.
            let restoring =
                replica.is_some_and(|r| r.node_id == *home) && !seen.contains(row.id.as_str());
            if lost.contains(home) || restoring {
                steps.push(Step::Restore { id: row.id.clone() });
                continue;
            }
            if row.spec.replicas == 0 {
                continue;
            }
            let want = snapshots
                .get(&row.id)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let behind = match replica {
                None => !want.is_empty(),
                Some(r) => r.snapshots != want || r.node_id == *home || lost.contains(&r.node_id),
            };
            if behind {
                steps.push(Step::Replicate { id: row.id.clone() });
            }
        }
        Ok(steps)
    }

    /// `Replicate`: brings the sandbox's replica up to its snapshots.
    pub(crate) async fn ensure_replicated(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let (Some(row), Some(nodes)) = (row, self.cluster_nodes.as_ref()) else {
            return Ok(());
        };
        if !live(&row) || row.spec.replicas == 0 {
            return Ok(());
        }
        let id = row.id.as_str();
        let want: Vec<String> = self
            .store
            .list_snapshots(id)
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect();
        if want.is_empty() {
            return Ok(());
        }
        let (home_id, home) = nodes.placement_of(id).await?;
        if nodes.is_lost(&home_id) {
            return Ok(());
        }
        let spec = node_spec(id, &row.spec);
        let need = Need::of(&spec);
        let existing = self.store.get_replica(id).await?;
        let kept = existing
            .as_ref()
            .filter(|r| r.node_id != home_id && !nodes.is_lost(&r.node_id));
        let (node_id, dst) = match kept {
            Some(r) => match nodes.reachable_member(&r.node_id) {
                Some(api) => (r.node_id.clone(), api),
                // Silent, not lost yet: it may answer again.
                None => return Ok(()),
            },
            None => {
                let Some((c, api)) = nodes
                    .choose_replica_node(id, &spec.template, &need, &home_id)
                    .await?
                else {
                    tracing::debug!(sandbox = id, "no other node can keep a replica now");
                    return Ok(());
                };
                if let Some(old) = &existing {
                    self.drop_old_replica(old).await;
                }
                (c.id, api)
            }
        };
        // The replica's node can restore it only with its template.
        nodes
            .ensure_template(&node_id, &dst, &spec.template)
            .await?;
        // What it holds, less what the sandbox no longer has.
        let held = dst.drop_replica(id, &want).await?;
        let sent = !want.iter().all(|s| held.contains(s));
        let got = if !sent {
            space_node_api::moves::Received {
                snapshots: held,
                ..Default::default()
            }
        } else {
            let parts = home.send_replica(id, &held).await?;
            dst.receive_replica(id, parts).await?
        };
        let Some(newest) = want.iter().rev().find(|s| got.snapshots.contains(s)) else {
            return Err(ControlError::from(NodeError::Internal(format!(
                "node {node_id} kept none of sandbox {id}'s snapshots"
            ))));
        };
        let fresh = existing.as_ref().is_none_or(|r| r.node_id != node_id);
        let r = ReplicaRow {
            sandbox_id: id.to_owned(),
            node_id: node_id.clone(),
            snapshot_id: newest.clone(),
            snapshots: want
                .iter()
                .filter(|s| got.snapshots.contains(s))
                .cloned()
                .collect(),
            // A pass that found everything there already sent nothing: the figure stays the
            // last send's, so a reader never sees a replication's bytes turn into 0.
            last_bytes: match &existing {
                Some(r) if !sent && r.node_id == node_id => r.last_bytes,
                _ => got.bytes,
            },
            updated_at: now_ms(),
        };
        self.store.put_replica(&r).await?;
        if got.bytes > 0 || fresh {
            self.event(
                id,
                "replicate",
                "ok",
                &format!(
                    "node={node_id} snapshot={newest}: {} of its snapshots there, {} bytes sent{}",
                    r.snapshots.len(),
                    got.bytes,
                    if fresh { " (a new replica)" } else { "" }
                ),
            );
        }
        Ok(())
    }

    /// Drops a replica that moves to another node, where its node still answers (a lost
    /// node's copy is left to it; see decision 0037).
    async fn drop_old_replica(&self, old: &ReplicaRow) {
        let Some(api) = self
            .cluster_nodes
            .as_ref()
            .and_then(|n| n.reachable_member(&old.node_id))
        else {
            return;
        };
        if let Err(e) = api.drop_replica(&old.sandbox_id, &[]).await {
            tracing::warn!(sandbox = %old.sandbox_id, node = %old.node_id, error = %e, "could not drop a replica that moved");
        }
    }

    /// `Restore`: the sandbox's node is lost. Restored on its replica's node from the newest
    /// snapshot there when it has one; else marked lost.
    pub(crate) async fn ensure_restored(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let (Some(row), Some(nodes)) = (row, self.cluster_nodes.as_ref()) else {
            return Ok(());
        };
        if !live(&row) {
            return Ok(());
        }
        let id = row.id.as_str();
        let Some(home) = self.store.node_of_sandbox(id).await? else {
            return Ok(());
        };
        let replica = self.store.get_replica(id).await?;
        let restoring = replica.as_ref().is_some_and(|r| r.node_id == home);
        if !restoring && !nodes.is_lost(&home) {
            return Ok(());
        }
        let usable = replica.filter(|r| nodes.reachable_member(&r.node_id).is_some());
        let Some(r) = usable else {
            let why = format!(
                "node {home} was lost and the sandbox had no replica to restore from: nothing \
                 was recreated (it comes back if its node does)"
            );
            self.event(id, "restore", "lost", &why);
            return self.write_status(id, SandboxState::Lost, Some(&why)).await;
        };
        let spec = node_spec(id, &row.spec);
        let (target, dst) = nodes.candidate(&r.node_id, &spec.template).await?;
        if !restoring {
            // The claim moves first: from here on the sandbox belongs to the replica's node,
            // and a restore cut short is finished by the next pass.
            if !nodes.move_claim(id, &target, &Need::of(&spec)).await? {
                return Err(ControlError::from(NodeError::Exhausted(format!(
                    "node {} has no room to restore sandbox {id} on now",
                    r.node_id
                ))));
            }
            self.event(
                id,
                "restore",
                "started",
                &format!("node {home} was lost; restoring on node {}", r.node_id),
            );
        }
        let snap = self.store.get_snapshot(&r.snapshot_id).await?;
        dst.restore_replica(&spec, &r.snapshot_id).await?;
        let gone = self
            .store
            .keep_only_snapshots(id, &r.snapshots, &r.snapshot_id)
            .await?;
        self.store.delete_replica(id).await?;
        let was = row.state;
        // Started again: with the snapshot's memory where it is a microvm's checkpoint.
        let started = if was == SandboxState::Stopped {
            Ok(false)
        } else {
            async {
                let status = dst.create_sandbox(&spec).await?;
                if was == SandboxState::Paused {
                    dst.pause_sandbox(id).await?;
                }
                Ok::<_, NodeError>(status.restored)
            }
            .await
        };
        let taken = snap.map_or_else(String::new, |s| {
            format!(
                ", taken {}{}",
                rfc3339_from_unix_ms(s.created_at),
                s.label.map(|l| format!(" ({l})")).unwrap_or_default()
            )
        });
        let detail = format!(
            "node {home} was lost; restored on node {} from snapshot {}{taken}, replicated {}: \
             what changed after it is lost{}{}",
            r.node_id,
            r.snapshot_id,
            rfc3339_from_unix_ms(r.updated_at),
            if gone.is_empty() {
                String::new()
            } else {
                format!(", with {} later snapshot(s) never replicated", gone.len())
            },
            match started {
                _ if was == SandboxState::Stopped => "",
                Ok(true) => "; its processes and memory came back as they were at the snapshot",
                _ => "; its processes started again",
            }
        );
        match started {
            Ok(restored) => {
                self.event(id, "restore", "ok", &detail);
                self.restart_checkpoint_processes(id, &r.snapshot_id, restored)
                    .await;
                self.write_status(id, was, None).await
            }
            Err(e) => {
                // Restored, stopped: `resume` starts it.
                let e = ControlError::from(e);
                self.event(
                    id,
                    "restore",
                    "failed",
                    &format!("{detail}; but it did not start there: {e}"),
                );
                self.write_status(id, SandboxState::Stopped, Some(&e.to_string()))
                    .await
            }
        }
    }

    /// `RemoveStray`: node `node` holds sandbox `id`, which the store places elsewhere.
    pub(crate) async fn ensure_stray_removed(&self, id: &str, node: &str) -> ControlResult<()> {
        let Some(nodes) = &self.cluster_nodes else {
            return Ok(());
        };
        match self.store.node_of_sandbox(id).await? {
            Some(placed) if placed != node => {}
            _ => return Ok(()),
        }
        let Some(api) = nodes.reachable_member(node) else {
            return Ok(());
        };
        if api.sandbox_status(id).await?.is_none() {
            return Ok(());
        }
        api.remove_sandbox(id).await?;
        self.event(
            id,
            "stray",
            "removed",
            &format!("a stale copy on node {node}, which the sandbox is no longer on"),
        );
        Ok(())
    }

    /// `Found`: a lost sandbox whose node came back with it.
    pub(crate) async fn ensure_found(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| r.state == SandboxState::Lost) else {
            return Ok(());
        };
        let Some(status) = self.node.sandbox_status(&row.id).await? else {
            return Ok(());
        };
        let state = match status.phase {
            Phase::Running => SandboxState::Running,
            Phase::Paused => SandboxState::Paused,
            Phase::Stopped => SandboxState::Stopped,
        };
        self.event(&row.id, "restore", "found", "its node came back with it");
        self.write_status(&row.id, state, None).await
    }

    /// On delete: the replica goes too, where its node answers.
    pub(crate) async fn forget_replica(&self, id: &str) -> ControlResult<()> {
        if let Some(r) = self.store.get_replica(id).await? {
            self.drop_old_replica(&r).await;
            self.store.delete_replica(id).await?;
        }
        Ok(())
    }

    /// The replica of a sandbox, for its DTO.
    pub(crate) async fn replica_of(&self, id: &str) -> ControlResult<Option<ReplicaStatus>> {
        Ok(self.store.get_replica(id).await?.map(|r| r.dto()))
    }
}
