//! `space migrate`: a sandbox moves to another node of the cluster (issue 14, decision 0035).
//!
//! The control replica the request reached relays the move: it asks the source node for the
//! sandbox's storage as a stream and hands the stream, as it comes, to the target node. Both
//! legs are the nodes' mTLS channels; nodes never connect to each other.
//!
//! 1. **Base**, while the sandbox runs: its snapshots, then a copy of its disk.
//! 2. The sandbox is paused on the source (downtime starts).
//! 3. **Final**: what changed on its disk since the base.
//! 4. The target adopts it, its claim moves there (the point of no return), and it starts
//!    there (downtime ends). The source forgets it.
//!
//! A failure before the claim moves undoes the move: the target drops what it received, the
//! source drops its copies and the sandbox runs on where it was.

use std::sync::Arc;
use std::time::Instant;

use space_api::{MigrateRequest, Migration, SandboxState};
use space_node_api::moves::{MoveStep, Received};
use space_node_api::{NodeApi, NodeError, Phase, SandboxSpec};
use space_rpc::RemoteNode;

use crate::engine::{Engine, node_spec};
use crate::error::{ControlError, ControlResult};
use crate::scheduler::{Candidate, Need};

/// A node id as the cluster makes them (lowercase letters and digits; `join::random_id`).
fn valid_node_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The two ends of a move.
struct Ends {
    id: String,
    from: String,
    src: Arc<RemoteNode>,
    /// The target, as the scheduler saw it when it was chosen.
    target: Candidate,
    dst: Arc<RemoteNode>,
}

impl Ends {
    /// One step: the source's stream straight into the target. `have`: the snapshots the
    /// target holds already as the sandbox's replica, which a `Base` does not send.
    async fn step(&self, step: MoveStep, have: &[String]) -> Result<Received, NodeError> {
        let parts = self.src.send_sandbox(&self.id, step, have).await?;
        self.dst.receive_sandbox(&self.id, step, have, parts).await
    }

    /// Undoes a move that will not finish (before the claim moved). Its own errors are
    /// logged; the caller answers with the move's.
    async fn undo(&self, adopted: bool, paused_here: bool) {
        let id = self.id.as_str();
        let dropped = if adopted {
            self.dst.remove_sandbox(id).await
        } else {
            self.dst.discard_move(id).await
        };
        if let Err(e) = dropped {
            tracing::warn!(sandbox = id, node = %self.target.id, error = %e, "could not drop what a failed move left on its target");
        }
        if let Err(e) = self.src.discard_move(id).await {
            tracing::warn!(sandbox = id, node = %self.from, error = %e, "could not drop a failed move's copies on its source");
        }
        if paused_here {
            match self.src.resume_sandbox(id).await {
                Ok(_)
                | Err(NodeError::WrongPhase {
                    phase: Phase::Running,
                    ..
                }) => {}
                Err(e) => {
                    tracing::error!(sandbox = id, node = %self.from, error = %e, "could not resume a sandbox after its move failed")
                }
            }
        }
    }
}

impl Engine {
    /// `POST /v1/sandboxes/{id}/migrate`.
    pub async fn migrate_sandbox(&self, id: &str, req: MigrateRequest) -> ControlResult<Migration> {
        if !space_api::is_valid_sandbox_id(id) {
            return Err(ControlError::invalid(format!("invalid sandbox id {id:?}")));
        }
        let nodes = self.cluster_nodes.clone().ok_or_else(|| {
            ControlError::conflict(
                "this spaced runs all-in-one, with one node: there is nowhere to move a sandbox \
                 to (run `spaced control` with joined nodes; see decision 0034)",
            )
        })?;
        if let Some(to) = &req.to
            && !valid_node_id(to)
        {
            return Err(ControlError::invalid(format!("invalid node id {to:?}")));
        }
        let guard = self.locks.lock(id).await;
        let row = self.load_checked(id).await?;
        // Held for the whole move: no replica's reconciler acts on the sandbox meanwhile.
        let Some(lease) = self.leases.sandbox(id).await? else {
            return Err(ControlError::conflict(format!(
                "another control-plane replica is working on sandbox {id}; try again shortly"
            )));
        };
        let was = row.state;
        if !matches!(
            was,
            SandboxState::Running | SandboxState::Paused | SandboxState::Stopped
        ) || row.deleted_at.is_some()
        {
            return Err(ControlError::conflict(format!(
                "sandbox {id} is {was}: only a running, paused or stopped sandbox moves"
            )));
        }
        let spec = node_spec(id, &row.spec);
        let need = Need::of(&spec);
        let (from, src) = nodes.placement_of(id).await?;
        let (target, dst) = nodes
            .choose_target(id, &spec.template, &need, &from, req.to.as_deref())
            .await?;
        let ends = Ends {
            id: id.to_owned(),
            from,
            src,
            target,
            dst,
        };
        self.event(
            id,
            "migrate",
            "started",
            &format!("from node {} to node {}", ends.from, ends.target.id),
        );
        tracing::info!(sandbox = id, from = %ends.from, to = %ends.target.id, "move started");
        let started = Instant::now();
        let mut adopted = false;
        let mut paused_here = false;
        let moved = self
            .move_steps(&ends, &spec, &need, was, &mut adopted, &mut paused_here)
            .await;
        let (base, last, stopped_at) = match moved {
            Ok(v) => v,
            Err(e) => {
                ends.undo(adopted, paused_here).await;
                let e = ControlError::from(e);
                self.event(id, "migrate", "failed", &e.to_string());
                return Err(e);
            }
        };
        // The claim is on the target now: the sandbox is there, whatever happens next.
        let started_there = if was == SandboxState::Stopped {
            Ok(false)
        } else {
            self.start_moved(&ends, &spec, was).await
        };
        // A microvm came with its memory: its processes went on as they were.
        let restored = matches!(started_there, Ok(true));
        let restarted = was != SandboxState::Stopped && !restored;
        let downtime_ms = stopped_at.map_or(0, |at| at.elapsed().as_millis() as u64);
        if let Err(e) = ends.src.remove_sandbox(id).await {
            tracing::warn!(sandbox = id, node = %ends.from, error = %e, "the moved sandbox's old copy stays on its source");
            self.event(
                id,
                "migrate",
                "warning",
                &format!(
                    "its old copy could not be removed from node {}: {e}",
                    ends.from
                ),
            );
        }
        if let Err(e) = started_there {
            // Kept, stopped, on the target: `resume` starts it.
            self.write_status(id, SandboxState::Stopped, Some(&e.to_string()))
                .await?;
            self.event(
                id,
                "migrate",
                "failed",
                &format!(
                    "moved to node {}, but it did not start there: {e}",
                    ends.target.id
                ),
            );
            return Err(e.into());
        }
        let total_ms = started.elapsed().as_millis() as u64;
        self.event(
            id,
            "migrate",
            "ok",
            &format!(
                "from node {} to node {} in {total_ms} ms, down {downtime_ms} ms; {} + {} bytes \
                 sent{}{}",
                ends.from,
                ends.target.id,
                base.bytes,
                last.bytes,
                if base.snapshots.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} snapshots taken from its replica there",
                        base.snapshots.len()
                    )
                },
                if restarted {
                    "; its processes started again there"
                } else if restored {
                    "; its processes and memory came with it"
                } else {
                    ""
                }
            ),
        );
        tracing::info!(sandbox = id, from = %ends.from, to = %ends.target.id, total_ms, downtime_ms,
            base_bytes = base.bytes, final_bytes = last.bytes, "move done");
        drop(lease);
        drop(guard);
        Ok(Migration {
            sandbox_id: id.to_owned(),
            from: ends.from,
            to: ends.target.id,
            total_ms,
            downtime_ms,
            base_bytes: base.bytes,
            final_bytes: last.bytes,
            reused_snapshots: base.snapshots,
            processes_restarted: restarted,
            sandbox: self.get_sandbox(id).await?,
        })
    }

    /// Base, pause, final, adopt, claim: everything that can still be undone. Answers what
    /// each step sent and when the sandbox stopped running (none when it was not running).
    async fn move_steps(
        &self,
        ends: &Ends,
        spec: &SandboxSpec,
        need: &Need,
        was: SandboxState,
        adopted: &mut bool,
        paused_here: &mut bool,
    ) -> Result<(Received, Received, Option<Instant>), NodeError> {
        let id = ends.id.as_str();
        let nodes = self
            .cluster_nodes
            .as_ref()
            .expect("a move runs in a cluster");
        // A target without the sandbox's template gets it first (the adopt needs it).
        nodes
            .ensure_template(&ends.target.id, &ends.dst, &spec.template)
            .await?;
        // The target may hold the sandbox's replica (decision 0056): what it holds of the
        // sandbox's snapshots is not sent again, and the base is incremental against the
        // newest of them. Asked of the target itself (the answer trims the replica to the
        // sandbox's snapshots); the lease keeps replication away meanwhile.
        let snapshots: Vec<String> = self
            .store
            .list_snapshots(id)
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))?
            .into_iter()
            .map(|s| s.id)
            .collect();
        let have = if snapshots.is_empty() {
            Vec::new()
        } else {
            match ends.dst.drop_replica(id, &snapshots).await {
                Ok(have) => have,
                Err(e) => {
                    tracing::warn!(sandbox = id, node = %ends.target.id, error = %e, "could not ask the target for its replica; sending every snapshot");
                    Vec::new()
                }
            }
        };
        let mut base = ends.step(MoveStep::Base, &have).await?;
        base.snapshots = have;
        let mut stopped_at = None;
        if was == SandboxState::Running {
            stopped_at = Some(Instant::now());
            match ends.src.pause_sandbox(id).await {
                Ok(_)
                | Err(NodeError::WrongPhase {
                    phase: Phase::Paused,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
            *paused_here = true;
        }
        let t = Instant::now();
        let last = ends.step(MoveStep::Final, &[]).await?;
        let final_ms = t.elapsed().as_millis() as u64;
        ends.dst.adopt_sandbox(spec).await?;
        *adopted = true;
        tracing::info!(
            sandbox = id,
            final_ms,
            adopt_ms = t.elapsed().as_millis() as u64 - final_ms,
            "move: final step sent and adopted"
        );
        if !nodes.move_claim(id, &ends.target, need).await? {
            return Err(NodeError::Exhausted(format!(
                "node {} took other sandboxes meanwhile and has no room for {id} now",
                ends.target.id
            )));
        }
        Ok((base, last, stopped_at))
    }

    /// Starts the moved sandbox on its new node, paused again when it was paused. True when
    /// its memory came with it (a microvm restored from the move's checkpoint).
    async fn start_moved(
        &self,
        ends: &Ends,
        spec: &SandboxSpec,
        was: SandboxState,
    ) -> Result<bool, NodeError> {
        let status = ends.dst.create_sandbox(spec).await?;
        if was == SandboxState::Paused {
            ends.dst.pause_sandbox(&ends.id).await?;
        }
        Ok(status.restored)
    }
}
