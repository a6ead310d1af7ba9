//! nftables rulesets (decision 0012): the node's root table `ip space_node` (forwarding and
//! NAT for every slot, constant size) and each slot's `inet space` table, kept inside the slot
//! so that a policy is nothing but set contents and a policy change is one atomic `nft -f -`
//! transaction.
//!
//! Rendering is pure (unit-tested on the text); applying goes through [`NftRunner`], whose
//! real implementation runs `nft -f -` (in a slot: from a thread inside its namespace).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Write as _};
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;

use super::policy::{self, Policy, Ports};
use super::{Egress, NetworkSpec};

/// Shortest life of a `dns4` element (a TTL of 0 must still let the connection start).
pub const DNS4_MIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest life of a `dns4` element.
pub const DNS4_MAX_TIMEOUT: Duration = Duration::from_secs(86_400);
/// At most this many live `dns4` elements per slot.
pub const DNS4_MAX_ELEMENTS: usize = 16_384;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("failed to run {nft}: {source}")]
    Spawn {
        nft: String,
        #[source]
        source: io::Error,
    },
    #[error("failed to enter the slot's network namespace: {0}")]
    Netns(#[source] io::Error),
    #[error("nft -f - failed ({status}): {stderr}")]
    Failed { status: String, stderr: String },
    #[error("too many resolved addresses in the slot's dns4 set (at most {DNS4_MAX_ELEMENTS})")]
    DnsFull,
    #[error("the policy changed while the answer was being processed")]
    Stale,
}

/// Applies an nftables script atomically (`nft -f -`), in a network namespace.
pub trait NftRunner: Send + Sync + std::fmt::Debug {
    /// Runs `script` as one transaction in `ns` (None: the calling thread's namespace).
    fn apply(&self, ns: Option<&File>, script: &str) -> Result<(), NftError>;
}

/// The real runner: spawns the `nft` binary.
#[derive(Debug, Clone)]
pub struct SystemNft {
    binary: PathBuf,
}

impl Default for SystemNft {
    fn default() -> Self {
        Self::new()
    }
}

impl SystemNft {
    /// Finds `nft` on PATH, or in /usr/sbin and /sbin (spaced may run with a short PATH).
    pub fn new() -> SystemNft {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let binary = std::env::split_paths(&path)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|d| d.join("nft"))
            .find(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("nft"));
        SystemNft { binary }
    }

    fn run(&self, script: &str) -> Result<(), NftError> {
        let spawn_err = |source| NftError::Spawn {
            nft: self.binary.display().to_string(),
            source,
        };
        let mut child = Command::new(&self.binary)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        let write = child
            .stdin
            .take()
            .map(|mut stdin| stdin.write_all(script.as_bytes()))
            .unwrap_or(Ok(()));
        let out = child.wait_with_output().map_err(spawn_err)?;
        if !out.status.success() {
            return Err(NftError::Failed {
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        write.map_err(spawn_err)
    }
}

impl NftRunner for SystemNft {
    fn apply(&self, ns: Option<&File>, script: &str) -> Result<(), NftError> {
        match ns {
            None => self.run(script),
            // The child inherits the namespace of the thread that spawns it.
            Some(ns) => space_sys::netns::run_in(ns.as_fd(), || self.run(script))
                .map_err(NftError::Netns)?,
        }
    }
}

/// Where the node serves every slot's DNS and egress proxy: ports of its own namespace, bound
/// on all addresses, which the root table redirects slot traffic to (decision 0059).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePorts {
    pub dns_udp: u16,
    pub dns_tcp: u16,
    pub proxy: u16,
}

/// The node's table (in its own namespace): no slot reaches another slot, the node itself or
/// link-local/metadata addresses; slots reach the outside through masquerade; nothing from
/// outside starts a connection into a slot. A slot's DNS (port 53, to any address) and HTTP(S)
/// (80 and 443) are redirected to the node's listeners at `ports`, which only redirected
/// slot traffic reaches: the node's own and outside hosts' connections to them are dropped.
pub fn root_table(subnet: Ipv4Net, ports: NodePorts) -> String {
    let NodePorts {
        dns_udp,
        dns_tcp,
        proxy,
    } = ports;
    let served = format!("udp . {dns_udp}, tcp . {dns_tcp}, tcp . {proxy}");
    format!(
        "add table ip space_node\n\
         delete table ip space_node\n\
         table ip space_node {{\n\
         \tchain prerouting {{\n\
         \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
         \t\tiifname \"spv*\" udp dport 53 redirect to :{dns_udp}\n\
         \t\tiifname \"spv*\" tcp dport 53 redirect to :{dns_tcp}\n\
         \t\tiifname \"spv*\" tcp dport {{ 80, 443 }} redirect to :{proxy}\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"spv*\" oifname \"spv*\" drop\n\
         \t\tiifname \"spv*\" ip daddr 169.254.0.0/16 drop\n\
         \t\toifname \"spv*\" ct state established,related accept\n\
         \t\toifname \"spv*\" drop\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"spv*\" ct status dnat meta l4proto . th dport {{ {served} }} accept\n\
         \t\tiifname \"spv*\" drop\n\
         \t\tmeta l4proto . th dport {{ {served} }} drop\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {subnet} oifname != \"spv*\" masquerade\n\
         \t}}\n\
         }}\n"
    )
}

/// Removes the node's table (tests, and a node switched to `--network off`).
pub fn remove_root_table() -> &'static str {
    "add table ip space_node\ndelete table ip space_node\n"
}

/// Ranges a slot never reaches in `open` mode unless `allow4` names them: the default-denied
/// and always-denied ranges and the node's slot subnet (fixed at slot creation).
pub fn deny_ranges(subnet: Ipv4Net) -> Vec<Ipv4Net> {
    let mut nets = policy::default_denied_nets();
    nets.extend(policy::never_reached_nets());
    nets.push(subnet);
    Ipv4Net::aggregate(&nets)
}

/// What a slot rejects before any set is looked at: every address no rule reaches (link-local
/// and cloud metadata, multicast, reserved), but loopback, the sandbox's own.
fn never_reached() -> String {
    let loopback: Ipv4Net = "127.0.0.0/8".parse().expect("valid");
    let nets: Vec<Ipv4Net> = policy::never_reached_nets()
        .into_iter()
        .filter(|n| *n != loopback)
        .collect();
    elements(Ipv4Net::aggregate(&nets))
}

/// An inclusive port range as nft writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange(pub u16, pub u16);

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == self.1 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{}-{}", self.0, self.1)
        }
    }
}

/// The `allow4` elements (`net . ports`) for CIDR rules with their ports: disjoint, as an
/// interval set of concatenations must be (nft refuses an element overlapping another). Ports
/// are cut where any rule's range starts or ends; each piece gets the aggregate of the
/// networks whose rules cover it, and neighbouring pieces with the same networks are joined.
pub fn allow4_elements(rules: &[(Ipv4Net, Ports)]) -> Vec<(Ipv4Net, PortRange)> {
    let mut cuts: Vec<u32> = rules
        .iter()
        .flat_map(|(_, p)| p.ranges().iter())
        .flat_map(|&(lo, hi)| [u32::from(lo), u32::from(hi) + 1])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut pieces: Vec<(Vec<Ipv4Net>, u16, u16)> = Vec::new();
    for w in cuts.windows(2) {
        // Every rule's range holds all of [lo, hi] or none of it.
        let (lo, hi) = (w[0] as u16, (w[1] - 1) as u16);
        let nets: Vec<Ipv4Net> = rules
            .iter()
            .filter(|(_, p)| p.contains(lo))
            .map(|(n, _)| *n)
            .collect();
        if nets.is_empty() {
            continue;
        }
        let nets = Ipv4Net::aggregate(&nets);
        match pieces.last_mut() {
            Some(last) if last.0 == nets && u32::from(last.2) + 1 == u32::from(lo) => last.2 = hi,
            _ => pieces.push((nets, lo, hi)),
        }
    }
    let mut out: Vec<(Ipv4Net, PortRange)> = pieces
        .into_iter()
        .flat_map(|(nets, lo, hi)| nets.into_iter().map(move |n| (n, PortRange(lo, hi))))
        .collect();
    out.sort();
    out
}

/// The contents of a slot's policy sets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotSets {
    /// CIDR rules on their ports (disjoint: [`allow4_elements`]).
    pub allow4: Vec<(Ipv4Net, PortRange)>,
    /// Resolved addresses of allowed names on the names' ports, with their remaining life.
    pub dns4: Vec<(Ipv4Addr, Ports, Duration)>,
    /// The slot's own address iff egress is open.
    pub open4: Option<Ipv4Addr>,
    /// The slot's own address iff egress is not open. It overrides `open4`, so that tightening
    /// an open slot only adds elements (removing one costs the kernel an RCU grace period,
    /// ~10 ms): a pooled slot pre-set to `open` takes `allowlist` or `none` cheaply.
    pub closed4: Option<Ipv4Addr>,
}

impl SlotSets {
    /// The sets for `policy` in the slot at `address` (no resolved addresses).
    pub fn for_policy(policy: &Policy, address: Ipv4Addr) -> SlotSets {
        SlotSets {
            allow4: if policy.egress() == Egress::None {
                Vec::new()
            } else {
                allow4_elements(policy.cidrs())
            },
            dns4: Vec::new(),
            open4: (policy.egress() == Egress::Open).then_some(address),
            closed4: (policy.egress() != Egress::Open).then_some(address),
        }
    }
}

fn elements<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn timeout_secs(d: Duration) -> u64 {
    d.as_secs().max(1)
}

fn allow4_items(items: &[(Ipv4Net, PortRange)]) -> String {
    elements(items.iter().map(|(n, p)| format!("{n} . {p}")))
}

/// `dns4` elements of `ip` on `ports`, with `timeout` when given.
fn dns4_items(ip: Ipv4Addr, ports: &Ports, timeout: Option<Duration>) -> Vec<String> {
    ports
        .ranges()
        .iter()
        .map(|&(lo, hi)| match timeout {
            Some(t) => format!("{ip} . {} timeout {}s", PortRange(lo, hi), timeout_secs(t)),
            None => format!("{ip} . {}", PortRange(lo, hi)),
        })
        .collect()
}

fn dns4_all(entries: &[(Ipv4Addr, Ports, Duration)]) -> String {
    elements(
        entries
            .iter()
            .flat_map(|(ip, ports, t)| dns4_items(*ip, ports, Some(*t))),
    )
}

/// A slot's table, created once in a fresh slot (deny-all until sets are filled: every set
/// empty), and again when a restarted node adopts the slot. Nothing accepts "ct state
/// established" on output, so emptied sets cut live flows.
///
/// DNS (port 53, to any address) and HTTP(S) (80 and 443) leave the slot whatever the sets
/// say: the node's root table redirects them to its DNS server and egress proxy, which apply
/// the policy themselves (decision 0059). They are not served inside the slot, so a slot
/// holds no socket of the node.
///
/// The `tap0` rules serve a microvm (decision 0014, "Networking"); in a namespace slot no
/// such interface exists (the sandbox cannot make one: it has no capability over the slot).
/// The guest's packets are forwarded through the same `egress` chain as a namespace
/// sandbox's own output, then NATed to the slot's address. Its resolver is the tap's
/// gateway, inside the slot: DNS sent there is DNATed to the slot's `gateway` (the node's
/// side of the veth), where the node's redirect takes it.
pub fn slot_table(deny: &[Ipv4Net], gateway: Ipv4Addr) -> String {
    use space_proto::vm_link::{GUEST, TAP};
    let deny = if deny.is_empty() {
        String::new()
    } else {
        format!(" elements = {{ {} }};", elements(deny))
    };
    let never = never_reached();
    format!(
        "table inet space {{\n\
         \tset allow4 {{ type ipv4_addr . inet_service; flags interval; }}\n\
         \tset dns4 {{ type ipv4_addr . inet_service; flags interval, timeout; size {DNS4_MAX_ELEMENTS}; }}\n\
         \tset deny4 {{ type ipv4_addr; flags interval; auto-merge;{deny} }}\n\
         \tset open4 {{ type ipv4_addr; }}\n\
         \tset closed4 {{ type ipv4_addr; }}\n\
         \tchain egress {{\n\
         \t\tip daddr 127.0.0.0/8 accept\n\
         \t\tmeta nfproto ipv6 drop\n\
         \t\tmeta l4proto {{ tcp, udp }} th dport 53 accept\n\
         \t\ttcp dport {{ 80, 443 }} accept\n\
         \t\tip daddr {{ {never} }} reject with icmp type admin-prohibited\n\
         \t\tmeta l4proto {{ tcp, udp }} ip daddr . th dport @allow4 accept\n\
         \t\tmeta l4proto {{ tcp, udp }} ip daddr . th dport @dns4 accept\n\
         \t\tip saddr @closed4 meta l4proto tcp reject with tcp reset\n\
         \t\tip saddr @closed4 reject with icmp type admin-prohibited\n\
         \t\tip saddr @open4 ip daddr != @deny4 accept\n\
         \t\tmeta l4proto tcp reject with tcp reset\n\
         \t\treject with icmp type admin-prohibited\n\
         \t}}\n\
         \tchain output {{\n\
         \t\ttype filter hook output priority filter; policy drop;\n\
         \t\toif \"lo\" accept\n\
         \t\toifname \"{TAP}\" accept\n\
         \t\tjump egress\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy drop;\n\
         \t\tiifname \"{TAP}\" oifname \"eth0\" ip saddr {GUEST} jump egress\n\
         \t\tiifname \"eth0\" oifname \"{TAP}\" ct state established,related accept\n\
         \t}}\n\
         \tchain nat_prerouting {{\n\
         \t\ttype nat hook prerouting priority -100; policy accept;\n\
         \t\tiifname \"{TAP}\" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}\n\
         \t}}\n\
         \tchain nat_postrouting {{\n\
         \t\ttype nat hook postrouting priority 100; policy accept;\n\
         \t\toifname \"eth0\" ip saddr {GUEST} masquerade\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy drop;\n\
         \t\tiif \"lo\" accept\n\
         \t\tct state established,related accept\n\
         \t}}\n\
         }}\n"
    )
}

/// Replaces a slot's table with a fresh [`slot_table`] in the same transaction as what
/// follows (an adopted slot's table may be an older node's).
pub fn replace_slot_table(deny: &[Ipv4Net], gateway: Ipv4Addr) -> String {
    format!(
        "add table inet space\ndelete table inet space\n{}",
        slot_table(deny, gateway)
    )
}

/// A slot's own addresses in `open4`/`closed4`: the slot's, and a microvm guest's link
/// address (the guest's packets are filtered when forwarded, before they are NATed to the
/// slot's address; in a namespace slot nothing has that address).
fn own(address: Ipv4Addr) -> String {
    format!("{address}, {}", space_proto::vm_link::GUEST)
}

/// One transaction replacing the policy sets' contents.
pub fn set_contents(sets: &SlotSets) -> String {
    let mut s = String::from(
        "flush set inet space allow4\nflush set inet space dns4\nflush set inet space open4\n\
         flush set inet space closed4\n",
    );
    if !sets.allow4.is_empty() {
        let _ = writeln!(
            s,
            "add element inet space allow4 {{ {} }}",
            allow4_items(&sets.allow4)
        );
    }
    if !sets.dns4.is_empty() {
        let _ = writeln!(
            s,
            "add element inet space dns4 {{ {} }}",
            dns4_all(&sets.dns4)
        );
    }
    if let Some(a) = sets.open4 {
        let _ = writeln!(s, "add element inet space open4 {{ {} }}", own(a));
    }
    if let Some(a) = sets.closed4 {
        let _ = writeln!(s, "add element inet space closed4 {{ {} }}", own(a));
    }
    s
}

/// One transaction taking the sets from `old` (None: unknown) to `new`: unchanged sets are
/// left alone, grown ones only get additions, others are flushed and refilled (removing
/// elements costs the kernel an RCU grace period, adding does not). `dns_removed`: some live
/// `dns4` element must go (then `dns4` is refilled with `new.dns4`, the ones kept).
pub fn set_changes(old: Option<&SlotSets>, new: &SlotSets, dns_removed: bool) -> String {
    let Some(old) = old else {
        return set_contents(new);
    };
    let mut s = String::new();
    if old.allow4 != new.allow4 {
        let added: Vec<_> = new
            .allow4
            .iter()
            .filter(|n| !old.allow4.contains(n))
            .collect();
        if old.allow4.iter().any(|n| !new.allow4.contains(n)) {
            s.push_str("flush set inet space allow4\n");
            if !new.allow4.is_empty() {
                let _ = writeln!(
                    s,
                    "add element inet space allow4 {{ {} }}",
                    allow4_items(&new.allow4)
                );
            }
        } else {
            let added: Vec<_> = added.into_iter().copied().collect();
            let _ = writeln!(
                s,
                "add element inet space allow4 {{ {} }}",
                allow4_items(&added)
            );
        }
    }
    // Closing leaves `open4` as it is (`closed4` overrides it; a later `add` of the same
    // element is a no-op), so tightening never removes an element.
    let closing = new.open4.is_none() && new.closed4.is_some();
    if old.open4 != new.open4 && !closing {
        if old.open4.is_some() {
            s.push_str("flush set inet space open4\n");
        }
        if let Some(a) = new.open4 {
            let _ = writeln!(s, "add element inet space open4 {{ {} }}", own(a));
        }
    }
    if old.closed4 != new.closed4 {
        if old.closed4.is_some() {
            s.push_str("flush set inet space closed4\n");
        }
        if let Some(a) = new.closed4 {
            let _ = writeln!(s, "add element inet space closed4 {{ {} }}", own(a));
        }
    }
    if dns_removed {
        s.push_str("flush set inet space dns4\n");
        if !new.dns4.is_empty() {
            let _ = writeln!(
                s,
                "add element inet space dns4 {{ {} }}",
                dns4_all(&new.dns4)
            );
        }
    }
    s
}

/// One address's change in `dns4`: from the elements it may have (`old`: on those ports) to
/// `ports`, for `timeout`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dns4Change {
    pub ip: Ipv4Addr,
    pub old: Option<Ports>,
    pub ports: Ports,
    pub timeout: Duration,
}

/// Puts resolved addresses in `dns4` (or refreshes their timeout, or widens their ports): the
/// elements an address may have are added, deleted, and its new ones added, in one
/// transaction, so an element already there gives way (elements of one address must not
/// overlap) and a missing one does not fail the delete.
pub fn add_dns4(changes: &[Dns4Change]) -> String {
    if changes.is_empty() {
        return String::new();
    }
    let before = |c: &Dns4Change| c.old.clone().unwrap_or_else(|| c.ports.clone());
    let old_timed = elements(
        changes
            .iter()
            .flat_map(|c| dns4_items(c.ip, &before(c), Some(c.timeout))),
    );
    let old_plain = elements(
        changes
            .iter()
            .flat_map(|c| dns4_items(c.ip, &before(c), None)),
    );
    let new = elements(
        changes
            .iter()
            .flat_map(|c| dns4_items(c.ip, &c.ports, Some(c.timeout))),
    );
    format!(
        "add element inet space dns4 {{ {old_timed} }}\n\
         delete element inet space dns4 {{ {old_plain} }}\n\
         add element inet space dns4 {{ {new} }}\n"
    )
}

/// The life of a `dns4` element for an answer with `ttl`.
pub fn dns4_timeout(ttl: u32) -> Duration {
    Duration::from_secs(u64::from(ttl)).clamp(DNS4_MIN_TIMEOUT, DNS4_MAX_TIMEOUT)
}

/// How long past its expiry an address's `dns4` elements are still assumed to be in the
/// kernel (whose timers run a little behind ours): within it, a new answer replaces them
/// rather than adds beside them.
const DNS4_GRACE: Duration = Duration::from_secs(10);
/// At most this many names are remembered per address (many names of one CDN address).
const DNS4_NAMES_PER_ADDRESS: usize = 8;

#[derive(Debug)]
struct DnsEntry {
    /// The names that let the address in (the latest last).
    names: Vec<String>,
    /// The ports its elements cover.
    ports: Ports,
    expires: Instant,
}

impl DnsEntry {
    fn elements(&self) -> usize {
        self.ports.ranges().len()
    }
}

#[derive(Debug, Default)]
struct FirewallState {
    /// The spec whose sets are in the kernel (None: unknown, e.g. an adopted slot).
    applied: Option<NetworkSpec>,
    /// `allow4` and `open4` as in the kernel (None: unknown).
    sets: Option<SlotSets>,
    /// What `dns4` holds (or held within [`DNS4_GRACE`]), with the names that let each
    /// address in.
    dns: HashMap<Ipv4Addr, DnsEntry>,
    /// A whole table to put in place with the next policy (an adopted slot's).
    table: Option<String>,
    /// `dns4` may hold addresses this node did not put there (an adopted slot whose
    /// record let the adoption skip nft): the next policy change flushes it.
    dns_unknown: bool,
}

/// What a slot's firewall holds as the node last put it there, kept next to the slot's pin
/// (`slot-<i>.firewall`, on the run dir's tmpfs, gone with the namespace at a reboot). A
/// restarted node adopting the slot runs no nft when the record names today's table and the
/// policy the sandbox has (issue 16: one `nft` process per slot made re-adoption slow). It is
/// removed before every transaction and written after it succeeds, so a node killed in
/// between finds none and replaces the table whole.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FirewallRecord {
    /// SHA-256 (hex) of the slot's table as [`slot_table`] renders it.
    pub table: String,
    /// The policy in the sets.
    pub spec: NetworkSpec,
}

impl FirewallRecord {
    /// Where the record of the slot pinned at `pin` lives.
    pub fn path(pin: &Path) -> PathBuf {
        pin.with_extension("firewall")
    }

    /// The record at `path`; None when there is none or it cannot be read whole.
    pub fn read(path: &Path) -> Option<FirewallRecord> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    /// Writes the record at `path`.
    pub fn store(&self, path: &Path) -> io::Result<()> {
        std::fs::write(path, serde_json::to_vec(self).map_err(io::Error::other)?)
    }
}

/// The digest a [`FirewallRecord`] names a table by.
pub fn table_digest(table: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(table.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Removes the record at `path` (none is fine).
pub fn forget_record(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Runs `script` in `ns` with the slot's record kept true: removed before, written after
/// success (see [`FirewallRecord`]).
pub fn apply_recorded(
    runner: &dyn NftRunner,
    ns: Option<&File>,
    script: &str,
    record: Option<(&Path, FirewallRecord)>,
) -> Result<(), NftError> {
    if let Some((path, _)) = &record {
        forget_record(path).map_err(NftError::Netns)?;
    }
    runner.apply(ns, script)?;
    if let Some((path, rec)) = record
        && let Err(e) = rec.store(path)
    {
        // Without it an adoption replaces the table whole: slower, never wrong.
        tracing::warn!(path = %path.display(), error = %e, "cannot record the slot's firewall");
        let _ = forget_record(path);
    }
    Ok(())
}

/// One slot's kernel policy: the `inet space` sets inside its namespace. Serializes every
/// change (policy replacement and DNS additions), so an address resolved under an old policy
/// never lands in the sets of a new one.
#[derive(Debug)]
pub struct SlotFirewall {
    /// The slot's pinned namespace, opened for each run: no open file is held per slot.
    ns: Option<PathBuf>,
    /// Where the slot's [`FirewallRecord`] is kept, and its table's digest.
    record: Option<(PathBuf, String)>,
    runner: Arc<dyn NftRunner>,
    address: Ipv4Addr,
    state: tokio::sync::Mutex<FirewallState>,
}

impl SlotFirewall {
    /// `applied`: the policy already in the kernel sets (a pool slot made with the default
    /// policy), if known.
    pub fn new(
        ns: Option<PathBuf>,
        runner: Arc<dyn NftRunner>,
        address: Ipv4Addr,
        applied: Option<&Policy>,
    ) -> SlotFirewall {
        SlotFirewall {
            ns,
            record: None,
            runner,
            address,
            state: tokio::sync::Mutex::new(FirewallState {
                applied: applied.map(|p| p.spec().clone()),
                sets: applied.map(|p| SlotSets::for_policy(p, address)),
                dns: HashMap::new(),
                table: None,
                dns_unknown: false,
            }),
        }
    }

    /// Keeps the slot's [`FirewallRecord`] at `path` for a table of `digest` true after
    /// every policy transaction.
    pub fn recorded(mut self, path: PathBuf, digest: String) -> SlotFirewall {
        self.record = Some((path, digest));
        self
    }

    /// The firewall of a slot an earlier run made whose record names today's table and
    /// `applied`: nothing to run until the policy changes, which then also flushes `dns4`
    /// (its addresses were admitted under the same policy, by a node that is gone).
    pub fn adopted_as_recorded(
        ns: PathBuf,
        runner: Arc<dyn NftRunner>,
        address: Ipv4Addr,
        applied: &Policy,
    ) -> SlotFirewall {
        let mut fw = SlotFirewall::new(Some(ns), runner, address, Some(applied));
        fw.state.get_mut().dns_unknown = true;
        fw
    }

    /// The firewall of a slot an earlier run made: `table` ([`replace_slot_table`]) goes in
    /// with the first policy applied, in the same transaction, so an older node's rules never
    /// outlive the adoption and adopting costs one nft run.
    pub fn adopted(
        ns: PathBuf,
        runner: Arc<dyn NftRunner>,
        address: Ipv4Addr,
        table: String,
    ) -> SlotFirewall {
        let mut fw = SlotFirewall::new(Some(ns), runner, address, None);
        fw.state.get_mut().table = Some(table);
        fw
    }

    /// Runs `script`; `spec`: the policy the sets hold after it, when it changes them (the
    /// slot's record is kept true then).
    async fn run(&self, script: String, spec: Option<NetworkSpec>) -> Result<(), NftError> {
        let ns = self.ns.clone();
        let runner = self.runner.clone();
        let record = spec.and_then(|spec| {
            let (path, table) = self.record.clone()?;
            Some((path, FirewallRecord { table, spec }))
        });
        tokio::task::spawn_blocking(move || {
            let ns = ns.map(File::open).transpose().map_err(NftError::Netns)?;
            let record = record.as_ref().map(|(p, r)| (p.as_path(), r.clone()));
            apply_recorded(&*runner, ns.as_ref(), &script, record)
        })
        .await
        .unwrap_or_else(|e| Err(NftError::Netns(io::Error::other(e))))
    }

    /// The spec whose sets are in the kernel.
    pub async fn applied(&self) -> Option<NetworkSpec> {
        self.state.lock().await.applied.clone()
    }

    /// Puts `policy` into the kernel sets (one transaction, touching only the sets that
    /// change). Resolved addresses whose name the new policy still allows stay in `dns4` with
    /// their remaining life. Returns false when no nft run was needed.
    pub async fn apply_policy(&self, policy: &Policy) -> Result<bool, NftError> {
        let mut st = self.state.lock().await;
        if st.applied.as_ref() == Some(policy.spec()) {
            return Ok(false);
        }
        let now = Instant::now();
        let mut sets = SlotSets::for_policy(policy, self.address);
        let mut kept = HashMap::new();
        let mut lapsed = HashMap::new();
        let mut dns_removed = st.dns_unknown;
        for (ip, mut e) in st.dns.drain() {
            if e.expires <= now {
                if e.expires + DNS4_GRACE > now {
                    lapsed.insert(ip, e);
                }
                continue;
            }
            e.names.retain(|n| policy.allows_name(n));
            let ports = e
                .names
                .iter()
                .fold(Ports::default(), |acc, n| acc.union(&policy.name_ports(n)));
            let keep = policy.egress() == Egress::Allowlist
                && !ports.is_empty()
                && policy.allows_resolved_ip(ip);
            if keep && ports == e.ports {
                sets.dns4.push((ip, e.ports.clone(), e.expires - now));
                kept.insert(ip, e);
            } else {
                // Refilled below: `dns4` is flushed, and what stays is added back.
                dns_removed = true;
                if keep {
                    e.ports = ports;
                    sets.dns4.push((ip, e.ports.clone(), e.expires - now));
                    kept.insert(ip, e);
                }
            }
        }
        sets.dns4.sort_by_key(|(ip, _, _)| *ip);
        let mut script = set_changes(st.sets.as_ref(), &sets, dns_removed);
        if let Some(table) = &st.table {
            script.insert_str(0, table);
        }
        let ran = !script.is_empty();
        if ran {
            self.run(script, Some(policy.spec().clone())).await?;
        }
        st.table = None;
        st.dns_unknown = false;
        // After a flush nothing lapsed is left in the kernel; otherwise it may be, for a while.
        if !dns_removed {
            kept.extend(lapsed);
        }
        st.applied = Some(policy.spec().clone());
        sets.dns4.clear();
        st.sets = Some(sets);
        st.dns = kept;
        Ok(ran)
    }

    /// Lets the slot reach addresses `name` resolved to (`(address, ttl)`), before the DNS
    /// answer goes out. `policy` is the one the answer was checked against; if the kernel
    /// holds another one by now, fails with [`NftError::Stale`].
    pub async fn allow_resolved(
        &self,
        policy: &Policy,
        name: &str,
        answers: &[(Ipv4Addr, u32)],
    ) -> Result<(), NftError> {
        let mut st = self.state.lock().await;
        if st.applied.as_ref() != Some(policy.spec()) {
            return Err(NftError::Stale);
        }
        let now = Instant::now();
        let name_ports = policy.name_ports(name);
        if name_ports.is_empty() {
            return Ok(());
        }
        let mut changes: Vec<Dns4Change> = Vec::new();
        for &(ip, ttl) in answers {
            if changes.iter().any(|c| c.ip == ip) {
                continue;
            }
            let mut timeout = dns4_timeout(ttl);
            let change = match st.dns.get(&ip) {
                None => Dns4Change {
                    ip,
                    old: None,
                    ports: name_ports.clone(),
                    timeout,
                },
                // Lapsed (its elements may still be in the kernel): replaced.
                Some(e) if e.expires <= now => Dns4Change {
                    ip,
                    old: Some(e.ports.clone()),
                    ports: name_ports.clone(),
                    timeout,
                },
                Some(e) => {
                    // On these ports already, and for at least half the new life: nothing to do.
                    if e.ports.covers(&name_ports) && e.expires > now + timeout / 2 {
                        continue;
                    }
                    timeout = timeout.max(e.expires - now);
                    Dns4Change {
                        ip,
                        old: Some(e.ports.clone()),
                        ports: e.ports.union(&name_ports),
                        timeout,
                    }
                }
            };
            changes.push(change);
        }
        if changes.is_empty() {
            return Ok(());
        }
        let held = |dns: &HashMap<Ipv4Addr, DnsEntry>| -> usize {
            dns.iter()
                .filter(|(ip, _)| !changes.iter().any(|c| c.ip == **ip))
                .map(|(_, e)| e.elements())
                .sum::<usize>()
                + changes
                    .iter()
                    .map(|c| c.ports.ranges().len())
                    .sum::<usize>()
        };
        if held(&st.dns) > DNS4_MAX_ELEMENTS {
            st.dns.retain(|_, e| e.expires + DNS4_GRACE > now);
            if held(&st.dns) > DNS4_MAX_ELEMENTS {
                return Err(NftError::DnsFull);
            }
        }
        self.run(add_dns4(&changes), None).await?;
        for c in changes {
            let e = st.dns.entry(c.ip).or_insert_with(|| DnsEntry {
                names: Vec::new(),
                ports: Ports::default(),
                expires: now,
            });
            if e.expires <= now {
                e.names.clear();
            }
            e.names.retain(|n| n != name);
            e.names.push(name.to_owned());
            if e.names.len() > DNS4_NAMES_PER_ADDRESS {
                e.names.remove(0);
            }
            e.ports = c.ports;
            e.expires = now + c.timeout;
        }
        Ok(())
    }
}

/// Records scripts instead of running them (unit tests).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct RecordingNft {
    pub scripts: std::sync::Mutex<Vec<(bool, String)>>,
    pub fail: std::sync::atomic::AtomicBool,
}

#[cfg(test)]
impl NftRunner for RecordingNft {
    fn apply(&self, ns: Option<&File>, script: &str) -> Result<(), NftError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(NftError::Failed {
                status: "exit status: 1".into(),
                stderr: "injected".into(),
            });
        }
        self.scripts
            .lock()
            .unwrap()
            .push((ns.is_some(), script.to_owned()));
        Ok(())
    }
}

#[cfg(test)]
impl RecordingNft {
    pub fn taken(&self) -> Vec<String> {
        std::mem::take(&mut *self.scripts.lock().unwrap())
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(egress: Egress, allow: &[&str]) -> NetworkSpec {
        NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn subnet() -> Ipv4Net {
        "10.213.0.0/16".parse().unwrap()
    }

    fn pol(egress: Egress, allow: &[&str]) -> Policy {
        Policy::new(&spec(egress, allow), &[subnet()]).unwrap()
    }

    const ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 6);
    const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 5);
    const PORTS: NodePorts = NodePorts {
        dns_udp: 40001,
        dns_tcp: 40002,
        proxy: 40003,
    };

    #[test]
    fn root_table_is_idempotent_and_names_the_subnet() {
        let t = root_table(subnet(), PORTS);
        assert!(t.starts_with("add table ip space_node\ndelete table ip space_node\n"));
        assert!(t.contains("iifname \"spv*\" udp dport 53 redirect to :40001"));
        assert!(t.contains("iifname \"spv*\" tcp dport 53 redirect to :40002"));
        assert!(t.contains("iifname \"spv*\" tcp dport { 80, 443 } redirect to :40003"));
        // Only redirected slot traffic reaches the node's listeners.
        assert!(t.contains("ct status dnat meta l4proto . th dport { udp . 40001, tcp . 40002, tcp . 40003 } accept"));
        assert!(t.contains(
            "\t\tmeta l4proto . th dport { udp . 40001, tcp . 40002, tcp . 40003 } drop"
        ));
        assert!(t.contains("ip saddr 10.213.0.0/16 oifname != \"spv*\" masquerade"));
        assert!(t.contains("iifname \"spv*\" oifname \"spv*\" drop"));
        assert!(t.contains("iifname \"spv*\" ip daddr 169.254.0.0/16 drop"));
        assert!(t.contains("chain input"));
    }

    #[test]
    fn deny_ranges_cover_private_reserved_and_subnet_merged() {
        let d = deny_ranges("100.127.0.0/16".parse().unwrap());
        let has = |s: &str| d.contains(&s.parse().unwrap());
        assert!(has("10.0.0.0/8") && has("192.168.0.0/16") && has("169.254.0.0/16"));
        assert!(has("127.0.0.0/8") && has("224.0.0.0/3"), "{d:?}");
        // 100.127/16 lies inside 100.64/10: merged away.
        assert!(!has("100.127.0.0/16") && has("100.64.0.0/10"));
        let d2 = deny_ranges("198.18.0.0/16".parse().unwrap());
        assert!(d2.contains(&"198.18.0.0/16".parse().unwrap()));
        assert!(slot_table(&d2, GATEWAY).contains("198.18.0.0/16"));
    }

    #[test]
    fn sets_follow_the_egress_mode() {
        let none = SlotSets::for_policy(&Policy::deny_all(), ADDR);
        assert_eq!(
            none,
            SlotSets {
                closed4: Some(ADDR),
                ..SlotSets::default()
            }
        );
        let s = set_contents(&none);
        assert_eq!(
            s,
            "flush set inet space allow4\nflush set inet space dns4\nflush set inet space open4\n\
             flush set inet space closed4\nadd element inet space closed4 { 10.213.0.6, 169.254.0.2 }\n"
        );

        let open = SlotSets::for_policy(&pol(Egress::Open, &["192.168.1.0/24"]), ADDR);
        assert_eq!(open.open4, Some(ADDR));
        let s = set_contents(&open);
        assert!(s.contains(
            "add element inet space allow4 { 192.168.1.0/24 . 80, 192.168.1.0/24 . 443 }"
        ));
        assert!(s.contains("add element inet space open4 { 10.213.0.6, 169.254.0.2 }"));

        let allow = SlotSets::for_policy(
            &pol(
                Egress::Allowlist,
                &[
                    "203.0.113.0/25",
                    "203.0.113.128/25",
                    "198.51.100.7",
                    "x.com",
                ],
            ),
            ADDR,
        );
        assert_eq!((allow.open4, allow.closed4), (None, Some(ADDR)));
        // Adjacent CIDRs are merged before they reach the kernel.
        assert_eq!(
            set_contents(&allow).lines().nth(4).unwrap(),
            "add element inet space allow4 { 198.51.100.7/32 . 80, 198.51.100.7/32 . 443, \
             203.0.113.0/24 . 80, 203.0.113.0/24 . 443 }"
        );
    }

    #[test]
    fn allow4_elements_are_disjoint_whatever_the_rules_overlap() {
        let rules = |r: &[&str]| pol(Egress::Allowlist, r).cidrs().to_vec();
        let text = |r: &[&str]| {
            allow4_elements(&rules(r))
                .iter()
                .map(|(n, p)| format!("{n} . {p}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            text(&[
                "172.17.0.0/16:5432",
                "172.16.0.0/12:5000-6000",
                "172.18.0.0/16:*"
            ]),
            [
                "172.16.0.0/12 . 5000-6000",
                "172.18.0.0/16 . 1-4999",
                "172.18.0.0/16 . 6001-65535",
            ]
        );
        assert_eq!(
            text(&["198.51.100.0/25:22", "198.51.100.128/25:22,23"]),
            ["198.51.100.0/24 . 22", "198.51.100.128/25 . 23"]
        );
        // Brute force: no two elements overlap, and an (address, port) is in an element iff a
        // rule admits it.
        let r = rules(&[
            "172.16.0.0/12:1-100,200",
            "172.17.0.0/16:50-250",
            "172.17.2.0/24:*",
            "192.168.0.0/16:100",
            "172.17.2.3:65535",
        ]);
        let el = allow4_elements(&r);
        for (i, a) in el.iter().enumerate() {
            for b in &el[i + 1..] {
                let nets = a.0.contains(&b.0) || b.0.contains(&a.0);
                let ports = a.1.0 <= b.1.1 && b.1.0 <= a.1.1;
                assert!(!(nets && ports), "{a:?} overlaps {b:?}");
            }
        }
        for ip in [
            "172.16.0.1",
            "172.17.0.1",
            "172.17.2.3",
            "192.168.0.1",
            "198.51.100.1",
        ] {
            let ip: Ipv4Addr = ip.parse().unwrap();
            for port in [1, 49, 50, 100, 101, 199, 200, 201, 250, 251, 65535] {
                let want = r.iter().any(|(n, p)| n.contains(&ip) && p.contains(port));
                let got = el
                    .iter()
                    .any(|(n, p)| n.contains(&ip) && p.0 <= port && port <= p.1);
                assert_eq!(got, want, "{ip}:{port}");
            }
        }
    }

    #[test]
    fn changes_touch_only_what_differs_and_flush_only_to_remove() {
        let open = SlotSets::for_policy(&pol(Egress::Open, &[]), ADDR);
        let none = SlotSets::for_policy(&Policy::deny_all(), ADDR);
        let a1 = SlotSets::for_policy(&pol(Egress::Allowlist, &["198.51.100.0/24"]), ADDR);
        let a2 = SlotSets::for_policy(
            &pol(Egress::Allowlist, &["198.51.100.0/24", "203.0.113.7"]),
            ADDR,
        );
        assert_eq!(set_changes(None, &none, false), set_contents(&none));
        assert_eq!(set_changes(Some(&open), &open, false), "");
        assert_eq!(
            set_changes(Some(&none), &open, false),
            "add element inet space open4 { 10.213.0.6, 169.254.0.2 }\nflush set inet space closed4\n"
        );
        // Tightening an open slot (a pooled one, say) only adds elements.
        assert_eq!(
            set_changes(Some(&open), &a1, false),
            "add element inet space allow4 { 198.51.100.0/24 . 80, 198.51.100.0/24 . 443 }\n\
             add element inet space closed4 { 10.213.0.6, 169.254.0.2 }\n"
        );
        assert_eq!(
            set_changes(Some(&open), &none, false),
            "add element inet space closed4 { 10.213.0.6, 169.254.0.2 }\n"
        );
        // Growing: additions only.
        assert_eq!(
            set_changes(Some(&a1), &a2, false),
            "add element inet space allow4 { 203.0.113.7/32 . 80, 203.0.113.7/32 . 443 }\n"
        );
        // Shrinking: flush and refill.
        assert_eq!(
            set_changes(Some(&a2), &a1, false),
            "flush set inet space allow4\n\
             add element inet space allow4 { 198.51.100.0/24 . 80, 198.51.100.0/24 . 443 }\n"
        );
        let mut kept = a1.clone();
        kept.dns4 = vec![(
            Ipv4Addr::new(1, 2, 3, 4),
            Ports::new([(443, 443), (8000, 8100)]),
            Duration::from_secs(61),
        )];
        assert_eq!(
            set_changes(Some(&a1), &kept, true),
            "flush set inet space dns4\nadd element inet space dns4 { 1.2.3.4 . 443 timeout 61s, \
             1.2.3.4 . 8000-8100 timeout 61s }\n"
        );
        assert_eq!(set_changes(Some(&a1), &kept, false), "");
    }

    #[test]
    fn dns4_refresh_is_add_delete_add_and_timeouts_are_clamped() {
        let ip = Ipv4Addr::new(1, 2, 3, 4);
        let s = add_dns4(&[Dns4Change {
            ip,
            old: None,
            ports: Ports::web(),
            timeout: Duration::from_secs(90),
        }]);
        assert_eq!(
            s,
            "add element inet space dns4 { 1.2.3.4 . 80 timeout 90s, 1.2.3.4 . 443 timeout 90s }\n\
             delete element inet space dns4 { 1.2.3.4 . 80, 1.2.3.4 . 443 }\n\
             add element inet space dns4 { 1.2.3.4 . 80 timeout 90s, 1.2.3.4 . 443 timeout 90s }\n"
        );
        // Widening: the old elements give way to the merged ones.
        let s = add_dns4(&[Dns4Change {
            ip,
            old: Some(Ports::web()),
            ports: Ports::new([(80, 80), (443, 443), (444, 500)]),
            timeout: Duration::from_secs(60),
        }]);
        assert!(
            s.ends_with("delete element inet space dns4 { 1.2.3.4 . 80, 1.2.3.4 . 443 }\n\
                 add element inet space dns4 { 1.2.3.4 . 80 timeout 60s, 1.2.3.4 . 443-500 timeout 60s }\n"),
            "{s}"
        );
        assert_eq!(add_dns4(&[]), "");
        assert_eq!(dns4_timeout(0), DNS4_MIN_TIMEOUT);
        assert_eq!(dns4_timeout(300), Duration::from_secs(300));
        assert_eq!(dns4_timeout(u32::MAX), DNS4_MAX_TIMEOUT);
    }

    #[tokio::test]
    async fn firewall_skips_same_policy_and_keeps_still_allowed_dns() {
        let rec = Arc::new(RecordingNft::default());
        let fw = SlotFirewall::new(None, rec.clone(), ADDR, Some(&pol(Egress::Open, &[])));
        // The pool pre-applied the default: no nft.
        assert!(!fw.apply_policy(&pol(Egress::Open, &[])).await.unwrap());
        assert!(rec.taken().is_empty());

        let p = pol(Egress::Allowlist, &["a.example.com", "*.b.example.com"]);
        assert!(fw.apply_policy(&p).await.unwrap());
        assert_eq!(rec.taken().len(), 1);

        let a = Ipv4Addr::new(93, 184, 216, 34);
        let b = Ipv4Addr::new(93, 184, 216, 35);
        fw.allow_resolved(&p, "a.example.com", &[(a, 300)])
            .await
            .unwrap();
        fw.allow_resolved(&p, "x.b.example.com", &[(b, 10)])
            .await
            .unwrap();
        let s = rec.taken();
        assert_eq!(s.len(), 2);
        assert!(
            s[0].contains("93.184.216.34 . 443 timeout 300s"),
            "{}",
            s[0]
        );
        assert!(s[1].contains("93.184.216.35 . 80 timeout 60s"), "{}", s[1]);
        // Answered again while fresh: nothing to do.
        fw.allow_resolved(&p, "a.example.com", &[(a, 300)])
            .await
            .unwrap();
        assert!(rec.taken().is_empty());

        // A narrower policy keeps only a.example.com's address.
        let p2 = pol(Egress::Allowlist, &["a.example.com"]);
        assert!(fw.apply_policy(&p2).await.unwrap());
        let s = rec.taken();
        assert!(s[0].contains("add element inet space dns4 { 93.184.216.34 . 80 timeout"));
        assert!(!s[0].contains("93.184.216.35"), "{}", s[0]);
        // An answer checked against the old policy is refused.
        assert!(matches!(
            fw.allow_resolved(&p, "x.b.example.com", &[(b, 10)]).await,
            Err(NftError::Stale)
        ));
        // Open mode: dns4 empties, open4 holds the slot.
        assert!(fw.apply_policy(&pol(Egress::Open, &[])).await.unwrap());
        let s = rec.taken();
        assert!(!s[0].contains("dns4 {"), "{}", s[0]);
        assert!(s[0].contains("open4 { 10.213.0.6, 169.254.0.2 }"));
    }

    #[tokio::test]
    async fn a_failed_apply_leaves_the_recorded_policy() {
        let rec = Arc::new(RecordingNft::default());
        let fw = SlotFirewall::new(None, rec.clone(), ADDR, Some(&pol(Egress::Open, &[])));
        rec.fail.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(fw.apply_policy(&Policy::deny_all()).await.is_err());
        assert_eq!(fw.applied().await, Some(spec(Egress::Open, &[])));
    }

    /// A real `nft` in a throwaway namespace: the rendered scripts are accepted by the kernel
    /// and nft, and `dns4` refreshes work on elements present or not (root).
    #[test]
    fn real_nft_accepts_the_rendered_rulesets() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = dir.path().join("ns");
        space_sys::netns::create_pinned(&pin).unwrap();
        let ns = File::open(&pin).unwrap();
        let nft = SystemNft::new();
        let t0 = Instant::now();
        let r = (|| -> Result<(), NftError> {
            nft.apply(Some(&ns), &root_table(subnet(), PORTS))?;
            nft.apply(Some(&ns), &root_table(subnet(), PORTS))?;
            nft.apply(Some(&ns), &slot_table(&deny_ranges(subnet()), GATEWAY))?;
            // An adoption replaces the table whole, in one transaction with the sets.
            nft.apply(
                Some(&ns),
                &format!(
                    "{}{}",
                    replace_slot_table(&deny_ranges(subnet()), GATEWAY),
                    set_contents(&SlotSets::for_policy(&pol(Egress::Open, &[]), ADDR))
                ),
            )?;
            let p = pol(
                Egress::Allowlist,
                &["203.0.113.0/24", "203.0.113.0/25", "x.com"],
            );
            nft.apply(Some(&ns), &set_contents(&SlotSets::for_policy(&p, ADDR)))?;
            let ip = Ipv4Addr::new(1, 2, 3, 4);
            let web = Dns4Change {
                ip,
                old: None,
                ports: Ports::web(),
                timeout: Duration::from_secs(70),
            };
            nft.apply(Some(&ns), &add_dns4(std::slice::from_ref(&web)))?;
            nft.apply(Some(&ns), &add_dns4(std::slice::from_ref(&web)))?;
            // Widened to a range that swallows 443: the old elements give way.
            let wide = Dns4Change {
                ip,
                old: Some(Ports::web()),
                ports: Ports::new([(80, 80), (400, 500)]),
                timeout: Duration::from_secs(70),
            };
            nft.apply(Some(&ns), &add_dns4(&[wide]))?;
            // Overlapping CIDR rules with ports reach the kernel as disjoint elements.
            let p = pol(
                Egress::Allowlist,
                &[
                    "172.16.0.0/12:5000-6000",
                    "172.17.0.0/16:5432",
                    "172.17.0.0/16:*",
                ],
            );
            nft.apply(Some(&ns), &set_contents(&SlotSets::for_policy(&p, ADDR)))?;
            nft.apply(
                Some(&ns),
                &set_contents(&SlotSets::for_policy(&pol(Egress::Open, &[]), ADDR)),
            )?;
            nft.apply(Some(&ns), remove_root_table())?;
            nft.apply(Some(&ns), &root_table(subnet(), PORTS))
        })();
        let elapsed = t0.elapsed();
        let listing = space_sys::netns::run_in(ns.as_fd(), || {
            Command::new(&nft.binary).args(["list", "ruleset"]).output()
        });
        drop(ns);
        space_sys::netns::remove_pinned(&pin).unwrap();
        r.unwrap();
        let listing = String::from_utf8(listing.unwrap().unwrap().stdout).unwrap();
        assert!(listing.contains("10.213.0.6"), "{listing}");
        assert!(listing.contains("dnat ip to 10.213.0.5"), "{listing}");
        assert!(listing.contains("redirect to :40003"), "{listing}");
        eprintln!("12 nft transactions: {elapsed:?}");
    }

    #[test]
    fn a_bad_script_reports_nft_stderr() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = dir.path().join("ns");
        space_sys::netns::create_pinned(&pin).unwrap();
        let ns = File::open(&pin).unwrap();
        let r = SystemNft::new().apply(Some(&ns), "flush set inet space nosuchset\n");
        drop(ns);
        space_sys::netns::remove_pinned(&pin).unwrap();
        match r {
            Err(NftError::Failed { stderr, .. }) => assert!(!stderr.is_empty()),
            other => panic!("expected a failure, got {other:?}"),
        }
    }
}
