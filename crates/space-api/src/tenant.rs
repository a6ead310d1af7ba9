//! Tenants and their API keys (decision 0040): every object belongs to a tenant, and a key
//! carries a tenant and a scope.

use serde::{Deserialize, Serialize};

/// The tenant that exists always: objects from before tenants and those an admin key makes.
pub const DEFAULT_TENANT: &str = "default";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyScope {
    /// Everything, every tenant's objects (only `default` holds admin keys).
    Admin,
    /// Its tenant's sandboxes and what is under them, and a read of shared templates.
    Tenant,
    /// What `tenant` may read; nothing it may change.
    ReadOnly,
}

impl KeyScope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Tenant => "tenant",
            Self::ReadOnly => "read-only",
        }
    }
}

impl std::str::FromStr for KeyScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "admin" => Ok(Self::Admin),
            "tenant" => Ok(Self::Tenant),
            "read-only" => Ok(Self::ReadOnly),
            other => Err(format!(
                "unknown key scope {other:?}: expected admin, tenant or read-only"
            )),
        }
    }
}

/// Whether `id` is a valid tenant id: 1 to 63 of `a-z`, `0-9` and `-`, starting with a
/// letter or digit.
pub fn is_valid_tenant_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
}

/// What a tenant's sandboxes may hold together; each absent limit is no limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantQuota {
    /// Sandboxes that are not deleted (stopped and failed ones count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u32>,
    /// CPU cores their limits claim, summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Memory their limits claim, summed, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Snapshots of its sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<u32>,
    /// Disk its namespace sandboxes' limits claim, summed, in MiB (a sandbox's limit holds
    /// its snapshots too, decision 0043). Under it every namespace sandbox has a limit: a
    /// create that names none gets [`DEFAULT_QUOTA_DISK_MIB`], or the quota when smaller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
}

/// The disk limit a namespace sandbox of a tenant with a disk quota gets when its create
/// names none (10 GiB).
pub const DEFAULT_QUOTA_DISK_MIB: u64 = 10 * 1024;

impl TenantQuota {
    /// Whether it limits anything.
    pub fn is_empty(&self) -> bool {
        self.sandboxes.is_none()
            && self.cpu.is_none()
            && self.memory_mib.is_none()
            && self.snapshots.is_none()
            && self.disk_mib.is_none()
    }

    /// Whether it limits what a sandbox claims (anything but snapshots).
    pub fn limits_sandboxes(&self) -> bool {
        self.sandboxes.is_some()
            || self.cpu.is_some()
            || self.memory_mib.is_some()
            || self.disk_mib.is_some()
    }
}

/// `POST /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    pub id: String,
    /// Replicas of its sandboxes when neither the create nor the template says (0 or 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<TenantQuota>,
}

/// `PUT /v1/tenants/{id}`: its settings, replaced whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTenant {
    /// Replicas of its sandboxes when neither the create nor the template says (none: 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Its quota (none: no limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<TenantQuota>,
}

/// A tenant and what it holds now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub id: String,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// Its sandboxes that are not deleted.
    pub sandboxes: u64,
    /// Its keys that still work (not revoked, not expired).
    pub keys: u64,
    /// Replicas of its sandboxes when neither the create nor the template says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<TenantQuota>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantList {
    pub tenants: Vec<Tenant>,
}

/// `POST /v1/keys`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    pub tenant: String,
    pub scope: KeyScope,
    /// A label for people (default: the scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Requests a second it may make, in bursts of twice that (default: 100 for tenant and
    /// read-only keys, no limit for admin keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<u32>,
}

/// The requests a second a tenant or read-only key may make when it names no rate.
pub const DEFAULT_KEY_RATE: u32 = 100;

/// A key as listed: never its value or hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub id: String,
    pub tenant: String,
    pub scope: KeyScope,
    pub name: String,
    /// Requests a second it may make (none: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<u32>,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// When it stops working (set by a rotation's overlap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// When it was revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyList {
    pub keys: Vec<ApiKey>,
}

/// A new key: its value is answered once, here, and never again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreatedKey {
    pub key: String,
    pub info: ApiKey,
}

/// `POST /v1/keys/{id}/rotate`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotateKey {
    /// How long the old key keeps working (default 3600, at most 604800).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_secs: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_and_ids() {
        for s in [KeyScope::Admin, KeyScope::Tenant, KeyScope::ReadOnly] {
            assert_eq!(s.as_str().parse::<KeyScope>(), Ok(s));
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
        }
        assert!("root".parse::<KeyScope>().is_err());
        assert!(is_valid_tenant_id("team-a1"));
        for bad in ["", "-a", "A", "a_b", "a/b", &"a".repeat(64)] {
            assert!(!is_valid_tenant_id(bad), "{bad}");
        }
    }
}
