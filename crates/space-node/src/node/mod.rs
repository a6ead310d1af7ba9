//! The in-process node agent: implements [`NodeApi`] over storage, templates, a [`Runtime`]
//! and the guest channel.
//!
//! Every operation is idempotent on the sandbox id and serialized per id (different ids run
//! in parallel). The in-memory table is rebuilt from `sandbox.json` records on open; running
//! sandboxes are adopted (their channel is reconnected), never restarted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::api::GuestChannel;
use async_trait::async_trait;
use futures::StreamExt;
use tracing::Instrument;

use crate::api::moves::{MoveStep, MoveStream, Received};
use crate::api::{
    NodeApi, NodeError, Observation, Phase, PoolConfig, PoolStatus, RuntimeKind, SandboxSpec,
    SandboxStatus, SnapshotInfo, TemplateInfo, TemplateSource,
};
use crate::channel::{GuestConnector, UnixConnector};
use crate::ids::{self, UidAllocator};
use crate::net::{NetConfig, NetError, Network, NetworkSpec, SecretSource};
use crate::runtime::{LaunchPlan, Launched, Runtime, SlotNetns};
use crate::state::{RECORD_VERSION, SandboxRecord, now_unix_ms};
use crate::storage::{self, Layout, StorageError, Subvolumes};
use crate::template::{TemplateError, TemplateStore};

/// A microvm sandbox's disk image in its sandbox dir.
pub const SANDBOX_DISK: &str = "disk.ext4";

/// The environment a template's processes start with: a login shell's basics, the template's
/// defaults (a login shell's environment in `base`), then `create_env`; and, for the daemon
/// only (it strips them), the template's default user and working directory.
pub(crate) fn template_env(
    defaults: &crate::api::TemplateDefaults,
    hostname: &str,
    create_env: &[(String, String)],
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
        ("TERM".into(), "xterm-256color".into()),
        ("HOSTNAME".into(), hostname.to_owned()),
    ];
    for (k, v) in &defaults.env {
        env.retain(|(k2, _)| k2 != k);
        env.push((k.clone(), v.clone()));
    }
    env.retain(|(k, _)| !create_env.iter().any(|(k2, _)| k2 == k));
    env.extend(create_env.iter().cloned());
    if let Some(user) = &defaults.user {
        // Who runs what names no user.
        env.push((space_proto::DEFAULT_USER_ENV.into(), user.clone()));
    }
    if let Some(dir) = &defaults.workdir {
        // Where an exec that names no cwd starts.
        env.push((space_proto::DEFAULT_CWD_ENV.into(), dir.clone()));
    }
    env
}

/// The ext4 image of a template version, next to its rootfs subvolume.
fn template_disk(template_rootfs: &Path) -> PathBuf {
    template_rootfs.with_file_name(SANDBOX_DISK)
}

/// Base environment of every sandbox (the spec's env is added on top and wins).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Configuration of the node agent.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Persistent state: templates, sandbox rootfs and records. Default `/var/lib/space`.
    pub data_dir: PathBuf,
    /// Runtime state (sockets, logs); lost on reboot, like the sandboxes' processes.
    /// Default `/run/space`.
    pub run_dir: PathBuf,
    /// Size of the sparse btrfs image created when `data_dir` is not btrfs. Default 16 GiB.
    pub image_size_bytes: u64,
    /// The static space-daemon binary on the host (bind-mounted into every sandbox).
    /// Default `/usr/local/lib/space/space-daemon`.
    pub daemon_binary: PathBuf,
    /// Static busybox the `minimal` template is built from. Default `/bin/busybox`
    /// (Debian's busybox-static).
    pub busybox: PathBuf,
    /// The machine's cache of the Debian `base` rootfs (`rootfs/`, `defaults.json`), made by
    /// the setup scripts; imported on open when the node has no Debian `base` yet. None: no
    /// `base` (decision 0016).
    pub base_cache: Option<PathBuf>,
    /// First host uid/gid of the sandbox ranges. Default 1_000_000_000.
    pub uid_base_start: u32,
    /// Ids per sandbox (root inside = `uid_base` outside). Default 65536.
    pub uid_count: u32,
    /// Cgroup (per v1 controller, or in the v2 tree) under which sandboxes get `<id>`.
    /// Default `space`.
    pub cgroup_parent: String,
    /// Output kept per process for reconnects (space-daemon's ring). Default 1 MiB.
    pub output_buffer_bytes: u64,
    /// How long finished processes stay listed and attachable. Default 600 s.
    pub exited_retention_secs: u64,
    /// Networking: slots, egress policy, DNS, proxy (decision 0012).
    pub net: NetConfig,
    /// The microvm runtime (decision 0014), made on first use; None: off. Its daemon binary,
    /// work dir and run root are filled from the fields above.
    pub microvm: Option<crate::runtime::microvm::MicrovmConfig>,
    /// The runtime of a create that names none.
    pub default_runtime: RuntimeKind,
    /// How often every sandbox's cgroup counters are sampled (`usage.rs`); zero: never.
    /// Default 5 s.
    pub usage_interval: std::time::Duration,
    /// Per-sandbox disk limits (decision 0043): simple quotas are turned on for the volume
    /// when it opens. Default on.
    pub disk_quotas: bool,
    /// MiB of MemAvailable below which new sandboxes are refused (decision 0049); 0: never.
    pub min_free_memory_mib: u64,
    /// How long a namespace sandbox's daemon connection may go unused before the node closes
    /// it (decision 0064); the next call connects again. Zero: never. Default 30 s.
    pub guest_idle: std::time::Duration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/var/lib/space"),
            run_dir: PathBuf::from("/run/space"),
            image_size_bytes: 16 << 30,
            daemon_binary: PathBuf::from("/usr/local/lib/space/space-daemon"),
            busybox: PathBuf::from("/bin/busybox"),
            base_cache: None,
            uid_base_start: 1_000_000_000,
            uid_count: 65536,
            cgroup_parent: "space".to_owned(),
            output_buffer_bytes: 1 << 20,
            exited_retention_secs: 600,
            net: NetConfig::default(),
            microvm: Some(Default::default()),
            default_runtime: RuntimeKind::Namespace,
            usage_interval: std::time::Duration::from_secs(5),
            disk_quotas: true,
            min_free_memory_mib: 256,
            guest_idle: std::time::Duration::from_secs(30),
        }
    }
}

/// The kernel-facing parts of a node, replaceable in tests.
pub struct NodeParts {
    /// Root of the btrfs volume (templates/ and sandboxes/ are created under it).
    pub volume_root: PathBuf,
    pub subvols: Arc<dyn Subvolumes>,
    /// The default runtime (namespace).
    pub runtime: Arc<dyn Runtime>,
    /// The microvm runtime, or why this node has none (decision 0014); None: made from
    /// `NodeConfig::microvm` on first use.
    pub microvm: Option<Result<Arc<dyn Runtime>, String>>,
    pub connector: Arc<dyn GuestConnector>,
    /// None: sandboxes get an empty network namespace (loopback only).
    pub network: Option<Arc<Network>>,
}

#[derive(Clone)]
struct Entry {
    record: SandboxRecord,
    client: Option<GuestChannel>,
    /// When `client` was last handed out (or set): a namespace sandbox's connection unused
    /// for `NodeConfig::guest_idle` is closed (decision 0064).
    used: std::time::Instant,
}

impl Entry {
    fn new(record: SandboxRecord, client: Option<GuestChannel>) -> Entry {
        Entry {
            record,
            client,
            used: std::time::Instant::now(),
        }
    }
}

pub struct Node {
    cfg: NodeConfig,
    layout: Layout,
    subvols: Arc<dyn Subvolumes>,
    runtime: Arc<dyn Runtime>,
    microvm: tokio::sync::OnceCell<Result<Arc<dyn Runtime>, String>>,
    connector: Arc<dyn GuestConnector>,
    templates: Arc<TemplateStore>,
    /// Unpacked image layers (`images.rs`).
    layers: Arc<crate::oci::LayerCache>,
    table: Mutex<HashMap<String, Entry>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    uids: Mutex<UidAllocator>,
    network: Option<Arc<Network>>,
    /// Warm pools of ready sandboxes, per template (decision 0013; `pools.rs`).
    pools: pools::PoolService,
    /// Every sandbox's snapshot tree (`snapshots.rs`).
    snapshots: snapshots::SnapshotStore,
    /// Templates' warm microvm checkpoints being made (`vm_warm.rs`).
    vm_warm: vm_warm::VmWarm,
    /// Recent cgroup samples per sandbox (`usage.rs`).
    usage: usage::UsageHistory,
    /// When this node agent opened: a control plane that sees it change knows the node
    /// restarted (and lost its warm pools' settings).
    opened_unix_ms: u64,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("volume", &self.layout.volume)
            .field("run_dir", &self.layout.run_dir)
            .field("runtime", &self.runtime.kind())
            .finish_non_exhaustive()
    }
}

impl From<StorageError> for NodeError {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::Unsupported(m) => NodeError::InvalidArgument(m),
            e => NodeError::Internal(e.to_string()),
        }
    }
}

impl From<TemplateError> for NodeError {
    fn from(e: TemplateError) -> Self {
        match e {
            TemplateError::Source(m) | TemplateError::Image(m) | TemplateError::Registry(m) => {
                NodeError::InvalidArgument(m)
            }
            TemplateError::ImageNotFound(r) => NodeError::NotFound {
                kind: "image",
                id: r,
            },
            e @ TemplateError::Unpack(crate::oci::unpack::UnpackError::Entry { .. })
            | e @ TemplateError::Unpack(crate::oci::unpack::UnpackError::Stream(_)) => {
                NodeError::InvalidArgument(e.to_string())
            }
            e => NodeError::Internal(e.to_string()),
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, NodeError> + Send + 'static,
) -> Result<T, NodeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| NodeError::Internal(format!("blocking task failed: {e}")))?
}

impl Node {
    /// Opens the node: prepares the btrfs volume (loop image if needed), builds the `base`
    /// template if missing, starts the namespace runtime, and adopts running sandboxes.
    pub async fn open(cfg: NodeConfig) -> Result<Arc<Node>, NodeError> {
        // A node holds a descriptor per sandbox (its daemon's channel, decision 0059) and
        // warm pools keep thousands of sandboxes.
        match space_sys::process::raise_open_file_limit() {
            Ok(limit) => tracing::debug!(?limit, "open file limit raised"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the open file limit"),
        }
        let (data_dir, size) = (cfg.data_dir.clone(), cfg.image_size_bytes);
        let volume = blocking(move || Ok(storage::prepare_volume(&data_dir, size)?)).await?;
        let (root, quotas) = (volume.root.clone(), cfg.disk_quotas);
        let subvols = blocking(move || Ok(crate::quota::open_btrfs(&root, quotas))).await?;
        let runtime = crate::runtime::namespace::NamespaceRuntime::new(
            crate::runtime::namespace::NamespaceConfig {
                cgroup_parent: cfg.cgroup_parent.clone(),
                ..Default::default()
            },
        )
        .map_err(|e| NodeError::Internal(format!("namespace runtime: {e}")))?;
        if !cfg.daemon_binary.is_file() {
            tracing::warn!(path = %cfg.daemon_binary.display(),
                "space-daemon binary not found; sandboxes will fail to start");
        }
        let network = if cfg.net.enabled {
            Some(
                Network::open(cfg.net.clone(), &cfg.data_dir, &cfg.run_dir)
                    .await
                    .map_err(|e| NodeError::Internal(format!("networking: {e}")))?,
            )
        } else {
            tracing::warn!("networking is off: sandboxes get loopback only");
            None
        };
        Self::open_with(
            cfg,
            NodeParts {
                volume_root: volume.root,
                subvols: Arc::new(subvols),
                runtime: Arc::new(runtime),
                microvm: None,
                connector: Arc::new(UnixConnector::default()),
                network,
            },
        )
        .await
    }

    /// Opens the node over the given parts (tests pass fakes).
    pub async fn open_with(cfg: NodeConfig, parts: NodeParts) -> Result<Arc<Node>, NodeError> {
        let layout = Layout {
            volume: parts.volume_root,
            run_dir: cfg.run_dir.clone(),
        };
        layout.create_dirs()?;
        let (templates, layers) = {
            let (layout, subvols, busybox, base_cache) = (
                layout.clone(),
                parts.subvols.clone(),
                cfg.busybox.clone(),
                cfg.base_cache.clone(),
            );
            blocking(move || {
                let store = TemplateStore::load(layout.clone(), subvols.clone())?;
                store.ensure_minimal(&busybox)?;
                store.ensure_base(base_cache.as_deref())?;
                let _ = std::fs::remove_dir_all(layout.oci_tmp());
                let layers = crate::oci::LayerCache::open(layout.oci_layers(), subvols)?;
                Ok((Arc::new(store), Arc::new(layers)))
            })
            .await?
        };
        let node = Arc::new(Node {
            uids: Mutex::new(UidAllocator::new(cfg.uid_base_start, cfg.uid_count)?),
            cfg,
            snapshots: snapshots::SnapshotStore::new(layout.clone(), parts.subvols.clone()),
            layout,
            subvols: parts.subvols,
            runtime: parts.runtime,
            microvm: match parts.microvm {
                Some(made) => tokio::sync::OnceCell::new_with(Some(made)),
                None => tokio::sync::OnceCell::new(),
            },
            connector: parts.connector,
            templates,
            layers,
            table: Mutex::new(HashMap::new()),
            locks: Mutex::new(HashMap::new()),
            network: parts.network,
            pools: Default::default(),
            vm_warm: Default::default(),
            usage: Default::default(),
            opened_unix_ms: now_unix_ms(),
        });
        node.recover().await?;
        node.start_pool_refill();
        node.start_vm_warm();
        node.start_usage_sampler();
        node.start_idle_guest_closer();
        Ok(node)
    }

    /// A free uid range for a new sandbox (its base).
    fn allocate_uids(&self) -> Result<u32, NodeError> {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allocate()
    }

    /// Gives the uid range at `base` back.
    fn free_uids(&self, base: u32) {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free(base);
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(id.to_string()).or_default().clone()
    }

    /// Drops the per-id lock when nobody else holds or waits on it.
    fn release_lock(&self, id: &str, lock: Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        // One reference in the map, one here.
        if Arc::strong_count(&lock) == 2 {
            locks.remove(id);
        }
    }

    fn entry(&self, id: &str) -> Option<Entry> {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    /// The entry of a sandbox whose init runs: NotFound, or Unavailable when stopped.
    fn running_entry(&self, id: &str) -> Result<Entry, NodeError> {
        let entry = self.entry(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.to_string(),
        })?;
        if !self.is_running(&entry.record) {
            return Err(NodeError::Unavailable {
                id: id.to_string(),
                reason: "sandbox is stopped".into(),
            });
        }
        Ok(entry)
    }

    /// The runtime of `kind`: the microvm one when this node has it, else the default one (a
    /// record of a runtime this node lacks fails on use, not here).
    fn rt_of(&self, kind: RuntimeKind) -> &Arc<dyn Runtime> {
        match self.microvm.get() {
            Some(Ok(vm)) if kind == vm.kind() => vm,
            _ => &self.runtime,
        }
    }

    /// The microvm runtime, made on first use (QEMU and the guest kernel are checked, the
    /// initramfs built, the accelerator probed); the error says why this node has none.
    async fn microvm(&self) -> Result<&Arc<dyn Runtime>, &str> {
        let made = self
            .microvm
            .get_or_init(|| async {
                let Some(mut cfg) = self.cfg.microvm.clone() else {
                    return Err("the microvm runtime is off (spaced --microvm off)".to_owned());
                };
                cfg.daemon_binary = self.cfg.daemon_binary.clone();
                cfg.work_dir = self.cfg.run_dir.join("microvm");
                cfg.run_root = Some(self.layout.run_sandboxes());
                // Guest RAM in files on the run dir (a tmpfs: decision 0014, "Memory
                // checkpoints"), so that templates' warm checkpoints can be made and restored.
                cfg.memory_dir
                    .get_or_insert_with(|| self.cfg.run_dir.join("microvm").join("mem"));
                let made = tokio::task::spawn_blocking(move || {
                    crate::runtime::microvm::MicrovmRuntime::new(cfg)
                })
                .await;
                match made {
                    Ok(Ok(rt)) => {
                        tracing::info!(
                            accel = rt.accel(),
                            note = rt.accel_note(),
                            "microvm runtime ready"
                        );
                        Ok(Arc::new(rt) as Arc<dyn Runtime>)
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "microvm runtime unavailable");
                        Err(e.to_string())
                    }
                    Err(e) => Err(format!("microvm setup task failed: {e}")),
                }
            })
            .await;
        made.as_ref().map_err(String::as_str)
    }

    /// The runtime of the sandbox of `rec`.
    fn rt(&self, rec: &SandboxRecord) -> &Arc<dyn Runtime> {
        self.rt_of(rec.runtime)
    }

    /// The runtime of `kind`, made on first use; the error says why this node has none.
    async fn runtime_for(&self, kind: RuntimeKind) -> Result<&Arc<dyn Runtime>, NodeError> {
        if kind == self.runtime.kind() {
            return Ok(&self.runtime);
        }
        match self.microvm().await {
            Ok(rt) if rt.kind() == kind => Ok(rt),
            Ok(_) => Err(NodeError::InvalidArgument(format!(
                "runtime {kind} is not available on this node"
            ))),
            Err(why) => Err(NodeError::InvalidArgument(format!(
                "runtime {kind} is not available on this node: {why}"
            ))),
        }
    }

    /// How the files of the sandbox of `rec` are kept (decision 0057).
    fn disk(&self, rec: &SandboxRecord) -> &'static dyn disk::Disk {
        disk::of(rec.runtime)
    }

    /// Where the files of sandbox `id` are, for its [`disk::Disk`].
    fn at<'a>(&'a self, id: &'a str) -> disk::At<'a> {
        disk::At::new(&self.layout, self.subvols.as_ref(), id)
    }

    /// Graceful shutdown: destroys the warm pools' ready sandboxes, a template checkpoint's
    /// builder VM if one is booting, and frees the ready (unused) network slots. Sandboxes,
    /// their slots and their processes stay, to be adopted by the next start.
    pub async fn shutdown(&self) {
        self.close_pools().await;
        self.destroy_stale_builders().await;
        if let Some(n) = &self.network {
            n.close().await;
        }
    }

    /// Lets the egress proxy ask the control plane for secret values.
    pub fn set_secret_source(&self, source: Arc<dyn SecretSource>) {
        if let Some(n) = &self.network {
            n.set_secret_source(source);
        }
    }

    /// Gives the sandbox of `rec` a network slot unless it has one; records it in `rec`.
    /// Returns whether a slot was attached now (to undo on a failed launch).
    async fn ensure_slot(&self, rec: &mut SandboxRecord) -> Result<bool, NodeError> {
        let Some(net) = &self.network else {
            return Ok(false);
        };
        let id = &rec.spec.id;
        if net.is_attached(id) {
            return Ok(false);
        }
        let slot = net
            .attach(id, &rec.spec.network, &rec.spec.secrets)
            .await
            .map_err(|e| e.for_sandbox(id))?;
        rec.slot = Some(slot);
        Ok(true)
    }

    /// Writes the table's record of `id` to its sandbox.json.
    async fn persist(&self, id: &str, durable: bool) -> Result<(), NodeError> {
        let Some(e) = self.entry(id) else {
            return Ok(());
        };
        let path = self.layout.sandbox_record(id);
        blocking(move || Ok(storage::write_json_atomic(&path, &e.record, durable)?)).await
    }

    /// The base environment of the sandbox's processes (with the daemon's own settings, which
    /// it strips): for a launch, and for handing out a warm pool's sandbox.
    fn sandbox_env(&self, rec: &SandboxRecord) -> Vec<(String, String)> {
        let (spec, runtime) = (&rec.spec, rec.runtime);
        let defaults = self
            .templates
            .get(&spec.template, rec.template_version)
            .map(|t| t.defaults)
            .unwrap_or_default();
        let mut env = template_env(&defaults, &spec.hostname, &spec.env);
        env.push(("SPACE_SANDBOX_ID".into(), spec.id.clone()));
        // For the daemon only (it strips these from the processes it starts).
        env.push((
            "SPACE_OUTPUT_BUFFER_BYTES".into(),
            self.cfg.output_buffer_bytes.to_string(),
        ));
        env.push((
            "SPACE_EXITED_RETENTION_SECS".into(),
            self.cfg.exited_retention_secs.to_string(),
        ));
        if let Some(n) = &self.network
            && let Some(slot) = n.slot(&spec.id)
        {
            // The node's DNS as the sandbox reaches it, and the CA of intercepted TLS
            // (decision 0012).
            let dns = self.rt_of(runtime).dns_address(slot.gateway);
            env.push(("SPACE_DNS".into(), dns.to_string()));
            env.push(("SPACE_CA_PEM".into(), n.ca_pem()));
            for (k, v) in [
                ("SSL_CERT_FILE", "/etc/space/ca-bundle.pem"),
                ("REQUESTS_CA_BUNDLE", "/etc/space/ca-bundle.pem"),
                ("CURL_CA_BUNDLE", "/etc/space/ca-bundle.pem"),
                ("NODE_EXTRA_CA_CERTS", "/etc/space/ca.pem"),
            ] {
                if !spec.env.iter().any(|(k2, _)| k2 == k) {
                    env.push((k.into(), v.into()));
                }
            }
        }
        env
    }

    fn launch_plan(&self, rec: &SandboxRecord) -> Result<LaunchPlan, NodeError> {
        let spec = &rec.spec;
        let env = self.sandbox_env(rec);
        let netns = match &self.network {
            Some(n) => n
                .netns(&spec.id)
                .map_err(|e| e.for_sandbox(&spec.id))?
                .map(|ns| SlotNetns {
                    ns,
                    home: n.home_netns(),
                }),
            None => None,
        };
        let name = rec.runtime_name();
        Ok(LaunchPlan {
            id: name.to_owned(),
            rootfs: self.layout.sandbox_rootfs(&spec.id),
            uid_base: rec.uid_base,
            id_count: rec.uid_count,
            hostname: spec.hostname.clone(),
            limits: spec.limits,
            env,
            daemon_binary: self.cfg.daemon_binary.clone(),
            channel_socket: self.layout.channel_socket(name),
            run_dir: self.layout.run_sandbox_dir(name),
            netns,
            disk: self.disk(rec).device(self.at(&spec.id)),
        })
    }

    /// Launches the sandbox of `rec` (rootfs and record exist) and connects its channel.
    /// On error nothing of the launch is left running.
    /// With `from`, a microvm sandbox is restored from that checkpoint instead of booted
    /// (`build_new` falls back to a boot when that fails).
    async fn launch(
        &self,
        rec: &mut SandboxRecord,
        from: Option<&Path>,
    ) -> Result<(Launched, GuestChannel), NodeError> {
        let attached = self
            .ensure_slot(rec)
            .instrument(tracing::debug_span!("build.slot"))
            .await?;
        if !attached && let Some(net) = &self.network {
            // A restart, rollback or checkpoint restore: the spec may carry a newer policy.
            net.update(&rec.spec.id, &rec.spec.network)
                .await
                .map_err(|e| e.for_sandbox(&rec.spec.id))?;
        }
        let result = self.launch_in_slot(rec, from).await;
        if result.is_ok() {
            rec.restored = from.is_some();
        }
        if result.is_err()
            && attached
            && let Some(net) = &self.network
        {
            net.detach(&rec.spec.id).await;
            rec.slot = None;
        }
        result
    }

    async fn launch_in_slot(
        &self,
        rec: &SandboxRecord,
        from: Option<&Path>,
    ) -> Result<(Launched, GuestChannel), NodeError> {
        let id = rec.spec.id.clone();
        // The runtime's init (host uid `uid_base`) attaches the idmapped rootfs at its host
        // path, so it must be able to traverse `sandboxes/<id>`. Owning it (0700) lets it,
        // while other host users still cannot reach the sandbox's files (which include
        // set-uid binaries owned by on-disk uid 0).
        let dir = self.layout.sandbox_dir(&id);
        std::os::unix::fs::chown(&dir, Some(rec.uid_base), Some(rec.uid_base))
            .map_err(|e| StorageError::io("chown", &dir, e))?;
        let plan = self.launch_plan(rec)?;
        storage::remove_tree(&plan.run_dir)?;
        storage::mkdir_private(&plan.run_dir)?;
        let launched = match from {
            Some(ckpt) => self.rt(rec).restore(&plan, ckpt).await.map_err(|e| {
                NodeError::Internal(format!(
                    "failed to restore sandbox {id} from {}: {e}",
                    ckpt.display()
                ))
            })?,
            None => self
                .rt(rec)
                .launch(&plan)
                .instrument(tracing::debug_span!("build.launch"))
                .await
                .map_err(|e| NodeError::Internal(format!("failed to launch sandbox {id}: {e}")))?,
        };
        let t_connect = std::time::Instant::now();
        let connected = if let Some(identity) = self.rt(rec).guest_identity(&rec.spec.id) {
            // A VM's daemon learns its environment, hostname and identity over the channel,
            // in the first RPC: a restored guest reseeds its RNG before anything draws on it.
            let done = self
                .connector
                .connect_personalized(
                    &plan.channel_socket,
                    space_proto::PersonalizeRequest {
                        env: plan.env.iter().cloned().collect(),
                        hostname: rec.spec.hostname.clone(),
                        ..identity
                    },
                )
                .await;
            tracing::info!(
                id,
                restored = from.is_some(),
                connect_ms = t_connect.elapsed().as_secs_f64() * 1e3,
                "microvm guest connected and personalized"
            );
            done.map_err(|e| e.to_string())
        } else {
            self.connector
                .connect(&plan.channel_socket)
                .instrument(tracing::debug_span!("build.connect"))
                .await
                .map_err(|e| e.to_string())
        };
        // Every boot runs the template's start command and waits for its ready command; a
        // restore (its VM ran the start command before the checkpoint) only waits for the
        // ready command (`start.rs`).
        let connected = match connected {
            Ok(client) => self
                .start_and_wait_ready(rec, &client, from.is_some())
                .instrument(tracing::debug_span!("build.ready"))
                .await
                .map(|()| client)
                .map_err(|reason| NodeError::NotReady {
                    id: id.clone(),
                    reason,
                }),
            other => other.map_err(|reason| NodeError::Unavailable {
                id: id.clone(),
                reason,
            }),
        };
        match connected {
            Ok(client) => Ok((launched, client)),
            Err(e) => {
                if let Err(d) = self.rt(rec).destroy(&plan.id, Some(&launched)).await {
                    tracing::warn!(id, error = %d, "destroy after failed connect failed");
                }
                Err(e)
            }
        }
    }

    async fn create_new(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        self.check_free_memory()?;
        let id = spec.id.clone();
        let tmpl = self.templates.latest(&spec.template).ok_or_else(|| {
            match spec.template.as_str() {
                crate::template::BASE_TEMPLATE => NodeError::InvalidArgument(format!(
                    "the base template is not built on this node ({}): run scripts/up (it builds \
                     the Debian rootfs once with mmdebstrap) and restart spaced, or create from \
                     `minimal`",
                    match &self.cfg.base_cache {
                        Some(p) => format!("no Debian rootfs in {}", p.display()),
                        None => "spaced runs with --base-cache none".to_owned(),
                    }
                )),
                _ => NodeError::NotFound {
                    kind: "template",
                    id: spec.template.clone(),
                },
            }
        })?;
        let kind = spec.runtime.unwrap_or(self.cfg.default_runtime);
        crate::quota::check_limit(&spec.limits, kind, self.subvols.as_ref())?;
        crate::runtime::check_limits(kind, &spec.limits).map_err(NodeError::InvalidArgument)?;
        let rt = self.runtime_for(kind).await?.clone();
        if let Some(status) = self.create_from_pool(spec, &tmpl, kind).await {
            return Ok(status);
        }
        // A runtime with memory checkpoints restores the template's warm one when it has it.
        let from = self.template_checkpoint(rt.as_ref(), &tmpl, &spec.limits);
        let (rec, launched, client) = self.build_new(spec, &tmpl, false, from.as_deref()).await?;
        let uid_base = rec.uid_base;
        let status = self.register_launched(rec, launched, client).await;
        tracing::info!(id, template = %spec.template, version = tmpl.version, uid_base, "sandbox created");
        self.sync_record_in_background(&id);
        Ok(status)
    }

    /// Builds sandbox `spec` from scratch on template version `tmpl`: uid range, rootfs
    /// snapshot, record, launch. On error everything is undone. Not entered in the table.
    /// A microvm sandbox restores `from` (a template checkpoint, `vm_warm.rs`) when given.
    pub(crate) async fn build_new(
        &self,
        spec: &SandboxSpec,
        tmpl: &TemplateInfo,
        pool_member: bool,
        from: Option<&Path>,
    ) -> Result<(SandboxRecord, Launched, GuestChannel), NodeError> {
        let id = spec.id.clone();
        let uid_base = self.allocate_uids()?;
        let mut rec = self.new_record(spec, tmpl.version, uid_base);
        rec.pool_member = pool_member;
        let mut result = self.build_attempt(&mut rec, &tmpl.path, from).await;
        if let (Err(e), Some(ckpt)) = (&result, from) {
            // The one fallback for a checkpoint that fails: the runtime refused it (a
            // corrupted state file), or it restored and the guest never answered (damaged
            // memory: `mem` has no checksum). It goes, a new one is asked for, and the
            // sandbox starts over on the template's disk (a broken guest may have written to
            // the first) and boots.
            let why = if matches!(e, NodeError::Unavailable { .. }) {
                "the restored guest did not answer"
            } else {
                "restore refused"
            };
            tracing::warn!(id, checkpoint = %ckpt.display(), error = %e,
                "{why}: discarding the checkpoint and booting instead");
            let ckpt = ckpt.to_path_buf();
            let _ = blocking(move || {
                vm_warm::discard_checkpoint(&ckpt);
                Ok(())
            })
            .await;
            if let Ok(vm) = self.microvm().await {
                self.template_checkpoint(vm.as_ref(), tmpl, &spec.limits);
            }
            result = self.build_attempt(&mut rec, &tmpl.path, None).await;
        }
        match result {
            Ok((launched, client)) => Ok((rec, launched, client)),
            Err(err) => {
                tracing::warn!(id, error = %err, "create failed; rolling back");
                self.undo_new_sandbox(&id, uid_base).await;
                Err(err)
            }
        }
    }

    /// One try of [`Node::build_new`]: the sandbox dir (a leftover removed), its rootfs or
    /// disk (from the checkpoint `from` when given), the record, the launch.
    async fn build_attempt(
        &self,
        rec: &mut SandboxRecord,
        tmpl_path: &Path,
        from: Option<&Path>,
    ) -> Result<(Launched, GuestChannel), NodeError> {
        let (tmpl_path, from2) = (tmpl_path.to_path_buf(), from.map(Path::to_path_buf));
        let disk = self.disk(rec);
        let (layout, subvols, rec2) = (self.layout.clone(), self.subvols.clone(), rec.clone());
        blocking(move || {
            let id = &rec2.spec.id;
            let dir = layout.sandbox_dir(id);
            if dir.exists() {
                // Leftover of a failed create or remove without a table entry.
                tracing::warn!(path = %dir.display(), "removing leftover sandbox dir");
                remove_sandbox_storage(&layout, subvols.as_ref(), id)?;
            }
            storage::mkdir_private(&dir)?;
            let at = disk::At::new(&layout, subvols.as_ref(), id);
            disk.make(at, &tmpl_path, from2.as_deref())?;
            crate::quota::set_limit(&layout, subvols.as_ref(), id, rec2.spec.limits.disk_mib)?;
            // Atomic but not fsynced here: an fsync costs ~7 ms on the loop image (a flush is
            // an fsync of the image file). `sync_record_in_background` makes it durable right
            // after the create answers (decision 0005).
            storage::write_json_atomic(&layout.sandbox_record(&rec2.spec.id), &rec2, false)?;
            Ok(())
        })
        .instrument(tracing::debug_span!("build.storage"))
        .await?;
        self.launch(rec, from).await
    }

    /// The record of a sandbox about to be made (create or fork), not yet launched.
    pub(crate) fn new_record(
        &self,
        spec: &SandboxSpec,
        template_version: u32,
        uid_base: u32,
    ) -> SandboxRecord {
        SandboxRecord {
            record_version: RECORD_VERSION,
            spec: spec.clone(),
            template_version,
            uid_base,
            uid_count: self.cfg.uid_count,
            runtime: spec.runtime.unwrap_or(self.cfg.default_runtime),
            created_unix_ms: now_unix_ms(),
            launched: None,
            slot: None,
            runtime_name: None,
            pool_member: false,
            pooled: false,
            restored: false,
        }
    }

    /// Enters a freshly launched sandbox (create or fork) in the table and records its init.
    pub(crate) async fn register_launched(
        &self,
        mut rec: SandboxRecord,
        launched: Launched,
        client: GuestChannel,
    ) -> SandboxStatus {
        let id = rec.spec.id.clone();
        rec.launched = Some(launched);
        let status = self.status_of(&rec);
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), Entry::new(rec, Some(client)));
        // Launched only matters while the host is up: no fsync needed.
        if let Err(e) = self.persist(&id, false).await {
            tracing::warn!(id, error = %e, "failed to record the launched init");
        }
        status
    }

    /// Makes the sandbox's record durable after the create has answered: the record is
    /// written without fsync on the create path (~7 ms on a loop image), and this closes the
    /// window in which a power loss would lose it from up to 30 s (the next btrfs commit) to
    /// milliseconds, without adding to create latency (decision 0005).
    pub(crate) fn sync_record_in_background(&self, id: &str) {
        let path = self.layout.sandbox_record(id);
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = storage::sync_file_and_dir(&path) {
                tracing::warn!(id, error = %e, "could not make the sandbox record durable");
            }
        });
    }

    /// Undoes a new sandbox (create or fork) whose launch failed: its storage and uid slot.
    pub(crate) async fn undo_new_sandbox(&self, id: &str, uid_base: u32) {
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_string());
        if let Err(e) =
            blocking(move || Ok(remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?)).await
        {
            tracing::error!(id, error = %e, "rollback of sandbox storage failed");
        }
        self.free_uids(uid_base);
    }
}

/// Deletes a sandbox's rootfs (with nested subvolumes), its dir and its run dir.
impl Node {
    /// Pause (freeze) or resume (thaw) a running sandbox, under its lock. The freezer state
    /// lives in the kernel, so it needs no record and survives a node restart.
    async fn set_paused(&self, id: &str, pause: bool) -> Result<SandboxStatus, NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let entry = self.entry(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.to_string(),
        })?;
        let wrong = |phase| NodeError::WrongPhase {
            id: id.to_string(),
            phase,
        };
        if !self.is_running(&entry.record) {
            return Err(wrong(Phase::Stopped));
        }
        let name = entry.record.runtime_name();
        let frozen = self.rt(&entry.record).is_frozen(name);
        if frozen == pause {
            return Err(wrong(if pause { Phase::Paused } else { Phase::Running }));
        }
        self.rt(&entry.record)
            .set_frozen(name, pause)
            .await
            .map_err(|e| {
                NodeError::Internal(format!(
                    "failed to {} sandbox {id}: {e}",
                    if pause { "pause" } else { "resume" }
                ))
            })?;
        tracing::info!(id, paused = pause, "sandbox freezer state changed");
        Ok(self.status_of(&entry.record))
    }
}

fn check_spec(spec: &SandboxSpec) -> Result<(), NodeError> {
    ids::validate_sandbox_id(&spec.id)?;
    ids::validate_template_name(&spec.template)?;
    ids::validate_hostname(&spec.hostname)?;
    ids::validate_env(&spec.env)?;
    let l = &spec.limits;
    if l.cpu_millis == 0 || l.memory_mib == 0 || l.pids == 0 {
        return Err(NodeError::InvalidArgument(
            "limits must be positive (cpu_millis, memory_mib, pids)".into(),
        ));
    }
    Ok(())
}

#[async_trait]
impl NodeApi for Node {
    #[tracing::instrument(name = "node.create", skip_all, fields(sandbox = %spec.id, template = %spec.template))]
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        check_spec(spec)?;
        let lock = self.lock_for(&spec.id);
        let _guard = lock.lock().await;
        match self.entry(&spec.id) {
            Some(entry) => {
                if entry.record.spec.template != spec.template {
                    return Err(NodeError::Conflict(format!(
                        "sandbox {} exists with template {}",
                        spec.id, entry.record.spec.template
                    )));
                }
                if !self.is_running(&entry.record) {
                    return self.restart(spec, entry).await;
                }
                if entry.client.is_none() {
                    let sock = self.layout.channel_socket(entry.record.runtime_name());
                    if let Ok(c) = self.connector.connect(&sock).await
                        && let Some(e) = self
                            .table
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_mut(&spec.id)
                    {
                        e.client = Some(c);
                    }
                }
                Ok(self.status_of(&entry.record))
            }
            None => self.create_new(spec).await,
        }
    }

    #[tracing::instrument(name = "node.remove", skip_all, fields(sandbox = id))]
    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let guard = lock.lock().await;
        let entry = self.entry(id);
        let dir_exists = self.layout.sandbox_dir(id).exists();
        if entry.is_none() && !dir_exists && !self.layout.run_sandbox_dir(id).exists() {
            drop(guard);
            self.release_lock(id, lock);
            return Ok(());
        }
        let launched = entry.as_ref().and_then(|e| e.record.launched.clone());
        let (name, kind) = match &entry {
            Some(e) => (e.record.runtime_name().to_owned(), e.record.runtime),
            None => (id.to_owned(), self.runtime.kind()),
        };
        self.rt_of(kind)
            .destroy(&name, launched.as_ref())
            .await
            .map_err(|e| NodeError::Internal(format!("failed to stop sandbox {id}: {e}")))?;
        if let Some(e) = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(id)
        {
            e.record.launched = None;
            e.client = None;
        }
        if let Some(net) = &self.network {
            net.detach(id).await;
        }
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_string());
        blocking(move || {
            remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?;
            Ok(storage::remove_tree(&layout.run_sandbox_dir(&name))?)
        })
        .await?;
        if let Some(e) = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
        {
            self.free_uids(e.record.uid_base);
        }
        tracing::info!(id, "sandbox removed");
        drop(guard);
        self.release_lock(id, lock);
        Ok(())
    }

    #[tracing::instrument(name = "node.stop", skip_all, fields(sandbox = id))]
    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let Some(entry) = self.entry(id) else {
            return Err(NodeError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            });
        };
        // The files outlive the stop: a running guest flushes them first. One that does not
        // answer (dead, hung) is stopped all the same; a frozen one cannot answer.
        let running = entry.record.launched.is_some()
            && !self
                .rt(&entry.record)
                .is_frozen(entry.record.runtime_name());
        // A namespace sandbox's connection may have been closed for being idle: open one.
        let client = match entry.client.clone() {
            None if running => {
                let sock = self.layout.channel_socket(entry.record.runtime_name());
                self.connector.connect(&sock).await.ok()
            }
            c => c,
        };
        if running && !snapshots::flush_guest(client).await {
            tracing::warn!(id, "the guest did not flush its disk before the stop");
        }
        self.rt(&entry.record)
            .destroy(entry.record.runtime_name(), entry.record.launched.as_ref())
            .await
            .map_err(|e| NodeError::Internal(format!("failed to stop sandbox {id}: {e}")))?;
        let was_launched = {
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            match table.get_mut(id) {
                Some(e) => {
                    e.client = None;
                    e.record.launched.take().is_some()
                }
                None => false,
            }
        };
        if was_launched {
            self.persist(id, false).await?;
            tracing::info!(id, "sandbox stopped");
        }
        Ok(())
    }

    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        Ok(self.entry(id).map(|e| self.status_of(&e.record)))
    }

    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        Ok(self.statuses(true))
    }

    async fn observe_phases(&self) -> Result<Observation, NodeError> {
        Ok(Observation {
            sandboxes: self.statuses(false),
            ..Default::default()
        })
    }

    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        let mut entry = self.running_entry(id)?;
        let frozen = |e: &Entry| self.rt(&e.record).is_frozen(e.record.runtime_name());
        if frozen(&entry) {
            // A snapshot freezes it for a moment while holding the sandbox's lock: wait that
            // out. Still frozen after is a pause (its daemon too: a call would hang).
            drop(self.lock_for(id).lock().await);
            entry = self.running_entry(id)?;
            if frozen(&entry) {
                return Err(NodeError::Conflict(format!("sandbox {id} is paused")));
            }
        }
        if let Some(c) = entry.client {
            // tonic's Channel reconnects by itself (through the same socket path) after the
            // connection breaks, so a cached client stays usable.
            if let Some(e) = self
                .table
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(id)
            {
                e.used = std::time::Instant::now();
            }
            return Ok(c);
        }
        // No client (adopt, an earlier connect failed, or closed for being idle): connect
        // once now.
        let sock = self.layout.channel_socket(entry.record.runtime_name());
        let client = self
            .connector
            .connect(&sock)
            .await
            .map_err(|e| NodeError::Unavailable {
                id: id.to_string(),
                reason: e.to_string(),
            })?;
        if let Some(e) = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(id)
        {
            e.client = Some(client.clone());
            e.used = std::time::Instant::now();
        }
        Ok(client)
    }

    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(self.templates.list())
    }

    async fn template_versions(&self, name: &str) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(self.templates.versions(name))
    }

    async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Vec<u32>, NodeError> {
        self.remove_template_impl(name, version).await
    }

    #[tracing::instrument(name = "node.snapshot", skip_all, fields(sandbox = id, snapshot = snap))]
    async fn snapshot_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.snapshot_impl(id, snap, false).await
    }

    async fn checkpoint_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.snapshot_impl(id, snap, true).await
    }

    async fn diff_sandbox(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<crate::diff::Change>, NodeError> {
        self.diff_impl(id, from, to).await
    }

    async fn list_snapshots(
        &self,
        id: &str,
        with_size: bool,
    ) -> Result<Vec<SnapshotInfo>, NodeError> {
        self.list_snapshots_impl(id, with_size).await
    }

    async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        self.delete_snapshot_impl(id, snap).await
    }

    async fn changed_since_snapshot(
        &self,
        id: &str,
        owner: &str,
        snap: &str,
    ) -> Result<bool, NodeError> {
        self.changed_since_snapshot_impl(id, owner, snap).await
    }

    #[tracing::instrument(name = "node.rollback", skip_all, fields(sandbox = %spec.id, snapshot = snap))]
    async fn rollback_sandbox(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.rollback_impl(spec, snap).await
    }

    #[tracing::instrument(name = "node.fork", skip_all, fields(sandbox = %spec.id, source, snapshot = snap))]
    async fn fork_sandbox(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.fork_impl(source, snap, spec).await
    }

    #[tracing::instrument(name = "node.pause", skip_all, fields(sandbox = id))]
    async fn pause_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.set_paused(id, true).await
    }

    #[tracing::instrument(name = "node.resume", skip_all, fields(sandbox = id))]
    async fn resume_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.set_paused(id, false).await
    }

    async fn validate_network(&self, network: &NetworkSpec) -> Result<(), NodeError> {
        match &self.network {
            Some(net) => net.validate(network).map_err(|e| e.for_sandbox("(new)")),
            None => Ok(()),
        }
    }

    #[tracing::instrument(name = "node.set_network", skip_all, fields(sandbox = id))]
    async fn set_network(
        &self,
        id: &str,
        network: &NetworkSpec,
    ) -> Result<SandboxStatus, NodeError> {
        ids::validate_sandbox_id(id)?;
        self.validate_network(network).await?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let entry = self.entry(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.to_string(),
        })?;
        if let Some(net) = &self.network
            && net.is_attached(id)
        {
            net.update(id, network)
                .await
                .map_err(|e| e.for_sandbox(id))?;
        }
        let status = {
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            let e = table.get_mut(id).ok_or_else(|| NodeError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            })?;
            e.record.spec.network = network.clone();
            self.status_of(&e.record)
        };
        self.persist(id, false).await?;
        tracing::info!(
            id,
            egress = network.egress.as_str(),
            rules = network.allow.len(),
            was = entry.record.spec.network.egress.as_str(),
            "egress policy changed"
        );
        Ok(status)
    }

    async fn connect_port(&self, id: &str, port: u16) -> Result<crate::api::PortStream, NodeError> {
        ids::validate_sandbox_id(id)?;
        if port == 0 {
            return Err(NodeError::InvalidArgument("port must be 1..=65535".into()));
        }
        if let Some(what) = crate::api::net::node_port(port) {
            return Err(NodeError::InvalidArgument(format!(
                "port {port} in a sandbox's network is {what}, not a sandbox port"
            )));
        }
        let entry = self.running_entry(id)?;
        let Some(net) = &self.network else {
            return Err(NodeError::Conflict("networking is off on this node".into()));
        };
        let host = self.rt(&entry.record).service_address();
        let stream = net.connect(id, host, port).await.map_err(|e| match e {
            NetError::Setup { source, .. } => NodeError::Unavailable {
                id: id.to_string(),
                reason: format!("nothing answers on port {port} inside the sandbox: {source}"),
            },
            e => e.for_sandbox(id),
        })?;
        let _ = stream.set_nodelay(true);
        Ok(Box::new(stream))
    }

    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        let (progress, _) = tokio::sync::mpsc::unbounded_channel();
        self.import_template_with_progress(name, source, progress)
            .await
    }

    async fn import_template_with_progress(
        &self,
        name: &str,
        source: TemplateSource,
        progress: crate::api::TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        ids::validate_template_name(name)?;
        let info = self.import_impl(name, source, &progress).await?;
        // Ready sandboxes of the old version are never handed out again.
        self.template_changed(&info.name, info.version).await;
        Ok(info)
    }

    async fn metrics(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        if let Some(p) = self.network.as_ref().and_then(|n| n.pool_stats()) {
            out.extend([
                ("space_net_slots_ready".into(), p.ready as f64),
                ("space_net_slots_attached".into(), p.attached as f64),
                ("space_net_pool_hits_total".into(), p.hits as f64),
                ("space_net_pool_misses_total".into(), p.misses as f64),
            ]);
        }
        self.pool_metrics(&mut out);
        out
    }

    #[tracing::instrument(name = "node.set_pool", skip_all, fields(template))]
    async fn set_pool(&self, template: &str, cfg: PoolConfig) -> Result<PoolStatus, NodeError> {
        self.set_pool_impl(template, cfg).await
    }

    async fn pools(&self) -> Vec<PoolStatus> {
        self.pools_impl()
    }

    async fn node_info(&self) -> Result<crate::api::NodeInfo, NodeError> {
        Ok(self.node_info_impl())
    }

    async fn send_sandbox(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
    ) -> Result<MoveStream, NodeError> {
        self.send_sandbox_impl(id, step, have).await
    }
    async fn receive_sandbox(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
        parts: MoveStream,
    ) -> Result<Received, NodeError> {
        self.receive_sandbox_impl(id, step, have, parts).await
    }
    async fn adopt_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        self.adopt_sandbox_impl(spec).await
    }
    async fn discard_move(&self, id: &str) -> Result<(), NodeError> {
        self.discard_move_impl(id).await
    }
    async fn send_template(&self, name: &str) -> Result<MoveStream, NodeError> {
        self.send_template_impl(name).await
    }
    async fn receive_template(
        &self,
        name: &str,
        parts: MoveStream,
    ) -> Result<TemplateInfo, NodeError> {
        self.receive_template_impl(name, parts).await
    }

    async fn send_replica(&self, id: &str, have: &[String]) -> Result<MoveStream, NodeError> {
        self.send_replica_impl(id, have).await
    }
    async fn receive_replica(&self, id: &str, parts: MoveStream) -> Result<Received, NodeError> {
        self.receive_replica_impl(id, parts).await
    }
    async fn drop_replica(&self, id: &str, keep: &[String]) -> Result<Vec<String>, NodeError> {
        self.drop_replica_impl(id, keep).await
    }
    async fn restore_replica(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.restore_replica_impl(spec, snap).await
    }

    async fn sandbox_usage(&self, id: &str) -> Result<crate::api::SandboxUsage, NodeError> {
        self.sandbox_usage_impl(id).await
    }
}

mod idle_guests;
mod status;
mod usage;

mod disk;
mod snapshots;
use snapshots::remove_sandbox_storage;

mod diff;

mod admission;
mod pools;

mod recover;

mod vm_warm;

mod images;

mod start;

mod moves;

mod replicas;

#[cfg(test)]
mod tests;
