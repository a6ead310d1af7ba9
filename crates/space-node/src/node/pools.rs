//! Warm pools on the node (decision 0013): building ready sandboxes ahead of time, handing
//! one out on create (personalization), retiring them, and the background refill. The
//! bookkeeping (sizes, targets, hits, misses) is [`crate::warm::Pools`].
//!
//! A member is a complete sandbox built like a cold create, under a fresh random name: its own
//! rootfs snapshot, uid range, cgroups, network slot (with the node's default policy) and a
//! running space-daemon. Nothing of a user ever runs in it before it is handed out, and it is
//! handed out once, so nothing carries over from one user to the next. Handing it out:
//! 1. the runtime applies the requested limits and sets the hostname (from the host, in the
//!    sandbox's UTS namespace);
//! 2. the network slot moves to the new id with the requested policy and secrets;
//! 3. space-daemon gets the user's base environment (`Personalize`);
//! 4. the sandbox dir is renamed to the new id and its record written.
//!
//! The runtime keeps knowing the sandbox by the member's name (`SandboxRecord::runtime_name`):
//! cgroups cannot be renamed on cgroup v2, and the run dir holds the channel socket that the
//! cached client reconnects through.
//!
//! A member that fails any step is destroyed and the create falls back to the cold path. A
//! record still marked `pool_member` when the node starts is destroyed (a crash mid-hand-out
//! included): the control plane then sees the create as failed, never a half-personalized
//! sandbox.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::api::GuestChannel;
use futures::StreamExt;
use space_proto::{ExecRequest, PersonalizeRequest};
use tracing::Instrument;

use super::{Entry, Node, blocking, remove_sandbox_storage};
use crate::api::RuntimeKind;
use crate::api::{
    Limits, NodeError, PoolConfig, PoolStatus, SandboxSpec, SandboxStatus, TemplateInfo,
};
use crate::state::{SandboxRecord, now_unix_ms};
use crate::storage::{self, StorageError};
use crate::warm::{self, Job};

/// Refill tasks: two builds at a time keep both cores of a small node busy between bursts.
const REFILL_TASKS: usize = 2;
/// QEMU's own memory next to a microvm member's guest RAM, for the pool's capacity.
const MICROVM_OVERHEAD_MIB: u64 = 64;
/// Members retired at once at shutdown.
const RETIRE_PARALLEL: usize = 8;

/// A random name for a new member, in the shape of a sandbox id.
fn member_name() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// A `/proc/meminfo` figure (`MemTotal`, `MemAvailable`), in bytes.
pub(super) fn meminfo_bytes(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s
        .lines()
        .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The node's warm pools as a service that owns their state: the members and their
/// bookkeeping ([`warm::Pools`]), which templates' pools hold microvms, the refill's wake-up
/// and its stop flag. The node asks it for members and work, and does the building and
/// destroying itself (they need its runtime, storage and network).
#[derive(Default)]
pub(super) struct PoolService {
    members: warm::Pools<Entry>,
    /// Templates whose pool holds microvm sandboxes (the others: the namespace runtime's).
    microvm: Mutex<HashSet<String>>,
    wake: Arc<tokio::sync::Notify>,
    closing: AtomicBool,
}

impl PoolService {
    /// Whether `template`'s pool holds microvm sandboxes.
    pub(super) fn is_microvm(&self, template: &str) -> bool {
        self.microvm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(template)
    }

    /// Sets the runtime of `template`'s pool. A pool changing runtime starts over: the
    /// members of the other runtime are returned, to be destroyed.
    fn set_runtime(&self, template: &str, microvm: bool) -> Vec<Entry> {
        if self.is_microvm(template) == microvm {
            return Vec::new();
        }
        let old = self.members.configure(template, 0, 0, None);
        let mut set = self.microvm.lock().unwrap_or_else(|e| e.into_inner());
        if microvm {
            set.insert(template.to_owned());
        } else {
            set.remove(template);
        }
        old
    }

    /// Sets a pool's size; returns the members it no longer keeps.
    fn configure(&self, template: &str, min: u32, max: u32, warning: Option<String>) -> Vec<Entry> {
        let retired = self.members.configure(template, min, max, warning);
        self.wake.notify_waiters();
        retired
    }

    /// Ready members the other pools hold or build.
    fn reserved_except(&self, template: &str) -> u64 {
        self.members.reserved_except(template)
    }

    /// A ready member of `template` built from `version`, if there is one; the refill is
    /// woken either way (a take is demand).
    fn take(&self, template: &str, version: u32) -> Option<Entry> {
        let member = self.members.take(template, version, Instant::now());
        self.wake.notify_waiters();
        member
    }

    /// The members built from other versions of `template` (after an import).
    pub(super) fn retire_other_versions(&self, template: &str, version: u32) -> Vec<Entry> {
        let old = self.members.retire_other_versions(template, version);
        self.wake.notify_waiters();
        old
    }

    pub(super) fn view(&self, template: &str) -> Option<warm::PoolView> {
        self.members.view(template)
    }

    fn views(&self) -> Vec<warm::PoolView> {
        self.members.views()
    }

    /// Stops the refill; returns every ready member, to be destroyed.
    fn close(&self) -> Vec<Entry> {
        self.closing.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
        self.members.drain()
    }

    /// Whether the pools are closed (the node is shutting down).
    pub(super) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Waits until woken (a take, a resize) or `d` has passed.
    fn waiter(&self, d: Duration) -> impl Future<Output = ()> + use<> {
        let wake = self.wake.clone();
        async move {
            let _ = tokio::time::timeout(d, wake.notified()).await;
        }
    }

    /// `/metrics` series of the pools.
    fn metrics(&self, out: &mut Vec<(String, f64)>) {
        for v in self.views() {
            let t = &v.template;
            out.push((
                format!("space_pool_ready{{template=\"{t}\"}}"),
                v.ready.into(),
            ));
            out.push((
                format!("space_pool_target{{template=\"{t}\"}}"),
                v.target.into(),
            ));
            out.push((
                format!("space_pool_starting{{template=\"{t}\"}}"),
                v.starting.into(),
            ));
            out.push((
                format!("space_pool_hits_total{{template=\"{t}\"}}"),
                v.hits as f64,
            ));
            out.push((
                format!("space_pool_misses_total{{template=\"{t}\"}}"),
                v.misses as f64,
            ));
            out.push((
                format!("space_pool_arrivals_per_second{{template=\"{t}\"}}"),
                v.arrivals_per_s,
            ));
        }
    }
}

impl Node {
    /// [`NodeApi::node_info`](crate::api::NodeApi::node_info).
    pub(super) fn node_info_impl(&self) -> crate::api::NodeInfo {
        let mut runtimes = vec![self.runtime.kind()];
        if self.cfg.microvm.is_some() && !runtimes.contains(&RuntimeKind::Microvm) {
            runtimes.push(RuntimeKind::Microvm);
        }
        let sandboxes = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|e| !e.record.pool_member)
            .count();
        crate::api::NodeInfo {
            name: rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
            runtimes,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            memory_bytes: meminfo_bytes("MemTotal").unwrap_or(0),
            memory_available_bytes: meminfo_bytes("MemAvailable").unwrap_or(0),
            sandboxes: sandboxes as u32,
            pool_ready: self.pools_impl().iter().map(|p| p.ready).sum(),
            started_unix_ms: self.opened_unix_ms,
            templates: {
                let mut names: Vec<String> =
                    self.templates.list().into_iter().map(|t| t.name).collect();
                names.sort();
                names.dedup();
                names
            },
            pool_ready_by_template: self
                .pools_impl()
                .into_iter()
                .map(|p| (p.template, p.ready))
                .collect(),
        }
    }
}

impl Node {
    /// How many ready sandboxes all pools together may hold, and what limits it. A microvm
    /// member is counted at its guest RAM plus QEMU's overhead.
    fn pool_capacity(&self, microvm: bool) -> (u64, String) {
        let mut limits: Vec<(u64, String)> = Vec::new();
        let per_member = if microvm {
            (crate::runtime::microvm::memory_mib_for(&Limits::default()) + MICROVM_OVERHEAD_MIB)
                << 20
        } else {
            warm::BYTES_PER_MEMBER
        };
        if let Some(total) = meminfo_bytes("MemTotal") {
            limits.push((
                total / 2 / per_member,
                format!(
                    "half of the node's {} MiB of memory at {} MiB per ready sandbox",
                    total >> 20,
                    per_member >> 20
                ),
            ));
        }
        let uids = self
            .uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .available();
        limits.push((uids, "free uid ranges".to_owned()));
        if let Some(slots) = self.network.as_ref().and_then(|n| n.slot_capacity()) {
            limits.push((slots, "network slots left for sandboxes".to_owned()));
        }
        limits
            .into_iter()
            .min_by_key(|(n, _)| *n)
            .unwrap_or((0, "no capacity".to_owned()))
    }

    /// The runtime of `template`'s pool: microvm when it was made so, else the node's.
    fn pool_runtime(&self, template: &str) -> RuntimeKind {
        if self.pools.is_microvm(template) {
            RuntimeKind::Microvm
        } else {
            self.runtime.kind()
        }
    }

    fn pool_status(&self, v: warm::PoolView) -> PoolStatus {
        let runtime = self.pool_runtime(&v.template);
        PoolStatus {
            template: v.template,
            runtime,
            min: v.min,
            max: v.max,
            target: v.target,
            ready: v.ready,
            starting: v.starting,
            hits: v.hits,
            misses: v.misses,
            warning: v.warning,
        }
    }

    pub(super) async fn set_pool_impl(
        &self,
        template: &str,
        cfg: PoolConfig,
    ) -> Result<PoolStatus, NodeError> {
        crate::ids::validate_template_name(template)?;
        if self.templates.latest(template).is_none() {
            return Err(NodeError::NotFound {
                kind: "template",
                id: template.to_owned(),
            });
        }
        if cfg.min > cfg.max {
            return Err(NodeError::InvalidArgument(format!(
                "pool min ({}) is larger than max ({})",
                cfg.min, cfg.max
            )));
        }
        if cfg.microvm
            && cfg.max > 0
            && let Err(why) = self.microvm().await
        {
            return Err(NodeError::InvalidArgument(format!(
                "a microvm pool needs the microvm runtime: {why}"
            )));
        }
        // A pool changing runtime starts over: its members are of the other runtime.
        let other_runtime = self.pools.set_runtime(template, cfg.microvm);
        self.retire_all(other_runtime).await;
        let (capacity, why) = self.pool_capacity(cfg.microvm);
        let left = capacity.saturating_sub(self.pools.reserved_except(template));
        let (min, max, warning) = warm::clamp(cfg.min, cfg.max, left, &why);
        if let Some(w) = &warning {
            tracing::warn!(template, "{w}");
        }
        let retired = self.pools.configure(template, min, max, warning.clone());
        self.retire_all(retired).await;
        tracing::info!(template, min, max, "warm pool configured");
        let view = self.pools.view(template).unwrap_or_else(|| warm::PoolView {
            template: template.to_owned(),
            min,
            max,
            target: 0,
            arrivals_per_s: 0.0,
            ready: 0,
            starting: 0,
            hits: 0,
            misses: 0,
            warning,
        });
        Ok(self.pool_status(view))
    }

    pub(crate) fn pools_impl(&self) -> Vec<PoolStatus> {
        self.pools
            .views()
            .into_iter()
            .map(|v| self.pool_status(v))
            .collect()
    }

    /// `/metrics` series of the pools.
    pub(super) fn pool_metrics(&self, out: &mut Vec<(String, f64)>) {
        self.pools.metrics(out);
    }

    /// Starts the background refill (after recovery).
    pub(super) fn start_pool_refill(self: &Arc<Self>) {
        for _ in 0..REFILL_TASKS {
            tokio::spawn(refill_loop(Arc::downgrade(self)));
        }
    }

    /// Stops the refill and destroys every ready member (clean shutdown).
    pub(super) async fn close_pools(&self) {
        let members = self.pools.close();
        if !members.is_empty() {
            tracing::info!(members = members.len(), "destroying ready pool sandboxes");
        }
        self.retire_all(members).await;
    }

    /// Drops the members built from older versions of `template` (after an import).
    pub(super) async fn template_changed(&self, template: &str, version: u32) {
        let old = self.pools.retire_other_versions(template, version);
        self.retire_all(old).await;
    }

    /// Builds one member of `template`'s pool: a sandbox like a cold create, under a fresh
    /// name, with default limits and the node's default egress policy.
    async fn build_member(&self, template: &str) -> Result<Entry, NodeError> {
        self.check_free_memory()?;
        let tmpl = self
            .templates
            .latest(template)
            .ok_or_else(|| NodeError::NotFound {
                kind: "template",
                id: template.to_owned(),
            })?;
        let name = member_name();
        let mut spec = SandboxSpec {
            id: name.clone(),
            template: template.to_owned(),
            limits: Limits::default(),
            env: Vec::new(),
            hostname: name,
            network: self
                .network
                .as_ref()
                .map(|n| n.default_spec())
                .unwrap_or_default(),
            secrets: Vec::new(),
            // Named, not left to the node's default: on a node whose default runtime is
            // microvm, a namespace pool's members were built as microvms' disks and then
            // launched as namespace sandboxes, and every build failed.
            runtime: Some(self.runtime.kind()),
        };
        let microvm = self.pools.is_microvm(template);
        let mut from = None;
        if microvm {
            spec.runtime = Some(RuntimeKind::Microvm);
            // Network slots are not given to microvms yet (decision 0014).
            spec.network = Default::default();
            let vm = self.microvm().await.map_err(|why| {
                NodeError::InvalidArgument(format!("microvm pool of {template}: {why}"))
            })?;
            from = self.template_checkpoint(vm.as_ref(), &tmpl, &spec.limits);
        }
        let (mut rec, launched, client) =
            self.build_new(&spec, &tmpl, true, from.as_deref()).await?;
        rec.launched = Some(launched);
        // Records the init, so a node restart can kill it (not durable: meaningless after a
        // host reboot anyway).
        let path = self.layout.sandbox_record(&rec.spec.id);
        let rec2 = rec.clone();
        let written = blocking(move || Ok(storage::write_json_atomic(&path, &rec2, false)?))
            .instrument(tracing::debug_span!("build.record"))
            .await;
        if let Err(e) = written {
            let entry = Entry::new(rec, Some(client));
            self.retire(entry).await;
            return Err(e);
        }
        warm_up(&client, &rec.spec.id)
            .instrument(tracing::debug_span!("build.warm_up"))
            .await;
        Ok(Entry::new(rec, Some(client)))
    }

    /// Serves a create from `spec.template`'s pool when it has a ready member of `tmpl`'s
    /// version. `None`: no pool, none ready, or handing out failed (the member was destroyed);
    /// the caller builds the sandbox cold.
    pub(super) async fn create_from_pool(
        &self,
        spec: &SandboxSpec,
        tmpl: &TemplateInfo,
        kind: RuntimeKind,
    ) -> Option<SandboxStatus> {
        if self.pool_runtime(&spec.template) != kind {
            return None;
        }
        // A VM's RAM and vCPUs are fixed when it starts: only default limits are pooled.
        if self.pools.is_microvm(&spec.template) && spec.limits != Limits::default() {
            return None;
        }
        let member = self.pools.take(&spec.template, tmpl.version)?;
        let t0 = Instant::now();
        let name = member.record.spec.id.clone();
        match self.hand_out(member, spec).await {
            Ok(status) => {
                tracing::info!(
                    id = %spec.id,
                    member = %name,
                    template = %spec.template,
                    elapsed_us = t0.elapsed().as_micros() as u64,
                    "sandbox created from the warm pool"
                );
                Some(status)
            }
            Err(failed) => {
                let (e, entry) = *failed;
                tracing::warn!(id = %spec.id, member = %name, error = %e,
                    "handing out a pool sandbox failed; building it cold");
                self.retire_as(entry, &spec.id).await;
                None
            }
        }
    }

    /// Personalizes `member` as sandbox `spec` (see the module doc). On error, returns the
    /// member for destruction.
    async fn hand_out(
        &self,
        member: Entry,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, Box<(NodeError, Entry)>> {
        let Entry { record, client, .. } = member;
        let name = record.spec.id.clone();
        let fail = |e: NodeError, record: SandboxRecord, client| {
            Err(Box::new((e, Entry::new(record, client))))
        };
        let (Some(launched), Some(mut guest)) = (
            record.launched.clone(),
            client.clone().map(GuestChannel::client),
        ) else {
            return fail(
                NodeError::Internal(format!("pool sandbox {name} is not running")),
                record,
                client,
            );
        };
        if !self.rt(&record).alive(&launched) {
            return fail(
                NodeError::Internal(format!("pool sandbox {name} died while ready")),
                record,
                client,
            );
        }
        let mut rec = record.clone();
        rec.spec = spec.clone();
        rec.runtime_name = Some(name.clone());
        rec.pool_member = false;
        rec.pooled = true;
        rec.created_unix_ms = now_unix_ms();
        let t0 = Instant::now();
        // 1. The network slot, with the requested policy and secrets (first: the environment
        // depends on the sandbox having a slot under its id).
        if let Some(net) = &self.network
            && record.slot.is_some()
            && let Err(e) = net
                .rename(&name, &spec.id, &spec.network, &spec.secrets)
                .await
        {
            return fail(e.for_sandbox(&spec.id), record, client);
        }
        let t_net = t0.elapsed();
        // 2. At once: limits and hostname; the base environment of every process; the
        // sandbox dir takes the id. None depends on another.
        let limits = (spec.limits != record.spec.limits).then_some(&spec.limits);
        let env: HashMap<String, String> = self.sandbox_env(&rec).into_iter().collect();
        let (layout, subvols) = (self.layout.clone(), self.subvols.clone());
        let (from_name, to_id) = (name.clone(), spec.id.clone());
        let disk_mib = spec.limits.disk_mib;
        // A VM's daemon sets its own hostname and takes a fresh identity (a member is a
        // restored copy of the template's checkpoint); else the runtime sets both from the
        // host, and the limits.
        let rt = self.rt(&record);
        let guest_req = match rt.guest_identity(&spec.id) {
            Some(identity) => PersonalizeRequest {
                env,
                hostname: spec.hostname.clone(),
                ..identity
            },
            None => PersonalizeRequest {
                env,
                ..Default::default()
            },
        };
        let runtime_step = rt.personalize(&name, &launched, limits, &spec.hostname);
        let (personalized, env_set, moved) = tokio::join!(
            runtime_step,
            guest.personalize(guest_req),
            blocking(move || {
                let (from, to) = (layout.sandbox_dir(&from_name), layout.sandbox_dir(&to_id));
                if to.exists() {
                    tracing::warn!(path = %to.display(), "removing leftover sandbox dir");
                    remove_sandbox_storage(&layout, subvols.as_ref(), &to_id)?;
                }
                std::fs::rename(&from, &to).map_err(|e| StorageError::io("rename", &from, e))?;
                Ok(crate::quota::set_limit(
                    &layout,
                    subvols.as_ref(),
                    &to_id,
                    disk_mib,
                )?)
            }),
        );
        let step = personalized
            .map_err(|e| NodeError::Internal(format!("personalize pool sandbox {name}: {e}")))
            .and(env_set.map_err(|s| NodeError::Unavailable {
                id: spec.id.clone(),
                reason: format!("personalize: {s}"),
            }))
            .and(moved);
        if let Err(e) = step {
            return fail(e, record, client);
        }
        let t_steps = t0.elapsed();
        // 3. The record says so. Until it is written it still says `pool_member`, so a crash
        // before this point destroys the sandbox instead of adopting a half-personalized one.
        let (path, rec2) = (self.layout.sandbox_record(&spec.id), rec.clone());
        if let Err(e) = blocking(move || Ok(storage::write_json_atomic(&path, &rec2, false)?)).await
        {
            return fail(e, record, client);
        }
        tracing::debug!(
            id = %spec.id,
            network_us = t_net.as_micros() as u64,
            steps_us = (t_steps - t_net).as_micros() as u64,
            record_us = (t0.elapsed() - t_steps).as_micros() as u64,
            "pool sandbox personalized"
        );
        let status = self.status_of(&rec);
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(spec.id.clone(), Entry::new(rec, client));
        self.sync_record_in_background(&spec.id);
        Ok(status)
    }

    /// Destroys a member that may be partly handed out as `id` (slot, dir).
    async fn retire_as(&self, member: Entry, id: &str) {
        if let Some(net) = &self.network {
            net.detach(id).await;
        }
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_owned());
        if let Err(e) =
            blocking(move || Ok(remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?)).await
        {
            tracing::warn!(id, error = %e, "removing a failed pool hand-out left storage");
        }
        self.retire(member).await;
    }

    /// Destroys a member: init, cgroups, slot, storage, uid range.
    pub(super) async fn retire(&self, member: Entry) {
        let rec = member.record;
        let (id, name) = (rec.spec.id.clone(), rec.runtime_name().to_owned());
        if let Err(e) = self.rt(&rec).destroy(&name, rec.launched.as_ref()).await {
            tracing::warn!(member = %name, error = %e, "destroying a pool sandbox failed");
        }
        if let Some(net) = &self.network {
            net.detach(&id).await;
        }
        let (layout, subvols) = (self.layout.clone(), self.subvols.clone());
        let (id2, name2) = (id.clone(), name.clone());
        if let Err(e) = blocking(move || {
            remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?;
            Ok(storage::remove_tree(&layout.run_sandbox_dir(&name2))?)
        })
        .await
        {
            tracing::warn!(member = %name, error = %e, "removing a pool sandbox's storage failed");
        }
        self.free_uids(rec.uid_base);
        tracing::debug!(member = %name, "pool sandbox destroyed");
    }

    pub(super) async fn retire_all(&self, members: Vec<Entry>) {
        futures::stream::iter(members)
            .for_each_concurrent(RETIRE_PARALLEL, |m| self.retire(m))
            .await;
    }
}

/// Runs `true` once in a new member: the first exec of a fresh sandbox costs ~1.5 ms more
/// than the next ones (space-daemon's first blocking threads and allocations, the page cache
/// of the template's binaries), and a user's first exec should not pay it. `Personalize`
/// makes the daemon forget the finished process. Best effort: a template without `true`
/// simply gets no warm-up.
async fn warm_up(client: &GuestChannel, name: &str) {
    let mut guest = client.clone().client();
    let req = ExecRequest {
        argv: vec!["true".to_owned()],
        ..Default::default()
    };
    let run = async {
        let mut events = guest.exec(req).await?.into_inner();
        while events.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    match tokio::time::timeout(std::time::Duration::from_secs(5), run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(member = name, error = %e, "warm-up exec failed"),
        Err(_) => tracing::debug!(member = name, "warm-up exec timed out"),
    }
}

/// One refill task: builds and retires members as [`warm::Pools::next_job`] says, until the
/// node is dropped or closes its pools. Holds the node only while working.
async fn refill_loop(weak: Weak<Node>) {
    loop {
        let Some(node) = weak.upgrade() else {
            return;
        };
        if node.pools.is_closing() {
            return;
        }
        match node.pools.members.next_job(Instant::now()) {
            Job::Build(template) => {
                let span = tracing::info_span!("pool.build", template = %template);
                let built = match node.build_member(&template).instrument(span).await {
                    Ok(m) => Some((m.record.template_version, m)),
                    Err(e) => {
                        tracing::warn!(template, error = %e, "building a pool sandbox failed");
                        None
                    }
                };
                if let Some(extra) =
                    node.pools
                        .members
                        .finish_build(&template, built, Instant::now())
                {
                    node.retire(extra).await;
                }
                if node.pools.is_closing() {
                    let late = node.pools.members.drain();
                    node.retire_all(late).await;
                    return;
                }
            }
            Job::Retire(members) => node.retire_all(members).await,
            Job::Wait(d) => {
                let wait = node.pools.waiter(d);
                drop(node);
                wait.await;
            }
        }
    }
}
