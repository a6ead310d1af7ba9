//! What travels in `space.node.v1.Node`'s messages: the operations of the node contract with
//! their arguments, template sources, and the contract's errors (decision 0032). JSON of the
//! contract's own types, so that this file is the only second description of them.

use serde::{Deserialize, Serialize};
use space_node_api::moves::{MovePart, MoveStep};
use space_node_api::net::NetworkSpec;
use space_node_api::{NodeError, Phase, PoolConfig, PullSpec, SandboxSpec, TemplateDefaults};
use space_proto::node as proto;

/// One operation of [`space_node_api::NodeApi`], as [`crate::client::RemoteNode`] sends it in
/// `CallRequest.request`. Streams (ports, imports, guest calls) have RPCs of their own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    CreateSandbox {
        spec: SandboxSpec,
    },
    RemoveSandbox {
        id: String,
    },
    StopSandbox {
        id: String,
    },
    SandboxStatus {
        id: String,
    },
    ListSandboxes,
    ListTemplates,
    TemplateVersions {
        name: String,
    },
    RemoveTemplate {
        name: String,
        version: Option<u32>,
    },
    PauseSandbox {
        id: String,
    },
    ResumeSandbox {
        id: String,
    },
    ValidateNetwork {
        network: NetworkSpec,
    },
    SetNetwork {
        id: String,
        network: NetworkSpec,
    },
    SnapshotSandbox {
        id: String,
        snap: String,
    },
    CheckpointSandbox {
        id: String,
        snap: String,
    },
    ListSnapshots {
        id: String,
        with_size: bool,
    },
    DiffSandbox {
        id: String,
        from: Option<String>,
        to: Option<String>,
    },
    DeleteSnapshot {
        id: String,
        snap: String,
    },
    ChangedSinceSnapshot {
        id: String,
        owner: String,
        snap: String,
    },
    RollbackSandbox {
        spec: SandboxSpec,
        snap: String,
    },
    ForkSandbox {
        source: String,
        snap: String,
        spec: SandboxSpec,
    },
    Metrics,
    SetPool {
        template: String,
        cfg: PoolConfig,
    },
    Pools,
    NodeInfo,
    SandboxUsage {
        id: String,
    },
    AdoptSandbox {
        spec: SandboxSpec,
    },
    DiscardMove {
        id: String,
    },
    DropReplica {
        id: String,
        keep: Vec<String>,
    },
    RestoreReplica {
        spec: SandboxSpec,
        snap: String,
    },
}

impl Op {
    /// Whether the operation changes the node: those carry an operation id, and a node that
    /// sees the id again answers from its memory of the first time.
    pub fn mutates(&self) -> bool {
        !matches!(
            self,
            Op::SandboxStatus { .. }
                | Op::ListSandboxes
                | Op::ListTemplates
                | Op::TemplateVersions { .. }
                | Op::ValidateNetwork { .. }
                | Op::ListSnapshots { .. }
                | Op::DiffSandbox { .. }
                | Op::ChangedSinceSnapshot { .. }
                | Op::Metrics
                | Op::Pools
                | Op::NodeInfo
                | Op::SandboxUsage { .. }
        )
    }

    /// The operation's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::CreateSandbox { .. } => "create_sandbox",
            Op::RemoveSandbox { .. } => "remove_sandbox",
            Op::StopSandbox { .. } => "stop_sandbox",
            Op::SandboxStatus { .. } => "sandbox_status",
            Op::ListSandboxes => "list_sandboxes",
            Op::ListTemplates => "list_templates",
            Op::TemplateVersions { .. } => "template_versions",
            Op::RemoveTemplate { .. } => "remove_template",
            Op::PauseSandbox { .. } => "pause_sandbox",
            Op::ResumeSandbox { .. } => "resume_sandbox",
            Op::ValidateNetwork { .. } => "validate_network",
            Op::SetNetwork { .. } => "set_network",
            Op::SnapshotSandbox { .. } => "snapshot_sandbox",
            Op::CheckpointSandbox { .. } => "checkpoint_sandbox",
            Op::ListSnapshots { .. } => "list_snapshots",
            Op::DiffSandbox { .. } => "diff_sandbox",
            Op::DeleteSnapshot { .. } => "delete_snapshot",
            Op::ChangedSinceSnapshot { .. } => "changed_since_snapshot",
            Op::RollbackSandbox { .. } => "rollback_sandbox",
            Op::ForkSandbox { .. } => "fork_sandbox",
            Op::Metrics => "metrics",
            Op::SetPool { .. } => "set_pool",
            Op::Pools => "pools",
            Op::NodeInfo => "node_info",
            Op::SandboxUsage { .. } => "sandbox_usage",
            Op::AdoptSandbox { .. } => "adopt_sandbox",
            Op::DiscardMove { .. } => "discard_move",
            Op::DropReplica { .. } => "drop_replica",
            Op::RestoreReplica { .. } => "restore_replica",
        }
    }
}

/// The first message of an `ImportTemplate` stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportHeader {
    pub name: String,
    pub source: Source,
}

/// [`space_node_api::TemplateSource`] without node paths: an archive is uploaded in the
/// stream instead. A directory on the caller's machine is not a source a remote node can
/// read (the caller sends a tar of it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// The archive follows in the stream's `data` chunks.
    Upload,
    Snapshot {
        sandbox: String,
        snapshot: String,
        defaults: Option<TemplateDefaults>,
    },
    Registry {
        reference: String,
        username: Option<String>,
        password: Option<String>,
        insecure: bool,
    },
    Derived {
        from: String,
        defaults: TemplateDefaults,
    },
}

impl Source {
    pub fn registry(p: PullSpec) -> Self {
        Source::Registry {
            reference: p.reference,
            username: p.username,
            password: p.password,
            insecure: p.insecure,
        }
    }
}

/// A [`NodeError`] on the wire: in a `tonic::Status`'s details, its code the nearest gRPC one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum WireError {
    NotFound { kind: String, id: String },
    InvalidArgument { message: String },
    Conflict { message: String },
    WrongPhase { id: String, phase: Phase },
    Exhausted { message: String },
    Unavailable { id: String, reason: String },
    NotReady { id: String, reason: String },
    Unreachable { node: String, reason: String },
    Internal { message: String },
}

impl From<&NodeError> for WireError {
    fn from(e: &NodeError) -> Self {
        match e {
            NodeError::NotFound { kind, id } => WireError::NotFound {
                kind: (*kind).to_owned(),
                id: id.clone(),
            },
            NodeError::InvalidArgument(m) => WireError::InvalidArgument { message: m.clone() },
            NodeError::Conflict(m) => WireError::Conflict { message: m.clone() },
            NodeError::WrongPhase { id, phase } => WireError::WrongPhase {
                id: id.clone(),
                phase: *phase,
            },
            NodeError::Exhausted(m) => WireError::Exhausted { message: m.clone() },
            NodeError::Unavailable { id, reason } => WireError::Unavailable {
                id: id.clone(),
                reason: reason.clone(),
            },
            NodeError::NotReady { id, reason } => WireError::NotReady {
                id: id.clone(),
                reason: reason.clone(),
            },
            NodeError::Unreachable { node, reason } => WireError::Unreachable {
                node: node.clone(),
                reason: reason.clone(),
            },
            NodeError::Internal(m) => WireError::Internal { message: m.clone() },
        }
    }
}

/// The kinds of thing a node reports missing ([`NodeError::NotFound`] holds a `&'static
/// str`); another word from a newer node reads as "object".
fn static_kind(kind: &str) -> &'static str {
    const KINDS: [&str; 7] = [
        "sandbox",
        "template",
        "template version",
        "snapshot",
        "image",
        "process",
        "pool",
    ];
    KINDS.into_iter().find(|k| *k == kind).unwrap_or("object")
}

impl From<WireError> for NodeError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::NotFound { kind, id } => NodeError::NotFound {
                kind: static_kind(&kind),
                id,
            },
            WireError::InvalidArgument { message } => NodeError::InvalidArgument(message),
            WireError::Conflict { message } => NodeError::Conflict(message),
            WireError::WrongPhase { id, phase } => NodeError::WrongPhase { id, phase },
            WireError::Exhausted { message } => NodeError::Exhausted(message),
            WireError::Unavailable { id, reason } => NodeError::Unavailable { id, reason },
            WireError::NotReady { id, reason } => NodeError::NotReady { id, reason },
            WireError::Unreachable { node, reason } => NodeError::Unreachable { node, reason },
            WireError::Internal { message } => NodeError::Internal(message),
        }
    }
}

/// The status a node answers a failed operation with.
pub fn status(e: &NodeError) -> tonic::Status {
    use tonic::Code;
    let code = match e {
        NodeError::NotFound { .. } => Code::NotFound,
        NodeError::InvalidArgument(_) => Code::InvalidArgument,
        NodeError::Conflict(_) | NodeError::WrongPhase { .. } => Code::FailedPrecondition,
        NodeError::Exhausted(_) => Code::ResourceExhausted,
        NodeError::Unavailable { .. }
        | NodeError::NotReady { .. }
        | NodeError::Unreachable { .. } => Code::Unavailable,
        NodeError::Internal(_) => Code::Internal,
    };
    let details = serde_json::to_vec(&WireError::from(e)).unwrap_or_default();
    tonic::Status::with_details(code, e.to_string(), details.into())
}

/// The node's own error in a status, when it sent one.
pub fn node_error_in(s: &tonic::Status) -> Option<NodeError> {
    serde_json::from_slice::<WireError>(s.details())
        .ok()
        .map(NodeError::from)
}

/// A status as text with its causes: tonic's summary of a transport failure ("transport
/// error") followed by what it summarizes ("… Connection refused"), each cause once.
pub fn status_text(s: &tonic::Status) -> String {
    let mut text = s.message().to_owned();
    let mut cause = std::error::Error::source(s);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text = format!("{text}: {c_text}");
        }
        cause = c.source();
    }
    text
}

/// The [`NodeError`] a status from `node` stands for: the node's own error when it sent one,
/// else (a transport failure, a proxy between) Unreachable naming the node and the failure's
/// causes ([`status_text`]).
pub fn node_error(node: &str, s: &tonic::Status) -> NodeError {
    node_error_in(s).unwrap_or_else(|| NodeError::Unreachable {
        node: node.to_owned(),
        reason: status_text(s),
    })
}

/// A move's step by its name on the wire.
pub fn move_step(name: &str) -> Result<MoveStep, NodeError> {
    match name {
        "base" => Ok(MoveStep::Base),
        "final" => Ok(MoveStep::Final),
        other => Err(NodeError::InvalidArgument(format!(
            "no move step {other:?} (base or final)"
        ))),
    }
}

/// A move's part as a message.
pub fn move_message(part: MovePart) -> proto::MovePart {
    use proto::move_part::Part;
    let part = match part {
        MovePart::File { path } => Part::File(path),
        MovePart::Subvolume { path } => Part::Subvolume(path),
        MovePart::Data(d) => Part::Data(d.to_vec()),
        MovePart::End => Part::End(true),
    };
    proto::MovePart { part: Some(part) }
}

/// A message of a move's stream as its part (a header there is out of place).
pub fn move_part(m: proto::MovePart) -> Result<MovePart, NodeError> {
    use proto::move_part::Part;
    match m.part {
        Some(Part::File(path)) => Ok(MovePart::File { path }),
        Some(Part::Subvolume(path)) => Ok(MovePart::Subvolume { path }),
        Some(Part::Data(d)) => Ok(MovePart::Data(d.into())),
        Some(Part::End(_)) => Ok(MovePart::End),
        Some(Part::Header(_)) | None => Err(NodeError::InvalidArgument(
            "a move's stream holds a message that is not one of its parts".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_cross_the_wire_whole() {
        let all = [
            NodeError::NotFound {
                kind: "template version",
                id: "base@3".into(),
            },
            NodeError::InvalidArgument("bad rule \"x\"".into()),
            NodeError::Conflict("in use".into()),
            NodeError::WrongPhase {
                id: "s1".into(),
                phase: Phase::Paused,
            },
            NodeError::Exhausted("no uid range".into()),
            NodeError::Unavailable {
                id: "s1".into(),
                reason: "gone".into(),
            },
            NodeError::NotReady {
                id: "s1".into(),
                reason: "ready command failed".into(),
            },
            NodeError::Unreachable {
                node: "n2".into(),
                reason: "refused".into(),
            },
            NodeError::Internal("disk".into()),
        ];
        for e in all {
            let back = node_error("n1", &status(&e));
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.code(), e.code());
            assert_eq!(
                std::mem::discriminant(&back),
                std::mem::discriminant(&e),
                "{e}"
            );
        }
        // A status without details (a transport failure) names the node.
        let e = node_error("n1", &tonic::Status::unavailable("connection refused"));
        assert!(
            matches!(&e, NodeError::Unreachable { node, .. } if node == "n1"),
            "{e}"
        );
        assert_eq!(e.to_string(), "node n1 is unreachable: connection refused");
        // A newer node's kind of thing reads as "object".
        let w = WireError::NotFound {
            kind: "volume".into(),
            id: "v".into(),
        };
        assert_eq!(NodeError::from(w).to_string(), "object v not found");
    }

    #[test]
    fn ops_name_themselves_and_reads_carry_no_operation_id() {
        let op: Op = serde_json::from_str(r#"{"op":"remove_sandbox","id":"abc"}"#).unwrap();
        assert_eq!(op, Op::RemoveSandbox { id: "abc".into() });
        assert_eq!(op.name(), "remove_sandbox");
        assert!(op.mutates());
        assert!(!Op::ListSandboxes.mutates());
        let json = serde_json::to_string(&Op::NodeInfo).unwrap();
        assert_eq!(json, r#"{"op":"node_info"}"#);
        assert!(serde_json::from_str::<Op>(r#"{"op":"format_disk"}"#).is_err());
    }
}
