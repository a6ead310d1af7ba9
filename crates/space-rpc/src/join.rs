//! A node's side of the cluster (decision 0033): joining with a one-time token, and its calls
//! to the control plane afterwards (heartbeats, secret values) over mTLS.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::Rng;
use space_node_api::NodeApi;
use space_proto::node::control_client::ControlClient;
use space_proto::node::{CaRequest, HeartbeatRequest, JoinRequest, SecretRequest};
use tonic::transport::Channel;

use crate::tls::{self, ClusterTls};
use crate::wire;

/// Join tokens start with this (and a version).
pub const TOKEN_PREFIX: &str = "sj1";

const LOWER: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// `n` random characters of [a-z0-9] (node and token ids).
pub fn random_id(n: usize) -> String {
    random(LOWER, n)
}

fn random(alphabet: &[u8], n: usize) -> String {
    let mut rng = rand::rng();
    (0..n)
        .map(|_| alphabet[rng.random_range(0..alphabet.len())] as char)
        .collect()
}

/// A join token's parts: `sj1.<id>.<secret>.<sha256 of the cluster CA>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub id: String,
    pub secret: String,
    pub ca_sha256: String,
}

impl Token {
    pub fn new(ca_sha256: &str) -> Self {
        Self {
            id: random(LOWER, 10),
            secret: random(BASE62, 32),
            ca_sha256: ca_sha256.to_owned(),
        }
    }

    pub fn parse(s: &str) -> Option<Token> {
        let mut parts = s.trim().split('.');
        let (prefix, id, secret, ca) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let ok = prefix == TOKEN_PREFIX
            && parts.next().is_none()
            && id.len() == 10
            && id.bytes().all(|b| LOWER.contains(&b))
            && secret.len() == 32
            && secret.bytes().all(|b| BASE62.contains(&b))
            && ca.len() == 64
            && ca
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
        ok.then(|| Token {
            id: id.into(),
            secret: secret.into(),
            ca_sha256: ca.into(),
        })
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{TOKEN_PREFIX}.{}.{}.{}",
            self.id, self.secret, self.ca_sha256
        )
    }
}

/// What a node keeps of its membership, in `<data dir>/cluster/` (the key 0600, the
/// directory 0700): which control plane, its own id, certificate and key, and the cluster
/// CA's certificate. A node with these starts without a token.
#[derive(Debug, Clone)]
pub struct Membership {
    pub node_id: String,
    /// The control plane's cluster listener (HOST:PORT).
    pub control: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

const FILES: [&str; 5] = ["node_id", "control", "ca.pem", "cert.pem", "key.pem"];

impl Membership {
    pub fn dir(data_dir: &Path) -> PathBuf {
        data_dir.join("cluster")
    }

    /// The membership kept in `dir`, if the node joined (every file there).
    pub fn load(dir: &Path) -> Result<Option<Membership>, String> {
        if !dir.join("node_id").exists() {
            return Ok(None);
        }
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .map(|s| s.trim_end().to_owned())
                .map_err(|e| format!("cannot read {}: {e}", dir.join(f).display()))
        };
        Ok(Some(Membership {
            node_id: read(FILES[0])?,
            control: read(FILES[1])?,
            ca_pem: read(FILES[2])?,
            cert_pem: read(FILES[3])?,
            key_pem: read(FILES[4])?,
        }))
    }

    /// Writes it to `dir` (each file whole: written aside, then renamed).
    pub fn save(&self, dir: &Path) -> Result<(), String> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let err =
            |what: &str, p: &Path, e: std::io::Error| format!("cannot {what} {}: {e}", p.display());
        std::fs::create_dir_all(dir).map_err(|e| err("create", dir, e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| err("restrict", dir, e))?;
        let values = [
            &self.node_id,
            &self.control,
            &self.ca_pem,
            &self.cert_pem,
            &self.key_pem,
        ];
        // node_id last: its presence says the rest is there.
        for (f, v) in FILES.iter().zip(values).rev() {
            let path = dir.join(f);
            let tmp = dir.join(format!(".{f}.tmp"));
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| err("create", &tmp, e))?;
            file.write_all(v.as_bytes())
                .and_then(|_| file.write_all(b"\n"))
                .and_then(|_| file.sync_all())
                .map_err(|e| err("write", &tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| err("rename into", &path, e))?;
        }
        Ok(())
    }

    pub fn tls(&self) -> Result<ClusterTls, String> {
        ClusterTls::from_pem(&self.ca_pem, &self.cert_pem, &self.key_pem)
    }

    /// A client of the control plane's `Control` service, over mTLS as this node.
    pub fn control_client(&self) -> Result<ControlClient<Channel>, String> {
        let config = tls::client_config(&self.tls()?)?;
        let channel = tls::tls_channel(&self.control, space_ca::CONTROL_NAME, config)?;
        Ok(ControlClient::new(channel))
    }
}

/// Joins the control plane at `control` (HOST:PORT) with `token`: fetches the cluster CA and
/// checks it against the token's hash, makes this node's key, and gets its certificate.
/// `address` is where the control plane will reach this node's service.
pub async fn join(
    control: &str,
    token: &str,
    name: &str,
    address: &str,
) -> Result<Membership, String> {
    let parsed = Token::parse(token)
        .ok_or("the join token is not one `space node token` printed (sj1.ID.SECRET.CAHASH)")?;
    // The CA over TLS that proves nothing yet: what it is, the token's hash decides.
    let ca_pem = {
        let channel = tls::tls_channel(control, space_ca::CONTROL_NAME, tls::any_server_config())?;
        ControlClient::new(channel)
            .ca(CaRequest {})
            .await
            .map_err(|s| {
                format!(
                    "cannot reach the control plane at {control}: {}",
                    wire::status_text(&s)
                )
            })?
            .into_inner()
            .ca_pem
    };
    let der = rustls_pemfile::certs(&mut ca_pem.as_bytes())
        .next()
        .and_then(Result::ok)
        .ok_or("the control plane sent no CA certificate")?;
    if space_ca::fingerprint(&der) != parsed.ca_sha256 {
        return Err(format!(
            "the control plane at {control} is not the one that made this token (its CA's hash differs)"
        ));
    }
    let (key_pem, public) = space_ca::new_member_key().map_err(|e| e.to_string())?;
    let config = tls::anonymous_client_config(&ca_pem)?;
    let channel = tls::tls_channel(control, space_ca::CONTROL_NAME, config)?;
    let reply = ControlClient::new(channel)
        .join(JoinRequest {
            token: token.trim().to_owned(),
            name: name.to_owned(),
            address: address.to_owned(),
            public_key: public.0,
        })
        .await
        .map_err(|s| {
            format!(
                "the control plane refused the join: {}",
                wire::status_text(&s)
            )
        })?
        .into_inner();
    Ok(Membership {
        node_id: reply.node_id,
        control: control.to_owned(),
        ca_pem,
        cert_pem: reply.certificate_pem,
        key_pem,
    })
}

/// Reports `node`'s [`NodeApi::node_info`] to the control plane every `every`, until the task
/// is dropped. A failed report is logged when it starts failing and when it recovers, not at
/// every try.
pub async fn heartbeats(
    mut client: ControlClient<Channel>,
    every: Duration,
    node: std::sync::Arc<dyn NodeApi>,
) {
    let mut failing = false;
    loop {
        let info = node.node_info().await.unwrap_or_default();
        let body = serde_json::to_vec(&info).unwrap_or_default();
        let sent =
            tokio::time::timeout(every, client.heartbeat(HeartbeatRequest { info: body })).await;
        match sent {
            Ok(Ok(_)) if failing => {
                tracing::info!("heartbeats reach the control plane again");
                failing = false;
            }
            Ok(Ok(_)) => {}
            Ok(Err(s)) if !failing => {
                tracing::warn!(error = %wire::status_text(&s), "heartbeat refused or lost; the node keeps its sandboxes running");
                failing = true;
            }
            Err(_) if !failing => {
                tracing::warn!("heartbeat timed out; the node keeps its sandboxes running");
                failing = true;
            }
            _ => {}
        }
        tokio::time::sleep(every).await;
    }
}

/// Secret values from the control plane's store, asked when the egress proxy needs one.
#[derive(Debug, Clone)]
pub struct ControlSecrets(pub ControlClient<Channel>);

#[async_trait::async_trait]
impl space_node_api::net::SecretSource for ControlSecrets {
    async fn secret_value(&self, name: &str) -> Option<String> {
        let req = SecretRequest {
            name: name.to_owned(),
        };
        match tokio::time::timeout(Duration::from_secs(5), self.0.clone().secret_value(req)).await {
            Ok(Ok(r)) => r.into_inner().value,
            Ok(Err(s)) => {
                tracing::warn!(secret = name, error = %wire::status_text(&s), "no secret value from the control plane");
                None
            }
            Err(_) => {
                tracing::warn!(
                    secret = name,
                    "the control plane did not answer for a secret value"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_junk_is_refused() {
        let t = Token::new(&"ab".repeat(32));
        let s = t.to_string();
        assert!(s.starts_with("sj1."), "{s}");
        assert_eq!(Token::parse(&s), Some(t.clone()));
        assert_eq!(Token::parse(&format!("  {s}\n")), Some(t));
        for bad in [
            "",
            "sj1",
            &("sj2.aaaaaaaaaa.0123456789abcdefghijABCDEFGHIJ0123.".to_owned() + &"a".repeat(64)),
            &s.replace("sj1.", "sj1.X"),
            &format!("{s}.more"),
            &s[..s.len() - 1],
            &s.to_uppercase(),
        ] {
            assert_eq!(Token::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_membership_is_kept_private_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let m = Membership {
            node_id: "abc".into(),
            control: "10.0.0.1:7443".into(),
            ca_pem: "CA".into(),
            cert_pem: "CERT".into(),
            key_pem: "KEY".into(),
        };
        let at = Membership::dir(dir.path());
        assert!(Membership::load(&at).unwrap().is_none());
        m.save(&at).unwrap();
        let back = Membership::load(&at).unwrap().unwrap();
        assert_eq!((back.node_id, back.key_pem), (m.node_id, m.key_pem));
        let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(at.clone()), 0o700);
        assert_eq!(mode(at.join("key.pem")), 0o600);
    }
}
