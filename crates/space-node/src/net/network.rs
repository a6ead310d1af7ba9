//! The facade the node uses: slots from a pool, per-sandbox policy, the node's DNS and proxy
//! serving every slot, inbound connections.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::ca::Ca;
use super::dns::{self, SlotDns, Upstream};
use super::nft::{self, NftRunner, NodePorts, SlotFirewall, SystemNft};
use super::policy::Policy;
use super::proxy::{EgressProxy, ProxySlot};
use super::slots::{self, KernelSlots, Pool, Slot, SlotError};
use super::{
    Egress, NetworkSpec, NetworkStatus, SandboxNet, SecretBinding, SecretSource, Secrets,
    SlotLookup,
};

/// Node networking configuration (spaced flags).
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Off: every sandbox gets a fresh, empty network namespace (loopback only), as before.
    pub enabled: bool,
    /// Cut into /30 slots. Default 10.213.0.0/16.
    pub subnet: Ipv4Net,
    /// Slots kept ready. Default 32.
    pub pool_size: usize,
    /// Upstream DNS servers. Default: the nameservers of /etc/resolv.conf.
    pub dns_upstream: Vec<SocketAddr>,
    /// Extra CA certificates (PEM file) the egress proxy trusts upstream.
    pub upstream_ca: Option<PathBuf>,
    /// Policy of sandboxes created without one.
    pub default_egress: Egress,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            subnet: "10.213.0.0/16".parse().expect("valid"),
            pool_size: 32,
            dns_upstream: Vec::new(),
            upstream_ca: None,
            default_egress: Egress::Open,
        }
    }
}

/// Where a sandbox's slot is; persisted in its record so a restarted node re-adopts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotInfo {
    pub index: u32,
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    /// The pinned namespace file.
    pub netns: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no free network slot: {0}")]
    Exhausted(String),
    #[error("sandbox {0} has no network slot")]
    NotFound(String),
    #[error("failed to {step}: {source}")]
    Setup {
        step: String,
        #[source]
        source: std::io::Error,
    },
}

impl NetError {
    /// The node error for this networking failure of sandbox `id`.
    pub(crate) fn for_sandbox(self, id: &str) -> crate::api::NodeError {
        use crate::api::NodeError;
        match self {
            NetError::InvalidArgument(m) => NodeError::InvalidArgument(m),
            NetError::Exhausted(m) => NodeError::Exhausted(format!("network slots: {m}")),
            NetError::NotFound(_) => {
                NodeError::Conflict(format!("sandbox {id} has no network slot"))
            }
            e => NodeError::Internal(format!("network of sandbox {id}: {e}")),
        }
    }
}

fn setup(step: impl Into<String>) -> impl FnOnce(io::Error) -> NetError {
    move |source| NetError::Setup {
        step: step.into(),
        source,
    }
}

impl From<SlotError> for NetError {
    fn from(e: SlotError) -> NetError {
        match e {
            SlotError::Exhausted { .. } => NetError::Exhausted(e.to_string()),
            e => NetError::Setup {
                step: "set up a network slot".into(),
                source: io::Error::other(e),
            },
        }
    }
}

fn invalid(e: super::policy::PolicyError) -> NetError {
    NetError::InvalidArgument(e.to_string())
}

/// A point-in-time view of the slot pool (see [`Network::pool_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Slots made and waiting for a sandbox.
    pub ready: usize,
    /// Slots attached to a sandbox.
    pub attached: usize,
    /// Creates served by a ready slot.
    pub hits: u64,
    /// Creates that had to make their slot.
    pub misses: u64,
    pub created: u64,
    pub destroyed: u64,
}

/// What the node's DNS server and egress proxy serve a slot with, found by the slot's
/// address (the source of everything it sends; a microvm guest's is NATed to it).
#[derive(Debug, Clone)]
struct Served {
    dns: Arc<SlotDns>,
    proxy: ProxySlot,
}

type ServedMap = Arc<std::sync::RwLock<HashMap<Ipv4Addr, Served>>>;

/// What the node's DNS server (`pick` its `dns`) or proxy (its `proxy`) serves the slot at
/// an address with.
fn lookup_in<T: 'static>(served: &ServedMap, pick: fn(&Served) -> T) -> SlotLookup<T> {
    let served = served.clone();
    Arc::new(move |src| {
        let map = served.read().unwrap_or_else(|e| e.into_inner());
        map.get(&src).map(pick)
    })
}

/// A sandbox's slot while attached: its policy state, served by the node's DNS and proxy
/// while this lives.
#[derive(Debug)]
struct Attached {
    info: SlotInfo,
    net: Arc<SandboxNet>,
    firewall: Arc<SlotFirewall>,
    served: ServedMap,
}

impl Drop for Attached {
    fn drop(&mut self) {
        // The slot is no longer served, and its proxied connections end.
        let mut served = self.served.write().unwrap_or_else(|e| e.into_inner());
        if served
            .get(&self.info.address)
            .is_some_and(|s| Arc::ptr_eq(&s.proxy.net, &self.net))
        {
            served.remove(&self.info.address);
        }
        drop(served);
        self.net.close();
    }
}

/// The enabled half of [`Network`].
struct Inner {
    subnet: Ipv4Net,
    kernel: Arc<KernelSlots>,
    pool: Arc<Pool>,
    upstream: Arc<Upstream>,
    ca: Arc<Ca>,
    attached: Mutex<HashMap<String, Attached>>,
    /// Slots pinned by an earlier run and not adopted (yet); destroyed by `finish_recovery`.
    leftovers: Mutex<BTreeSet<u32>>,
    /// The slots the node's DNS and proxy serve, by address.
    served: ServedMap,
    /// The DNS server's and the proxy's accept loops.
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The node's sockets serving every slot: DNS over UDP and TCP, and the egress proxy. Bound
/// on all addresses at ports the kernel picks; the root table sends only redirected slot
/// traffic to them (decision 0059).
struct NodeListeners {
    dns_udp: std::net::UdpSocket,
    dns_tcp: std::net::TcpListener,
    proxy: std::net::TcpListener,
}

impl NodeListeners {
    fn bind() -> io::Result<NodeListeners> {
        let any = Ipv4Addr::UNSPECIFIED;
        let listeners = NodeListeners {
            dns_udp: std::net::UdpSocket::bind((any, 0))?,
            dns_tcp: std::net::TcpListener::bind((any, 0))?,
            proxy: std::net::TcpListener::bind((any, 0))?,
        };
        listeners.proxy.set_nonblocking(true)?;
        Ok(listeners)
    }

    fn ports(&self) -> io::Result<NodePorts> {
        Ok(NodePorts {
            dns_udp: self.dns_udp.local_addr()?.port(),
            dns_tcp: self.dns_tcp.local_addr()?.port(),
            proxy: self.proxy.local_addr()?.port(),
        })
    }
}

pub struct Network {
    cfg: NetConfig,
    home: Arc<File>,
    secrets: Arc<Secrets>,
    inner: Option<Inner>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Network")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

fn enable_forwarding() -> io::Result<()> {
    let now = std::fs::read_to_string(IP_FORWARD)
        .map_err(|e| io::Error::new(e.kind(), format!("{IP_FORWARD}: {e}")))?;
    if now.trim() != "1" {
        std::fs::write(IP_FORWARD, "1")
            .map_err(|e| io::Error::new(e.kind(), format!("{IP_FORWARD}: {e}")))?;
        info!("enabled IPv4 forwarding (net.ipv4.ip_forward=1) for sandbox networking");
    }
    Ok(())
}

impl Network {
    /// Sets up the node side (root table, forwarding, CA under `data_dir/ca`), removes
    /// leftover slots under `run_dir/netns` that no record adopts (see `finish_recovery`).
    pub async fn open(
        cfg: NetConfig,
        data_dir: &Path,
        run_dir: &Path,
    ) -> Result<Arc<Network>, NetError> {
        let home = File::open("/proc/thread-self/ns/net")
            .map(Arc::new)
            .map_err(setup("open the node's network namespace"))?;
        let secrets = Arc::new(Secrets::default());
        if !cfg.enabled {
            return Ok(Arc::new(Network {
                cfg,
                home,
                secrets,
                inner: None,
            }));
        }
        let subnet = cfg.subnet.trunc();
        if slots::slot_count(subnet) == 0 {
            return Err(NetError::InvalidArgument(format!(
                "slot subnet {subnet} is too small (at least a /30)"
            )));
        }
        let default_spec = NetworkSpec {
            egress: cfg.default_egress,
            allow: Vec::new(),
        };
        let default_policy = Policy::new(&default_spec, &[subnet]).map_err(invalid)?;

        enable_forwarding().map_err(setup("enable IPv4 forwarding"))?;
        let listeners = NodeListeners::bind()
            .map_err(setup("bind the node's DNS and egress proxy listeners"))?;
        let ports = listeners
            .ports()
            .map_err(setup("read the node's listener ports"))?;
        let nft: Arc<dyn NftRunner> = Arc::new(SystemNft::new());
        {
            let nft = nft.clone();
            let home = home.clone();
            let t0 = Instant::now();
            let table = nft::root_table(subnet, ports);
            tokio::task::spawn_blocking(move || nft.apply(Some(&home), &table))
                .await
                .map_err(io::Error::other)
                .and_then(|r| r.map_err(io::Error::other))
                .map_err(setup("install the node's nftables table (ip space_node)"))?;
            debug!(
                elapsed_us = t0.elapsed().as_micros() as u64,
                "root nftables table installed"
            );
        }

        let ca_dir = data_dir.join("ca");
        let ca = tokio::task::spawn_blocking(move || Ca::load_or_create(&ca_dir))
            .await
            .map_err(io::Error::other)
            .and_then(|r| r.map_err(io::Error::other))
            .map(Arc::new)
            .map_err(setup("load the node CA"))?;
        let upstream = Arc::new(Upstream::from_config(&cfg.dns_upstream));
        if upstream.servers().is_empty() {
            warn!(
                "no upstream DNS server (none given and none in /etc/resolv.conf): sandboxes cannot resolve names"
            );
        }
        let proxy = EgressProxy::new(
            ca.clone(),
            cfg.upstream_ca.as_deref(),
            upstream.clone(),
            secrets.clone(),
        )
        .map_err(|e| NetError::Setup {
            step: "set up the egress proxy".into(),
            source: io::Error::other(e),
        })?;

        let dir = run_dir.join("netns");
        let kernel =
            Arc::new(KernelSlots::new(subnet, &dir, nft.clone()).map_err(setup("open rtnetlink"))?);
        // Ready slots must leave room for sandboxes: at most half the subnet's slots.
        let max_pool = (slots::slot_count(subnet) / 2) as usize;
        let pool_size = if cfg.pool_size > max_pool {
            warn!(
                asked = cfg.pool_size,
                used = max_pool,
                %subnet,
                "slot pool larger than half the subnet's slots; clamped"
            );
            max_pool
        } else {
            cfg.pool_size
        };
        let pool = Pool::new(kernel.clone(), subnet, pool_size, default_policy);
        let leftovers: BTreeSet<u32> = slots::pinned_indexes(&dir).into_iter().collect();
        for &i in &leftovers {
            pool.reserve(i);
        }
        let served: ServedMap = Default::default();
        let dns_lookup = lookup_in(&served, |s| s.dns.clone());
        let mut tasks = dns::serve_node(listeners.dns_udp, listeners.dns_tcp, dns_lookup)
            .map_err(setup("serve the node's DNS"))?;
        let listener = tokio::net::TcpListener::from_std(listeners.proxy)
            .map_err(setup("serve the egress proxy"))?;
        tasks.push(proxy.serve_node(listener, lookup_in(&served, |s| s.proxy.clone())));
        info!(
            %subnet,
            pool = pool_size,
            default_egress = cfg.default_egress.as_str(),
            upstreams = ?upstream.servers(),
            dns_port = ports.dns_udp,
            proxy_port = ports.proxy,
            "sandbox networking on"
        );
        Ok(Arc::new(Network {
            cfg,
            home,
            secrets,
            inner: Some(Inner {
                subnet,
                kernel,
                pool,
                upstream,
                ca,
                attached: Mutex::new(HashMap::new()),
                leftovers: Mutex::new(leftovers),
                served,
                tasks,
            }),
        }))
    }

    fn inner(&self) -> Result<&Inner, NetError> {
        self.inner.as_ref().ok_or_else(|| {
            NetError::InvalidArgument("networking is off on this node (--network off)".into())
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    pub fn set_secret_source(&self, source: Arc<dyn SecretSource>) {
        self.secrets.set(source);
    }

    /// The spec a create without one gets.
    pub fn default_spec(&self) -> NetworkSpec {
        NetworkSpec {
            egress: self.cfg.default_egress,
            allow: Vec::new(),
        }
    }

    fn policy(&self, spec: &NetworkSpec) -> Result<Policy, NetError> {
        let reserved = [self.cfg.subnet.trunc()];
        Policy::new(spec, &reserved).map_err(invalid)
    }

    /// Validates a spec (InvalidArgument naming the bad rule).
    pub fn validate(&self, spec: &NetworkSpec) -> Result<(), NetError> {
        self.policy(spec).map(drop)
    }

    /// Has the node's DNS and proxy serve a slot now owned by `net`.
    fn serve(&self, inner: &Inner, slot: Slot, net: Arc<SandboxNet>) -> Attached {
        // The namespace's fd is not kept: its pin (`info.netns`) holds the namespace, and
        // `netns` opens it when asked. Nor does the slot hold a socket: the node serves it
        // from its own (decision 0059). No open file per sandbox here (issue 16).
        let Slot {
            info,
            netns: _,
            firewall,
        } = slot;
        let served = Served {
            dns: SlotDns::new(net.clone(), firewall.clone(), inner.upstream.clone()),
            proxy: ProxySlot::new(net.clone()),
        };
        inner
            .served
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(info.address, served);
        Attached {
            info,
            net,
            firewall,
            served: inner.served.clone(),
        }
    }

    fn insert(&self, inner: &Inner, id: &str, a: Attached) -> Result<SlotInfo, NetError> {
        let mut map = lock(&inner.attached);
        if map.contains_key(id) {
            let index = a.info.index;
            drop(a);
            drop(map);
            inner.pool.release(index);
            return Err(NetError::InvalidArgument(format!(
                "sandbox {id} already has a network slot"
            )));
        }
        let info = a.info.clone();
        map.insert(id.to_owned(), a);
        Ok(info)
    }

    /// Gives sandbox `id` a slot (from the pool, or made now), applies `spec`, starts its DNS
    /// and proxy.
    pub async fn attach(
        &self,
        id: &str,
        spec: &NetworkSpec,
        secrets: &[SecretBinding],
    ) -> Result<SlotInfo, NetError> {
        let inner = self.inner()?;
        let policy = self.policy(spec)?;
        let existing = lock(&inner.attached).get(id).map(|a| a.info.clone());
        if let Some(info) = existing {
            // Attached already (a retried create): converge on the spec.
            self.update(id, spec).await?;
            return Ok(info);
        }
        let t0 = Instant::now();
        let (slot, hit) = inner.pool.take().await?;
        let index = slot.info.index;
        let ran_nft = match slot.firewall.apply_policy(&policy).await {
            Ok(ran) => ran,
            Err(e) => {
                drop(slot);
                inner.pool.release(index);
                return Err(NetError::Setup {
                    step: "apply the egress policy".into(),
                    source: io::Error::other(e),
                });
            }
        };
        let net = SandboxNet::new(id, slot.info.address, policy, secrets.to_vec());
        let attached = self.serve(inner, slot, net);
        let info = self.insert(inner, id, attached)?;
        debug!(
            sandbox = id,
            index,
            pool_hit = hit,
            nft = ran_nft,
            elapsed_us = t0.elapsed().as_micros() as u64,
            "network slot attached"
        );
        Ok(info)
    }

    /// After a node restart: takes back the slot a record names (replaces its table and
    /// re-applies `spec` in one nft run, and serves it again).
    pub async fn adopt(
        &self,
        id: &str,
        slot: &SlotInfo,
        spec: &NetworkSpec,
        secrets: &[SecretBinding],
    ) -> Result<(), NetError> {
        let inner = self.inner()?;
        let policy = self.policy(spec)?;
        let expected = slots::slot_addresses(inner.subnet, slot.index);
        if expected.map(|(_, gw, addr)| (gw, addr)) != Some((slot.gateway, slot.address)) {
            return Err(NetError::InvalidArgument(format!(
                "slot {} ({}) is not in the node's slot subnet {}",
                slot.index, slot.address, inner.subnet
            )));
        }
        let was_leftover = lock(&inner.leftovers).remove(&slot.index);
        if !was_leftover && !inner.pool.reserve(slot.index) {
            return Err(NetError::InvalidArgument(format!(
                "slot {} is already in use",
                slot.index
            )));
        }
        let reopened = match inner.kernel.reopen(slot).await {
            Ok(s) => s,
            Err(e) => {
                inner.pool.release(slot.index);
                return Err(e.into());
            }
        };
        if let Err(e) = reopened.firewall.apply_policy(&policy).await {
            drop(reopened);
            inner.pool.release(slot.index);
            return Err(NetError::Setup {
                step: "apply the egress policy".into(),
                source: io::Error::other(e),
            });
        }
        let net = SandboxNet::new(id, slot.address, policy, secrets.to_vec());
        let attached = self.serve(inner, reopened, net);
        self.insert(inner, id, attached)?;
        debug!(sandbox = id, index = slot.index, "network slot adopted");
        Ok(())
    }

    /// Called once after every record was adopted: destroys unadopted slots, starts the pool.
    pub async fn finish_recovery(&self) {
        let Some(inner) = self.inner.as_ref() else {
            return;
        };
        let leftovers = std::mem::take(&mut *lock(&inner.leftovers));
        for index in leftovers {
            debug!(index, "destroying a leftover network slot");
            inner.pool.release_now(index).await;
        }
        inner.pool.start();
    }

    /// Replaces the sandbox's policy now; cuts connections it no longer allows.
    pub async fn update(&self, id: &str, spec: &NetworkSpec) -> Result<(), NetError> {
        let inner = self.inner()?;
        let policy = self.policy(spec)?;
        self.apply(inner, id, policy).await
    }

    /// Puts an already parsed `policy` in force for sandbox `id` (see [`Network::update`]).
    async fn apply(&self, inner: &Inner, id: &str, policy: Policy) -> Result<(), NetError> {
        let (firewall, net) = lock(&inner.attached)
            .get(id)
            .map(|a| (a.firewall.clone(), a.net.clone()))
            .ok_or_else(|| NetError::NotFound(id.to_owned()))?;
        let t0 = Instant::now();
        let ran = firewall
            .apply_policy(&policy)
            .await
            .map_err(|e| NetError::Setup {
                step: "apply the egress policy".into(),
                source: io::Error::other(e),
            })?;
        let cut = net.set_policy(policy);
        debug!(
            sandbox = id,
            nft = ran,
            cut,
            elapsed_us = t0.elapsed().as_micros() as u64,
            "egress policy updated"
        );
        Ok(())
    }

    /// Gives sandbox `from`'s slot to sandbox `to` (a warm pool's ready sandbox handed to its
    /// user, decision 0013) with `to`'s policy and secrets. DNS and proxy keep serving; they
    /// answer for `to` from now on.
    pub async fn rename(
        &self,
        from: &str,
        to: &str,
        spec: &NetworkSpec,
        secrets: &[SecretBinding],
    ) -> Result<SlotInfo, NetError> {
        let inner = self.inner()?;
        // Checked before anything moves, so a bad policy leaves the slot where it was.
        let policy = self.policy(spec)?;
        let info = {
            let mut map = lock(&inner.attached);
            if map.contains_key(to) {
                return Err(NetError::InvalidArgument(format!(
                    "sandbox {to} already has a network slot"
                )));
            }
            let a = map
                .remove(from)
                .ok_or_else(|| NetError::NotFound(from.to_owned()))?;
            a.net.set_id(to);
            a.net.set_secrets(secrets.to_vec());
            let info = a.info.clone();
            map.insert(to.to_owned(), a);
            info
        };
        self.apply(inner, to, policy).await?;
        Ok(info)
    }

    /// Stops DNS and proxy of the sandbox and destroys its slot (in the background). Idempotent.
    pub async fn detach(&self, id: &str) {
        let Some(inner) = self.inner.as_ref() else {
            return;
        };
        let removed = lock(&inner.attached).remove(id);
        let Some(a) = removed else {
            return;
        };
        let index = a.info.index;
        drop(a);
        inner.pool.release(index);
    }

    /// The slot of sandbox `id`, if one is attached.
    pub fn slot(&self, id: &str) -> Option<SlotInfo> {
        let inner = self.inner.as_ref()?;
        lock(&inner.attached).get(id).map(|a| a.info.clone())
    }

    /// Whether sandbox `id` has a slot attached.
    pub fn is_attached(&self, id: &str) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|inner| lock(&inner.attached).contains_key(id))
    }

    /// The pinned namespace of the sandbox's slot, opened now (for launching its init, or a
    /// connection inside it). None: no slot attached.
    pub fn netns(&self, id: &str) -> Result<Option<Arc<std::fs::File>>, NetError> {
        let Some(inner) = self.inner.as_ref() else {
            return Ok(None);
        };
        let Some(pin) = lock(&inner.attached).get(id).map(|a| a.info.netns.clone()) else {
            return Ok(None);
        };
        File::open(&pin)
            .map(|f| Some(Arc::new(f)))
            .map_err(setup("open the slot's namespace"))
    }

    /// The node's own network namespace, opened at `open` (the runtime returns to it).
    pub fn home_netns(&self) -> Arc<std::fs::File> {
        self.home.clone()
    }

    /// A TCP connection to `host:port` made inside the sandbox's slot: its loopback (a
    /// namespace sandbox) or a microvm guest's link address.
    pub async fn connect(
        &self,
        id: &str,
        host: Ipv4Addr,
        port: u16,
    ) -> Result<tokio::net::TcpStream, NetError> {
        let ns = self
            .netns(id)?
            .ok_or_else(|| NetError::NotFound(id.to_owned()))?;
        let step = format!("connect to port {port} in sandbox {id}");
        let stream = tokio::task::spawn_blocking(move || {
            space_sys::netns::run_in(ns.as_fd(), || {
                let s = std::net::TcpStream::connect_timeout(
                    &(host, port).into(),
                    std::time::Duration::from_secs(5),
                )?;
                s.set_nonblocking(true)?;
                Ok::<_, io::Error>(s)
            })
            .and_then(|r| r)
        })
        .await
        .map_err(io::Error::other)
        .and_then(|r| r)
        .map_err(setup(step.clone()))?;
        tokio::net::TcpStream::from_std(stream).map_err(setup(step))
    }

    /// The CA certificate (PEM) sandboxes trust for intercepted TLS.
    pub fn ca_pem(&self) -> String {
        self.inner
            .as_ref()
            .map(|i| i.ca.cert_pem().to_owned())
            .unwrap_or_default()
    }

    pub fn status(&self, id: &str) -> Option<NetworkStatus> {
        let inner = self.inner.as_ref()?;
        let map = lock(&inner.attached);
        let a = map.get(id)?;
        let policy = a.net.policy();
        Some(NetworkStatus {
            address: a.info.address,
            gateway: a.info.gateway,
            egress: policy.egress(),
            allow: policy.spec().allow.clone(),
        })
    }

    /// How many more sandboxes could get a slot (the subnet's slots not in use or ready);
    /// `None` with networking off.
    pub fn slot_capacity(&self) -> Option<u64> {
        let inner = self.inner.as_ref()?;
        let total = u64::from(slots::slot_count(inner.subnet));
        let used = (inner.pool.ready() + lock(&inner.attached).len()) as u64;
        Some(total.saturating_sub(used))
    }

    /// The slot pool's gauges and counters, for `/metrics`; `None` with networking off.
    pub fn pool_stats(&self) -> Option<PoolSnapshot> {
        let inner = self.inner.as_ref()?;
        let stats = &inner.pool.stats;
        Some(PoolSnapshot {
            ready: inner.pool.ready(),
            attached: lock(&inner.attached).len(),
            hits: stats.hits.load(Ordering::Relaxed),
            misses: stats.misses.load(Ordering::Relaxed),
            created: stats.created.load(Ordering::Relaxed),
            destroyed: stats.destroyed.load(Ordering::Relaxed),
        })
    }

    /// Stops the pool's refill and destroys its ready slots (attached slots stay, for the next
    /// run to adopt). For a clean shutdown and tests.
    pub async fn close(&self) {
        if let Some(inner) = self.inner.as_ref() {
            inner.pool.close().await;
        }
    }
}

/// Real-kernel tests (root). Each runs its whole body on a thread inside a fresh network
/// namespace (the test's "node"), with its own runtime, so nothing touches the host's
/// interfaces or ruleset; a second namespace ("world", 203.0.113.2) stands for the internet.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::dns::tests::fake_upstream;
    use std::io::{Read, Write};
    use std::net::{SocketAddrV4, TcpStream};
    use std::process::Command;
    use std::time::Duration;

    const WORLD: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    fn sh(ns: &File, args: &str) {
        let out = space_sys::netns::run_in(ns.as_fd(), || {
            Command::new("ip").args(args.split_whitespace()).output()
        })
        .unwrap()
        .unwrap();
        assert!(
            out.status.success(),
            "ip {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A node namespace and a world namespace joined by a veth; a TCP server in the world on
    /// 203.0.113.2:8080 that answers "hi". Runs `body` inside the node with a runtime.
    fn with_lab<F>(body: F)
    where
        F: FnOnce(PathBuf) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> + Send,
    {
        let dir = tempfile::tempdir().unwrap();
        let node_pin = dir.path().join("node");
        let world_pin = dir.path().join("world");
        space_sys::netns::create_pinned(&node_pin).unwrap();
        space_sys::netns::create_pinned(&world_pin).unwrap();
        let node = File::open(&node_pin).unwrap();
        let world = File::open(&world_pin).unwrap();
        sh(&node, "link set lo up");
        sh(&world, "link set lo up");
        sh(
            &node,
            &format!(
                "link add wv0 type veth peer name wv1 netns {}",
                world_pin.display()
            ),
        );
        sh(&node, "addr add 203.0.113.1/24 dev wv0");
        sh(&node, "link set wv0 up");
        sh(&world, "addr add 203.0.113.2/24 dev wv1");
        sh(&world, "link set wv1 up");
        let server = space_sys::netns::run_in(world.as_fd(), || {
            std::net::TcpListener::bind(SocketAddrV4::new(WORLD, 8080))
        })
        .unwrap()
        .unwrap();
        std::thread::spawn(move || {
            for mut c in server.incoming().flatten() {
                let _ = c.write_all(b"hi");
                // Keep it open until the client goes (or is cut).
                std::thread::spawn(move || {
                    let mut b = [0u8; 64];
                    while matches!(c.read(&mut b), Ok(n) if n > 0) {
                        let _ = c.write_all(&b[..1]);
                    }
                });
            }
        });
        let http = space_sys::netns::run_in(world.as_fd(), || {
            std::net::TcpListener::bind(SocketAddrV4::new(WORLD, 80))
        })
        .unwrap()
        .unwrap();
        std::thread::spawn(move || {
            for mut c in http.incoming().flatten() {
                let mut b = [0u8; 1024];
                let _ = c.read(&mut b);
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nworld",
                );
            }
        });
        let run = dir.path().join("run");
        let result = space_sys::netns::run_in(node.as_fd(), || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(body(run.clone()));
                rt.shutdown_timeout(Duration::from_secs(2));
            }))
        })
        .unwrap();
        // Unpin whatever slots are left, then the lab.
        for i in slots::pinned_indexes(&run.join("netns")) {
            let _ = space_sys::netns::remove_pinned(&slots::pin_path(&run.join("netns"), i));
        }
        drop((node, world));
        space_sys::netns::remove_pinned(&node_pin).unwrap();
        space_sys::netns::remove_pinned(&world_pin).unwrap();
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    }

    /// Connects from inside the slot (as the sandbox would) and reads the greeting.
    fn reach(ns: &File, to: SocketAddrV4) -> io::Result<TcpStream> {
        space_sys::netns::run_in(ns.as_fd(), || {
            let mut s = TcpStream::connect_timeout(&to.into(), Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let mut b = [0u8; 2];
            s.read_exact(&mut b)?;
            assert_eq!(&b, b"hi");
            Ok(s)
        })
        .unwrap()
    }

    async fn reach_async(ns: Arc<File>, to: SocketAddrV4) -> io::Result<TcpStream> {
        tokio::task::spawn_blocking(move || reach(&ns, to))
            .await
            .unwrap()
    }

    /// A plain HTTP GET from inside the slot to 203.0.113.2:80 (redirected to the egress
    /// proxy); the whole response.
    async fn http_get(ns: Arc<File>) -> String {
        tokio::task::spawn_blocking(move || {
            space_sys::netns::run_in(ns.as_fd(), || {
                let to = SocketAddrV4::new(WORLD, 80);
                let mut s = TcpStream::connect_timeout(&to.into(), Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(4)))?;
                s.write_all(b"GET / HTTP/1.1\r\nHost: 203.0.113.2\r\nConnection: close\r\n\r\n")?;
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                Ok::<_, io::Error>(out)
            })
            .unwrap()
            .unwrap_or_else(|e| format!("error: {e}"))
        })
        .await
        .unwrap()
    }

    fn dns_query(ns: &File, name: &str) -> hickory_proto::op::Message {
        use hickory_proto::op::{Message, Query};
        use hickory_proto::rr::{Name, RecordType};
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        let bytes = q.to_vec().unwrap();
        space_sys::netns::run_in(ns.as_fd(), || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
            // Any resolver address: the slot's NAT sends port 53 to the node's server.
            s.send_to(&bytes, "192.0.2.53:53").unwrap();
            let mut buf = [0u8; 1500];
            let n = s.recv(&mut buf).unwrap();
            Message::from_vec(&buf[..n]).unwrap()
        })
        .unwrap()
    }

    fn spec(egress: Egress, allow: &[&str]) -> NetworkSpec {
        NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    async fn open(run: &Path, upstream: SocketAddr, pool: usize) -> Arc<Network> {
        let cfg = NetConfig {
            pool_size: pool,
            dns_upstream: vec![upstream],
            ..NetConfig::default()
        };
        Network::open(cfg, &run.join("data"), run).await.unwrap()
    }

    #[test]
    fn policy_decides_what_a_slot_reaches() {
        if !is_root() {
            eprintln!("needs root");
            return;
        }
        with_lab(|run| {
            Box::pin(async move {
                let (up, _) = fake_upstream(vec![("api.example.com", vec![WORLD])]).await;
                let net = open(&run, up, 1).await;
                assert!(net.enabled());
                assert!(net.ca_pem().contains("BEGIN CERTIFICATE"));

                // A miss (the pool has not started) and the time it takes.
                let t0 = Instant::now();
                let info = net
                    .attach("a", &spec(Egress::Open, &[]), &[])
                    .await
                    .unwrap();
                let first = t0.elapsed();
                // Now the pool starts filling.
                net.finish_recovery().await;
                let ns = net.netns("a").unwrap().unwrap();
                let to = SocketAddrV4::new(WORLD, 8080);

                // Open: the world is reachable; the node's own address is not.
                let mut live = reach_async(ns.clone(), to).await.unwrap();
                let node_addr = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 1), 8080);
                assert!(reach_async(ns.clone(), node_addr).await.is_err());
                assert!(
                    reach_async(ns.clone(), SocketAddrV4::new(info.gateway, 22))
                        .await
                        .is_err()
                );

                // Port 80 goes through the egress proxy (by original destination here).
                let got = http_get(ns.clone()).await;
                assert!(
                    got.starts_with("HTTP/1.1 200") && got.ends_with("world"),
                    "{got}"
                );

                // None: refused at once, and the live connection is cut.
                let t0 = Instant::now();
                net.update("a", &spec(Egress::None, &[])).await.unwrap();
                let update = t0.elapsed();
                let t0 = Instant::now();
                let err = reach_async(ns.clone(), to).await.unwrap_err();
                assert!(
                    t0.elapsed() < Duration::from_secs(1),
                    "{err}: must fail fast"
                );
                let cut = tokio::task::spawn_blocking(move || {
                    let _ = live.write_all(b"x");
                    let mut b = [0u8; 1];
                    live.read(&mut b)
                })
                .await
                .unwrap();
                assert!(
                    !matches!(cut, Ok(1)),
                    "the established flow must be cut: {cut:?}"
                );

                let got = http_get(ns.clone()).await;
                assert!(!got.contains("world"), "the proxy must refuse: {got}");

                // Allowlist by CIDR: on 80 and 443 unless the rule names its ports.
                net.update("a", &spec(Egress::Allowlist, &["203.0.113.0/24"]))
                    .await
                    .unwrap();
                assert!(http_get(ns.clone()).await.ends_with("world"));
                assert!(
                    reach_async(ns.clone(), to).await.is_err(),
                    "8080 is not named"
                );
                net.update("a", &spec(Egress::Allowlist, &["203.0.113.0/24:8080"]))
                    .await
                    .unwrap();
                reach_async(ns.clone(), to).await.unwrap();
                assert!(
                    !http_get(ns.clone()).await.ends_with("world"),
                    "80 is not named"
                );
                net.update("a", &spec(Egress::Allowlist, &["198.51.100.0/24:*"]))
                    .await
                    .unwrap();
                assert!(reach_async(ns.clone(), to).await.is_err());

                // Allowlist by name: refused names, and the answer opens the way.
                net.update("a", &spec(Egress::Allowlist, &["api.example.com:8080"]))
                    .await
                    .unwrap();
                assert!(reach_async(ns.clone(), to).await.is_err());
                let m = {
                    let ns = ns.clone();
                    tokio::task::spawn_blocking(move || dns_query(&ns, "other.org"))
                        .await
                        .unwrap()
                };
                assert_eq!(
                    m.metadata.response_code,
                    hickory_proto::op::ResponseCode::Refused
                );
                let m = {
                    let ns = ns.clone();
                    tokio::task::spawn_blocking(move || dns_query(&ns, "api.example.com"))
                        .await
                        .unwrap()
                };
                assert_eq!(m.answers.len(), 1, "{m:?}");
                reach_async(ns.clone(), to).await.unwrap();
                // Dropping the name takes its address away.
                net.update("a", &spec(Egress::Allowlist, &["b.example.com:8080"]))
                    .await
                    .unwrap();
                assert!(reach_async(ns.clone(), to).await.is_err());

                let st = net.status("a").unwrap();
                assert_eq!((st.address, st.egress), (info.address, Egress::Allowlist));

                // A second attach takes the pooled slot, with no nft run.
                let inner = net.inner.as_ref().unwrap();
                for _ in 0..400 {
                    if inner.pool.ready() == 1 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert_eq!(inner.pool.ready(), 1);
                let t0 = Instant::now();
                let info_b = net
                    .attach("b", &spec(Egress::Open, &[]), &[])
                    .await
                    .unwrap();
                let hit = t0.elapsed();
                assert_ne!(info_b.index, info.index);
                reach_async(net.netns("b").unwrap().unwrap(), to)
                    .await
                    .unwrap();
                let stats = &inner.pool.stats;
                let (hits, misses) = (
                    stats.hits.load(std::sync::atomic::Ordering::Relaxed),
                    stats.misses.load(std::sync::atomic::Ordering::Relaxed),
                );
                assert_eq!((hits, misses), (1, 1));
                eprintln!(
                    "slot attach: miss {first:?}, pool hit {hit:?}; policy update {update:?}"
                );

                // Sandboxes do not reach each other.
                let b_inside =
                    space_sys::netns::run_in(net.netns("b").unwrap().unwrap().as_fd(), || {
                        std::net::TcpListener::bind("0.0.0.0:9000")
                    })
                    .unwrap()
                    .unwrap();
                net.update("a", &spec(Egress::Open, &[])).await.unwrap();
                assert!(
                    reach_async(ns.clone(), SocketAddrV4::new(info_b.address, 9000))
                        .await
                        .is_err()
                );
                drop(b_inside);

                // Inbound: the node connects to the sandbox's loopback.
                let inside = space_sys::netns::run_in(ns.as_fd(), || {
                    std::net::TcpListener::bind("127.0.0.1:7000")
                })
                .unwrap()
                .unwrap();
                let c = net.connect("a", Ipv4Addr::LOCALHOST, 7000).await.unwrap();
                assert!(inside.accept().is_ok());
                drop(c);
                assert!(net.connect("a", Ipv4Addr::LOCALHOST, 7001).await.is_err());
                assert!(matches!(
                    net.connect("zz", Ipv4Addr::LOCALHOST, 1).await,
                    Err(NetError::NotFound(_))
                ));
                assert!(matches!(
                    net.update("a", &spec(Egress::Allowlist, &["10.213.0.0/24"]))
                        .await,
                    Err(NetError::InvalidArgument(_))
                ));

                // Detach frees the slot: the pin and the host veth go.
                drop(ns);
                net.detach("a").await;
                net.detach("a").await;
                assert!(!net.is_attached("a"));
                let pin = slots::pin_path(&run.join("netns"), info.index);
                for _ in 0..400 {
                    if !pin.exists() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert!(!pin.exists());
                net.detach("b").await;
                net.close().await;
            })
        });
    }

    #[test]
    fn a_restarted_node_adopts_its_slots_and_removes_the_rest() {
        if !is_root() {
            eprintln!("needs root");
            return;
        }
        with_lab(|run| {
            Box::pin(async move {
                let (up, _) = fake_upstream(vec![]).await;
                let net = open(&run, up, 0).await;
                net.finish_recovery().await;
                let keep = net
                    .attach("keep", &spec(Egress::Open, &[]), &[])
                    .await
                    .unwrap();
                let lose = net
                    .attach("lose", &spec(Egress::Open, &[]), &[])
                    .await
                    .unwrap();
                let only_8080 = spec(Egress::Allowlist, &["203.0.113.2:8080"]);
                let same = net.attach("same", &only_8080, &[]).await.unwrap();
                let record = |info: &SlotInfo| {
                    nft::FirewallRecord::read(&nft::FirewallRecord::path(&info.netns))
                };
                assert_eq!(record(&same).unwrap().spec, only_8080);
                // A record that names another table is not trusted: "keep"'s is replaced.
                let mut stale = record(&keep).unwrap();
                stale.table = "0".repeat(64);
                stale
                    .store(&nft::FirewallRecord::path(&keep.netns))
                    .unwrap();
                // The "crash": the first Network goes without detaching.
                let inner = net.inner.as_ref().unwrap();
                lock(&inner.attached).clear();
                drop(net);

                let net = open(&run, up, 0).await;
                net.adopt(
                    "keep",
                    &keep,
                    &spec(Egress::Allowlist, &["203.0.113.2:8080"]),
                    &[],
                )
                .await
                .unwrap();
                // Its record names today's table and the same policy: adopted as it is.
                net.adopt("same", &same, &only_8080, &[]).await.unwrap();
                net.finish_recovery().await;
                assert!(!lose.netns.exists(), "the unadopted slot is destroyed");
                assert!(record(&lose).is_none(), "its firewall record goes with it");
                assert!(keep.netns.exists());
                assert_eq!(record(&keep).unwrap().spec, only_8080);
                // Replaced: the record names today's table again.
                let subnet = NetConfig::default().subnet;
                let today = nft::slot_table(&nft::deny_ranges(subnet), keep.gateway);
                assert_eq!(record(&keep).unwrap().table, nft::table_digest(&today));
                reach_async(
                    net.netns("same").unwrap().unwrap(),
                    SocketAddrV4::new(WORLD, 8080),
                )
                .await
                .unwrap();
                // The adopted policy is the kernel's: closing it cuts the way out.
                net.update("same", &spec(Egress::None, &[])).await.unwrap();
                assert_eq!(record(&same).unwrap().spec, spec(Egress::None, &[]));
                assert!(
                    reach_async(
                        net.netns("same").unwrap().unwrap(),
                        SocketAddrV4::new(WORLD, 8080)
                    )
                    .await
                    .is_err()
                );
                reach_async(
                    net.netns("keep").unwrap().unwrap(),
                    SocketAddrV4::new(WORLD, 8080),
                )
                .await
                .unwrap();
                // Its index is not handed out again.
                let other = net
                    .attach("other", &spec(Egress::None, &[]), &[])
                    .await
                    .unwrap();
                assert_ne!(other.index, keep.index);
                assert_eq!(other.index, lose.index);
                net.detach("keep").await;
                net.detach("other").await;
                net.detach("same").await;
                net.close().await;
            })
        });
    }

    /// A destroyed slot goes with its namespace: the kernel removes the veth pair soon after
    /// the pin, and the index is free when it has. A namespace something still holds keeps
    /// its pair only until the teardown wait ends; then the pair is deleted (decision 0052).
    #[test]
    fn a_destroyed_slot_takes_its_pair_along_and_a_held_one_is_cut_off() {
        if !is_root() {
            eprintln!("needs root");
            return;
        }
        with_lab(|run| {
            Box::pin(async move {
                use super::slots::SlotBackend;
                // In the lab's node namespace (/sys shows the host's).
                let link = |i: u32| {
                    Command::new("ip")
                        .args(["link", "show", "dev", &slots::host_ifname(i)])
                        .output()
                        .unwrap()
                        .status
                        .success()
                };
                let subnet: Ipv4Net = "10.213.0.0/24".parse().unwrap();
                let k = KernelSlots::new(subnet, &run.join("netns"), Arc::new(SystemNft::new()))
                    .unwrap();
                let policy = Policy::new(&spec(Egress::Open, &[]), &[subnet]).unwrap();
                let slot = k.create(0, &policy).await.unwrap();
                assert!(link(0));
                // The host end carries no IPv6 (no route in the node's IPv6 table); inside,
                // IPv6 is off and any port may be bound.
                let host_conf = format!(
                    "/proc/sys/net/ipv6/conf/{}/disable_ipv6",
                    slots::host_ifname(0)
                );
                if Path::new("/proc/sys/net/ipv6").exists() {
                    assert_eq!(std::fs::read_to_string(&host_conf).unwrap().trim(), "1");
                    let routes = Command::new("ip")
                        .args([
                            "-6",
                            "route",
                            "show",
                            "table",
                            "all",
                            "dev",
                            &slots::host_ifname(0),
                        ])
                        .output()
                        .unwrap();
                    assert_eq!(String::from_utf8_lossy(&routes.stdout).trim(), "");
                }
                let inside = space_sys::netns::run_in(slot.netns.as_fd(), || {
                    [
                        "/proc/sys/net/ipv4/ip_unprivileged_port_start",
                        "/proc/sys/net/ipv6/conf/all/disable_ipv6",
                        "/proc/sys/net/ipv6/conf/default/disable_ipv6",
                        "/proc/sys/net/ipv6/conf/eth0/disable_ipv6",
                    ]
                    .map(|p| {
                        std::fs::read_to_string(p)
                            .unwrap_or_default()
                            .trim()
                            .to_owned()
                    })
                })
                .unwrap();
                assert_eq!(inside[0], "0");
                if Path::new("/proc/sys/net/ipv6").exists() {
                    assert_eq!(inside[1..], ["1", "1", "1"]);
                }
                drop(slot);
                let t0 = Instant::now();
                k.destroy(0).await;
                assert!(!link(0), "the pair went with the namespace");
                // Under the teardown wait: the kernel took the pair, not the fallback.
                assert!(
                    t0.elapsed() < Duration::from_millis(4500),
                    "{:?}",
                    t0.elapsed()
                );

                let slot = k.create(1, &policy).await.unwrap();
                let held = File::open(&slot.info.netns).unwrap();
                drop(slot);
                let t0 = Instant::now();
                k.destroy(1).await;
                assert!(!link(1), "a held namespace loses its pair");
                assert!(t0.elapsed() >= Duration::from_secs(4), "{:?}", t0.elapsed());
                // The namespace itself lives on with whoever holds it, without a way out.
                let links = space_sys::netns::run_in(held.as_fd(), || {
                    Command::new("ip").args(["-o", "link"]).output()
                })
                .unwrap()
                .unwrap();
                let links = String::from_utf8_lossy(&links.stdout);
                assert!(!links.contains("eth0"), "{links}");
            })
        });
    }

    #[tokio::test]
    async fn networking_off_attaches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = NetConfig {
            enabled: false,
            ..NetConfig::default()
        };
        let net = Network::open(cfg, dir.path(), dir.path()).await.unwrap();
        assert!(!net.enabled());
        assert!(net.attach("a", &NetworkSpec::default(), &[]).await.is_err());
        assert!(!net.is_attached("a"));
        assert!(net.status("a").is_none());
        assert_eq!(net.ca_pem(), "");
        net.detach("a").await;
        net.finish_recovery().await;
        // Validation still works (the API checks specs either way).
        assert!(
            net.validate(&spec(Egress::Allowlist, &["nope/33"]))
                .is_err()
        );
        assert!(
            net.validate(&spec(Egress::Allowlist, &["*.example.com"]))
                .is_ok()
        );
    }
}
