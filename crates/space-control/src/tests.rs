//! Router tests: `app(state).oneshot(request)` against a fake node and a fake guest server
//! (tonic over a unix socket in a temp dir).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use futures::StreamExt;
use http_body_util::BodyExt;
use space_api::{ErrorBody, ExecEvent, Sandbox, SandboxState};
use space_node_api::{
    GuestChannel, NodeApi, NodeError, Phase, SandboxSpec, SandboxStatus, TemplateInfo,
    TemplateSource,
};
use space_proto as pb;
use space_proto::guest_server::{Guest, GuestServer};
use tokio::sync::OnceCell;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request as TReq, Response as TResp, Status};
use tower::ServiceExt;

use crate::reconcile::{Backoff, ERROR_SANDBOX_LOST};
use crate::{AppState, Auth, ControlConfig, ControlPlane, app};

// ---------------------------------------------------------------- fake guest

#[derive(Default)]
struct FakeGuest {
    files: Mutex<BTreeMap<String, Vec<u8>>>,
    calls: Mutex<Vec<String>>,
}

type EventStream = futures::stream::BoxStream<'static, Result<pb::ProcessEvent, Status>>;

fn ev(e: pb::process_event::Event) -> Result<pb::ProcessEvent, Status> {
    Ok(pb::ProcessEvent { event: Some(e) })
}

fn entry(path: &str, size: u64, dir: bool) -> pb::EntryInfo {
    pb::EntryInfo {
        name: path.rsplit('/').next().unwrap_or("").to_string(),
        path: path.to_string(),
        r#type: if dir {
            pb::FileType::Dir
        } else {
            pb::FileType::File
        } as i32,
        size,
        mode: 0o644,
        ..Default::default()
    }
}

#[async_trait]
impl Guest for FakeGuest {
    async fn info(&self, _: TReq<pb::InfoRequest>) -> Result<TResp<pb::InfoReply>, Status> {
        Ok(TResp::new(pb::InfoReply::default()))
    }

    type ExecStream = EventStream;

    async fn exec(&self, r: TReq<pb::ExecRequest>) -> Result<TResp<EventStream>, Status> {
        use pb::process_event::Event;
        let r = r.into_inner();
        self.calls
            .lock()
            .unwrap()
            .push(format!("exec {:?}", r.argv));
        let started = ev(Event::Started(pb::Started { pid: 7 }));
        let events: Vec<Result<pb::ProcessEvent, Status>> = match r.argv[0].as_str() {
            "missing" => return Err(Status::not_found("executable missing not found")),
            "echo" => vec![
                started,
                ev(Event::Output(pb::Output {
                    stream: pb::Stream::Stdout as i32,
                    offset: 0,
                    data: r.argv[1..].join(" ").into_bytes(),
                })),
                ev(Event::Output(pb::Output {
                    stream: pb::Stream::Stderr as i32,
                    offset: 2,
                    data: b"e".to_vec(),
                })),
                ev(Event::Exit(pb::Exit {
                    code: 3,
                    ..Default::default()
                })),
            ],
            "killed" => vec![
                started,
                ev(Event::Exit(pb::Exit {
                    signal: 9,
                    signaled: true,
                    ..Default::default()
                })),
            ],
            _ => vec![started, Err(Status::internal("secret guest failure"))],
        };
        Ok(TResp::new(futures::stream::iter(events).boxed()))
    }

    async fn start(&self, r: TReq<pb::ExecRequest>) -> Result<TResp<pb::StartReply>, Status> {
        let r = r.into_inner();
        self.calls.lock().unwrap().push(format!(
            "start {:?} tag={} env={}",
            r.argv,
            r.tag,
            r.env.len()
        ));
        if r.argv.first().is_some_and(|a| a == "missing") {
            return Err(Status::not_found("executable missing not found"));
        }
        Ok(TResp::new(pb::StartReply { pid: 8 }))
    }

    type AttachStream = EventStream;

    async fn attach(&self, r: TReq<pb::AttachRequest>) -> Result<TResp<EventStream>, Status> {
        use pb::process_event::Event;
        let r = r.into_inner();
        if r.pid == 99 {
            return Err(Status::not_found("no process 99"));
        }
        if r.offset > 10 {
            return Err(Status::out_of_range("offset beyond the end"));
        }
        let events = vec![
            ev(Event::Output(pb::Output {
                stream: pb::Stream::Stdout as i32,
                offset: r.offset,
                data: b"later".to_vec(),
            })),
            ev(Event::Exit(pb::Exit::default())),
        ];
        Ok(TResp::new(futures::stream::iter(events).boxed()))
    }

    async fn list_processes(
        &self,
        _: TReq<pb::ListProcessesRequest>,
    ) -> Result<TResp<pb::ListProcessesReply>, Status> {
        Ok(TResp::new(pb::ListProcessesReply {
            processes: vec![pb::ProcessInfo {
                pid: 7,
                argv: vec!["sleep".into(), "1".into()],
                running: true,
                ..Default::default()
            }],
        }))
    }

    async fn signal(&self, r: TReq<pb::SignalRequest>) -> Result<TResp<pb::Empty>, Status> {
        let r = r.into_inner();
        self.calls
            .lock()
            .unwrap()
            .push(format!("signal {} {} {}", r.pid, r.signal, r.group));
        Ok(TResp::new(pb::Empty {}))
    }

    async fn write_stdin(&self, r: TReq<pb::StdinRequest>) -> Result<TResp<pb::Empty>, Status> {
        let r = r.into_inner();
        self.calls.lock().unwrap().push(format!(
            "stdin {} {}",
            r.pid,
            String::from_utf8_lossy(&r.data)
        ));
        Ok(TResp::new(pb::Empty {}))
    }

    async fn close_stdin(&self, r: TReq<pb::PidRequest>) -> Result<TResp<pb::Empty>, Status> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("close {}", r.into_inner().pid));
        Ok(TResp::new(pb::Empty {}))
    }

    async fn resize(&self, r: TReq<pb::ResizeRequest>) -> Result<TResp<pb::Empty>, Status> {
        let r = r.into_inner();
        self.calls
            .lock()
            .unwrap()
            .push(format!("resize {} {}x{}", r.pid, r.rows, r.cols));
        Ok(TResp::new(pb::Empty {}))
    }

    type ReadFileStream = futures::stream::BoxStream<'static, Result<pb::FileChunk, Status>>;

    async fn read_file(
        &self,
        r: TReq<pb::ReadFileRequest>,
    ) -> Result<TResp<Self::ReadFileStream>, Status> {
        let path = r.into_inner().path;
        if path == "/dir" {
            return Err(Status::failed_precondition("/dir is a directory"));
        }
        let data = self
            .files
            .lock()
            .unwrap()
            .get(&path)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("{path} not found")))?;
        let chunks: Vec<Result<pb::FileChunk, Status>> = data
            .chunks(3)
            .map(|c| Ok(pb::FileChunk { data: c.to_vec() }))
            .collect();
        Ok(TResp::new(futures::stream::iter(chunks).boxed()))
    }

    async fn write_file(
        &self,
        r: TReq<tonic::Streaming<pb::WriteFileRequest>>,
    ) -> Result<TResp<pb::EntryInfo>, Status> {
        use pb::write_file_request::Msg;
        let mut s = r.into_inner();
        let Some(pb::WriteFileRequest {
            msg: Some(Msg::Open(open)),
        }) = s.message().await?
        else {
            return Err(Status::invalid_argument("first message must be open"));
        };
        let mut data = Vec::new();
        let mut chunks = 0;
        while let Some(m) = s.message().await? {
            if let Some(Msg::Data(d)) = m.msg {
                assert!(d.len() <= pb::CHUNK_BYTES);
                chunks += 1;
                data.extend_from_slice(&d);
            }
        }
        self.calls.lock().unwrap().push(format!(
            "write {} mode={:o} parents={} chunks={chunks}",
            open.path, open.mode, open.make_parents
        ));
        let size = data.len() as u64;
        self.files.lock().unwrap().insert(open.path.clone(), data);
        Ok(TResp::new(entry(&open.path, size, false)))
    }

    async fn stat(&self, r: TReq<pb::PathRequest>) -> Result<TResp<pb::EntryInfo>, Status> {
        let path = r.into_inner().path;
        let files = self.files.lock().unwrap();
        let data = files
            .get(&path)
            .ok_or_else(|| Status::not_found(format!("{path} not found")))?;
        Ok(TResp::new(entry(&path, data.len() as u64, false)))
    }

    async fn list_dir(
        &self,
        r: TReq<pb::ListDirRequest>,
    ) -> Result<TResp<pb::ListDirReply>, Status> {
        let path = r.into_inner().path;
        let files = self.files.lock().unwrap();
        let entries = files
            .iter()
            .filter(|(p, _)| p.starts_with(&format!("{}/", path.trim_end_matches('/'))))
            .map(|(p, d)| entry(p, d.len() as u64, false))
            .collect();
        Ok(TResp::new(pb::ListDirReply { entries }))
    }

    async fn make_dir(&self, r: TReq<pb::MakeDirRequest>) -> Result<TResp<pb::EntryInfo>, Status> {
        let r = r.into_inner();
        if r.path == "/exists" {
            return Err(Status::already_exists("/exists exists"));
        }
        Ok(TResp::new(entry(&r.path, 0, true)))
    }

    async fn remove(&self, r: TReq<pb::RemoveRequest>) -> Result<TResp<pb::Empty>, Status> {
        let r = r.into_inner();
        self.calls
            .lock()
            .unwrap()
            .push(format!("remove {}", r.path));
        match self.files.lock().unwrap().remove(&r.path) {
            Some(_) => Ok(TResp::new(pb::Empty {})),
            None => Err(Status::not_found(format!("{} not found", r.path))),
        }
    }

    async fn rename(&self, r: TReq<pb::RenameRequest>) -> Result<TResp<pb::EntryInfo>, Status> {
        let r = r.into_inner();
        let mut files = self.files.lock().unwrap();
        let data = files
            .remove(&r.from)
            .ok_or_else(|| Status::not_found(format!("{} not found", r.from)))?;
        let size = data.len() as u64;
        files.insert(r.to.clone(), data);
        Ok(TResp::new(entry(&r.to, size, false)))
    }

    async fn sync(&self, _: TReq<pb::Empty>) -> Result<TResp<pb::Empty>, Status> {
        Ok(TResp::new(pb::Empty {}))
    }

    type WatchStream = futures::stream::BoxStream<'static, Result<pb::WatchEvent, Status>>;

    /// `/missing` is not there; any other directory reports `started`, then `<dir>/x` made.
    async fn watch(&self, r: TReq<pb::WatchRequest>) -> Result<TResp<Self::WatchStream>, Status> {
        if r.into_inner().path == "/missing" {
            return Err(Status::not_found("/missing: no such directory"));
        }
        let ev = |kind: pb::WatchKind, name: &str| {
            Ok(pb::WatchEvent {
                kind: kind as i32,
                name: name.into(),
                is_dir: false,
            })
        };
        let events = vec![
            ev(pb::WatchKind::Started, ""),
            ev(pb::WatchKind::Create, "x"),
        ];
        Ok(TResp::new(futures::stream::iter(events).boxed()))
    }

    async fn personalize(
        &self,
        r: TReq<pb::PersonalizeRequest>,
    ) -> Result<TResp<pb::Empty>, Status> {
        let n = r.into_inner().env.len();
        self.calls
            .lock()
            .unwrap()
            .push(format!("personalize env={n}"));
        Ok(TResp::new(pb::Empty {}))
    }
}

// ---------------------------------------------------------------- fake node

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CreateFailure {
    None,
    NoTemplate,
    Internal,
}

struct FakeNode {
    sandboxes: Mutex<HashMap<String, SandboxStatus>>,
    calls: Mutex<Vec<String>>,
    fail_create: Mutex<CreateFailure>,
    socket: PathBuf,
    channel: OnceCell<Channel>,
    imported: Mutex<Vec<(String, Vec<u8>)>>,
    /// The last spec each sandbox was (re)started with.
    specs: Mutex<HashMap<String, SandboxSpec>>,
    /// What `connect_port` reaches, by sandbox port (listeners on 127.0.0.1).
    ports: Mutex<HashMap<u16, std::net::SocketAddr>>,
    /// Warm pools as set (clamped to `FAKE_POOL_CAPACITY`), by template.
    pools: Mutex<BTreeMap<String, space_node_api::PoolStatus>>,
    /// Acts as a node whose checkpoints keep memory (a microvm's) and whose rollbacks and
    /// forks restore it.
    vm_memory: std::sync::atomic::AtomicBool,
    /// What `node_info` reports as the node's start (0: unknown, as an old node would).
    started_unix_ms: std::sync::atomic::AtomicU64,
}

/// How many sandboxes the fake node can keep in a warm pool.
const FAKE_POOL_CAPACITY: u32 = 100;

impl FakeNode {
    fn status(id: &str, phase: Phase) -> SandboxStatus {
        SandboxStatus {
            id: id.into(),
            phase,
            template: "base".into(),
            runtime: space_node_api::RuntimeKind::Namespace,
            init_pid: (phase == Phase::Running).then_some(4242),
            uid_base: 1_000_000,
            uid_count: 65_536,
            channel: PathBuf::from("/nonexistent"),
            memory_bytes: Some(1_000_000),
            cpu_usage_usec: Some(2_000_000),
            disk_bytes: None,
            network: None,
            pooled: false,
            restored: false,
        }
    }

    /// The status of a sandbox started from `spec`, with its network.
    /// `started`, with `restored` as a node that restores memory says.
    fn restored(&self, spec: &SandboxSpec) -> SandboxStatus {
        let mut st = self.started(spec);
        st.restored = self.vm_memory.load(std::sync::atomic::Ordering::Relaxed);
        st
    }

    fn started(&self, spec: &SandboxSpec) -> SandboxStatus {
        self.specs
            .lock()
            .unwrap()
            .insert(spec.id.clone(), spec.clone());
        let mut st = Self::status(&spec.id, Phase::Running);
        st.network = Some(space_node_api::net::NetworkStatus {
            address: "10.213.0.2".parse().unwrap(),
            gateway: "10.213.0.1".parse().unwrap(),
            egress: spec.network.egress,
            allow: spec.network.allow.clone(),
        });
        self.sandboxes
            .lock()
            .unwrap()
            .insert(spec.id.clone(), st.clone());
        st
    }

    fn spec(&self, id: &str) -> SandboxSpec {
        self.specs.lock().unwrap().get(id).cloned().unwrap()
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn set_phase(&self, id: &str, phase: Option<Phase>) {
        let mut map = self.sandboxes.lock().unwrap();
        match phase {
            Some(p) => {
                map.insert(id.to_string(), Self::status(id, p));
            }
            None => {
                map.remove(id);
            }
        }
    }
}

#[async_trait]
impl NodeApi for FakeNode {
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("create {}", spec.id));
        match *self.fail_create.lock().unwrap() {
            CreateFailure::NoTemplate => {
                return Err(NodeError::NotFound {
                    kind: "template",
                    id: spec.template.clone(),
                });
            }
            CreateFailure::Internal => {
                return Err(NodeError::Internal("mount /secret failed".into()));
            }
            CreateFailure::None => {}
        }
        Ok(self.started(spec))
    }

    async fn validate_network(
        &self,
        network: &space_node_api::net::NetworkSpec,
    ) -> Result<(), NodeError> {
        space_node_api::policy::Policy::new(network, &[])
            .map(drop)
            .map_err(|e| NodeError::InvalidArgument(e.to_string()))
    }

    async fn set_network(
        &self,
        id: &str,
        network: &space_node_api::net::NetworkSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.validate_network(network).await?;
        self.calls
            .lock()
            .unwrap()
            .push(format!("network {id} {}", network.egress.as_str()));
        let mut map = self.sandboxes.lock().unwrap();
        let st = map.get_mut(id).ok_or_else(|| NodeError::NotFound {
            kind: "sandbox",
            id: id.into(),
        })?;
        if let Some(n) = &mut st.network {
            n.egress = network.egress;
            n.allow = network.allow.clone();
        }
        Ok(st.clone())
    }

    async fn connect_port(
        &self,
        id: &str,
        port: u16,
    ) -> Result<space_node_api::PortStream, NodeError> {
        if !self.sandboxes.lock().unwrap().contains_key(id) {
            return Err(NodeError::NotFound {
                kind: "sandbox",
                id: id.into(),
            });
        }
        let addr = self.ports.lock().unwrap().get(&port).copied();
        let unavailable = || NodeError::Unavailable {
            id: id.into(),
            reason: format!("nothing listens on port {port}"),
        };
        let addr = addr.ok_or_else(unavailable)?;
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|_| unavailable())?;
        Ok(Box::new(tcp))
    }

    async fn fork_sandbox(
        &self,
        source: &str,
        snap: &str,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("fork {source} {snap} {}", spec.id));
        Ok(self.restored(spec))
    }

    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.calls.lock().unwrap().push(format!("remove {id}"));
        self.sandboxes.lock().unwrap().remove(id);
        Ok(())
    }

    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.calls.lock().unwrap().push(format!("stop {id}"));
        Ok(())
    }

    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().get(id).cloned())
    }

    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().values().cloned().collect())
    }

    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        if !self.sandboxes.lock().unwrap().contains_key(id) {
            return Err(NodeError::NotFound {
                kind: "sandbox",
                id: id.into(),
            });
        }
        let path = self.socket.clone();
        let ch = self
            .channel
            .get_or_try_init(|| async move {
                Endpoint::try_from("http://guest.invalid")
                    .unwrap()
                    .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                        let p = path.clone();
                        async move {
                            let s = tokio::net::UnixStream::connect(p).await?;
                            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                        }
                    }))
                    .await
            })
            .await
            .map_err(|e| NodeError::Unavailable {
                id: id.into(),
                reason: e.to_string(),
            })?;
        Ok(GuestChannel::direct(ch.clone()))
    }

    async fn snapshot_sandbox(
        &self,
        id: &str,
        snap: &str,
    ) -> Result<space_node_api::SnapshotInfo, NodeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("snapshot {id} {snap}"));
        Ok(space_node_api::SnapshotInfo {
            id: snap.into(),
            sandbox_id: id.into(),
            created_unix_ms: 1000,
            size_bytes: None,
            path: PathBuf::from("/s"),
            memory: false,
        })
    }

    async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<(), NodeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("snapshot-rm {id} {snap}"));
        Ok(())
    }

    async fn rollback_sandbox(
        &self,
        spec: &SandboxSpec,
        snap: &str,
    ) -> Result<SandboxStatus, NodeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("rollback {} {snap}", spec.id));
        Ok(self.restored(spec))
    }

    async fn checkpoint_sandbox(
        &self,
        id: &str,
        snap: &str,
    ) -> Result<space_node_api::SnapshotInfo, NodeError> {
        let mut info = self.snapshot_sandbox(id, snap).await?;
        if self.vm_memory.load(std::sync::atomic::Ordering::Relaxed) {
            self.calls
                .lock()
                .unwrap()
                .push(format!("checkpoint {id} {snap}"));
            info.memory = true;
        }
        Ok(info)
    }

    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        let mut list = vec![TemplateInfo {
            source: String::new(),
            name: "base".into(),
            version: 1,
            created_unix_ms: 0,
            path: PathBuf::from("/var/lib/space/templates/base/1/rootfs"),
            defaults: Default::default(),
        }];
        for (name, _) in self.imported.lock().unwrap().iter() {
            list.push(TemplateInfo {
                source: String::new(),
                name: name.clone(),
                version: 2,
                created_unix_ms: 1000,
                path: PathBuf::from("/t"),
                defaults: Default::default(),
            });
        }
        Ok(list)
    }

    async fn set_pool(
        &self,
        template: &str,
        cfg: space_node_api::PoolConfig,
    ) -> Result<space_node_api::PoolStatus, NodeError> {
        self.calls.lock().unwrap().push(format!(
            "pool {template} {} {}{}",
            cfg.min,
            cfg.max,
            if cfg.microvm { " microvm" } else { "" }
        ));
        let known = template == "base"
            || self
                .imported
                .lock()
                .unwrap()
                .iter()
                .any(|(n, _)| n == template);
        if !known {
            return Err(NodeError::NotFound {
                kind: "template",
                id: template.into(),
            });
        }
        if cfg.min > cfg.max {
            return Err(NodeError::InvalidArgument(format!(
                "min {} > max {}",
                cfg.min, cfg.max
            )));
        }
        let (min, max) = (
            cfg.min.min(FAKE_POOL_CAPACITY),
            cfg.max.min(FAKE_POOL_CAPACITY),
        );
        let st = space_node_api::PoolStatus {
            template: template.into(),
            runtime: space_node_api::RuntimeKind::Namespace,
            min,
            max,
            target: min,
            ready: 0,
            starting: min,
            hits: 0,
            misses: 0,
            warning: (cfg.max > FAKE_POOL_CAPACITY).then(|| {
                format!("clamped to the node's capacity of {FAKE_POOL_CAPACITY} sandboxes")
            }),
        };
        self.pools
            .lock()
            .unwrap()
            .insert(template.into(), st.clone());
        Ok(st)
    }

    async fn pools(&self) -> Vec<space_node_api::PoolStatus> {
        self.pools.lock().unwrap().values().cloned().collect()
    }

    async fn node_info(&self) -> Result<space_node_api::NodeInfo, NodeError> {
        Ok(space_node_api::NodeInfo {
            name: "fake".into(),
            runtimes: vec![space_node_api::RuntimeKind::Namespace],
            cpus: 2,
            memory_bytes: 8 << 30,
            memory_available_bytes: 6 << 30,
            sandboxes: self.sandboxes.lock().unwrap().len() as u32,
            pool_ready: 0,
            started_unix_ms: self
                .started_unix_ms
                .load(std::sync::atomic::Ordering::Relaxed),
            ..Default::default()
        })
    }

    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        let TemplateSource::Tar(path) = source else {
            return Err(NodeError::InvalidArgument("expected a tar".into()));
        };
        let data = std::fs::read(&path).map_err(|e| NodeError::Internal(e.to_string()))?;
        self.imported.lock().unwrap().push((name.into(), data));
        Ok(TemplateInfo {
            source: String::new(),
            name: name.into(),
            version: 2,
            created_unix_ms: 1000,
            path: PathBuf::from("/t"),
            defaults: Default::default(),
        })
    }
}

// ---------------------------------------------------------------- harness

struct Harness {
    _dir: tempfile::TempDir,
    state: AppState,
    node: Arc<FakeNode>,
    guest: Arc<FakeGuest>,
    key: String,
}

async fn harness_with(cfg: impl FnOnce(&mut ControlConfig)) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("guest.sock");
    let guest = Arc::new(FakeGuest::default());
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let svc = GuestServer::from_arc(guest.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
            .unwrap();
    });
    let node = Arc::new(FakeNode {
        sandboxes: Mutex::default(),
        calls: Mutex::default(),
        fail_create: Mutex::new(CreateFailure::None),
        socket,
        channel: OnceCell::new(),
        imported: Mutex::default(),
        specs: Mutex::default(),
        ports: Mutex::default(),
        pools: Mutex::default(),
        vm_memory: Default::default(),
        started_unix_ms: Default::default(),
    });
    let mut c = ControlConfig::new(dir.path().join("data"));
    cfg(&mut c);
    let cp = ControlPlane::open(c, None, node.clone()).await.unwrap();
    let key = std::fs::read_to_string(&cp.admin_key_path)
        .unwrap()
        .trim()
        .to_string();
    Harness {
        _dir: dir,
        state: cp.state,
        node,
        guest,
        key,
    }
}

async fn harness() -> Harness {
    harness_with(|_| {}).await
}

struct Reply {
    status: StatusCode,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    fn json<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "bad json {e}: {:?} (status {})",
                String::from_utf8_lossy(&self.body),
                self.status
            )
        })
    }

    /// Asserts the JSON error body and status.
    fn error(&self, status: u16, code: &str) -> String {
        assert_eq!(
            self.status.as_u16(),
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        let e: ErrorBody = self.json();
        assert_eq!(e.error.code, code);
        e.error.message
    }

    fn events(&self) -> Vec<ExecEvent> {
        self.body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect()
    }
}

impl Harness {
    async fn send(&self, req: Request<Body>) -> Reply {
        let resp = app(self.state.clone()).oneshot(req).await.unwrap();
        let status = resp.status();
        let content_type = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string());
        let body = resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        Reply {
            status,
            content_type,
            body,
        }
    }

    async fn call(&self, method: Method, uri: &str, body: impl Into<Body>) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {}", self.key))
            .header("content-type", "application/json")
            .body(body.into())
            .unwrap();
        self.send(req).await
    }

    async fn create(&self) -> Sandbox {
        let r = self.call(Method::POST, "/v1/sandboxes", "{}").await;
        assert_eq!(r.status, StatusCode::CREATED);
        r.json()
    }
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn healthz_needs_no_auth_and_everything_else_does() {
    let h = harness().await;
    let r = h
        .send(Request::get("/healthz").body(Body::empty()).unwrap())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v: serde_json::Value = r.json();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["version"], "0.1.0");

    // Everything but /healthz and the port proxy (whose token is the credential).
    for (method, path) in crate::ROUTES.iter().filter(|(_, p)| *p != "/healthz") {
        let uri = path
            .replace("{id}", "abcdefghij0123456789")
            .replace("{pid}", "1")
            .replace("{name}", "x");
        let req = Request::builder()
            .method(*method)
            .uri(&uri)
            .body(Body::empty())
            .unwrap();
        h.send(req).await.error(401, "unauthorized");
        let req = Request::builder()
            .method(*method)
            .uri(&uri)
            .header("authorization", "Bearer sk_wrong")
            .body(Body::empty())
            .unwrap();
        h.send(req).await.error(401, "unauthorized");
    }
    // Unknown routes need auth too, then answer 404 JSON.
    let req = Request::get("/v2/nope").body(Body::empty()).unwrap();
    h.send(req).await.error(401, "unauthorized");
    h.call(Method::GET, "/v2/nope", Body::empty())
        .await
        .error(404, "not_found");
    h.call(Method::PATCH, "/v1/sandboxes", Body::empty())
        .await
        .error(405, "method_not_allowed");
}

#[tokio::test]
async fn create_get_list_delete() {
    let h = harness().await;
    let body = r#"{"cpu":0.5,"memory_mib":256,"pids":64,"env":{"A":"1"},"hostname":"box"}"#;
    let r = h.call(Method::POST, "/v1/sandboxes", body).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let sb: Sandbox = r.json();
    assert!(space_api::is_valid_sandbox_id(&sb.id));
    assert_eq!(sb.state, SandboxState::Running);
    assert_eq!(sb.template, "base");
    assert_eq!(sb.runtime, "namespace");
    assert_eq!(sb.cpu, 0.5);
    assert_eq!(sb.memory_mib, 256);
    assert_eq!(sb.pids, 64);
    assert_eq!(sb.env["A"], "1");
    assert_eq!(sb.hostname, "box");
    assert_eq!(sb.init_pid, Some(4242));
    assert!(sb.created_at.ends_with('Z'));

    let got: Sandbox = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{}", sb.id),
            Body::empty(),
        )
        .await
        .json();
    assert_eq!(got.id, sb.id);
    assert_eq!(got.memory_bytes, Some(1_000_000));
    assert_eq!(got.cpu_usage_usec, Some(2_000_000));

    let sb2 = h.create().await;
    let list: space_api::SandboxList = h
        .call(Method::GET, "/v1/sandboxes", Body::empty())
        .await
        .json();
    let ids: Vec<_> = list.sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(ids, vec![sb.id.clone(), sb2.id.clone()]);

    let r = h
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{}", sb.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(h.node.calls().contains(&format!("remove {}", sb.id)));
    h.call(
        Method::GET,
        &format!("/v1/sandboxes/{}", sb.id),
        Body::empty(),
    )
    .await
    .error(404, "not_found");
    h.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{}", sb.id),
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn bad_inputs_are_400_with_json_bodies() {
    let h = harness().await;
    let bad_bodies = [
        "{",                           // bad JSON
        "",                            // no body
        "[]",                          // wrong type
        r#"{"cpus":1}"#,               // unknown field
        r#"{"cpu":"x"}"#,              // wrong field type
        r#"{"cpu":0}"#,                // out of range
        r#"{"memory_mib":1}"#,         //
        r#"{"pids":1}"#,               //
        r#"{"env":{"1X":"a"}}"#,       // bad env key
        r#"{"env":{"A=B":"a"}}"#,      //
        r#"{"env":{"A":"a\u0000b"}}"#, // NUL in a value
        r#"{"template":"../../etc"}"#, // bad template name
        r#"{"hostname":"has space"}"#, // bad hostname
    ];
    for body in bad_bodies {
        let r = h.call(Method::POST, "/v1/sandboxes", body).await;
        r.error(400, "invalid_argument");
    }
    // Nothing was stored.
    let list: space_api::SandboxList = h
        .call(Method::GET, "/v1/sandboxes", Body::empty())
        .await
        .json();
    assert!(list.sandboxes.is_empty());

    // Bad ids.
    for id in ["short", "ABCDEFGHIJ0123456789", "abcdefghij012345678_"] {
        h.call(Method::GET, &format!("/v1/sandboxes/{id}"), Body::empty())
            .await
            .error(400, "invalid_argument");
    }
    let sb = h.create().await;
    // Missing field, empty cmd, bad pid, bad query, relative path.
    let id = &sb.id;
    h.call(Method::POST, &format!("/v1/sandboxes/{id}/exec"), "{}")
        .await
        .error(400, "invalid_argument");
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":[]}"#,
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":["x"],"env":{"-":"1"}}"#,
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes/notanumber/signal"),
        r#"{"signal":"KILL"}"#,
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes/7/signal"),
        r#"{"signal":"NOPE"}"#,
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files"),
        Body::empty(),
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=relative"),
        Body::empty(),
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/processes/7/output?offset=-1"),
        Body::empty(),
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/files?path=/a&mode=999"),
        "x",
    )
    .await
    .error(400, "invalid_argument");
    h.call(Method::PUT, "/v1/templates/Bad..Name", "x")
        .await
        .error(400, "invalid_argument");
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let h = harness_with(|c| c.max_upload_bytes = 10).await;
    let big = format!(r#"{{"hostname":"{}"}}"#, "a".repeat(1024 * 1024 + 10));
    h.call(Method::POST, "/v1/sandboxes", big)
        .await
        .error(413, "payload_too_large");
    let sb = h.create().await;
    // Declared length over the upload limit.
    h.call(
        Method::PUT,
        &format!("/v1/sandboxes/{}/files?path=/big", sb.id),
        vec![0u8; 11],
    )
    .await
    .error(413, "payload_too_large");
    // Streamed (no length) over the limit: aborted, partial file removed.
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = vec![
        Ok(bytes::Bytes::from_static(b"123456")),
        Ok(bytes::Bytes::from_static(b"789012")),
    ];
    let r = h
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{}/files?path=/big", sb.id),
            Body::from_stream(futures::stream::iter(chunks)),
        )
        .await;
    r.error(413, "payload_too_large");
    assert!(!h.guest.files.lock().unwrap().contains_key("/big"));
    h.call(Method::PUT, "/v1/templates/t1", vec![0u8; 11])
        .await
        .error(413, "payload_too_large");
}

#[tokio::test]
async fn create_failures() {
    let h = harness().await;
    *h.node.fail_create.lock().unwrap() = CreateFailure::NoTemplate;
    h.call(Method::POST, "/v1/sandboxes", r#"{"template":"nope"}"#)
        .await
        .error(404, "not_found");
    // A client error leaves nothing behind.
    let list: space_api::SandboxList = h
        .call(Method::GET, "/v1/sandboxes", Body::empty())
        .await
        .json();
    assert!(list.sandboxes.is_empty());

    *h.node.fail_create.lock().unwrap() = CreateFailure::Internal;
    let msg = h
        .call(Method::POST, "/v1/sandboxes", "{}")
        .await
        .error(500, "internal");
    assert!(!msg.contains("secret"));
    // A server error leaves a failed row (with a safe message) and cleans the node.
    let list: space_api::SandboxList = h
        .call(Method::GET, "/v1/sandboxes", Body::empty())
        .await
        .json();
    assert_eq!(list.sandboxes.len(), 1);
    let failed = &list.sandboxes[0];
    assert_eq!(failed.state, SandboxState::Failed);
    assert!(!failed.error.as_deref().unwrap().contains("secret"));
    assert!(h.node.calls().contains(&format!("remove {}", failed.id)));
    // Guest actions on a failed sandbox conflict; delete works.
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{}/exec", failed.id),
        r#"{"cmd":["true"]}"#,
    )
    .await
    .error(409, "conflict");
    let r = h
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{}", failed.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn watch_streams_ndjson_and_refuses_bad_input() {
    let h = harness().await;
    let id = h.create().await.id;
    let r = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/watch?path=/work&recursive=true"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.content_type.as_deref(), Some("application/x-ndjson"));
    let events: Vec<space_api::WatchEvent> = r
        .body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    let kinds: Vec<_> = events.iter().map(|e| (e.kind, e.name.as_str())).collect();
    assert_eq!(
        kinds,
        [
            (space_api::WatchKind::Started, ""),
            (space_api::WatchKind::Create, "x")
        ]
    );
    let watch = |q: &str| format!("/v1/sandboxes/{id}/files/watch{q}");
    h.call(Method::GET, &watch("?path=/missing"), Body::empty())
        .await
        .error(404, "not_found");
    h.call(Method::GET, &watch("?path=relative"), Body::empty())
        .await
        .error(400, "invalid_argument");
    h.call(Method::GET, &watch(""), Body::empty())
        .await
        .error(400, "invalid_argument");
    h.call(Method::GET, &watch("?path=/w&bogus=1"), Body::empty())
        .await
        .error(400, "invalid_argument");
    h.call(
        Method::GET,
        "/v1/sandboxes/aaaaaaaaaaaaaaaaaaaa/files/watch?path=/w",
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn metrics_answer_limits_and_refuse_bad_bounds_and_ids() {
    let h = harness().await;
    let sb = h.create().await;
    let url = |q: &str| format!("/v1/sandboxes/{}/metrics{q}", sb.id);
    let m: space_api::SandboxMetrics = h.call(Method::GET, &url(""), Body::empty()).await.json();
    assert_eq!(m.cpu, sb.cpu);
    assert_eq!(m.memory_limit_bytes, sb.memory_mib << 20);
    let m: space_api::SandboxMetrics = h
        .call(
            Method::GET,
            &url("?since=2000-01-01T00:00:00Z"),
            Body::empty(),
        )
        .await
        .json();
    assert!(m.samples.iter().all(|s| s.cpu_pct <= 100.0));
    for bad in ["?since=yesterday", "?until=1", "?bogus=1"] {
        h.call(Method::GET, &url(bad), Body::empty())
            .await
            .error(400, "invalid_argument");
    }
    h.call(
        Method::GET,
        "/v1/sandboxes/aaaaaaaaaaaaaaaaaaaa/metrics",
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn exec_streams_ndjson() {
    let h = harness().await;
    let sb = h.create().await;
    let uri = format!("/v1/sandboxes/{}/exec", sb.id);
    let r = h
        .call(
            Method::POST,
            &uri,
            r#"{"cmd":["echo","hi"],"env":{"X":"1"}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.content_type.as_deref(), Some("application/x-ndjson"));
    assert_eq!(
        r.events(),
        vec![
            ExecEvent::Started { pid: 7 },
            ExecEvent::Stdout {
                offset: 0,
                data: b"hi".to_vec()
            },
            ExecEvent::Stderr {
                offset: 2,
                data: b"e".to_vec()
            },
            ExecEvent::Exit {
                code: Some(3),
                signal: None
            },
        ]
    );
    // The wire format is the documented one.
    let text = String::from_utf8(r.body.clone()).unwrap();
    assert!(text.starts_with("{\"type\":\"started\",\"pid\":7}\n"));
    assert!(text.ends_with("{\"type\":\"exit\",\"code\":3}\n"));

    let r = h.call(Method::POST, &uri, r#"{"cmd":["killed"]}"#).await;
    assert_eq!(
        r.events().last(),
        Some(&ExecEvent::Exit {
            code: None,
            signal: Some(9)
        })
    );

    // Errors before the first event are HTTP errors.
    h.call(Method::POST, &uri, r#"{"cmd":["missing"]}"#)
        .await
        .error(404, "not_found");
    // Errors midway are a final error event without internal details.
    let r = h.call(Method::POST, &uri, r#"{"cmd":["boom"]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    match r.events().last().unwrap() {
        ExecEvent::Error { code, message } => {
            assert_eq!(code, "internal");
            assert!(!message.contains("secret"));
        }
        other => panic!("unexpected {other:?}"),
    }

    // Background.
    let r = h
        .call(
            Method::POST,
            &uri,
            r#"{"cmd":["sleep","1"],"background":true}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.json::<serde_json::Value>(), serde_json::json!({"pid": 8}));

    // Unknown sandbox.
    h.call(
        Method::POST,
        "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/exec",
        r#"{"cmd":["true"]}"#,
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn processes_output_stdin_signal_resize() {
    let h = harness().await;
    let sb = h.create().await;
    let base = format!("/v1/sandboxes/{}/processes", sb.id);
    let list: space_api::ProcessList = h.call(Method::GET, &base, Body::empty()).await.json();
    assert_eq!(list.processes[0].pid, 7);
    assert_eq!(list.processes[0].cmd, vec!["sleep", "1"]);
    assert!(list.processes[0].running);

    let r = h
        .call(
            Method::GET,
            &format!("{base}/7/output?offset=3"),
            Body::empty(),
        )
        .await;
    assert_eq!(
        r.events(),
        vec![
            ExecEvent::Stdout {
                offset: 3,
                data: b"later".to_vec()
            },
            ExecEvent::Exit {
                code: Some(0),
                signal: None
            }
        ]
    );
    h.call(
        Method::GET,
        &format!("{base}/7/output?offset=11"),
        Body::empty(),
    )
    .await
    .error(416, "out_of_range");
    h.call(Method::GET, &format!("{base}/99/output"), Body::empty())
        .await
        .error(404, "not_found");

    let r = h
        .call(Method::POST, &format!("{base}/7/stdin"), "hello")
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(
            Method::POST,
            &format!("{base}/7/stdin/close"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(
            Method::POST,
            &format!("{base}/7/signal"),
            r#"{"signal":"TERM","group":true}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(Method::POST, &format!("{base}/7/signal"), r#"{"signal":9}"#)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(
            Method::POST,
            &format!("{base}/7/resize"),
            r#"{"rows":40,"cols":120}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let calls = h.guest.calls.lock().unwrap().clone();
    for want in [
        "stdin 7 hello",
        "close 7",
        "signal 7 15 true",
        "signal 7 9 false",
        "resize 7 40x120",
    ] {
        assert!(calls.iter().any(|c| c == want), "{want} not in {calls:?}");
    }
}

#[tokio::test]
async fn files_roundtrip() {
    let h = harness().await;
    let sb = h.create().await;
    let base = format!("/v1/sandboxes/{}/files", sb.id);
    let content: Vec<u8> = (0..(pb::CHUNK_BYTES * 2 + 100))
        .map(|i| (i % 251) as u8)
        .collect();
    let r = h
        .call(
            Method::PUT,
            &format!("{base}?path=/work/a.bin&mode=600&parents=true"),
            content.clone(),
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let e: space_api::EntryInfo = r.json();
    assert_eq!(e.path, "/work/a.bin");
    assert_eq!(e.size, content.len() as u64);
    assert_eq!(e.file_type, space_api::FileType::File);
    let calls = h.guest.calls.lock().unwrap().clone();
    assert!(
        calls
            .iter()
            .any(|c| c == "write /work/a.bin mode=600 parents=true chunks=3"),
        "{calls:?}"
    );

    let r = h
        .call(
            Method::GET,
            &format!("{base}?path=/work/a.bin"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.content_type.as_deref(), Some("application/octet-stream"));
    assert_eq!(r.body, content);

    h.call(Method::GET, &format!("{base}?path=/dir"), Body::empty())
        .await
        .error(412, "failed_precondition");
    h.call(Method::GET, &format!("{base}?path=/missing"), Body::empty())
        .await
        .error(404, "not_found");

    let st: space_api::EntryInfo = h
        .call(
            Method::GET,
            &format!("{base}/stat?path=/work/a.bin"),
            Body::empty(),
        )
        .await
        .json();
    assert_eq!(st.size, content.len() as u64);
    let list: space_api::EntryList = h
        .call(
            Method::GET,
            &format!("{base}/list?path=/work"),
            Body::empty(),
        )
        .await
        .json();
    assert_eq!(list.entries.len(), 1);

    let r = h
        .call(
            Method::POST,
            &format!("{base}/mkdir"),
            r#"{"path":"/d","parents":true}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(
        r.json::<space_api::EntryInfo>().file_type,
        space_api::FileType::Dir
    );
    h.call(
        Method::POST,
        &format!("{base}/mkdir"),
        r#"{"path":"/exists"}"#,
    )
    .await
    .error(409, "conflict");

    let r = h
        .call(
            Method::POST,
            &format!("{base}/rename"),
            r#"{"from":"/work/a.bin","to":"/work/b.bin"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .call(
            Method::DELETE,
            &format!("{base}?path=/work/b.bin"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    h.call(
        Method::DELETE,
        &format!("{base}?path=/work/b.bin"),
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn templates_list_and_import() {
    let h = harness().await;
    let list: space_api::TemplateList = h
        .call(Method::GET, "/v1/templates", Body::empty())
        .await
        .json();
    assert_eq!(list.templates[0].name, "base");
    assert_eq!(list.templates[0].version, 1);
    let r = h.call(Method::PUT, "/v1/templates/py3", "tar-bytes").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let t: space_api::Template = r.json();
    assert_eq!((t.name.as_str(), t.version), ("py3", 2));
    let imported = h.node.imported.lock().unwrap().clone();
    assert_eq!(imported, vec![("py3".to_string(), b"tar-bytes".to_vec())]);
    // The temporary upload is gone.
    let tmp = h.state.engine.config().data_dir.join("tmp");
    assert_eq!(std::fs::read_dir(tmp).unwrap().count(), 0);
}

#[tokio::test]
async fn metrics_count_things() {
    let h = harness().await;
    h.create().await;
    let r = h
        .call(
            Method::GET,
            "/v1/sandboxes/aaaaaaaaaaaaaaaaaaaa",
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.call(Method::GET, "/metrics", Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8(r.body).unwrap();
    assert!(text.contains("space_sandboxes_created_total 1"), "{text}");
    assert!(
        text.contains("space_http_errors_total{code=\"not_found\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("space_sandbox_create_seconds_count 1"),
        "{text}"
    );
    assert!(
        text.contains("space_sandboxes{state=\"running\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn reconciler_heals_divergence() {
    let h = harness().await;
    let engine = h.state.engine.clone();
    let stopped = h.create().await;
    let lost = h.create().await;
    let fine = h.create().await;
    let orphan = "oooooooooooooooooooo";
    h.node.set_phase(&stopped.id, Some(Phase::Stopped));
    h.node.set_phase(&lost.id, None);
    h.node.set_phase(orphan, Some(Phase::Running));
    // A deletion that the fast path did not finish.
    let half_deleted = h.create().await;
    engine
        .store()
        .set_status(&half_deleted.id, SandboxState::Deleting, None)
        .await
        .unwrap();

    let mut backoff = Backoff::default();
    let applied = engine.reconcile_once(&mut backoff).await.unwrap();
    assert_eq!(applied, 4);

    let get = |id: String| {
        let h = &h;
        async move {
            h.call(Method::GET, &format!("/v1/sandboxes/{id}"), Body::empty())
                .await
        }
    };
    // Its init died: restarted on its rootfs (it has no snapshot; decision 0009).
    let s: Sandbox = get(stopped.id.clone()).await.json();
    assert_eq!(s.state, SandboxState::Running);
    assert_eq!(s.error, None);
    assert!(h.node.calls().contains(&format!("create {}", stopped.id)));
    let r = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{}/events", stopped.id),
            Body::empty(),
        )
        .await;
    let events: space_api::EventList = r.json();
    let rec = events
        .events
        .iter()
        .find(|e| e.action == "recovered")
        .expect("a recovered event");
    assert_eq!(rec.actor, "node");
    assert!(rec.detail.contains("rootfs"), "{rec:?}");
    let s: Sandbox = get(lost.id.clone()).await.json();
    assert_eq!(s.state, SandboxState::Failed);
    assert_eq!(s.error.as_deref(), Some(ERROR_SANDBOX_LOST));
    let s: Sandbox = get(fine.id.clone()).await.json();
    assert_eq!(s.state, SandboxState::Running);
    get(half_deleted.id.clone()).await.error(404, "not_found");
    assert!(h.node.calls().contains(&format!("remove {orphan}")));

    // Exec in the failed (lost) sandbox conflicts.
    h.call(
        Method::POST,
        &format!("/v1/sandboxes/{}/exec", lost.id),
        r#"{"cmd":["true"]}"#,
    )
    .await
    .error(409, "conflict");

    // Converged: a second pass does nothing.
    assert_eq!(engine.reconcile_once(&mut backoff).await.unwrap(), 0);
}

#[test]
fn openapi_matches_routes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../api/openapi.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.0"),
        "OpenAPI 3.0 expected"
    );
    let mut documented = std::collections::BTreeSet::new();
    let mut proxied = std::collections::BTreeSet::new();
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        let path = path.as_str().unwrap();
        for (method, _) in item.as_mapping().unwrap() {
            let method = method.as_str().unwrap();
            if method == "parameters" {
                continue;
            }
            // The port proxy takes any method: its paths are checked against PROXY_ROUTES.
            if crate::port_proxy::PROXY_ROUTES.contains(&path) {
                proxied.insert((path.to_string(), method.to_uppercase()));
                continue;
            }
            documented.insert((method.to_uppercase(), path.to_string()));
        }
    }
    for path in crate::port_proxy::PROXY_ROUTES {
        for m in ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"] {
            assert!(
                proxied.contains(&(path.to_string(), m.to_string())),
                "openapi.yaml lacks {m} {path}"
            );
        }
    }
    let routed: std::collections::BTreeSet<(String, String)> = crate::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    let missing: Vec<_> = routed.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routed).collect();
    assert!(
        missing.is_empty(),
        "routes not in openapi.yaml: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "openapi.yaml paths with no route: {extra:?}"
    );
}

#[test]
fn app_registers_every_route() {
    // Builds the router (a missing handler panics) and checks no route is listed twice.
    let mut seen = std::collections::HashSet::new();
    for r in crate::ROUTES {
        assert!(seen.insert(r), "duplicate route {r:?}");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let h = harness().await;
        for (method, path) in crate::ROUTES {
            let uri = path
                .replace("{id}", "abcdefghij0123456789")
                .replace("{pid}", "1")
                .replace("{name}", "x");
            let req = Request::builder()
                .method(*method)
                .uri(&uri)
                .header("authorization", format!("Bearer {}", h.key))
                .body(Body::empty())
                .unwrap();
            let r = h.send(req).await;
            // Routed: never the fallback's "no route" 404 nor 405.
            assert_ne!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            if r.status == StatusCode::NOT_FOUND {
                let e: ErrorBody = r.json();
                assert!(!e.error.message.starts_with("no route"), "{method} {path}");
            }
        }
    });
    let _ = Auth::default();
}

#[tokio::test]
async fn rust_client_against_the_served_api() {
    let h = harness_with(|c| c.shutdown_timeout = std::time::Duration::from_millis(200)).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::serve(listener, h.state.clone(), async {
        let _ = rx.await;
    }));
    let url = format!("http://{addr}");
    let c = space_api::Client::new(&url, &h.key).unwrap();
    assert_eq!(c.health().await.unwrap().status, "ok");

    let sb = c
        .create_sandbox(&space_api::CreateSandbox::default())
        .await
        .unwrap();
    let out = c
        .exec_output(&sb.id, &space_api::ExecRequest::new(["echo", "a", "b"]))
        .await
        .unwrap();
    assert_eq!(out.pid, 7);
    assert_eq!(out.stdout, b"a b");
    assert_eq!(out.stderr, b"e");
    assert_eq!(out.status(), 3);
    let pid = c
        .exec_background(&sb.id, &space_api::ExecRequest::new(["sleep", "9"]))
        .await
        .unwrap();
    assert_eq!(pid, 8);

    let err = c
        .exec(&sb.id, &space_api::ExecRequest::new(["missing"]))
        .await
        .err()
        .unwrap();
    assert_eq!((err.status(), err.code()), (Some(404), "not_found"));

    // Streamed upload (chunked, no content length) and download.
    let data: Vec<u8> = (0..600_000u32).map(|i| (i % 13) as u8).collect();
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        data.chunks(100_000).map(|c| Ok(c.to_vec())).collect();
    let body = reqwest_body(chunks);
    let e = c
        .write_file(&sb.id, "/x/data", Some(0o600), true, body)
        .await
        .unwrap();
    assert_eq!(e.size, data.len() as u64);
    assert_eq!(c.read_file_bytes(&sb.id, "/x/data").await.unwrap(), data);
    assert_eq!(
        c.stat(&sb.id, "/x/data").await.unwrap().size,
        data.len() as u64
    );
    assert_eq!(c.list_dir(&sb.id, "/x", None).await.unwrap().len(), 1);
    c.remove_file(&sb.id, "/x/data", false).await.unwrap();

    let mut events = c.process_output(&sb.id, 7, 0, true).await.unwrap();
    let mut n = 0;
    while let Some(ev) = events.next().await {
        ev.unwrap();
        n += 1;
    }
    assert_eq!(n, 2);
    c.signal(
        &sb.id,
        7,
        &space_api::SignalRequest {
            signal: space_api::SignalSpec::Name("KILL".into()),
            group: false,
        },
    )
    .await
    .unwrap();

    assert_eq!(c.list_sandboxes().await.unwrap().len(), 1);
    assert_eq!(c.list_templates().await.unwrap()[0].name, "base");
    c.delete_sandbox(&sb.id).await.unwrap();
    let err = c.get_sandbox(&sb.id).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("sandbox {} not found (not_found)", sb.id)
    );

    let bad = space_api::Client::new(&url, "sk_nope").unwrap();
    let err = bad.list_sandboxes().await.unwrap_err();
    assert_eq!((err.status(), err.code()), (Some(401), "unauthorized"));

    // Graceful shutdown returns; sandboxes are not touched by it.
    let calls_before = h.node.calls().len();
    tx.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        h.node.calls()[calls_before..]
            .iter()
            .all(|c| !c.starts_with("remove") && !c.starts_with("stop"))
    );
}

fn reqwest_body(chunks: Vec<Result<Vec<u8>, std::io::Error>>) -> space_api::Body {
    space_api::Body::wrap_stream(futures::stream::iter(chunks))
}

#[tokio::test]
async fn events_record_actions_and_outlive_the_sandbox() {
    let h = harness().await;
    let sb = h.create().await;
    let id = sb.id.clone();
    let r = h
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=%2Froot%2Fsecret.txt"),
            Body::from("TOP-SECRET-CONTENT"),
        )
        .await;
    let _ = r.status;
    let r = h
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/events"),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8(r.body.clone()).unwrap();
    assert!(!text.contains("TOP-SECRET"), "{text}");
    let events: space_api::EventList = r.json();
    let actions: Vec<&str> = events.events.iter().map(|e| e.action.as_str()).collect();
    for want in [
        "create",
        "running",
        "file_write",
        "deleting",
        "deleted",
        "delete",
    ] {
        assert!(actions.contains(&want), "{want} missing in {actions:?}");
    }
    let create = &events.events[0];
    assert_eq!(create.action, "create");
    assert!(
        create.actor.starts_with("api:") && create.actor.len() == 16,
        "{create:?}"
    );
    let write = events
        .events
        .iter()
        .find(|e| e.action == "file_write")
        .unwrap();
    assert_eq!(write.detail, "path=/root/secret.txt");
    assert!(events.events.windows(2).all(|w| w[0].id < w[1].id));
    // Paging.
    let r = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/events?limit=2&after={}", create.id),
            Body::empty(),
        )
        .await;
    let page: space_api::EventList = r.json();
    assert_eq!(page.events.len(), 2);
    assert_eq!(page.events[0].id, events.events[1].id);
    // No events and no sandbox: 404.
    h.call(
        Method::GET,
        "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/events",
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn half_done_creates_of_an_earlier_instance_resolve_at_once() {
    let h = harness().await;
    let engine = h.state.engine.clone();
    let before = engine.boot_ms - 1;
    let on_node = "cccccccccccccccccccc";
    let not_on_node = "dddddddddddddddddddd";
    for id in [on_node, not_on_node] {
        engine
            .store()
            .insert_sandbox(&crate::store::tests::row(
                id,
                SandboxState::Creating,
                before,
            ))
            .await
            .unwrap();
    }
    h.node.set_phase(on_node, Some(Phase::Running));
    let mut backoff = Backoff::default();
    engine.reconcile_once(&mut backoff).await.unwrap();
    let row = engine.store().get_sandbox(on_node).await.unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Running);
    let row = engine
        .store()
        .get_sandbox(not_on_node)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, SandboxState::Failed);
    assert!(row.error.unwrap().contains("interrupted"));
    assert!(h.node.calls().contains(&format!("remove {not_on_node}")));
    // A create of this instance still gets its grace period.
    let fresh = "eeeeeeeeeeeeeeeeeeee";
    engine
        .store()
        .insert_sandbox(&crate::store::tests::row(
            fresh,
            SandboxState::Creating,
            crate::store::now_ms(),
        ))
        .await
        .unwrap();
    engine.reconcile_once(&mut backoff).await.unwrap();
    let row = engine.store().get_sandbox(fresh).await.unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Creating);
}

#[tokio::test]
async fn crash_loop_stops_the_sandbox_and_keeps_its_data() {
    let h = harness().await;
    let engine = h.state.engine.clone();
    let sb = h.create().await;
    let now = crate::store::now_ms();
    for i in 0..crate::recovery::RESTART_LIMIT as i64 {
        engine.restarts.note(&sb.id, now - 60_000 + i);
    }
    h.node.set_phase(&sb.id, Some(Phase::Stopped));
    let mut backoff = Backoff::default();
    engine.reconcile_once(&mut backoff).await.unwrap();
    let row = engine.store().get_sandbox(&sb.id).await.unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Stopped);
    assert!(row.error.unwrap().starts_with("crash loop"));
    // Its rootfs and snapshots stay: the next pass must not remove it on the node.
    engine.reconcile_once(&mut backoff).await.unwrap();
    assert!(engine.store().get_sandbox(&sb.id).await.unwrap().is_some());
    let events = engine
        .list_events(&sb.id, space_api::EventQuery::default())
        .await
        .unwrap();
    assert!(events.iter().any(|e| e.action == "crash_loop"));
    assert!(!events.iter().any(|e| e.action == "recovered"));
}

#[tokio::test]
async fn checkpoints_record_running_processes_and_restart_them_on_rollback() {
    let h = harness().await;
    let sb = h.create().await;
    let base = format!("/v1/sandboxes/{}", sb.id);
    // Bad kinds are 400.
    let r = h
        .call(
            Method::POST,
            &format!("{base}/snapshots"),
            r#"{"kind":"memory"}"#,
        )
        .await;
    r.error(400, "invalid_argument");
    // A disk snapshot records no processes.
    let r = h.call(Method::POST, &format!("{base}/snapshots"), "").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let disk: space_api::Snapshot = r.json();
    assert_eq!(disk.kind, space_api::SnapshotKind::Disk);
    assert_eq!(disk.processes, None);
    // A checkpoint asks the guest: the fake runs `sleep 1`.
    let r = h
        .call(
            Method::POST,
            &format!("{base}/snapshots"),
            r#"{"kind":"checkpoint","label":"cp"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let cp: space_api::Snapshot = r.json();
    assert_eq!(cp.kind, space_api::SnapshotKind::Checkpoint);
    assert!(!cp.memory);
    let procs = cp.processes.clone().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].cmd, vec!["sleep".to_string(), "1".to_string()]);
    let r = h.call(Method::GET, &format!("{base}/snapshots"), "").await;
    let list: space_api::SnapshotList = r.json();
    let listed = list.snapshots.iter().find(|s| s.id == cp.id).unwrap();
    assert_eq!(listed.processes, cp.processes);
    assert_eq!(
        list.snapshots
            .iter()
            .find(|s| s.id == disk.id)
            .unwrap()
            .processes,
        None
    );
    // Rolling back to the disk snapshot starts nothing.
    let starts = |h: &Harness| {
        h.guest
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.starts_with("start "))
            .count()
    };
    let r = h
        .call(
            Method::POST,
            &format!("{base}/rollback"),
            format!(r#"{{"snapshot":"{}"}}"#, disk.id),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(starts(&h), 0);
    // Rolling back to the checkpoint restarts the process, without env.
    let r = h
        .call(
            Method::POST,
            &format!("{base}/rollback"),
            format!(r#"{{"snapshot":"{}"}}"#, cp.id),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let calls = h.guest.calls.lock().unwrap().clone();
    assert!(
        calls.contains(&r#"start ["sleep", "1"] tag= env=0"#.to_string()),
        "{calls:?}"
    );
    let r = h.call(Method::GET, &format!("{base}/events"), "").await;
    let body = String::from_utf8_lossy(&r.body).to_string();
    assert!(body.contains("process_restarted"), "{body}");
    // Deleting the checkpoint forgets its process list.
    let r = h
        .call(Method::DELETE, &format!("{base}/snapshots/{}", cp.id), "")
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.state.engine.store().get_checkpoint(&cp.id).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn recovery_from_a_checkpoint_restarts_its_processes() {
    let h = harness().await;
    let sb = h.create().await;
    let r = h
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/snapshots", sb.id),
            r#"{"kind":"checkpoint"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    // Its init died: the reconciler restarts it from the newest snapshot, the checkpoint.
    h.node.set_phase(&sb.id, Some(Phase::Stopped));
    let mut backoff = Backoff::default();
    h.state.engine.reconcile_once(&mut backoff).await.unwrap();
    assert!(
        h.node.calls().iter().any(|c| c.starts_with("rollback ")),
        "{:?}",
        h.node.calls()
    );
    let calls = h.guest.calls.lock().unwrap().clone();
    assert!(
        calls.contains(&r#"start ["sleep", "1"] tag= env=0"#.to_string()),
        "{calls:?}"
    );
}

#[path = "tests_net.rs"]
mod net;

#[path = "tests_pools.rs"]
mod pools;

#[path = "tests_tenants.rs"]
mod tenants;

#[tokio::test]
async fn memory_checkpoints_are_not_restarted_and_running_microvms_fork_from_one() {
    let h = harness().await;
    h.node
        .vm_memory
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let r = h
        .call(Method::POST, "/v1/sandboxes", r#"{"runtime":"microvm"}"#)
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let vm: Sandbox = r.json();
    let base = format!("/v1/sandboxes/{}", vm.id);
    let r = h
        .call(
            Method::POST,
            &format!("{base}/snapshots"),
            r#"{"kind":"checkpoint"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let cp: space_api::Snapshot = r.json();
    assert!(cp.memory, "the node kept the memory");
    let calls = h.node.calls.lock().unwrap().clone();
    assert!(
        calls.contains(&format!("checkpoint {} {}", vm.id, cp.id)),
        "{calls:?}"
    );
    // Listed with its memory flag too.
    let r = h.call(Method::GET, &format!("{base}/snapshots"), "").await;
    let list: space_api::SnapshotList = r.json();
    assert!(list.snapshots.iter().any(|s| s.id == cp.id && s.memory));

    // A rollback that restored the memory restarts nothing. (Answers the events after it.)
    let rollback = || async {
        let r = h
            .call(
                Method::POST,
                &format!("{base}/rollback"),
                format!(r#"{{"snapshot":"{}"}}"#, cp.id),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let r = h.call(Method::GET, &format!("{base}/events"), "").await;
        String::from_utf8_lossy(&r.body).to_string()
    };
    let body = rollback().await;
    assert!(body.contains("memory_restored"), "{body}");
    assert!(!body.contains("process_restarted"), "{body}");
    let calls = h.guest.calls.lock().unwrap().clone();
    assert!(!calls.iter().any(|c| c.starts_with("start ")), "{calls:?}");

    // A running microvm forks from a checkpoint; a namespace sandbox from a disk snapshot.
    let r = h.call(Method::POST, &format!("{base}/fork"), "{}").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let n_checkpoints = |h: &Harness, id: &str| {
        h.node
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.starts_with(&format!("checkpoint {id} ")))
            .count()
    };
    assert_eq!(n_checkpoints(&h, &vm.id), 2);
    let ns = h.create().await;
    let r = h
        .call(Method::POST, &format!("/v1/sandboxes/{}/fork", ns.id), "{}")
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(n_checkpoints(&h, &ns.id), 0);

    // Where the node could not restore the memory (it booted the disk), the processes are
    // started again.
    h.node
        .vm_memory
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let body = rollback().await;
    assert!(body.contains("process_restarted"), "{body}");
}

#[tokio::test]
async fn a_templates_runtime_is_the_default_of_its_creates_and_its_pool() {
    let h = harness().await;
    let set = |body: &'static str| {
        let h = &h;
        async move {
            h.call(Method::PUT, "/v1/templates/base/settings", body)
                .await
        }
    };
    // Bad input: runtime, fields, template name, unknown template.
    set(r#"{"runtime":"firecracker"}"#)
        .await
        .error(400, "invalid_argument");
    set(r#"{"runtime":"microvm","x":1}"#)
        .await
        .error(400, "invalid_argument");
    h.call(
        Method::PUT,
        "/v1/templates/Bad..Name/settings",
        r#"{"runtime":"microvm"}"#,
    )
    .await
    .error(400, "invalid_argument");
    h.call(
        Method::PUT,
        "/v1/templates/nope/settings",
        r#"{"runtime":"microvm"}"#,
    )
    .await
    .error(404, "not_found");

    let r = set(r#"{"runtime":"microvm"}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    let t: space_api::Template = r.json();
    assert_eq!(t.runtime.as_deref(), Some("microvm"));
    let r = h.call(Method::GET, "/v1/templates", "").await;
    let list: space_api::TemplateList = r.json();
    assert_eq!(list.templates[0].runtime.as_deref(), Some("microvm"));
    // Creates that name no runtime get the template's; a create's own wins.
    let runtime_of = |id: &str| h.node.specs.lock().unwrap()[id].runtime;
    let sb = h.create().await;
    assert_eq!(
        runtime_of(&sb.id),
        Some(space_node_api::RuntimeKind::Microvm)
    );
    let r = h
        .call(Method::POST, "/v1/sandboxes", r#"{"runtime":"namespace"}"#)
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let own = r.json::<Sandbox>();
    assert_eq!(
        runtime_of(&own.id),
        Some(space_node_api::RuntimeKind::Namespace)
    );
    // So does a pool set without one.
    let r = h
        .call(Method::PUT, "/v1/templates/base/pool", r#"{"min":1}"#)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        h.node
            .calls
            .lock()
            .unwrap()
            .contains(&"pool base 1 1 microvm".to_string()),
        "{:?}",
        h.node.calls.lock().unwrap()
    );
    // null: the node's default again.
    let r = set(r#"{"runtime":null}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json::<space_api::Template>().runtime, None);
    let again = h.create().await;
    assert_eq!(
        runtime_of(&again.id),
        Some(space_node_api::RuntimeKind::Namespace)
    );
}

#[tokio::test]
async fn an_all_in_one_spaced_has_nowhere_to_move_a_sandbox() {
    let h = harness().await;
    let sb = h.create().await;
    let uri = format!("/v1/sandboxes/{}/migrate", sb.id);
    let msg = h.call(Method::POST, &uri, "").await.error(409, "conflict");
    assert!(msg.contains("all-in-one"), "{msg}");
    // Bad bodies are refused before anything else.
    h.call(Method::POST, &uri, "{\"to\": 5}")
        .await
        .error(400, "invalid_argument");
    h.call(Method::POST, &uri, "{\"node\": \"x\"}")
        .await
        .error(400, "invalid_argument");
    h.call(Method::POST, "/v1/sandboxes/NOT-AN-ID/migrate", "")
        .await
        .error(400, "invalid_argument");
    // Nothing happened to it.
    let r = h
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{}", sb.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.json::<Sandbox>().state, SandboxState::Running);
}

#[tokio::test]
async fn a_create_with_an_idempotency_key_makes_one_sandbox() {
    let h = harness().await;
    let post = |key: &'static str, body: &'static str| {
        let req = Request::builder()
            .method(Method::POST)
            .uri("/v1/sandboxes")
            .header("authorization", format!("Bearer {}", h.key))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body))
            .unwrap();
        h.send(req)
    };
    let first = post("k-1", r#"{"env":{"A":"1"}}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let sb: Sandbox = first.json();
    let again = post("k-1", r#"{"env":{"A":"1"}}"#).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.json::<Sandbox>().id, sb.id);
    let msg = post("k-1", r#"{"env":{"A":"2"}}"#)
        .await
        .error(409, "conflict");
    assert!(msg.contains("different"), "{msg}");
    post("has space", "{}").await.error(400, "invalid_argument");
    // A refused create forgets its key: fixed, the same key works.
    post("k-2", r#"{"cpu":-1}"#)
        .await
        .error(400, "invalid_argument");
    assert_eq!(post("k-2", "{}").await.status, StatusCode::CREATED);
    let r = h.call(Method::GET, "/v1/sandboxes", Body::empty()).await;
    assert_eq!(r.json::<space_api::SandboxList>().sandboxes.len(), 2);
}

#[tokio::test]
async fn the_reconciler_leaves_a_sandbox_another_replica_holds() {
    let h = harness().await;
    let engine = h.state.engine.clone();
    let lost = h.create().await;
    h.node.set_phase(&lost.id, None);
    // Another replica works on it (its step, a move): its lease is in the store.
    let lease = format!("sandbox/{}", lost.id);
    let store = engine.store().clone();
    assert!(
        store
            .try_lease(&lease, "replica-other", crate::leases::LEASE_TTL)
            .await
            .unwrap()
    );
    let mut backoff = Backoff::default();
    engine.reconcile_once(&mut backoff).await.unwrap();
    let uri = format!("/v1/sandboxes/{}", lost.id);
    let get = || h.call(Method::GET, &uri, Body::empty());
    assert_eq!(get().await.json::<Sandbox>().state, SandboxState::Running);
    // Released (or lapsed): the next pass does the step.
    store.release_lease(&lease, "replica-other").await.unwrap();
    engine.reconcile_once(&mut backoff).await.unwrap();
    assert_eq!(get().await.json::<Sandbox>().state, SandboxState::Failed);
}

/// Decision 0054: the admin key is the one shared file that may change after the first
/// start (the key on disk revoked, a new one made). The replica that makes the new one
/// stores it; another replica with the old one on disk takes the new one at its next start.
#[tokio::test]
async fn a_new_admin_key_reaches_every_replica() {
    let h = harness().await;
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let db = format!("sqlite://{}?mode=rwc", a.path().join("shared.db").display());
    let open = |dir: &std::path::Path| {
        ControlPlane::open(
            ControlConfig::new(dir.to_owned()),
            Some(&db),
            h.node.clone(),
        )
    };
    let key = |dir: &std::path::Path| std::fs::read(dir.join("admin.key")).unwrap();
    let first = open(a.path()).await.unwrap();
    std::fs::copy(a.path().join("secrets.key"), b.path().join("secrets.key")).unwrap();
    drop(open(b.path()).await.unwrap());
    let old = key(a.path());
    assert_eq!(key(b.path()), old);
    // The key on disk is revoked (another admin key took its place): the next start of the
    // first replica makes a new one.
    let store = first.state.engine.store().clone();
    drop(first);
    store.delete_api_keys_named("admin").await.unwrap();
    drop(open(a.path()).await.unwrap());
    let new = key(a.path());
    assert_ne!(new, old);
    // The second replica, with the revoked one on disk, takes the new one.
    drop(open(b.path()).await.unwrap());
    assert_eq!(key(b.path()), new);
    drop(open(a.path()).await.unwrap());
    assert_eq!(key(a.path()), new, "a start changed a live key");
}

#[tokio::test]
async fn a_replica_with_another_secrets_key_refuses_to_start() {
    let h = harness().await;
    let data_dir = h.state.engine.config().data_dir.clone();
    h.state
        .engine
        .vault
        .put(
            space_api::tenant::DEFAULT_TENANT,
            "K",
            &space_api::PutSecret {
                value: "v".into(),
                hosts: vec!["api.x.com".into()],
                header: "X-Key: {}".into(),
            },
        )
        .await
        .unwrap();
    // The same data dir opens again; with another secrets.key it is refused, and says why.
    let reopen = || ControlPlane::open(ControlConfig::new(data_dir.clone()), None, h.node.clone());
    assert!(reopen().await.is_ok());
    std::fs::write(data_dir.join("secrets.key"), [7u8; 32]).unwrap();
    let e = reopen().await.err().expect("refused");
    // The files replicas share (decision 0054), sealed under the first key, are what the
    // other key fails to open first.
    assert!(
        matches!(
            e,
            crate::OpenError::SharedFiles(crate::shared_files::SharedFileError::WrongKey { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("first replica's secrets.key"), "{e}");
    // A store without them (one an older spaced left): the secrets' own check refuses.
    sqlx::query("DELETE FROM shared_files")
        .execute(h.state.engine.store().pool())
        .await
        .unwrap();
    let e = reopen().await.err().expect("refused");
    assert!(matches!(e, crate::OpenError::SecretsKey { .. }), "{e}");
    assert!(e.to_string().contains("same secrets.key"), "{e}");
}
