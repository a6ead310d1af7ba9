//! Nodes and the cluster as the API shows them (issue 14): `GET /v1/nodes` and
//! `GET /v1/cluster`. An all-in-one spaced has one node, itself.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One node: what it has, what it holds, and what its sandboxes' limits claim of it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// The node's id in the cluster (a node that joined with a token); none for the
    /// in-process node of an all-in-one spaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Where the control plane reaches its service (HOST:PORT), for a node that joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The node's host name.
    pub name: String,
    /// `ready` (it answers), `draining` (it answers; nothing new is placed on it) or
    /// `unreachable` (it did not answer just now).
    pub state: String,
    /// The runtimes it offers (`namespace`, `microvm`).
    pub runtimes: Vec<String>,
    pub cpus: u32,
    pub memory_bytes: u64,
    pub memory_available_bytes: u64,
    /// Sandboxes it holds for users (warm pools' ready ones not counted).
    pub sandboxes: u32,
    /// Ready sandboxes in its warm pools.
    pub pool_ready: u32,
    /// The CPU limits of its creating, running and paused sandboxes, summed (cores).
    pub allocated_cpu: f64,
    /// Their memory limits, summed.
    pub allocated_memory_mib: u64,
}

/// `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeList {
    pub nodes: Vec<Node>,
}

/// `GET /v1/cluster`: the nodes summed, and the sandboxes by state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterStatus {
    pub nodes: u32,
    pub nodes_ready: u32,
    pub cpus: u32,
    pub memory_bytes: u64,
    pub memory_available_bytes: u64,
    pub allocated_cpu: f64,
    pub allocated_memory_mib: u64,
    pub pool_ready: u32,
    /// Every sandbox the store holds, counted by state (`running`, `paused`, ...).
    pub sandboxes: BTreeMap<String, u32>,
}

/// `POST /v1/nodes/tokens`: how long the token is good for (default 3600 s, at most a day).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateJoinToken {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
}

/// A one-time join token and the command that uses it on the new node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinToken {
    pub token: String,
    /// RFC 3339.
    pub expires_at: String,
    /// `spaced node --control ... --join-token ...`, with ADDRESS for the node's own address.
    pub join_command: String,
}

/// `POST /v1/sandboxes/{id}/migrate`: where to (a node id); the scheduler picks when absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// What a move did (decision 0035).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Migration {
    pub sandbox_id: String,
    /// The node it left and the node it is on now.
    pub from: String,
    pub to: String,
    /// From the start of the move to its end.
    pub total_ms: u64,
    /// How long the sandbox did not run: from its pause on the old node until it ran on the
    /// new one (0 for a stopped sandbox).
    pub downtime_ms: u64,
    /// Bytes sent while it ran (its snapshots and a copy of its disk), then while it was
    /// paused (what changed meanwhile).
    pub base_bytes: u64,
    pub final_bytes: u64,
    /// The snapshots the new node held already as the sandbox's replica: not sent again, the
    /// rest incremental against them (decision 0056).
    #[serde(default)]
    pub reused_snapshots: Vec<String>,
    /// Its processes started again on the new node (a namespace sandbox's cannot move with
    /// it; the template's start command runs again).
    pub processes_restarted: bool,
    /// The sandbox as it is now.
    pub sandbox: crate::Sandbox,
}

/// `POST /v1/nodes/{id}/drain` (and `DELETE`, which ends a drain): whether the node is drained
/// now, and the sandboxes still on it (`space node drain` moves each with
/// `POST /v1/sandboxes/{id}/migrate`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    pub node_id: String,
    pub draining: bool,
    pub sandboxes: Vec<String>,
}
