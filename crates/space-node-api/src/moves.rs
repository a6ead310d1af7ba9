//! A sandbox's storage in transit between nodes: migration (issue 14, decision 0035).
//!
//! The source node answers [`NodeApi::send_sandbox`](crate::NodeApi::send_sandbox) with a
//! stream of [`MovePart`]s; the control plane hands that stream, as it comes, to the target
//! node's [`NodeApi::receive_sandbox`](crate::NodeApi::receive_sandbox). Two steps move a
//! sandbox: [`MoveStep::Base`] while it runs (its snapshots and a read-only copy of its disk),
//! then [`MoveStep::Final`] while it is paused (only what changed since the base). The
//! target then adopts what it received, and the source forgets the sandbox.

use std::pin::Pin;

use serde::{Deserialize, Serialize};
use tokio_stream::Stream;

use crate::NodeError;

/// Which part of a move a stream carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveStep {
    /// The sandbox's snapshots, each incremental against the one before, and a read-only
    /// copy of its disk taken now (incremental against its newest snapshot).
    Base,
    /// What changed on its disk since the base, taken while it is paused or stopped.
    Final,
}

impl MoveStep {
    pub const fn as_str(self) -> &'static str {
        match self {
            MoveStep::Base => "base",
            MoveStep::Final => "final",
        }
    }
}

/// One part of a move's stream. A `File` or `Subvolume` starts an item; the `Data` parts
/// after it are its bytes; `End` closes the stream (a stream without it was cut short).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MovePart {
    /// A file of the sandbox's record (a snapshot's `snapshot.json`), at `path` relative to
    /// the sandbox's directory.
    File {
        path: String,
    },
    /// A `btrfs send` stream, received as a read-only subvolume in directory `path`
    /// (relative to the sandbox's directory).
    Subvolume {
        path: String,
    },
    Data(bytes::Bytes),
    End,
}

/// What `send_sandbox` answers and `receive_sandbox` takes.
pub type MoveStream = Pin<Box<dyn Stream<Item = Result<MovePart, NodeError>> + Send>>;

/// What a target node received of one step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Received {
    /// Bytes of the stream (btrfs send streams and files).
    pub bytes: u64,
    /// Subvolumes received.
    pub subvolumes: u32,
    /// A replica's receive (decision 0037): every snapshot of the sandbox the replica holds
    /// whole now, oldest first. A move's base, as the control plane keeps it: the snapshots
    /// the target took from its replica instead of receiving them (decision 0056).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<String>,
}

/// Whether `path` (relative to a sandbox's directory) is somewhere a move may write: a
/// snapshot's record (`snapshots/<id>/snapshot.json`) for a file, a snapshot's directory
/// (`snapshots/<id>`) or `incoming` for a subvolume. Nothing else: a source node must not be
/// able to write anywhere else on the target.
pub fn valid_move_path(path: &str, subvolume: bool) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let snapshot_id = |s: &str| {
        (1..=64).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    match (subvolume, parts.as_slice()) {
        (true, ["incoming"]) => true,
        (true, ["snapshots", id]) => snapshot_id(id),
        (false, ["snapshots", id, "snapshot.json"]) => snapshot_id(id),
        _ => false,
    }
}

/// Whether `path` (relative to a replica's directory) is somewhere a replication may write
/// (decision 0037): a snapshot's subvolume directory or its record, as [`valid_move_path`]
/// allows them; never `incoming`, which only a move receives.
pub fn valid_replica_path(path: &str, subvolume: bool) -> bool {
    path != "incoming" && valid_move_path(path, subvolume)
}

/// Whether `path` is somewhere a template's transfer may write, relative to the version's
/// directory being received: its `template.json`, or its rootfs subvolume received in `.`.
pub fn valid_template_path(path: &str, subvolume: bool) -> bool {
    matches!((subvolume, path), (true, ".") | (false, "template.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_writes_only_where_a_sandbox_keeps_snapshots() {
        assert!(valid_move_path("incoming", true));
        assert!(valid_move_path("snapshots/abc123", true));
        assert!(valid_move_path("snapshots/abc123/snapshot.json", false));
        for bad in [
            "",
            "/",
            "/etc",
            "rootfs",
            "incoming/../..",
            "snapshots/..",
            "snapshots/../../x",
            "snapshots/ABC",
            "snapshots/a/rootfs",
            "snapshots/a/b/snapshot.json",
            "snapshots//snapshot.json",
        ] {
            assert!(!valid_move_path(bad, true), "{bad}");
            assert!(!valid_move_path(bad, false), "{bad}");
        }
        assert!(!valid_move_path("incoming", false));
        assert!(valid_template_path(".", true) && valid_template_path("template.json", false));
        for bad in ["..", "/", "rootfs", "../x", "template.json/.."] {
            assert!(!valid_template_path(bad, true) && !valid_template_path(bad, false));
        }
        assert!(!valid_move_path("snapshots/a/snapshot.json", true));
        assert!(valid_replica_path("snapshots/abc123", true));
        assert!(valid_replica_path("snapshots/abc123/snapshot.json", false));
        assert!(!valid_replica_path("incoming", true));
        assert!(!valid_replica_path("snapshots/..", true));
    }
}
