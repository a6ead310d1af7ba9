//! Networking of sandboxes (decision 0012): a network slot per sandbox (a node-owned network
//! namespace with a routed veth and NAT), its egress policy (nftables rules kept inside the
//! slot, plus the node's DNS and egress proxy, served for every slot from the node's own
//! namespace: decision 0059), inbound connections, and the credential layer (secrets
//! substituted by the proxy, never visible inside).
//!
//! Who does what:
//! - [`policy`]: parsing and matching of rules (CIDRs, exact and wildcard domains);
//! - [`slots`]/[`nft`]: slot namespaces, veths, the node's root table and per-slot rulesets;
//! - [`dns`]: the node's resolver, answering each slot by its policy, and the upstream
//!   forwarder;
//! - [`proxy`]/[`ca`]: the transparent egress proxy and the node CA for intercepted TLS;
//! - [`network`]: the facade the node uses.

pub use space_ca as ca;
pub mod dns;
pub mod network;
pub mod nft;
pub mod policy;
pub mod proxy;
pub mod slots;

use std::net::Ipv4Addr;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;

pub use network::{NetConfig, NetError, Network, SlotInfo};
pub use space_node_api::net::{Egress, NetworkSpec, NetworkStatus, SecretBinding, SecretSource};

/// The node's secret source, set once the control plane is up.
#[derive(Default)]
pub struct Secrets(RwLock<Option<Arc<dyn SecretSource>>>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secrets(..)")
    }
}

impl Secrets {
    pub fn set(&self, source: Arc<dyn SecretSource>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(source);
    }
    /// The value of secret `name`, or None (unknown, or no source set yet).
    pub async fn value(&self, name: &str) -> Option<String> {
        let source = self.0.read().unwrap_or_else(|e| e.into_inner()).clone()?;
        source.secret_value(name).await
    }
}

/// Finds the slot a query or connection came from by its source address (None: from no
/// slot of this node). The node's DNS server and egress proxy serve every slot through one.
pub type SlotLookup<T> = Arc<dyn Fn(Ipv4Addr) -> Option<T> + Send + Sync>;

/// The slot `peer` (a query's or connection's source) belongs to, if any (slots are IPv4).
pub fn slot_of<T>(lookup: &SlotLookup<T>, peer: std::net::SocketAddr) -> Option<T> {
    match peer {
        std::net::SocketAddr::V4(p) => lookup(*p.ip()),
        std::net::SocketAddr::V6(_) => None,
    }
}

/// Name resolution as the node does it (through its upstream servers, never the sandbox's).
#[async_trait]
pub trait Resolve: Send + Sync {
    /// IPv4 addresses of `name` (empty when it has none).
    async fn lookup_v4(&self, name: &str) -> std::io::Result<Vec<Ipv4Addr>>;
}

/// One sandbox's live network state, shared by its DNS server and egress proxy and changed by
/// [`Network::update`]: the compiled policy, the secret bindings, and the proxied connections
/// (so that a tightened policy cuts the ones it no longer allows).
#[derive(Debug)]
pub struct SandboxNet {
    /// The sandbox's id (changes once when a warm pool's sandbox is handed out).
    id: RwLock<Arc<str>>,
    /// The sandbox's own address in its slot.
    pub address: Ipv4Addr,
    policy: RwLock<Arc<policy::Policy>>,
    secrets: RwLock<Arc<Vec<SecretBinding>>>,
    conns: std::sync::Mutex<std::collections::HashMap<u64, Conn>>,
    next_conn: std::sync::atomic::AtomicU64,
    /// Set when the sandbox's slot is detached: every connection is cut, new ones refused.
    closed: std::sync::atomic::AtomicBool,
}

/// A proxied connection as the policy sees it.
#[derive(Debug)]
struct Conn {
    /// The name it was allowed by (SNI or Host), if any.
    name: Option<String>,
    /// The address the node connected to, and its port.
    ip: Ipv4Addr,
    port: u16,
    cancel: tokio_util::sync::CancellationToken,
}

/// Keeps a connection registered while alive; dropping it unregisters.
#[derive(Debug)]
pub struct ConnGuard {
    net: Arc<SandboxNet>,
    key: u64,
    /// Cancelled when a policy change forbids the connection: the proxy then drops both
    /// sockets.
    pub cancel: tokio_util::sync::CancellationToken,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.net
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl SandboxNet {
    pub fn new(
        id: &str,
        address: Ipv4Addr,
        policy: policy::Policy,
        secrets: Vec<SecretBinding>,
    ) -> Arc<SandboxNet> {
        Arc::new(SandboxNet {
            id: RwLock::new(Arc::from(id)),
            address,
            policy: RwLock::new(Arc::new(policy)),
            secrets: RwLock::new(Arc::new(secrets)),
            conns: Default::default(),
            next_conn: Default::default(),
            closed: Default::default(),
        })
    }

    pub fn id(&self) -> Arc<str> {
        self.id.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_id(&self, id: &str) {
        *self.id.write().unwrap_or_else(|e| e.into_inner()) = Arc::from(id);
    }

    pub fn policy(&self) -> Arc<policy::Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn secrets(&self) -> Arc<Vec<SecretBinding>> {
        self.secrets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_secrets(&self, secrets: Vec<SecretBinding>) {
        *self.secrets.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(secrets);
    }

    /// Registers a proxied connection to `ip` port `port`, allowed by `name` (SNI/Host) if
    /// any.
    pub fn register(self: &Arc<Self>, name: Option<&str>, ip: Ipv4Addr, port: u16) -> ConnGuard {
        let key = self
            .next_conn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cancel = tokio_util::sync::CancellationToken::new();
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).insert(
            key,
            Conn {
                name: name.map(str::to_owned),
                ip,
                port,
                cancel: cancel.clone(),
            },
        );
        // A policy swap (or the slot's detach) between the proxy's decision and this
        // registration must not let the connection through: check again now.
        if self.closed.load(std::sync::atomic::Ordering::SeqCst)
            || !self.policy().allows_connection(name, ip, port)
        {
            cancel.cancel();
        }
        ConnGuard {
            net: self.clone(),
            key,
            cancel,
        }
    }

    /// Replaces the policy and cuts the proxied connections it no longer allows. Returns how
    /// many were cut.
    pub fn set_policy(&self, policy: policy::Policy) -> usize {
        let policy = Arc::new(policy);
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = policy.clone();
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        let mut cut = 0;
        for c in conns.values() {
            if !c.cancel.is_cancelled()
                && !policy.allows_connection(c.name.as_deref(), c.ip, c.port)
            {
                c.cancel.cancel();
                cut += 1;
            }
        }
        cut
    }

    /// Cuts every proxied connection and refuses new ones: the sandbox's slot is gone (the
    /// node's proxy serves all slots, so nothing else ends them).
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            c.cancel.cancel();
        }
    }

    /// Live proxied connections.
    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipnet::Ipv4Net;
    use policy::Policy;

    fn spec(egress: Egress, allow: &[&str]) -> NetworkSpec {
        NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn tightening_cuts_only_what_is_no_longer_allowed() {
        let subnet: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        let net = SandboxNet::new(
            "sb",
            ip("10.213.0.2"),
            Policy::new(&spec(Egress::Open, &[]), &[subnet]).unwrap(),
            vec![],
        );
        let a = net.register(Some("api.example.test"), ip("203.0.113.10"), 443);
        let b = net.register(None, ip("203.0.113.11"), 443);
        let a22 = net.register(Some("api.example.test"), ip("203.0.113.10"), 22);
        assert!(!a.cancel.is_cancelled() && !b.cancel.is_cancelled());
        let cut = net.set_policy(
            Policy::new(&spec(Egress::Allowlist, &["api.example.test"]), &[subnet]).unwrap(),
        );
        assert_eq!(cut, 2);
        assert!(!a.cancel.is_cancelled());
        assert!(b.cancel.is_cancelled());
        assert!(a22.cancel.is_cancelled(), "the rule names 80 and 443 only");
        drop((b, a22));
        assert_eq!(net.connections(), 1);
        // Registering under a policy that forbids it is cancelled at once.
        let c = net.register(None, ip("198.51.100.20"), 443);
        assert!(c.cancel.is_cancelled());
    }
}
