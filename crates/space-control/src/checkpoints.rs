//! Checkpoints (decision 0007): a snapshot of kind `checkpoint` is, for the namespace runtime,
//! a disk snapshot plus the sandbox's spec (every snapshot row keeps it) plus the processes
//! to restart. Memory is not kept: after a rollback, a recovery or a fork from a checkpoint
//! each recorded process is started again from scratch (guest `Start`, in the background),
//! with an event `process_restarted` per process. A microvm's checkpoint keeps its memory
//! (`memory: true`, decision 0014): its rollback or fork brings the processes back as they
//! were (event `memory_restored`), unless that restore failed and the node booted the disk.

use std::collections::HashMap;

use space_api::{CheckpointProcess, Snapshot};
use space_proto as pb;
use sqlx::Row;

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError};

/// The extra state of a checkpoint (table `checkpoints`, migration 0006).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Whether process memory was kept (never, for the namespace runtime).
    pub memory: bool,
    pub processes: Vec<CheckpointProcess>,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(id: &str, memory: i64, processes: &str) -> Result<Checkpoint, StoreError> {
    let processes = serde_json::from_str(processes).map_err(|e| StoreError::Corrupt {
        id: id.to_string(),
        reason: format!("bad checkpoint process list: {e}"),
    })?;
    Ok(Checkpoint {
        memory: memory != 0,
        processes,
    })
}

impl Store {
    pub async fn insert_checkpoint(&self, snap: &str, c: &Checkpoint) -> Result<(), StoreError> {
        let processes = serde_json::to_string(&c.processes).unwrap_or_else(|_| "[]".into());
        sqlx::query("INSERT INTO checkpoints (snapshot_id, memory, processes) VALUES ($1, $2, $3)")
            .bind(snap)
            .bind(i64::from(c.memory))
            .bind(processes)
            .execute(self.pool())
            .await
            .map_err(q("insert checkpoint"))?;
        Ok(())
    }

    pub async fn get_checkpoint(&self, snap: &str) -> Result<Option<Checkpoint>, StoreError> {
        let row = sqlx::query("SELECT memory, processes FROM checkpoints WHERE snapshot_id = $1")
            .bind(snap)
            .fetch_optional(self.pool())
            .await
            .map_err(q("get checkpoint"))?;
        let Some(r) = row else { return Ok(None) };
        let memory: i64 = r.try_get("memory").map_err(q("decode checkpoint"))?;
        let processes: String = r.try_get("processes").map_err(q("decode checkpoint"))?;
        decode(snap, memory, &processes).map(Some)
    }

    /// The checkpoints among a sandbox's snapshots, by snapshot id.
    pub async fn checkpoints_of(
        &self,
        sandbox_id: &str,
    ) -> Result<HashMap<String, Checkpoint>, StoreError> {
        let rows = sqlx::query(
            "SELECT c.snapshot_id, c.memory, c.processes FROM checkpoints c \
             JOIN snapshots s ON s.id = c.snapshot_id WHERE s.sandbox_id = $1",
        )
        .bind(sandbox_id)
        .fetch_all(self.pool())
        .await
        .map_err(q("list checkpoints"))?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in rows {
            let id: String = r.try_get("snapshot_id").map_err(q("decode checkpoint"))?;
            let memory: i64 = r.try_get("memory").map_err(q("decode checkpoint"))?;
            let processes: String = r.try_get("processes").map_err(q("decode checkpoint"))?;
            let c = decode(&id, memory, &processes)?;
            out.insert(id, c);
        }
        Ok(out)
    }

    pub async fn delete_checkpoint(&self, snap: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM checkpoints WHERE snapshot_id = $1")
            .bind(snap)
            .execute(self.pool())
            .await
            .map_err(q("delete checkpoint"))?;
        Ok(())
    }
}

/// The processes a checkpoint records: the running ones, without env (never stored).
pub fn processes_to_record(list: Vec<pb::ProcessInfo>) -> Vec<CheckpointProcess> {
    let some = |s: String| (!s.is_empty()).then_some(s);
    list.into_iter()
        .filter(|p| p.running && !p.argv.is_empty())
        .map(|p| CheckpointProcess {
            cmd: p.argv,
            cwd: some(p.cwd),
            user: some(p.user),
            tty: p.tty,
            tag: some(p.tag),
        })
        .collect()
}

/// The guest request that starts a recorded process again.
pub fn restart_request(p: &CheckpointProcess) -> pb::ExecRequest {
    pb::ExecRequest {
        argv: p.cmd.clone(),
        cwd: p.cwd.clone().unwrap_or_default(),
        user: p.user.clone().unwrap_or_default(),
        tty: p.tty,
        rows: if p.tty { 24 } else { 0 },
        cols: if p.tty { 80 } else { 0 },
        tag: p.tag.clone().unwrap_or_default(),
        ..Default::default()
    }
}

/// Fills a snapshot DTO's checkpoint fields.
pub fn decorate(s: &mut Snapshot, c: &Checkpoint) {
    s.processes = Some(c.processes.clone());
    s.memory = c.memory;
}

impl Engine {
    /// What a checkpoint of a running sandbox keeps besides the disk: its running processes
    /// (asked of the guest before the freeze). Memory is not kept by the namespace runtime.
    pub(crate) async fn checkpoint_state(&self, id: &str) -> ControlResult<Checkpoint> {
        let mut guest = self.node.guest(id).await?;
        let reply = guest
            .list_processes(pb::ListProcessesRequest {})
            .await
            .map_err(ControlError::from)?
            .into_inner();
        Ok(Checkpoint {
            memory: false,
            processes: processes_to_record(reply.processes),
        })
    }

    /// After sandbox `id` came up again from snapshot `snap`: when it is a checkpoint, starts
    /// its recorded processes again, each fresh, and records `process_restarted` per process
    /// (detail: argv[0] only). Failures are events, never errors of the caller. Not when the
    /// node brought the checkpoint's memory back (`restored`): the processes never stopped.
    pub(crate) async fn restart_checkpoint_processes(&self, id: &str, snap: &str, restored: bool) {
        let checkpoint = match self.store.get_checkpoint(snap).await {
            Ok(Some(c)) if c.memory && restored => {
                self.event(id, "memory_restored", "ok", snap);
                return;
            }
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(sandbox = id, snapshot = snap, error = %e, "load checkpoint");
                self.event(id, "process_restarted", "error", "checkpoint unreadable");
                return;
            }
        };
        if checkpoint.processes.is_empty() {
            return;
        }
        let mut guest = match self.node.guest(id).await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(sandbox = id, error = %e, "guest for checkpoint restart");
                for p in &checkpoint.processes {
                    self.event(
                        id,
                        "process_restarted",
                        "error",
                        &format!("{}: {e}", p.cmd[0]),
                    );
                }
                return;
            }
        };
        for p in &checkpoint.processes {
            let argv0 = p.cmd.first().map(String::as_str).unwrap_or("");
            match guest.start(restart_request(p)).await {
                Ok(_) => self.event(id, "process_restarted", "ok", argv0),
                Err(s) => {
                    tracing::warn!(sandbox = id, argv0, error = %s.message(), "checkpoint restart");
                    self.event(
                        id,
                        "process_restarted",
                        "error",
                        &format!("{argv0}: {}", s.message()),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_running_processes_without_env() {
        let list = vec![
            pb::ProcessInfo {
                pid: 1,
                argv: vec!["sh".into(), "-c".into(), "loop".into()],
                tag: "ticker".into(),
                running: true,
                cwd: "/root".into(),
                user: "root".into(),
                ..Default::default()
            },
            pb::ProcessInfo {
                pid: 2,
                argv: vec!["true".into()],
                running: false,
                ..Default::default()
            },
        ];
        let got = processes_to_record(list);
        assert_eq!(
            got,
            vec![CheckpointProcess {
                cmd: vec!["sh".into(), "-c".into(), "loop".into()],
                cwd: Some("/root".into()),
                user: Some("root".into()),
                tty: false,
                tag: Some("ticker".into()),
            }]
        );
        let r = restart_request(&got[0]);
        assert_eq!(r.argv, got[0].cmd);
        assert_eq!(r.tag, "ticker");
        assert!(r.env.is_empty());
    }

    #[tokio::test]
    async fn stored_and_listed_per_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let c = Checkpoint {
            memory: false,
            processes: vec![CheckpointProcess {
                cmd: vec!["sleep".into(), "9".into()],
                ..Default::default()
            }],
        };
        store.insert_checkpoint("snap1", &c).await.unwrap();
        assert_eq!(store.get_checkpoint("snap1").await.unwrap(), Some(c));
        assert_eq!(store.get_checkpoint("other").await.unwrap(), None);
        store.delete_checkpoint("snap1").await.unwrap();
        assert_eq!(store.get_checkpoint("snap1").await.unwrap(), None);
    }
}
