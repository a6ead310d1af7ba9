//! The reconciler (kube-rs style). Level-triggered: [`reconcile`] looks only at desired rows
//! and the node's observed sandboxes, never at why it was called, and returns independent
//! steps. Each `ensure_*` step takes the sandbox's lock, re-checks its own precondition
//! against fresh state, and is safe to repeat. Failures go through [`error_policy`], which
//! picks a backoff; the loop always requeues. Status is written only by
//! `Engine::write_status`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use space_api::SandboxState;
use space_node_api::{Phase, SandboxStatus};
use tracing::Instrument;

use crate::engine::{Engine, node_spec};
use crate::error::{ControlError, ControlResult, ErrorKind};
use crate::store::{SandboxRow, now_ms};

pub const ERROR_INIT_EXITED: &str = "init exited";
pub const ERROR_SANDBOX_LOST: &str = "sandbox lost";

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// Deletion finalizer: remove on the node, then forget the row.
    FinalizeDelete { id: String },
    /// A running row whose init is gone: restart it from its newest snapshot (or its
    /// rootfs), or mark it stopped after a crash loop (see `recovery`).
    MarkStopped { id: String },
    /// A row whose sandbox the node no longer has: mark failed.
    MarkLost { id: String },
    /// A row stuck in `creating` (the fast path died): create on the node (idempotent).
    ResumeCreate { id: String },
    /// A failed row that still has node resources: remove them (the row stays, with its
    /// error, until the user deletes it).
    CleanupFailed { id: String },
    /// A node sandbox without a row: remove it.
    RemoveOrphan { id: String },
    /// The timeout's deadline passed: apply its action once (see `lifecycle`).
    ExpireTimeout { id: String },
    /// Idle longer than its auto-pause period: pause it.
    AutoPause { id: String },
    /// Row running but node paused, or the reverse: make the node follow the row.
    SyncFreeze { id: String },
    /// The snapshot policy's period passed: snapshot if the files changed (see
    /// `snapshot_policy`).
    AutoSnapshot { id: String },
    /// The node applies another egress policy than the row wants: apply the row's (see
    /// `net`).
    SyncNetwork { id: String },
    /// The replica lacks a snapshot the sandbox has, or is on a node that cannot keep it
    /// (see `replicas`).
    Replicate { id: String },
    /// The sandbox's node is lost: restore it from its replica, or mark it lost.
    Restore { id: String },
    /// Node `node` holds a copy of a sandbox the store places on another node: remove it.
    RemoveStray { id: String, node: String },
    /// A lost sandbox is on its node again: take its status from there.
    Found { id: String },
}

impl Step {
    pub fn id(&self) -> &str {
        match self {
            Step::FinalizeDelete { id }
            | Step::MarkStopped { id }
            | Step::MarkLost { id }
            | Step::ResumeCreate { id }
            | Step::CleanupFailed { id }
            | Step::RemoveOrphan { id }
            | Step::ExpireTimeout { id }
            | Step::AutoPause { id }
            | Step::SyncFreeze { id }
            | Step::AutoSnapshot { id }
            | Step::SyncNetwork { id }
            | Step::Replicate { id }
            | Step::Restore { id }
            | Step::RemoveStray { id, .. }
            | Step::Found { id } => id,
        }
    }
}

/// Compares desired rows with observed node sandboxes. Pure; `now_ms` and `create_grace_ms`
/// decide when a `creating` row counts as abandoned by its fast path.
pub fn reconcile(
    desired: &[SandboxRow],
    observed: &[SandboxStatus],
    now_ms: i64,
    create_grace_ms: i64,
) -> Vec<Step> {
    let on_node: HashMap<&str, &SandboxStatus> =
        observed.iter().map(|s| (s.id.as_str(), s)).collect();
    let known: HashSet<&str> = desired.iter().map(|r| r.id.as_str()).collect();
    let mut steps = Vec::new();
    for row in desired {
        let id = row.id.clone();
        let node = on_node.get(row.id.as_str()).map(|s| s.phase);
        let step = match (row.state, node) {
            (SandboxState::Deleting, _) => Some(Step::FinalizeDelete { id }),
            _ if row.deleted_at.is_some() => Some(Step::FinalizeDelete { id }),
            (SandboxState::Running | SandboxState::Paused, Some(Phase::Stopped)) => {
                Some(Step::MarkStopped { id })
            }
            (SandboxState::Running | SandboxState::Stopped | SandboxState::Paused, None) => {
                Some(Step::MarkLost { id })
            }
            (SandboxState::Running, Some(Phase::Paused))
            | (SandboxState::Paused, Some(Phase::Running)) => Some(Step::SyncFreeze { id }),
            (SandboxState::Creating, _) if now_ms - row.updated_at > create_grace_ms => {
                Some(Step::ResumeCreate { id })
            }
            (SandboxState::Failed, Some(_)) => Some(Step::CleanupFailed { id }),
            (SandboxState::Lost, Some(_)) => Some(Step::Found { id }),
            _ => None,
        };
        steps.extend(step);
    }
    for s in observed {
        if !known.contains(s.id.as_str()) {
            steps.push(Step::RemoveOrphan { id: s.id.clone() });
        }
    }
    steps
}

/// Backoff after the `attempts`-th consecutive failure of a step on one sandbox.
pub fn error_policy(err: &ControlError, attempts: u32) -> Duration {
    // The guest or node being briefly unavailable heals fast; anything else backs off more.
    let base = if err.kind == ErrorKind::Unavailable {
        500
    } else {
        1000
    };
    let exp = attempts.saturating_sub(1).min(6);
    Duration::from_millis(base << exp).min(Duration::from_secs(60))
}

/// Backoff bookkeeping of the reconcile loop.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: HashMap<String, (u32, Instant)>,
}

impl Backoff {
    fn ready(&self, id: &str, now: Instant) -> bool {
        self.failures
            .get(id)
            .is_none_or(|(_, not_before)| now >= *not_before)
    }

    fn failed(&mut self, id: &str, err: &ControlError, now: Instant) -> Duration {
        let entry = self.failures.entry(id.to_string()).or_insert((0, now));
        entry.0 += 1;
        let delay = error_policy(err, entry.0);
        entry.1 = now + delay;
        delay
    }

    fn succeeded(&mut self, id: &str) {
        self.failures.remove(id);
    }
}

impl Engine {
    /// One reconcile pass: observe the node, then read desired state (in this order, so a
    /// sandbox created in between always has its row), then apply each step.
    pub async fn reconcile_once(&self, backoff: &mut Backoff) -> ControlResult<usize> {
        self.metrics
            .reconcile_runs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.pools_pass().await;
        let observation = self.node.observe_phases().await?;
        let mut desired = self.store.list_sandboxes().await?;
        // Replication and node loss look at every row, those on silent nodes too.
        let replication = self.replication_pass(&desired, &observation).await?;
        let observed = observation.sandboxes;
        // On a node that did not answer: not observed, and not gone either. Left alone until
        // it answers again (node liveness marks them).
        desired.retain(|r| !observation.unseen.contains(&r.id));
        // Rows left `creating` by an earlier spaced instance have no fast path to finish
        // them: resolve them now instead of after the grace period (decision 0009).
        for r in desired
            .iter_mut()
            .filter(|r| r.state == SandboxState::Creating && r.updated_at < self.boot_ms)
        {
            r.updated_at = i64::MIN / 2;
        }
        let mut steps = reconcile(
            &desired,
            &observed,
            now_ms(),
            self.cfg.create_grace.as_millis() as i64,
        );
        // A sandbox being restored is not on its node yet: not lost.
        let restoring: HashSet<String> = replication
            .iter()
            .filter(|s| matches!(s, Step::Restore { .. }))
            .map(|s| s.id().to_owned())
            .collect();
        steps.retain(|s| !(matches!(s, Step::MarkLost { .. }) && restoring.contains(s.id())));
        steps.extend(replication);
        steps.extend(self.lifecycle_pass(&desired).await?);
        steps.extend(crate::net::network_steps(&desired, &observed));
        match self.snapshot_policy_pass(&desired).await {
            Ok(s) => steps.extend(s),
            Err(e) => tracing::warn!(error = %e, "snapshot policy pass"),
        }
        let now = Instant::now();
        steps.retain(|s| backoff.ready(s.id(), now));
        // Every step's sandbox lease in one claim: what another replica claimed first is its
        // work this pass (decision 0055).
        let leases = self.leases.sandboxes(steps.iter().map(Step::id)).await?;
        let mut applied = 0;
        for step in steps {
            if !leases.holds(step.id()) {
                tracing::debug!(
                    ?step,
                    "another replica holds the sandbox; left for a later pass"
                );
                continue;
            }
            match self.apply(&step).await {
                Ok(()) => {
                    backoff.succeeded(step.id());
                    applied += 1;
                }
                Err(e) => {
                    self.metrics
                        .reconcile_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let delay = backoff.failed(step.id(), &e, now);
                    tracing::warn!(?step, error = %e, retry_in = ?delay, "reconcile step failed");
                }
            }
        }
        Ok(applied)
    }

    /// Applies one step, whose sandbox's lease this replica holds, under the sandbox's lock.
    async fn apply(&self, step: &Step) -> ControlResult<()> {
        let id = step.id();
        let _guard = self.locks.lock(id).await;
        let row = self.store.get_sandbox(id).await?;
        match step {
            Step::FinalizeDelete { .. } => self.ensure_deleted(row).await,
            Step::MarkStopped { .. } => self.ensure_recovered(row).await,
            Step::MarkLost { .. } => self.ensure_lost(row).await,
            Step::ResumeCreate { .. } => self.ensure_created(row).await,
            Step::CleanupFailed { .. } => self.ensure_failed_cleaned(row).await,
            Step::RemoveOrphan { .. } => self.ensure_orphan_removed(id, row).await,
            Step::ExpireTimeout { .. } => self.ensure_timeout_enforced(row).await,
            Step::AutoPause { .. } => self.ensure_idle_paused(row).await,
            Step::SyncFreeze { .. } => self.ensure_freeze_synced(row).await,
            Step::AutoSnapshot { .. } => self.ensure_auto_snapshot(row).await,
            Step::SyncNetwork { .. } => self.ensure_network_synced(row).await,
            Step::Replicate { .. } => self.ensure_replicated(row).await,
            Step::Restore { .. } => self.ensure_restored(row).await,
            Step::RemoveStray { node, .. } => self.ensure_stray_removed(id, node).await,
            Step::Found { .. } => self.ensure_found(row).await,
        }
    }

    async fn ensure_deleted(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row else { return Ok(()) };
        if row.state != SandboxState::Deleting && row.deleted_at.is_none() {
            return Ok(());
        }
        self.finalize_delete(&row.id).await
    }

    async fn ensure_lost(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| {
            matches!(
                r.state,
                SandboxState::Running | SandboxState::Stopped | SandboxState::Paused
            )
        }) else {
            return Ok(());
        };
        if self.node.sandbox_status(&row.id).await?.is_some() {
            return Ok(());
        }
        self.write_status(&row.id, SandboxState::Failed, Some(ERROR_SANDBOX_LOST))
            .await
    }

    async fn ensure_created(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| r.state == SandboxState::Creating) else {
            return Ok(());
        };
        // Half-done create (decision 0009): finished if the node has it running, else failed
        // and cleaned.
        match self.node.sandbox_status(&row.id).await? {
            Some(s) if s.phase == Phase::Running => {
                self.event(&row.id, "create_resolved", "ok", "running on the node");
                return self
                    .write_status(&row.id, SandboxState::Running, None)
                    .await;
            }
            _ if row.updated_at < self.boot_ms => {
                self.write_status(
                    &row.id,
                    SandboxState::Failed,
                    Some("create interrupted by a restart of spaced"),
                )
                .await?;
                self.node.remove_sandbox(&row.id).await?;
                return Ok(());
            }
            _ => {}
        }
        match self
            .node
            .create_sandbox(&node_spec(&row.id, &row.spec))
            .await
        {
            Ok(_) => {
                self.write_status(&row.id, SandboxState::Running, None)
                    .await
            }
            Err(e) => {
                let err = ControlError::from(e);
                if err.kind.is_caller_error() {
                    let msg = format!("create failed: {}", err.message);
                    self.write_status(&row.id, SandboxState::Failed, Some(&msg))
                        .await
                } else {
                    Err(err)
                }
            }
        }
    }

    async fn ensure_failed_cleaned(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| r.state == SandboxState::Failed) else {
            return Ok(());
        };
        self.node.remove_sandbox(&row.id).await?;
        Ok(())
    }

    async fn ensure_orphan_removed(&self, id: &str, row: Option<SandboxRow>) -> ControlResult<()> {
        if row.is_some() {
            return Ok(());
        }
        tracing::info!(sandbox = id, "removing orphan sandbox");
        self.node.remove_sandbox(id).await?;
        Ok(())
    }
}

/// Runs the reconcile loop until `shutdown` resolves: every `reconcile_interval`, and at
/// once when woken ([`Engine::wake_reconciler`]).
pub fn spawn_reconciler(
    engine: Arc<Engine>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Backoff::default();
        tokio::pin!(shutdown);
        let actor: Arc<str> = Arc::from("reconciler");
        loop {
            let pass =
                crate::events::ACTOR.scope(actor.clone(), engine.reconcile_once(&mut backoff));
            if let Err(e) = pass.instrument(tracing::debug_span!("reconcile")).await {
                tracing::warn!(error = %e, "reconcile pass failed");
            }
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep(engine.cfg.reconcile_interval) => {}
                _ = engine.wake.notified() => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::row;
    use std::path::PathBuf;

    fn status(id: &str, phase: Phase) -> SandboxStatus {
        SandboxStatus {
            id: id.into(),
            phase,
            template: "base".into(),
            runtime: space_node_api::RuntimeKind::Namespace,
            init_pid: (phase == Phase::Running).then_some(42),
            uid_base: 100_000,
            uid_count: 65_536,
            channel: PathBuf::from("/run/space/x.sock"),
            memory_bytes: None,
            cpu_usage_usec: None,
            disk_bytes: None,
            network: None,
            pooled: false,
            restored: false,
        }
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbb";

    #[test]
    fn converged_state_needs_nothing() {
        let desired = [row(A, SandboxState::Running, 0)];
        let observed = [status(A, Phase::Running)];
        assert!(reconcile(&desired, &observed, 1_000_000, 60_000).is_empty());
        assert!(reconcile(&[], &[], 0, 0).is_empty());
        // A stopped row whose node sandbox is stopped is converged too.
        let desired = [row(A, SandboxState::Stopped, 0)];
        let observed = [status(A, Phase::Stopped)];
        assert!(reconcile(&desired, &observed, 0, 0).is_empty());
    }

    #[test]
    fn each_divergence_yields_its_step() {
        let mut deleting = row(A, SandboxState::Deleting, 0);
        deleting.deleted_at = Some(5);
        let cases: Vec<(Vec<SandboxRow>, Vec<SandboxStatus>, Vec<Step>)> = vec![
            (
                vec![deleting.clone()],
                vec![status(A, Phase::Running)],
                vec![Step::FinalizeDelete { id: A.into() }],
            ),
            (
                vec![deleting],
                vec![],
                vec![Step::FinalizeDelete { id: A.into() }],
            ),
            (
                vec![row(A, SandboxState::Running, 0)],
                vec![status(A, Phase::Stopped)],
                vec![Step::MarkStopped { id: A.into() }],
            ),
            (
                vec![row(A, SandboxState::Running, 0)],
                vec![],
                vec![Step::MarkLost { id: A.into() }],
            ),
            // A sandbox marked lost (its node was lost, no replica) is found on its node again;
            // while it is not seen, nothing is done to it (nothing recreated).
            (
                vec![row(A, SandboxState::Lost, 0)],
                vec![status(A, Phase::Running)],
                vec![Step::Found { id: A.into() }],
            ),
            (vec![row(A, SandboxState::Lost, 0)], vec![], vec![]),
            (
                vec![row(A, SandboxState::Stopped, 0)],
                vec![],
                vec![Step::MarkLost { id: A.into() }],
            ),
            (
                vec![],
                vec![status(B, Phase::Running)],
                vec![Step::RemoveOrphan { id: B.into() }],
            ),
            (
                vec![row(A, SandboxState::Failed, 0)],
                vec![status(A, Phase::Stopped)],
                vec![Step::CleanupFailed { id: A.into() }],
            ),
            (vec![row(A, SandboxState::Failed, 0)], vec![], vec![]),
            // A paused sandbox is alive: nothing to do while the node agrees.
            (
                vec![row(A, SandboxState::Paused, 0)],
                vec![status(A, Phase::Paused)],
                vec![],
            ),
            (
                vec![row(A, SandboxState::Paused, 0)],
                vec![status(A, Phase::Stopped)],
                vec![Step::MarkStopped { id: A.into() }],
            ),
            (
                vec![row(A, SandboxState::Paused, 0)],
                vec![],
                vec![Step::MarkLost { id: A.into() }],
            ),
            (
                vec![row(A, SandboxState::Paused, 0)],
                vec![status(A, Phase::Running)],
                vec![Step::SyncFreeze { id: A.into() }],
            ),
            (
                vec![row(A, SandboxState::Running, 0)],
                vec![status(A, Phase::Paused)],
                vec![Step::SyncFreeze { id: A.into() }],
            ),
        ];
        for (desired, observed, want) in cases {
            assert_eq!(
                reconcile(&desired, &observed, 1_000, 60_000),
                want,
                "{desired:?} {observed:?}"
            );
        }
    }

    #[test]
    fn creating_rows_wait_for_the_grace_period() {
        let desired = [row(A, SandboxState::Creating, 1_000)];
        assert!(reconcile(&desired, &[], 2_000, 60_000).is_empty());
        assert_eq!(
            reconcile(&desired, &[], 62_000, 60_000),
            vec![Step::ResumeCreate { id: A.into() }]
        );
    }

    #[test]
    fn steps_are_independent_per_sandbox() {
        let desired = [
            row(A, SandboxState::Running, 0),
            row(B, SandboxState::Running, 0),
        ];
        let observed = [
            status(A, Phase::Stopped),
            status("c".repeat(20).as_str(), Phase::Running),
        ];
        let mut steps = reconcile(&desired, &observed, 0, 60_000);
        steps.sort();
        assert_eq!(
            steps,
            vec![
                Step::MarkStopped { id: A.into() },
                Step::MarkLost { id: B.into() },
                Step::RemoveOrphan { id: "c".repeat(20) },
            ]
        );
    }

    #[test]
    fn error_policy_backs_off_exponentially_with_a_cap() {
        let e = ControlError::internal("x");
        assert_eq!(error_policy(&e, 1), Duration::from_secs(1));
        assert_eq!(error_policy(&e, 2), Duration::from_secs(2));
        assert_eq!(error_policy(&e, 3), Duration::from_secs(4));
        assert_eq!(error_policy(&e, 100), Duration::from_secs(60));
        let u = ControlError::unavailable("x");
        assert_eq!(error_policy(&u, 1), Duration::from_millis(500));

        let mut b = Backoff::default();
        let now = Instant::now();
        assert!(b.ready(A, now));
        b.failed(A, &e, now);
        assert!(!b.ready(A, now));
        assert!(b.ready(A, now + Duration::from_secs(1)));
        assert!(b.ready(B, now));
        b.succeeded(A);
        assert!(b.ready(A, now));
    }
}
