//! Networking on the control-plane side (decision 0012): a sandbox's egress policy as desired
//! state (in its spec; applied by the node now when it runs, at its next start otherwise),
//! the conversions to the node's types, and port URLs (`POST /v1/sandboxes/{id}/ports`,
//! tokens signed with `<data_dir>/ports.key`; the proxy itself is in `port_proxy`).

use ring::hmac;
use space_api::{
    Egress, NetworkPolicy, PortInfo, Sandbox, SandboxNetwork, SandboxState, is_valid_sandbox_id,
};
use space_node_api::SandboxStatus;
use space_node_api::net::{NetworkSpec, NetworkStatus, SecretBinding};

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};
use crate::reconcile::Step;
use crate::store::{NetworkRecord, SandboxRow, SecretBindingRecord};

/// Hex digits of the HMAC kept in a port token.
const TOKEN_MAC_HEX: usize = 32;

pub fn egress_to_node(e: Egress) -> space_node_api::net::Egress {
    match e {
        Egress::None => space_node_api::net::Egress::None,
        Egress::Allowlist => space_node_api::net::Egress::Allowlist,
        Egress::Open => space_node_api::net::Egress::Open,
    }
}

pub fn egress_from_node(e: space_node_api::net::Egress) -> Egress {
    match e {
        space_node_api::net::Egress::None => Egress::None,
        space_node_api::net::Egress::Allowlist => Egress::Allowlist,
        space_node_api::net::Egress::Open => Egress::Open,
    }
}

pub fn node_network(rec: &NetworkRecord) -> NetworkSpec {
    NetworkSpec {
        egress: egress_to_node(rec.egress),
        allow: rec.allow.clone(),
    }
}

pub fn node_bindings(recs: &[SecretBindingRecord]) -> Vec<SecretBinding> {
    recs.iter()
        .map(|b| SecretBinding {
            name: b.name.clone(),
            placeholder: b.placeholder.clone(),
            hosts: b.hosts.clone(),
            header: b.header.clone(),
            inject: b.inject,
            secret: b
                .tenant
                .as_deref()
                .map(|t| crate::secrets::vault_key(t, &b.name))
                .unwrap_or_default(),
        })
        .collect()
}

/// The policy a request asks for, with defaults: no `egress` means `allowlist` when rules
/// are given, else `default`. Every rule is checked (400 naming the bad one).
pub fn resolve_policy(req: &NetworkPolicy, default: Egress) -> ControlResult<NetworkRecord> {
    let egress = req.egress.unwrap_or(if req.allow.is_empty() {
        default
    } else {
        Egress::Allowlist
    });
    let rec = NetworkRecord {
        egress,
        allow: req.allow.iter().map(|r| r.trim().to_string()).collect(),
    };
    space_node_api::policy::Policy::new(&node_network(&rec), &[])
        .map_err(|e| ControlError::invalid(e.to_string()))?;
    Ok(rec)
}

/// `Sandbox.network`: the desired policy, plus the address when the node reports one.
pub fn network_dto(rec: &NetworkRecord, status: Option<&NetworkStatus>) -> SandboxNetwork {
    SandboxNetwork {
        egress: rec.egress,
        allow: rec.allow.clone(),
        address: status.map(|s| s.address.to_string()),
        gateway: status.map(|s| s.gateway.to_string()),
    }
}

/// A short event detail of a policy (rules, never secrets).
pub fn policy_detail(rec: &NetworkRecord) -> String {
    if rec.allow.is_empty() {
        format!("egress={}", rec.egress)
    } else {
        format!("egress={} allow={}", rec.egress, rec.allow.join(","))
    }
}

/// Whether the node applies a different policy than the row wants (only for sandboxes
/// that run or are paused, and only when the node reports a network at all).
pub fn network_drifted(row: &SandboxRow, observed: &SandboxStatus) -> bool {
    let Some(net) = &observed.network else {
        return false;
    };
    matches!(row.state, SandboxState::Running | SandboxState::Paused)
        && (egress_from_node(net.egress) != row.spec.network.egress
            || net.allow != row.spec.network.allow)
}

/// Reconcile steps for policies the node does not apply (a failed or missed update).
pub fn network_steps(desired: &[SandboxRow], observed: &[SandboxStatus]) -> Vec<Step> {
    let by_id: std::collections::HashMap<&str, &SandboxStatus> =
        observed.iter().map(|s| (s.id.as_str(), s)).collect();
    desired
        .iter()
        .filter(|r| r.deleted_at.is_none())
        .filter(|r| {
            by_id
                .get(r.id.as_str())
                .is_some_and(|s| network_drifted(r, s))
        })
        .map(|r| Step::SyncNetwork { id: r.id.clone() })
        .collect()
}

// ---------------------------------------------------------------- port tokens

/// Signs and checks port tokens: `<id>.<port>.<first 32 hex digits of
/// HMAC-SHA256(key, "id:port")>`.
pub struct PortSigner {
    key: hmac::Key,
}

impl PortSigner {
    pub fn new(key: &[u8]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
        }
    }

    fn mac(&self, id: &str, port: u16) -> String {
        let tag = hmac::sign(&self.key, format!("{id}:{port}").as_bytes());
        tag.as_ref()
            .iter()
            .take(TOKEN_MAC_HEX / 2)
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The envd access token of sandbox `id` (E2B's `envdAccessToken`, decision 0022): the
    /// hex of HMAC-SHA256(key, "envd:<id>"). No port token can equal it: those sign
    /// "<id>:<port>", and an id is 20 characters of [a-z0-9].
    pub fn envd_token(&self, id: &str) -> String {
        self.sandbox_token("envd", id)
    }

    /// Whether `token` is sandbox `id`'s envd access token (compared in constant time).
    pub fn verify_envd_token(&self, id: &str, token: &str) -> bool {
        self.verify_sandbox_token("envd", id, token)
    }

    /// The traffic access token of sandbox `id` (E2B's `trafficAccessToken`): it opens the
    /// sandbox's ports through the E2B address, and nothing else. HMAC of "traffic:<id>".
    pub fn traffic_token(&self, id: &str) -> String {
        self.sandbox_token("traffic", id)
    }

    pub fn verify_traffic_token(&self, id: &str, token: &str) -> bool {
        self.verify_sandbox_token("traffic", id, token)
    }

    fn sandbox_token(&self, purpose: &str, id: &str) -> String {
        crate::auth::to_hex(hmac::sign(&self.key, format!("{purpose}:{id}").as_bytes()).as_ref())
    }

    fn verify_sandbox_token(&self, purpose: &str, id: &str, token: &str) -> bool {
        let Some(tag) = crate::auth::from_hex_bytes(token) else {
            return false;
        };
        hmac::verify(&self.key, format!("{purpose}:{id}").as_bytes(), &tag).is_ok()
    }

    pub fn token(&self, id: &str, port: u16) -> String {
        format!("{id}.{port}.{}", self.mac(id, port))
    }

    /// The sandbox and port of a valid token.
    pub fn verify(&self, token: &str) -> Option<(String, u16)> {
        let mut parts = token.split('.');
        let (id, port, mac) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !is_valid_sandbox_id(id) || mac.len() != TOKEN_MAC_HEX {
            return None;
        }
        // Canonical decimal only ("08080" would be another token for the same port).
        let port_text = port;
        let port: u16 = port_text.parse().ok().filter(|p| *p != 0)?;
        if port.to_string() != port_text {
            return None;
        }
        let want = self.mac(id, port);
        // Constant time over the fixed-length strings.
        let diff = want
            .bytes()
            .zip(mac.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (diff == 0).then(|| (id.to_string(), port))
    }
}

/// Checks a `Host` header value before it goes into a URL: `name[:port]` or `[v6][:port]`.
fn check_host(host: &str) -> ControlResult<()> {
    let ok = !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:[]".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid Host header {host:?}"
        )))
    }
}

// ---------------------------------------------------------------- engine

impl Engine {
    /// `PUT /v1/sandboxes/{id}/network`: stores the new policy and applies it now when the
    /// sandbox runs or is paused (the node cuts connections it no longer allows).
    /// Every attempt is recorded as a `network` event (the rules asked for, and the result).
    pub async fn set_network(&self, id: &str, req: NetworkPolicy) -> ControlResult<Sandbox> {
        if !is_valid_sandbox_id(id) {
            return Err(ControlError::invalid(format!(
                "invalid sandbox id {id:?}: expected 20 characters of [a-z0-9]"
            )));
        }
        let asked = NetworkRecord {
            egress: req.egress.unwrap_or(self.cfg.default_egress),
            allow: req.allow.clone(),
        };
        let result = self.set_network_locked(id, req).await;
        let detail = match &result {
            Ok(rec) => policy_detail(rec),
            Err(_) => policy_detail(&asked),
        };
        let outcome = result.as_ref().map_or_else(|e| e.code(), |_| "ok");
        self.event(id, "network", outcome, &detail);
        result?;
        self.get_sandbox(id).await
    }

    async fn set_network_locked(
        &self,
        id: &str,
        req: NetworkPolicy,
    ) -> ControlResult<NetworkRecord> {
        let rec = resolve_policy(&req, self.cfg.default_egress)?;
        {
            let _guard = self.locks.lock(id).await;
            let row = self
                .store
                .get_sandbox(id)
                .await?
                .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))?;
            if row.state == SandboxState::Deleting || row.deleted_at.is_some() {
                return Err(ControlError::not_found(format!("sandbox {id} not found")));
            }
            let spec = node_network(&rec);
            self.node.validate_network(&spec).await?;
            let mut new_spec = row.spec.clone();
            new_spec.network = rec.clone();
            if !self.store.set_spec(id, &new_spec).await? {
                return Err(ControlError::not_found(format!("sandbox {id} not found")));
            }
            tracing::info!(sandbox = id, egress = %rec.egress, rules = rec.allow.len(), "egress policy set");
            if matches!(row.state, SandboxState::Running | SandboxState::Paused) {
                match self.node.set_network(id, &spec).await {
                    Ok(_) => {}
                    // The node lost it meanwhile: the reconciler explains that.
                    Err(space_node_api::NodeError::NotFound { .. }) => self.wake_reconciler(),
                    Err(e) => {
                        // Stored as desired state; the reconciler retries applying it.
                        self.wake_reconciler();
                        return Err(e.into());
                    }
                }
            }
        }
        Ok(rec)
    }

    /// Re-applies the stored policy on the node (reconciler step).
    pub(crate) async fn ensure_network_synced(&self, row: Option<SandboxRow>) -> ControlResult<()> {
        let Some(row) = row.filter(|r| {
            matches!(r.state, SandboxState::Running | SandboxState::Paused)
                && r.deleted_at.is_none()
        }) else {
            return Ok(());
        };
        match self.node.sandbox_status(&row.id).await? {
            Some(s) if network_drifted(&row, &s) => {}
            _ => return Ok(()),
        }
        self.node
            .set_network(&row.id, &node_network(&row.spec.network))
            .await?;
        self.event(
            &row.id,
            "network_synced",
            "ok",
            &policy_detail(&row.spec.network),
        );
        Ok(())
    }

    /// `POST /v1/sandboxes/{id}/ports`: the URL of `port`, on the host the client used.
    pub async fn open_port(
        &self,
        id: &str,
        port: u32,
        host: Option<&str>,
    ) -> ControlResult<PortInfo> {
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                ControlError::invalid(format!("port must be between 1 and 65535, got {port}"))
            })?;
        if let Some(what) = space_node_api::net::node_port(port) {
            return Err(ControlError::invalid(format!(
                "port {port} in a sandbox's network is {what}, not a sandbox port; serve on \
                 another port"
            )));
        }
        if !is_valid_sandbox_id(id) {
            return Err(ControlError::invalid(format!(
                "invalid sandbox id {id:?}: expected 20 characters of [a-z0-9]"
            )));
        }
        let row = self
            .store
            .get_sandbox(id)
            .await?
            .ok_or_else(|| ControlError::not_found(format!("sandbox {id} not found")))?;
        if row.state == SandboxState::Deleting || row.deleted_at.is_some() {
            return Err(ControlError::not_found(format!("sandbox {id} not found")));
        }
        let host = host.ok_or_else(|| ControlError::invalid("a Host header is required"))?;
        check_host(host)?;
        self.event(id, "port", "ok", &format!("port={port}"));
        Ok(PortInfo {
            port,
            url: format!("http://{host}/p/{}/", self.ports.token(id, port)),
        })
    }
}

// ---------------------------------------------------------------- http

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "abcdefghij0123456789";

    fn pol(egress: Option<Egress>, allow: &[&str]) -> NetworkPolicy {
        NetworkPolicy {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn policies_resolve_defaults_and_name_bad_rules() {
        let r = resolve_policy(&pol(None, &[]), Egress::Open).unwrap();
        assert_eq!(r, NetworkRecord::default());
        let r = resolve_policy(&pol(None, &[]), Egress::None).unwrap();
        assert_eq!(r.egress, Egress::None);
        let r = resolve_policy(&pol(None, &["api.x.com"]), Egress::Open).unwrap();
        assert_eq!(r.egress, Egress::Allowlist);
        let r = resolve_policy(&pol(Some(Egress::Open), &["10.0.0.0/8"]), Egress::None).unwrap();
        assert_eq!((r.egress, r.allow.len()), (Egress::Open, 1));
        for (bad, named) in [
            ("10.0.0.0/33", "10.0.0.0/33"),
            ("300.1.1.1", "300.1.1.1"),
            ("10.0.0.1/8", "10.0.0.1/8"),
            ("foo..com", "foo..com"),
            ("*", "*"),
            ("a.*.com", "a.*.com"),
            ("::1", "::1"),
        ] {
            let e =
                resolve_policy(&pol(Some(Egress::Allowlist), &[bad]), Egress::Open).unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{bad}");
            assert!(e.message.contains(named), "{bad}: {}", e.message);
        }
        let e = resolve_policy(&pol(Some(Egress::None), &["x.com"]), Egress::Open).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
    }

    #[test]
    fn envd_tokens_are_per_sandbox_and_per_key() {
        let s = PortSigner::new(&[1u8; 32]);
        let (a, b) = ("a".repeat(20), "b".repeat(20));
        let t = s.envd_token(&a);
        assert_eq!(t.len(), 64);
        assert!(s.verify_envd_token(&a, &t));
        assert!(!s.verify_envd_token(&b, &t));
        assert!(!s.verify_envd_token(&a, &s.envd_token(&b)));
        assert!(!s.verify_envd_token(&a, &t[..63]));
        assert!(!s.verify_envd_token(&a, ""));
        assert!(!PortSigner::new(&[2u8; 32]).verify_envd_token(&a, &t));
        // Traffic tokens are per sandbox too, and neither kind passes for the other.
        let tr = s.traffic_token(&a);
        assert!(s.verify_traffic_token(&a, &tr));
        assert!(!s.verify_traffic_token(&b, &tr));
        assert!(!s.verify_traffic_token(&a, &t));
        assert!(!s.verify_envd_token(&a, &tr));
    }

    #[test]
    fn port_tokens_verify_only_when_untouched() {
        let s = PortSigner::new(&[1u8; 32]);
        let t = s.token(ID, 8080);
        assert_eq!(t.len(), 20 + 1 + 4 + 1 + 32);
        assert_eq!(s.verify(&t), Some((ID.to_string(), 8080)));
        // Another port, id or key fails; so do malformed tokens.
        let other_port = t.replacen(".8080.", ".8081.", 1);
        assert_eq!(s.verify(&other_port), None);
        let other_id = t.replacen("abcdefghij", "bbcdefghij", 1);
        assert_eq!(s.verify(&other_id), None);
        assert_eq!(PortSigner::new(&[2u8; 32]).verify(&t), None);
        let zero_padded = format!("{ID}.08080.{}", &t[t.len() - 32..]);
        assert_eq!(s.verify(&zero_padded), None);
        for bad in [
            "",
            "x",
            &format!("{ID}.8080"),
            &format!("{t}.x"),
            &t[..t.len() - 1],
            &format!("{ID}.0.{}", "0".repeat(32)),
            &format!("{ID}.70000.{}", "0".repeat(32)),
        ] {
            assert_eq!(s.verify(bad), None, "{bad}");
        }
    }

    #[test]
    fn hosts_for_urls() {
        check_host("127.0.0.1:7070").unwrap();
        check_host("space.example.com").unwrap();
        check_host("[::1]:7070").unwrap();
        assert!(check_host("a/b").is_err());
        assert!(check_host("a b").is_err());
        assert!(check_host("").is_err());
    }
}
