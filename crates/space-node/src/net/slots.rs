//! Network slots (decision 0012): node-owned network namespaces, each with a routed veth pair,
//! and a deny-all firewall; plus the pool that keeps some ready so that creating a sandbox
//! makes none. The node serves every slot's DNS and egress proxy from its own namespace
//! (decision 0059), so a slot holds no socket of the node.
//!
//! Slot `i` of subnet S (cut into /30s) is network S+4i: the host side `spv<i>` holds .1 (the
//! gateway), the peer `eth0` inside holds .2 with a default route via .1. Its namespace is
//! pinned at `<run_dir>/netns/slot-<i>`. Links, addresses and routes go through rtnetlink
//! (a socket made inside the slot for the inside half); sysctls and the firewall are written
//! from a thread inside the slot.

use std::collections::{BTreeSet, VecDeque};
use std::fs::{self, File};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::packet_route::link::{InfoData, InfoKind, InfoVeth};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};
use space_sys::netns;
use tracing::{debug, warn};

use super::network::SlotInfo;
use super::nft::{self, FirewallRecord, NftError, NftRunner, SlotFirewall, SlotSets};
use super::policy::Policy;

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("failed to {step} (slot {index}): {source}")]
    Io {
        index: u32,
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("failed to {step} (slot {index}): {source}")]
    Netlink {
        index: u32,
        step: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to set up the firewall of slot {index}: {source}")]
    Nft {
        index: u32,
        #[source]
        source: NftError,
    },
    #[error("all {count} slots of {subnet} are in use")]
    Exhausted { subnet: Ipv4Net, count: u32 },
}

impl SlotError {
    fn io(index: u32, step: impl Into<String>) -> impl FnOnce(io::Error) -> SlotError {
        move |source| SlotError::Io {
            index,
            step: step.into(),
            source,
        }
    }
    fn netlink(index: u32, step: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> SlotError {
        move |source| SlotError::Netlink {
            index,
            step: step.into(),
            source,
        }
    }
}

/// How many /30 slots `subnet` holds.
pub fn slot_count(subnet: Ipv4Net) -> u32 {
    match subnet.prefix_len() {
        p if p > 30 => 0,
        // A /0../1 would overflow u32; nobody gives a node that much.
        0 | 1 => 1 << 29,
        p => 1u32 << (30 - p),
    }
}

/// Slot `index`'s /30, gateway (.1) and address (.2).
pub fn slot_addresses(subnet: Ipv4Net, index: u32) -> Option<(Ipv4Net, Ipv4Addr, Ipv4Addr)> {
    if index >= slot_count(subnet) {
        return None;
    }
    let base = u32::from(subnet.network()) + index * 4;
    let net = Ipv4Net::new(Ipv4Addr::from(base), 30).ok()?;
    Some((net, Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2)))
}

/// The host-side interface of slot `index`.
pub fn host_ifname(index: u32) -> String {
    format!("spv{index}")
}

/// The pinned namespace of slot `index` under `dir` (`<run_dir>/netns`).
pub fn pin_path(dir: &Path, index: u32) -> PathBuf {
    dir.join(format!("slot-{index}"))
}

/// Slot indexes pinned under `dir` (leftovers of an earlier run, or adoptable ones).
pub fn pinned_indexes(dir: &Path) -> Vec<u32> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<u32> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("slot-")?
                .parse::<u32>()
                .ok()
        })
        .collect();
    v.sort_unstable();
    v
}

/// A ready slot: its namespace and firewall.
#[derive(Debug)]
pub struct Slot {
    pub info: SlotInfo,
    pub netns: Arc<File>,
    pub firewall: Arc<SlotFirewall>,
}

/// Makes and destroys slots (the kernel, or a fake in tests).
#[async_trait]
pub trait SlotBackend: Send + Sync + std::fmt::Debug + 'static {
    /// Makes slot `index` with `initial` already in its firewall. Cleans up after itself on
    /// failure.
    async fn create(&self, index: u32, initial: &Policy) -> Result<Slot, SlotError>;
    /// Destroys slot `index` (whatever exists of it). When it returns the index may be reused.
    async fn destroy(&self, index: u32);
}

/// Slots in the kernel.
#[derive(Debug)]
pub struct KernelSlots {
    subnet: Ipv4Net,
    dir: PathBuf,
    nft: Arc<dyn NftRunner>,
    deny: Vec<Ipv4Net>,
    /// rtnetlink in the node's own namespace.
    node: rtnetlink::Handle,
    /// The node's namespace's `/proc/sys/net/ipv6/conf` (none without IPv6): each slot's
    /// host end has IPv6 turned off before it is up (see `try_create`).
    host_ipv6_conf: Option<OwnedFd>,
}

/// A slot's sysctls, under `/proc/sys/net`.
const SLOT_SYSCTLS: [(&str, &str); 3] = [
    ("ipv4/ip_unprivileged_port_start", "0"),
    ("ipv6/conf/all/disable_ipv6", "1"),
    ("ipv6/conf/default/disable_ipv6", "1"),
];

/// Writes the calling thread's namespace's [`SLOT_SYSCTLS`], through one lookup of
/// `/proc/sys/net`: every namespace that ever looked up a sysctl has a `net` entry of its own
/// under `/proc/sys`, all of them compared by name at each lookup there (a cost that grew
/// with the number of slots; issue 16).
fn write_sysctls() -> io::Result<()> {
    let net = rustix::fs::open(
        "/proc/sys/net",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| io::Error::new(e.kind(), format!("/proc/sys/net: {e}")))?;
    for (path, value) in SLOT_SYSCTLS {
        match write_at(&net, path, value) {
            Ok(()) => {}
            // IPv6 compiled out or disabled at boot: nothing to disable.
            Err(e) if e.kind() == io::ErrorKind::NotFound && path.starts_with("ipv6") => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("/proc/sys/net/{path}: {e}"),
                ));
            }
        }
    }
    Ok(())
}

/// Writes `value` to the file `path` under the directory `dir`.
fn write_at(dir: &OwnedFd, path: &str, value: &str) -> io::Result<()> {
    let fd = rustix::fs::openat(
        dir,
        path,
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    rustix::io::write(&fd, value.as_bytes())?;
    Ok(())
}

async fn link_index(h: &rtnetlink::Handle, name: &str) -> Result<u32, rtnetlink::Error> {
    let mut links = h.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await? {
        Some(l) => Ok(l.header.index),
        None => Err(rtnetlink::Error::RequestFailed),
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(io::Error::other)
}

impl KernelSlots {
    /// Slots of `subnet` pinned under `dir`. Opens an rtnetlink socket in the calling thread's
    /// namespace (the node's) and drives it on the current runtime.
    pub fn new(subnet: Ipv4Net, dir: &Path, nft: Arc<dyn NftRunner>) -> io::Result<KernelSlots> {
        fs::create_dir_all(dir)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        let (conn, node, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let host_ipv6_conf = match rustix::fs::open(
            "/proc/sys/net/ipv6/conf",
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            Ok(fd) => Some(fd),
            Err(e) if e == rustix::io::Errno::NOENT => None,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("/proc/sys/net/ipv6/conf: {e}"),
                ));
            }
        };
        Ok(KernelSlots {
            subnet,
            dir: dir.to_owned(),
            nft,
            deny: nft::deny_ranges(subnet),
            node,
            host_ipv6_conf,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes back a slot an earlier run made. Its firewall holds what the slot's record
    /// says; without a record that names today's table, an unknown policy and perhaps an
    /// older node's table, both replaced by the first policy the caller applies.
    pub async fn reopen(&self, info: &SlotInfo) -> Result<Slot, SlotError> {
        let index = info.index;
        let path = info.netns.clone();
        let ns = blocking(move || File::open(&path))
            .await
            .and_then(|r| r)
            .map_err(SlotError::io(
                index,
                format!("open {}", info.netns.display()),
            ))?;
        // The record says whether the firewall holds today's table, and which policy: then
        // nothing need run unless the sandbox's policy is another (issue 16).
        let digest = nft::table_digest(&nft::slot_table(&self.deny, info.gateway));
        let record_path = FirewallRecord::path(&info.netns);
        let recorded = FirewallRecord::read(&record_path)
            .filter(|r| r.table == digest)
            .and_then(|r| Policy::new(&r.spec, &[self.subnet]).ok());
        let firewall = match recorded {
            Some(applied) => SlotFirewall::adopted_as_recorded(
                info.netns.clone(),
                self.nft.clone(),
                info.address,
                &applied,
            ),
            None => SlotFirewall::adopted(
                info.netns.clone(),
                self.nft.clone(),
                info.address,
                nft::replace_slot_table(&self.deny, info.gateway),
            ),
        };
        let firewall = Arc::new(firewall.recorded(record_path, digest));
        Ok(Slot {
            info: info.clone(),
            netns: Arc::new(ns),
            firewall,
        })
    }

    async fn try_create(&self, index: u32, initial: &Policy) -> Result<Slot, SlotError> {
        let (_, gateway, address) =
            slot_addresses(self.subnet, index).ok_or(SlotError::Exhausted {
                subnet: self.subnet,
                count: slot_count(self.subnet),
            })?;
        let pin = pin_path(&self.dir, index);
        let host = host_ifname(index);

        // 1. The namespace, its sysctls and its firewall (deny-all, then `initial`), before
        //    any link exists; its record once they are in.
        let table = nft::slot_table(&self.deny, gateway);
        let digest = nft::table_digest(&table);
        let script = format!(
            "{table}{}",
            nft::set_contents(&SlotSets::for_policy(initial, address))
        );
        let record_path = FirewallRecord::path(&pin);
        let record = FirewallRecord {
            table: digest.clone(),
            spec: initial.spec().clone(),
        };
        let nft = self.nft.clone();
        let pin2 = pin.clone();
        let ns = blocking(move || -> Result<File, SlotError> {
            netns::create_pinned(&pin2).map_err(SlotError::io(
                index,
                format!("pin a namespace at {}", pin2.display()),
            ))?;
            let ns = File::open(&pin2)
                .map_err(SlotError::io(index, format!("open {}", pin2.display())))?;
            netns::run_in(ns.as_fd(), write_sysctls)
                .and_then(|r| r)
                .map_err(SlotError::io(index, "write the slot's sysctls"))?;
            let path = FirewallRecord::path(&pin2);
            nft::apply_recorded(&*nft, Some(&ns), &script, Some((&path, record)))
                .map_err(|source| SlotError::Nft { index, source })?;
            Ok(ns)
        })
        .await
        .map_err(SlotError::io(index, "create the namespace"))??;
        let ns = Arc::new(ns);

        // 2. The veth pair: `spv<i>` here, its peer created directly inside as `eth0`.
        let peer = LinkMessageBuilder::<LinkUnspec>::new()
            .name("eth0".to_owned())
            .setns_by_fd(std::os::fd::AsRawFd::as_raw_fd(&*ns))
            .build();
        let veth = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
            .name(host.clone())
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        self.node
            .link()
            .add(veth)
            .execute()
            .await
            .map_err(SlotError::netlink(index, format!("create veth {host}")))?;
        let host_index = link_index(&self.node, &host)
            .await
            .map_err(SlotError::netlink(index, format!("find {host}")))?;
        // No IPv6 on the host end (slots are IPv4 only): up with IPv6, every pair added two
        // routes to the node's one IPv6 table (fe80::/64 and ff00::/8, each a list as long as
        // the slot count, walked at every insert and every link change) and ran duplicate
        // address detection: 4.6 % of a pool fill's CPU with 1,400 slots (issue 16).
        if let Some(conf) = &self.host_ipv6_conf {
            write_at(conf, &format!("{host}/disable_ipv6"), "1")
                .map_err(SlotError::io(index, format!("turn IPv6 off on {host}")))?;
        }
        self.node
            .address()
            .add(host_index, gateway.into(), 30)
            .execute()
            .await
            .map_err(SlotError::netlink(index, format!("address {host}")))?;
        self.node
            .link()
            .set(LinkUnspec::new_with_index(host_index).up().build())
            .execute()
            .await
            .map_err(SlotError::netlink(index, format!("bring {host} up")))?;

        // 3. Inside: lo and eth0 up, the address, the default route; through a netlink
        //    socket made inside the slot, driven by this runtime.
        let rt = tokio::runtime::Handle::current();
        let (conn, inside, _) = netns::run_in(ns.as_fd(), || {
            let _entered = rt.enter();
            rtnetlink::new_connection()
        })
        .and_then(|r| r)
        .map_err(SlotError::io(index, "open netlink inside the slot"))?;
        let conn = tokio::spawn(conn);
        let inside_result = async {
            // lo is ifindex 1 in every namespace.
            inside
                .link()
                .set(LinkUnspec::new_with_index(1).up().build())
                .execute()
                .await
                .map_err(SlotError::netlink(index, "bring lo up"))?;
            let eth0 = link_index(&inside, "eth0")
                .await
                .map_err(SlotError::netlink(index, "find eth0"))?;
            inside
                .address()
                .add(eth0, address.into(), 30)
                .execute()
                .await
                .map_err(SlotError::netlink(index, "address eth0"))?;
            inside
                .link()
                .set(LinkUnspec::new_with_index(eth0).up().build())
                .execute()
                .await
                .map_err(SlotError::netlink(index, "bring eth0 up"))?;
            inside
                .route()
                .add(
                    RouteMessageBuilder::<Ipv4Addr>::new()
                        .gateway(gateway)
                        .build(),
                )
                .execute()
                .await
                .map_err(SlotError::netlink(index, "add the default route"))
        }
        .await;
        drop(inside);
        conn.abort();
        inside_result?;

        let firewall = Arc::new(
            SlotFirewall::new(Some(pin.clone()), self.nft.clone(), address, Some(initial))
                .recorded(record_path, digest),
        );
        Ok(Slot {
            info: SlotInfo {
                index,
                address,
                gateway,
                netns: pin,
            },
            netns: ns,
            firewall,
        })
    }
}

#[async_trait]
impl SlotBackend for KernelSlots {
    async fn create(&self, index: u32, initial: &Policy) -> Result<Slot, SlotError> {
        let t0 = Instant::now();
        match self.try_create(index, initial).await {
            Ok(slot) => {
                debug!(
                    index,
                    elapsed_us = t0.elapsed().as_micros() as u64,
                    "slot created"
                );
                Ok(slot)
            }
            Err(e) => {
                self.destroy(index).await;
                Err(e)
            }
        }
    }

    async fn destroy(&self, index: u32) {
        let host = host_ifname(index);
        // Unpinning drops the node's last reference to the namespace (its slot's sockets and
        // fd are closed by now): the kernel then tears it down in the background, `eth0` and
        // so the pair with it, and batches namespaces that go together under one RTNL hold.
        // Deleting `spv<i>` here instead took ~29 ms of RTNL per slot on this 2-core node,
        // which every slot being made waited behind (decision 0052).
        let pin = pin_path(&self.dir, index);
        if let Err(e) = nft::forget_record(&FirewallRecord::path(&pin)) {
            warn!(index, error = %e, "failed to remove the slot's firewall record");
        }
        match blocking(move || netns::remove_pinned(&pin)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) | Err(e) => warn!(index, error = %e, "failed to unpin the slot namespace"),
        }
        // The index is free for reuse once the pair is gone. A namespace something still
        // holds (a process that outlived its sandbox) keeps its link: cut it off.
        let deadline = Instant::now() + TEARDOWN_WAIT;
        loop {
            match link_index(&self.node, &host).await {
                Err(rtnetlink::Error::RequestFailed) => return,
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => return,
                Ok(_) if Instant::now() < deadline => {
                    tokio::time::sleep(TEARDOWN_POLL).await;
                }
                Ok(_) => {
                    warn!(
                        index,
                        "slot namespace still held after {TEARDOWN_WAIT:?}: deleting {host}"
                    );
                    break;
                }
                Err(e) => {
                    warn!(index, error = %e, "cannot look for {host}: deleting it");
                    break;
                }
            }
        }
        match self
            .node
            .link()
            .del_with_message(LinkUnspec::new_with_name(&host).build())
            .execute()
            .await
        {
            Ok(()) => {}
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {}
            Err(e) => warn!(index, error = %e, "failed to delete {host}"),
        }
    }
}

/// How long a destroyed slot's pair may take to go with its namespace before it is deleted.
const TEARDOWN_WAIT: Duration = Duration::from_secs(5);
/// How often `destroy` looks for it meanwhile.
const TEARDOWN_POLL: Duration = Duration::from_millis(20);

/// How long the pool waits after the last take before refilling (unless it runs low).
const REFILL_QUIET: Duration = Duration::from_millis(100);
/// Pause between two refilled slots while the pool is not low.
const REFILL_PACE: Duration = Duration::from_millis(10);

#[derive(Debug, Default)]
struct PoolState {
    ready: VecDeque<Slot>,
    /// Indexes in use: ready, attached, reserved or being destroyed.
    used: BTreeSet<u32>,
    closed: bool,
    refill: Option<tokio::task::JoinHandle<()>>,
    /// When a ready slot was last taken: refills wait for a quiet moment (see `refill`).
    last_take: Option<std::time::Instant>,
    /// Where `alloc` looks for a free index first.
    next_index: u32,
}

/// Counters of the pool (also used by tests).
#[derive(Debug, Default)]
pub struct PoolStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub created: AtomicU64,
    pub destroyed: AtomicU64,
}

/// Keeps `size` slots ready (made with the node's default policy), refilled in the background
/// one at a time. An index is reused only once its old slot is fully destroyed.
#[derive(Debug)]
pub struct Pool {
    backend: Arc<dyn SlotBackend>,
    size: usize,
    subnet: Ipv4Net,
    default_policy: Policy,
    state: Mutex<PoolState>,
    /// Serializes creation (RTNL serializes it anyway; this keeps index order and the miss
    /// path from racing the refill).
    create_lock: tokio::sync::Mutex<()>,
    wake: tokio::sync::Notify,
    /// Background destroys in flight (see `release`), which `close` waits for.
    releasing: std::sync::atomic::AtomicUsize,
    released: tokio::sync::Notify,
    pub stats: PoolStats,
}

/// How long `close` waits for background destroys before leaving the rest to the next start.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

impl Pool {
    pub fn new(
        backend: Arc<dyn SlotBackend>,
        subnet: Ipv4Net,
        size: usize,
        default_policy: Policy,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            backend,
            size,
            subnet,
            default_policy,
            state: Mutex::new(PoolState::default()),
            create_lock: tokio::sync::Mutex::new(()),
            wake: tokio::sync::Notify::new(),
            releasing: Default::default(),
            released: tokio::sync::Notify::new(),
            stats: PoolStats::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn default_policy(&self) -> &Policy {
        &self.default_policy
    }

    /// Marks `index` in use (an adopted slot, or a leftover awaiting destruction). False if it
    /// already was.
    pub fn reserve(&self, index: u32) -> bool {
        self.lock().used.insert(index)
    }

    /// Slots ready now.
    pub fn ready(&self) -> usize {
        self.lock().ready.len()
    }

    /// Indexes in use (ready, attached, reserved, being destroyed).
    pub fn in_use(&self) -> usize {
        self.lock().used.len()
    }

    fn alloc(&self) -> Result<u32, SlotError> {
        let mut st = self.lock();
        let count = slot_count(self.subnet);
        // The next free index after the last one handed out, wrapping: a destroyed slot's
        // index (and its `spv<i>` name, which the kernel frees when it gets to the
        // namespace's teardown) is the last to be reused.
        let start = st.next_index.min(count);
        let free_from = |from: u32, to: u32| {
            let mut want = from;
            for &u in st.used.range(from..to) {
                if u != want {
                    break;
                }
                want += 1;
            }
            (want < to).then_some(want)
        };
        let Some(want) = free_from(start, count).or_else(|| free_from(0, start)) else {
            return Err(SlotError::Exhausted {
                subnet: self.subnet,
                count,
            });
        };
        st.used.insert(want);
        st.next_index = want + 1;
        Ok(want)
    }

    async fn create_one(&self) -> Result<Slot, SlotError> {
        let index = self.alloc()?;
        match self.backend.create(index, &self.default_policy).await {
            Ok(s) => {
                self.stats.created.fetch_add(1, Ordering::Relaxed);
                Ok(s)
            }
            Err(e) => {
                // The backend cleaned up what it made.
                self.lock().used.remove(&index);
                Err(e)
            }
        }
    }

    /// Starts the background refill.
    pub fn start(self: &Arc<Self>) {
        let mut st = self.lock();
        if st.refill.is_some() || st.closed || self.size == 0 {
            return;
        }
        let pool = self.clone();
        st.refill = Some(tokio::spawn(async move { pool.refill().await }));
    }

    async fn refill(self: Arc<Self>) {
        loop {
            loop {
                let (need, closed, wait) = {
                    let st = self.lock();
                    // During a burst of creates, making slots would compete with them for the
                    // CPU and RTNL: while more than a quarter of the pool is left, refill only
                    // once no slot was taken for REFILL_QUIET.
                    let wait = st
                        .last_take
                        .map(|t| REFILL_QUIET.saturating_sub(t.elapsed()))
                        .filter(|w| !w.is_zero() && st.ready.len() > self.size / 4);
                    (st.ready.len() < self.size, st.closed, wait)
                };
                if closed {
                    return;
                }
                if !need {
                    break;
                }
                if let Some(w) = wait {
                    tokio::time::sleep(w).await;
                    continue;
                }
                let made = {
                    let _g = self.create_lock.lock().await;
                    self.create_one().await
                };
                match made {
                    Ok(slot) => {
                        let (rejected, plenty) = {
                            let mut st = self.lock();
                            if st.closed {
                                (Some(slot), false)
                            } else {
                                st.ready.push_back(slot);
                                (None, st.ready.len() > self.size / 4)
                            }
                        };
                        // Unless the pool runs low, leave the CPU to the sandboxes between
                        // two slots (a burst's refill would otherwise slow their execs).
                        if plenty && rejected.is_none() {
                            tokio::time::sleep(REFILL_PACE).await;
                        }
                        if let Some(slot) = rejected {
                            let index = slot.info.index;
                            drop(slot);
                            self.destroy_now(index).await;
                            return;
                        }
                    }
                    Err(e) => {
                        warn!(error = %e, "failed to refill the slot pool; retrying in 1 s");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            self.wake.notified().await;
        }
    }

    /// A slot for a sandbox: a ready one (hit), or one made now (miss). The bool says hit.
    pub async fn take(&self) -> Result<(Slot, bool), SlotError> {
        if let Some(s) = self.pop() {
            return Ok((s, true));
        }
        let _g = self.create_lock.lock().await;
        // The refill may have finished one while we waited.
        if let Some(s) = self.pop() {
            return Ok((s, true));
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let made = self.create_one().await;
        self.wake.notify_one();
        made.map(|s| (s, false))
    }

    fn pop(&self) -> Option<Slot> {
        let s = {
            let mut st = self.lock();
            let s = st.ready.pop_front()?;
            st.last_take = Some(std::time::Instant::now());
            s
        };
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        self.wake.notify_one();
        Some(s)
    }

    async fn destroy_now(&self, index: u32) {
        self.backend.destroy(index).await;
        self.stats.destroyed.fetch_add(1, Ordering::Relaxed);
        self.lock().used.remove(&index);
        self.wake.notify_one();
    }

    /// Destroys slot `index` in the background; frees the index when done.
    pub fn release(self: &Arc<Self>, index: u32) {
        let pool = self.clone();
        self.releasing.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            pool.destroy_now(index).await;
            if pool.releasing.fetch_sub(1, Ordering::SeqCst) == 1 {
                pool.released.notify_waiters();
            }
        });
    }

    /// Destroys slot `index` and waits for it.
    pub async fn release_now(&self, index: u32) {
        self.destroy_now(index).await;
    }

    /// Stops the refill and destroys the ready slots (attached ones stay).
    pub async fn close(&self) {
        let (ready, refill) = {
            let mut st = self.lock();
            st.closed = true;
            (std::mem::take(&mut st.ready), st.refill.take())
        };
        // The refill ends by itself (never mid-creation, which would leak a half-made slot):
        // a creation in flight finishes and its slot is destroyed as the pool is closed.
        self.wake.notify_one();
        if let Some(r) = refill {
            let _ = r.await;
        }
        let _g = self.create_lock.lock().await;
        for s in ready {
            let index = s.info.index;
            drop(s);
            self.destroy_now(index).await;
        }
        // Slots of removed sandboxes still being destroyed in the background: a shutdown
        // right after removals should not leave them pinned (the next start would reclaim
        // them, but a clean stop leaves nothing behind).
        let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
        loop {
            let done = self.released.notified();
            if self.releasing.load(Ordering::SeqCst) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                tracing::warn!(
                    left = self.releasing.load(Ordering::SeqCst),
                    "slots still being destroyed at shutdown; the next start reclaims them"
                );
                break;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::net::nft::RecordingNft;
    use crate::net::{Egress, NetworkSpec};

    /// Slots without a kernel: the current namespace.
    #[derive(Debug, Default)]
    pub(crate) struct FakeSlots {
        pub log: Mutex<Vec<String>>,
        pub fail_next: std::sync::atomic::AtomicBool,
        pub nft: Arc<RecordingNft>,
    }

    #[async_trait]
    impl SlotBackend for FakeSlots {
        async fn create(&self, index: u32, initial: &Policy) -> Result<Slot, SlotError> {
            if self.fail_next.swap(false, Ordering::SeqCst) {
                return Err(SlotError::Io {
                    index,
                    step: "fake".into(),
                    source: io::Error::other("injected"),
                });
            }
            self.log.lock().unwrap().push(format!("create {index}"));
            let subnet: Ipv4Net = "10.213.0.0/16".parse().unwrap();
            let (_, gateway, address) = slot_addresses(subnet, index).unwrap();
            Ok(Slot {
                info: SlotInfo {
                    index,
                    address,
                    gateway,
                    netns: PathBuf::from(format!("/fake/slot-{index}")),
                },
                netns: Arc::new(File::open("/proc/self/ns/net").unwrap()),
                firewall: Arc::new(SlotFirewall::new(
                    None,
                    self.nft.clone(),
                    address,
                    Some(initial),
                )),
            })
        }
        async fn destroy(&self, index: u32) {
            self.log.lock().unwrap().push(format!("destroy {index}"));
        }
    }

    fn open_policy() -> Policy {
        Policy::new(
            &NetworkSpec {
                egress: Egress::Open,
                allow: vec![],
            },
            &[],
        )
        .unwrap()
    }

    #[test]
    fn addressing_cuts_the_subnet_into_30s() {
        let s: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        assert_eq!(slot_count(s), 16384);
        let (net, gw, addr) = slot_addresses(s, 1).unwrap();
        assert_eq!(net, "10.213.0.4/30".parse::<Ipv4Net>().unwrap());
        assert_eq!(gw, Ipv4Addr::new(10, 213, 0, 5));
        assert_eq!(addr, Ipv4Addr::new(10, 213, 0, 6));
        let (_, _, last) = slot_addresses(s, 16383).unwrap();
        assert_eq!(last, Ipv4Addr::new(10, 213, 255, 254));
        assert!(slot_addresses(s, 16384).is_none());
        assert_eq!(slot_count("10.0.0.0/30".parse().unwrap()), 1);
        assert_eq!(slot_count("10.0.0.0/31".parse().unwrap()), 0);
        assert!(host_ifname(16383).len() <= 15, "IFNAMSIZ");
    }

    #[test]
    fn pinned_indexes_lists_slot_pins_only() {
        let d = tempfile::tempdir().unwrap();
        for n in ["slot-3", "slot-10", "slot-x", "other"] {
            fs::write(d.path().join(n), "").unwrap();
        }
        assert_eq!(pinned_indexes(d.path()), vec![3, 10]);
        assert!(pinned_indexes(&d.path().join("missing")).is_empty());
    }

    async fn wait_ready(pool: &Pool, n: usize) {
        for _ in 0..400 {
            if pool.ready() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("pool never reached {n} ready slots (has {})", pool.ready());
    }

    #[tokio::test]
    async fn pool_refills_in_the_background_and_counts_hits_and_misses() {
        let fake = Arc::new(FakeSlots::default());
        let pool = Pool::new(
            fake.clone(),
            "10.213.0.0/16".parse().unwrap(),
            2,
            open_policy(),
        );
        // Reserved (adopted) index 0 is skipped.
        assert!(pool.reserve(0));
        assert!(!pool.reserve(0));
        // Before start: a miss makes one now.
        let (s, hit) = pool.take().await.unwrap();
        assert!(!hit);
        assert_eq!(s.info.index, 1);
        pool.start();
        wait_ready(&pool, 2).await;
        let (s2, hit) = pool.take().await.unwrap();
        assert!(hit);
        assert_eq!(s2.info.index, 2);
        wait_ready(&pool, 2).await;
        // Index 1 is free again only after its destruction finished, and the next slot
        // made takes the next index, not the freed one.
        pool.release_now(1).await;
        let (s3, hit) = pool.take().await.unwrap();
        assert!(hit);
        assert_eq!(s3.info.index, 3);
        wait_ready(&pool, 2).await;
        let log = fake.log.lock().unwrap().clone();
        assert_eq!(
            log,
            [
                "create 1",
                "create 2",
                "create 3",
                "create 4",
                "destroy 1",
                "create 5"
            ],
            "{log:?}"
        );
        assert_eq!(pool.stats.hits.load(Ordering::Relaxed), 2);
        assert_eq!(pool.stats.misses.load(Ordering::Relaxed), 1);
        pool.close().await;
        assert_eq!(pool.ready(), 0);
        // 0 (reserved), 2 and 3 (taken) remain in use.
        assert_eq!(pool.in_use(), 3);
        // The pre-applied default policy means no nft at take time.
        assert!(!s2.firewall.apply_policy(&open_policy()).await.unwrap());
        drop((s, s3));
    }

    #[tokio::test]
    async fn close_waits_for_background_releases() {
        let fake = Arc::new(FakeSlots::default());
        let pool = Pool::new(
            fake.clone(),
            "10.213.0.0/16".parse().unwrap(),
            1,
            open_policy(),
        );
        let (a, _) = pool.take().await.unwrap();
        let (b, _) = pool.take().await.unwrap();
        let (ia, ib) = (a.info.index, b.info.index);
        drop((a, b));
        pool.release(ia);
        pool.release(ib);
        // No await between the releases and close: their tasks have not run yet.
        pool.close().await;
        let log = fake.log.lock().unwrap().clone();
        for i in [ia, ib] {
            assert!(log.contains(&format!("destroy {i}")), "{log:?}");
        }
        assert_eq!(pool.in_use(), 0);
    }

    #[tokio::test]
    async fn a_failed_creation_frees_its_index() {
        let fake = Arc::new(FakeSlots::default());
        let pool = Pool::new(
            fake.clone(),
            "10.213.0.0/30".parse().unwrap(),
            0,
            open_policy(),
        );
        fake.fail_next.store(true, Ordering::SeqCst);
        assert!(pool.take().await.is_err());
        assert_eq!(pool.in_use(), 0);
        let (s, _) = pool.take().await.unwrap();
        assert_eq!(s.info.index, 0);
        // A /30 holds one slot.
        assert!(matches!(
            pool.take().await,
            Err(SlotError::Exhausted { count: 1, .. })
        ));
    }
}
