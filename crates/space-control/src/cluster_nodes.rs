//! The nodes of a cluster as one [`NodeApi`] (issue 14, decision 0034): each sandbox's
//! operations go to the node it was placed on (`sandbox_nodes`), new sandboxes are placed by
//! the [`scheduler`](crate::scheduler) with claims made in store transactions, and what every
//! node should have (templates, warm pools) goes to each reachable node.
//!
//! The members are the store's `cluster_nodes` rows, read again at every reconcile pass and
//! placement, so that a node that joined or was removed through another replica is seen
//! here within one pass. A member whose heartbeat lapsed is unreachable: nothing is placed
//! on it, and its sandboxes are reported unseen rather than gone.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use space_node_api::diff::Change;
use space_node_api::net::NetworkSpec;
use space_node_api::{
    GuestChannel, NodeApi, NodeError, NodeInfo, Observation, PoolConfig, PoolStatus, PortStream,
    SandboxSpec, SandboxStatus, SandboxUsage, SnapshotInfo, TemplateInfo, TemplateProgress,
    TemplateSource,
};
use space_rpc::RemoteNode;

use crate::cluster::NodeRow;
use crate::scheduler::{Candidate, Need, Placement};
use crate::store::{Store, StoreError, now_ms};

/// How old the claims the scheduler ranks nodes by may be. This replica's own claims are
/// added to them at once; other replicas' show up within this time. A stale figure only
/// ranks nodes: the claim's transaction checks the node's room against the store, and a
/// claim refused there reads them again.
const CLAIMS_FRESH: Duration = Duration::from_secs(1);

/// What live sandboxes claim on each node: (CPU millis, memory MiB).
type ClaimsByNode = HashMap<String, (u64, u64)>;

/// Tries of a placement whose claim lost a race (each with fresh figures).
pub const PLACE_TRIES: usize = 20;

/// Calls of one create on its node while the node, though unreachable, is not lost (a
/// connection refused or slow to open on a loaded node). Every node operation is idempotent
/// on the sandbox id, so a call that may have reached the node is safe to send again.
const CREATE_CALLS: usize = 4;

/// The pause before the second call of [`CREATE_CALLS`], doubled before each next one: a
/// node slow to open connections because it is loaded gets a moment to catch up.
const CREATE_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// How old the members' reports may be when a create is placed (they are read again at
/// every reconcile pass as well).
const MEMBERS_FRESH: Duration = Duration::from_secs(1);

/// How long this replica trusts what it remembers of a sandbox's node before reading the
/// store again: another replica may have moved the sandbox (decision 0035).
const PLACEMENT_FRESH: Duration = Duration::from_secs(1);

/// How long the reconciler waits for one node's list.
const OBSERVE_TIMEOUT: Duration = Duration::from_secs(5);

struct Member {
    row: NodeRow,
    api: Arc<RemoteNode>,
}

/// Every node of the cluster, routed by sandbox.
pub struct ClusterNodes {
    store: Store,
    tls: space_rpc::tls::ClusterTls,
    members: RwLock<BTreeMap<String, Member>>,
    /// Sandbox id to node id, as placed or observed, and when (the store is the truth).
    placed: RwLock<HashMap<String, (String, std::time::Instant)>>,
    /// When the members were last read from the store.
    refreshed: std::sync::Mutex<Option<std::time::Instant>>,
    /// The claims per node as last read ([`CLAIMS_FRESH`]), with this replica's since.
    claims: std::sync::Mutex<Option<(std::time::Instant, ClaimsByNode)>>,
    /// How long a member may be silent before it counts as lost (decision 0037).
    lost_after: Duration,
}

impl std::fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNodes").finish_non_exhaustive()
    }
}

fn store_err(e: StoreError) -> NodeError {
    NodeError::Internal(crate::error_chain(&e))
}

impl ClusterNodes {
    pub fn new(store: Store, tls: space_rpc::tls::ClusterTls, lost_after: Duration) -> Self {
        Self {
            store,
            tls,
            members: RwLock::default(),
            placed: RwLock::default(),
            refreshed: Default::default(),
            claims: Default::default(),
            lost_after,
        }
    }

    /// The members that are lost now (silent for `lost_after`), as last read.
    pub(crate) fn lost_members(&self) -> BTreeSet<String> {
        let now = now_ms();
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|m| m.row.lost(now, self.lost_after))
            .map(|m| m.row.id.clone())
            .collect()
    }

    /// Whether node `node` is lost: silent for `lost_after`, or no longer a member.
    pub(crate) fn is_lost(&self, node: &str) -> bool {
        let now = now_ms();
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .is_none_or(|m| m.row.lost(now, self.lost_after))
    }

    /// Member `node`'s API while its heartbeat is fresh.
    pub(crate) fn reachable_member(&self, node: &str) -> Option<Arc<RemoteNode>> {
        let now = now_ms();
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .filter(|m| m.row.reachable(now))
            .map(|m| m.api.clone())
    }

    /// Where a replica of sandbox `id` (on node `home`, of `template`, needing `need`) is
    /// kept: the node the scheduler picks among the others, as for a create, so that a
    /// restore there later finds room. None when no other node can take it.
    pub(crate) async fn choose_replica_node(
        &self,
        id: &str,
        template: &str,
        need: &Need,
        home: &str,
    ) -> Result<Option<(Candidate, Arc<RemoteNode>)>, NodeError> {
        let others: Vec<Candidate> = self
            .candidates(template)
            .await?
            .into_iter()
            .filter(|c| c.id != home)
            .collect();
        let Ok(p) = crate::scheduler::place(&others, need, id) else {
            return Ok(None);
        };
        let api = self.member(&p.node).ok_or_else(no_node)?;
        let c = others
            .into_iter()
            .find(|c| c.id == p.node)
            .expect("placed on a candidate");
        Ok(Some((c, api)))
    }

    /// Node `node` as the scheduler sees it now (its claims read now), with its API.
    pub(crate) async fn candidate(
        &self,
        node: &str,
        template: &str,
    ) -> Result<(Candidate, Arc<RemoteNode>), NodeError> {
        let c = self
            .candidates(template)
            .await?
            .into_iter()
            .find(|c| c.id == node)
            .ok_or(NodeError::NotFound {
                kind: "node",
                id: node.to_owned(),
            })?;
        let api = self.member(node).ok_or_else(no_node)?;
        Ok((c, api))
    }

    /// Reads the members again from the store: new nodes get a channel, removed ones are
    /// dropped, the others' rows (heartbeats, reports) are refreshed.
    pub async fn refresh(&self) -> Result<(), NodeError> {
        let started = std::time::Instant::now();
        let rows = self.store.list_cluster_nodes().await.map_err(store_err)?;
        let config = space_rpc::tls::client_config(&self.tls).map_err(NodeError::Internal)?;
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        let ids: BTreeSet<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        members.retain(|id, _| ids.contains(id.as_str()));
        for row in rows {
            match members.get_mut(&row.id) {
                Some(m) if m.row.address == row.address => m.row = row,
                _ => {
                    let channel = space_rpc::tls::tls_channel(
                        &row.address,
                        &space_ca::node_name(&row.id),
                        config.clone(),
                    )
                    .map_err(NodeError::Internal)?;
                    tracing::info!(node = %row.id, name = %row.name, address = %row.address, "driving node");
                    let api = Arc::new(RemoteNode::new(
                        format!("{} ({})", row.name, row.id),
                        channel,
                    ));
                    members.insert(row.id.clone(), Member { row, api });
                }
            }
        }
        *self.refreshed.lock().unwrap_or_else(|e| e.into_inner()) = Some(started);
        Ok(())
    }

    /// The members whose heartbeat is fresh, with their APIs.
    fn reachable(&self) -> Vec<(NodeRow, Arc<RemoteNode>)> {
        let now = now_ms();
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|m| m.row.reachable(now))
            .map(|m| (m.row.clone(), m.api.clone()))
            .collect()
    }

    fn member(&self, node: &str) -> Option<Arc<RemoteNode>> {
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .map(|m| m.api.clone())
    }

    /// The node sandbox `id` is on.
    async fn node_of(&self, id: &str) -> Result<Arc<RemoteNode>, NodeError> {
        Ok(self.placement_of(id).await?.1)
    }

    /// The node sandbox `id` is on: its id and API.
    pub(crate) async fn placement_of(
        &self,
        id: &str,
    ) -> Result<(String, Arc<RemoteNode>), NodeError> {
        let cached = self
            .placed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .filter(|(_, at)| at.elapsed() < PLACEMENT_FRESH)
            .map(|(node, _)| node.clone());
        let node = match cached {
            Some(n) => n,
            None => {
                let n = self
                    .store
                    .node_of_sandbox(id)
                    .await
                    .map_err(store_err)?
                    .ok_or_else(|| NodeError::NotFound {
                        kind: "sandbox",
                        id: id.to_owned(),
                    })?;
                self.remember(id, &n);
                n
            }
        };
        if let Some(api) = self.member(&node) {
            return Ok((node, api));
        }
        self.refresh().await?;
        match self.member(&node) {
            Some(api) => Ok((node, api)),
            None => Err(NodeError::Unreachable {
                reason: format!("sandbox {id} is on node {node}, which left the cluster"),
                node,
            }),
        }
    }

    fn remember(&self, id: &str, node: &str) {
        self.placed
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), (node.to_owned(), std::time::Instant::now()));
    }

    /// What the scheduler knows of every member now.
    /// The members' reports may be up to [`MEMBERS_FRESH`] old (they change with heartbeats,
    /// every 5 s); the claims are read now, and the claim's transaction checks them again.
    async fn candidates(&self, template: &str) -> Result<Vec<Candidate>, NodeError> {
        let stale = self
            .refreshed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none_or(|at| at.elapsed() > MEMBERS_FRESH);
        if stale {
            self.refresh().await?;
        }
        let claims = self.claims().await?;
        let now = now_ms();
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        let template_elsewhere = members.values().any(|m| has_template(m, template, now));
        Ok(members
            .values()
            .map(|m| {
                let (cpu, mem) = claims.get(&m.row.id).copied().unwrap_or((0, 0));
                let mut c = Candidate {
                    id: m.row.id.clone(),
                    // Without a report yet, its capacity is unknown: not a candidate.
                    reachable: m.row.reachable(now) && m.row.info.is_some(),
                    runtimes: Vec::new(),
                    cpus: 0,
                    memory_bytes: 0,
                    claimed_cpu_millis: cpu,
                    claimed_memory_mib: mem,
                    has_template: false,
                    template_elsewhere,
                    pool_ready: 0,
                    draining: m.row.draining,
                };
                if let Some(info) = &m.row.info {
                    c.runtimes.clone_from(&info.runtimes);
                    c.cpus = info.cpus;
                    c.memory_bytes = info.memory_bytes;
                    c.has_template = info.templates.iter().any(|t| t == template);
                    c.pool_ready = info
                        .pool_ready_by_template
                        .get(template)
                        .copied()
                        .unwrap_or(0);
                }
                c
            })
            .collect())
    }

    /// The claims per node to rank candidates by: read again when older than
    /// [`CLAIMS_FRESH`].
    async fn claims(&self) -> Result<ClaimsByNode, NodeError> {
        {
            let cached = self.claims.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, claims)) = cached.as_ref()
                && at.elapsed() < CLAIMS_FRESH
            {
                return Ok(claims.clone());
            }
        }
        let claims = self.store.claims_by_node().await.map_err(store_err)?;
        *self.claims.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), claims.clone()));
        Ok(claims)
    }

    /// Counts a claim this replica made in the cached figures; `None`: a claim was refused,
    /// so the figures are read again next time.
    fn note_claim(&self, claimed: Option<(&str, &Need)>) {
        let mut cached = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        match (claimed, cached.as_mut()) {
            (Some((node, need)), Some((_, claims))) => {
                let c = claims.entry(node.to_owned()).or_default();
                c.0 += need.cpu_millis;
                c.1 += need.memory_mib;
            }
            (Some(_), None) => {}
            (None, _) => *cached = None,
        }
    }

    /// Places sandbox `id` (which needs `need`, from `template`) on a node, recording the
    /// claim; a claim that lost a race with another create's is tried again with fresh
    /// figures (up to [`PLACE_TRIES`] times).
    pub async fn place(
        &self,
        id: &str,
        template: &str,
        need: Need,
    ) -> Result<Placement, NodeError> {
        for _ in 0..PLACE_TRIES {
            let nodes = self.candidates(template).await?;
            let placement =
                crate::scheduler::place(&nodes, &need, id).map_err(NodeError::Exhausted)?;
            let node = nodes
                .iter()
                .find(|n| n.id == placement.node)
                .expect("placed on a candidate");
            if self.store.claim(id, node, &need).await.map_err(store_err)? {
                self.note_claim(Some((&placement.node, &need)));
                self.remember(id, &placement.node);
                return Ok(placement);
            }
            self.note_claim(None);
        }
        Err(NodeError::Exhausted(
            "every node that fit was claimed by other creates meanwhile; try again".into(),
        ))
    }

    /// Where sandbox `id` (on node `from`, needing `need`) moves: node `to` when given
    /// (NotFound when no such member; Exhausted when it cannot take it), else the node the
    /// scheduler picks among the others.
    pub(crate) async fn choose_target(
        &self,
        id: &str,
        template: &str,
        need: &Need,
        from: &str,
        to: Option<&str>,
    ) -> Result<(Candidate, Arc<RemoteNode>), NodeError> {
        self.refresh().await?;
        let nodes: Vec<Candidate> = self
            .candidates(template)
            .await?
            .into_iter()
            .filter(|c| c.id != from)
            .collect();
        let chosen = match to {
            Some(to) if to == from => {
                return Err(NodeError::InvalidArgument(format!(
                    "sandbox {id} is on node {to} already"
                )));
            }
            Some(to) => {
                let c = nodes
                    .iter()
                    .find(|c| c.id == to)
                    .ok_or(NodeError::NotFound {
                        kind: "node",
                        id: to.to_owned(),
                    })?;
                crate::scheduler::place(std::slice::from_ref(c), need, id)
                    .map_err(|why| {
                        NodeError::Exhausted(format!("node {to} cannot take sandbox {id}: {why}"))
                    })?
                    .node
            }
            None => {
                crate::scheduler::place(&nodes, need, id)
                    .map_err(|why| {
                        NodeError::Exhausted(format!("no other node can take sandbox {id}: {why}"))
                    })?
                    .node
            }
        };
        let api = self.member(&chosen).ok_or_else(no_node)?;
        let candidate = nodes
            .into_iter()
            .find(|c| c.id == chosen)
            .expect("chosen among the candidates");
        Ok((candidate, api))
    }

    /// Moves sandbox `id`'s claim to node `to`, in one transaction that locks `to`'s row as a
    /// placement does: false when it no longer fits there.
    pub(crate) async fn move_claim(
        &self,
        id: &str,
        to: &Candidate,
        need: &Need,
    ) -> Result<bool, NodeError> {
        let moved = self
            .store
            .move_claim(id, to, need)
            .await
            .map_err(store_err)?;
        if moved {
            self.remember(id, &to.id);
        }
        Ok(moved)
    }

    /// Sends template `name` to node `to` from a reachable node that has it, when `to` has not
    /// reported it (decision 0035: templates reach nodes on demand, and are kept there). The
    /// node's report is updated here at once, so the next create does not send it again.
    pub(crate) async fn ensure_template(
        &self,
        to: &str,
        dst: &Arc<RemoteNode>,
        name: &str,
    ) -> Result<(), NodeError> {
        let now = now_ms();
        let source = {
            let members = self.members.read().unwrap_or_else(|e| e.into_inner());
            match members.get(to) {
                Some(m) if has_template(m, name, now) || m.row.info.is_none() => return Ok(()),
                _ => {}
            }
            members
                .values()
                .filter(|m| m.row.id != to && has_template(m, name, now))
                .map(|m| (m.row.id.clone(), m.api.clone()))
                .next()
        };
        let Some((from, src)) = source else {
            // Nobody reports it: the node answers for itself (NotFound, or it has it).
            return Ok(());
        };
        let started = std::time::Instant::now();
        let parts = src.send_template(name).await?;
        let info = dst.receive_template(name, parts).await?;
        tracing::info!(template = name, version = info.version, from = %from, to,
            ms = started.elapsed().as_millis() as u64, "template sent to a node that lacked it");
        self.note_template(&[to.to_owned()], name).await;
        Ok(())
    }

    /// Counts template `name` as on `nodes` now, here and in their stored reports, before
    /// their next heartbeats say so: a create right after an import (or a send), through any
    /// replica, finds it there.
    async fn note_template(&self, nodes: &[String], name: &str) {
        for id in nodes {
            if let Some(m) = self
                .members
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(id)
                && let Some(i) = m.row.info.as_mut()
                && !i.templates.iter().any(|t| t == name)
            {
                i.templates.push(name.to_owned());
            }
            if let Err(e) = self.store.note_node_template(id, name).await {
                tracing::warn!(node = %id, template = name, error = %e, "could not record a node's template");
            }
        }
    }

    /// Runs `f` on every reachable member; the first answer, or the first error (the same
    /// error the node gave: a missing template is still NotFound).
    async fn on_each<T, F, Fut>(&self, f: F) -> Result<T, NodeError>
    where
        F: Fn(Arc<RemoteNode>) -> Fut,
        Fut: Future<Output = Result<T, NodeError>>,
    {
        self.refresh().await?;
        let members = self.reachable();
        if members.is_empty() {
            return Err(no_node());
        }
        let mut first = None;
        for (row, api) in members {
            match f(api).await {
                Ok(v) => {
                    first.get_or_insert(v);
                }
                Err(e) => {
                    tracing::warn!(node = %row.id, error = %e, "a node refused what the others are asked");
                    return Err(e);
                }
            }
        }
        first.ok_or_else(no_node)
    }
}

/// Whether member `m` reported template `name` and is reachable.
fn has_template(m: &Member, name: &str, now: i64) -> bool {
    m.row.reachable(now)
        && m.row
            .info
            .as_ref()
            .is_some_and(|i| i.templates.iter().any(|t| t == name))
}

fn no_node() -> NodeError {
    NodeError::Unreachable {
        node: "(none)".into(),
        reason: crate::cluster::NO_NODE.into(),
    }
}

impl Store {
    pub async fn node_of_sandbox(&self, id: &str) -> Result<Option<String>, StoreError> {
        use sqlx::Row;
        let row = sqlx::query("SELECT node_id FROM sandbox_nodes WHERE sandbox_id = $1")
            .bind(id)
            .fetch_optional(self.pool())
            .await
            .map_err(|source| StoreError::Query {
                what: "find node of sandbox",
                source,
            })?;
        row.map(|r| r.try_get::<String, _>(0))
            .transpose()
            .map_err(|source| StoreError::Query {
                what: "find node of sandbox",
                source,
            })
    }

    /// Every sandbox's node.
    pub async fn placements(&self) -> Result<HashMap<String, String>, StoreError> {
        use sqlx::Row;
        let q = |source| StoreError::Query {
            what: "list placements",
            source,
        };
        let rows = sqlx::query("SELECT sandbox_id, node_id FROM sandbox_nodes")
            .fetch_all(self.pool())
            .await
            .map_err(q)?;
        rows.iter()
            .map(|r| Ok((r.try_get(0).map_err(q)?, r.try_get(1).map_err(q)?)))
            .collect()
    }

    /// The limits live sandboxes claim on each node: (CPU millis, memory MiB).
    pub async fn claims_by_node(&self) -> Result<ClaimsByNode, StoreError> {
        use sqlx::Row;
        let q = |source| StoreError::Query {
            what: "sum claims",
            source,
        };
        let rows = sqlx::query(CLAIMS_BY_NODE)
            .fetch_all(self.pool())
            .await
            .map_err(q)?;
        rows.iter()
            .map(|r| {
                let node: String = r.try_get(0).map_err(q)?;
                let cpu: i64 = r.try_get(1).map_err(q)?;
                let mem: i64 = r.try_get(2).map_err(q)?;
                Ok((node, (cpu.max(0) as u64, mem.max(0) as u64)))
            })
            .collect()
    }

    /// Claims room on `node` for sandbox `id`, in one transaction that first locks the node's
    /// row: false when it no longer fits (another create took the room) or the node is gone.
    pub async fn claim(&self, id: &str, node: &Candidate, need: &Need) -> Result<bool, StoreError> {
        let q = |what| move |source| StoreError::Query { what, source };
        let mut tx = self.pool().begin().await.map_err(q("claim"))?;
        if !lock_node(&mut tx, &node.id).await? {
            return Ok(false);
        }
        // With the node's row locked, one statement sums what its live sandboxes claim and
        // inserts this claim only when it still fits.
        let inserted = sqlx::query(CLAIM_IF_IT_FITS)
            .bind(id)
            .bind(&node.id)
            .bind(need.cpu_millis as i64)
            .bind(need.memory_mib as i64)
            .bind(now_ms())
            .bind(node.cpu_capacity() as i64)
            .bind(node.memory_capacity_mib() as i64)
            .execute(&mut *tx)
            .await
            .map_err(q("record placement"))?;
        if inserted.rows_affected() == 0 {
            // It did not fit, or the sandbox was placed already (a create retried at once):
            // then that placement stands, as before.
            let placed: Option<(String,)> =
                sqlx::query_as("SELECT node_id FROM sandbox_nodes WHERE sandbox_id = $1")
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(q("find placement"))?;
            return Ok(placed.is_some_and(|(n,)| n == node.id));
        }
        tx.commit().await.map_err(q("claim"))?;
        Ok(true)
    }

    /// [`Self::claim`] for a sandbox placed already: its claim moves to `node` when it fits
    /// there (what it claims on its old node is not counted against `node`).
    pub async fn move_claim(
        &self,
        id: &str,
        node: &Candidate,
        need: &Need,
    ) -> Result<bool, StoreError> {
        let q = |what| move |source| StoreError::Query { what, source };
        let mut tx = self.pool().begin().await.map_err(q("move claim"))?;
        if !lock_if_fits(&mut tx, node, need).await? {
            return Ok(false);
        }
        let moved = sqlx::query(
            "UPDATE sandbox_nodes SET node_id = $2, placed_at = $3 WHERE sandbox_id = $1",
        )
        .bind(id)
        .bind(&node.id)
        .bind(now_ms())
        .execute(&mut *tx)
        .await
        .map_err(q("move placement"))?;
        if moved.rows_affected() != 1 {
            return Ok(false);
        }
        tx.commit().await.map_err(q("move claim"))?;
        Ok(true)
    }

    /// Adds template `name` to node `node`'s stored report (its next heartbeat replaces the
    /// report with its own, which has it).
    pub async fn note_node_template(&self, node: &str, name: &str) -> Result<(), StoreError> {
        use sqlx::Row;
        let q = |what| move |source| StoreError::Query { what, source };
        let row = sqlx::query("SELECT info FROM cluster_nodes WHERE id = $1")
            .bind(node)
            .fetch_optional(self.pool())
            .await
            .map_err(q("read node"))?;
        let Some(row) = row else { return Ok(()) };
        let info: Option<String> = row.try_get(0).map_err(q("read node"))?;
        let Some(mut info) = info.and_then(|i| serde_json::from_str::<NodeInfo>(&i).ok()) else {
            return Ok(());
        };
        if info.templates.iter().any(|t| t == name) {
            return Ok(());
        }
        info.templates.push(name.to_owned());
        sqlx::query("UPDATE cluster_nodes SET info = $2 WHERE id = $1")
            .bind(node)
            .bind(serde_json::to_string(&info).unwrap_or_default())
            .execute(self.pool())
            .await
            .map_err(q("record node template"))?;
        Ok(())
    }

    pub async fn forget_placement(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandbox_nodes WHERE sandbox_id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(|source| StoreError::Query {
                what: "forget placement",
                source,
            })?;
        Ok(())
    }

    /// The sandboxes placed on `node`.
    pub async fn sandboxes_on(&self, node: &str) -> Result<Vec<String>, StoreError> {
        use sqlx::Row;
        let q = |source| StoreError::Query {
            what: "list sandboxes of node",
            source,
        };
        let rows = sqlx::query("SELECT sandbox_id FROM sandbox_nodes WHERE node_id = $1")
            .bind(node)
            .fetch_all(self.pool())
            .await
            .map_err(q)?;
        rows.iter().map(|r| r.try_get(0).map_err(q)).collect()
    }
}

/// In a claim's transaction: locks `node`'s row (every claim on it waits here for the one
/// before to commit: a row lock on PostgreSQL, the write lock on SQLite) and answers whether
/// `need` fits beside what its live sandboxes claim now. False when the node is gone.
/// Locks node `node`'s row for the transaction (placements on it wait for each other):
/// false when there is no such node.
async fn lock_node(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    node: &str,
) -> Result<bool, StoreError> {
    let locked = sqlx::query("UPDATE cluster_nodes SET id = id WHERE id = $1")
        .bind(node)
        .execute(&mut **tx)
        .await
        .map_err(|source| StoreError::Query {
            what: "lock node",
            source,
        })?;
    Ok(locked.rows_affected() == 1)
}

async fn lock_if_fits(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    node: &Candidate,
    need: &Need,
) -> Result<bool, StoreError> {
    use sqlx::Row;
    let q = |what| move |source| StoreError::Query { what, source };
    if !lock_node(tx, &node.id).await? {
        return Ok(false);
    }
    let row = sqlx::query(&format!("{CLAIMS} AND sn.node_id = $1"))
        .bind(&node.id)
        .fetch_one(&mut **tx)
        .await
        .map_err(q("sum claims"))?;
    let cpu: i64 = row.try_get(0).map_err(q("sum claims"))?;
    let mem: i64 = row.try_get(1).map_err(q("sum claims"))?;
    Ok(Candidate {
        claimed_cpu_millis: cpu.max(0) as u64,
        claimed_memory_mib: mem.max(0) as u64,
        ..node.clone()
    }
    .fits(need))
}

/// The claims of live sandboxes (creating, running, paused; not deleted).
const CLAIMS: &str = "SELECT CAST(COALESCE(SUM(sn.cpu_millis), 0) AS BIGINT), \
     CAST(COALESCE(SUM(sn.memory_mib), 0) AS BIGINT) \
     FROM sandbox_nodes sn JOIN sandboxes s ON s.id = sn.sandbox_id \
     WHERE s.deleted_at IS NULL AND s.state IN ('creating', 'running', 'paused')";

/// A claim ($1 sandbox, $2 node, $3 CPU millis, $4 memory MiB, $5 when), inserted only when
/// it fits in the node's room ($6 CPU millis, $7 memory MiB) next to its live claims.
const CLAIM_IF_IT_FITS: &str = "INSERT INTO sandbox_nodes \
     (sandbox_id, node_id, cpu_millis, memory_mib, placed_at) \
     SELECT $1, $2, CAST($3 AS BIGINT), CAST($4 AS BIGINT), CAST($5 AS BIGINT) FROM ( \
       SELECT CAST(COALESCE(SUM(sn.cpu_millis), 0) AS BIGINT) AS cpu, \
              CAST(COALESCE(SUM(sn.memory_mib), 0) AS BIGINT) AS mem \
       FROM sandbox_nodes sn JOIN sandboxes s ON s.id = sn.sandbox_id \
       WHERE s.deleted_at IS NULL AND s.state IN ('creating', 'running', 'paused') \
         AND sn.node_id = $2) c \
     WHERE c.cpu + CAST($3 AS BIGINT) <= CAST($6 AS BIGINT) \
       AND c.mem + CAST($4 AS BIGINT) <= CAST($7 AS BIGINT) \
     ON CONFLICT (sandbox_id) DO NOTHING";

const CLAIMS_BY_NODE: &str = "SELECT sn.node_id, CAST(COALESCE(SUM(sn.cpu_millis), 0) AS BIGINT), \
     CAST(COALESCE(SUM(sn.memory_mib), 0) AS BIGINT) \
     FROM sandbox_nodes sn JOIN sandboxes s ON s.id = sn.sandbox_id \
     WHERE s.deleted_at IS NULL AND s.state IN ('creating', 'running', 'paused') \
     GROUP BY sn.node_id";

/// `series{labels}` with `node="id"` added.
fn with_node_label(series: &str, node: &str) -> String {
    match series.strip_suffix('}').and_then(|s| s.split_once('{')) {
        Some((name, "")) => format!("{name}{{node=\"{node}\"}}"),
        Some((name, labels)) => format!("{name}{{{labels},node=\"{node}\"}}"),
        None => format!("{series}{{node=\"{node}\"}}"),
    }
}

#[async_trait]
impl NodeApi for ClusterNodes {
    /// On the sandbox's node when it was placed (a restart, a recovery); else placed now.
    /// A node without the sandbox's template gets it from one that has it first.
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        let (node_id, node) = match self.placement_of(&spec.id).await {
            Ok(n) => n,
            Err(NodeError::NotFound { .. }) => {
                let p = self.place(&spec.id, &spec.template, Need::of(spec)).await?;
                let api = self.member(&p.node).ok_or_else(no_node)?;
                (p.node, api)
            }
            Err(e) => return Err(e),
        };
        self.ensure_template(&node_id, &node, &spec.template)
            .await?;
        let mut call = 1;
        loop {
            match node.create_sandbox(spec).await {
                Err(e @ NodeError::Unreachable { .. })
                    if call < CREATE_CALLS && !self.is_lost(&node_id) =>
                {
                    tracing::warn!(sandbox = %spec.id, node = %node_id, error = %e, call, "create: node unreachable; calling again");
                    tokio::time::sleep(CREATE_RETRY_PAUSE * (1 << (call - 1))).await;
                    call += 1;
                }
                answer => return answer,
            }
        }
    }

    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        match self.placement_of(id).await {
            // On a lost node: nothing can be removed there now. If it comes back, the
            // reconciler removes its copy (a sandbox without a row is an orphan).
            Ok((node, _)) if self.is_lost(&node) => {
                tracing::info!(sandbox = id, node, "forgotten on a lost node");
            }
            Ok((_, node)) => node.remove_sandbox(id).await?,
            // Never placed: nothing to remove anywhere.
            Err(NodeError::NotFound { .. }) => {}
            // On a node that left the cluster: nothing to remove that can be reached.
            Err(NodeError::Unreachable { node, .. }) if self.is_lost(&node) => {}
            Err(e) => return Err(e),
        }
        self.store.forget_placement(id).await.map_err(store_err)?;
        self.placed
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        Ok(())
    }

    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.node_of(id).await?.stop_sandbox(id).await
    }

    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        match self.node_of(id).await {
            Ok(node) => node.sandbox_status(id).await,
            Err(NodeError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        Ok(self.observe().await?.sandboxes)
    }

    /// Every reachable node's list; the sandboxes placed on the others are unseen.
    async fn observe(&self) -> Result<Observation, NodeError> {
        self.refresh().await?;
        let now = now_ms();
        let members: Vec<(NodeRow, Arc<RemoteNode>)> = self
            .members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|m| (m.row.clone(), m.api.clone()))
            .collect();
        let lists = futures::future::join_all(members.iter().map(|(row, api)| async move {
            if !row.reachable(now) {
                return Err("its heartbeat lapsed".to_owned());
            }
            match tokio::time::timeout(OBSERVE_TIMEOUT, api.list_sandboxes()).await {
                Ok(Ok(l)) => Ok(l),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer in time".to_owned()),
            }
        }))
        .await;
        let mut out = Observation::default();
        let placements = self.store.placements().await.map_err(store_err)?;
        let mut seen: BTreeSet<String> = BTreeSet::new();
        for ((row, _), list) in members.iter().zip(lists) {
            match list {
                // A sandbox on a node the store does not place it on (one end of a move
                // under way, or a copy a lost node kept) is a stray there, not observed:
                // the status that counts is its own node's (not remembered here either).
                Ok(list) => {
                    for st in list {
                        if placements.get(&st.id).is_some_and(|n| *n != row.id) {
                            out.strays.push((row.id.clone(), st.id));
                        } else if seen.insert(st.id.clone()) {
                            out.sandboxes.push(st);
                        }
                    }
                }
                Err(why) => {
                    tracing::debug!(node = %row.id, why, "node not observed");
                    out.unseen
                        .extend(self.store.sandboxes_on(&row.id).await.map_err(store_err)?);
                }
            }
        }
        Ok(out)
    }

    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        self.node_of(id).await?.guest_channel(id).await
    }

    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        self.refresh().await?;
        let mut all: BTreeMap<(String, u32), TemplateInfo> = BTreeMap::new();
        let mut answered = false;
        let mut last = no_node();
        for (row, api) in self.reachable() {
            // A node gone since its last heartbeat is left out, not the whole list.
            match api.list_templates().await {
                Ok(list) => {
                    answered = true;
                    for t in list {
                        all.entry((t.name.clone(), t.version)).or_insert(t);
                    }
                }
                Err(e @ NodeError::Unreachable { .. }) => {
                    tracing::debug!(node = %row.id, error = %e, "templates of a node not listed");
                    last = e;
                }
                Err(e) => return Err(e),
            }
        }
        if !answered {
            return Err(last);
        }
        Ok(all.into_values().collect())
    }

    async fn template_versions(&self, name: &str) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(self
            .list_templates()
            .await?
            .into_iter()
            .filter(|t| t.name == name)
            .collect())
    }

    async fn pause_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.node_of(id).await?.pause_sandbox(id).await
    }

    async fn resume_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.node_of(id).await?.resume_sandbox(id).await
    }

    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        self.import_template_with_progress(name, source, tx).await
    }

    /// A snapshot becomes a template on its sandbox's node; anything else is imported on
    /// every reachable node (the first one's progress is shown).
    async fn import_template_with_progress(
        &self,
        name: &str,
        source: TemplateSource,
        progress: TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        if let TemplateSource::Snapshot { sandbox, .. } = &source {
            let (node_id, node) = self.placement_of(sandbox).await?;
            let info = node
                .import_template_with_progress(name, source, progress)
                .await?;
            self.note_template(&[node_id], name).await;
            return Ok(info);
        }
        let first = std::sync::Mutex::new(Some(progress));
        let on: Vec<String> = self.reachable().into_iter().map(|(r, _)| r.id).collect();
        let info = self
            .on_each(|api| {
                let source = source.clone();
                let progress = first
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .unwrap_or_else(|| tokio::sync::mpsc::unbounded_channel().0);
                async move {
                    api.import_template_with_progress(name, source, progress)
                        .await
                }
            })
            .await?;
        self.note_template(&on, name).await;
        Ok(info)
    }

    async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Vec<u32>, NodeError> {
        let removed = std::sync::Mutex::new(BTreeSet::new());
        self.on_each(|api| {
            let removed = &removed;
            async move {
                let v = api.remove_template(name, version).await?;
                removed.lock().unwrap_or_else(|e| e.into_inner()).extend(v);
                Ok(())
            }
        })
        .await?;
        Ok(removed
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .collect())
    }

    /// Asked of one node: the first that answers (a node whose heartbeat is still fresh may
    /// be gone, or out of this replica's reach).
    async fn validate_network(&self, network: &NetworkSpec) -> Result<(), NodeError> {
        self.refresh().await?;
        let mut last = no_node();
        for (_, api) in self.reachable() {
            match api.validate_network(network).await {
                Err(e @ NodeError::Unreachable { .. }) => last = e,
                answer => return answer,
            }
        }
        Err(last)
    }

    async fn set_network(
        &self,
        id: &str,
        network: &NetworkSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.node_of(id).await?.set_network(id, network).await
    }

    async fn connect_port(&self, id: &str, port: u16) -> Result<PortStream, NodeError> {
        self.node_of(id).await?.connect_port(id, port).await
    }

    async fn snapshot_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.node_of(id).await?.snapshot_sandbox(id, snap).await
    }

    async fn checkpoint_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.node_of(id).await?.checkpoint_sandbox(id, snap).await
    }

    async fn list_snapshots(
        &self,
        id: &str,
        with_size: bool,
    ) -> Result<Vec<SnapshotInfo>, NodeError> {
        self.node_of(id).await?.list_snapshots(id, with_size).await
    }

    async fn diff_sandbox(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<Change>, NodeError> {
        self.node_of(id).await?.diff_sandbox(id, from, to).await
    }

    async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        self.node_of(id).await?.delete_snapshot(id, snap).await
    }

    async fn changed_since_snapshot(
        &self,
        id: &str,
        owner: &str,
        snap: &str,
    ) -> Result<bool, NodeError> {
        self.node_of(id)
            .await?
            .changed_since_snapshot(id, owner, snap)
            .await
    }

    async fn rollback_sandbox(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.node_of(&spec.id)
            .await?
            .rollback_sandbox(spec, snap)
            .await
    }

    /// On the source's node (the fork is a snapshot of its disk there), if it fits.
    async fn fork_sandbox(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        let (node_id, node) = self.placement_of(source).await?;
        let candidate = self
            .candidates(&spec.template)
            .await?
            .into_iter()
            .find(|c| c.id == node_id)
            .ok_or_else(no_node)?;
        if !self
            .store
            .claim(&spec.id, &candidate, &Need::of(spec))
            .await
            .map_err(store_err)?
        {
            return Err(NodeError::Exhausted(format!(
                "node {node_id}, where sandbox {source} is, has no room for its fork"
            )));
        }
        self.remember(&spec.id, &node_id);
        node.fork_sandbox(source, snap, spec).await
    }

    async fn metrics(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for (row, api) in self.reachable() {
            out.extend(
                api.metrics()
                    .await
                    .into_iter()
                    .map(|(k, v)| (with_node_label(&k, &row.id), v)),
            );
        }
        out
    }

    async fn set_pool(&self, template: &str, cfg: PoolConfig) -> Result<PoolStatus, NodeError> {
        self.on_each(|api| async move { api.set_pool(template, cfg).await })
            .await
    }

    /// Each template's pool summed over the nodes (sizes as the first node holds them).
    async fn pools(&self) -> Vec<PoolStatus> {
        let mut all: BTreeMap<String, PoolStatus> = BTreeMap::new();
        for (_, api) in self.reachable() {
            for p in api.pools().await {
                match all.get_mut(&p.template) {
                    None => {
                        all.insert(p.template.clone(), p);
                    }
                    Some(sum) => {
                        sum.ready += p.ready;
                        sum.starting += p.starting;
                        sum.hits += p.hits;
                        sum.misses += p.misses;
                    }
                }
            }
        }
        all.into_values().collect()
    }

    /// The members summed; `started_unix_ms` changes whenever a node starts again or joins,
    /// so the reconciler hands the pools to every node then.
    async fn node_info(&self) -> Result<NodeInfo, NodeError> {
        self.refresh().await?;
        let members = self.reachable();
        if members.is_empty() {
            return Err(no_node());
        }
        let mut sum = NodeInfo::default();
        for (row, _) in members {
            let i = row.info.unwrap_or_default();
            sum.cpus += i.cpus;
            sum.memory_bytes += i.memory_bytes;
            sum.memory_available_bytes += i.memory_available_bytes;
            sum.sandboxes += i.sandboxes;
            sum.pool_ready += i.pool_ready;
            sum.started_unix_ms = sum.started_unix_ms.wrapping_add(i.started_unix_ms);
            for r in i.runtimes {
                if !sum.runtimes.contains(&r) {
                    sum.runtimes.push(r);
                }
            }
        }
        Ok(sum)
    }

    async fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, NodeError> {
        self.node_of(id).await?.sandbox_usage(id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_gain_a_node_label() {
        assert_eq!(with_node_label("a", "n1"), "a{node=\"n1\"}");
        assert_eq!(with_node_label("a{}", "n1"), "a{node=\"n1\"}");
        assert_eq!(
            with_node_label("a{t=\"x\"}", "n1"),
            "a{t=\"x\",node=\"n1\"}"
        );
    }
}
