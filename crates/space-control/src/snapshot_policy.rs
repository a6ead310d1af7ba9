//! Snapshot policy per sandbox (decision 0010): automatic snapshots every N seconds while
//! the sandbox's files change, optionally after every foreground exec, and retention (keep
//! the newest K automatic snapshots; labelled ones stay unless asked otherwise; the head
//! always stays).
//!
//! - Automatic snapshots carry no label (labels are the user's); they are marked in table
//!   `auto_snapshots` and shown with `auto: true`.
//! - "Changed" is asked of the node ([`space_node_api::NodeApi::changed_since_snapshot`]:
//!   one btrfs tree search for items newer than the head snapshot's transaction).
//! - The pure [`policy_steps`] says which sandboxes are due (injected clock); the reconciler
//!   applies `Step::AutoSnapshot` through [`Engine::ensure_auto_snapshot`] under the lock.
//!   The pure [`retention`] picks what to delete; it runs after every automatic snapshot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::Stream;
use futures::stream::BoxStream;
use space_api::{MAX_EVERY_SECS, MAX_KEEP_LAST, Sandbox, SandboxState, Snapshot, SnapshotPolicy};
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};
use crate::reconcile::Step;
use crate::snapshots::SnapshotRow;
use crate::store::{SandboxRow, Store, StoreError, now_ms};

/// Why an automatic snapshot was taken (column `auto_snapshots.reason`).
pub const REASON_EVERY: &str = "every";
pub const REASON_EXEC: &str = "exec";

/// A sandbox's policy (table `snapshot_policies`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRow {
    pub sandbox_id: String,
    pub policy: SnapshotPolicy,
    /// When the periodic check last ran (or the policy was set), unix ms.
    pub checked_at: i64,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &AnyRow) -> Result<PolicyRow, StoreError> {
    let every: Option<i64> = r.try_get("every_secs").map_err(q("decode policy"))?;
    let keep: Option<i64> = r.try_get("keep_last").map_err(q("decode policy"))?;
    let after: i64 = r.try_get("after_exec").map_err(q("decode policy"))?;
    let labelled: i64 = r.try_get("keep_labelled").map_err(q("decode policy"))?;
    Ok(PolicyRow {
        sandbox_id: r.try_get("sandbox_id").map_err(q("decode policy"))?,
        policy: SnapshotPolicy {
            every_secs: every.map(|v| v.max(0) as u64),
            after_exec: after != 0,
            keep_last: keep.map(|v| v.clamp(0, u32::MAX as i64) as u32),
            keep_labelled: labelled != 0,
        },
        checked_at: r.try_get("checked_at").map_err(q("decode policy"))?,
    })
}

const COLUMNS: &str = "sandbox_id, every_secs, after_exec, keep_last, keep_labelled, checked_at";

impl Store {
    pub async fn get_snapshot_policy(&self, id: &str) -> Result<Option<PolicyRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshot_policies WHERE sandbox_id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get snapshot policy"))?;
        row.map(|r| decode(&r)).transpose()
    }

    pub async fn list_snapshot_policies(&self) -> Result<HashMap<String, PolicyRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM snapshot_policies"))
            .fetch_all(self.pool())
            .await
            .map_err(q("list snapshot policies"))?;
        rows.iter()
            .map(|r| decode(r).map(|p| (p.sandbox_id.clone(), p)))
            .collect()
    }

    pub async fn put_snapshot_policy(&self, p: &PolicyRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO snapshot_policies \
             (sandbox_id, every_secs, after_exec, keep_last, keep_labelled, checked_at) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (sandbox_id) DO UPDATE SET every_secs = excluded.every_secs, \
             after_exec = excluded.after_exec, keep_last = excluded.keep_last, \
             keep_labelled = excluded.keep_labelled, checked_at = excluded.checked_at",
        )
        .bind(&p.sandbox_id)
        .bind(p.policy.every_secs.map(|v| v as i64))
        .bind(p.policy.after_exec as i64)
        .bind(p.policy.keep_last.map(i64::from))
        .bind(p.policy.keep_labelled as i64)
        .bind(p.checked_at)
        .execute(self.pool())
        .await
        .map_err(q("put snapshot policy"))?;
        Ok(())
    }

    /// Forgets a sandbox's policy and its automatic-snapshot marks.
    pub async fn delete_snapshot_policy(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM snapshot_policies WHERE sandbox_id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("delete snapshot policy"))?;
        sqlx::query("DELETE FROM auto_snapshots WHERE sandbox_id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("delete auto snapshot marks"))?;
        Ok(())
    }

    pub async fn mark_auto_snapshot(
        &self,
        snap: &str,
        sandbox_id: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO auto_snapshots (snapshot_id, sandbox_id, reason) VALUES ($1, $2, $3) \
             ON CONFLICT (snapshot_id) DO NOTHING",
        )
        .bind(snap)
        .bind(sandbox_id)
        .bind(reason)
        .execute(self.pool())
        .await
        .map_err(q("mark auto snapshot"))?;
        Ok(())
    }

    pub async fn unmark_auto_snapshot(&self, snap: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM auto_snapshots WHERE snapshot_id = $1")
            .bind(snap)
            .execute(self.pool())
            .await
            .map_err(q("unmark auto snapshot"))?;
        Ok(())
    }

    /// The ids of a sandbox's automatic snapshots.
    pub async fn auto_snapshot_ids(&self, sandbox_id: &str) -> Result<HashSet<String>, StoreError> {
        let rows = sqlx::query("SELECT snapshot_id FROM auto_snapshots WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .fetch_all(self.pool())
            .await
            .map_err(q("list auto snapshots"))?;
        rows.iter()
            .map(|r| r.try_get("snapshot_id").map_err(q("list auto snapshots")))
            .collect()
    }
}

// ---------------------------------------------------------------- pure parts

/// Checks a policy's numbers.
pub fn validate(p: &SnapshotPolicy) -> ControlResult<()> {
    if let Some(v) = p.every_secs
        && !(1..=MAX_EVERY_SECS).contains(&v)
    {
        return Err(ControlError::invalid(format!(
            "every_secs must be between 1 and {MAX_EVERY_SECS}, got {v}"
        )));
    }
    if let Some(k) = p.keep_last
        && !(1..=MAX_KEEP_LAST).contains(&k)
    {
        return Err(ControlError::invalid(format!(
            "keep_last must be between 1 and {MAX_KEEP_LAST}, got {k}"
        )));
    }
    Ok(())
}

/// The policy row a create request asks for (`None` when it sets none).
pub fn policy_from_create(
    req: &space_api::CreateSandbox,
    id: &str,
    now: i64,
) -> ControlResult<Option<PolicyRow>> {
    let Some(p) = &req.snapshot_policy else {
        return Ok(None);
    };
    validate(p)?;
    Ok((!p.is_empty()).then(|| PolicyRow {
        sandbox_id: id.to_string(),
        policy: p.clone(),
        checked_at: now,
    }))
}

/// Which sandboxes are due for their periodic check. Pure: only running sandboxes (paused,
/// stopped, creating, deleting ones are skipped) whose `every_secs` passed since the last
/// check.
pub fn policy_steps(
    desired: &[SandboxRow],
    policies: &HashMap<String, PolicyRow>,
    now_ms: i64,
) -> Vec<Step> {
    desired
        .iter()
        .filter(|row| row.state == SandboxState::Running && row.deleted_at.is_none())
        .filter(|row| {
            policies.get(&row.id).is_some_and(|p| {
                p.policy.every_secs.is_some_and(|s| {
                    now_ms.saturating_sub(p.checked_at) >= (s as i64).saturating_mul(1000)
                })
            })
        })
        .map(|row| Step::AutoSnapshot { id: row.id.clone() })
        .collect()
}

/// The snapshots retention deletes, given a sandbox's snapshots (any order), which of them
/// are automatic, its head and its policy. Candidates: automatic snapshots, plus labelled
/// ones when `keep_labelled` is false; the newest `keep_last` candidates stay, and the head
/// never goes. Unlabelled snapshots taken through the API are never candidates.
pub fn retention(
    snapshots: &[SnapshotRow],
    auto: &HashSet<String>,
    head: Option<&str>,
    policy: &SnapshotPolicy,
) -> Vec<String> {
    let Some(keep) = policy.keep_last else {
        return Vec::new();
    };
    let mut candidates: Vec<&SnapshotRow> = snapshots
        .iter()
        .filter(|s| auto.contains(&s.id) || (!policy.keep_labelled && s.label.is_some()))
        .collect();
    // Newest first.
    candidates.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
    candidates
        .into_iter()
        .skip(keep as usize)
        .filter(|s| Some(s.id.as_str()) != head)
        .map(|s| s.id.clone())
        .collect()
}

// ---------------------------------------------------------------- engine

impl Engine {
    /// Adds the snapshot policy to a sandbox DTO.
    pub(crate) async fn decorate_policy(&self, sb: &mut Sandbox) {
        match self.store.get_snapshot_policy(&sb.id).await {
            Ok(p) => sb.snapshot_policy = p.map(|p| p.policy),
            Err(e) => tracing::warn!(sandbox = %sb.id, error = %e, "snapshot policy lookup"),
        }
    }

    pub(crate) async fn decorate_policies(&self, list: &mut [Sandbox]) {
        match self.store.list_snapshot_policies().await {
            Ok(map) => list
                .iter_mut()
                .for_each(|sb| sb.snapshot_policy = map.get(&sb.id).map(|p| p.policy.clone())),
            Err(e) => tracing::warn!(error = %e, "snapshot policy lookup"),
        }
    }

    /// Sets `auto` on the automatic ones of a sandbox's snapshot DTOs.
    pub(crate) async fn mark_auto(&self, id: &str, list: &mut [Snapshot]) -> ControlResult<()> {
        let auto = self.store.auto_snapshot_ids(id).await?;
        list.iter_mut().for_each(|s| s.auto = auto.contains(&s.id));
        Ok(())
    }

    /// `PUT /v1/sandboxes/{id}/snapshot-policy`: replaces the policy (an empty one removes
    /// it). The periodic clock starts now.
    pub async fn set_snapshot_policy(
        &self,
        id: &str,
        policy: SnapshotPolicy,
    ) -> ControlResult<Sandbox> {
        if !space_api::is_valid_sandbox_id(id) {
            return Err(ControlError::invalid(format!("invalid sandbox id {id:?}")));
        }
        validate(&policy)?;
        {
            let _guard = self.locks.lock(id).await;
            let row = self
                .store
                .get_sandbox(id)
                .await?
                .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))?;
            if row.state == SandboxState::Deleting || row.deleted_at.is_some() {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is being deleted"
                )));
            }
            if policy.is_empty() {
                sqlx_delete_policy_only(&self.store, id).await?;
            } else {
                self.store
                    .put_snapshot_policy(&PolicyRow {
                        sandbox_id: id.to_string(),
                        policy: policy.clone(),
                        checked_at: now_ms(),
                    })
                    .await?;
            }
            tracing::info!(sandbox = id, ?policy, "snapshot policy set");
            if policy.keep_last.is_some() {
                self.apply_retention(id, &policy).await?;
            }
        }
        self.wake_reconciler();
        self.get_sandbox(id).await
    }

    /// Takes an automatic snapshot (caller holds the lock, the sandbox runs), marks it and
    /// applies retention.
    async fn auto_snapshot_locked(
        &self,
        row: &SandboxRow,
        policy: &SnapshotPolicy,
        reason: &str,
    ) -> ControlResult<()> {
        let snap = self.snapshot_locked(row, None).await?;
        self.store
            .mark_auto_snapshot(&snap.id, &row.id, reason)
            .await?;
        tracing::debug!(sandbox = %row.id, snapshot = %snap.id, reason, "automatic snapshot");
        self.apply_retention(&row.id, policy).await
    }

    /// Deletes what [`retention`] picks (caller holds the lock).
    async fn apply_retention(&self, id: &str, policy: &SnapshotPolicy) -> ControlResult<()> {
        if policy.keep_last.is_none() {
            return Ok(());
        }
        let snaps = self.store.list_snapshots(id).await?;
        let auto = self.store.auto_snapshot_ids(id).await?;
        let head = self.store.snapshot_head(id).await?;
        for snap in retention(&snaps, &auto, head.as_deref(), policy) {
            self.node.delete_snapshot(id, &snap).await?;
            self.store.delete_snapshot(&snap).await?;
            self.store.unmark_auto_snapshot(&snap).await?;
            tracing::debug!(sandbox = id, snapshot = %snap, "retention deleted a snapshot");
        }
        Ok(())
    }

    /// Whether the sandbox's files changed since its head snapshot (true without a head).
    async fn changed_since_head(&self, id: &str) -> ControlResult<bool> {
        let Some(head) = self.store.snapshot_head(id).await? else {
            return Ok(true);
        };
        let Some(snap) = self.store.get_snapshot(&head).await? else {
            return Ok(true);
        };
        Ok(self
            .node
            .changed_since_snapshot(id, &snap.sandbox_id, &head)
            .await?)
    }

    /// Reconcile step: the periodic check is due -> snapshot when changed, then restart the
    /// period.
    pub(crate) async fn ensure_auto_snapshot(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| r.state == SandboxState::Running && r.deleted_at.is_none())
        else {
            return Ok(());
        };
        let Some(mut p) = self.store.get_snapshot_policy(&row.id).await? else {
            return Ok(());
        };
        let now = now_ms();
        let due = policy_steps(
            std::slice::from_ref(&row),
            &HashMap::from([(row.id.clone(), p.clone())]),
            now,
        );
        if due.is_empty() {
            return Ok(());
        }
        // The period restarts whatever happens below, so a failing snapshot is retried on
        // the next period (and by the reconciler's backoff), not in a tight loop.
        p.checked_at = now;
        self.store.put_snapshot_policy(&p).await?;
        if self.changed_since_head(&row.id).await? {
            self.auto_snapshot_locked(&row, &p.policy, REASON_EVERY)
                .await?;
        }
        Ok(())
    }

    /// After a foreground exec ended: an automatic snapshot when the policy asks for one.
    /// Runs on its own task (never delays the exec's response); errors are logged.
    pub(crate) async fn snapshot_after_exec(&self, id: &str) {
        let res = async {
            let Some(p) = self.store.get_snapshot_policy(id).await? else {
                return Ok(());
            };
            if !p.policy.after_exec {
                return Ok(());
            }
            let _guard = self.locks.lock(id).await;
            let Some(row) = self.store.get_sandbox(id).await? else {
                return Ok(());
            };
            if row.state != SandboxState::Running || row.deleted_at.is_some() {
                return Ok(());
            }
            self.auto_snapshot_locked(&row, &p.policy, REASON_EXEC)
                .await
        }
        .await;
        if let Err(e) = res {
            tracing::warn!(sandbox = id, error = %e, "snapshot after exec");
        }
    }

    /// The policy steps of one reconcile pass; forgets policies of sandboxes that are gone.
    pub(crate) async fn snapshot_policy_pass(
        &self,
        desired: &[SandboxRow],
    ) -> ControlResult<Vec<Step>> {
        let policies = self.store.list_snapshot_policies().await?;
        let known: HashSet<&str> = desired.iter().map(|r| r.id.as_str()).collect();
        for id in policies.keys().filter(|id| !known.contains(id.as_str())) {
            self.store.delete_snapshot_policy(id).await?;
        }
        Ok(policy_steps(desired, &policies, now_ms()))
    }
}

async fn sqlx_delete_policy_only(store: &Store, id: &str) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM snapshot_policies WHERE sandbox_id = $1")
        .bind(id)
        .execute(store.pool())
        .await
        .map_err(q("delete snapshot policy"))?;
    Ok(())
}

/// Wraps a foreground exec's event stream: when it is dropped (the exec ended and its
/// response was sent, or the client left), an automatic snapshot is started on its own task
/// if the policy asks for one.
pub(crate) fn after_exec<T: Send + 'static>(
    engine: &Arc<Engine>,
    id: &str,
    inner: BoxStream<'static, T>,
) -> BoxStream<'static, T> {
    Box::pin(AfterExec {
        inner,
        engine: engine.clone(),
        id: id.to_string(),
    })
}

struct AfterExec<T> {
    inner: BoxStream<'static, T>,
    engine: Arc<Engine>,
    id: String,
}

impl<T> Stream for AfterExec<T> {
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl<T> Drop for AfterExec<T> {
    fn drop(&mut self) {
        let (engine, id) = (self.engine.clone(), std::mem::take(&mut self.id));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { engine.snapshot_after_exec(&id).await });
        }
    }
}

// ---------------------------------------------------------------- http

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::row;
    use space_api::SnapshotKind;

    const A: &str = "aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbb";

    fn pol(every: Option<u64>, keep: Option<u32>) -> SnapshotPolicy {
        SnapshotPolicy {
            every_secs: every,
            keep_last: keep,
            ..Default::default()
        }
    }

    fn prow(id: &str, p: SnapshotPolicy, checked_at: i64) -> PolicyRow {
        PolicyRow {
            sandbox_id: id.into(),
            policy: p,
            checked_at,
        }
    }

    fn map(rows: Vec<PolicyRow>) -> HashMap<String, PolicyRow> {
        rows.into_iter()
            .map(|p| (p.sandbox_id.clone(), p))
            .collect()
    }

    #[test]
    fn periodic_checks_are_due_after_their_period_on_running_sandboxes_only() {
        let desired = [
            row(A, SandboxState::Running, 0),
            row(B, SandboxState::Running, 0),
        ];
        let p = map(vec![
            prow(A, pol(Some(2), None), 1_000),
            prow(B, pol(None, Some(3)), 0),
        ]);
        assert!(policy_steps(&desired, &p, 2_999).is_empty());
        assert_eq!(
            policy_steps(&desired, &p, 3_000),
            vec![Step::AutoSnapshot { id: A.into() }]
        );
        for s in [
            SandboxState::Paused,
            SandboxState::Stopped,
            SandboxState::Creating,
            SandboxState::Deleting,
            SandboxState::Failed,
        ] {
            assert!(
                policy_steps(&[row(A, s, 0)], &p, 100_000).is_empty(),
                "{s:?}"
            );
        }
        let mut deleted = row(A, SandboxState::Running, 0);
        deleted.deleted_at = Some(1);
        assert!(policy_steps(&[deleted], &p, 100_000).is_empty());
        assert!(policy_steps(&desired, &HashMap::new(), i64::MAX).is_empty());
    }

    fn snap(id: &str, label: Option<&str>, at: i64) -> SnapshotRow {
        SnapshotRow {
            id: id.into(),
            sandbox_id: A.into(),
            parent_id: None,
            label: label.map(str::to_string),
            kind: SnapshotKind::Disk,
            spec: None,
            size_bytes: None,
            created_at: at,
        }
    }

    #[test]
    fn retention_keeps_the_newest_automatic_ones_labelled_ones_and_the_head() {
        let snaps = [
            snap("a1", None, 1),
            snap("u1", Some("mine"), 2),
            snap("a2", None, 3),
            snap("m1", None, 4), // taken through the API, unlabelled
            snap("a3", None, 5),
            snap("a4", None, 6),
        ];
        let auto: HashSet<String> = ["a1", "a2", "a3", "a4"].map(String::from).into();
        let mut out = retention(&snaps, &auto, Some("a4"), &pol(None, Some(2)));
        out.sort();
        assert_eq!(out, vec!["a1", "a2"]);
        // No keep_last: nothing goes.
        assert!(retention(&snaps, &auto, None, &pol(Some(1), None)).is_empty());
        // The head survives even when old (after a rollback to it).
        let mut out = retention(&snaps, &auto, Some("a1"), &pol(None, Some(1)));
        out.sort();
        assert_eq!(out, vec!["a2", "a3"]);
        // keep_labelled = false: labelled snapshots count too; unlabelled API ones never.
        let mut p = pol(None, Some(2));
        p.keep_labelled = false;
        let mut out = retention(&snaps, &auto, None, &p);
        out.sort();
        assert_eq!(out, vec!["a1", "a2", "u1"]);
    }

    #[test]
    fn validation() {
        assert!(validate(&pol(Some(1), Some(1))).is_ok());
        assert!(validate(&pol(Some(MAX_EVERY_SECS), Some(MAX_KEEP_LAST))).is_ok());
        for bad in [
            pol(Some(0), None),
            pol(Some(MAX_EVERY_SECS + 1), None),
            pol(None, Some(0)),
            pol(None, Some(MAX_KEEP_LAST + 1)),
        ] {
            assert_eq!(validate(&bad).unwrap_err().code(), "invalid_argument");
        }
        let req = space_api::CreateSandbox {
            snapshot_policy: Some(pol(Some(5), None)),
            ..Default::default()
        };
        let p = policy_from_create(&req, A, 7).unwrap().unwrap();
        assert_eq!((p.policy.every_secs, p.checked_at), (Some(5), 7));
        let empty = space_api::CreateSandbox {
            snapshot_policy: Some(SnapshotPolicy::default()),
            ..Default::default()
        };
        assert_eq!(policy_from_create(&empty, A, 7).unwrap(), None);
    }

    #[tokio::test]
    async fn policy_rows_and_marks_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        assert_eq!(store.get_snapshot_policy(A).await.unwrap(), None);
        let mut p = prow(A, pol(Some(3), Some(2)), 42);
        p.policy.after_exec = true;
        p.policy.keep_labelled = false;
        store.put_snapshot_policy(&p).await.unwrap();
        assert_eq!(store.get_snapshot_policy(A).await.unwrap(), Some(p.clone()));
        p.checked_at = 43;
        store.put_snapshot_policy(&p).await.unwrap();
        assert_eq!(store.list_snapshot_policies().await.unwrap(), map(vec![p]));
        store
            .mark_auto_snapshot("s1", A, REASON_EVERY)
            .await
            .unwrap();
        store
            .mark_auto_snapshot("s1", A, REASON_EVERY)
            .await
            .unwrap();
        store
            .mark_auto_snapshot("s2", A, REASON_EXEC)
            .await
            .unwrap();
        store.unmark_auto_snapshot("s2").await.unwrap();
        assert_eq!(
            store.auto_snapshot_ids(A).await.unwrap(),
            HashSet::from(["s1".to_string()])
        );
        store.delete_snapshot_policy(A).await.unwrap();
        assert!(store.list_snapshot_policies().await.unwrap().is_empty());
        assert!(store.auto_snapshot_ids(A).await.unwrap().is_empty());
    }
}
