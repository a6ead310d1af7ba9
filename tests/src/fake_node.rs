//! Fake node agents for the scheduler's cluster test (issue 14): each joins a real control
//! plane with a real join token, serves the node contract over mTLS and heartbeats exactly as
//! `spaced node` does (`space_rpc::join`, `space_rpc::router`), but holds no sandboxes: a
//! create is counted and answered `running`. A thousand of them cost one test process a few
//! thousand file descriptors and no btrfs, cgroups or namespaces.
//!
//! Only for tests: nothing here runs a sandbox.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use space_node_api::{
    GuestChannel, NodeApi, NodeError, NodeInfo, Phase, RuntimeKind, SandboxSpec, SandboxStatus,
    TemplateInfo,
};

/// What one fake node offers and holds.
#[derive(Debug)]
pub struct FakeNode {
    pub name: String,
    pub cpus: u32,
    pub memory_bytes: u64,
    /// The template every fake node has.
    pub template: String,
    sandboxes: Mutex<BTreeMap<String, SandboxStatus>>,
    /// Creates that made a sandbox (a retried create of one it holds is not counted).
    pub created: AtomicU32,
    started_unix_ms: u64,
}

impl FakeNode {
    pub fn new(name: &str, cpus: u32, memory_bytes: u64, template: &str) -> Self {
        Self {
            name: name.to_owned(),
            cpus,
            memory_bytes,
            template: template.to_owned(),
            sandboxes: Mutex::default(),
            created: AtomicU32::new(0),
            started_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// The ids of the sandboxes it holds now.
    pub fn held(&self) -> Vec<String> {
        self.sandboxes.lock().unwrap().keys().cloned().collect()
    }
}

#[async_trait::async_trait]
impl NodeApi for FakeNode {
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        if spec.template != self.template {
            return Err(NodeError::NotFound {
                kind: "template",
                id: spec.template.clone(),
            });
        }
        let mut held = self.sandboxes.lock().unwrap();
        if let Some(s) = held.get(&spec.id) {
            return Ok(s.clone());
        }
        let status = SandboxStatus {
            id: spec.id.clone(),
            phase: Phase::Running,
            template: spec.template.clone(),
            runtime: spec.runtime.unwrap_or_default(),
            init_pid: None,
            uid_base: 0,
            uid_count: 0,
            channel: Default::default(),
            memory_bytes: None,
            cpu_usage_usec: None,
            disk_bytes: None,
            network: None,
            pooled: false,
            restored: false,
        };
        held.insert(spec.id.clone(), status.clone());
        self.created.fetch_add(1, Ordering::SeqCst);
        Ok(status)
    }

    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.sandboxes.lock().unwrap().remove(id);
        Ok(())
    }

    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        match self.sandboxes.lock().unwrap().get_mut(id) {
            Some(s) => {
                s.phase = Phase::Stopped;
                Ok(())
            }
            None => Err(NodeError::NotFound {
                kind: "sandbox",
                id: id.to_owned(),
            }),
        }
    }

    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().get(id).cloned())
    }

    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().values().cloned().collect())
    }

    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        Err(NodeError::Conflict(format!(
            "sandbox {id} is on a fake node, which runs no guest"
        )))
    }

    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(vec![TemplateInfo {
            name: self.template.clone(),
            version: 1,
            created_unix_ms: self.started_unix_ms,
            path: Default::default(),
            defaults: Default::default(),
            source: "fake".into(),
        }])
    }

    async fn import_template(
        &self,
        name: &str,
        _source: space_node_api::TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        Err(NodeError::Conflict(format!(
            "a fake node imports no template ({name})"
        )))
    }

    async fn node_info(&self) -> Result<NodeInfo, NodeError> {
        Ok(NodeInfo {
            name: self.name.clone(),
            runtimes: vec![RuntimeKind::Namespace],
            cpus: self.cpus,
            memory_bytes: self.memory_bytes,
            memory_available_bytes: self.memory_bytes,
            sandboxes: self.sandboxes.lock().unwrap().len() as u32,
            pool_ready: 0,
            started_unix_ms: self.started_unix_ms,
            templates: vec![self.template.clone()],
            pool_ready_by_template: BTreeMap::new(),
        })
    }
}

/// A fake node that joined: its service and heartbeats run until it is dropped.
pub struct FakeAgent {
    pub node: Arc<FakeNode>,
    /// Its id in the cluster.
    pub id: String,
    /// Where the control plane reaches it.
    pub address: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Joins `node` to the control plane at `controls` (HOST:PORT, comma-separated replicas; the
/// join goes to the first) with `token`, serving on `ip` (a free port), as `spaced node` does.
/// `scratch` is the node service's upload directory.
pub async fn join_fake(
    node: FakeNode,
    ip: IpAddr,
    controls: &str,
    token: &str,
    scratch: &Path,
) -> Result<FakeAgent> {
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .context("bind a fake node's listener")?;
    let address = listener.local_addr()?;
    let first = controls.split(',').next().unwrap_or(controls);
    let mut m = space_rpc::join::join(first, token, &node.name, &address.to_string())
        .await
        .map_err(anyhow::Error::msg)?;
    m.control = controls.to_owned();
    let config = space_rpc::tls::node_server_config(&m.tls().map_err(anyhow::Error::msg)?)
        .map_err(anyhow::Error::msg)?;
    let tls = space_rpc::tls::TlsListener::new(listener, config)?;
    let node = Arc::new(node);
    let service = space_rpc::NodeService::new(node.clone(), scratch.to_owned(), 1 << 20);
    let serve = tokio::spawn(async move {
        let _ = axum::serve(tls, space_rpc::router(service)).await;
    });
    let control = m.control_client().map_err(anyhow::Error::msg)?;
    let beat = tokio::spawn(space_rpc::join::heartbeats(
        control,
        space_control::cluster::HEARTBEAT_EVERY,
        node.clone(),
    ));
    Ok(FakeAgent {
        node,
        id: m.node_id,
        address,
        tasks: vec![serve, beat],
    })
}
