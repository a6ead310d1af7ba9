//! The cluster's membership (issue 14, decision 0033): one-time join tokens, the nodes that
//! joined with them, their heartbeats, and the `space.node.v1.Control` service that nodes
//! call on the control plane's cluster listener.
//!
//! A node joins with a token from `space node token`: it checks the cluster CA against the
//! token's hash, sends the public half of its key and gets a certificate naming it
//! (`<id>.nodes.space.internal`). From then on it speaks mTLS only: the control plane calls
//! its node service as `control.space.internal`, and the node's calls here are recognized by
//! the fingerprint of the certificate it was issued. `space node rm` deletes the node's row,
//! so that certificate is no longer accepted.
//!
//! The engine drives the joined nodes through [`crate::cluster_nodes::ClusterNodes`].

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use space_node_api::NodeInfo;
use space_node_api::net::SecretSource;
use space_proto::node::control_server::{Control, ControlServer};
use space_proto::node::{
    CaReply, CaRequest, HeartbeatReply, HeartbeatRequest, JoinReply, JoinRequest, SecretReply,
    SecretRequest,
};
use space_rpc::join::Token;
use space_rpc::tls::{ClusterTls, PeerCert};
use sqlx::Row;
use tonic::{Request, Response, Status};

use crate::auth::to_hex;
use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError, now_ms};

/// A token's lifetime unless asked otherwise, and the longest one may have.
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);
pub const TOKEN_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// How often a node reports, and how long without a report makes it unreachable.
/// Where a control plane keeps the cluster CA (`ca.key`, `ca.pem`), in its data dir.
pub const CA_DIR: &str = "cluster-ca";
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(20);

/// A node that joined, as the store holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    pub id: String,
    pub name: String,
    pub address: String,
    pub cert_sha256: String,
    pub joined_at: i64,
    pub heartbeat_at: i64,
    /// Its last heartbeat's `NodeInfo`.
    pub info: Option<NodeInfo>,
    /// Being drained: nothing new is placed on it (`space node drain`).
    pub draining: bool,
}

impl NodeRow {
    /// Whether it reported within [`UNREACHABLE_AFTER`] of `now`.
    pub fn reachable(&self, now: i64) -> bool {
        now - self.heartbeat_at < UNREACHABLE_AFTER.as_millis() as i64
    }

    /// Whether it has been silent for `lost_after` (spaced control's `--node-lost-after`):
    /// lost, so its sandboxes are restored elsewhere from their replicas, or marked lost
    /// (decision 0037).
    pub fn lost(&self, now: i64, lost_after: Duration) -> bool {
        !self.reachable(now) && now - self.heartbeat_at >= lost_after.as_millis() as i64
    }
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &sqlx::any::AnyRow) -> Result<NodeRow, StoreError> {
    let get = |e: sqlx::Error| StoreError::Query {
        what: "decode node",
        source: e,
    };
    let info: Option<String> = r.try_get("info").map_err(get)?;
    Ok(NodeRow {
        id: r.try_get("id").map_err(get)?,
        name: r.try_get("name").map_err(get)?,
        address: r.try_get("address").map_err(get)?,
        cert_sha256: r.try_get("cert_sha256").map_err(get)?,
        joined_at: r.try_get("joined_at").map_err(get)?,
        heartbeat_at: r.try_get("heartbeat_at").map_err(get)?,
        info: info.and_then(|i| serde_json::from_str(&i).ok()),
        draining: r.try_get::<i64, _>("draining").map_err(get)? != 0,
    })
}

const NODE_COLUMNS: &str = "id, name, address, cert_sha256, joined_at, heartbeat_at, info";

async fn insert_node<'e>(
    db: impl sqlx::Executor<'e, Database = sqlx::Any>,
    node: &NodeRow,
) -> Result<(), StoreError> {
    let info = node
        .info
        .as_ref()
        .map(|i| serde_json::to_string(i).unwrap_or_default());
    sqlx::query(&format!(
        "INSERT INTO cluster_nodes ({NODE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
    ))
    .bind(&node.id)
    .bind(&node.name)
    .bind(&node.address)
    .bind(&node.cert_sha256)
    .bind(node.joined_at)
    .bind(node.heartbeat_at)
    .bind(info)
    .execute(db)
    .await
    .map_err(q("record node"))?;
    Ok(())
}

impl Store {
    pub async fn put_join_token(
        &self,
        id: &str,
        secret_sha256: &str,
        expires_at: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO join_tokens (id, secret_sha256, created_at, expires_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(secret_sha256)
        .bind(now_ms())
        .bind(expires_at)
        .execute(self.pool())
        .await
        .map_err(q("put join token"))?;
        Ok(())
    }

    /// Whether token `id` with this secret could be used now (a read: the use itself is
    /// [`Self::join_with_token`]'s, atomic).
    pub async fn join_token_usable(
        &self,
        id: &str,
        secret_sha256: &str,
    ) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT id FROM join_tokens \
             WHERE id = $1 AND secret_sha256 = $2 AND used_at IS NULL AND expires_at > $3",
        )
        .bind(id)
        .bind(secret_sha256)
        .bind(now_ms())
        .fetch_optional(self.pool())
        .await
        .map_err(q("check join token"))?;
        Ok(row.is_some())
    }

    /// Uses token `id` for `node` and records the node, in one transaction: false (and
    /// nothing recorded) when the token is unknown, used, expired or its secret differs.
    pub async fn join_with_token(
        &self,
        id: &str,
        secret_sha256: &str,
        node: &NodeRow,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool().begin().await.map_err(q("join"))?;
        let used = sqlx::query(
            "UPDATE join_tokens SET used_at = $1, node_id = $2 \
             WHERE id = $3 AND secret_sha256 = $4 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(node.joined_at)
        .bind(&node.id)
        .bind(id)
        .bind(secret_sha256)
        .execute(&mut *tx)
        .await
        .map_err(q("use join token"))?;
        if used.rows_affected() != 1 {
            return Ok(false);
        }
        insert_node(&mut *tx, node).await?;
        tx.commit().await.map_err(q("join"))?;
        Ok(true)
    }

    /// Records a node as if it had joined (simulated nodes of the scheduler's tests and
    /// benchmarks; a real node joins with a token).
    pub async fn put_cluster_node(&self, node: &NodeRow) -> Result<(), StoreError> {
        insert_node(self.pool(), node).await
    }

    pub async fn list_cluster_nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {NODE_COLUMNS}, draining FROM cluster_nodes ORDER BY joined_at, id"
        ))
        .fetch_all(self.pool())
        .await
        .map_err(q("list nodes"))?;
        rows.iter().map(decode).collect()
    }

    pub async fn cluster_node_by_cert(&self, sha256: &str) -> Result<Option<NodeRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {NODE_COLUMNS}, draining FROM cluster_nodes WHERE cert_sha256 = $1"
        ))
        .bind(sha256)
        .fetch_optional(self.pool())
        .await
        .map_err(q("find node"))?;
        row.as_ref().map(decode).transpose()
    }

    pub async fn node_heartbeat(&self, id: &str, info: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE cluster_nodes SET heartbeat_at = $1, info = $2 WHERE id = $3")
            .bind(now_ms())
            .bind(info)
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("node heartbeat"))?;
        Ok(())
    }

    /// Forgets node `id` (its certificate is refused from now on); false if unknown.
    pub async fn remove_cluster_node(&self, id: &str) -> Result<bool, StoreError> {
        let r = sqlx::query("DELETE FROM cluster_nodes WHERE id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("remove node"))?;
        Ok(r.rows_affected() == 1)
    }

    /// Marks node `id` drained (nothing new is placed on it) or not; false if unknown.
    pub async fn set_node_draining(&self, id: &str, draining: bool) -> Result<bool, StoreError> {
        let r = sqlx::query("UPDATE cluster_nodes SET draining = $2 WHERE id = $1")
            .bind(id)
            .bind(i64::from(draining))
            .execute(self.pool())
            .await
            .map_err(q("mark node draining"))?;
        Ok(r.rows_affected() == 1)
    }
}

fn sha256_hex(s: &str) -> String {
    to_hex(&Sha256::digest(s.as_bytes()))
}

/// The control plane's side of the cluster: its CA, its own identity, and the node it drives.
pub struct Cluster {
    pub ca: Arc<space_ca::Ca>,
    /// The CA certificate's fingerprint (what tokens pin).
    pub ca_sha256: String,
    /// The control plane's identity (`control.space.internal`), made at this start.
    pub tls: ClusterTls,
    /// Where nodes reach this control plane (`--cluster-listen`, as printed in join commands).
    pub listen: String,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

/// Why the engine has no node yet.
pub const NO_NODE: &str = "no node has joined this control plane (`space node token`)";

impl Cluster {
    /// The cluster CA in `dir` (made on first use) and a fresh identity for this start.
    pub fn open(dir: &std::path::Path, listen: String) -> Result<Self, String> {
        let ca = space_ca::Ca::load_or_create_as(dir, &space_ca::CaProfile::cluster())
            .map_err(|e| crate::error_chain(&e))?;
        let identity = ca
            .new_identity(space_ca::CONTROL_NAME)
            .map_err(|e| crate::error_chain(&e))?;
        let tls = ClusterTls::from_pem(ca.cert_pem(), &identity.cert_pem, &identity.key_pem)?;
        Ok(Self {
            ca_sha256: space_ca::fingerprint(ca.cert_der()),
            ca: Arc::new(ca),
            tls,
            listen,
        })
    }
}

/// `POST /v1/nodes/tokens` and `DELETE /v1/nodes/{id}`, and the nodes the API lists.
impl crate::engine::Engine {
    fn cluster(&self) -> ControlResult<&Arc<Cluster>> {
        self.cluster.as_ref().ok_or_else(|| {
            ControlError::conflict(
                "this spaced drives one node of its own (in-process, or --node); nodes join a `spaced control` started without --node",
            )
        })
    }

    /// A one-time join token, valid `ttl`.
    pub async fn create_join_token(&self, ttl: Duration) -> ControlResult<space_api::JoinToken> {
        let cluster = self.cluster()?;
        if ttl.is_zero() || ttl > TOKEN_TTL_MAX {
            return Err(ControlError::invalid(format!(
                "ttl_secs must be 1 to {}",
                TOKEN_TTL_MAX.as_secs()
            )));
        }
        let token = Token::new(&cluster.ca_sha256);
        let expires_at = now_ms() + ttl.as_millis() as i64;
        self.store
            .put_join_token(&token.id, &sha256_hex(&token.secret), expires_at)
            .await?;
        let token_text = token.to_string();
        Ok(space_api::JoinToken {
            join_command: format!(
                "spaced node --control {} --join-token {token_text} --listen 0.0.0.0:7071 --advertise ADDRESS:7071",
                cluster.listen
            ),
            token: token_text,
            expires_at: space_api::rfc3339_from_unix_ms(expires_at),
        })
    }

    /// Removes node `id` from the cluster: its certificate is refused from now on, and the
    /// engine stops driving it (its sandboxes stay in the store, unseen).
    pub async fn remove_node(&self, id: &str) -> ControlResult<()> {
        self.cluster()?;
        if !self.store.remove_cluster_node(id).await? {
            return Err(ControlError::not_found(format!("node {id} not found")));
        }
        // This replica stops at once; the others at their next reconcile pass.
        if let Some(nodes) = &self.cluster_nodes {
            nodes.refresh().await?;
        }
        tracing::info!(node = id, "node removed from the cluster");
        Ok(())
    }

    /// Starts (or with `draining` false, ends) a drain of node `id`: nothing new is placed
    /// on it. Answers the sandboxes still on it.
    pub async fn drain_node(&self, id: &str, draining: bool) -> ControlResult<space_api::Drain> {
        self.cluster()?;
        if !self.store.set_node_draining(id, draining).await? {
            return Err(ControlError::not_found(format!("node {id} not found")));
        }
        if let Some(nodes) = &self.cluster_nodes {
            nodes.refresh().await?;
        }
        tracing::info!(node = id, draining, "node drain");
        Ok(space_api::Drain {
            node_id: id.to_owned(),
            draining,
            sandboxes: self.store.sandboxes_on(id).await?,
        })
    }

    pub(crate) async fn joined_nodes(&self) -> ControlResult<Vec<NodeRow>> {
        Ok(self.store.list_cluster_nodes().await?)
    }
}

/// The `space.node.v1.Control` service on the cluster listener.
pub struct ControlService {
    store: Store,
    cluster: Arc<Cluster>,
    secrets: Arc<dyn SecretSource>,
}

impl ControlService {
    pub fn new(store: Store, cluster: Arc<Cluster>, secrets: Arc<dyn SecretSource>) -> Self {
        Self {
            store,
            cluster,
            secrets,
        }
    }

    /// The cluster listener's whole service, for axum (with `ConnectInfo<PeerCert>`).
    pub fn router(self) -> axum::Router {
        tonic::service::Routes::new(ControlServer::new(self)).into_axum_router()
    }

    /// The joined node whose certificate the call came with.
    async fn caller<T>(&self, req: &Request<T>) -> Result<NodeRow, Status> {
        let fp = req
            .extensions()
            .get::<axum::extract::ConnectInfo<PeerCert>>()
            .and_then(|c| c.0.0.clone())
            .ok_or_else(|| Status::unauthenticated("a node's certificate is needed"))?;
        self.store
            .cluster_node_by_cert(&fp)
            .await
            .map_err(|e| Status::unavailable(crate::error_chain(&e)))?
            .ok_or_else(|| {
                Status::permission_denied("this certificate's node is not in the cluster")
            })
    }
}

fn valid_address(a: &str) -> bool {
    match a.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && host.len() <= 253
                && port.parse::<u16>().is_ok_and(|p| p != 0)
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b))
        }
        None => false,
    }
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn ca(&self, _: Request<CaRequest>) -> Result<Response<CaReply>, Status> {
        Ok(Response::new(CaReply {
            ca_pem: self.cluster.ca.cert_pem().to_owned(),
        }))
    }

    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let JoinRequest {
            token,
            name,
            address,
            public_key,
        } = req.into_inner();
        // One message for every bad token: which part was wrong is not for the caller.
        let refused = || Status::unauthenticated("invalid, used or expired join token");
        let token = Token::parse(&token).ok_or_else(refused)?;
        if token.ca_sha256 != self.cluster.ca_sha256 {
            return Err(refused());
        }
        if !valid_address(&address) {
            return Err(Status::invalid_argument(format!(
                "address {address:?} is not HOST:PORT"
            )));
        }
        let name: String = name.chars().filter(|c| !c.is_control()).take(253).collect();
        if public_key.len() != 65 || public_key[0] != 4 {
            return Err(Status::invalid_argument(
                "public_key must be an uncompressed ECDSA P-256 point (65 bytes)",
            ));
        }
        // Nothing is signed for a token that cannot join.
        let usable = self
            .store
            .join_token_usable(&token.id, &sha256_hex(&token.secret))
            .await
            .map_err(|e| Status::unavailable(crate::error_chain(&e)))?;
        if !usable {
            return Err(refused());
        }
        let id = space_rpc::join::random_id(12);
        let cert_pem = self
            .cluster
            .ca
            .issue_identity(&space_ca::node_name(&id), &space_ca::RawP256(public_key))
            .map_err(|e| Status::invalid_argument(crate::error_chain(&e)))?;
        let der = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| Status::internal("issued an unreadable certificate"))?;
        let now = now_ms();
        let row = NodeRow {
            id: id.clone(),
            name,
            address,
            cert_sha256: space_ca::fingerprint(&der),
            joined_at: now,
            heartbeat_at: now,
            info: None,
            draining: false,
        };
        let joined = self
            .store
            .join_with_token(&token.id, &sha256_hex(&token.secret), &row)
            .await
            .map_err(|e| Status::unavailable(crate::error_chain(&e)))?;
        if !joined {
            return Err(refused());
        }
        tracing::info!(node = %row.id, name = %row.name, address = %row.address, "node joined");
        Ok(Response::new(JoinReply {
            node_id: id,
            certificate_pem: cert_pem,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let node = self.caller(&req).await?;
        let info = String::from_utf8(req.into_inner().info)
            .ok()
            .filter(|i| i.len() <= 64 << 10 && serde_json::from_str::<NodeInfo>(i).is_ok())
            .ok_or_else(|| Status::invalid_argument("info is not a node's NodeInfo"))?;
        self.store
            .node_heartbeat(&node.id, &info)
            .await
            .map_err(|e| Status::unavailable(crate::error_chain(&e)))?;
        Ok(Response::new(HeartbeatReply {}))
    }

    async fn secret_value(
        &self,
        req: Request<SecretRequest>,
    ) -> Result<Response<SecretReply>, Status> {
        self.caller(&req).await?;
        let value = self.secrets.secret_value(&req.into_inner().name).await;
        Ok(Response::new(SecretReply { value }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_and_port() {
        for ok in ["10.0.0.2:7071", "node-1.example.com:7071", "[fd00::1]:7071"] {
            assert!(valid_address(ok), "{ok}");
        }
        for bad in ["10.0.0.2", ":7071", "h:0", "h:99999", "h /x:1", "h:port"] {
            assert!(!valid_address(bad), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_token_joins_once_before_it_expires() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let node = |id: &str, fp: &str| NodeRow {
            id: id.into(),
            name: "n".into(),
            address: "10.0.0.2:7071".into(),
            cert_sha256: fp.into(),
            joined_at: now_ms(),
            heartbeat_at: now_ms(),
            info: None,
            draining: false,
        };
        store
            .put_join_token("t1", &sha256_hex("s"), now_ms() + 60_000)
            .await
            .unwrap();
        store
            .put_join_token("t2", &sha256_hex("s"), now_ms() - 1)
            .await
            .unwrap();
        assert!(
            store
                .join_token_usable("t1", &sha256_hex("s"))
                .await
                .unwrap()
        );
        assert!(
            !store
                .join_token_usable("t1", &sha256_hex("x"))
                .await
                .unwrap()
        );
        assert!(
            !store
                .join_token_usable("t2", &sha256_hex("s"))
                .await
                .unwrap()
        );
        assert!(
            !store
                .join_with_token("t1", &sha256_hex("wrong"), &node("a", "fa"))
                .await
                .unwrap()
        );
        assert!(
            !store
                .join_with_token("t2", &sha256_hex("s"), &node("a", "fa"))
                .await
                .unwrap(),
            "an expired token joined"
        );
        assert!(
            store
                .join_with_token("t1", &sha256_hex("s"), &node("a", "fa"))
                .await
                .unwrap()
        );
        assert!(
            !store
                .join_with_token("t1", &sha256_hex("s"), &node("b", "fb"))
                .await
                .unwrap(),
            "a used token joined again"
        );
        assert!(
            !store
                .join_token_usable("t1", &sha256_hex("s"))
                .await
                .unwrap()
        );
        let nodes = store.list_cluster_nodes().await.unwrap();
        assert_eq!(
            nodes.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        assert_eq!(
            store.cluster_node_by_cert("fa").await.unwrap().unwrap().id,
            "a"
        );
        assert!(store.cluster_node_by_cert("fb").await.unwrap().is_none());
        store.node_heartbeat("a", "{}").await.unwrap();
        assert!(store.remove_cluster_node("a").await.unwrap());
        assert!(!store.remove_cluster_node("a").await.unwrap());
        assert!(store.cluster_node_by_cert("fa").await.unwrap().is_none());
    }
}

#[cfg(test)]
mod service_tests {
    use super::*;
    use axum::extract::ConnectInfo;

    struct Values;

    #[async_trait::async_trait]
    impl SecretSource for Values {
        async fn secret_value(&self, name: &str) -> Option<String> {
            (name == "GH").then(|| "ghp_value".to_owned())
        }
    }

    fn from(fp: Option<&str>) -> ConnectInfo<PeerCert> {
        ConnectInfo(PeerCert(fp.map(str::to_owned)))
    }

    fn with_peer<T>(msg: T, peer: Option<&str>) -> Request<T> {
        let mut req = Request::new(msg);
        req.extensions_mut().insert(from(peer));
        req
    }

    #[tokio::test]
    async fn only_a_member_gets_secrets_and_reports() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let cluster = Arc::new(Cluster::open(&dir.path().join("ca"), "h:7443".into()).unwrap());
        let svc = ControlService::new(store.clone(), cluster, Arc::new(Values));
        store
            .put_cluster_node(&NodeRow {
                id: "n1".into(),
                name: "n".into(),
                address: "10.0.0.2:7071".into(),
                cert_sha256: "f1".into(),
                joined_at: 1,
                heartbeat_at: 1,
                info: None,
                draining: false,
            })
            .await
            .unwrap();
        let ask = |peer| with_peer(SecretRequest { name: "GH".into() }, peer);
        let e = svc.secret_value(ask(None)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc.secret_value(ask(Some("f2"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let v = svc.secret_value(ask(Some("f1"))).await.unwrap();
        assert_eq!(v.into_inner().value.as_deref(), Some("ghp_value"));
        let missing = with_peer(
            SecretRequest {
                name: "NOPE".into(),
            },
            Some("f1"),
        );
        assert_eq!(
            svc.secret_value(missing).await.unwrap().into_inner().value,
            None
        );

        // Heartbeats: a member's NodeInfo is kept; junk and strangers are refused.
        let info = serde_json::to_vec(&NodeInfo {
            cpus: 4,
            ..NodeInfo::default()
        })
        .unwrap();
        let beat = |info: Vec<u8>, peer| with_peer(HeartbeatRequest { info }, peer);
        svc.heartbeat(beat(info.clone(), Some("f1"))).await.unwrap();
        let n = store.cluster_node_by_cert("f1").await.unwrap().unwrap();
        assert_eq!(n.info.unwrap().cpus, 4);
        assert!(n.heartbeat_at > 1);
        let e = svc
            .heartbeat(beat(b"{".to_vec(), Some("f1")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = svc.heartbeat(beat(info, Some("f9"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        // Removed: refused from then on.
        assert!(store.remove_cluster_node("n1").await.unwrap());
        let e = svc.secret_value(ask(Some("f1"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    #[tokio::test]
    async fn joins_check_the_token_the_address_and_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let cluster = Arc::new(Cluster::open(&dir.path().join("ca"), "h:7443".into()).unwrap());
        let svc = ControlService::new(store.clone(), cluster.clone(), Arc::new(Values));
        let token = Token::new(&cluster.ca_sha256);
        store
            .put_join_token(&token.id, &sha256_hex(&token.secret), now_ms() + 60_000)
            .await
            .unwrap();
        let (_, public) = space_ca::new_member_key().unwrap();
        let join = |token: String, address: &str, key: Vec<u8>| {
            Request::new(JoinRequest {
                token,
                name: "n\u{7}ode".into(),
                address: address.into(),
                public_key: key,
            })
        };
        let good = token.to_string();
        let e = svc
            .join(join(good.clone(), "no-port", public.0.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = svc
            .join(join(good.clone(), "10.0.0.2:7071", vec![4; 10]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let other_ca = Token::new(&"0".repeat(64)).to_string();
        let e = svc
            .join(join(other_ca, "10.0.0.2:7071", public.0.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        // None of those spent the token.
        let r = svc
            .join(join(good.clone(), "10.0.0.2:7071", public.0.clone()))
            .await
            .unwrap()
            .into_inner();
        assert!(r.certificate_pem.contains("BEGIN CERTIFICATE"));
        let n = &store.list_cluster_nodes().await.unwrap()[0];
        assert_eq!(
            (n.id.as_str(), n.name.as_str()),
            (r.node_id.as_str(), "node")
        );
        let e = svc
            .join(join(good, "10.0.0.3:7071", public.0))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
    }
}
