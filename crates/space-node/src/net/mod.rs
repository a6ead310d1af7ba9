//! Networking of sandboxes (decision 0012): a network slot per sandbox (a node-owned network
//! namespace with a routed veth and NAT), its egress policy (nftables rules kept inside the
//! slot, plus the node's DNS and egress proxy), inbound connections, and the credential layer
//! (secrets substituted by the proxy, never visible inside).
//!
//! Who does what:
//! - [`policy`]: parsing and matching of rules (CIDRs, exact and wildcard domains);
//! - [`slots`]/[`nft`]: slot namespaces, veths, the node's root table and per-slot rulesets;
//! - [`dns`]: the per-slot resolver and the upstream forwarder;
//! - [`proxy`]/[`ca`]: the transparent egress proxy and the node CA for intercepted TLS;
//! - [`network`]: the facade the node uses.

pub mod ca;
pub mod dns;
pub mod network;
pub mod nft;
pub mod policy;
pub mod proxy;
pub mod slots;

use std::net::Ipv4Addr;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use network::{NetConfig, NetError, Network, SlotInfo};

/// What a sandbox may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    /// Nothing (not even DNS).
    None,
    /// Only what the allow rules name.
    Allowlist,
    /// The internet, minus the node, other sandboxes, private, link-local and metadata
    /// addresses (allow rules may re-admit private ranges).
    #[default]
    Open,
}

impl Egress {
    pub fn as_str(self) -> &'static str {
        match self {
            Egress::None => "none",
            Egress::Allowlist => "allowlist",
            Egress::Open => "open",
        }
    }
}

impl std::str::FromStr for Egress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Egress::None),
            "allowlist" => Ok(Egress::Allowlist),
            "open" => Ok(Egress::Open),
            other => Err(format!(
                "unknown egress mode {other:?} (expected none, allowlist or open)"
            )),
        }
    }
}

/// A sandbox's egress policy as the user wrote it (validated by [`policy::Policy::new`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NetworkSpec {
    pub egress: Egress,
    /// CIDRs (`203.0.113.0/24`, `198.51.100.7`), exact domains (`api.example.com`) and
    /// wildcard domains (`*.example.com`: any name below example.com, not itself).
    pub allow: Vec<String>,
}

/// A secret a sandbox may use: its environment holds `name=placeholder`; the egress proxy
/// puts the value in place of the placeholder in header `header` of HTTPS requests to hosts
/// matching `hosts`. With `inject`, the sandbox holds nothing (no placeholder): the proxy sets
/// `header`, its template filled with the value, on every HTTPS request to those hosts. The
/// value itself is never here (see [`SecretSource`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretBinding {
    pub name: String,
    pub placeholder: String,
    /// Exact or wildcard domain patterns.
    pub hosts: Vec<String>,
    /// `Header-Name: template` with `{}` where the value goes (e.g. `Authorization: Bearer {}`).
    pub header: String,
    #[serde(default)]
    pub inject: bool,
}

impl SecretBinding {
    /// The header name (before the first `:`), trimmed.
    pub fn header_name(&self) -> &str {
        self.header.split(':').next().unwrap_or("").trim()
    }

    /// The header's template (after the first `:`), trimmed: `Bearer {}`.
    pub fn header_template(&self) -> &str {
        self.header.split_once(':').map_or("", |(_, t)| t.trim())
    }
}

/// Where secret values come from (the control plane's encrypted store), asked at the moment a
/// request needs one, so a rotated secret takes effect at once.
#[async_trait]
pub trait SecretSource: Send + Sync {
    async fn secret_value(&self, name: &str) -> Option<String>;
}

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

/// Name resolution as the node does it (through its upstream servers, never the sandbox's).
#[async_trait]
pub trait Resolve: Send + Sync {
    /// IPv4 addresses of `name` (empty when it has none).
    async fn lookup_v4(&self, name: &str) -> std::io::Result<Vec<Ipv4Addr>>;
}

/// A sandbox's network as `inspect` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkStatus {
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub egress: Egress,
    pub allow: Vec<String>,
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
}

/// A proxied connection as the policy sees it.
#[derive(Debug)]
struct Conn {
    /// The name it was allowed by (SNI or Host), if any.
    name: Option<String>,
    /// The address the node connected to.
    ip: Ipv4Addr,
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

    /// Registers a proxied connection to `ip`, allowed by `name` (SNI/Host) if any.
    pub fn register(self: &Arc<Self>, name: Option<&str>, ip: Ipv4Addr) -> ConnGuard {
        let key = self
            .next_conn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cancel = tokio_util::sync::CancellationToken::new();
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).insert(
            key,
            Conn {
                name: name.map(str::to_owned),
                ip,
                cancel: cancel.clone(),
            },
        );
        // A policy swap between the proxy's decision and this registration must not let the
        // connection through: check again under the new policy.
        if !self.policy().allows_connection(name, ip) {
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
            if !c.cancel.is_cancelled() && !policy.allows_connection(c.name.as_deref(), c.ip) {
                c.cancel.cancel();
                cut += 1;
            }
        }
        cut
    }

    /// Live proxied connections.
    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}
