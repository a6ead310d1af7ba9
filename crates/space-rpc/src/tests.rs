//! The transport against a fake node over real loopback HTTP/2: every answer and error comes
//! back as the node gave it, retries with one operation id do the work once, ports and
//! uploads stream both ways.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use space_node_api::{
    GuestChannel, NodeApi, NodeError, Phase, PortStream, RuntimeKind, SandboxSpec, SandboxStatus,
    TemplateDefaults, TemplateEvent, TemplateInfo, TemplateProgress, TemplateSource,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{NodeService, RemoteNode};

#[derive(Default)]
struct Fake {
    sandboxes: Mutex<BTreeMap<String, SandboxStatus>>,
    creates: Mutex<u32>,
    uploads: Mutex<Vec<Vec<u8>>>,
}

fn status(spec: &SandboxSpec) -> SandboxStatus {
    SandboxStatus {
        id: spec.id.clone(),
        phase: Phase::Running,
        template: spec.template.clone(),
        runtime: RuntimeKind::Namespace,
        init_pid: Some(42),
        uid_base: 100_000,
        uid_count: 65536,
        channel: PathBuf::from("/run/x"),
        memory_bytes: None,
        cpu_usage_usec: None,
        disk_bytes: None,
        network: None,
        pooled: false,
        restored: false,
    }
}

#[async_trait]
impl NodeApi for Fake {
    async fn create_sandbox(&self, spec: &SandboxSpec) -> Result<SandboxStatus, NodeError> {
        if spec.template != "base" {
            return Err(NodeError::NotFound {
                kind: "template",
                id: spec.template.clone(),
            });
        }
        // Slow enough that two calls with one operation id overlap.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        *self.creates.lock().unwrap() += 1;
        let s = status(spec);
        self.sandboxes
            .lock()
            .unwrap()
            .insert(spec.id.clone(), s.clone());
        Ok(s)
    }
    async fn remove_sandbox(&self, id: &str) -> Result<(), NodeError> {
        self.sandboxes.lock().unwrap().remove(id);
        Ok(())
    }
    async fn stop_sandbox(&self, id: &str) -> Result<(), NodeError> {
        Err(NodeError::WrongPhase {
            id: id.into(),
            phase: Phase::Paused,
        })
    }
    async fn sandbox_status(&self, id: &str) -> Result<Option<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().get(id).cloned())
    }
    async fn list_sandboxes(&self) -> Result<Vec<SandboxStatus>, NodeError> {
        Ok(self.sandboxes.lock().unwrap().values().cloned().collect())
    }
    async fn guest_channel(&self, id: &str) -> Result<GuestChannel, NodeError> {
        Err(NodeError::NotFound {
            kind: "sandbox",
            id: id.into(),
        })
    }
    async fn list_templates(&self) -> Result<Vec<TemplateInfo>, NodeError> {
        Ok(Vec::new())
    }
    async fn import_template(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> Result<TemplateInfo, NodeError> {
        let TemplateSource::Tar(path) = source else {
            return Err(NodeError::InvalidArgument("only uploads here".into()));
        };
        self.uploads
            .lock()
            .unwrap()
            .push(std::fs::read(&path).unwrap());
        Ok(TemplateInfo {
            name: name.into(),
            version: 1,
            created_unix_ms: 1,
            path,
            defaults: TemplateDefaults::default(),
            source: "upload".into(),
        })
    }
    async fn import_template_with_progress(
        &self,
        name: &str,
        source: TemplateSource,
        progress: TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        let _ = progress.send(TemplateEvent::Note("unpacking".into()));
        self.import_template(name, source).await
    }
    /// An echo server that upper-cases what it reads, on port 7.
    async fn connect_port(&self, id: &str, port: u16) -> Result<PortStream, NodeError> {
        if port != 7 {
            return Err(NodeError::Unavailable {
                id: id.into(),
                reason: format!("nothing listens on port {port}"),
            });
        }
        let (ours, theirs) = tokio::io::duplex(1024);
        tokio::spawn(async move {
            let (mut rd, mut wr) = tokio::io::split(ours);
            let mut buf = [0u8; 512];
            while let Ok(n) = rd.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                let up = buf[..n].to_ascii_uppercase();
                if wr.write_all(&up).await.is_err() {
                    return;
                }
            }
            let _ = wr.shutdown().await;
        });
        Ok(Box::new(theirs))
    }
}

async fn serve(fake: Arc<Fake>) -> (RemoteNode, tempfile::TempDir) {
    let scratch = tempfile::tempdir().unwrap();
    let service = NodeService::new(fake, scratch.path().to_owned(), 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, crate::router(service)).await });
    let channel = crate::channel(&format!("http://{addr}")).unwrap();
    (RemoteNode::new("n1", channel), scratch)
}

fn spec(id: &str, template: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        template: template.into(),
        limits: Default::default(),
        env: Vec::new(),
        hostname: id.into(),
        network: Default::default(),
        secrets: Vec::new(),
        runtime: None,
    }
}

#[tokio::test]
async fn operations_and_their_errors_come_back_as_the_node_gave_them() {
    let fake = Arc::new(Fake::default());
    let (node, _scratch) = serve(fake.clone()).await;
    let s = node.create_sandbox(&spec("s1", "base")).await.unwrap();
    assert_eq!(s, status(&spec("s1", "base")));
    assert_eq!(node.list_sandboxes().await.unwrap().len(), 1);
    assert_eq!(node.sandbox_status("s1").await.unwrap(), Some(s));
    assert_eq!(node.sandbox_status("nope").await.unwrap(), None);

    let e = node.create_sandbox(&spec("s2", "gone")).await.unwrap_err();
    assert!(
        matches!(&e, NodeError::NotFound { kind: "template", id } if id == "gone"),
        "{e:?}"
    );
    let e = node.stop_sandbox("s1").await.unwrap_err();
    assert!(
        matches!(
            e,
            NodeError::WrongPhase {
                phase: Phase::Paused,
                ..
            }
        ),
        "{e:?}"
    );
    // An operation the fake leaves to the trait's default.
    let e = node.pause_sandbox("s1").await.unwrap_err();
    assert_eq!(e.code(), "conflict");
    node.remove_sandbox("s1").await.unwrap();
    assert!(node.list_sandboxes().await.unwrap().is_empty());
    // A guest call's error is the node's, in the call's status.
    let mut guest = node.guest("s9").await.unwrap();
    let st = guest.info(space_proto::InfoRequest {}).await.unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");
    assert!(st.message().contains("sandbox s9 not found"), "{st:?}");
}

#[tokio::test]
async fn one_operation_id_does_the_work_once() {
    let fake = Arc::new(Fake::default());
    let (node, _scratch) = serve(fake.clone()).await;
    let mut client = space_proto::node::node_client::NodeClient::new(node.channel_for_tests());
    let request = serde_json::to_vec(&crate::wire::Op::CreateSandbox {
        spec: spec("s1", "base"),
    })
    .unwrap();
    let call = |id: &str| space_proto::node::CallRequest {
        request: request.clone(),
        operation_id: id.into(),
    };
    // Two at once (the second waits for the first), then a late retry.
    let (mut c1, mut c2) = (client.clone(), client.clone());
    let (a, b) = tokio::join!(c1.call(call("op-1")), c2.call(call("op-1")));
    let c = client.call(call("op-1")).await.unwrap();
    assert_eq!(a.unwrap().into_inner(), c.get_ref().clone());
    assert_eq!(b.unwrap().into_inner(), c.into_inner());
    assert_eq!(*fake.creates.lock().unwrap(), 1);
    // Another id is another operation.
    client.call(call("op-2")).await.unwrap();
    assert_eq!(*fake.creates.lock().unwrap(), 2);
    // Not an operation at all.
    let bad = space_proto::node::CallRequest {
        request: br#"{"op":"format_disk"}"#.to_vec(),
        operation_id: String::new(),
    };
    let st = client.call(bad).await.unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn ports_stream_both_ways_and_close() {
    let (node, _scratch) = serve(Arc::new(Fake::default())).await;
    let mut conn = node.connect_port("s1", 7).await.unwrap();
    conn.write_all(b"hello ").await.unwrap();
    conn.write_all(b"node").await.unwrap();
    conn.shutdown().await.unwrap();
    let mut back = String::new();
    conn.read_to_string(&mut back).await.unwrap();
    assert_eq!(back, "HELLO NODE");
    // A port nothing listens on fails at connect, with the node's reason.
    let Err(e) = node.connect_port("s1", 8).await else {
        panic!("connected to a port nothing listens on");
    };
    assert!(e.to_string().contains("nothing listens on port 8"), "{e}");
}

#[tokio::test]
async fn uploads_arrive_whole_and_oversized_ones_are_refused() {
    let fake = Arc::new(Fake::default());
    let (node, scratch) = serve(fake.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let tar = dir.path().join("t.tar");
    // Several chunks of the client's, with a pattern that shows reordering.
    let data: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&tar, &data).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let info = node
        .import_template_with_progress("t", TemplateSource::Tar(tar.clone()), tx)
        .await
        .unwrap();
    assert_eq!((info.name.as_str(), info.version), ("t", 1));
    assert_eq!(
        rx.recv().await,
        Some(TemplateEvent::Note("unpacking".into()))
    );
    assert_eq!(fake.uploads.lock().unwrap().as_slice(), &[data]);
    // The scratch file is gone once imported.
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);

    std::fs::write(&tar, vec![0u8; (1 << 20) + 1]).unwrap();
    let e = node
        .import_template("t", TemplateSource::Tar(tar))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("larger than this node's limit"),
        "{e}"
    );
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
    let e = node
        .import_template("t", TemplateSource::Dir(dir.path().into()))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("send it as a tar archive"), "{e}");
}

#[tokio::test]
async fn a_node_that_is_not_there_is_unavailable_by_name() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let node = RemoteNode::new("n7", crate::channel(&format!("http://{addr}")).unwrap());
    let e = node.list_sandboxes().await.unwrap_err();
    assert!(
        matches!(&e, NodeError::Unreachable { node, .. } if node == "n7"),
        "{e:?}"
    );
    // The cause is named, not only tonic's "transport error".
    let text = e.to_string();
    assert!(text.starts_with("node n7 is unreachable"), "{e}");
    assert!(text.to_lowercase().contains("connection refused"), "{e}");
}
