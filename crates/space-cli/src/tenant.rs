//! `space tenant ...` and `space key ...`: tenants and their API keys (decision 0040).

use anyhow::Result;
use clap::Subcommand;
use space_api::Client;
use space_api::tenant::{
    ApiKey, ApiKeyList, CreateKey, CreateTenant, KeyScope, RotateKey, SetTenant, Tenant,
    TenantList, TenantQuota,
};

#[derive(Debug, Subcommand)]
pub enum TenantCmd {
    /// Create a tenant (1 to 63 of a-z, 0-9 and -).
    Create {
        id: String,
        #[command(flatten)]
        settings: SettingsArgs,
        #[arg(long)]
        json: bool,
    },
    /// Set a tenant's settings, replaced whole (what is not given is unset: no limit).
    Set {
        id: String,
        #[command(flatten)]
        settings: SettingsArgs,
        #[arg(long)]
        json: bool,
    },
    /// List tenants with their sandboxes and live keys.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove a tenant that has no sandboxes and no live keys.
    Rm { id: String },
}

/// A tenant's settings on the command line.
#[derive(Debug, clap::Args)]
pub struct SettingsArgs {
    /// Replicas of its sandboxes when neither the create nor the template says (needs a
    /// cluster).
    #[arg(long)]
    replicas: Option<u32>,
    /// At most this many sandboxes that are not deleted.
    #[arg(long, value_name = "N")]
    max_sandboxes: Option<u32>,
    /// At most this many CPU cores claimed by its sandboxes' limits together.
    #[arg(long, value_name = "CORES")]
    max_cpu: Option<f64>,
    /// At most this much memory claimed by its sandboxes' limits together, in MiB.
    #[arg(long, value_name = "MIB")]
    max_memory: Option<u64>,
    /// At most this many snapshots of its sandboxes.
    #[arg(long, value_name = "N")]
    max_snapshots: Option<u32>,
    /// At most this much disk claimed by its namespace sandboxes' disk limits together, in
    /// MiB; a create without --disk then gets 10 GiB (or this, when smaller).
    #[arg(long, value_name = "MIB")]
    max_disk: Option<u64>,
}

impl SettingsArgs {
    fn quota(&self) -> Option<TenantQuota> {
        let q = TenantQuota {
            sandboxes: self.max_sandboxes,
            cpu: self.max_cpu,
            memory_mib: self.max_memory,
            snapshots: self.max_snapshots,
            disk_mib: self.max_disk,
        };
        (!q.is_empty()).then_some(q)
    }
}

#[derive(Debug, Subcommand)]
pub enum KeyCmd {
    /// Create an API key and print it (it is shown this once, never again).
    Create {
        /// The tenant it belongs to (`default` for admin keys).
        #[arg(long, default_value = space_api::tenant::DEFAULT_TENANT)]
        tenant: String,
        /// admin, tenant or read-only.
        #[arg(long, default_value = "tenant", value_parser = parse_scope)]
        scope: KeyScope,
        /// A label for people.
        #[arg(long)]
        name: Option<String>,
        /// Requests a second it may make, in bursts of twice that (default: 100 for tenant
        /// and read-only keys, no limit for admin keys).
        #[arg(long, value_name = "N")]
        rate: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their values).
    Ls {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Make a new key like ID and print it; ID keeps working for the overlap.
    Rotate {
        id: String,
        /// How long the old key keeps working, in seconds (default 3600, at most 604800).
        #[arg(long, value_name = "SECS")]
        overlap: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key: it fails from the next request on.
    Revoke { id: String },
}

fn parse_scope(s: &str) -> Result<KeyScope, String> {
    s.parse()
}

/// The table of `space tenant ls`.
pub fn tenant_table(tenants: &[Tenant]) -> String {
    let mut out = vec![format!(
        "{:<24}  {:>9}  {:>5}  {:>8}  {:<24}  QUOTA",
        "TENANT", "SANDBOXES", "KEYS", "REPLICAS", "CREATED"
    )];
    for t in tenants {
        out.push(format!(
            "{:<24}  {:>9}  {:>5}  {:>8}  {:<24}  {}",
            t.id,
            t.sandboxes,
            t.keys,
            t.replicas.unwrap_or(0),
            t.created_at,
            quota_text(t.quota.as_ref())
        ));
    }
    out.join("\n")
}

/// A quota in a few words ("-" for none).
fn quota_text(q: Option<&TenantQuota>) -> String {
    let Some(q) = q else { return "-".into() };
    let mut parts = Vec::new();
    if let Some(n) = q.sandboxes {
        parts.push(format!("{n} sandboxes"));
    }
    if let Some(c) = q.cpu {
        parts.push(format!("{c} cpu"));
    }
    if let Some(m) = q.memory_mib {
        parts.push(format!("{m} MiB"));
    }
    if let Some(n) = q.snapshots {
        parts.push(format!("{n} snapshots"));
    }
    if let Some(m) = q.disk_mib {
        parts.push(format!("{m} MiB disk"));
    }
    parts.join(", ")
}

/// The table of `space key ls`: a key's state is live, expires (a rotation's overlap) or
/// revoked.
pub fn key_table(keys: &[ApiKey]) -> String {
    let mut out = vec![format!(
        "{:<16}  {:<16}  {:<9}  {:<16}  STATE",
        "ID", "TENANT", "SCOPE", "NAME"
    )];
    for k in keys {
        let state = match (&k.revoked_at, &k.expires_at) {
            (Some(at), _) => format!("revoked {at}"),
            (None, Some(at)) => format!("expires {at}"),
            (None, None) => "live".to_owned(),
        };
        out.push(format!(
            "{:<16}  {:<16}  {:<9}  {:<16}  {state}",
            k.id,
            k.tenant,
            k.scope.as_str(),
            k.name
        ));
    }
    out.join("\n")
}

pub async fn run_tenant(c: Client, cmd: TenantCmd) -> Result<i32> {
    match cmd {
        TenantCmd::Create { id, settings, json } => {
            let req = CreateTenant {
                id,
                replicas: settings.replicas,
                quota: settings.quota(),
            };
            let t = c.create_tenant(&req).await?;
            if json {
                crate::print_json(&t)?;
            } else {
                println!("{}", t.id);
            }
        }
        TenantCmd::Set { id, settings, json } => {
            let req = SetTenant {
                replicas: settings.replicas,
                quota: settings.quota(),
            };
            let t = c.set_tenant(&id, &req).await?;
            if json {
                crate::print_json(&t)?;
            } else {
                println!("{}", tenant_table(std::slice::from_ref(&t)));
            }
        }
        TenantCmd::Ls { json } => {
            let tenants = c.list_tenants().await?;
            if json {
                crate::print_json(&TenantList { tenants })?;
            } else {
                println!("{}", tenant_table(&tenants));
            }
        }
        TenantCmd::Rm { id } => c.delete_tenant(&id).await?,
    }
    Ok(0)
}

pub async fn run_key(c: Client, cmd: KeyCmd) -> Result<i32> {
    let created = match cmd {
        KeyCmd::Create {
            tenant,
            scope,
            name,
            rate,
            json,
        } => {
            let req = CreateKey {
                tenant,
                scope,
                name,
                rate_per_sec: rate,
            };
            (c.create_key(&req).await?, json)
        }
        KeyCmd::Rotate { id, overlap, json } => (
            c.rotate_key(
                &id,
                &RotateKey {
                    overlap_secs: overlap,
                },
            )
            .await?,
            json,
        ),
        KeyCmd::Ls { tenant, json } => {
            let keys = c.list_keys(tenant.as_deref()).await?;
            if json {
                crate::print_json(&ApiKeyList { keys })?;
            } else {
                println!("{}", key_table(&keys));
            }
            return Ok(0);
        }
        KeyCmd::Revoke { id } => {
            c.revoke_key(&id).await?;
            return Ok(0);
        }
    };
    let (created, json) = created;
    if json {
        crate::print_json(&created)?;
    } else {
        // The key alone on stdout (for `$(...)`); what it is on stderr.
        println!("{}", created.key);
        eprintln!(
            "key {} of tenant {} ({}); it is shown this once",
            created.info.id,
            created.info.tenant,
            created.info.scope.as_str()
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_states_read_in_the_table() {
        let k = |revoked: Option<&str>, expires: Option<&str>| ApiKey {
            id: "abcdefghijklmnop".into(),
            tenant: "team-a".into(),
            scope: KeyScope::ReadOnly,
            name: "ci".into(),
            rate_per_sec: None,
            created_at: "2026-12-03T00:00:00Z".into(),
            expires_at: expires.map(String::from),
            revoked_at: revoked.map(String::from),
        };
        let t = key_table(&[
            k(None, None),
            k(None, Some("2026-12-04T00:00:00Z")),
            k(Some("2026-12-03T01:00:00Z"), None),
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ID"));
        assert!(lines[1].ends_with("live") && lines[1].contains("read-only"));
        assert!(lines[2].ends_with("expires 2026-12-04T00:00:00Z"));
        assert!(lines[3].ends_with("revoked 2026-12-03T01:00:00Z"));
    }
}
