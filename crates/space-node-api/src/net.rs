//! A sandbox's network as the contract speaks of it (decision 0012): its egress policy as the
//! user wrote it, the secrets it may use through the egress proxy, and its network as
//! `inspect` shows it.

use std::net::Ipv4Addr;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// The port of the node's DNS resolver as a sandbox reaches it.
pub const SLOT_DNS_PORT: u16 = 53;
/// Where the node's egress proxy listened on the loopback of every sandbox's network slot
/// until decision 0059 moved it (and DNS) into the node's own namespace.
pub const SLOT_PROXY_PORT: u16 = 15001;

/// The node's service that `port` of a sandbox once led to, if any: no port URL leads to it
/// (a namespace sandbox shared its slot's loopback with the node's DNS and egress proxy, which
/// would otherwise have carried a stranger's requests out with the sandbox's secrets). Refused
/// on both runtimes alike (decision 0047). Since decision 0059 the node serves neither in
/// the slot; the ports stay reserved so that a URL never names one.
pub fn node_port(port: u16) -> Option<&'static str> {
    match port {
        SLOT_DNS_PORT => Some("the node's DNS resolver"),
        SLOT_PROXY_PORT => Some("the node's egress proxy"),
        _ => None,
    }
}

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
    /// The name the node asks its [`SecretSource`] for, when it is not `name` (a tenant's
    /// secret: `tenant/name`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret: String,
}

impl SecretBinding {
    /// The name to ask the [`SecretSource`] for.
    pub fn source_name(&self) -> &str {
        if self.secret.is_empty() {
            &self.name
        } else {
            &self.secret
        }
    }

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

/// A sandbox's network as `inspect` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkStatus {
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub egress: Egress,
    pub allow: Vec<String>,
}
