//! Nodes and the cluster as the API shows them (issue 14): `GET /v1/nodes` and
//! `GET /v1/cluster`. All-in-one, the engine has one node (the in-process one), and what it
//! reports comes from [`NodeApi::node_info`](space_node_api::NodeApi::node_info); a control
//! plane that leads a cluster lists the nodes that joined it, each as its last heartbeat
//! described it (`unreachable` once heartbeats stop). What sandboxes claim comes from the
//! store's rows.

use std::collections::BTreeMap;

use space_api::{ClusterStatus, Node, SandboxState};

use crate::engine::Engine;
use crate::error::ControlResult;
use crate::store::SandboxRow;

/// Whether a sandbox in state `s` holds its limits on its node.
fn claims(s: SandboxState) -> bool {
    matches!(
        s,
        SandboxState::Creating | SandboxState::Running | SandboxState::Paused
    )
}

/// The CPU (cores, to a thousandth) and memory limits the claiming rows add up to.
fn allocated(rows: &[SandboxRow]) -> (f64, u64) {
    let (cpu, mem) = rows
        .iter()
        .filter(|r| claims(r.state))
        .fold((0.0, 0), |(c, m), r| {
            (c + r.spec.cpu, m + r.spec.memory_mib)
        });
    ((cpu * 1000.0_f64).round() / 1000.0, mem)
}

impl Engine {
    pub async fn list_nodes(&self) -> ControlResult<Vec<Node>> {
        let rows = self.store.list_sandboxes().await?;
        self.nodes_now(&rows).await
    }

    async fn nodes_now(&self, rows: &[SandboxRow]) -> ControlResult<Vec<Node>> {
        if self.cluster.is_none() {
            return Ok(vec![self.local_node(rows).await]);
        }
        let claims = self.store.claims_by_node().await?;
        let now = crate::store::now_ms();
        Ok(self
            .joined_nodes()
            .await?
            .into_iter()
            .map(|n| {
                let info = n.info.clone().unwrap_or_default();
                let (cpu_millis, allocated_memory_mib) =
                    claims.get(&n.id).copied().unwrap_or((0, 0));
                Node {
                    state: if n.lost(now, self.cfg.node_lost_after) {
                        "lost"
                    } else if !n.reachable(now) {
                        "unreachable"
                    } else if n.draining {
                        "draining"
                    } else {
                        "ready"
                    }
                    .into(),
                    runtimes: info.runtimes.iter().map(|k| k.to_string()).collect(),
                    cpus: info.cpus,
                    memory_bytes: info.memory_bytes,
                    memory_available_bytes: info.memory_available_bytes,
                    sandboxes: info.sandboxes,
                    pool_ready: info.pool_ready,
                    allocated_cpu: cpu_millis as f64 / 1000.0,
                    allocated_memory_mib,
                    id: Some(n.id),
                    address: Some(n.address),
                    name: n.name,
                }
            })
            .collect())
    }

    async fn local_node(&self, rows: &[SandboxRow]) -> Node {
        let (allocated_cpu, allocated_memory_mib) = allocated(rows);
        match self.node.node_info().await {
            Ok(info) => Node {
                id: None,
                address: None,
                name: info.name,
                state: "ready".into(),
                runtimes: info.runtimes.iter().map(|k| k.to_string()).collect(),
                cpus: info.cpus,
                memory_bytes: info.memory_bytes,
                memory_available_bytes: info.memory_available_bytes,
                sandboxes: info.sandboxes,
                pool_ready: info.pool_ready,
                allocated_cpu,
                allocated_memory_mib,
            },
            Err(e) => {
                tracing::warn!(error = %e, "node info");
                Node {
                    name: "local".into(),
                    state: "unreachable".into(),
                    allocated_cpu,
                    allocated_memory_mib,
                    ..Node::default()
                }
            }
        }
    }

    pub async fn cluster_status(&self) -> ControlResult<ClusterStatus> {
        let rows = self.store.list_sandboxes().await?;
        let nodes = self.nodes_now(&rows).await?;
        let mut sandboxes = BTreeMap::new();
        for r in &rows {
            *sandboxes.entry(r.state.as_str().to_owned()).or_insert(0) += 1;
        }
        Ok(ClusterStatus {
            nodes: nodes.len() as u32,
            nodes_ready: nodes.iter().filter(|n| n.state == "ready").count() as u32,
            cpus: nodes.iter().map(|n| n.cpus).sum(),
            memory_bytes: nodes.iter().map(|n| n.memory_bytes).sum(),
            memory_available_bytes: nodes.iter().map(|n| n.memory_available_bytes).sum(),
            allocated_cpu: nodes.iter().map(|n| n.allocated_cpu).sum(),
            allocated_memory_mib: nodes.iter().map(|n| n.allocated_memory_mib).sum(),
            pool_ready: nodes.iter().map(|n| n.pool_ready).sum(),
            sandboxes,
        })
    }
}
