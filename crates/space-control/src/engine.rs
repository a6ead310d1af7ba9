//! The engine: one method per API action. The HTTP layer parses a request into typed
//! arguments and calls exactly one of these; they return DTOs or a [`ControlError`], a domain
//! error whose [`ErrorKind`](crate::ErrorKind) callers match on (`http::error` decides its
//! status). What a sandbox's lifecycle state allows is decided in [`check_lifecycle`],
//! nowhere else.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use rand::Rng;
use space_api::{
    CreateSandbox, DEFAULT_CPU, DEFAULT_MEMORY_MIB, DEFAULT_PIDS, DEFAULT_TEMPLATE, EntryInfo,
    ExecEvent, ExecRequest, MakeDirRequest, PathQuery, ProcessInfo, RenameRequest, Sandbox,
    SandboxState, SignalRequest, Template, WriteFileQuery, is_valid_env_key, is_valid_sandbox_id,
    is_valid_template_name,
};
use space_node_api::{
    GuestChannel, Limits, NodeApi, NodeError, RuntimeKind, SandboxSpec, SandboxStatus,
    TemplateSource,
};
use space_proto as pb;
use space_proto::guest_client::GuestClient;
use tokio::io::AsyncWriteExt;
use tokio::sync::{Notify, OwnedMutexGuard};

use crate::convert::{self, asks_node, sandbox_dto, template_dto};
use crate::error::{ControlError, ControlResult};
use crate::metrics::{Metrics, inc};
use crate::store::{SandboxRow, SandboxSpecRecord, Store, now_ms};

/// The runtimes as the API and the store write them: the node contract's kinds.
pub const RUNTIME_NAME: &str = RuntimeKind::Namespace.as_str();
/// The runtime of a VM per sandbox (decision 0014).
pub const MICROVM: &str = RuntimeKind::Microvm.as_str();
/// The runtimes a create may ask for (decision 0014).
pub const RUNTIMES: [&str; 2] = [RUNTIME_NAME, MICROVM];

/// Settings of the control plane.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// Holds space.db, admin.key and temporary uploads.
    pub data_dir: PathBuf,
    /// Limit of JSON (and stdin) request bodies.
    pub max_json_bytes: usize,
    /// Limit of streamed uploads (files, templates).
    pub max_upload_bytes: u64,
    /// How often the reconciler runs without being woken.
    pub reconcile_interval: Duration,
    /// How long a row may stay `creating` before the reconciler takes over its creation.
    pub create_grace: Duration,
    /// How long graceful shutdown waits for open requests (exec streams) before it gives up.
    pub shutdown_timeout: Duration,
    /// Egress of sandboxes created without a `network` (spaced's `--default-egress`).
    pub default_egress: space_api::Egress,
    /// The runtime recorded for creates that name none (`spaced --default-runtime`).
    pub default_runtime: String,
    /// Warm pool of the default template while no pool was set for it through the API
    /// (spaced's `--warm-pool`; None: no default pool). See `pools`.
    pub default_pool: Option<space_node_api::PoolConfig>,
    /// The template of creates that name none (spaced's `--default-template`; `base`).
    pub default_template: String,
    /// E2B's host form (spaced's `--e2b-domain`, decision 0030): a request for
    /// `PORT-ID.DOMAIN` goes to port PORT of sandbox ID, and replies name the domain.
    /// None: E2B's calls are routed by header only.
    pub e2b_domain: Option<String>,
    /// The certificate (PEM) of the CA spaced issues `e2b_domain`'s certificates from, for
    /// clients to trust (`GET /v1/e2b`, `space e2b ca`); None when spaced serves a
    /// certificate it was given, or no TLS.
    pub e2b_ca_pem: Option<String>,
    /// How long a joined node may be silent before it counts as lost (spaced control's
    /// `--node-lost-after`, decision 0037): its sandboxes with a replica are then restored
    /// on another node from their newest replicated snapshot, and the others marked lost.
    pub node_lost_after: Duration,
    /// How long events are kept (spaced's `--events-retention-days`); None: forever.
    pub events_retention: Option<Duration>,
    /// The disk limit of a namespace create that names none and whose tenant has no disk
    /// quota (spaced's `--default-disk`, decision 0043); None: no limit.
    pub default_disk_mib: Option<u64>,
}

impl ControlConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            max_json_bytes: 1024 * 1024,
            max_upload_bytes: 10 * 1024 * 1024 * 1024,
            reconcile_interval: Duration::from_secs(2),
            create_grace: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(5),
            default_egress: space_api::Egress::Open,
            default_runtime: RUNTIME_NAME.to_owned(),
            default_pool: Some(space_node_api::PoolConfig {
                min: 4,
                max: 32,
                microvm: false,
            }),
            default_template: DEFAULT_TEMPLATE.to_owned(),
            e2b_domain: None,
            e2b_ca_pem: None,
            node_lost_after: Duration::from_secs(300),
            events_retention: Some(crate::events::DEFAULT_RETENTION),
            default_disk_mib: None,
        }
    }
}

/// What an action wants to do with a sandbox, for the lifecycle check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Anything that talks to the guest: exec, processes, files.
    Guest,
    Delete,
    /// Take a disk snapshot (running or paused; a paused sandbox stays paused).
    Snapshot,
    /// Put the sandbox back on one of its snapshots (running, paused or stopped).
    Rollback,
    /// Create new sandboxes from one of its snapshots (running or paused).
    Fork,
}

/// The one place that says what each lifecycle state allows.
pub fn check_lifecycle(row: &SandboxRow, action: Action) -> ControlResult<()> {
    use SandboxState::*;
    match (action, row.state) {
        (Action::Delete, _) => Ok(()),
        (Action::Snapshot | Action::Fork, Running | Paused) => Ok(()),
        (Action::Rollback, Running | Paused | Stopped) => Ok(()),
        (Action::Snapshot | Action::Fork | Action::Rollback, _) => {
            Err(ControlError::conflict(format!(
                "sandbox {} is {}; {} needs it running",
                row.id,
                row.state,
                match action {
                    Action::Rollback => "rollback",
                    Action::Fork => "fork",
                    _ => "a snapshot",
                }
            )))
        }
        (Action::Guest, Running) => Ok(()),
        (Action::Guest, Creating) => Err(ControlError::conflict(format!(
            "sandbox {} is still being created",
            row.id
        ))),
        (Action::Guest, Deleting) => Err(ControlError::conflict(format!(
            "sandbox {} is being deleted",
            row.id
        ))),
        (Action::Guest, Paused) => Err(ControlError::conflict(format!(
            "sandbox {} is paused; resume it first",
            row.id
        ))),
        (Action::Guest, Stopped | Failed | Lost) => Err(ControlError::conflict(match &row.error {
            Some(e) => format!("sandbox {} is {} ({e})", row.id, row.state),
            None if row.state == Stopped => {
                format!("sandbox {} is stopped; resume starts it again", row.id)
            }
            None => format!("sandbox {} is {}", row.id, row.state),
        })),
    }
}

/// Per-sandbox async locks: the fast path and the reconciler never act on one id at once.
#[derive(Debug, Default)]
pub(crate) struct KeyedLocks(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl KeyedLocks {
    pub(crate) async fn lock(&self, id: &str) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(id.to_string()).or_default().clone()
        };
        m.lock_owned().await
    }

    pub(crate) fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }
}

/// A foreground exec's events, or a background exec's pid.
pub enum ExecReply {
    Events(BoxStream<'static, ExecEvent>),
    Background(u32),
}

pub struct Engine {
    pub(crate) store: Store,
    pub(crate) node: Arc<dyn NodeApi>,
    /// The cluster this control plane leads nodes of (`spaced control`); none all-in-one.
    pub(crate) cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Its nodes, which `node` routes to (the same object); placement asks it.
    pub(crate) cluster_nodes: Option<Arc<crate::cluster_nodes::ClusterNodes>>,
    pub(crate) cfg: ControlConfig,
    pub(crate) locks: KeyedLocks,
    /// Which replica works on a sandbox now, across replicas (see `leases`).
    pub(crate) leases: crate::leases::Leases,
    pub metrics: Metrics,
    pub(crate) wake: Notify,
    /// API activity per sandbox, for auto-pause (see `lifecycle`).
    pub(crate) activity: Arc<crate::lifecycle::Activity>,
    /// Events and audit (see `events`).
    pub(crate) events: crate::events::EventLog,
    /// When this engine started (unix ms): rows left `creating` before it are orphaned.
    pub(crate) boot_ms: i64,
    /// Automatic restarts after init deaths, for the crash-loop limit (see `recovery`).
    pub(crate) restarts: crate::recovery::Restarts,
    /// Secrets, sealed at rest (see `secrets`); also the node's secret source.
    pub(crate) vault: Arc<crate::secrets::SecretVault>,
    /// Signs port URLs (see `net`).
    pub(crate) ports: crate::net::PortSigner,
    /// Serializes warm-pool changes: API calls and the start-up restore (see `pools`).
    pub(crate) pools_lock: tokio::sync::Mutex<()>,
    /// The node agent's start time as last seen (`NodeInfo::started_unix_ms`; 0: not yet):
    /// when it changes, the node restarted and gets its warm pools again.
    pub(crate) node_started: std::sync::atomic::AtomicU64,
    /// Each sandbox's tenant, for the per-request ownership check (see `tenants`).
    pub(crate) owners: crate::tenants::Owners,
    /// Tenants' default replicas, read at most once a second (see `tenants`).
    pub(crate) tenant_defaults: crate::tenants::TenantDefaults,
}

pub(crate) fn new_sandbox_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..space_api::SANDBOX_ID_LEN)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn check_id(id: &str) -> ControlResult<()> {
    if is_valid_sandbox_id(id) {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid sandbox id {id:?}: expected 20 characters of [a-z0-9]"
        )))
    }
}

fn check_path(what: &str, path: &str) -> ControlResult<String> {
    if path.is_empty() {
        return Err(ControlError::invalid(format!("{what} is required")));
    }
    if !path.starts_with('/') {
        return Err(ControlError::invalid(format!(
            "{what} {path:?} must be an absolute path"
        )));
    }
    if path.contains('\0') || path.len() > 4096 {
        return Err(ControlError::invalid(format!("{what} is not a valid path")));
    }
    Ok(path.to_string())
}

/// Environment names the platform itself sets for the guest daemon (its default user and
/// working directory, DNS, CA, log level, ...): a request may not set any of them.
pub const RESERVED_ENV_PREFIX: &str = "SPACE_";

fn check_env(env: &std::collections::BTreeMap<String, String>) -> ControlResult<()> {
    for (k, v) in env {
        if !is_valid_env_key(k) {
            return Err(ControlError::invalid(format!(
                "invalid env key {k:?}: expected [A-Za-z_][A-Za-z0-9_]*"
            )));
        }
        if k.to_ascii_uppercase().starts_with(RESERVED_ENV_PREFIX) {
            return Err(ControlError::invalid(format!(
                "env key {k:?}: names starting with {RESERVED_ENV_PREFIX} are the platform's own"
            )));
        }
        if v.contains('\0') {
            return Err(ControlError::invalid(format!(
                "env value of {k} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

fn check_hostname(h: &str) -> ControlResult<()> {
    let ok = !h.is_empty()
        && h.len() <= 63
        && !h.starts_with('-')
        && !h.ends_with('-')
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid hostname {h:?}: 1-63 characters of [A-Za-z0-9-], not starting or ending with '-'"
        )))
    }
}

/// Applies defaults and checks every field of a create request (secrets are bound by the
/// engine, which looks them up).
pub fn validate_create(req: CreateSandbox, id: &str) -> ControlResult<SandboxSpecRecord> {
    validate_create_with(req, id, space_api::Egress::Open)
}

/// [`validate_create`] with the node's default egress.
pub fn validate_create_with(
    req: CreateSandbox,
    id: &str,
    default_egress: space_api::Egress,
) -> ControlResult<SandboxSpecRecord> {
    let network =
        crate::net::resolve_policy(&req.network.clone().unwrap_or_default(), default_egress)?;
    let template = req.template.unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
    if !is_valid_template_name(&template) {
        return Err(ControlError::invalid(format!(
            "invalid template name {template:?}"
        )));
    }
    let cpu = req.cpu.unwrap_or(DEFAULT_CPU);
    if !cpu.is_finite() || !(0.01..=64.0).contains(&cpu) {
        return Err(ControlError::invalid(format!(
            "cpu must be between 0.01 and 64 cores, got {cpu}"
        )));
    }
    let memory_mib = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
    if !(16..=1_048_576).contains(&memory_mib) {
        return Err(ControlError::invalid(format!(
            "memory_mib must be between 16 and 1048576, got {memory_mib}"
        )));
    }
    let pids = req.pids.unwrap_or(DEFAULT_PIDS);
    if !(8..=1_000_000).contains(&pids) {
        return Err(ControlError::invalid(format!(
            "pids must be between 8 and 1000000, got {pids}"
        )));
    }
    if let Some(d) = req.disk_mib
        && !(16..=16_777_216).contains(&d)
    {
        return Err(ControlError::invalid(format!(
            "disk_mib must be between 16 and 16777216, got {d}"
        )));
    }
    if let Some(r) = &req.rlimits {
        check_rlimits(r, memory_mib)?;
    }
    check_env(&req.env)?;
    check_metadata(&req.metadata)?;
    let hostname = req.hostname.unwrap_or_else(|| id.to_string());
    check_hostname(&hostname)?;
    if let Some(rt) = &req.runtime
        && !RUNTIMES.contains(&rt.as_str())
    {
        return Err(ControlError::invalid(format!(
            "unknown runtime {rt:?}: expected one of {}",
            RUNTIMES.join(", ")
        )));
    }
    Ok(SandboxSpecRecord {
        template,
        cpu,
        memory_mib,
        pids,
        disk_mib: req.disk_mib,
        rlimits: req.rlimits.filter(|r| *r != space_api::Rlimits::default()),
        env: req.env,
        metadata: req.metadata,
        hostname,
        network,
        secrets: Vec::new(),
        runtime: req.runtime,
        replicas: req.replicas.unwrap_or(0),
    })
}

/// A create's resource limits: open files within what Linux allows a process
/// (`fs.nr_open`'s default), core size and locked memory within the sandbox's memory.
fn check_rlimits(r: &space_api::Rlimits, memory_mib: u64) -> ControlResult<()> {
    if let Some(n) = r.nofile
        && !(16..=1_048_576).contains(&n)
    {
        return Err(ControlError::invalid(format!(
            "rlimits.nofile must be between 16 and 1048576, got {n}"
        )));
    }
    let memory = memory_mib << 20;
    for (name, v) in [("core", r.core), ("memlock", r.memlock)] {
        if let Some(v) = v
            && v > memory
        {
            return Err(ControlError::invalid(format!(
                "rlimits.{name} must be at most the sandbox's memory ({memory} bytes), got {v}"
            )));
        }
    }
    Ok(())
}

/// A `user` field: a name or numeric uid ("" for the sandbox's default user).
fn check_user(user: Option<&str>) -> ControlResult<String> {
    match user {
        None => Ok(String::new()),
        Some(u) if u.is_empty() || u.len() > 256 || u.contains(['\0', ':', '/']) => Err(
            ControlError::invalid("user must be a name or a numeric uid"),
        ),
        Some(u) => Ok(u.to_string()),
    }
}

/// Metadata limits: 64 entries, keys of 1..=128 bytes, values up to 512 bytes, no NUL.
fn check_metadata(m: &std::collections::BTreeMap<String, String>) -> ControlResult<()> {
    if m.len() > 64 {
        return Err(ControlError::invalid(format!(
            "at most 64 metadata entries, got {}",
            m.len()
        )));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > 128 || v.len() > 512 || k.contains('\0') || v.contains('\0') {
            return Err(ControlError::invalid(format!(
                "invalid metadata entry {k:?}: keys are 1..=128 bytes, values up to 512, no NUL"
            )));
        }
    }
    Ok(())
}

pub(crate) fn node_spec(id: &str, spec: &SandboxSpecRecord) -> SandboxSpec {
    SandboxSpec {
        id: id.to_string(),
        template: spec.template.clone(),
        limits: Limits {
            cpu_millis: ((spec.cpu * 1000.0).round() as u32).max(10),
            memory_mib: spec.memory_mib,
            pids: spec.pids,
            rlimits: spec.rlimits.map(node_rlimits).unwrap_or_default(),
            disk_mib: spec.disk_mib,
        },
        env: spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(
                spec.secrets
                    .iter()
                    .filter(|b| !b.inject)
                    .map(|b| (b.name.clone(), b.placeholder.clone())),
            )
            .collect(),
        hostname: spec.hostname.clone(),
        network: crate::net::node_network(&spec.network),
        secrets: crate::net::node_bindings(&spec.secrets),
        // Validated against RUNTIMES when the row was made.
        runtime: spec.runtime.as_deref().and_then(|r| r.parse().ok()),
    }
}

fn node_rlimits(r: space_api::Rlimits) -> space_node_api::Rlimits {
    space_node_api::Rlimits {
        nofile: r.nofile,
        core: r.core,
        memlock: r.memlock,
    }
}

/// Parses an octal mode ("644", "0755", "0o600").
fn parse_mode(mode: Option<&str>) -> ControlResult<u32> {
    let Some(m) = mode else { return Ok(0) };
    let digits = m.trim_start_matches("0o");
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|v| *v <= 0o7777)
        .ok_or_else(|| {
            ControlError::invalid(format!("invalid mode {m:?}: expected octal like 644"))
        })
}

fn is_terminal(ev: &ExecEvent) -> bool {
    matches!(ev, ExecEvent::Exit { .. } | ExecEvent::Error { .. })
}

/// Turns a guest event stream into public events. Stops after `Exit`; a failure midway
/// becomes a final `Error` event. With `require_exit`, an early end is an error too.
fn event_stream(
    first: Option<ExecEvent>,
    rest: tonic::Streaming<pb::ProcessEvent>,
    require_exit: bool,
) -> BoxStream<'static, ExecEvent> {
    struct St {
        pending: Option<ExecEvent>,
        inner: tonic::Streaming<pb::ProcessEvent>,
        done: bool,
        require_exit: bool,
    }
    let st = St {
        pending: first,
        inner: rest,
        done: false,
        require_exit,
    };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        if let Some(ev) = st.pending.take() {
            st.done = is_terminal(&ev);
            return Some((ev, st));
        }
        loop {
            match st.inner.message().await {
                Ok(Some(msg)) => {
                    if let Some(ev) = convert::exec_event(msg) {
                        st.done = is_terminal(&ev);
                        return Some((ev, st));
                    }
                }
                Ok(None) => {
                    st.done = true;
                    if st.require_exit {
                        let ev = ExecEvent::Error {
                            code: "unavailable".into(),
                            message: "the guest ended the stream before the process exited".into(),
                        };
                        return Some((ev, st));
                    }
                    return None;
                }
                Err(status) => {
                    st.done = true;
                    let e = ControlError::from(status);
                    let ev = ExecEvent::Error {
                        code: e.code().to_string(),
                        message: e.message,
                    };
                    return Some((ev, st));
                }
            }
        }
    })
    .boxed()
}

impl Engine {
    /// Builds the engine; opens (or creates) the key files `secrets.key` and `ports.key` in
    /// the data dir.
    pub fn new(
        store: Store,
        node: Arc<dyn NodeApi>,
        cfg: ControlConfig,
    ) -> Result<Self, crate::secrets::KeyFileError> {
        let vault = Arc::new(crate::secrets::SecretVault::open(
            store.clone(),
            &cfg.data_dir.join(crate::secrets::SECRETS_KEY_FILE),
        )?);
        let ports_path = cfg.data_dir.join(crate::secrets::PORTS_KEY_FILE);
        let ports_key = crate::secrets::load_or_create_key(&ports_path)?;
        crate::secrets::warn_if_loose(&ports_path);
        let events = crate::events::EventLog::spawn(store.clone());
        Ok(Self {
            leases: crate::leases::Leases::new(store.clone()),
            store,
            node,
            cluster: None,
            cluster_nodes: None,
            cfg,
            locks: KeyedLocks::default(),
            owners: Default::default(),
            tenant_defaults: Default::default(),
            metrics: Metrics::default(),
            wake: Notify::new(),
            activity: Arc::default(),
            events,
            boot_ms: now_ms(),
            restarts: Default::default(),
            vault,
            ports: crate::net::PortSigner::new(&ports_key),
            pools_lock: tokio::sync::Mutex::new(()),
            node_started: Default::default(),
        })
    }

    pub fn config(&self) -> &ControlConfig {
        &self.cfg
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Asks the reconciler for a pass now.
    pub fn wake_reconciler(&self) {
        self.wake.notify_one();
    }

    /// The single writer of sandbox status (fast path and reconciler alike).
    pub(crate) async fn write_status(
        &self,
        id: &str,
        state: SandboxState,
        error: Option<&str>,
    ) -> ControlResult<()> {
        tracing::info!(sandbox = id, state = %state, error, "sandbox status");
        self.store.set_status(id, state, error).await?;
        self.event(id, &state.to_string(), "ok", error.unwrap_or(""));
        Ok(())
    }

    async fn load(&self, id: &str) -> ControlResult<SandboxRow> {
        check_id(id)?;
        self.store
            .get_sandbox(id)
            .await?
            .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))
    }

    /// The guest client of a running sandbox (after the lifecycle check).
    pub(crate) async fn guest(&self, id: &str) -> ControlResult<GuestClient<GuestChannel>> {
        let row = self.load(id).await?;
        self.activity.touch(id);
        check_lifecycle(&row, Action::Guest)?;
        match self.node.guest(id).await {
            Ok(g) => Ok(g),
            Err(e) => {
                // Perhaps init died, or a removal raced us: let the reconciler look now, and
                // explain the failure by the sandbox's current state.
                self.wake_reconciler();
                match self.store.get_sandbox(id).await {
                    Ok(None) => Err(ControlError::not_found(format!("sandbox {id} not found"))),
                    Ok(Some(row)) => check_lifecycle(&row, Action::Guest).and(Err(e.into())),
                    Err(_) => Err(e.into()),
                }
            }
        }
    }

    /// Explains a failed guest call. Errors the guest chose (not found, bad argument...) pass
    /// through; a broken channel is explained by the sandbox's state, because the usual cause
    /// is a removal or stop racing the call: that is a 404 or 409, not a server fault.
    async fn explain_guest_error(&self, id: &str, status: tonic::Status) -> ControlError {
        use tonic::Code;
        if !matches!(
            status.code(),
            Code::Unknown
                | Code::Unavailable
                | Code::Cancelled
                | Code::Internal
                | Code::Aborted
                | Code::DeadlineExceeded
        ) {
            return status.into();
        }
        match self.store.get_sandbox(id).await {
            Ok(None) => ControlError::not_found(format!("sandbox {id} not found")),
            Ok(Some(row)) => match check_lifecycle(&row, Action::Guest) {
                Err(e) => e,
                Ok(()) => {
                    self.wake_reconciler();
                    status.into()
                }
            },
            Err(_) => status.into(),
        }
    }

    // ---- sandboxes ----

    /// A create for tenant `default` (the control plane's own work, and tests).
    pub async fn create_sandbox(&self, req: CreateSandbox) -> ControlResult<Sandbox> {
        self.create_sandbox_for(space_api::tenant::DEFAULT_TENANT, req)
            .await
    }

    /// A create of a sandbox of `tenant`.
    pub async fn create_sandbox_for(
        &self,
        tenant: &str,
        req: CreateSandbox,
    ) -> ControlResult<Sandbox> {
        self.create_with_id(tenant, req, new_sandbox_id()).await
    }

    /// A create of sandbox `id` for `tenant` (the id chosen by the caller: a retried
    /// idempotent create reuses the id its first try chose).
    pub(crate) async fn create_with_id(
        &self,
        tenant: &str,
        req: CreateSandbox,
        id: String,
    ) -> ControlResult<Sandbox> {
        let start = std::time::Instant::now();
        let now = now_ms();
        let lifecycle = crate::lifecycle::lifecycle_from_create(&req, &id, now)?;
        let snapshot_policy = crate::snapshot_policy::policy_from_create(&req, &id, now)?;
        let secret_names = req.secrets.clone();
        let secret_headers = req.secret_headers.clone();
        let req = CreateSandbox {
            template: req
                .template
                .or_else(|| Some(self.cfg.default_template.clone())),
            ..req
        };
        let asked_replicas = req.replicas;
        let mut spec = validate_create_with(req, &id, self.cfg.default_egress)?;
        // The template's settings: whether the tenant may use it (another tenant's private
        // template is one it does not have), and what the request left out.
        let t = self.store.template_settings(&spec.template).await?;
        if !t.visible_to(tenant) {
            return Err(ControlError::not_found(format!(
                "template {} not found",
                spec.template
            )));
        }
        spec.runtime.get_or_insert_with(|| {
            t.runtime
                .clone()
                .unwrap_or_else(|| self.cfg.default_runtime.clone())
        });
        if asked_replicas.is_none() {
            spec.replicas = match t.replicas {
                Some(n) => n,
                None => self.tenant_default_replicas(tenant).await?,
            };
        }
        self.check_replicas(spec.replicas)?;
        if spec.disk_mib.is_none() && spec.runtime.as_deref() != Some(MICROVM) {
            // Under a tenant's disk quota (or the node's default) every namespace sandbox
            // has a disk limit.
            spec.disk_mib = self.default_disk_for(tenant).await?;
        }
        spec.secrets = self.vault.bind(tenant, &secret_names, &spec.env).await?;
        let injected = self
            .vault
            .bind_headers(tenant, &secret_headers, spec.secrets.len())
            .await?;
        spec.secrets.extend(injected);
        self.node
            .validate_network(&crate::net::node_network(&spec.network))
            .await?;
        let row = SandboxRow {
            id: id.clone(),
            tenant: tenant.to_owned(),
            spec,
            state: SandboxState::Creating,
            error: None,
            generation: 1,
            deleted_at: None,
            created_at: now,
            updated_at: now,
        };
        let _guard = self.locks.lock(&id).await;
        self.insert_sandbox_row(&row).await?;
        self.owners.note(&id, tenant);
        let created_detail = format!(
            "template={} {}",
            row.spec.template,
            crate::net::policy_detail(&row.spec.network)
        );
        if let Some(l) = &lifecycle {
            self.store.put_lifecycle(l).await?;
        }
        if let Some(p) = &snapshot_policy {
            self.store.put_snapshot_policy(p).await?;
        }
        self.activity.touch(&id);
        let spec = node_spec(&id, &row.spec);
        let created = async {
            // The `create` event is recorded once this create's own writes are done (its
            // row, lifecycle, policy, claim): recording wakes the event writer, whose insert
            // would otherwise meet them at SQLite's write lock, where the loser sleeps 1 ms
            // or more in SQLite's busy handler.
            // Across nodes: where it goes, and why, is an event of its own.
            if let Some(nodes) = &self.cluster_nodes {
                let need = crate::scheduler::Need::of(&spec);
                let placed = nodes.place(&id, &spec.template, need).await;
                self.event(&id, "create", "ok", &created_detail);
                match placed {
                    Ok(p) => {
                        self.event(&id, "place", "ok", &format!("node={} {}", p.node, p.reason))
                    }
                    Err(e) => {
                        self.event(&id, "place", "error", &e.to_string());
                        return Err(e);
                    }
                }
            } else {
                self.event(&id, "create", "ok", &created_detail);
            }
            self.node.create_sandbox(&spec).await
        };
        match created.await {
            Ok(status) => {
                self.write_status(&id, SandboxState::Running, None).await?;
                inc(&self.metrics.sandboxes_created);
                let row = SandboxRow {
                    state: SandboxState::Running,
                    ..row
                };
                let mut sb = sandbox_dto(&row, Some(&status));
                crate::lifecycle::decorate(&mut sb, lifecycle.as_ref());
                self.metrics.create_seconds.since(start);
                Ok(sb)
            }
            Err(e) => {
                inc(&self.metrics.sandbox_create_errors);
                let err = ControlError::from(e);
                if err.kind.is_caller_error() {
                    // Nothing was created (unknown template, bad argument): forget the row.
                    let _ = self.node.remove_sandbox(&id).await;
                    self.store.delete_sandbox(&id).await?;
                    self.locks.forget(&id);
                } else {
                    let msg = format!("create failed: {}", err.message);
                    self.write_status(&id, SandboxState::Failed, Some(&msg))
                        .await?;
                    if let Err(e) = self.node.remove_sandbox(&id).await {
                        tracing::warn!(sandbox = %id, error = %e, "cleanup after failed create");
                        self.wake_reconciler();
                    }
                }
                Err(err)
            }
        }
    }

    pub async fn get_sandbox(&self, id: &str) -> ControlResult<Sandbox> {
        let row = self.load(id).await?;
        let mut node_unreachable = false;
        let status = match row.state {
            s if asks_node(s) => self.node.sandbox_status(id).await.unwrap_or_else(|e| {
                node_unreachable = matches!(e, NodeError::Unreachable { .. });
                tracing::warn!(sandbox = id, error = %e, "node status");
                None
            }),
            _ => None,
        };
        let mut sb = sandbox_dto(&row, status.as_ref());
        sb.node_unreachable = node_unreachable;
        self.decorate_one(&mut sb).await;
        if row.spec.replicas > 0 {
            sb.replica = self.replica_of(id).await?;
        }
        Ok(sb)
    }

    /// Every sandbox, or `tenant`'s only.
    pub async fn list_sandboxes(&self, tenant: Option<&str>) -> ControlResult<Vec<Sandbox>> {
        // What the nodes hold; a sandbox whose node did not answer is shown as unreachable
        // (all of them when the only node did not).
        let (observed, unseen, all_unseen): (HashMap<String, SandboxStatus>, _, _) =
            match self.node.observe().await {
                Ok(o) => (
                    o.sandboxes.into_iter().map(|s| (s.id.clone(), s)).collect(),
                    o.unseen,
                    false,
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "node list");
                    let unreachable = matches!(e, NodeError::Unreachable { .. });
                    (HashMap::new(), Default::default(), unreachable)
                }
            };
        let mut rows = self.store.list_sandboxes().await?;
        if let Some(t) = tenant {
            rows.retain(|r| r.tenant == t);
        }
        let mut list: Vec<Sandbox> = rows
            .iter()
            .map(|r| {
                let mut sb = sandbox_dto(r, observed.get(&r.id));
                sb.node_unreachable = asks_node(r.state) && (all_unseen || unseen.contains(&r.id));
                sb
            })
            .collect();
        self.decorate_all(&mut list).await;
        if rows.iter().any(|r| r.spec.replicas > 0) {
            let replicas = self.store.all_replicas().await?;
            for sb in &mut list {
                sb.replica = replicas.get(&sb.id).map(|r| r.dto());
            }
        }
        Ok(list)
    }

    /// Deletion: mark (finalizer), remove on the node, forget the row.
    pub async fn delete_sandbox(&self, id: &str) -> ControlResult<()> {
        check_id(id)?;
        let _guard = self.locks.lock(id).await;
        let row = self.load(id).await?;
        check_lifecycle(&row, Action::Delete)?;
        if row.state != SandboxState::Deleting {
            self.write_status(id, SandboxState::Deleting, None).await?;
        }
        self.finalize_delete(id).await?;
        inc(&self.metrics.sandboxes_deleted);
        Ok(())
    }

    /// Second half of deletion (also run by the reconciler): idempotent.
    pub(crate) async fn finalize_delete(&self, id: &str) -> ControlResult<()> {
        self.node.remove_sandbox(id).await?;
        self.forget_replica(id).await?;
        self.store.forget_snapshots_of(id).await?;
        self.store.delete_sandbox(id).await?;
        self.store.delete_lifecycle(id).await?;
        self.event(id, "deleted", "ok", "");
        self.restarts.forget(id);
        self.activity.forget(id);
        self.locks.forget(id);
        Ok(())
    }

    // ---- exec and processes ----

    pub async fn exec(&self, id: &str, req: ExecRequest) -> ControlResult<ExecReply> {
        let start = std::time::Instant::now();
        if req.cmd.is_empty() || req.cmd[0].is_empty() {
            return Err(ControlError::invalid("cmd must be a non-empty list"));
        }
        if req.cmd.iter().any(|a| a.contains('\0')) {
            return Err(ControlError::invalid("cmd contains a NUL byte"));
        }
        check_env(&req.env)?;
        if let Some(cwd) = &req.cwd {
            check_path("cwd", cwd)?;
        }
        check_user(req.user.as_deref())?;
        let background = req.background;
        let mut guest = self.guest(id).await?;
        inc(&self.metrics.execs);
        let preq = convert::exec_request(req);
        if background {
            return match guest.start(preq).await {
                Ok(reply) => {
                    self.metrics.exec_seconds.since(start);
                    Ok(ExecReply::Background(reply.into_inner().pid))
                }
                Err(s) => Err(self.explain_guest_error(id, s).await),
            };
        }
        // Errors before the first event (no such executable, bad user, bad cwd) are plain
        // HTTP errors; after it they are an `error` event.
        let first = match guest.exec(preq).await {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                stream.message().await.map(|first| (first, stream))
            }
            Err(s) => Err(s),
        };
        let (first, stream) = match first {
            Ok(v) => v,
            Err(s) => return Err(self.explain_guest_error(id, s).await),
        };
        let first = first.and_then(convert::exec_event);
        if first.is_none() {
            return Err(ControlError::unavailable(
                "the guest ended the exec stream before the process started",
            ));
        }
        self.metrics.exec_seconds.since(start);
        Ok(ExecReply::Events(
            self.activity.track(id, event_stream(first, stream, true)),
        ))
    }

    pub async fn list_processes(&self, id: &str) -> ControlResult<Vec<ProcessInfo>> {
        let mut guest = self.guest(id).await?;
        let reply = guest
            .list_processes(pb::ListProcessesRequest {})
            .await?
            .into_inner();
        Ok(reply
            .processes
            .into_iter()
            .map(convert::process_info)
            .collect())
    }

    /// Output of a process from `offset`; with `follow`, until it exits.
    pub async fn process_output(
        &self,
        id: &str,
        pid: u32,
        offset: u64,
        follow: bool,
    ) -> ControlResult<BoxStream<'static, ExecEvent>> {
        let mut guest = self.guest(id).await?;
        let mut stream = guest
            .attach(pb::AttachRequest {
                pid,
                offset,
                follow,
            })
            .await?
            .into_inner();
        // Surface early errors (unknown pid, offset out of range) as HTTP errors, without
        // holding the response back for long when a followed process is quiet.
        let first = match tokio::time::timeout(Duration::from_millis(100), stream.message()).await {
            Ok(Ok(Some(msg))) => convert::exec_event(msg),
            Ok(Ok(None)) => return Ok(futures::stream::empty().boxed()),
            Ok(Err(status)) => return Err(status.into()),
            Err(_elapsed) => None,
        };
        Ok(self.activity.track(id, event_stream(first, stream, false)))
    }

    pub async fn write_stdin(&self, id: &str, pid: u32, data: Bytes) -> ControlResult<()> {
        let mut guest = self.guest(id).await?;
        guest
            .write_stdin(pb::StdinRequest {
                pid,
                data: data.to_vec(),
            })
            .await?;
        Ok(())
    }

    pub async fn close_stdin(&self, id: &str, pid: u32) -> ControlResult<()> {
        let mut guest = self.guest(id).await?;
        guest.close_stdin(pb::PidRequest { pid }).await?;
        Ok(())
    }

    pub async fn signal(&self, id: &str, pid: u32, req: SignalRequest) -> ControlResult<()> {
        let signal = req
            .signal
            .number()
            .ok_or_else(|| ControlError::invalid(format!("unknown signal {:?}", req.signal)))?;
        let mut guest = self.guest(id).await?;
        guest
            .signal(pb::SignalRequest {
                pid,
                signal,
                group: req.group,
            })
            .await?;
        Ok(())
    }

    pub async fn resize(&self, id: &str, pid: u32, rows: u16, cols: u16) -> ControlResult<()> {
        if rows == 0 || cols == 0 {
            return Err(ControlError::invalid("rows and cols must be positive"));
        }
        let mut guest = self.guest(id).await?;
        guest
            .resize(pb::ResizeRequest {
                pid,
                rows: rows.into(),
                cols: cols.into(),
            })
            .await?;
        Ok(())
    }

    // ---- files ----

    /// A file's contents, streamed. Errors before the first chunk are HTTP errors.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
    ) -> ControlResult<BoxStream<'static, Result<Bytes, ControlError>>> {
        let path = check_path("path", path)?;
        let mut guest = self.guest(id).await?;
        let mut stream = guest
            .read_file(pb::ReadFileRequest {
                path,
                offset: 0,
                length: 0,
            })
            .await?
            .into_inner();
        let first = stream.message().await?;
        let Some(first) = first else {
            return Ok(futures::stream::empty().boxed());
        };
        let rest = futures::stream::unfold(stream, |mut s| async move {
            match s.message().await {
                Ok(Some(chunk)) => Some((Ok(Bytes::from(chunk.data)), s)),
                Ok(None) => None,
                Err(status) => {
                    tracing::warn!(status = ?status, "file read failed midway");
                    Some((Err(ControlError::from(status)), s))
                }
            }
        });
        Ok(
            futures::stream::once(async move { Ok(Bytes::from(first.data)) })
                .chain(rest)
                .boxed(),
        )
    }

    /// Streams `body` into a file (chunks of `space_proto::CHUNK_BYTES`), never buffering
    /// it whole, with `metadata` set on it as `user.e2b.*` extended attributes. Past the upload
    /// limit the write is aborted and 413 returned.
    pub async fn write_file<S, E>(
        &self,
        id: &str,
        q: WriteFileQuery,
        metadata: std::collections::HashMap<String, String>,
        content_length: Option<u64>,
        body: S,
    ) -> ControlResult<EntryInfo>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let path = check_path("path", &q.path)?;
        let mode = parse_mode(q.mode.as_deref())?;
        let user = check_user(q.user.as_deref())?;
        let limit = self.cfg.max_upload_bytes;
        if content_length.is_some_and(|n| n > limit) {
            return Err(too_large(limit));
        }
        let mut guest = self.guest(id).await?;
        let open = pb::WriteFileRequest {
            msg: Some(pb::write_file_request::Msg::Open(pb::WriteFileOpen {
                path: path.clone(),
                mode,
                make_parents: q.parents.unwrap_or(false),
                user,
                append: false,
                metadata,
            })),
        };
        let (abort_tx, abort_rx) = tokio::sync::oneshot::channel();
        let data = upload_chunks(body, limit, abort_tx).map(|data| pb::WriteFileRequest {
            msg: Some(pb::write_file_request::Msg::Data(data.to_vec())),
        });
        let reqs = futures::stream::once(async move { open }).chain(data);
        tokio::select! {
            r = guest.write_file(reqs) => Ok(convert::entry_info(r?.into_inner())),
            Ok(err) = abort_rx => {
                // The RPC was dropped (cancelled) above; remove what was written.
                let _ = guest.remove(pb::RemoveRequest { path, recursive: false }).await;
                Err(err)
            }
        }
    }

    pub async fn remove_file(&self, id: &str, q: PathQuery) -> ControlResult<()> {
        let path = check_path("path", &q.path)?;
        let mut guest = self.guest(id).await?;
        guest
            .remove(pb::RemoveRequest {
                path,
                recursive: q.recursive.unwrap_or(false),
            })
            .await?;
        Ok(())
    }

    /// Changes under the directory `path` (the daemon's inotify watch). Errors (no such
    /// directory) come before the stream; its first event is `started`. The stream ends when
    /// the sandbox's channel does (it stops, or is removed).
    pub async fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> ControlResult<BoxStream<'static, space_api::WatchEvent>> {
        let path = check_path("path", path)?;
        let mut guest = self.guest(id).await?;
        let stream = match guest.watch(pb::WatchRequest { path, recursive }).await {
            Ok(r) => r.into_inner(),
            Err(s) => return Err(self.explain_guest_error(id, s).await),
        };
        Ok(stream
            .take_while(|r| std::future::ready(r.is_ok()))
            .filter_map(|r| std::future::ready(r.ok().and_then(convert::watch_event)))
            .boxed())
    }

    pub async fn stat(&self, id: &str, path: &str) -> ControlResult<EntryInfo> {
        let path = check_path("path", path)?;
        let mut guest = self.guest(id).await?;
        let e = guest.stat(pb::PathRequest { path }).await?.into_inner();
        Ok(convert::entry_info(e))
    }

    pub async fn list_dir(&self, id: &str, q: PathQuery) -> ControlResult<Vec<EntryInfo>> {
        let path = check_path("path", &q.path)?;
        let mut guest = self.guest(id).await?;
        let reply = guest
            .list_dir(pb::ListDirRequest {
                path,
                depth: q.depth.unwrap_or(1),
            })
            .await?
            .into_inner();
        Ok(reply.entries.into_iter().map(convert::entry_info).collect())
    }

    pub async fn mkdir(&self, id: &str, req: MakeDirRequest) -> ControlResult<EntryInfo> {
        let path = check_path("path", &req.path)?;
        if req.mode.is_some_and(|m| m > 0o7777) {
            return Err(ControlError::invalid(
                "mode must be permission bits (<= 07777)",
            ));
        }
        let user = check_user(req.user.as_deref())?;
        let mut guest = self.guest(id).await?;
        let e = guest
            .make_dir(pb::MakeDirRequest {
                path,
                mode: req.mode.unwrap_or(0),
                parents: req.parents,
                user,
            })
            .await?
            .into_inner();
        Ok(convert::entry_info(e))
    }

    pub async fn rename(&self, id: &str, req: RenameRequest) -> ControlResult<EntryInfo> {
        let from = check_path("from", &req.from)?;
        let to = check_path("to", &req.to)?;
        let mut guest = self.guest(id).await?;
        let e = guest
            .rename(pb::RenameRequest {
                from,
                to,
                overwrite: req.overwrite,
            })
            .await?
            .into_inner();
        Ok(convert::entry_info(e))
    }

    // ---- templates ----

    /// The templates `tenant` may see (every one: None).
    pub async fn list_templates(&self, tenant: Option<&str>) -> ControlResult<Vec<Template>> {
        let list = self.node.list_templates().await?;
        let settings = self.store.all_template_settings().await?;
        let none = crate::template_settings::TemplateSettings::default();
        Ok(list
            .iter()
            // A build's steps and base images are the builder's (decision 0018).
            .filter(|t| !t.name.starts_with(crate::build::BUILD_PREFIX))
            .filter_map(|t| {
                let s = settings.get(&t.name).unwrap_or(&none);
                tenant
                    .is_none_or(|tenant| s.visible_to(tenant))
                    .then(|| s.apply(template_dto(t)))
            })
            .collect())
    }

    /// Streams a tar archive to a temporary file under the data dir, imports it, and
    /// deletes the file.
    pub async fn import_template<S, E>(
        &self,
        name: &str,
        replace: bool,
        content_length: Option<u64>,
        body: S,
    ) -> ControlResult<Template>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        // The body is read before anything is refused: a client cut short by an early answer
        // sees a broken pipe, not the error (the CLI checks the name first too).
        let tmp = self
            .receive_upload("template", content_length, body)
            .await?;
        crate::templates::check_template_name(name)?;
        self.check_name_free(name, replace).await?;
        let info = self
            .node
            .import_template(name, TemplateSource::Tar(tmp.0.clone()))
            .await?;
        self.template_out(&info).await
    }

    /// Streams an upload body to a temporary file under the data dir (removed when the
    /// returned path is dropped), within the upload limit; an empty body is refused.
    pub(crate) async fn receive_upload<S, E>(
        &self,
        what: &str,
        content_length: Option<u64>,
        mut body: S,
    ) -> ControlResult<TempPath>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let limit = self.cfg.max_upload_bytes;
        if content_length.is_some_and(|n| n > limit) {
            return Err(too_large(limit));
        }
        let tmp_dir = self.cfg.data_dir.join("tmp");
        // Uploads and downloads pass through it: no other host user may list or read them.
        crate::dir_with_mode(&tmp_dir, 0o700).map_err(|e| {
            ControlError::internal(format_args!("create {}: {e}", tmp_dir.display()))
        })?;
        let tmp = TempPath(tmp_dir.join(format!("{what}-{}.tar", new_sandbox_id())));
        let mut file = tokio::fs::File::create(&tmp.0)
            .await
            .map_err(|e| ControlError::internal(format_args!("create {}: {e}", tmp.0.display())))?;
        let mut total = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk =
                chunk.map_err(|e| ControlError::invalid(format!("upload interrupted: {e}")))?;
            total += chunk.len() as u64;
            if total > limit {
                return Err(too_large(limit));
            }
            file.write_all(&chunk).await.map_err(|e| {
                ControlError::internal(format_args!("write {}: {e}", tmp.0.display()))
            })?;
        }
        file.flush()
            .await
            .map_err(|e| ControlError::internal(format_args!("write {}: {e}", tmp.0.display())))?;
        if total == 0 {
            return Err(ControlError::invalid(format!(
                "the {what} archive is empty"
            )));
        }
        Ok(tmp)
    }

    // ---- service ----

    /// Prometheus text exposition: the control plane's [`Metrics`], sandboxes by state and
    /// the node's series (see `metrics`).
    pub async fn metrics_text(&self) -> ControlResult<String> {
        let sandboxes = self.store.count_by_state().await?;
        Ok(self.metrics.render(&sandboxes, &self.node.metrics().await))
    }
}

fn too_large(limit: u64) -> ControlError {
    ControlError::too_large(format!("upload exceeds the limit of {limit} bytes"))
}

/// Removes a file when dropped.
pub(crate) struct TempPath(pub(crate) PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Re-chunks an upload body into pieces of at most `CHUNK_BYTES`, counting bytes. Past
/// `limit`, or when the body fails, it reports on `abort` and then never ends, so the RPC
/// that consumes it cannot finish as if the upload were complete.
fn upload_chunks<S, E>(
    body: S,
    limit: u64,
    abort: tokio::sync::oneshot::Sender<ControlError>,
) -> impl Stream<Item = Bytes> + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display + Send + 'static,
{
    struct St<S> {
        body: S,
        total: u64,
        buf: BytesMut,
        abort: Option<tokio::sync::oneshot::Sender<ControlError>>,
        ended: bool,
    }
    let st = St {
        body,
        total: 0,
        buf: BytesMut::new(),
        abort: Some(abort),
        ended: false,
    };
    let chunk = pb::CHUNK_BYTES;
    futures::stream::unfold(st, move |mut st| async move {
        loop {
            if st.buf.len() >= chunk || (st.ended && !st.buf.is_empty()) {
                let n = st.buf.len().min(chunk);
                let out = st.buf.split_to(n).freeze();
                return Some((out, st));
            }
            if st.ended {
                return None;
            }
            let fail = match st.body.next().await {
                Some(Ok(b)) => {
                    st.total += b.len() as u64;
                    if st.total > limit {
                        Some(too_large(limit))
                    } else {
                        st.buf.extend_from_slice(&b);
                        None
                    }
                }
                Some(Err(e)) => Some(ControlError::invalid(format!("upload interrupted: {e}"))),
                None => {
                    st.ended = true;
                    None
                }
            };
            if let Some(err) = fail {
                if let Some(tx) = st.abort.take() {
                    let _ = tx.send(err);
                }
                futures::future::pending::<()>().await;
            }
        }
    })
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
