//! Crash recovery (decision 0009). A sandbox whose init died (crash, OOM kill, host reboot)
//! is restarted by the reconciler from its newest snapshot, or on its current rootfs when it
//! has none, with backoff; after [`RESTART_LIMIT`] restarts within [`RESTART_WINDOW_MS`] it
//! is marked `stopped` instead (crash loop; its files and snapshots are kept). Every attempt is an event (`recovered`,
//! `recover_failed`, `crash_loop`).

use std::collections::HashMap;
use std::sync::Mutex;

use space_api::SandboxState;
use space_node_api::Phase;

use crate::engine::{Engine, node_spec};
use crate::error::{ControlError, ControlResult};
use crate::store::{SandboxRow, now_ms};

/// Restarts allowed within [`RESTART_WINDOW_MS`] before the sandbox is marked failed.
pub const RESTART_LIMIT: usize = 5;
pub const RESTART_WINDOW_MS: i64 = 10 * 60 * 1000;
/// Wait before the n-th restart in the window: 1 s << (n - 2) for n >= 2, at most this.
pub const MAX_RESTART_DELAY_MS: i64 = 30_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Restart now.
    Restart,
    /// Too soon after the previous restart: look again on a later pass.
    Wait,
    /// Too many restarts in the window: give up.
    GiveUp,
}

/// What to do with a dead sandbox, given the times (unix ms) of its earlier restarts.
pub fn decide(history: &[i64], now: i64) -> Decision {
    let recent: Vec<i64> = history
        .iter()
        .copied()
        .filter(|t| now - t < RESTART_WINDOW_MS)
        .collect();
    if recent.len() >= RESTART_LIMIT {
        return Decision::GiveUp;
    }
    match recent.iter().max() {
        None => Decision::Restart,
        Some(last) => {
            let delay = (1000_i64 << (recent.len() - 1).min(10)).min(MAX_RESTART_DELAY_MS);
            if now - last >= delay {
                Decision::Restart
            } else {
                Decision::Wait
            }
        }
    }
}

/// Restart history per sandbox (in memory: a spaced restart starts every sandbox afresh).
#[derive(Debug, Default)]
pub struct Restarts {
    inner: Mutex<HashMap<String, Vec<i64>>>,
}

impl Restarts {
    fn decide(&self, id: &str, now: i64) -> (Decision, usize) {
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let h = map.get(id).map(Vec::as_slice).unwrap_or(&[]);
        (decide(h, now), h.len())
    }

    pub(crate) fn note(&self, id: &str, now: i64) {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let h = map.entry(id.to_string()).or_default();
        h.retain(|t| now - t < RESTART_WINDOW_MS);
        h.push(now);
    }

    pub fn forget(&self, id: &str) {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

impl Engine {
    /// Step `MarkStopped`: the row says running (or paused) but the init is gone. Restart it
    /// (see the module docs). Idempotent: re-checks the node first.
    pub(crate) async fn ensure_recovered(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) =
            row.filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Paused))
        else {
            return Ok(());
        };
        let id = row.id.as_str();
        match self.node.sandbox_status(id).await? {
            Some(s) if s.phase == Phase::Stopped => {}
            _ => return Ok(()),
        }
        let now = now_ms();
        let (decision, count) = self.restarts.decide(id, now);
        match decision {
            Decision::Wait => return Ok(()),
            Decision::GiveUp => {
                let msg = format!(
                    "crash loop: init died after {count} restarts within {} s",
                    RESTART_WINDOW_MS / 1000
                );
                self.node.stop_sandbox(id).await?;
                self.event(id, "crash_loop", "ok", &msg);
                self.restarts.forget(id);
                // Stopped, not failed: a failed sandbox is cleaned up on the node, and a
                // crash-looping one still holds the user's files and snapshots. It can be
                // rolled back (or removed) by its owner.
                return self
                    .write_status(id, SandboxState::Stopped, Some(&msg))
                    .await;
            }
            Decision::Restart => {}
        }
        self.restarts.note(id, now);
        let started = std::time::Instant::now();
        let newest = self.store.list_snapshots(id).await?.pop();
        let spec = node_spec(id, &row.spec);
        let result = match &newest {
            Some(snap) => self.node.rollback_sandbox(&spec, &snap.id).await,
            None => self.node.create_sandbox(&spec).await,
        };
        let from = match &newest {
            Some(snap) => format!("snapshot={}", snap.id),
            None => "rootfs (no snapshot)".to_string(),
        };
        match result {
            Ok(_) => {
                if let Some(snap) = &newest {
                    self.store.set_snapshot_head(id, &snap.id).await?;
                }
                self.write_status(id, SandboxState::Running, None).await?;
                if let Some(snap) = &newest {
                    self.restart_checkpoint_processes(id, &snap.id, false).await;
                }
                let ms = started.elapsed().as_millis();
                tracing::info!(
                    sandbox = id,
                    from,
                    ms,
                    "sandbox recovered after its init died"
                );
                self.event(
                    id,
                    "recovered",
                    "ok",
                    &format!("init died; restarted from {from} in {ms} ms"),
                );
                Ok(())
            }
            Err(e) => {
                let err = ControlError::from(e);
                self.event(
                    id,
                    "recover_failed",
                    err.code(),
                    &format!("restart from {from}: {}", err.message),
                );
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_restart_is_immediate_then_backs_off_then_gives_up() {
        assert_eq!(decide(&[], 0), Decision::Restart);
        let t0 = 1_000_000;
        assert_eq!(decide(&[t0], t0 + 500), Decision::Wait);
        assert_eq!(decide(&[t0], t0 + 1000), Decision::Restart);
        assert_eq!(decide(&[t0, t0 + 1000], t0 + 2000), Decision::Wait);
        assert_eq!(decide(&[t0, t0 + 1000], t0 + 3000), Decision::Restart);
        let five = [t0, t0 + 1, t0 + 2, t0 + 3, t0 + 4];
        assert_eq!(decide(&five, t0 + 60_000), Decision::GiveUp);
        // Restarts older than the window are forgiven.
        assert_eq!(
            decide(&five, t0 + RESTART_WINDOW_MS + 10),
            Decision::Restart
        );
        // The fifth restart waits 8 s after the fourth.
        let four = [t0, t0 + 1, t0 + 2, t0 + 3];
        assert_eq!(decide(&four, t0 + 3 + 7_000), Decision::Wait);
        assert_eq!(decide(&four, t0 + 3 + 8_000), Decision::Restart);
    }
}
