//! Snapshots, rollback and fork: the store's snapshot tree, the engine's actions and their
//! HTTP handlers (registered in `http::ROUTES`).
//!
//! The tree: a snapshot's parent is its sandbox's *head*, the snapshot the sandbox's current
//! state descends from (its newest snapshot, the one it was rolled back to, or for a fork
//! the one it was forked from). Deleting a snapshot re-links its children (and heads) to
//! its parent, so the tree never points at a deleted node.

use std::collections::HashMap;

use rand::Rng;
use space_api::{
    CreateSnapshot, ForkRequest, MAX_FORK_COUNT, RollbackRequest, Sandbox, SandboxState, Snapshot,
    SnapshotKind, Template, TemplateFromSnapshot, is_valid_sandbox_id, rfc3339_from_unix_ms,
};
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::checkpoints::Checkpoint;
use crate::convert::sandbox_dto;
use crate::engine::{Action, Engine, check_lifecycle, node_spec};
use crate::error::{ControlError, ControlResult};
use crate::store::{SandboxRow, Store, StoreError, now_ms};

/// Longest label accepted.
pub const MAX_LABEL_LEN: usize = 256;

/// A row of the `snapshots` table.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: String,
    pub sandbox_id: String,
    pub parent_id: Option<String>,
    pub label: Option<String>,
    pub kind: SnapshotKind,
    /// The sandbox's spec (JSON) when the snapshot was taken.
    pub spec: Option<String>,
    pub size_bytes: Option<i64>,
    pub created_at: i64,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &AnyRow) -> Result<SnapshotRow, StoreError> {
    let id: String = r.try_get("id").map_err(q("decode snapshot"))?;
    let kind: String = r.try_get("kind").map_err(q("decode snapshot"))?;
    let kind = SnapshotKind::parse(&kind).ok_or_else(|| StoreError::Corrupt {
        id: id.clone(),
        reason: format!("bad snapshot kind {kind:?}"),
    })?;
    Ok(SnapshotRow {
        sandbox_id: r.try_get("sandbox_id").map_err(q("decode snapshot"))?,
        parent_id: r.try_get("parent_id").map_err(q("decode snapshot"))?,
        label: r.try_get("label").map_err(q("decode snapshot"))?,
        kind,
        spec: r.try_get("spec").map_err(q("decode snapshot"))?,
        size_bytes: r.try_get("size_bytes").map_err(q("decode snapshot"))?,
        created_at: r.try_get("created_at").map_err(q("decode snapshot"))?,
        id,
    })
}

const COLUMNS: &str = "id, sandbox_id, parent_id, label, kind, spec, size_bytes, created_at";

impl Store {
    pub async fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO snapshots (id, sandbox_id, parent_id, label, kind, spec, size_bytes, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&s.id)
        .bind(&s.sandbox_id)
        .bind(s.parent_id.clone())
        .bind(s.label.clone())
        .bind(s.kind.as_str())
        .bind(s.spec.clone())
        .bind(s.size_bytes)
        .bind(s.created_at)
        .execute(self.pool())
        .await
        .map_err(q("insert snapshot"))?;
        Ok(())
    }

    pub async fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM snapshots WHERE id = $1"))
            .bind(id)
            .fetch_optional(self.pool())
            .await
            .map_err(q("get snapshot"))?;
        row.map(|r| decode(&r)).transpose()
    }

    /// A sandbox's snapshots, oldest first.
    pub async fn list_snapshots(&self, sandbox_id: &str) -> Result<Vec<SnapshotRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE sandbox_id = $1 ORDER BY created_at, id"
        ))
        .bind(sandbox_id)
        .fetch_all(self.pool())
        .await
        .map_err(q("list snapshots"))?;
        rows.iter().map(decode).collect()
    }

    /// The live sandboxes forked from `sandbox_id`'s snapshots, with the snapshot each came
    /// from: a fork's head is its source's snapshot until it takes one of its own, whose
    /// parent is then that snapshot.
    pub async fn forks_of(&self, sandbox_id: &str) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query(
            "SELECT DISTINCT f.sandbox_id AS fork, f.snapshot_id AS snap FROM ( \
                 SELECT sandbox_id, snapshot_id FROM snapshot_heads \
                 UNION SELECT sandbox_id, parent_id AS snapshot_id FROM snapshots \
                     WHERE parent_id IS NOT NULL \
             ) f \
             JOIN snapshots s ON s.id = f.snapshot_id AND s.sandbox_id = $1 \
             JOIN sandboxes x ON x.id = f.sandbox_id AND x.deleted_at IS NULL \
             WHERE f.sandbox_id <> $1 ORDER BY fork",
        )
        .bind(sandbox_id)
        .fetch_all(self.pool())
        .await
        .map_err(q("list forks"))?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("fork").map_err(q("list forks"))?,
                    r.try_get("snap").map_err(q("list forks"))?,
                ))
            })
            .collect()
    }

    /// The snapshot the sandbox's current state descends from.
    pub async fn snapshot_head(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT snapshot_id FROM snapshot_heads WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .fetch_optional(self.pool())
            .await
            .map_err(q("get snapshot head"))?;
        row.map(|r| r.try_get("snapshot_id").map_err(q("get snapshot head")))
            .transpose()
    }

    pub async fn set_snapshot_head(&self, sandbox_id: &str, snap: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO snapshot_heads (sandbox_id, snapshot_id) VALUES ($1, $2) \
             ON CONFLICT (sandbox_id) DO UPDATE SET snapshot_id = excluded.snapshot_id",
        )
        .bind(sandbox_id)
        .bind(snap)
        .execute(self.pool())
        .await
        .map_err(q("set snapshot head"))?;
        Ok(())
    }

    /// Forgets a snapshot, re-linking its children and heads to its parent. Idempotent.
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), StoreError> {
        let Some(row) = self.get_snapshot(id).await? else {
            return Ok(());
        };
        let mut tx = self.pool().begin().await.map_err(q("delete snapshot"))?;
        sqlx::query("UPDATE snapshots SET parent_id = $1 WHERE parent_id = $2")
            .bind(row.parent_id.clone())
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(q("re-link snapshot children"))?;
        match &row.parent_id {
            Some(p) => {
                sqlx::query("UPDATE snapshot_heads SET snapshot_id = $1 WHERE snapshot_id = $2")
                    .bind(p)
                    .bind(id)
                    .execute(&mut *tx)
                    .await
            }
            None => {
                sqlx::query("DELETE FROM snapshot_heads WHERE snapshot_id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
            }
        }
        .map_err(q("re-link snapshot heads"))?;
        sqlx::query("DELETE FROM snapshots WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(q("delete snapshot"))?;
        sqlx::query("DELETE FROM checkpoints WHERE snapshot_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(q("delete checkpoint"))?;
        tx.commit().await.map_err(q("delete snapshot"))?;
        Ok(())
    }

    /// Forgets every snapshot of a sandbox (newest first, so children of the set end up
    /// linked to the nearest ancestor outside it) and its head.
    pub async fn forget_snapshots_of(&self, sandbox_id: &str) -> Result<(), StoreError> {
        let mut rows = self.list_snapshots(sandbox_id).await?;
        rows.reverse();
        for r in rows {
            self.delete_snapshot(&r.id).await?;
        }
        sqlx::query("DELETE FROM snapshot_heads WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .execute(self.pool())
            .await
            .map_err(q("delete snapshot head"))?;
        Ok(())
    }
}

fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..space_api::SANDBOX_ID_LEN)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn check_ids(id: &str, snap: Option<&str>) -> ControlResult<()> {
    if !is_valid_sandbox_id(id) {
        return Err(ControlError::invalid(format!(
            "invalid sandbox id {id:?}: expected 20 characters of [a-z0-9]"
        )));
    }
    if let Some(s) = snap
        && !is_valid_sandbox_id(s)
    {
        return Err(ControlError::invalid(format!(
            "invalid snapshot id {s:?}: expected 20 characters of [a-z0-9]"
        )));
    }
    Ok(())
}

pub fn validate_label(label: &str) -> ControlResult<()> {
    if label.is_empty() || label.len() > MAX_LABEL_LEN || label.chars().any(char::is_control) {
        return Err(ControlError::invalid(format!(
            "label must be 1..={MAX_LABEL_LEN} bytes without control characters"
        )));
    }
    Ok(())
}

pub fn validate_fork_count(count: Option<u32>) -> ControlResult<u32> {
    match count.unwrap_or(1) {
        n @ 1..=MAX_FORK_COUNT => Ok(n),
        n => Err(ControlError::invalid(format!(
            "count must be 1..={MAX_FORK_COUNT}, got {n}"
        ))),
    }
}

pub fn snapshot_dto(r: &SnapshotRow, size: Option<u64>) -> Snapshot {
    Snapshot {
        id: r.id.clone(),
        sandbox_id: r.sandbox_id.clone(),
        parent_id: r.parent_id.clone(),
        label: r.label.clone(),
        created_at: rfc3339_from_unix_ms(r.created_at),
        size_bytes: size.or(r.size_bytes.map(|n| n as u64)),
        kind: r.kind,
        // Set by `snapshot_policy::mark_auto`.
        auto: false,
        // Set by `checkpoints::decorate`.
        processes: None,
        memory: false,
    }
}

impl Engine {
    async fn load_row(&self, id: &str) -> ControlResult<SandboxRow> {
        self.store
            .get_sandbox(id)
            .await?
            .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))
    }

    /// The snapshot `snap` of sandbox `id`: 404 when it does not exist (any more), 400 when
    /// it belongs to another sandbox.
    async fn own_snapshot(&self, id: &str, snap: &str) -> ControlResult<SnapshotRow> {
        match self.store.get_snapshot(snap).await? {
            None => Err(ControlError::not_found(format!(
                "snapshot {snap} not found"
            ))),
            Some(s) if s.sandbox_id != id => Err(ControlError::invalid(format!(
                "snapshot {snap} belongs to sandbox {}, not to {id}",
                s.sandbox_id
            ))),
            Some(s) => Ok(s),
        }
    }

    /// Takes a snapshot; the caller holds the sandbox's lock and checked its lifecycle.
    pub(crate) async fn snapshot_locked(
        &self,
        row: &SandboxRow,
        label: Option<String>,
    ) -> ControlResult<SnapshotRow> {
        self.snapshot_locked_as(row, label, None)
            .await
            .map(|(s, _)| s)
    }

    /// Takes a snapshot, a checkpoint when `checkpoint` is given (recorded with it, `memory`
    /// as the node kept it); returns the checkpoint as recorded.
    pub(crate) async fn snapshot_locked_as(
        &self,
        row: &SandboxRow,
        label: Option<String>,
        checkpoint: Option<&Checkpoint>,
    ) -> ControlResult<(SnapshotRow, Option<Checkpoint>)> {
        let start = std::time::Instant::now();
        let id = &row.id;
        let snap = new_id();
        let parent = self.store.snapshot_head(id).await?;
        // A checkpoint keeps the memory where the runtime can (a microvm), so its processes
        // come back as they were instead of being started again.
        let info = if checkpoint.is_some() {
            self.node.checkpoint_sandbox(id, &snap).await?
        } else {
            self.node.snapshot_sandbox(id, &snap).await?
        };
        let checkpoint = checkpoint.map(|c| Checkpoint {
            memory: info.memory,
            ..c.clone()
        });
        let checkpoint = checkpoint.as_ref();
        let srow = SnapshotRow {
            id: snap.clone(),
            sandbox_id: id.clone(),
            parent_id: parent,
            label,
            kind: if checkpoint.is_some() {
                SnapshotKind::Checkpoint
            } else {
                SnapshotKind::Disk
            },
            spec: serde_json::to_string(&row.spec).ok(),
            size_bytes: None,
            created_at: info.created_unix_ms as i64,
        };
        let stored = async {
            self.store.insert_snapshot(&srow).await?;
            if let Some(c) = checkpoint {
                self.store.insert_checkpoint(&snap, c).await?;
            }
            self.store.set_snapshot_head(id, &snap).await
        }
        .await;
        if let Err(e) = stored {
            if let Err(d) = self.node.delete_snapshot(id, &snap).await {
                tracing::warn!(sandbox = %id, snapshot = %snap, error = %d, "cleanup of an unrecorded snapshot");
            }
            return Err(e.into());
        }
        self.metrics.snapshot_seconds.since(start);
        Ok((srow, checkpoint.cloned()))
    }

    pub async fn create_snapshot(&self, id: &str, req: CreateSnapshot) -> ControlResult<Snapshot> {
        check_ids(id, None)?;
        if let Some(l) = &req.label {
            validate_label(l)?;
        }
        let _guard = self.locks.lock(id).await;
        let row = self.load_row(id).await?;
        check_lifecycle(&row, Action::Snapshot)?;
        self.check_snapshot_quota(&row.tenant).await?;
        let checkpoint = match req.kind.unwrap_or(SnapshotKind::Disk) {
            SnapshotKind::Disk => None,
            SnapshotKind::Checkpoint => {
                if row.state != SandboxState::Running {
                    return Err(ControlError::conflict(format!(
                        "sandbox {id} is {}: a checkpoint needs it running (its process list \
                         comes from the guest)",
                        row.state
                    )));
                }
                Some(self.checkpoint_state(id).await?)
            }
        };
        let (s, checkpoint) = self
            .snapshot_locked_as(&row, req.label, checkpoint.as_ref())
            .await?;
        let mut dto = snapshot_dto(&s, None);
        if let Some(c) = &checkpoint {
            crate::checkpoints::decorate(&mut dto, c);
        }
        Ok(dto)
    }

    /// The snapshot sandbox `id`'s files descend from now (see [`SnapshotList::head`]).
    ///
    /// [`SnapshotList::head`]: space_api::SnapshotList::head
    pub async fn snapshot_head(&self, id: &str) -> ControlResult<Option<String>> {
        check_ids(id, None)?;
        Ok(self.store.snapshot_head(id).await?)
    }

    /// The live sandboxes forked from sandbox `id`'s snapshots (see [`SnapshotList::forks`]).
    ///
    /// [`SnapshotList::forks`]: space_api::SnapshotList::forks
    pub async fn snapshot_forks(&self, id: &str) -> ControlResult<Vec<space_api::ForkOf>> {
        check_ids(id, None)?;
        Ok(self
            .store
            .forks_of(id)
            .await?
            .into_iter()
            .map(|(sandbox, snapshot)| space_api::ForkOf { sandbox, snapshot })
            .collect())
    }

    pub async fn list_snapshots(&self, id: &str) -> ControlResult<Vec<Snapshot>> {
        check_ids(id, None)?;
        self.load_row(id).await?;
        let rows = self.store.list_snapshots(id).await?;
        let sizes: HashMap<String, Option<u64>> = match self.node.list_snapshots(id, true).await {
            Ok(list) => list.into_iter().map(|s| (s.id, s.size_bytes)).collect(),
            Err(e) => {
                tracing::warn!(sandbox = id, error = %e, "node snapshot list");
                HashMap::new()
            }
        };
        let mut out: Vec<Snapshot> = rows
            .iter()
            .map(|r| snapshot_dto(r, sizes.get(&r.id).copied().flatten()))
            .collect();
        self.mark_auto(id, &mut out).await?;
        let checkpoints = self.store.checkpoints_of(id).await?;
        for s in &mut out {
            if let Some(c) = checkpoints.get(&s.id) {
                crate::checkpoints::decorate(s, c);
            }
        }
        Ok(out)
    }

    pub async fn delete_snapshot(&self, id: &str, snap: &str) -> ControlResult<()> {
        check_ids(id, Some(snap))?;
        let _guard = self.locks.lock(id).await;
        self.load_row(id).await?;
        match self.store.get_snapshot(snap).await? {
            Some(s) if s.sandbox_id == id => {}
            _ => {
                return Err(ControlError::not_found(format!(
                    "snapshot {snap} of sandbox {id} not found"
                )));
            }
        }
        self.node.delete_snapshot(id, snap).await?;
        self.store.delete_snapshot(snap).await?;
        Ok(())
    }

    /// A new version of template `name` whose rootfs is the snapshot, taken over by the node
    /// with no copy (a namespace sandbox's snapshot; a microvm's is a disk image: 400).
    pub async fn template_from_snapshot(
        &self,
        name: &str,
        req: TemplateFromSnapshot,
    ) -> ControlResult<Template> {
        crate::templates::check_template_name(name)?;
        check_ids(&req.sandbox, Some(&req.snapshot))?;
        let _guard = self.locks.lock(&req.sandbox).await;
        self.load_row(&req.sandbox).await?;
        let snap = self.own_snapshot(&req.sandbox, &req.snapshot).await?;
        let info = self
            .node
            .import_template(
                name,
                space_node_api::TemplateSource::Snapshot {
                    sandbox: req.sandbox.clone(),
                    snapshot: snap.id,
                    defaults: None,
                },
            )
            .await?;
        self.template_out(&info).await
    }

    pub async fn rollback(&self, id: &str, req: RollbackRequest) -> ControlResult<Sandbox> {
        check_ids(id, Some(&req.snapshot))?;
        let _guard = self.locks.lock(id).await;
        let row = self.load_row(id).await?;
        check_lifecycle(&row, Action::Rollback)?;
        let snap = self.own_snapshot(id, &req.snapshot).await?;
        let status = match self
            .node
            .rollback_sandbox(&node_spec(id, &row.spec), &snap.id)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                // The node may have stopped it already: let the reconciler look.
                self.wake_reconciler();
                return Err(e.into());
            }
        };
        self.write_status(id, SandboxState::Running, None).await?;
        self.store.set_snapshot_head(id, &snap.id).await?;
        self.restart_checkpoint_processes(id, &snap.id, status.restored)
            .await;
        let row = SandboxRow {
            state: SandboxState::Running,
            error: None,
            ..row
        };
        Ok(sandbox_dto(&row, Some(&status)))
    }

    pub async fn fork(&self, id: &str, req: ForkRequest) -> ControlResult<Vec<Sandbox>> {
        check_ids(id, req.snapshot.as_deref())?;
        let count = validate_fork_count(req.count)?;
        let _guard = self.locks.lock(id).await;
        let row = self.load_row(id).await?;
        check_lifecycle(&row, Action::Fork)?;
        let snap = match &req.snapshot {
            Some(s) => self.own_snapshot(id, s).await?,
            // A running microvm forks as it is, processes and memory: a checkpoint.
            None if row.spec.runtime.as_deref() == Some(crate::engine::MICROVM)
                && row.state == SandboxState::Running =>
            {
                let c = self.checkpoint_state(id).await?;
                self.snapshot_locked_as(&row, Some("fork".into()), Some(&c))
                    .await?
                    .0
            }
            None => self.snapshot_locked(&row, Some("fork".into())).await?,
        };
        let mut out = Vec::with_capacity(count as usize);
        for _ in 0..count {
            out.push(self.fork_one(&row, &snap.id).await?);
        }
        Ok(out)
    }

    async fn fork_one(&self, source: &SandboxRow, snap: &str) -> ControlResult<Sandbox> {
        let id = new_id();
        let mut spec = source.spec.clone();
        spec.hostname = id.clone();
        let now = now_ms();
        let row = SandboxRow {
            id: id.clone(),
            // A fork belongs to its source's tenant.
            tenant: source.tenant.clone(),
            spec,
            state: SandboxState::Creating,
            error: None,
            generation: 1,
            deleted_at: None,
            created_at: now,
            updated_at: now,
        };
        let _guard = self.locks.lock(&id).await;
        self.insert_sandbox_row(&row).await?;
        self.owners.note(&id, &row.tenant);
        match self
            .node
            .fork_sandbox(&source.id, snap, &node_spec(&id, &row.spec))
            .await
        {
            Ok(status) => {
                self.write_status(&id, SandboxState::Running, None).await?;
                self.store.set_snapshot_head(&id, snap).await?;
                self.restart_checkpoint_processes(&id, snap, status.restored)
                    .await;
                let row = SandboxRow {
                    state: SandboxState::Running,
                    ..row
                };
                Ok(sandbox_dto(&row, Some(&status)))
            }
            Err(e) => {
                let err = ControlError::from(e);
                let _ = self.node.remove_sandbox(&id).await;
                self.store.delete_sandbox(&id).await?;
                self.locks.forget(&id);
                Err(err)
            }
        }
    }
}

// ---- HTTP handlers ----

/// An optional JSON object body: empty means the default.
pub(crate) fn optional_body<T: serde::de::DeserializeOwned + Default>(
    bytes: &[u8],
) -> ControlResult<T> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        None => Ok(T::default()),
        Some(b'{') => serde_json::from_slice(bytes)
            .map_err(|e| ControlError::invalid(format!("invalid JSON body: {e}"))),
        Some(_) => Err(ControlError::invalid(
            "the request body must be a JSON object",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_counts() {
        assert!(validate_label("before refactor").is_ok());
        assert!(validate_label("").is_err());
        assert!(validate_label("a\nb").is_err());
        assert!(validate_label(&"x".repeat(MAX_LABEL_LEN + 1)).is_err());
        assert_eq!(validate_fork_count(None).unwrap(), 1);
        assert_eq!(validate_fork_count(Some(16)).unwrap(), 16);
        assert!(validate_fork_count(Some(0)).is_err());
        assert!(validate_fork_count(Some(17)).is_err());
        assert!(optional_body::<ForkRequest>(b"").unwrap() == ForkRequest::default());
        assert!(optional_body::<ForkRequest>(b"[1]").is_err());
        assert!(optional_body::<ForkRequest>(b"{\"bogus\":1}").is_err());
    }

    fn snap(id: &str, sandbox: &str, parent: Option<&str>, at: i64) -> SnapshotRow {
        SnapshotRow {
            id: id.into(),
            sandbox_id: sandbox.into(),
            parent_id: parent.map(str::to_string),
            label: None,
            kind: SnapshotKind::Disk,
            spec: None,
            size_bytes: None,
            created_at: at,
        }
    }

    #[tokio::test]
    async fn deleting_relinks_children_and_heads() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        store
            .insert_snapshot(&snap("a", "s1", None, 1))
            .await
            .unwrap();
        store
            .insert_snapshot(&snap("b", "s1", Some("a"), 2))
            .await
            .unwrap();
        store
            .insert_snapshot(&snap("c", "s2", Some("b"), 3))
            .await
            .unwrap();
        store.set_snapshot_head("s1", "b").await.unwrap();
        store.set_snapshot_head("s1", "b").await.unwrap(); // upsert
        store.delete_snapshot("b").await.unwrap();
        let c = store.get_snapshot("c").await.unwrap().unwrap();
        assert_eq!(c.parent_id.as_deref(), Some("a"));
        assert_eq!(
            store.snapshot_head("s1").await.unwrap().as_deref(),
            Some("a")
        );
        store.forget_snapshots_of("s1").await.unwrap();
        let c = store.get_snapshot("c").await.unwrap().unwrap();
        assert_eq!(c.parent_id, None);
        assert_eq!(store.snapshot_head("s1").await.unwrap(), None);
        assert!(store.list_snapshots("s1").await.unwrap().is_empty());
        store.delete_snapshot("nope").await.unwrap();
    }
}
