//! Snapshot, rollback and fork DTOs (`/v1/sandboxes/{id}/snapshots`, `.../rollback`,
//! `.../fork`).

use serde::{Deserialize, Serialize};

/// Most sandboxes one fork call may create.
pub const MAX_FORK_COUNT: u32 = 16;

/// What a snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    /// The sandbox's filesystem only (an atomic read-only btrfs snapshot).
    Disk,
    /// Disk plus process state. namespace: the disk plus the sandbox's spec and the
    /// processes to restart (memory is not kept: they restart from scratch); microvm (later):
    /// memory and devices too (`Snapshot::memory`).
    Checkpoint,
}

impl SnapshotKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotKind::Disk => "disk",
            SnapshotKind::Checkpoint => "checkpoint",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "disk" => Some(SnapshotKind::Disk),
            "checkpoint" => Some(SnapshotKind::Checkpoint),
            _ => None,
        }
    }
}

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Default `disk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<SnapshotKind>,
}

/// A process a checkpoint restarts (a fresh process: its memory is not kept). Never env
/// values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointProcess {
    /// argv.
    pub cmd: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tty: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// 20 characters of [a-z0-9], like sandbox ids.
    pub id: String,
    pub sandbox_id: String,
    /// The snapshot this one descends from: the sandbox's previous snapshot (or the one it
    /// was rolled back to), or for a fork's first snapshot the one it was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// Bytes the snapshot's files reference (shared extents counted in full), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    pub kind: SnapshotKind,
    /// Taken by the sandbox's snapshot policy (never labelled), not through the API.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto: bool,
    /// Checkpoints: the processes restarted after a rollback, recovery or fork from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<Vec<CheckpointProcess>>,
    /// Whether process memory was kept (microvm checkpoints, later). Always false for the
    /// namespace runtime: its checkpoints restart processes from scratch.
    #[serde(default)]
    pub memory: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
    /// The snapshot the sandbox's files descend from now: its newest snapshot, or the one it
    /// was last rolled back to (the parent of its next snapshot). None: it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<String>,
    /// The live sandboxes forked from its snapshots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forks: Vec<ForkOf>,
}

/// A sandbox forked from a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkOf {
    /// The fork.
    pub sandbox: String,
    /// The snapshot it was forked from.
    pub snapshot: String,
}

/// `POST /v1/sandboxes/{id}/rollback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    pub snapshot: String,
}

/// `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Fork from this snapshot of the sandbox; without it the live state is snapshotted
    /// first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// How many sandboxes to create (1..=16, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// Answer of `POST /v1/sandboxes/{id}/fork` (the new sandboxes, in creation order).
pub use crate::types::SandboxList as ForkResult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_json_shape() {
        let s = Snapshot {
            id: "a".repeat(20),
            sandbox_id: "b".repeat(20),
            parent_id: None,
            label: Some("x".into()),
            created_at: "2026-01-01T00:00:00Z".into(),
            size_bytes: None,
            kind: SnapshotKind::Disk,
            auto: false,
            processes: None,
            memory: false,
        };
        let v = serde_json::to_value(&s).unwrap();
        assert!(v.get("auto").is_none());
        assert_eq!(v["kind"], "disk");
        assert!(v.get("parent_id").is_none());
        assert_eq!(serde_json::from_value::<Snapshot>(v).unwrap(), s);
        assert!(serde_json::from_str::<ForkRequest>(r#"{"count":2,"x":1}"#).is_err());
        assert_eq!(
            SnapshotKind::parse("checkpoint"),
            Some(SnapshotKind::Checkpoint)
        );
        assert_eq!(SnapshotKind::parse("mem"), None);
        let c: CreateSnapshot = serde_json::from_str(r#"{"kind":"checkpoint"}"#).unwrap();
        assert_eq!(c.kind, Some(SnapshotKind::Checkpoint));
        assert!(serde_json::from_str::<CreateSnapshot>(r#"{"kind":"memory"}"#).is_err());
    }
}
