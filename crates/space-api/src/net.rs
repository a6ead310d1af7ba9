//! Networking, egress policy, secrets and ports (decision 0012).
//!
//! - A sandbox's egress is `none` (nothing leaves), `allowlist` (only `allow` rules: CIDRs,
//!   addresses, exact domains, `*.domain` wildcards, each on its `:PORTS`, 80 and 443 when it
//!   names none) or `open` (the internet, not private ranges unless a CIDR rule names them).
//! - A secret is a value kept by the control plane; a sandbox created with it sees only a
//!   placeholder in its environment, which the node's egress proxy replaces in one header of
//!   HTTPS requests to the secret's hosts. Values are never returned by the API.
//! - A port is reached through `GET/... /p/{token}/...` on the API address.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Largest secret value accepted, in bytes.
pub const MAX_SECRET_BYTES: usize = 8192;

/// What a sandbox may reach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    /// Nothing leaves the sandbox (DNS answers REFUSED).
    None,
    /// Only the `allow` rules.
    Allowlist,
    /// Anything public; private and local ranges only through CIDR rules in `allow`.
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

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Egress::None,
            "allowlist" => Egress::Allowlist,
            "open" => Egress::Open,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Egress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Egress::parse(s).ok_or_else(|| format!("expected none, allowlist or open, got {s:?}"))
    }
}

/// `CreateSandbox.network` and the body of `PUT /v1/sandboxes/{id}/network` (it replaces the
/// whole policy).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Absent: `allowlist` when `allow` has rules, else the node's default egress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Egress>,
    /// Rules: `203.0.113.0/24`, `198.51.100.7`, `api.example.com`, `*.example.com`, each with
    /// optional ports (`api.example.com:8443`, `10.0.0.0/8:5432,6379`, `x.example.com:8000-8100`,
    /// `203.0.113.7:*`); without them a rule admits 80 and 443.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

/// `Sandbox.network`: the policy, and the sandbox's address while the node has one for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxNetwork {
    pub egress: Egress,
    #[serde(default)]
    pub allow: Vec<String>,
    /// IPv4 address of the sandbox (its `eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Its gateway (the node side of its link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// `PUT /v1/secrets/{name}`: creates or replaces a secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutSecret {
    /// 1..=8192 bytes, no CR, LF or NUL. Never returned.
    pub value: String,
    /// Domains the value may be sent to: `api.example.com` or `*.example.com`.
    pub hosts: Vec<String>,
    /// The header that carries it, `{}` marking where the value goes:
    /// `Authorization: Bearer {}`.
    pub header: String,
}

impl std::fmt::Debug for PutSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutSecret")
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .finish()
    }
}

/// A secret as the API shows it (never its value).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretInfo {
    pub name: String,
    /// The tenant it belongs to: a name is unique within its tenant (decision 0048).
    #[serde(default = "crate::types::default_tenant")]
    pub tenant: String,
    /// Empty for a secret made through E2B's API, which only `secret_headers` (and E2B's
    /// network rules) can use.
    pub hosts: Vec<String>,
    pub header: String,
    /// 1 for a new secret; every change of its value adds one.
    #[serde(default = "first_version")]
    pub version: u64,
    /// The caller's own labels (E2B's secret metadata).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub updated_at: String,
}

fn first_version() -> u64 {
    1
}

/// A header the egress proxy sets, with a secret's value in it, on every HTTPS request of
/// the sandbox to `hosts` (`CreateSandbox.secret_headers`). The sandbox holds nothing: not
/// the value, not even a placeholder. This is what E2B's network rules with
/// `${e2b.secrets.NAME}` in a header become.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretHeader {
    /// The secret whose value goes in.
    pub secret: String,
    /// Domains: `api.example.com` or `*.example.com`. A secret bound to hosts of its own
    /// (`PUT /v1/secrets`) may only be sent to those.
    pub hosts: Vec<String>,
    /// `Header-Name: template`, `{}` marking where the value goes: `Authorization: Bearer {}`.
    /// It replaces any header of that name the sandbox sent.
    pub header: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretList {
    pub secrets: Vec<SecretInfo>,
}

/// Whether `name` is a valid secret name: `[A-Za-z_][A-Za-z0-9_.-]{0,63}`. Only a name that
/// is also an environment variable name (no `.` or `-`) can be given to a sandbox as a
/// placeholder (`CreateSandbox.secrets`); any can go in a `secret_headers` entry.
pub fn is_valid_secret_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 64
        && bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

/// `POST /v1/sandboxes/{id}/ports`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRequest {
    /// 1..=65535: a TCP port the sandbox listens on (on any address, 127.0.0.1 included).
    pub port: u32,
}

/// The reply: the URL that reaches the port (no API key needed: the URL is the credential).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortInfo {
    pub port: u16,
    pub url: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn egress_and_policy_wire_forms() {
        assert_eq!(serde_json::to_string(&Egress::None).unwrap(), "\"none\"");
        assert_eq!("allowlist".parse::<Egress>(), Ok(Egress::Allowlist));
        assert!("closed".parse::<Egress>().is_err());
        let p: NetworkPolicy =
            serde_json::from_str(r#"{"egress":"allowlist","allow":["*.x.com"]}"#).unwrap();
        assert_eq!(p.egress, Some(Egress::Allowlist));
        assert_eq!(p.allow, vec!["*.x.com"]);
        assert_eq!(
            serde_json::from_str::<NetworkPolicy>("{}").unwrap(),
            NetworkPolicy::default()
        );
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"egres":"open"}"#).is_err());
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"egress":"x"}"#).is_err());
    }

    #[test]
    fn secret_names_and_debug_hides_values() {
        assert!(is_valid_secret_name("OPENAI_API_KEY"));
        assert!(is_valid_secret_name(&"A".repeat(64)));
        assert!(!is_valid_secret_name(&"A".repeat(65)));
        assert!(!is_valid_secret_name("1X"));
        // E2B's names look like this; only env-var names can become placeholders.
        assert!(is_valid_secret_name("openai-api.key_2"));
        for bad in ["", "-x", ".x", "A B", "a/b", "a{b}"] {
            assert!(!is_valid_secret_name(bad), "{bad:?}");
        }
        let s = PutSecret {
            value: "sk-verysecret".into(),
            hosts: vec!["api.x.com".into()],
            header: "Authorization: Bearer {}".into(),
        };
        assert!(!format!("{s:?}").contains("verysecret"));
    }
}
