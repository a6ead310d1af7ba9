//! The node contract (issue 14): what the control plane asks of a node, and the types it
//! speaks, with no I/O and no runtime code. space-control depends on this crate only; the node
//! agent (`space-node`) implements [`NodeApi`]. In all-in-one mode the control plane holds the
//! in-process node behind `Arc<dyn NodeApi>`; a remote node client implements the same trait.
//! Every operation is idempotent on the sandbox id.
//!
//! Modules: [`net`] (egress policies, secret bindings, a sandbox's network as inspected),
//! [`policy`] (parsing and matching of egress rules: pure functions both sides use) and
//! [`diff`] (what a diff of two trees reports).

pub mod diff;
pub mod guest;
pub mod moves;
pub mod net;
pub mod policy;

use std::collections::BTreeMap;
use std::path::PathBuf;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use space_proto::guest_client::GuestClient;

pub use guest::GuestChannel;

/// Resource limits of one sandbox. Applied through cgroups (v2, or the v1 hybrid layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU quota in thousandths of a core (1000 = one full core).
    pub cpu_millis: u32,
    /// Memory limit in MiB (RAM; swap is not granted).
    pub memory_mib: u64,
    /// Maximum number of tasks (processes + threads).
    pub pids: u32,
    /// Resource limits of every process, where they differ from the defaults.
    #[serde(default, skip_serializing_if = "Rlimits::is_default")]
    pub rlimits: Rlimits,
    /// Disk limit in MiB: what its rootfs and snapshots may hold together (decision 0043);
    /// none: bounded by the node's volume only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            cpu_millis: 1000,
            memory_mib: 512,
            pids: 512,
            rlimits: Rlimits::default(),
            disk_mib: None,
        }
    }
}

/// Per-sandbox resource limits (`setrlimit`), each soft and hard alike; `None` keeps the
/// platform's default (1,024 open files with a hard limit of 524,288, no core dumps, 8 MiB
/// of locked memory: decision 0041).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nofile: Option<u64>,
    /// Bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core: Option<u64>,
    /// Bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memlock: Option<u64>,
}

impl Rlimits {
    pub fn is_default(&self) -> bool {
        *self == Rlimits::default()
    }
}

/// How a sandbox is isolated: `namespace` (Linux namespaces, cgroups and seccomp on the
/// node's kernel) or `microvm` (a QEMU microvm with its own kernel, decision 0014). Written
/// as those words in records and on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    #[default]
    Namespace,
    Microvm,
}

impl RuntimeKind {
    pub const ALL: [RuntimeKind; 2] = [RuntimeKind::Namespace, RuntimeKind::Microvm];

    pub const fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Namespace => "namespace",
            RuntimeKind::Microvm => "microvm",
        }
    }
}

impl std::fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RuntimeKind {
    type Err = NodeError;
    fn from_str(s: &str) -> Result<Self, NodeError> {
        RuntimeKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                NodeError::InvalidArgument(format!(
                    "unknown runtime {s:?}: expected namespace or microvm"
                ))
            })
    }
}

/// What the control plane wants to exist on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// 20 characters of [a-z0-9]; chosen by the control plane.
    pub id: String,
    pub template: String,
    pub limits: Limits,
    /// Environment every process in the sandbox starts with (on top of PATH, HOME, ...).
    pub env: Vec<(String, String)>,
    pub hostname: String,
    /// Egress policy (decision 0012). Absent in records written before networking: `open`
    /// defaults apply.
    #[serde(default)]
    pub network: crate::net::NetworkSpec,
    /// Secrets the sandbox may use through the egress proxy (placeholders only; values stay
    /// in the control plane's store).
    #[serde(default)]
    pub secrets: Vec<crate::net::SecretBinding>,
    /// None: the node's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeKind>,
}

/// Where a sandbox stands as the node observes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Init (space-daemon) is alive and the channel socket exists.
    Running,
    /// The rootfs exists but init is gone (it died, was killed, or the host rebooted).
    Stopped,
    /// Init is alive but every process is frozen (cgroup freezer): no CPU, memory kept.
    /// The guest channel does not answer.
    Paused,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Running => "running",
            Phase::Stopped => "stopped",
            Phase::Paused => "paused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStatus {
    pub id: String,
    pub phase: Phase,
    pub template: String,
    pub runtime: RuntimeKind,
    /// Host pid of the sandbox's init (space-daemon) while running.
    pub init_pid: Option<u32>,
    /// First host uid of the sandbox's id range (root inside = this uid outside).
    pub uid_base: u32,
    pub uid_count: u32,
    /// Host path of the guest channel (unix socket).
    pub channel: PathBuf,
    /// Bytes of the sandbox's memory cgroup in use, when known.
    pub memory_bytes: Option<u64>,
    /// CPU time used by the sandbox so far, in microseconds, when known (running only).
    #[serde(default)]
    pub cpu_usage_usec: Option<u64>,
    /// Bytes charged to its disk limit (its files and snapshots), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// Its network slot and policy (None: networking off on this node).
    #[serde(default)]
    pub network: Option<crate::net::NetworkStatus>,
    /// Made from its template's warm pool (decision 0013).
    #[serde(default)]
    pub pooled: bool,
    /// Its VM was restored from its template's warm checkpoint at its last start.
    #[serde(default)]
    pub restored: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateInfo {
    pub name: String,
    pub version: u32,
    pub created_unix_ms: u64,
    /// Host path of the read-only rootfs subvolume.
    pub path: PathBuf,
    /// What every sandbox of this version starts with, unless its create says otherwise.
    #[serde(default)]
    pub defaults: TemplateDefaults,
    /// Where the version came from (`template.json`'s `source`).
    #[serde(default)]
    pub source: String,
}

/// A template's defaults (the Debian `base`: user `user`, a login shell's environment).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateDefaults {
    /// The user exec and file operations run as when they name none (default root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Environment of every process; a create's own `env` wins.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The working directory of exec calls that name none (default: the user's home).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// An OCI image's ENTRYPOINT and CMD, kept as the image said them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// Started in the background at every fresh launch (decision 0019).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Retried until it exits 0; the launch answers then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// How long the ready command may take (default 60 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_secs: Option<u64>,
}

/// A registry pull: `reference` as `docker pull` takes it, credentials for basic or token
/// auth, and `insecure` for a plain-HTTP registry.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PullSpec {
    pub reference: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub insecure: bool,
}

impl std::fmt::Debug for PullSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullSpec")
            .field("reference", &self.reference)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("insecure", &self.insecure)
            .finish()
    }
}

/// A line of a template's progress (pull, import, build), as it happens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateEvent {
    /// Step `n` of `of` is done (or, for a build, starts).
    Step { n: u32, of: u32, text: String },
    /// Something the user should know that did not stop the work (a dropped device node).
    Note(String),
    /// A line a build step's command printed.
    Output(String),
}

/// Where an imported template's files come from (a path on the node's filesystem).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    Dir(PathBuf),
    /// A tar archive (optionally gzip-compressed): a rootfs, or an image (an OCI image
    /// layout or a `docker save` archive, told apart by what is inside).
    Tar(PathBuf),
    /// A namespace sandbox's disk snapshot, taken over with no copy (a btrfs snapshot of its
    /// read-only subvolume), with the defaults of the sandbox's template.
    Snapshot {
        sandbox: String,
        snapshot: String,
        /// Instead of the sandbox's template's (a build step's accumulated config).
        defaults: Option<TemplateDefaults>,
    },
    /// An image pulled from a registry.
    Registry(PullSpec),
    /// The newest version of template `from`, with other defaults (a build's last step), no
    /// copy.
    Derived {
        from: String,
        defaults: TemplateDefaults,
    },
}

/// Where a template's progress lines go as they happen.
pub type TemplateProgress = tokio::sync::mpsc::UnboundedSender<TemplateEvent>;

/// One disk snapshot of a sandbox as the node holds it
/// (`sandboxes/<id>/snapshots/<snap>/rootfs`, a read-only subvolume).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// 20 characters of [a-z0-9]; chosen by the control plane.
    pub id: String,
    pub sandbox_id: String,
    pub created_unix_ms: u64,
    /// Bytes referenced by the snapshot's files, once computed (lazily; see
    /// docs/decisions/0007-snapshots.md).
    pub size_bytes: Option<u64>,
    /// Host path of the read-only rootfs subvolume (a microvm's: its disk image).
    pub path: PathBuf,
    /// Whether the running VM's memory (its processes as they were) was kept with it: a
    /// microvm checkpoint (decision 0014, "Memory snapshots"). Rollback and fork restore it.
    pub memory: bool,
}

/// A byte stream to a port inside a sandbox: on the node, a TCP connection (Nagle off);
/// through a remote node, whatever carries it there.
pub trait PortIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> PortIo for T {}
/// What [`NodeApi::connect_port`] answers.
pub type PortStream = Box<dyn PortIo>;

/// Errors of the node API. `code()` is the stable machine-readable name the control plane
/// shows clients; the message is safe to show too.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("conflict: {0}")]
    Conflict(String),
    /// The sandbox is in a phase the operation does not apply to (pausing a paused one,
    /// resuming a running one, either on a stopped one): a conflict callers can tell apart
    /// without reading the message.
    #[error("conflict: sandbox {id} is {}", phase.as_str())]
    WrongPhase { id: String, phase: Phase },
    #[error("resource exhausted: {0}")]
    Exhausted(String),
    #[error("guest channel of sandbox {id} unavailable: {reason}")]
    Unavailable { id: String, reason: String },
    /// The node agent did not answer (a remote node: refused, reset or timed out).
    #[error("node {node} is unreachable: {reason}")]
    Unreachable { node: String, reason: String },
    /// The template's start or ready command failed (decision 0019).
    #[error("sandbox {id} did not become ready: {reason}")]
    NotReady { id: String, reason: String },
    #[error("{0}")]
    Internal(String),
}

impl NodeError {
    pub fn code(&self) -> &'static str {
        match self {
            NodeError::NotFound { .. } => "not_found",
            NodeError::InvalidArgument(_) => "invalid_argument",
            NodeError::Conflict(_) | NodeError::WrongPhase { .. } => "conflict",
            NodeError::Exhausted(_) => "resource_exhausted",
            NodeError::Unavailable { .. } => "unavailable",
            NodeError::NotReady { .. } | NodeError::Unreachable { .. } => "unavailable",
            NodeError::Internal(_) => "internal",
        }
    }
}

#[async_trait]
pub trait NodeApi: Send + Sync {
    /// Create and start the sandbox. Idempotent: if it already runs with this id, returns its
    /// status. Fails with NotFound for an unknown template.
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError>;
    /// Stop the sandbox and delete its rootfs, cgroups and channel. Idempotent: removing a
    /// sandbox that is not there succeeds.
    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError>;
    /// Stop the sandbox's processes and free runtime resources, keeping its rootfs.
    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError>;
    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError>;
    /// Everything the node holds, for the reconciler.
    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError>;
    /// What the reconciler works from: [`Self::list_sandboxes`], and, for several nodes,
    /// which sandboxes could not be seen because their node did not answer.
    async fn observe(&self) -> Result<Observation, NodeError> {
        Ok(Observation {
            sandboxes: self.list_sandboxes().await?,
            ..Default::default()
        })
    }
    /// What a reconcile pass works from: [`Self::observe`], where each sandbox's usage
    /// figures (`memory_bytes`, `cpu_usage_usec`, `disk_bytes`) may be left out. Every pass
    /// asks it of a node that may hold thousands of sandboxes, and reading those figures was
    /// most of what an idle node spent per pass (issue 16).
    async fn observe_phases(&self) -> Result<Observation, NodeError> {
        self.observe().await
    }
    /// The sandbox's guest channel (cached; cheap to call per request). Conflict while it is
    /// paused (its daemon is frozen too); NotFound for an unknown id.
    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError>;
    /// A gRPC client on [`Self::guest_channel`].
    async fn guest(&self, id: &str) -> Result<GuestClient<GuestChannel>, NodeError> {
        Ok(self.guest_channel(id).await?.client())
    }
    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError>;
    /// Freeze every process of a running sandbox (returns once frozen). WrongPhase if it is
    /// already paused (phase Paused) or stopped; NotFound for an unknown id.
    async fn pause_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        Err(NodeError::Conflict(format!(
            "this node cannot pause sandbox {id}"
        )))
    }
    /// Thaw a paused sandbox. WrongPhase if it runs (phase Running) or is stopped; NotFound
    /// for an unknown id.
    async fn resume_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        Err(NodeError::Conflict(format!(
            "this node cannot resume sandbox {id}"
        )))
    }
    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError>;
    /// Every version of template `name`, oldest first (empty: no such template).
    async fn template_versions(&self, name: &str) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(self
            .list_templates()
            .await?
            .into_iter()
            .filter(|t| t.name == name)
            .collect())
    }

    /// Deletes one version of template `name`, or all of them (`None`). Refused (Conflict)
    /// while a sandbox uses a version being deleted, or while the template has a warm pool
    /// and its newest version would go. Returns the versions deleted.
    async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Vec<u32>, NodeError> {
        let _ = (name, version);
        Err(NodeError::InvalidArgument(
            "this node cannot remove templates".into(),
        ))
    }

    /// [`Self::import_template`], saying what it does on `progress` as it goes (a pull's
    /// layers, a note for each device node dropped).
    async fn import_template_with_progress(
        &self,
        name: &str,
        source: TemplateSource,
        progress: TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        drop(progress);
        self.import_template(name, source).await
    }

    // ---- networking (additive; default: unsupported) ----

    /// Checks an egress policy without applying it (InvalidArgument naming the bad rule).
    async fn validate_network(&self, network: &crate::net::NetworkSpec) -> Result<(), NodeError> {
        let _ = network;
        Ok(())
    }
    /// Replaces the sandbox's egress policy now (running or paused; a stopped sandbox gets it
    /// at its next start); connections it no longer allows are cut. NotFound for an unknown
    /// id; InvalidArgument for bad rules.
    async fn set_network(
        &self,
        id: &str,
        network: &crate::net::NetworkSpec,
    ) -> Result<SandboxStatus, NodeError> {
        let _ = network;
        Err(NodeError::Conflict(format!(
            "this node cannot change the network of sandbox {id}"
        )))
    }
    /// A connection to `port` on the sandbox's loopback, for the inbound port proxy.
    /// NotFound for an unknown id; Unavailable when nothing listens there.
    async fn connect_port(&self, id: &str, port: u16) -> Result<PortStream, NodeError> {
        let _ = port;
        Err(NodeError::Conflict(format!(
            "this node cannot connect into sandbox {id}"
        )))
    }

    // ---- snapshots, rollback and fork (additive; default: unsupported) ----

    /// Takes an atomic read-only snapshot `snap` of the sandbox's rootfs (briefly freezing
    /// its processes when it runs). Idempotent on `snap`.
    async fn snapshot_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        let _ = (id, snap);
        Err(NodeError::Internal(
            "snapshots are not supported by this node".into(),
        ))
    }
    /// A snapshot that also keeps the running sandbox's memory where its runtime can (a
    /// microvm: its RAM and device state, `memory: true`); elsewhere the same as
    /// `snapshot_sandbox`. Idempotent on `snap`.
    async fn checkpoint_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.snapshot_sandbox(id, snap).await
    }
    /// The sandbox's snapshots (oldest first), with sizes when `with_size` (computed once
    /// per snapshot, then cached).
    async fn list_snapshots(
        &self,
        id: &str,
        with_size: bool,
    ) -> Result<Vec<SnapshotInfo>, NodeError> {
        let _ = (id, with_size);
        Err(NodeError::Internal(
            "snapshots are not supported by this node".into(),
        ))
    }
    /// The paths added, modified and deleted from `from` to `to` (snapshot ids of this
    /// sandbox; `from: None` = its creation (the template version it was made of), `to: None`
    /// = the live rootfs, best effort while it is written). Sorted by path. Decision 0011.
    async fn diff_sandbox(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<crate::diff::Change>, NodeError> {
        let _ = (id, from, to);
        Err(NodeError::Internal(
            "diff is not supported by this node".into(),
        ))
    }
    /// Deletes a snapshot. Idempotent: a missing snapshot is fine.
    async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        let _ = (id, snap);
        Err(NodeError::Internal(
            "snapshots are not supported by this node".into(),
        ))
    }
    /// Whether the sandbox's rootfs changed since snapshot `snap` of sandbox `owner` (its
    /// own, or for a fork the source's) was cut. Cheap (one btrfs tree search); it sees
    /// creates, unlinks, renames and metadata at once, in-place overwrites once written
    /// back or committed. When unsure (no such snapshot, not btrfs) it answers `true`.
    async fn changed_since_snapshot(
        &self,
        id: &str,
        owner: &str,
        snap: &str,
    ) -> Result<bool, NodeError> {
        let _ = (id, owner, snap);
        Ok(true)
    }
    /// Stops the sandbox's processes, replaces its rootfs with a writable snapshot of its
    /// snapshot `snap` and starts it again (same id, same uid range). `spec` carries the
    /// limits, env and hostname to start with.
    async fn rollback_sandbox(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        let _ = (spec, snap);
        Err(NodeError::Internal(
            "rollback is not supported by this node".into(),
        ))
    }
    /// Creates and starts sandbox `spec.id` on a writable snapshot of `source`'s snapshot
    /// `snap`, with a fresh identity (hostname, /etc/machine-id). Idempotent on `spec.id`.
    async fn fork_sandbox(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        let _ = (source, snap, spec);
        Err(NodeError::Internal(
            "fork is not supported by this node".into(),
        ))
    }
    /// Node-level series for `/metrics`: each a name with its labels already rendered
    /// (`space_net_slots_ready`, `name{label="v"}`) and a value. Cheap on the node; a remote
    /// node's are one call away.
    async fn metrics(&self) -> Vec<(String, f64)> {
        Vec::new()
    }

    // ---- warm pools (additive; default: none) ----

    /// Sets the warm pool of `template` (decision 0013). Sizes beyond the node's capacity are
    /// clamped and the answer's `warning` says so; `min > max` is InvalidArgument; an unknown
    /// template is NotFound. `min = max = 0` turns the pool off (its ready sandboxes are
    /// destroyed).
    async fn set_pool(&self, template: &str, cfg: PoolConfig) -> Result<PoolStatus, NodeError> {
        let _ = cfg;
        Err(NodeError::Conflict(format!(
            "this node keeps no warm pool (template {template})"
        )))
    }
    /// Every configured pool, by template name.
    async fn pools(&self) -> Vec<PoolStatus> {
        Vec::new()
    }

    /// What the node has and holds now (cheap: a few /proc reads). Default: nothing known.
    async fn node_info(&self) -> Result<NodeInfo, NodeError> {
        Ok(NodeInfo::default())
    }

    // ---- migration (additive; default: unsupported; decision 0035) ----

    /// Step `step` of moving sandbox `id` away: its storage as a stream for another node's
    /// [`Self::receive_sandbox`]. `Final` needs the sandbox paused or stopped and a `Base`
    /// sent before it. `have`: snapshots the target holds already as the sandbox's replica
    /// (decision 0056); a `Base` sends none of them, and what follows them is incremental
    /// against them. NotFound for an unknown id; InvalidArgument for a runtime whose
    /// sandboxes cannot move.
    async fn send_sandbox(
        &self,
        id: &str,
        step: moves::MoveStep,
        have: &[String],
    ) -> Result<moves::MoveStream, NodeError> {
        let _ = (step, have);
        Err(NodeError::InvalidArgument(format!(
            "this node cannot move sandbox {id}"
        )))
    }
    /// Receives step `step` of sandbox `id` from another node's [`Self::send_sandbox`]. A
    /// `Base` is refused (Conflict) while this node holds the sandbox; what a failed move
    /// left here goes with [`Self::discard_move`]. `have`: as the sender was given it; a
    /// `Base` takes those snapshots from this node's replica of the sandbox (Conflict when
    /// it holds one of them no longer), and the rest of the replica goes.
    async fn receive_sandbox(
        &self,
        id: &str,
        step: moves::MoveStep,
        have: &[String],
        parts: moves::MoveStream,
    ) -> Result<moves::Received, NodeError> {
        let _ = (step, have, parts);
        Err(NodeError::InvalidArgument(format!(
            "this node cannot receive sandbox {id}"
        )))
    }
    /// Makes the sandbox received here (both steps) one of this node's, stopped: a
    /// `create_sandbox` with the same spec starts it. Idempotent.
    async fn adopt_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        Err(NodeError::InvalidArgument(format!(
            "this node cannot adopt sandbox {}",
            spec.id
        )))
    }
    /// The newest version of template `name` as a stream for another node's
    /// [`Self::receive_template`]: templates reach the nodes that lack them on demand.
    async fn send_template(&self, name: &str) -> Result<moves::MoveStream, NodeError> {
        Err(NodeError::InvalidArgument(format!(
            "this node cannot send template {name}"
        )))
    }
    /// Receives a template version another node sent, keeping its version number, and
    /// caches it. A version this node has already is answered as it is.
    async fn receive_template(
        &self,
        name: &str,
        parts: moves::MoveStream,
    ) -> Result<TemplateInfo, NodeError> {
        let _ = parts;
        Err(NodeError::InvalidArgument(format!(
            "this node cannot receive template {name}"
        )))
    }
    /// Drops what a move that will not finish left here: a source's copies taken for it, or
    /// a target's partly received sandbox (never one it has adopted). Idempotent.
    async fn discard_move(&self, id: &str) -> Result<(), NodeError> {
        let _ = id;
        Ok(())
    }

    // ---- replication (additive; default: unsupported; decision 0037) ----

    /// Sandbox `id`'s snapshots that a replica holding `have` lacks, oldest first, each
    /// incremental against the newest one before it that the replica will hold (`have` or
    /// sent before it), as a stream for another node's [`Self::receive_replica`]. NotFound
    /// for an unknown id; InvalidArgument for a runtime whose snapshots cannot be sent.
    async fn send_replica(
        &self,
        id: &str,
        have: &[String],
    ) -> Result<moves::MoveStream, NodeError> {
        let _ = have;
        Err(NodeError::InvalidArgument(format!(
            "this node cannot replicate sandbox {id}"
        )))
    }
    /// Keeps what another node's [`Self::send_replica`] sent as the replica of sandbox `id`
    /// (its snapshots only, never a live sandbox). Answers every snapshot the replica holds
    /// whole now; one cut short is dropped. Conflict while this node holds the sandbox.
    async fn receive_replica(
        &self,
        id: &str,
        parts: moves::MoveStream,
    ) -> Result<moves::Received, NodeError> {
        let _ = parts;
        Err(NodeError::InvalidArgument(format!(
            "this node cannot keep a replica of sandbox {id}"
        )))
    }
    /// Drops the replica's snapshots of sandbox `id` that are not in `keep` (all of it, and
    /// its directory, when `keep` is empty); answers what it holds after. Idempotent.
    async fn drop_replica(&self, id: &str, keep: &[String]) -> Result<Vec<String>, NodeError> {
        let _ = (id, keep);
        Ok(Vec::new())
    }
    /// Makes the replica of sandbox `spec.id` one of this node's sandboxes, stopped, on its
    /// snapshot `snap` (its disk a writable snapshot of it; every replicated snapshot comes
    /// along): a `create_sandbox` with the same spec starts it. Idempotent; NotFound when
    /// the replica does not hold `snap`.
    async fn restore_replica(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        let _ = snap;
        Err(NodeError::InvalidArgument(format!(
            "this node cannot restore sandbox {}",
            spec.id
        )))
    }

    // ---- usage (additive; default: none kept) ----

    /// The sandbox's recent cgroup samples, oldest first, ending with one taken now while it
    /// runs (decision 0024); its disk as the guest sees it when the guest answers. NotFound
    /// for an unknown id.
    async fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, NodeError> {
        let _ = id;
        Ok(SandboxUsage::default())
    }
}

/// What a node has and holds, as it reports it: `space node ls`, and the figures a
/// scheduler places by.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's host name.
    pub name: String,
    /// The runtimes it offers (microvm when configured; whether QEMU and KVM work shows at
    /// the first microvm create).
    pub runtimes: Vec<RuntimeKind>,
    pub cpus: u32,
    pub memory_bytes: u64,
    /// The kernel's MemAvailable.
    pub memory_available_bytes: u64,
    /// Sandboxes it holds for users (its warm pools' ready ones not counted).
    pub sandboxes: u32,
    /// Ready sandboxes in its warm pools.
    pub pool_ready: u32,
    /// When the node agent started (unix ms): it changes when the node restarts.
    #[serde(default)]
    pub started_unix_ms: u64,
    /// The templates it has (names; any version).
    #[serde(default)]
    pub templates: Vec<String>,
    /// Ready members of its warm pools, by template.
    #[serde(default)]
    pub pool_ready_by_template: BTreeMap<String, u32>,
}

/// What the reconciler sees of the node (or nodes) it drives.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observation {
    pub sandboxes: Vec<SandboxStatus>,
    /// Sandboxes on nodes that did not answer: neither there nor gone, so left alone.
    pub unseen: std::collections::BTreeSet<String>,
    /// (node id, sandbox id): a sandbox a node holds while the store places it on another
    /// node (a copy left behind by a lost node that came back after its sandboxes were
    /// restored elsewhere, or one end of a move under way). Empty for a single node.
    pub strays: Vec<(String, String)>,
}

/// One reading of a sandbox's cgroup counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSample {
    pub unix_ms: u64,
    /// CPU time used since the sandbox started, in microseconds.
    pub cpu_usage_usec: u64,
    /// Memory charged to it, page cache included.
    pub memory_bytes: u64,
    /// The page cache part of `memory_bytes` (0 where the runtime cannot tell).
    pub memory_cache_bytes: u64,
}

/// What [`NodeApi::sandbox_usage`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxUsage {
    pub samples: Vec<UsageSample>,
    /// statvfs("/") inside the guest, now; None when it did not answer (paused, stopped).
    pub disk_total_bytes: Option<u64>,
    pub disk_used_bytes: Option<u64>,
}

/// Requested sizes of a template's warm pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// Ready sandboxes kept at all times.
    pub min: u32,
    /// How far the pool may grow while creates outrun it.
    pub max: u32,
    /// Pool microvm sandboxes (restored from the template's warm checkpoint, default
    /// limits) instead of namespace ones.
    #[serde(default)]
    pub microvm: bool,
}

/// A template's warm pool as the node holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub template: String,
    pub runtime: RuntimeKind,
    /// Sizes in force (after clamping).
    pub min: u32,
    pub max: u32,
    /// What the pool refills to now: `min`, raised toward `max` after misses.
    pub target: u32,
    pub ready: u32,
    /// Being built now.
    pub starting: u32,
    pub hits: u64,
    pub misses: u64,
    /// Why the requested sizes were clamped, when they were.
    pub warning: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_kinds_keep_the_words_records_hold() {
        for k in RuntimeKind::ALL {
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
            assert_eq!(serde_json::from_str::<RuntimeKind>(&json).unwrap(), k);
            assert_eq!(k.as_str().parse::<RuntimeKind>().unwrap(), k);
        }
        let e = "firecracker".parse::<RuntimeKind>().unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(
            e.to_string().contains("expected namespace or microvm"),
            "{e}"
        );
        // A sandbox record written before the enum reads the same.
        let spec: SandboxSpec = serde_json::from_str(
            r#"{"id":"a","template":"base","limits":{"cpu_millis":1000,"memory_mib":512,"pids":512},
                "env":[],"hostname":"a","runtime":"microvm"}"#,
        )
        .unwrap();
        assert_eq!(spec.runtime, Some(RuntimeKind::Microvm));
    }
}
