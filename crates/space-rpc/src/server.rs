//! The node agent's end: `space.node.v1.Node` over any [`NodeApi`], and the guest calls it
//! forwards to sandboxes' channels. [`router`] is the whole service, for axum to serve on the
//! node's listener.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::response::Response;
use space_node_api::guest::SANDBOX_HEADER;
use space_node_api::{NodeApi, NodeError, TemplateSource};
use space_proto::node::node_server::{Node, NodeServer};
use space_proto::node::{
    CallReply, CallRequest, ImportEvent, ImportPart, MovePart, MoveRequest, PortData, import_event,
    move_part,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{OnceCell, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};
use tower::ServiceExt;

use crate::wire::{self, ImportHeader, Op, Source};

/// How long a node remembers what an operation answered, for retries with its id.
pub const OP_MEMORY: Duration = Duration::from_secs(600);
/// Operations remembered at most (the oldest are forgotten first).
pub const OP_MEMORY_MAX: usize = 10_000;
/// Largest message either end accepts (a listing of many sandboxes is one message).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Bytes read from a port's connection per message.
const PORT_CHUNK: usize = 64 << 10;

/// What a node remembers of the operations it did: the answer of each that succeeded, by
/// operation id, so a retry (the caller never saw the answer) gets it again without the work
/// being done twice. Two calls with one id at once run it once: the second waits.
#[derive(Default)]
struct Operations {
    done: Mutex<HashMap<String, (Instant, Answer)>>,
}

/// An operation's answer once it has one; callers with its id wait on it meanwhile.
type Answer = Arc<OnceCell<Vec<u8>>>;

impl Operations {
    async fn run<F>(&self, id: &str, work: F) -> Result<Vec<u8>, NodeError>
    where
        F: Future<Output = Result<Vec<u8>, NodeError>>,
    {
        let cell = {
            let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
            if !done.contains_key(id) && done.len() >= OP_MEMORY_MAX {
                let now = Instant::now();
                done.retain(|_, (at, _)| now.duration_since(*at) < OP_MEMORY);
                if done.len() >= OP_MEMORY_MAX
                    && let Some(oldest) = done
                        .iter()
                        .min_by_key(|(_, (at, _))| *at)
                        .map(|(k, _)| k.clone())
                {
                    done.remove(&oldest);
                }
            }
            done.entry(id.to_owned())
                .or_insert_with(|| (Instant::now(), Arc::new(OnceCell::new())))
                .1
                .clone()
        };
        // A failure leaves the cell empty: the next try does the work again.
        cell.get_or_try_init(|| work).await.cloned()
    }
}

/// The gRPC service over `node`.
pub struct NodeService {
    node: Arc<dyn NodeApi>,
    ops: Operations,
    /// Where uploaded template archives are written until imported.
    scratch: PathBuf,
    /// The largest upload accepted.
    max_upload: u64,
}

impl NodeService {
    pub fn new(node: Arc<dyn NodeApi>, scratch: PathBuf, max_upload: u64) -> Self {
        Self {
            node,
            ops: Operations::default(),
            scratch,
            max_upload,
        }
    }

    async fn dispatch(&self, op: Op) -> Result<Vec<u8>, NodeError> {
        let n = &self.node;
        fn json<T: serde::Serialize>(v: T) -> Result<Vec<u8>, NodeError> {
            serde_json::to_vec(&v).map_err(|e| NodeError::Internal(format!("encode: {e}")))
        }
        match op {
            Op::CreateSandbox { spec } => json(n.create_sandbox(&spec).await?),
            Op::RemoveSandbox { id } => json(n.remove_sandbox(&id).await?),
            Op::StopSandbox { id } => json(n.stop_sandbox(&id).await?),
            Op::SandboxStatus { id } => json(n.sandbox_status(&id).await?),
            Op::ListSandboxes => json(n.list_sandboxes().await?),
            Op::ListTemplates => json(n.list_templates().await?),
            Op::TemplateVersions { name } => json(n.template_versions(&name).await?),
            Op::RemoveTemplate { name, version } => json(n.remove_template(&name, version).await?),
            Op::PauseSandbox { id } => json(n.pause_sandbox(&id).await?),
            Op::ResumeSandbox { id } => json(n.resume_sandbox(&id).await?),
            Op::ValidateNetwork { network } => json(n.validate_network(&network).await?),
            Op::SetNetwork { id, network } => json(n.set_network(&id, &network).await?),
            Op::SnapshotSandbox { id, snap } => json(n.snapshot_sandbox(&id, &snap).await?),
            Op::CheckpointSandbox { id, snap } => json(n.checkpoint_sandbox(&id, &snap).await?),
            Op::ListSnapshots { id, with_size } => json(n.list_snapshots(&id, with_size).await?),
            Op::DiffSandbox { id, from, to } => {
                json(n.diff_sandbox(&id, from.as_deref(), to.as_deref()).await?)
            }
            Op::DeleteSnapshot { id, snap } => json(n.delete_snapshot(&id, &snap).await?),
            Op::ChangedSinceSnapshot { id, owner, snap } => {
                json(n.changed_since_snapshot(&id, &owner, &snap).await?)
            }
            Op::RollbackSandbox { spec, snap } => json(n.rollback_sandbox(&spec, &snap).await?),
            Op::ForkSandbox { source, snap, spec } => {
                json(n.fork_sandbox(&source, &snap, &spec).await?)
            }
            Op::Metrics => json(n.metrics().await),
            Op::SetPool { template, cfg } => json(n.set_pool(&template, cfg).await?),
            Op::Pools => json(n.pools().await),
            Op::NodeInfo => json(n.node_info().await?),
            Op::SandboxUsage { id } => json(n.sandbox_usage(&id).await?),
            Op::AdoptSandbox { spec } => json(n.adopt_sandbox(&spec).await?),
            Op::DiscardMove { id } => json(n.discard_move(&id).await?),
            Op::DropReplica { id, keep } => json(n.drop_replica(&id, &keep).await?),
            Op::RestoreReplica { spec, snap } => json(n.restore_replica(&spec, &snap).await?),
        }
    }

    /// Writes an uploaded archive (the rest of `inbound`, after `first`) to a scratch file.
    async fn receive_upload(
        &self,
        first: Vec<u8>,
        inbound: &mut Streaming<ImportPart>,
    ) -> Result<tempfile::TempPath, Status> {
        let io = |what: &'static str| {
            move |e: std::io::Error| Status::internal(format!("{what} the uploaded archive: {e}"))
        };
        let tmp = tempfile::Builder::new()
            .prefix(".upload-")
            .tempfile_in(&self.scratch)
            .map_err(io("keep"))?;
        let (file, path) = tmp.into_parts();
        let mut file = tokio::fs::File::from_std(file);
        let mut total = first.len() as u64;
        file.write_all(&first).await.map_err(io("write"))?;
        while let Some(part) = inbound.message().await? {
            total += part.data.len() as u64;
            if total > self.max_upload {
                return Err(Status::resource_exhausted(format!(
                    "the archive is larger than this node's limit of {} bytes",
                    self.max_upload
                )));
            }
            file.write_all(&part.data).await.map_err(io("write"))?;
        }
        file.flush().await.map_err(io("write"))?;
        Ok(path)
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Node for NodeService {
    async fn call(
        &self,
        req: tonic::Request<CallRequest>,
    ) -> Result<tonic::Response<CallReply>, Status> {
        let CallRequest {
            request,
            operation_id,
        } = req.into_inner();
        let op: Op = serde_json::from_slice(&request)
            .map_err(|e| Status::invalid_argument(format!("not an operation of this node: {e}")))?;
        let name = op.name();
        let reply = if op.mutates() && !operation_id.is_empty() {
            self.ops.run(&operation_id, self.dispatch(op)).await
        } else {
            self.dispatch(op).await
        };
        match reply {
            Ok(reply) => Ok(tonic::Response::new(CallReply { reply })),
            Err(e) => {
                tracing::debug!(op = name, error = %e, "node operation failed");
                Err(wire::status(&e))
            }
        }
    }

    type PortStream = BoxStream<PortData>;

    async fn port(
        &self,
        req: tonic::Request<Streaming<PortData>>,
    ) -> Result<tonic::Response<Self::PortStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound.message().await?.ok_or_else(|| {
            Status::invalid_argument("a port stream starts with its sandbox and port")
        })?;
        let port = u16::try_from(first.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| Status::invalid_argument(format!("bad port {}", first.port)))?;
        let conn = self
            .node
            .connect_port(&first.sandbox_id, port)
            .await
            .map_err(|e| wire::status(&e))?;
        let (mut rd, mut wr) = tokio::io::split(conn);
        tokio::spawn(async move {
            let pump = async {
                if !first.data.is_empty() {
                    wr.write_all(&first.data).await?;
                }
                while let Ok(Some(m)) = inbound.message().await {
                    wr.write_all(&m.data).await?;
                }
                wr.shutdown().await
            };
            let _ = pump.await;
        });
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut buf = vec![0u8; PORT_CHUNK];
            loop {
                let msg = match rd.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => Ok(PortData {
                        data: buf[..n].to_vec(),
                        ..Default::default()
                    }),
                    Err(e) => Err(Status::aborted(format!("port connection: {e}"))),
                };
                let end = msg.is_err();
                if tx.send(msg).await.is_err() || end {
                    break;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ImportTemplateStream = BoxStream<ImportEvent>;

    async fn import_template(
        &self,
        req: tonic::Request<Streaming<ImportPart>>,
    ) -> Result<tonic::Response<Self::ImportTemplateStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("an import starts with its header"))?;
        let header: ImportHeader = serde_json::from_slice(&first.header)
            .map_err(|e| Status::invalid_argument(format!("bad import header: {e}")))?;
        let mut upload = None;
        let source = match header.source {
            Source::Upload => {
                let path = self.receive_upload(first.data, &mut inbound).await?;
                let source = TemplateSource::Tar(path.to_path_buf());
                upload = Some(path);
                source
            }
            Source::Snapshot {
                sandbox,
                snapshot,
                defaults,
            } => TemplateSource::Snapshot {
                sandbox,
                snapshot,
                defaults,
            },
            Source::Registry {
                reference,
                username,
                password,
                insecure,
            } => TemplateSource::Registry(space_node_api::PullSpec {
                reference,
                username,
                password,
                insecure,
            }),
            Source::Derived { from, defaults } => TemplateSource::Derived { from, defaults },
        };
        let node = self.node.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let (ptx, mut prx) = mpsc::unbounded_channel();
            let import = node.import_template_with_progress(&header.name, source, ptx);
            tokio::pin!(import);
            let done = loop {
                tokio::select! {
                    Some(ev) = prx.recv() => {
                        let event = serde_json::to_vec(&ev).unwrap_or_default();
                        let _ = tx
                            .send(Ok(ImportEvent { event: Some(import_event::Event::Progress(event)) }))
                            .await;
                    }
                    r = &mut import => break r,
                }
            };
            while let Ok(ev) = prx.try_recv() {
                let event = serde_json::to_vec(&ev).unwrap_or_default();
                let _ = tx
                    .send(Ok(ImportEvent {
                        event: Some(import_event::Event::Progress(event)),
                    }))
                    .await;
            }
            let last = done.map_err(|e| wire::status(&e)).and_then(|info| {
                serde_json::to_vec(&info)
                    .map(|v| ImportEvent {
                        event: Some(import_event::Event::Done(v)),
                    })
                    .map_err(|e| Status::internal(format!("encode: {e}")))
            });
            let _ = tx.send(last).await;
            drop(upload);
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type SendSandboxStream = BoxStream<MovePart>;

    async fn send_sandbox(
        &self,
        req: tonic::Request<MoveRequest>,
    ) -> Result<tonic::Response<Self::SendSandboxStream>, Status> {
        let MoveRequest {
            sandbox_id,
            step,
            template,
            replica,
            have,
        } = req.into_inner();
        let parts = if replica {
            self.node.send_replica(&sandbox_id, &have).await
        } else if template.is_empty() {
            let step = wire::move_step(&step).map_err(|e| wire::status(&e))?;
            self.node.send_sandbox(&sandbox_id, step, &have).await
        } else {
            self.node.send_template(&template).await
        }
        .map_err(|e| wire::status(&e))?;
        Ok(tonic::Response::new(Box::pin(parts.map(|p| {
            p.map(wire::move_message).map_err(|e| wire::status(&e))
        }))))
    }

    async fn receive_sandbox(
        &self,
        req: tonic::Request<Streaming<MovePart>>,
    ) -> Result<tonic::Response<CallReply>, Status> {
        let mut inbound = req.into_inner();
        let header = match inbound.message().await?.and_then(|m| m.part) {
            Some(move_part::Part::Header(h)) => h,
            _ => return Err(Status::invalid_argument("a move starts with its header")),
        };
        let parts: space_node_api::moves::MoveStream = Box::pin(inbound.map(|m| match m {
            Ok(m) => wire::move_part(m),
            Err(s) => Err(wire::node_error("the sending side", &s)),
        }));
        let reply = if header.replica {
            self.node
                .receive_replica(&header.sandbox_id, parts)
                .await
                .map(|got| serde_json::to_vec(&got))
        } else if header.template.is_empty() {
            let step = wire::move_step(&header.step).map_err(|e| wire::status(&e))?;
            self.node
                .receive_sandbox(&header.sandbox_id, step, &header.have, parts)
                .await
                .map(|got| serde_json::to_vec(&got))
        } else {
            self.node
                .receive_template(&header.template, parts)
                .await
                .map(|info| serde_json::to_vec(&info))
        }
        .map_err(|e| wire::status(&e))?
        .map_err(|e| Status::internal(format!("encode: {e}")))?;
        Ok(tonic::Response::new(CallReply { reply }))
    }
}

/// The node agent's service: `space.node.v1.Node` and the guest calls it forwards.
pub fn router(service: NodeService) -> axum::Router {
    let node = service.node.clone();
    let grpc = NodeServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let guest = axum::Router::new()
        .route(
            "/space.guest.v1.Guest/{method}",
            axum::routing::post(forward_guest),
        )
        .with_state(node);
    tonic::service::Routes::new(grpc)
        .into_axum_router()
        .merge(guest)
}

/// A guest call for the sandbox its header names, sent on that sandbox's channel as it came
/// (body, trailers and all) and answered the same way.
async fn forward_guest(State(node): State<Arc<dyn NodeApi>>, req: Request) -> Response {
    let Some(id) = req
        .headers()
        .get(SANDBOX_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return failed(Status::invalid_argument(format!(
            "a guest call through the node names its sandbox in {SANDBOX_HEADER}"
        )));
    };
    let channel = match node.guest_channel(&id).await {
        Ok(c) => c.channel().clone(),
        Err(e) => return failed(wire::status(&e)),
    };
    let (mut parts, body) = req.into_parts();
    parts.headers.remove(SANDBOX_HEADER);
    let req = axum::http::Request::from_parts(parts, tonic::body::Body::new(body));
    match channel.oneshot(req).await {
        Ok(resp) => resp.map(axum::body::Body::new),
        Err(e) => failed(wire::status(&NodeError::Unavailable {
            id,
            reason: e.to_string(),
        })),
    }
}

fn failed(s: Status) -> Response {
    s.into_http()
}
