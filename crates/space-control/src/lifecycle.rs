//! Pause/resume, auto-pause on idle and per-sandbox timeouts (decision 0008).
//!
//! - Pause freezes every process of a sandbox through its cgroup freezer (no CPU, memory
//!   kept); resume thaws it. Store state `paused`.
//! - A timeout is an absolute deadline (`timeout_at`, unix ms). Only create and
//!   `POST /v1/sandboxes/{id}/timeout` set or clear it; pause, resume, reconnects and
//!   restarts never touch it. When it expires the reconciler applies `on_timeout` (default
//!   `pause`; `delete` on request) once and clears it.
//! - Idle = no API call that reaches the guest (exec, processes, files) and no open exec or
//!   output stream. The last activity is kept in memory ([`Activity`]) and written on pause.
//!   After a restart the clock starts at the restart (never pauses earlier than due).
//!
//! The pure [`lifecycle_steps`] turns rows + deadlines + idleness into reconcile steps; the
//! `ensure_*` methods apply them under the sandbox's lock.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::BoxStream;
use space_api::{OnTimeout, Sandbox, SandboxState, SetTimeout, rfc3339_from_unix_ms};
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::engine::{Action, Engine, check_lifecycle};
use crate::error::{ControlError, ControlResult};
use crate::reconcile::Step;
use crate::store::{SandboxRow, Store, StoreError, now_ms};

/// Largest timeout / auto-pause accepted: 100 years. Not a lifetime cap, only a guard
/// against overflowing the deadline arithmetic.
pub const MAX_SECS: u64 = 100 * 365 * 24 * 3600;

/// The lifecycle settings of one sandbox (table `sandbox_lifecycle`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LifecycleRow {
    pub id: String,
    /// Absolute deadline, unix ms.
    pub timeout_at: Option<i64>,
    pub on_timeout: OnTimeout,
    pub auto_pause_secs: Option<u64>,
    pub paused_at: Option<i64>,
    pub last_activity_at: Option<i64>,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &AnyRow) -> Result<LifecycleRow, StoreError> {
    let id: String = r.try_get("id").map_err(q("decode lifecycle"))?;
    let on: String = r.try_get("on_timeout").map_err(q("decode lifecycle"))?;
    let on_timeout = OnTimeout::parse(&on).ok_or_else(|| StoreError::Corrupt {
        id: id.clone(),
        reason: format!("bad on_timeout {on:?}"),
    })?;
    let auto: Option<i64> = r
        .try_get("auto_pause_secs")
        .map_err(q("decode lifecycle"))?;
    Ok(LifecycleRow {
        timeout_at: r.try_get("timeout_at").map_err(q("decode lifecycle"))?,
        on_timeout,
        auto_pause_secs: auto.map(|v| v.max(0) as u64),
        paused_at: r.try_get("paused_at").map_err(q("decode lifecycle"))?,
        last_activity_at: r
            .try_get("last_activity_at")
            .map_err(q("decode lifecycle"))?,
        id,
    })
}

const COLUMNS: &str = "id, timeout_at, on_timeout, auto_pause_secs, paused_at, last_activity_at";

/// The insert-or-replace of one lifecycle row, for a pool or a transaction.
fn upsert_lifecycle(
    l: &LifecycleRow,
) -> sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments<'_>> {
    sqlx::query(
        "INSERT INTO sandbox_lifecycle \
         (id, timeout_at, on_timeout, auto_pause_secs, paused_at, last_activity_at) \
         VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (id) DO UPDATE SET timeout_at = excluded.timeout_at, \
         on_timeout = excluded.on_timeout, auto_pause_secs = excluded.auto_pause_secs, \
         paused_at = excluded.paused_at, last_activity_at = excluded.last_activity_at",
    )
    .bind(&l.id)
    .bind(l.timeout_at)
    .bind(l.on_timeout.as_str())
    .bind(l.auto_pause_secs.map(|v| v as i64))
    .bind(l.paused_at)
    .bind(l.last_activity_at)
}

impl Store {
    pub async fn get_lifecycle(&self, id: &str) -> Result<Option<LifecycleRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandbox_lifecycle WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get lifecycle"))?;
        row.map(|r| decode(&r)).transpose()
    }

    pub async fn list_lifecycle(&self) -> Result<HashMap<String, LifecycleRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM sandbox_lifecycle"))
            .fetch_all(self.pool())
            .await
            .map_err(q("list lifecycle"))?;
        rows.iter()
            .map(|r| decode(r).map(|l| (l.id.clone(), l)))
            .collect()
    }

    pub async fn put_lifecycle(&self, l: &LifecycleRow) -> Result<(), StoreError> {
        upsert_lifecycle(l)
            .execute(self.pool())
            .await
            .map_err(q("put lifecycle"))?;
        Ok(())
    }

    /// Records a pause in one transaction: the state `paused` and the lifecycle row (its
    /// `paused_at`, and a consumed timeout when the pause was the timeout's), so that no
    /// reader sees one without the other. Returns false if the sandbox row is gone.
    pub async fn set_paused(&self, l: &LifecycleRow) -> Result<bool, StoreError> {
        let mut tx = self.pool().begin().await.map_err(q("record pause"))?;
        let res = sqlx::query(
            "UPDATE sandboxes SET state = $1, error = NULL, updated_at = $2 WHERE id = $3",
        )
        .bind(SandboxState::Paused.as_str())
        .bind(now_ms())
        .bind(&l.id)
        .execute(&mut *tx)
        .await
        .map_err(q("record pause"))?;
        if res.rows_affected() == 0 {
            return Ok(false);
        }
        upsert_lifecycle(l)
            .execute(&mut *tx)
            .await
            .map_err(q("record pause"))?;
        tx.commit().await.map_err(q("record pause"))?;
        Ok(true)
    }

    pub async fn delete_lifecycle(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandbox_lifecycle WHERE id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("delete lifecycle"))?;
        Ok(())
    }
}

// ---------------------------------------------------------------- activity

#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    last_ms: i64,
    streams: u32,
}

/// In-memory API activity per sandbox: last call time and open streams.
#[derive(Debug)]
pub struct Activity {
    started_ms: i64,
    map: Mutex<HashMap<String, Seen>>,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            started_ms: now_ms(),
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl Activity {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, Seen>) -> R) -> R {
        f(&mut self.map.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records an API call on `id` now.
    pub fn touch(&self, id: &str) {
        let now = now_ms();
        self.with(|m| m.entry(id.to_string()).or_default().last_ms = now);
    }

    /// Since when `id` has been idle; `None` while a stream is open.
    pub fn idle_since(&self, id: &str) -> Option<i64> {
        let started = self.started_ms;
        self.with(|m| match m.get(id) {
            Some(s) if s.streams > 0 => None,
            Some(s) => Some(s.last_ms.max(started)),
            None => Some(started),
        })
    }

    pub fn forget(&self, id: &str) {
        self.with(|m| m.remove(id));
    }

    /// Wraps a stream so that `id` counts as active until the stream is dropped.
    pub fn track<T: Send + 'static>(
        self: &std::sync::Arc<Self>,
        id: &str,
        inner: BoxStream<'static, T>,
    ) -> BoxStream<'static, T> {
        let now = now_ms();
        self.with(|m| {
            let s = m.entry(id.to_string()).or_default();
            s.streams += 1;
            s.last_ms = now;
        });
        Box::pin(Tracked {
            inner,
            activity: self.clone(),
            id: id.to_string(),
        })
    }
}

struct Tracked<T> {
    inner: BoxStream<'static, T>,
    activity: std::sync::Arc<Activity>,
    id: String,
}

impl<T> Stream for Tracked<T> {
    type Item = T;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl<T> Drop for Tracked<T> {
    fn drop(&mut self) {
        let now = now_ms();
        self.activity.with(|m| {
            if let Some(s) = m.get_mut(&self.id) {
                s.streams = s.streams.saturating_sub(1);
                s.last_ms = now;
            }
        });
    }
}

// ---------------------------------------------------------------- pure steps

/// Deadlines and idleness -> steps. Pure: `idle_since(id)` says since when a sandbox has
/// been idle (`None` while it has an open stream) and `now_ms` is the clock.
pub fn lifecycle_steps(
    desired: &[SandboxRow],
    lifecycle: &HashMap<String, LifecycleRow>,
    idle_since: &dyn Fn(&str) -> Option<i64>,
    now_ms: i64,
) -> Vec<Step> {
    let mut steps = Vec::new();
    for row in desired {
        let Some(l) = lifecycle.get(&row.id) else {
            continue;
        };
        if row.deleted_at.is_some()
            || matches!(row.state, SandboxState::Deleting | SandboxState::Creating)
        {
            continue;
        }
        if l.timeout_at.is_some_and(|t| now_ms >= t) {
            steps.push(Step::ExpireTimeout { id: row.id.clone() });
            continue;
        }
        if row.state == SandboxState::Running
            && let Some(secs) = l.auto_pause_secs
            && let Some(since) = idle_since(&row.id)
            && now_ms.saturating_sub(since) >= (secs as i64).saturating_mul(1000)
        {
            steps.push(Step::AutoPause { id: row.id.clone() });
        }
    }
    steps
}

// ---------------------------------------------------------------- engine

fn check_secs(what: &str, v: u64) -> ControlResult<i64> {
    if v == 0 || v > MAX_SECS {
        return Err(ControlError::invalid(format!(
            "{what} must be between 1 and {MAX_SECS} seconds, got {v}"
        )));
    }
    Ok(v as i64 * 1000)
}

/// The lifecycle row a create request asks for (`None` when it sets nothing).
pub fn lifecycle_from_create(
    req: &space_api::CreateSandbox,
    id: &str,
    now: i64,
) -> ControlResult<Option<LifecycleRow>> {
    let timeout_at = match req.timeout_secs {
        Some(v) => Some(now + check_secs("timeout_secs", v)?),
        None => None,
    };
    if let Some(v) = req.auto_pause_secs {
        check_secs("auto_pause_secs", v)?;
    }
    if timeout_at.is_none() && req.auto_pause_secs.is_none() && req.on_timeout.is_none() {
        return Ok(None);
    }
    Ok(Some(LifecycleRow {
        id: id.to_string(),
        timeout_at,
        on_timeout: req.on_timeout.unwrap_or_default(),
        auto_pause_secs: req.auto_pause_secs,
        paused_at: None,
        last_activity_at: None,
    }))
}

/// Adds the lifecycle fields to a sandbox DTO.
pub fn decorate(sb: &mut Sandbox, l: Option<&LifecycleRow>) {
    let Some(l) = l else { return };
    sb.timeout_at = l.timeout_at.map(rfc3339_from_unix_ms);
    sb.on_timeout = l.timeout_at.map(|_| l.on_timeout);
    sb.auto_pause_secs = l.auto_pause_secs;
    sb.paused_at = l
        .paused_at
        .filter(|_| sb.state == SandboxState::Paused)
        .map(rfc3339_from_unix_ms);
}

impl Engine {
    async fn lifecycle_or_default(&self, id: &str) -> ControlResult<LifecycleRow> {
        Ok(self
            .store
            .get_lifecycle(id)
            .await?
            .unwrap_or_else(|| LifecycleRow {
                id: id.to_string(),
                ..Default::default()
            }))
    }

    /// Adds the stored lifecycle fields to a DTO.
    pub(crate) async fn decorate_one(&self, sb: &mut Sandbox) {
        match self.store.get_lifecycle(&sb.id).await {
            Ok(l) => decorate(sb, l.as_ref()),
            Err(e) => tracing::warn!(sandbox = %sb.id, error = %e, "lifecycle lookup"),
        }
        self.decorate_policy(sb).await;
    }

    pub(crate) async fn decorate_all(&self, list: &mut [Sandbox]) {
        match self.store.list_lifecycle().await {
            Ok(map) => list.iter_mut().for_each(|sb| decorate(sb, map.get(&sb.id))),
            Err(e) => tracing::warn!(error = %e, "lifecycle lookup"),
        }
        self.decorate_policies(list).await;
    }

    /// `POST /v1/sandboxes/{id}/pause`.
    pub async fn pause_sandbox(&self, id: &str) -> ControlResult<Sandbox> {
        {
            let _guard = self.locks.lock(id).await;
            let row = self.load_checked(id).await?;
            match row.state {
                SandboxState::Running => {}
                SandboxState::Paused => {
                    return Err(ControlError::conflict(format!(
                        "sandbox {id} is already paused"
                    )));
                }
                _ => check_lifecycle(&row, Action::Guest)?,
            }
            self.pause_locked(id, false).await?;
        }
        self.get_sandbox(id).await
    }

    /// `POST /v1/sandboxes/{id}/pause` with `{"memory": false}` (E2B's filesystem-only
    /// pause): every process ends and the sandbox's memory and CPU are freed; its filesystem,
    /// snapshots and settings stay. The sandbox is `stopped` until `resume` starts it again
    /// on that filesystem, cold: the template's start command runs again.
    pub async fn stop_sandbox(&self, id: &str) -> ControlResult<Sandbox> {
        {
            let _guard = self.locks.lock(id).await;
            let row = self.load_checked(id).await?;
            match row.state {
                SandboxState::Running => {}
                SandboxState::Stopped => {
                    return Err(ControlError::conflict(format!(
                        "sandbox {id} is already stopped"
                    )));
                }
                SandboxState::Paused => {
                    return Err(ControlError::conflict(format!(
                        "sandbox {id} is paused with its memory; resume it before a \
                         filesystem-only pause"
                    )));
                }
                _ => check_lifecycle(&row, Action::Guest)?,
            }
            self.stop_locked(id).await?;
        }
        self.get_sandbox(id).await
    }

    /// The stop itself, under the sandbox's lock.
    async fn stop_locked(&self, id: &str) -> ControlResult<()> {
        self.node.stop_sandbox(id).await?;
        self.write_status(id, SandboxState::Stopped, None).await
    }

    /// `POST /v1/sandboxes/{id}/resume`: thaws a paused sandbox, or starts a stopped one
    /// again on its filesystem.
    pub async fn resume_sandbox(&self, id: &str) -> ControlResult<Sandbox> {
        {
            let _guard = self.locks.lock(id).await;
            let row = self.load_checked(id).await?;
            if row.state == SandboxState::Stopped {
                self.node
                    .create_sandbox(&crate::engine::node_spec(id, &row.spec))
                    .await?;
                self.write_status(id, SandboxState::Running, None).await?;
                self.activity.touch(id);
                return self.get_sandbox(id).await;
            }
            if row.state != SandboxState::Paused {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is {}, not paused",
                    row.state
                )));
            }
            match self.node.resume_sandbox(id).await {
                Ok(_) => {}
                // Already thawed on the node (a crash between thaw and the store write).
                Err(space_node_api::NodeError::WrongPhase {
                    phase: space_node_api::Phase::Running,
                    ..
                }) => {}
                Err(e) => return Err(e.into()),
            }
            self.write_status(id, SandboxState::Running, None).await?;
            let mut l = self.lifecycle_or_default(id).await?;
            if l.paused_at.is_some() {
                l.paused_at = None;
                self.store.put_lifecycle(&l).await?;
            }
            // Resuming is activity: the idle clock starts again.
            self.activity.touch(id);
        }
        self.get_sandbox(id).await
    }

    /// `POST /v1/sandboxes/{id}/timeout`: the only way to change a timeout after create.
    pub async fn set_timeout(&self, id: &str, req: SetTimeout) -> ControlResult<Sandbox> {
        let timeout_at = match req.timeout_secs {
            Some(v) => Some(now_ms() + check_secs("timeout_secs", v)?),
            None => None,
        };
        {
            let _guard = self.locks.lock(id).await;
            let row = self.load_checked(id).await?;
            if row.state == SandboxState::Deleting || row.deleted_at.is_some() {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is being deleted"
                )));
            }
            let mut l = self.lifecycle_or_default(id).await?;
            l.timeout_at = timeout_at;
            if let Some(on) = req.on_timeout {
                l.on_timeout = on;
            }
            self.store.put_lifecycle(&l).await?;
            tracing::info!(
                sandbox = id,
                timeout_at,
                on_timeout = l.on_timeout.as_str(),
                "timeout set"
            );
        }
        self.wake_reconciler();
        self.get_sandbox(id).await
    }

    /// E2B's connect (decision 0022): the deadline becomes now + `secs` when that is later.
    /// A running sandbox's deadline is never shortened, and one without a deadline keeps
    /// none. `resumed`: the connect has just resumed the sandbox, which then gets a deadline
    /// of at least now + `secs` even if its pause had consumed the old one.
    pub async fn extend_timeout(&self, id: &str, secs: u64, resumed: bool) -> ControlResult<()> {
        let add = check_secs("timeout", secs)?;
        {
            let _guard = self.locks.lock(id).await;
            let mut l = self.lifecycle_or_default(id).await?;
            let wanted = now_ms() + add;
            let extend = match l.timeout_at {
                Some(at) => wanted > at,
                None => resumed,
            };
            if !extend {
                return Ok(());
            }
            l.timeout_at = Some(wanted);
            self.store.put_lifecycle(&l).await?;
            tracing::info!(sandbox = id, timeout_at = wanted, "timeout extended");
        }
        self.wake_reconciler();
        Ok(())
    }

    pub(crate) async fn load_checked(&self, id: &str) -> ControlResult<SandboxRow> {
        if !space_api::is_valid_sandbox_id(id) {
            return Err(ControlError::invalid(format!("invalid sandbox id {id:?}")));
        }
        self.store
            .get_sandbox(id)
            .await?
            .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))
    }

    /// Freezes a running sandbox and records it (caller holds the lock, state is running).
    /// `consume_timeout`: the pause is the timeout's, which is cleared in the same write.
    async fn pause_locked(&self, id: &str, consume_timeout: bool) -> ControlResult<()> {
        match self.node.pause_sandbox(id).await {
            Ok(_) => {}
            // Already frozen on the node (a crash between freeze and the store write).
            Err(space_node_api::NodeError::WrongPhase {
                phase: space_node_api::Phase::Paused,
                ..
            }) => {}
            Err(e) => return Err(e.into()),
        }
        let mut l = self.lifecycle_or_default(id).await?;
        let now = now_ms();
        l.paused_at = Some(now);
        l.last_activity_at = self.activity.idle_since(id).or(Some(now));
        if consume_timeout {
            l.timeout_at = None;
        }
        tracing::info!(sandbox = id, state = %SandboxState::Paused, "sandbox status");
        self.store.set_paused(&l).await?;
        self.event(id, SandboxState::Paused.as_str(), "ok", "");
        Ok(())
    }

    /// Reconcile step: the timeout expired -> apply `on_timeout` once, clear the deadline.
    pub(crate) async fn ensure_timeout_enforced(
        &self,
        row: Option<SandboxRow>,
    ) -> ControlResult<()> {
        let Some(row) = row else { return Ok(()) };
        if row.deleted_at.is_some()
            || matches!(row.state, SandboxState::Deleting | SandboxState::Creating)
        {
            return Ok(());
        }
        let Some(mut l) = self.store.get_lifecycle(&row.id).await? else {
            return Ok(());
        };
        let Some(deadline) = l.timeout_at.filter(|t| now_ms() >= *t) else {
            return Ok(());
        };
        match l.on_timeout {
            OnTimeout::Delete => {
                tracing::info!(sandbox = %row.id, deadline, "timeout expired: deleting");
                self.write_status(&row.id, SandboxState::Deleting, Some("timeout expired"))
                    .await?;
                self.finalize_delete(&row.id).await?;
                return Ok(());
            }
            OnTimeout::Pause => {
                tracing::info!(sandbox = %row.id, deadline, "timeout expired: pausing");
                if row.state == SandboxState::Running {
                    // The pause and the consumed deadline are one write.
                    return self.pause_locked(&row.id, true).await;
                }
            }
            OnTimeout::Stop => {
                tracing::info!(sandbox = %row.id, deadline, "timeout expired: stopping");
                if row.state == SandboxState::Running {
                    self.node.stop_sandbox(&row.id).await?;
                    // The consumed deadline is written before the state, so that no reader
                    // sees a stopped sandbox still carrying the deadline that stopped it.
                    l.timeout_at = None;
                    self.store.put_lifecycle(&l).await?;
                    return self
                        .write_status(&row.id, SandboxState::Stopped, None)
                        .await;
                }
            }
        }
        // Fired once: a later resume is not paused again by the same deadline.
        l.timeout_at = None;
        self.store.put_lifecycle(&l).await?;
        Ok(())
    }

    /// Reconcile step: idle past `auto_pause_secs` -> pause.
    pub(crate) async fn ensure_idle_paused(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| r.state == SandboxState::Running && r.deleted_at.is_none())
        else {
            return Ok(());
        };
        let Some(l) = self.store.get_lifecycle(&row.id).await? else {
            return Ok(());
        };
        let steps = lifecycle_steps(
            std::slice::from_ref(&row),
            &HashMap::from([(row.id.clone(), l)]),
            &|id| self.activity.idle_since(id),
            now_ms(),
        );
        if steps.contains(&Step::AutoPause { id: row.id.clone() }) {
            tracing::info!(sandbox = %row.id, "idle: auto-pausing");
            self.pause_locked(&row.id, false).await?;
        }
        Ok(())
    }

    /// Reconcile step: the store says running/paused and the node the opposite (a crash
    /// between the node call and the store write): make the node follow the store.
    pub(crate) async fn ensure_freeze_synced(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row else { return Ok(()) };
        let Some(status) = self.node.sandbox_status(&row.id).await? else {
            return Ok(());
        };
        use space_node_api::Phase;
        match (row.state, status.phase) {
            (SandboxState::Running, Phase::Paused) => {
                self.node.resume_sandbox(&row.id).await?;
            }
            (SandboxState::Paused, Phase::Running) => {
                self.node.pause_sandbox(&row.id).await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The lifecycle steps of one reconcile pass.
    pub(crate) async fn lifecycle_pass(&self, desired: &[SandboxRow]) -> ControlResult<Vec<Step>> {
        let lifecycle = self.store.list_lifecycle().await?;
        Ok(lifecycle_steps(
            desired,
            &lifecycle,
            &|id| self.activity.idle_since(id),
            now_ms(),
        ))
    }
}

// ---------------------------------------------------------------- http

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::row;

    const A: &str = "aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbb";

    fn lc(id: &str, timeout_at: Option<i64>, auto: Option<u64>) -> LifecycleRow {
        LifecycleRow {
            id: id.into(),
            timeout_at,
            auto_pause_secs: auto,
            ..Default::default()
        }
    }

    fn map(rows: Vec<LifecycleRow>) -> HashMap<String, LifecycleRow> {
        rows.into_iter().map(|l| (l.id.clone(), l)).collect()
    }

    #[test]
    fn timeouts_fire_at_their_deadline_only() {
        let desired = [row(A, SandboxState::Running, 0)];
        let l = map(vec![lc(A, Some(10_000), None)]);
        let idle = |_: &str| None;
        assert!(lifecycle_steps(&desired, &l, &idle, 9_999).is_empty());
        assert_eq!(
            lifecycle_steps(&desired, &l, &idle, 10_000),
            vec![Step::ExpireTimeout { id: A.into() }]
        );
        // Paused sandboxes still count down (the deadline is absolute).
        let paused = [row(A, SandboxState::Paused, 0)];
        assert_eq!(
            lifecycle_steps(&paused, &l, &idle, 20_000),
            vec![Step::ExpireTimeout { id: A.into() }]
        );
        // Creating / deleting rows are left alone.
        for s in [SandboxState::Creating, SandboxState::Deleting] {
            assert!(lifecycle_steps(&[row(A, s, 0)], &l, &idle, 20_000).is_empty());
        }
        // No lifecycle row, or no deadline: nothing.
        assert!(lifecycle_steps(&desired, &HashMap::new(), &idle, i64::MAX).is_empty());
        let none = map(vec![lc(A, None, None)]);
        assert!(lifecycle_steps(&desired, &none, &idle, i64::MAX).is_empty());
    }

    #[test]
    fn auto_pause_needs_idleness_for_the_whole_period() {
        let desired = [
            row(A, SandboxState::Running, 0),
            row(B, SandboxState::Running, 0),
        ];
        let l = map(vec![lc(A, None, Some(2)), lc(B, None, Some(2))]);
        // A idle since 1000, B has an open stream.
        let idle = |id: &str| (id == A).then_some(1_000);
        assert!(lifecycle_steps(&desired, &l, &idle, 2_999).is_empty());
        assert_eq!(
            lifecycle_steps(&desired, &l, &idle, 3_000),
            vec![Step::AutoPause { id: A.into() }]
        );
        // Only running sandboxes are auto-paused.
        let paused = [row(A, SandboxState::Paused, 0)];
        assert!(lifecycle_steps(&paused, &l, &idle, 100_000).is_empty());
        // An expired timeout wins over auto-pause (one step per sandbox).
        let both = map(vec![lc(A, Some(500), Some(2))]);
        assert_eq!(
            lifecycle_steps(&desired[..1], &both, &idle, 100_000),
            vec![Step::ExpireTimeout { id: A.into() }]
        );
    }

    #[test]
    fn create_validation_of_lifecycle_fields() {
        let req = |t: Option<u64>, a: Option<u64>| space_api::CreateSandbox {
            timeout_secs: t,
            auto_pause_secs: a,
            ..Default::default()
        };
        assert_eq!(lifecycle_from_create(&req(None, None), A, 0).unwrap(), None);
        let l = lifecycle_from_create(&req(Some(5), Some(7)), A, 1_000)
            .unwrap()
            .unwrap();
        assert_eq!(l.timeout_at, Some(6_000));
        assert_eq!(l.auto_pause_secs, Some(7));
        assert_eq!(l.on_timeout, OnTimeout::Pause);
        for bad in [
            req(Some(0), None),
            req(None, Some(0)),
            req(Some(MAX_SECS + 1), None),
        ] {
            assert_eq!(
                lifecycle_from_create(&bad, A, 0).unwrap_err().code(),
                "invalid_argument"
            );
        }
    }

    #[test]
    fn activity_tracks_streams() {
        let a = std::sync::Arc::new(Activity::default());
        assert_eq!(a.idle_since(A), Some(a.started_ms));
        let s = a.track(A, Box::pin(futures::stream::empty::<u8>()));
        assert_eq!(a.idle_since(A), None);
        drop(s);
        assert!(a.idle_since(A).is_some_and(|t| t >= a.started_ms));
    }

    #[tokio::test]
    async fn lifecycle_rows_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        assert_eq!(store.get_lifecycle(A).await.unwrap(), None);
        let mut l = lc(A, Some(42), Some(3));
        l.on_timeout = OnTimeout::Delete;
        store.put_lifecycle(&l).await.unwrap();
        assert_eq!(store.get_lifecycle(A).await.unwrap(), Some(l.clone()));
        l.timeout_at = None;
        l.paused_at = Some(7);
        store.put_lifecycle(&l).await.unwrap();
        assert_eq!(store.list_lifecycle().await.unwrap(), map(vec![l]));
        store.delete_lifecycle(A).await.unwrap();
        assert!(store.list_lifecycle().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_pause_writes_state_and_lifecycle_together() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let mut l = lc(A, Some(42), None);
        l.paused_at = Some(9);
        // No sandbox row: nothing is written.
        assert!(!store.set_paused(&l).await.unwrap());
        assert_eq!(store.get_lifecycle(A).await.unwrap(), None);

        store
            .insert_sandbox(&row(A, SandboxState::Running, 1))
            .await
            .unwrap();
        store.put_lifecycle(&lc(A, Some(42), None)).await.unwrap();
        l.timeout_at = None;
        assert!(store.set_paused(&l).await.unwrap());
        let got = store.get_sandbox(A).await.unwrap().unwrap();
        assert_eq!(got.state, SandboxState::Paused);
        assert_eq!(store.get_lifecycle(A).await.unwrap(), Some(l));
    }
}
