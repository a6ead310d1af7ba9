//! The control plane's end: [`RemoteNode`], a [`NodeApi`] whose every operation is a call to
//! a node agent over one HTTP/2 connection (tonic's `Channel`, which reconnects by itself).
//! Mutating operations carry an operation id and are retried with it when the connection
//! failed before an answer came (the node does each once).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use space_node_api::diff::Change;
use space_node_api::moves::{MoveStep, MoveStream, Received};
use space_node_api::net::NetworkSpec;
use space_node_api::{
    GuestChannel, NodeApi, NodeError, NodeInfo, PoolConfig, PoolStatus, PortStream, SandboxSpec,
    SandboxStatus, SandboxUsage, SnapshotInfo, TemplateInfo, TemplateProgress, TemplateSource,
};
use space_proto::node::node_client::NodeClient;
use space_proto::node::{CallRequest, ImportPart, MoveRequest, PortData, import_event, move_part};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::server::MAX_MESSAGE_BYTES;
use crate::wire::{self, ImportHeader, Op, Source};

/// Tries of an operation whose connection failed before it was answered.
const TRIES: u32 = 3;
/// Bytes of an uploaded archive per message.
const UPLOAD_CHUNK: usize = 256 << 10;
/// Bytes of a port stream per message, and the buffer between the stream and its reader.
const PORT_CHUNK: usize = 64 << 10;

/// A node agent reached over gRPC.
#[derive(Debug, Clone)]
pub struct RemoteNode {
    /// The node's name, in errors.
    name: String,
    channel: Channel,
}

impl RemoteNode {
    /// The node `name` at the other end of `channel`.
    pub fn new(name: impl Into<String>, channel: Channel) -> Self {
        Self {
            name: name.into(),
            channel,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn client(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    fn unreachable(name: &str, reason: impl std::fmt::Display) -> NodeError {
        NodeError::Unreachable {
            node: name.to_owned(),
            reason: reason.to_string(),
        }
    }

    async fn call<T: DeserializeOwned>(&self, op: Op) -> Result<T, NodeError> {
        let operation_id = if op.mutates() {
            operation_id()
        } else {
            String::new()
        };
        let name = op.name();
        let request = serde_json::to_vec(&op)
            .map_err(|e| NodeError::Internal(format!("encode {name}: {e}")))?;
        let (node, client) = (self.name.as_str(), self.client());
        let mut tries = 0;
        let reply = loop {
            tries += 1;
            let req = CallRequest {
                request: request.clone(),
                operation_id: operation_id.clone(),
            };
            match client.clone().call(req).await {
                Ok(r) => break r.into_inner().reply,
                // No answer from the node itself (no details): the connection failed. The
                // same operation id makes another try safe.
                Err(s)
                    if s.details().is_empty()
                        && s.code() == tonic::Code::Unavailable
                        && tries < TRIES =>
                {
                    tracing::debug!(node = %node, op = name, error = %s, "retrying");
                    tokio::time::sleep(Duration::from_millis(100 << tries)).await;
                }
                Err(s) => return Err(wire::node_error(node, &s)),
            }
        };
        serde_json::from_slice(&reply)
            .map_err(|e| Self::unreachable(node, format!("unreadable answer to {name}: {e}")))
    }

    async fn import(
        &self,
        name: &str,
        source: TemplateSource,
        progress: Option<TemplateProgress>,
    ) -> Result<TemplateInfo, NodeError> {
        let (source, archive) = match source {
            TemplateSource::Tar(path) => (Source::Upload, Some(path)),
            TemplateSource::Dir(path) => {
                return Err(NodeError::InvalidArgument(format!(
                    "{} is a directory on this host, which node {} cannot read: send it as a tar archive",
                    path.display(),
                    self.name()
                )));
            }
            TemplateSource::Snapshot {
                sandbox,
                snapshot,
                defaults,
            } => (
                Source::Snapshot {
                    sandbox,
                    snapshot,
                    defaults,
                },
                None,
            ),
            TemplateSource::Registry(p) => (Source::registry(p), None),
            TemplateSource::Derived { from, defaults } => {
                (Source::Derived { from, defaults }, None)
            }
        };
        let header = serde_json::to_vec(&ImportHeader {
            name: name.to_owned(),
            source,
        })
        .map_err(|e| NodeError::Internal(format!("encode import: {e}")))?;
        let (tx, rx) = mpsc::channel(4);
        let _ = tx
            .send(ImportPart {
                header,
                data: Vec::new(),
            })
            .await;
        // The archive streams while the call waits for the node's first answer.
        let sender = archive.map(|path| {
            tokio::spawn(async move {
                let mut f = tokio::fs::File::open(&path)
                    .await
                    .map_err(|e| NodeError::Internal(format!("open {}: {e}", path.display())))?;
                let mut buf = vec![0u8; UPLOAD_CHUNK];
                loop {
                    let n = f.read(&mut buf).await.map_err(|e| {
                        NodeError::Internal(format!("read {}: {e}", path.display()))
                    })?;
                    if n == 0 {
                        return Ok::<(), NodeError>(());
                    }
                    let part = ImportPart {
                        header: Vec::new(),
                        data: buf[..n].to_vec(),
                    };
                    if tx.send(part).await.is_err() {
                        return Ok(());
                    }
                }
            })
        });
        let (node, mut client) = (self.name.as_str(), self.client());
        let mut events = client
            .import_template(ReceiverStream::new(rx))
            .await
            .map_err(|s| wire::node_error(node, &s))?
            .into_inner();
        if let Some(sender) = sender {
            sender
                .await
                .map_err(|e| NodeError::Internal(format!("upload: {e}")))??;
        }
        while let Some(ev) = events
            .message()
            .await
            .map_err(|s| wire::node_error(node, &s))?
        {
            match ev.event {
                Some(import_event::Event::Progress(p)) => {
                    if let (Some(progress), Ok(ev)) = (&progress, serde_json::from_slice(&p)) {
                        let _ = progress.send(ev);
                    }
                }
                Some(import_event::Event::Done(info)) => {
                    return serde_json::from_slice(&info).map_err(|e| {
                        Self::unreachable(node, format!("unreadable import answer: {e}"))
                    });
                }
                None => {}
            }
        }
        Err(Self::unreachable(
            node,
            "the import ended without an answer",
        ))
    }
}

impl RemoteNode {
    /// A stream of a sandbox's or a template's parts from this node.
    async fn pull(&self, req: MoveRequest) -> Result<MoveStream, NodeError> {
        let node = self.name.clone();
        let parts = self
            .client()
            .send_sandbox(req)
            .await
            .map_err(|s| wire::node_error(&node, &s))?
            .into_inner();
        Ok(Box::pin(parts.map(move |m| match m {
            Ok(m) => wire::move_part(m),
            Err(s) => Err(wire::node_error(&node, &s)),
        })))
    }

    /// `parts` to this node as they come, after `header`; its answer, as JSON. When `parts`
    /// fails (the sending node's error), the stream to this node is cut before its end, and
    /// that error is the answer.
    async fn push<T: DeserializeOwned>(
        &self,
        header: MoveRequest,
        mut parts: MoveStream,
    ) -> Result<T, NodeError> {
        let failed = Arc::new(std::sync::Mutex::new(None));
        let (tx, rx) = mpsc::channel(8);
        let _ = tx
            .send(space_proto::node::MovePart {
                part: Some(move_part::Part::Header(header)),
            })
            .await;
        let keep = failed.clone();
        let pump = tokio::spawn(async move {
            while let Some(p) = parts.next().await {
                match p {
                    Ok(p) => {
                        if tx.send(wire::move_message(p)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        *keep.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        return;
                    }
                }
            }
        });
        let reply = self.client().receive_sandbox(ReceiverStream::new(rx)).await;
        pump.abort();
        if let Some(e) = failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e);
        }
        let reply = reply
            .map_err(|s| wire::node_error(&self.name, &s))?
            .into_inner()
            .reply;
        serde_json::from_slice(&reply).map_err(|e| {
            Self::unreachable(&self.name, format!("unreadable answer to receive: {e}"))
        })
    }
}

/// A fresh operation id: 128 random bits in hex.
fn operation_id() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}

#[async_trait]
impl NodeApi for RemoteNode {
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        self.call(Op::CreateSandbox { spec: spec.clone() }).await
    }

    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.call(Op::RemoveSandbox { id: id.to_owned() }).await
    }

    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.call(Op::StopSandbox { id: id.to_owned() }).await
    }

    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        self.call(Op::SandboxStatus { id: id.to_owned() }).await
    }

    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        self.call(Op::ListSandboxes).await
    }

    /// No call: the node answers for the sandbox when a guest call reaches it (NotFound,
    /// or Conflict while it is paused), in that call's status.
    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        GuestChannel::via_node(self.channel.clone(), id)
    }

    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        self.call(Op::ListTemplates).await
    }

    async fn pause_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.call(Op::PauseSandbox { id: id.to_owned() }).await
    }

    async fn resume_sandbox(&self, id: &str) -> Result<SandboxStatus, NodeError> {
        self.call(Op::ResumeSandbox { id: id.to_owned() }).await
    }

    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        self.import(name, source, None).await
    }

    async fn template_versions(&self, name: &str) -> Result<Vec<TemplateInfo>, NodeError> {
        self.call(Op::TemplateVersions {
            name: name.to_owned(),
        })
        .await
    }

    async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Vec<u32>, NodeError> {
        self.call(Op::RemoveTemplate {
            name: name.to_owned(),
            version,
        })
        .await
    }

    async fn import_template_with_progress(
        &self,
        name: &str,
        source: TemplateSource,
        progress: TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        self.import(name, source, Some(progress)).await
    }

    async fn validate_network(&self, network: &NetworkSpec) -> Result<(), NodeError> {
        self.call(Op::ValidateNetwork {
            network: network.clone(),
        })
        .await
    }

    async fn set_network(
        &self,
        id: &str,
        network: &NetworkSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.call(Op::SetNetwork {
            id: id.to_owned(),
            network: network.clone(),
        })
        .await
    }

    async fn connect_port(&self, id: &str, port: u16) -> Result<PortStream, NodeError> {
        let (tx, rx) = mpsc::channel(8);
        let _ = tx
            .send(PortData {
                sandbox_id: id.to_owned(),
                port: port.into(),
                data: Vec::new(),
            })
            .await;
        // The node answers once it has connected (or failed to): errors come here.
        let (node, mut client) = (self.name.as_str(), self.client());
        let mut inbound = client
            .port(ReceiverStream::new(rx))
            .await
            .map_err(|s| wire::node_error(node, &s))?
            .into_inner();
        let (ours, theirs) = tokio::io::duplex(PORT_CHUNK);
        let (mut rd, mut wr) = tokio::io::split(ours);
        tokio::spawn(async move {
            let mut buf = vec![0u8; PORT_CHUNK];
            while let Ok(n) = rd.read(&mut buf).await {
                let data = buf[..n].to_vec();
                // 0: the reader closed its writing side; ending the stream says so.
                if n == 0
                    || tx
                        .send(PortData {
                            data,
                            ..Default::default()
                        })
                        .await
                        .is_err()
                {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if wr.write_all(&m.data).await.is_err() {
                    return;
                }
            }
            let _ = wr.shutdown().await;
        });
        Ok(Box::new(theirs))
    }

    async fn snapshot_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.call(Op::SnapshotSandbox {
            id: id.to_owned(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn checkpoint_sandbox(&self, id: &str, snap: &str) -> Result<SnapshotInfo, NodeError> {
        self.call(Op::CheckpointSandbox {
            id: id.to_owned(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn list_snapshots(
        &self,
        id: &str,
        with_size: bool,
    ) -> Result<Vec<SnapshotInfo>, NodeError> {
        self.call(Op::ListSnapshots {
            id: id.to_owned(),
            with_size,
        })
        .await
    }

    async fn diff_sandbox(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<Change>, NodeError> {
        self.call(Op::DiffSandbox {
            id: id.to_owned(),
            from: from.map(str::to_owned),
            to: to.map(str::to_owned),
        })
        .await
    }

    async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        self.call(Op::DeleteSnapshot {
            id: id.to_owned(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn changed_since_snapshot(
        &self,
        id: &str,
        owner: &str,
        snap: &str,
    ) -> Result<bool, NodeError> {
        self.call(Op::ChangedSinceSnapshot {
            id: id.to_owned(),
            owner: owner.to_owned(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn rollback_sandbox(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.call(Op::RollbackSandbox {
            spec: spec.clone(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn fork_sandbox(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.call(Op::ForkSandbox {
            source: source.to_owned(),
            snap: snap.to_owned(),
            spec: spec.clone(),
        })
        .await
    }

    /// Empty when the node does not answer (the scrape goes on without its series).
    async fn metrics(&self) -> Vec<(String, f64)> {
        self.call(Op::Metrics).await.unwrap_or_else(|e| {
            tracing::warn!(node = %self.name(), error = %e, "no metrics from the node");
            Vec::new()
        })
    }

    async fn set_pool(&self, template: &str, cfg: PoolConfig) -> Result<PoolStatus, NodeError> {
        self.call(Op::SetPool {
            template: template.to_owned(),
            cfg,
        })
        .await
    }

    /// Empty when the node does not answer.
    async fn pools(&self) -> Vec<PoolStatus> {
        self.call(Op::Pools).await.unwrap_or_else(|e| {
            tracing::warn!(node = %self.name(), error = %e, "no pools from the node");
            Vec::new()
        })
    }

    async fn node_info(&self) -> Result<NodeInfo, NodeError> {
        self.call(Op::NodeInfo).await
    }

    async fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, NodeError> {
        self.call(Op::SandboxUsage { id: id.to_owned() }).await
    }

    async fn send_sandbox(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
    ) -> Result<MoveStream, NodeError> {
        self.pull(MoveRequest {
            sandbox_id: id.to_owned(),
            step: step.as_str().to_owned(),
            have: have.to_vec(),
            ..Default::default()
        })
        .await
    }

    async fn receive_sandbox(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
        parts: MoveStream,
    ) -> Result<Received, NodeError> {
        let header = MoveRequest {
            sandbox_id: id.to_owned(),
            step: step.as_str().to_owned(),
            have: have.to_vec(),
            ..Default::default()
        };
        self.push(header, parts).await
    }

    async fn send_template(&self, name: &str) -> Result<MoveStream, NodeError> {
        self.pull(MoveRequest {
            template: name.to_owned(),
            ..Default::default()
        })
        .await
    }

    async fn receive_template(
        &self,
        name: &str,
        parts: MoveStream,
    ) -> Result<TemplateInfo, NodeError> {
        let header = MoveRequest {
            template: name.to_owned(),
            ..Default::default()
        };
        self.push(header, parts).await
    }

    async fn adopt_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        self.call(Op::AdoptSandbox { spec: spec.clone() }).await
    }

    async fn send_replica(&self, id: &str, have: &[String]) -> Result<MoveStream, NodeError> {
        self.pull(MoveRequest {
            sandbox_id: id.to_owned(),
            replica: true,
            have: have.to_vec(),
            ..Default::default()
        })
        .await
    }

    async fn receive_replica(&self, id: &str, parts: MoveStream) -> Result<Received, NodeError> {
        let header = MoveRequest {
            sandbox_id: id.to_owned(),
            replica: true,
            ..Default::default()
        };
        self.push(header, parts).await
    }

    async fn drop_replica(&self, id: &str, keep: &[String]) -> Result<Vec<String>, NodeError> {
        self.call(Op::DropReplica {
            id: id.to_owned(),
            keep: keep.to_vec(),
        })
        .await
    }

    async fn restore_replica(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.call(Op::RestoreReplica {
            spec: spec.clone(),
            snap: snap.to_owned(),
        })
        .await
    }

    async fn discard_move(&self, id: &str) -> Result<(), NodeError> {
        self.call(Op::DiscardMove { id: id.to_owned() }).await
    }
}

#[cfg(test)]
impl RemoteNode {
    pub(crate) fn channel_for_tests(&self) -> Channel {
        self.channel.clone()
    }
}
