//! The DTOs of the REST API v1. Pure data: no I/O. Every struct denies unknown fields, so a
//! typo in a request is a 400 instead of a silently ignored option.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Length of a sandbox id: lowercase ASCII letters and digits.
pub const SANDBOX_ID_LEN: usize = 20;

/// Default template of a new sandbox.
pub const DEFAULT_TEMPLATE: &str = "base";
pub const DEFAULT_CPU: f64 = 1.0;
pub const DEFAULT_MEMORY_MIB: u64 = 512;
pub const DEFAULT_PIDS: u32 = 512;

/// What recent E2B SDKs require of an API key: `e2b_` and hex digits.
pub const E2B_KEY_PREFIX: &str = "e2b_";

/// The E2B form of a space API key: `e2b_` + the hex of its bytes. The server maps it back
/// with no table, so a key revoked in one form is revoked in both (decision 0022).
pub fn e2b_key(key: &str) -> String {
    let mut out = String::from(E2B_KEY_PREFIX);
    for b in key.as_bytes() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Whether `id` has the shape of a sandbox id (20 chars of `[a-z0-9]`).
pub fn is_valid_sandbox_id(id: &str) -> bool {
    id.len() == SANDBOX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Whether `key` is a valid environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_valid_env_key(key: &str) -> bool {
    let mut bytes = key.bytes();
    match bytes.next() {
        Some(b) if b.is_ascii_alphabetic() || b == b'_' => {}
        _ => return false,
    }
    bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Whether `name` is a valid template name: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn is_valid_template_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    match bytes.next() {
        Some(b) if b.is_ascii_lowercase() || b.is_ascii_digit() => {}
        _ => return false,
    }
    name.len() <= 63
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

/// The error body of every failed request: `{"error":{"code":"...","message":"..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// Stable machine-readable code: invalid_argument, unauthorized, not_found, conflict, ...
    pub code: String,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                code: code.into(),
                message: message.into(),
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    pub status: String,
    pub version: String,
}

/// `GET /v1/e2b`: how E2B's SDKs reach this server beyond `E2B_API_URL` (decision 0030).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bSettings {
    /// spaced's `--e2b-domain` (`E2B_DOMAIN` for the SDKs), if it has one.
    pub domain: Option<String>,
    /// The CA certificate (PEM) of the certificates spaced issues for that domain, for
    /// clients to trust; None when spaced serves a certificate it was given, or no TLS.
    pub ca: Option<String>,
}

/// Per-sandbox resource limits, each soft and hard alike (decision 0041). Unset fields keep
/// the defaults: 1,024 open files (hard 524,288), no core dumps, 8 MiB of locked memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rlimits {
    /// Open files, 16..=1048576.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nofile: Option<u64>,
    /// Core dump size in bytes, at most the sandbox's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core: Option<u64>,
    /// Locked memory in bytes, at most the sandbox's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memlock: Option<u64>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Default "base".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Cores, 0.01..=64; default 1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// 16..=1048576; default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// 8..=1000000; default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u32>,
    /// Disk limit in MiB, 16..=16777216: what the sandbox's files and its snapshots may hold
    /// together (namespace runtime; decision 0043). A write past it fails inside with
    /// EDQUOT. None: bounded by the node's volume only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    /// Resource limits of the sandbox's processes (namespace runtime); none = the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimits: Option<Rlimits>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The caller's own labels (at most 64; keys 1..=128 bytes, values up to 512); listed
    /// with the sandbox and filtered on by `GET /sandboxes?metadata=` of the E2B API.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Seconds from now after which `on_timeout` happens; none = no timeout (no hard cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Idle seconds (no API activity, no open exec stream) after which the sandbox is
    /// paused; none = never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause_secs: Option<u64>,
    /// What an expired timeout does; default `pause`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
    /// Automatic snapshots and their retention; none = on demand only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_policy: Option<crate::snapshot_policy::SnapshotPolicy>,
    /// Egress policy; none = the node's default egress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::NetworkPolicy>,
    /// Names of secrets (`PUT /v1/secrets/{name}`) the sandbox may use: each becomes an
    /// environment variable holding a placeholder the egress proxy replaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Headers the egress proxy sets with a secret's value on the sandbox's HTTPS requests to
    /// the hosts named (the sandbox sees nothing of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_headers: Vec<crate::net::SecretHeader>,
    /// "namespace" (a namespace sandbox on the shared kernel) or "microvm" (a VM with its own
    /// kernel); default: the node's (`spaced --default-runtime`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Copies of the sandbox's snapshots kept on other nodes (decision 0037): 0 or 1. With
    /// 1, each snapshot is sent to a second node, and if the sandbox's node is lost it is
    /// restored there from its newest replicated snapshot. Default: its template's setting,
    /// else 0. Needs a cluster and the namespace runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
}

/// The most replicas a sandbox may ask for.
pub const MAX_REPLICAS: u32 = 1;

/// Where a sandbox's replica is and how far it has come (decision 0037).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaStatus {
    /// The node that holds it.
    pub node: String,
    /// The newest snapshot it holds: what a restore after the loss of the sandbox's node
    /// comes back from.
    pub snapshot_id: String,
    /// How many of the sandbox's snapshots it holds.
    pub snapshots: u32,
    /// Bytes the last replication sent (incremental on what the replica had).
    pub last_bytes: u64,
    /// When it last caught up (RFC 3339).
    pub updated_at: String,
}

/// `POST /v1/sandboxes/{id}/pause` (the body is optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// `false`: a filesystem-only pause. Every process ends and memory and CPU are freed; the
    /// sandbox is `stopped` and `resume` starts it again, cold, on its filesystem. Absent or
    /// `true`: a freeze that keeps processes and memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
}

/// What happens when a sandbox's timeout expires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Freeze it (nothing is lost; `resume` continues it).
    #[default]
    Pause,
    /// Delete it.
    Delete,
    /// A filesystem-only pause: every process ends, the files stay (`stopped`; `resume`
    /// starts it again, cold).
    Stop,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Pause => "pause",
            OnTimeout::Delete => "delete",
            OnTimeout::Stop => "stop",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pause" => Some(OnTimeout::Pause),
            "delete" => Some(OnTimeout::Delete),
            "stop" => Some(OnTimeout::Stop),
            _ => None,
        }
    }
}

/// `POST /v1/sandboxes/{id}/timeout`: sets (counting from now) or clears the timeout. The
/// only call that changes a sandbox's timeout.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    /// Seconds from now; null clears the timeout.
    pub timeout_secs: Option<u64>,
    /// Unchanged when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    Stopped,
    Failed,
    Deleting,
    /// Frozen: no CPU, memory kept; `resume` thaws it.
    Paused,
    /// Its node was lost and it had no replica to restore from (decision 0037). Nothing was
    /// recreated in its place; it comes back if its node does, and `rm` forgets it.
    Lost,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Stopped => "stopped",
            SandboxState::Failed => "failed",
            SandboxState::Deleting => "deleting",
            SandboxState::Paused => "paused",
            SandboxState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "stopped" => SandboxState::Stopped,
            "failed" => SandboxState::Failed,
            "deleting" => SandboxState::Deleting,
            "paused" => SandboxState::Paused,
            "lost" => SandboxState::Lost,
            _ => return None,
        })
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sandbox {
    pub id: String,
    /// The tenant it belongs to (decision 0040).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    pub template: String,
    /// "namespace" (the only runtime so far).
    pub runtime: String,
    pub state: SandboxState,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub cpu: f64,
    pub memory_mib: u64,
    pub pids: u32,
    /// Its disk limit in MiB, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    /// Bytes charged to its disk limit: its files and what its snapshots keep, as of btrfs's
    /// last commit (at most about 30 s behind a write).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// The resource limits the create set (absent: the defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimits: Option<Rlimits>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    pub hostname: String,
    /// Why the sandbox failed or stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Host pid of the sandbox's init while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_pid: Option<u32>,
    /// First host uid of the sandbox's uid range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid_base: Option<u32>,
    /// Bytes of memory the sandbox uses now (its memory cgroup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// CPU time the sandbox has used so far, in microseconds (its cgroup), while it runs.
    /// Two samples over an interval give its CPU share (`space top`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_usage_usec: Option<u64>,
    /// When the timeout expires (RFC 3339), if one is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_at: Option<String>,
    /// What the timeout does when it expires (present with `timeout_at`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
    /// Idle seconds after which the sandbox is paused, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause_secs: Option<u64>,
    /// When the sandbox was paused (RFC 3339), while paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<String>,
    /// Its snapshot policy, when one is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_policy: Option<crate::snapshot_policy::SnapshotPolicy>,
    /// Its egress policy and address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::SandboxNetwork>,
    /// Names of the secrets it uses (never their values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Whether it was made from its template's warm pool (a personalized ready sandbox)
    /// rather than built on create.
    #[serde(default)]
    pub pooled: bool,
    /// Whether its VM was restored from its template's warm checkpoint (microvm) rather
    /// than booted, this time it started.
    #[serde(default)]
    pub restored: bool,
    /// Copies of its snapshots kept on other nodes (0 or 1; decision 0037).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replicas: u32,
    /// Its replica, once one holds a snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaStatus>,
    /// Its node did not answer (its heartbeat lapsed, or it failed to answer just now):
    /// `state` is the one recorded before, and the live figures are missing. The sandbox is
    /// left as it is, neither failed nor recreated elsewhere, until its node is back.
    #[serde(default, skip_serializing_if = "is_false")]
    pub node_unreachable: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/exec`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// argv; non-empty. argv[0] is looked up in PATH when it has no '/'.
    pub cmd: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub tty: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cols: Option<u16>,
    /// Keep stdin open for `POST .../stdin`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stdin: bool,
    /// Bytes written to stdin first (base64 on the wire).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::b64::option"
    )]
    pub stdin_data: Option<Vec<u8>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Return `{"pid":N}` (201) as soon as the process runs instead of streaming events.
    #[serde(default, skip_serializing_if = "is_false")]
    pub background: bool,
}

impl ExecRequest {
    /// A request that runs `cmd` with everything else defaulted.
    pub fn new<I, S>(cmd: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            cmd: cmd.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `201` reply of a background exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Started {
    pub pid: u32,
}

/// One line of an exec or output stream (ndjson).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ExecEvent {
    Started {
        pid: u32,
    },
    Stdout {
        offset: u64,
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    Stderr {
        offset: u64,
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    Pty {
        offset: u64,
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// Bytes `[from, to)` were dropped from the process's bounded output buffer.
    Gap {
        from: u64,
        to: u64,
    },
    /// Last event: exactly one of `code` and `signal` is set.
    Exit {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
    },
    /// The stream failed midway (last event).
    Error {
        code: String,
        message: String,
    },
}

impl ExecEvent {
    /// The shell-style exit status of an `Exit` event: the code, or 128 + signal.
    pub fn exit_status(&self) -> Option<i32> {
        match self {
            ExecEvent::Exit { code, signal } => Some(match (code, signal) {
                (_, Some(sig)) => 128 + sig,
                (Some(code), None) => *code,
                (None, None) => 0,
            }),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessInfo {
    pub pid: u32,
    pub cmd: Vec<String>,
    #[serde(default)]
    pub tag: String,
    pub tty: bool,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub started_at: String,
    pub output_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// `GET .../processes/{pid}/output` query.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    #[serde(default)]
    pub offset: u64,
    /// Keep streaming until the process exits (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
}

/// A signal by name ("KILL", "SIGTERM") or number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SignalSpec {
    Number(i32),
    Name(String),
}

impl SignalSpec {
    /// The signal number, if the name is known and the number in 1..=64.
    pub fn number(&self) -> Option<i32> {
        match self {
            SignalSpec::Number(n) => (1..=64).contains(n).then_some(*n),
            SignalSpec::Name(name) => signal_number(name),
        }
    }
}

impl std::str::FromStr for SignalSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let spec = match s.parse::<i32>() {
            Ok(n) => SignalSpec::Number(n),
            Err(_) => SignalSpec::Name(s.to_string()),
        };
        match spec.number() {
            Some(_) => Ok(spec),
            None => Err(format!("unknown signal {s:?}")),
        }
    }
}

const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ILL", 4),
    ("TRAP", 5),
    ("ABRT", 6),
    ("BUS", 7),
    ("FPE", 8),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("STKFLT", 16),
    ("CHLD", 17),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("TTIN", 21),
    ("TTOU", 22),
    ("URG", 23),
    ("XCPU", 24),
    ("XFSZ", 25),
    ("VTALRM", 26),
    ("PROF", 27),
    ("WINCH", 28),
    ("IO", 29),
    ("PWR", 30),
    ("SYS", 31),
];

/// Number of a Linux signal given by name, with or without the `SIG` prefix, any case.
pub fn signal_number(name: &str) -> Option<i32> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS.iter().find(|(n, _)| *n == bare).map(|(_, v)| *v)
}

/// `POST .../processes/{pid}/signal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: SignalSpec,
    #[serde(default, skip_serializing_if = "is_false")]
    pub group: bool,
}

/// `POST .../processes/{pid}/resize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryInfo {
    pub name: String,
    pub path: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    /// Permission bits (07777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// The uid's and gid's names in the sandbox (the numbers where it has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    pub modified_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// A directory another filesystem is mounted on (/proc, /sys, a tmpfs): downloads skip it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mount_point: bool,
    /// Its `user.e2b.<key>` extended attributes, by key (E2B's file metadata).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryList {
    pub entries: Vec<EntryInfo>,
}

/// Query of `GET/DELETE .../files`, `.../files/stat` and `.../files/list`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recursive: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
}

/// Query of `GET .../files/watch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    /// A directory.
    pub path: String,
    /// The whole tree below it (directories made later included), not only its entries.
    #[serde(default, skip_serializing_if = "is_false")]
    pub recursive: bool,
}

/// Query of `GET /v1/sandboxes/{id}/metrics`: samples taken in `[since, until]` (RFC 3339;
/// each end open when absent).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
}

/// `GET /v1/sandboxes/{id}/metrics`: the sandbox's recent usage (decision 0024), oldest
/// sample first; the last one is taken by the call itself while the sandbox runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxMetrics {
    /// Its CPU limit, in cores.
    pub cpu: f64,
    pub memory_limit_bytes: u64,
    /// statvfs("/") inside the sandbox now (what `df /` shows there); absent while it
    /// is paused or stopped.
    pub disk_total_bytes: Option<u64>,
    pub disk_used_bytes: Option<u64>,
    pub samples: Vec<MetricSample>,
}

/// One sample of [`SandboxMetrics`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricSample {
    /// RFC 3339, UTC.
    pub time: String,
    /// CPU used since the sample before, in percent of the sandbox's CPU limit (0 to 100).
    pub cpu_pct: f64,
    /// Memory in use, the page cache not counted.
    pub memory_bytes: u64,
    /// Page cache charged to the sandbox.
    pub memory_cache_bytes: u64,
}

/// What changed (`GET .../files/watch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    /// The first line: every change after it is reported.
    Started,
    /// Created, or moved in.
    Create,
    Write,
    Remove,
    /// Moved away (its new name, if watched, comes as a `create`).
    Rename,
    /// Metadata changed (mode, owner, times).
    Chmod,
    /// Events were lost (the kernel's queue, or a client too far behind).
    Overflow,
}

impl WatchKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WatchKind::Started => "started",
            WatchKind::Create => "create",
            WatchKind::Write => "write",
            WatchKind::Remove => "remove",
            WatchKind::Rename => "rename",
            WatchKind::Chmod => "chmod",
            WatchKind::Overflow => "overflow",
        }
    }
}

/// One line of `GET .../files/watch` (ndjson).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchEvent {
    #[serde(rename = "type")]
    pub kind: WatchKind,
    /// Relative to the watched directory ("" for the directory itself).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub is_dir: bool,
}

/// Query of `PUT .../files`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteFileQuery {
    pub path: String,
    /// Who owns the file: a user name or uid; default the sandbox's default user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Octal permission bits, e.g. "644" or "0755".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parents: Option<bool>,
}

/// `POST .../files/mkdir`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MakeDirRequest {
    pub path: String,
    /// Who owns what is made; default the sandbox's default user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub parents: bool,
    /// Permission bits; default 0755.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

/// `POST .../files/rename`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenameRequest {
    pub from: String,
    pub to: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub overwrite: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub name: String,
    pub version: u32,
    pub created_at: String,
    /// Where the version came from (`oci:REF@DIGEST`, `dir:...`, `snapshot:ID/SNAP`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Run in the background in every new sandbox of this version (decision 0019).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Retried until it succeeds; creates answer then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// Host path of the template's read-only root filesystem (for operators and benchmarks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The runtime creates of this template get when they name none (absent: the node's
    /// default). Set with `PUT /v1/templates/{name}/settings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// The replicas creates of this template get when they name none (absent: 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// The tenant it belongs to (decision 0048).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Whether other tenants may use it, read-only.
    #[serde(default)]
    pub shared: bool,
}

/// `POST /v1/templates/{name}/from-snapshot`: a new version of the template `name` made of a
/// sandbox's disk snapshot, with no copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateFromSnapshot {
    pub sandbox: String,
    pub snapshot: String,
}

/// `PUT /v1/templates/{name}/settings`: the template's settings, replaced whole.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTemplateSettings {
    /// "namespace" or "microvm"; null or absent: the node's default.
    #[serde(default)]
    pub runtime: Option<String>,
    /// Replicas the template's sandboxes get when their create names none (decision 0037);
    /// null or absent: 0.
    #[serde(default)]
    pub replicas: Option<u32>,
    /// Whether other tenants may read it and create sandboxes of it (decision 0048); null or
    /// absent: its tenant's default (shared for `default`'s, private for another tenant's).
    #[serde(default)]
    pub shared: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// Formats unix milliseconds as RFC 3339 UTC with millisecond precision
/// (`2024-05-01T12:00:00.123Z`).
pub(crate) fn default_tenant() -> String {
    crate::tenant::DEFAULT_TENANT.to_owned()
}

pub fn rfc3339_from_unix_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// The inverse of [`rfc3339_from_unix_ms`]: `YYYY-MM-DDTHH:MM:SS[.mmm]Z` to unix milliseconds;
/// `None` for anything else.
pub fn unix_ms_from_rfc3339(s: &str) -> Option<i64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, millis) = match time.split_once('.') {
        Some((hms, frac)) if frac.len() == 3 => (hms, frac.parse::<i64>().ok()?),
        Some(_) => return None,
        None => (time, 0),
    };
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (h, m, sec) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    // Howard Hinnant's days_from_civil.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + h * 3600 + m * 60 + sec) * 1000) + millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(is_valid_sandbox_id("abcdefghij0123456789"));
        assert!(!is_valid_sandbox_id("abcdefghij012345678"));
        assert!(!is_valid_sandbox_id("ABCDEFGHIJ0123456789"));
        assert!(!is_valid_sandbox_id("abcdefghij012345678/"));
    }

    #[test]
    fn env_keys() {
        assert!(is_valid_env_key("PATH"));
        assert!(is_valid_env_key("_x1"));
        assert!(!is_valid_env_key("1X"));
        assert!(!is_valid_env_key("A=B"));
        assert!(!is_valid_env_key(""));
        assert!(!is_valid_env_key("A\0"));
    }

    #[test]
    fn template_names() {
        assert!(is_valid_template_name("base"));
        assert!(is_valid_template_name("py3.12-slim"));
        assert!(!is_valid_template_name("../x"));
        assert!(!is_valid_template_name("Base"));
        assert!(!is_valid_template_name(""));
        assert!(!is_valid_template_name(&"a".repeat(64)));
    }

    #[test]
    fn exec_events_roundtrip() {
        let line = r#"{"type":"stdout","offset":3,"data":"aGk="}"#;
        let ev: ExecEvent = serde_json::from_str(line).unwrap();
        assert_eq!(
            ev,
            ExecEvent::Stdout {
                offset: 3,
                data: b"hi".to_vec()
            }
        );
        assert_eq!(serde_json::to_string(&ev).unwrap(), line);
        let exit = ExecEvent::Exit {
            code: None,
            signal: Some(9),
        };
        assert_eq!(
            serde_json::to_string(&exit).unwrap(),
            r#"{"type":"exit","signal":9}"#
        );
        assert_eq!(exit.exit_status(), Some(137));
        let started: ExecEvent = serde_json::from_str(r#"{"type":"started","pid":7}"#).unwrap();
        assert_eq!(started, ExecEvent::Started { pid: 7 });
    }

    #[test]
    fn create_denies_unknown_fields_and_defaults() {
        let c: CreateSandbox = serde_json::from_str("{}").unwrap();
        assert_eq!(c, CreateSandbox::default());
        assert!(serde_json::from_str::<CreateSandbox>(r#"{"cpus":2}"#).is_err());
        let e: ExecRequest =
            serde_json::from_str(r#"{"cmd":["cat"],"stdin_data":"aGk="}"#).unwrap();
        assert_eq!(e.stdin_data.as_deref(), Some(&b"hi"[..]));
        assert!(!e.background);
    }

    #[test]
    fn signals() {
        assert_eq!(signal_number("KILL"), Some(9));
        assert_eq!(signal_number("sigterm"), Some(15));
        assert_eq!(signal_number("NOPE"), None);
        let s: SignalRequest = serde_json::from_str(r#"{"signal":"INT"}"#).unwrap();
        assert_eq!(s.signal.number(), Some(2));
        let s: SignalRequest = serde_json::from_str(r#"{"signal":10,"group":true}"#).unwrap();
        assert_eq!(s.signal.number(), Some(10));
        assert!(s.group);
        assert_eq!(SignalSpec::Number(0).number(), None);
        assert!("TERM".parse::<SignalSpec>().is_ok());
        assert!("BOGUS".parse::<SignalSpec>().is_err());
    }

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339_from_unix_ms(0), "1970-01-01T00:00:00.000Z");
        for ms in [
            0,
            1,
            951_782_400_000,
            1_709_251_199_999,
            1_796_000_000_123,
            -86_400_001,
        ] {
            assert_eq!(unix_ms_from_rfc3339(&rfc3339_from_unix_ms(ms)), Some(ms));
        }
        assert_eq!(
            unix_ms_from_rfc3339("2024-05-01T12:00:00Z"),
            Some(1_714_564_800_000)
        );
        for bad in [
            "",
            "2024-05-01",
            "2024-13-01T00:00:00Z",
            "2024-05-01T00:00:00.1Z",
        ] {
            assert_eq!(unix_ms_from_rfc3339(bad), None, "{bad}");
        }
        assert_eq!(
            rfc3339_from_unix_ms(1_709_251_199_999),
            "2024-02-29T23:59:59.999Z"
        );
        assert_eq!(
            rfc3339_from_unix_ms(951_782_400_000),
            "2000-02-29T00:00:00.000Z"
        );
    }
}

/// Where the CLI puts the Dockerfile in a build's context tar (`dockerfile=` names it; COPY
/// never copies it).
pub const BUILD_DOCKERFILE_ENTRY: &str = ".space-build.Dockerfile";

/// `POST /v1/templates/{name}/pull`: an image from an OCI registry becomes a new version of
/// template `name`.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullTemplate {
    /// As `docker pull` takes it: `python:3.12-slim`, `localhost:5000/team/app@sha256:...`.
    pub reference: String,
    /// Basic credentials (also sent to a token realm that asks for them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Plain HTTP to the registry.
    #[serde(default)]
    pub insecure: bool,
    /// Make a new version when `name` exists (else that is a conflict).
    #[serde(default)]
    pub replace: bool,
}

impl std::fmt::Debug for PullTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullTemplate")
            .field("reference", &self.reference)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("insecure", &self.insecure)
            .field("replace", &self.replace)
            .finish()
    }
}

/// One line of a template's progress (pull, build): ndjson, ending with `done` or `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TemplateLog {
    /// Step `n` of `of`.
    Step { n: u32, of: u32, text: String },
    /// Worth knowing; did not stop the work.
    Note { text: String },
    /// A line a build step printed.
    Output { text: String },
    /// The new version.
    Done { template: Template },
    /// The work failed; nothing was left half-made.
    Error { error: ErrorDetail },
}

/// `GET /v1/templates/{name}`: every version, oldest first, and the template's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateDetail {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    pub versions: Vec<Template>,
}

/// `DELETE /v1/templates/{name}[?version=N]`: what was deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRemoved {
    pub name: String,
    pub versions: Vec<u32>,
}

/// `PUT /v1/templates/{name}/start`: a new version with these start settings. A field that is
/// absent keeps the newest version's; an empty string clears it; `start_cmd: "image"` is the
/// image's ENTRYPOINT and CMD.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTemplateStart {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_secs: Option<u64>,
}
