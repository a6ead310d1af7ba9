//! Node logic with a recording fake runtime, a fake guest connector and plain directories
//! standing in for subvolumes (no root needed), plus one real-btrfs test.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::GuestChannel;
use async_trait::async_trait;

use super::*;
use crate::api::{Limits, RuntimeKind};
use crate::channel::{ChannelError, GuestConnector, lazy_client};
use crate::runtime::{Launched, RuntimeError};
use crate::storage::fake::DirSubvolumes;

#[derive(Default)]
struct FakeRuntime {
    calls: Mutex<Vec<String>>,
    plans: Mutex<Vec<LaunchPlan>>,
    alive: Mutex<HashSet<u32>>,
    next_pid: AtomicU32,
    fail_launch: Mutex<bool>,
    launch_delay: Mutex<Option<Duration>>,
    frozen: Mutex<HashSet<String>>,
}

impl FakeRuntime {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn count(&self, prefix: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.starts_with(prefix))
            .count()
    }
    fn kill_all(&self) {
        self.alive.lock().unwrap().clear();
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    fn kind(&self) -> RuntimeKind {
        // The fake stands in for the node's default runtime.
        RuntimeKind::Namespace
    }
    async fn launch(&self, plan: &LaunchPlan) -> Result<Launched, RuntimeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("launch {}", plan.id));
        let delay = *self.launch_delay.lock().unwrap();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if std::mem::take(&mut *self.fail_launch.lock().unwrap()) {
            return Err(RuntimeError::NotReady("injected".into()));
        }
        assert!(plan.rootfs.is_dir(), "rootfs exists before launch");
        assert!(plan.run_dir.is_dir(), "run dir exists before launch");
        self.plans.lock().unwrap().push(plan.clone());
        let pid = 1000 + self.next_pid.fetch_add(1, Ordering::SeqCst);
        self.alive.lock().unwrap().insert(pid);
        Ok(Launched {
            init_pid: pid,
            start_time: 7,
        })
    }
    async fn destroy(&self, id: &str, launched: Option<&Launched>) -> Result<(), RuntimeError> {
        self.calls.lock().unwrap().push(format!("destroy {id}"));
        if let Some(l) = launched {
            self.alive.lock().unwrap().remove(&l.init_pid);
        }
        Ok(())
    }
    fn alive(&self, launched: &Launched) -> bool {
        self.alive.lock().unwrap().contains(&launched.init_pid)
    }
    fn memory_bytes(&self, _id: &str) -> Option<u64> {
        Some(4096)
    }
    fn cpu_usage_usec(&self, _id: &str) -> Option<u64> {
        Some(250_000)
    }
    async fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), RuntimeError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("freeze {id} {frozen}"));
        let mut f = self.frozen.lock().unwrap();
        if frozen {
            f.insert(id.to_string());
        } else {
            f.remove(id);
        }
        Ok(())
    }
    fn is_frozen(&self, id: &str) -> bool {
        self.frozen.lock().unwrap().contains(id)
    }
}

#[derive(Default)]
struct FakeConnector {
    connects: Mutex<Vec<PathBuf>>,
    fail: Mutex<bool>,
}

#[async_trait]
impl GuestConnector for FakeConnector {
    async fn connect(&self, socket: &Path) -> Result<GuestChannel, ChannelError> {
        self.connects.lock().unwrap().push(socket.to_path_buf());
        if std::mem::take(&mut *self.fail.lock().unwrap()) {
            return Err(ChannelError::Timeout {
                path: socket.to_path_buf(),
                timeout: Duration::from_millis(1),
            });
        }
        Ok(lazy_client(socket))
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    rt: Arc<FakeRuntime>,
    conn: Arc<FakeConnector>,
    subvols: Arc<DirSubvolumes>,
    node: Arc<Node>,
}

fn cfg(dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: dir.join("data"),
        run_dir: dir.join("run"),
        daemon_binary: dir.join("space-daemon"),
        ..Default::default()
    }
}

async fn open(
    dir: &Path,
    rt: Arc<FakeRuntime>,
    conn: Arc<FakeConnector>,
    subvols: Arc<DirSubvolumes>,
) -> Arc<Node> {
    Node::open_with(
        cfg(dir),
        NodeParts {
            volume_root: dir.join("vol"),
            subvols,
            runtime: rt,
            microvm: Some(Err("no microvm in these tests".into())),
            connector: conn,
            network: None,
        },
    )
    .await
    .unwrap()
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let rt = Arc::new(FakeRuntime::default());
    let conn = Arc::new(FakeConnector::default());
    let subvols = Arc::new(DirSubvolumes::default());
    let node = open(dir.path(), rt.clone(), conn.clone(), subvols.clone()).await;
    Fixture {
        dir,
        rt,
        conn,
        subvols,
        node,
    }
}

fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        template: "minimal".into(),
        limits: Limits::default(),
        env: vec![
            ("FOO".into(), "bar".into()),
            ("HOME".into(), "/home/x".into()),
        ],
        hostname: "box".into(),
        network: Default::default(),
        secrets: vec![],
        runtime: None,
    }
}

const START: u32 = 1_000_000_000;

#[tokio::test]
async fn create_snapshots_records_launches_and_connects() {
    let f = fixture().await;
    let st = f.node.create_sandbox(&spec("aaa")).await.unwrap();
    assert_eq!(st.phase, Phase::Running);
    assert_eq!(st.uid_base, START);
    assert_eq!(st.uid_count, 65536);
    assert_eq!(st.runtime, RuntimeKind::Namespace);
    assert_eq!(st.init_pid, Some(1000));
    assert_eq!(st.memory_bytes, Some(4096));
    assert_eq!(st.cpu_usage_usec, Some(250_000));
    let vol = f.dir.path().join("vol");
    assert_eq!(
        st.channel,
        f.dir.path().join("run/sandboxes/aaa/guest.sock")
    );
    // The rootfs is a snapshot of base.
    assert!(vol.join("sandboxes/aaa/rootfs/bin/busybox").is_file());
    assert!(
        f.subvols
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("snapshot")
                && c.contains("templates/minimal/1/rootfs")
                && c.ends_with("sandboxes/aaa/rootfs ro=false"))
    );
    // Persisted record with the launched init.
    let rec: SandboxRecord = storage::read_json(&vol.join("sandboxes/aaa/sandbox.json")).unwrap();
    assert_eq!(rec.template_version, 1);
    assert_eq!(rec.launched.unwrap().init_pid, 1000);
    // The plan: base env, spec env on top (HOME overridden), hostname, daemon binary.
    let plan = f.rt.plans.lock().unwrap()[0].clone();
    let env: HashMap<_, _> = plan.env.iter().cloned().collect();
    assert_eq!(env["PATH"], DEFAULT_PATH);
    assert_eq!(env["HOME"], "/home/x");
    assert_eq!(env["FOO"], "bar");
    assert_eq!(env["HOSTNAME"], "box");
    assert_eq!(plan.env.iter().filter(|(k, _)| k == "HOME").count(), 1);
    assert_eq!(plan.daemon_binary, f.dir.path().join("space-daemon"));
    assert_eq!(plan.uid_base, START);
    // The channel was connected once (readiness).
    assert_eq!(f.conn.connects.lock().unwrap().len(), 1);
    // The run dir is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(f.dir.path().join("run/sandboxes/aaa"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    assert!(f.node.guest("aaa").await.is_ok());
}

/// The reconciler's view of every sandbox carries its phase but not its usage figures,
/// which it never reads; a list carries both.
#[tokio::test]
async fn observe_phases_leaves_out_the_usage_figures() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("aaa")).await.unwrap();
    f.node.create_sandbox(&spec("bbb")).await.unwrap();
    f.node.pause_sandbox("bbb").await.unwrap();
    let light = f.node.observe_phases().await.unwrap().sandboxes;
    let phases: Vec<_> = light.iter().map(|s| (s.id.as_str(), s.phase)).collect();
    assert_eq!(phases, [("aaa", Phase::Running), ("bbb", Phase::Paused)]);
    assert!(light.iter().all(|s| s.init_pid.is_some()));
    assert!(
        light
            .iter()
            .all(|s| s.memory_bytes.is_none() && s.cpu_usage_usec.is_none())
    );
    let full = f.node.list_sandboxes().await.unwrap();
    assert!(full.iter().all(|s| s.memory_bytes == Some(4096)));
}

#[tokio::test]
async fn create_is_idempotent_and_serialized_per_id() {
    let f = fixture().await;
    *f.rt.launch_delay.lock().unwrap() = Some(Duration::from_millis(30));
    let s = spec("same");
    let o = spec("other");
    let (a, b, c) = tokio::join!(
        f.node.create_sandbox(&s),
        f.node.create_sandbox(&s),
        f.node.create_sandbox(&o)
    );
    let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
    assert_eq!(a, b);
    assert_ne!(a.uid_base, c.uid_base);
    assert_eq!(f.rt.count("launch same"), 1);
    assert_eq!(f.rt.count("launch other"), 1);
    // Again later: same status, no new launch.
    assert_eq!(f.node.create_sandbox(&s).await.unwrap(), a);
    assert_eq!(f.rt.count("launch same"), 1);
    // Same id with another template is a conflict.
    let mut other = s.clone();
    other.template = "mine".into();
    assert!(matches!(
        f.node.create_sandbox(&other).await,
        Err(NodeError::Conflict(_))
    ));
}

#[tokio::test]
async fn uid_slots_are_lowest_free_and_freed_on_remove() {
    let f = fixture().await;
    let a = f.node.create_sandbox(&spec("a1")).await.unwrap();
    let b = f.node.create_sandbox(&spec("b1")).await.unwrap();
    assert_eq!((a.uid_base, b.uid_base), (START, START + 65536));
    f.node.remove_sandbox("a1").await.unwrap();
    let c = f.node.create_sandbox(&spec("c1")).await.unwrap();
    assert_eq!(c.uid_base, START);
}

#[tokio::test]
async fn remove_is_idempotent_and_deletes_everything() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("gone")).await.unwrap();
    f.node.remove_sandbox("gone").await.unwrap();
    assert_eq!(f.rt.count("destroy gone"), 1);
    assert!(!f.dir.path().join("vol/sandboxes/gone").exists());
    assert!(!f.dir.path().join("run/sandboxes/gone").exists());
    assert!(
        f.subvols
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.ends_with("sandboxes/gone/rootfs") && c.starts_with("delete"))
    );
    assert!(f.node.sandbox_status("gone").await.unwrap().is_none());
    assert!(f.node.list_sandboxes().await.unwrap().is_empty());
    // Again, and for an id that never existed.
    f.node.remove_sandbox("gone").await.unwrap();
    f.node.remove_sandbox("never").await.unwrap();
    assert!(matches!(
        f.node.remove_sandbox("../x").await,
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        f.node.guest("gone").await,
        Err(NodeError::NotFound { .. })
    ));
}

#[tokio::test]
async fn failed_launch_rolls_back() {
    let f = fixture().await;
    *f.rt.fail_launch.lock().unwrap() = true;
    let err = f.node.create_sandbox(&spec("bad")).await.unwrap_err();
    assert!(matches!(err, NodeError::Internal(_)), "{err}");
    assert!(!f.dir.path().join("vol/sandboxes/bad").exists());
    assert!(!f.dir.path().join("run/sandboxes/bad").exists());
    assert!(f.node.sandbox_status("bad").await.unwrap().is_none());
    // The slot was freed and the id can be created now.
    assert_eq!(
        f.node.create_sandbox(&spec("bad")).await.unwrap().uid_base,
        START
    );
}

#[tokio::test]
async fn failed_connect_destroys_and_rolls_back() {
    let f = fixture().await;
    *f.conn.fail.lock().unwrap() = true;
    let err = f.node.create_sandbox(&spec("nochan")).await.unwrap_err();
    assert!(matches!(err, NodeError::Unavailable { .. }), "{err}");
    assert_eq!(f.rt.count("destroy nochan"), 1);
    assert!(f.rt.alive.lock().unwrap().is_empty());
    assert!(!f.dir.path().join("vol/sandboxes/nochan").exists());
}

#[tokio::test]
async fn failed_snapshot_rolls_back() {
    let f = fixture().await;
    *f.subvols.fail_snapshot.lock().unwrap() = true;
    assert!(f.node.create_sandbox(&spec("snap")).await.is_err());
    assert_eq!(f.rt.count("launch"), 0);
    assert!(!f.dir.path().join("vol/sandboxes/snap").exists());
    assert_eq!(
        f.node.create_sandbox(&spec("snap")).await.unwrap().uid_base,
        START
    );
}

#[tokio::test]
async fn unknown_template_and_bad_specs() {
    let f = fixture().await;
    let mut s = spec("t1");
    s.template = "nope".into();
    match f.node.create_sandbox(&s).await {
        Err(NodeError::NotFound { kind, id }) => {
            assert_eq!((kind, id.as_str()), ("template", "nope"))
        }
        other => panic!("{other:?}"),
    }
    let mut s = spec("Bad/Id");
    assert!(matches!(
        f.node.create_sandbox(&s).await,
        Err(NodeError::InvalidArgument(_))
    ));
    s = spec("ok");
    s.env.push(("A=B".into(), "x".into()));
    assert!(matches!(
        f.node.create_sandbox(&s).await,
        Err(NodeError::InvalidArgument(_))
    ));
    assert_eq!(f.rt.count("launch"), 0);
}

#[tokio::test]
async fn no_port_connection_reaches_the_nodes_own_listeners_in_a_slot() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("p1")).await.unwrap();
    for (port, what) in [(53, "DNS resolver"), (15001, "egress proxy")] {
        match f.node.connect_port("p1", port).await {
            Err(NodeError::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
            Err(e) => panic!("port {port}: {e}"),
            Ok(_) => panic!("port {port} connected"),
        }
    }
}

#[tokio::test]
async fn stop_keeps_rootfs_and_create_restarts_it() {
    let f = fixture().await;
    let first = f.node.create_sandbox(&spec("st")).await.unwrap();
    let marker = f.dir.path().join("vol/sandboxes/st/rootfs/root/state");
    std::fs::write(&marker, "keep").unwrap();
    f.node.stop_sandbox("st").await.unwrap();
    let st = f.node.sandbox_status("st").await.unwrap().unwrap();
    assert_eq!(st.phase, Phase::Stopped);
    assert_eq!(st.init_pid, None);
    assert_eq!(st.cpu_usage_usec, None);
    assert!(matches!(
        f.node.guest("st").await,
        Err(NodeError::Unavailable { .. })
    ));
    f.node.stop_sandbox("st").await.unwrap(); // idempotent
    assert!(matches!(
        f.node.stop_sandbox("zz").await,
        Err(NodeError::NotFound { .. })
    ));
    // Create again: relaunched on the same rootfs and uid range.
    let again = f.node.create_sandbox(&spec("st")).await.unwrap();
    assert_eq!(again.phase, Phase::Running);
    assert_eq!(again.uid_base, first.uid_base);
    assert_eq!(f.rt.count("launch st"), 2);
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "keep");
}

#[tokio::test]
async fn reopen_adopts_running_marks_dead_stopped_and_cleans_leftovers() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("live")).await.unwrap();
    f.node.create_sandbox(&spec("dead")).await.unwrap();
    // "dead"'s init dies while the node is down.
    let dead_pid = f
        .node
        .sandbox_status("dead")
        .await
        .unwrap()
        .unwrap()
        .init_pid
        .unwrap();
    f.rt.alive.lock().unwrap().remove(&dead_pid);
    // A half-created sandbox (no record) and a stale run dir.
    let half = f.dir.path().join("vol/sandboxes/half");
    std::fs::create_dir_all(half.join("rootfs")).unwrap();
    std::fs::create_dir_all(f.dir.path().join("run/sandboxes/stale")).unwrap();
    let launches = f.rt.count("launch");
    let live_status = f.node.sandbox_status("live").await.unwrap().unwrap();
    drop(f.node);

    let conn2 = Arc::new(FakeConnector::default());
    let node = open(f.dir.path(), f.rt.clone(), conn2.clone(), f.subvols.clone()).await;
    assert_eq!(f.rt.count("launch"), launches, "never restarts on open");
    let list = node.list_sandboxes().await.unwrap();
    assert_eq!(
        list.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["dead", "live"]
    );
    assert_eq!(
        node.sandbox_status("live").await.unwrap().unwrap(),
        live_status
    );
    assert_eq!(
        node.sandbox_status("dead").await.unwrap().unwrap().phase,
        Phase::Stopped
    );
    assert_eq!(
        *conn2.connects.lock().unwrap(),
        vec![f.dir.path().join("run/sandboxes/live/guest.sock")]
    );
    assert!(
        f.rt.count("destroy dead") >= 1,
        "leftovers of the dead one are cleaned"
    );
    assert!(!half.exists());
    assert!(!f.dir.path().join("run/sandboxes/stale").exists());
    // The dead one's record no longer claims a live init.
    let rec: SandboxRecord =
        storage::read_json(&f.dir.path().join("vol/sandboxes/dead/sandbox.json")).unwrap();
    assert!(rec.launched.is_none());
    // Slots survive the restart: a new sandbox gets the next free one.
    assert_eq!(
        node.create_sandbox(&spec("new")).await.unwrap().uid_base,
        START + 2 * 65536
    );
    // Base was not rebuilt.
    assert_eq!(node.list_templates().await.unwrap()[0].version, 1);
    f.rt.kill_all();
}

#[tokio::test]
async fn guest_connects_when_no_client_is_cached() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("g")).await.unwrap();
    drop(f.node);
    let conn2 = Arc::new(FakeConnector::default());
    *conn2.fail.lock().unwrap() = true; // adopt fails...
    let node = open(f.dir.path(), f.rt.clone(), conn2.clone(), f.subvols.clone()).await;
    assert_eq!(conn2.connects.lock().unwrap().len(), 1);
    node.guest("g").await.unwrap(); // ...guest() connects again
    node.guest("g").await.unwrap(); // ...and caches
    assert_eq!(conn2.connects.lock().unwrap().len(), 2);
}

/// Decision 0064: a namespace sandbox's connection that no call used for the idle window is
/// closed; one used within it is kept; the next call connects again.
#[tokio::test]
async fn an_idle_guest_connection_is_closed_and_the_next_call_reconnects() {
    let f = fixture().await;
    f.node.create_sandbox(&spec("g")).await.unwrap();
    let connects = || f.conn.connects.lock().unwrap().len();
    let after_create = connects();
    f.node.guest("g").await.unwrap();
    assert_eq!(f.node.close_idle_guests(Duration::from_secs(60)), 0);
    f.node.guest("g").await.unwrap();
    assert_eq!(connects(), after_create, "a client in use is kept");
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(f.node.close_idle_guests(Duration::from_millis(50)), 1);
    assert_eq!(f.node.close_idle_guests(Duration::from_millis(50)), 0);
    f.node.guest("g").await.unwrap();
    assert_eq!(connects(), after_create + 1, "the next call connects again");
    f.node.guest("g").await.unwrap();
    assert_eq!(connects(), after_create + 1, "and caches the new client");
    // A stop of a sandbox whose connection was closed connects to flush it first.
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(f.node.close_idle_guests(Duration::from_millis(50)), 1);
    f.node.stop_sandbox("g").await.unwrap();
    assert_eq!(connects(), after_create + 2);
}

#[tokio::test]
async fn import_template_validates_and_versions() {
    let f = fixture().await;
    let src = f.dir.path().join("tree");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    assert!(matches!(
        f.node
            .import_template("Bad Name", TemplateSource::Dir(src.clone()))
            .await,
        Err(NodeError::InvalidArgument(_))
    ));
    match f
        .node
        .import_template("x", TemplateSource::Dir(f.dir.path().join("missing")))
        .await
    {
        Err(NodeError::InvalidArgument(m)) => assert!(m.contains("missing"), "{m}"),
        other => panic!("{other:?}"),
    }
    let v1 = f
        .node
        .import_template("minimal", TemplateSource::Dir(src.clone()))
        .await
        .unwrap();
    assert_eq!(v1.version, 2);
    let mut list = f.node.list_templates().await.unwrap();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].version, 2);
    // New sandboxes use the newest version and pin it.
    f.node.create_sandbox(&spec("pin")).await.unwrap();
    let rec: SandboxRecord =
        storage::read_json(&f.dir.path().join("vol/sandboxes/pin/sandbox.json")).unwrap();
    assert_eq!(rec.template_version, 2);
}

/// Real kernel (root, btrfs-progs, loop devices): the node over a loop-mounted btrfs image
/// with the real ioctl-backed storage and the fake runtime.
#[tokio::test]
async fn real_btrfs_create_and_remove_with_nested_subvolumes() {
    use space_sys::btrfs;
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path());
    let vol = storage::prepare_volume(&c.data_dir, 512 << 20).unwrap();
    let _unmount = crate::storage::tests::Unmount(vol.root.clone());
    let rt = Arc::new(FakeRuntime::default());
    let node = Node::open_with(
        c,
        NodeParts {
            volume_root: vol.root.clone(),
            subvols: Arc::new(storage::Btrfs::default()),
            runtime: rt.clone(),
            microvm: Some(Err("no microvm in these tests".into())),
            connector: Arc::new(FakeConnector::default()),
            network: None,
        },
    )
    .await
    .unwrap();
    let base = vol.root.join("templates/minimal/1/rootfs");
    assert!(btrfs::is_subvolume(&base).unwrap());
    assert!(btrfs::is_readonly(&base).unwrap());

    let mut times = Vec::new();
    for i in 0..5 {
        let t0 = std::time::Instant::now();
        node.create_sandbox(&spec(&format!("r{i}"))).await.unwrap();
        times.push(t0.elapsed());
    }
    times.sort();
    eprintln!("node create (real btrfs, fake runtime) p50 {:?}", times[2]);
    let rootfs = vol.root.join("sandboxes/r0/rootfs");
    assert!(btrfs::is_subvolume(&rootfs).unwrap());
    assert!(!btrfs::is_readonly(&rootfs).unwrap());
    // Sandbox code makes nested subvolumes (allowed to unprivileged users) and a symlink to
    // another sandbox's rootfs.
    btrfs::create_subvolume(&rootfs.join("tmp"), "nested").unwrap();
    btrfs::create_subvolume(&rootfs.join("tmp/nested"), "deeper").unwrap();
    std::os::unix::fs::symlink(
        vol.root.join("sandboxes/r1/rootfs"),
        rootfs.join("tmp/evil"),
    )
    .unwrap();
    node.remove_sandbox("r0").await.unwrap();
    assert!(!vol.root.join("sandboxes/r0").exists());
    assert!(vol.root.join("sandboxes/r1/rootfs/bin/busybox").exists());
    for i in 1..5 {
        node.remove_sandbox(&format!("r{i}")).await.unwrap();
    }
    assert!(
        btrfs::child_subvolumes(&vol.root)
            .unwrap()
            .iter()
            .all(|c| c.rel_path.starts_with("templates"))
    );
}

/// End to end on the real kernel: loop-mounted btrfs, the namespace runtime and a real static
/// space-daemon (path in SPACE_DAEMON_BIN). Creates, talks to, adopts after a node restart,
/// and removes sandboxes; prints the create latency.
#[tokio::test]
#[ignore = "needs root and a static space-daemon: SPACE_DAEMON_BIN=... cargo test -- --ignored"]
async fn real_node_end_to_end() {
    let daemon = PathBuf::from(
        std::env::var("SPACE_DAEMON_BIN").expect("SPACE_DAEMON_BIN names a static space-daemon"),
    );
    let dir = tempfile::tempdir().unwrap();
    // Like /var/lib: traversable by the sandboxes' host uids.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let c = NodeConfig {
        data_dir: dir.path().join("data"),
        run_dir: dir.path().join("run"),
        image_size_bytes: 1 << 30,
        daemon_binary: daemon,
        cgroup_parent: format!("space-nodetest-{}", std::process::id()),
        ..Default::default()
    };
    let _cgroups = RemoveCgroupParent(c.cgroup_parent.clone());
    let node = Node::open(c.clone()).await.unwrap();
    let _unmount =
        crate::storage::tests::Unmount(std::fs::canonicalize(&c.data_dir).unwrap().join("volume"));
    let mut times = Vec::new();
    for i in 0..10 {
        let t0 = std::time::Instant::now();
        let st = node.create_sandbox(&spec(&format!("e{i}"))).await.unwrap();
        times.push(t0.elapsed());
        assert_eq!(st.phase, Phase::Running);
    }
    times.sort();
    eprintln!("create (real) p50 {:?} p90 {:?}", times[5], times[9]);
    let info = node
        .guest("e0")
        .await
        .unwrap()
        .info(space_proto::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.hostname, "box");
    let st = node.sandbox_status("e0").await.unwrap().unwrap();
    drop(node);

    // Restart the node: the sandbox is adopted, not restarted.
    let node = Node::open(c.clone()).await.unwrap();
    let st2 = node.sandbox_status("e0").await.unwrap().unwrap();
    assert_eq!(st2.init_pid, st.init_pid);
    assert_eq!(st2.phase, Phase::Running);
    let info2 = node
        .guest("e0")
        .await
        .unwrap()
        .info(space_proto::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info2.started_unix_ms, info.started_unix_ms);

    node.stop_sandbox("e1").await.unwrap();
    assert_eq!(
        node.sandbox_status("e1").await.unwrap().unwrap().phase,
        Phase::Stopped
    );
    assert_eq!(
        node.create_sandbox(&spec("e1")).await.unwrap().phase,
        Phase::Running
    );
    for i in 0..10 {
        node.remove_sandbox(&format!("e{i}")).await.unwrap();
    }
    assert!(node.list_sandboxes().await.unwrap().is_empty());
}

/// The runtime keeps the (empty once sandboxes are gone) parent cgroups; tests remove theirs.
struct RemoveCgroupParent(String);

impl Drop for RemoveCgroupParent {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(&self.0));
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for ent in rd.flatten() {
                let _ = std::fs::remove_dir(ent.path().join(&self.0));
            }
        }
    }
}

#[tokio::test]
async fn pause_and_resume_follow_the_freezer_and_survive_reopen() {
    let f = fixture().await;
    let id = "pausepausepausepause";
    f.node.create_sandbox(&spec(id)).await.unwrap();
    let st = f.node.pause_sandbox(id).await.unwrap();
    assert_eq!(st.phase, Phase::Paused);
    assert!(st.init_pid.is_some(), "a paused sandbox is alive");
    // A frozen guest would hang any call: refused at once.
    assert!(matches!(
        f.node.guest(id).await,
        Err(NodeError::Conflict(_))
    ));
    assert!(matches!(
        f.node.pause_sandbox(id).await,
        Err(NodeError::WrongPhase {
            phase: Phase::Paused,
            ..
        })
    ));
    assert!(matches!(
        f.node.pause_sandbox("unknownunknownunknow").await,
        Err(NodeError::NotFound { .. })
    ));
    // A node restart reads the freezer: still paused, not mistaken for dead, not connected.
    let connects = f.conn.connects.lock().unwrap().len();
    let node = open(
        f.dir.path(),
        f.rt.clone(),
        f.conn.clone(),
        f.subvols.clone(),
    )
    .await;
    assert_eq!(f.conn.connects.lock().unwrap().len(), connects);
    let st = node.sandbox_status(id).await.unwrap().unwrap();
    assert_eq!(st.phase, Phase::Paused);
    assert_eq!(node.resume_sandbox(id).await.unwrap().phase, Phase::Running);
    assert!(matches!(
        node.resume_sandbox(id).await,
        Err(NodeError::WrongPhase {
            phase: Phase::Running,
            ..
        })
    ));
    node.guest(id).await.unwrap();
    // Stopped sandboxes cannot be paused.
    node.stop_sandbox(id).await.unwrap();
    assert!(matches!(
        node.pause_sandbox(id).await,
        Err(NodeError::WrongPhase {
            phase: Phase::Stopped,
            ..
        })
    ));
}

/// Waits (bounded) until `template`'s pool holds `n` ready sandboxes.
#[tokio::test]
async fn a_call_during_a_snapshot_freeze_waits_for_it_instead_of_failing() {
    let f = fixture().await;
    let id = "freezefreezefreezefr";
    f.node.create_sandbox(&spec(id)).await.unwrap();
    // What a snapshot does: the sandbox's lock held while it is frozen.
    let lock = f.node.lock_for(id);
    let guard = lock.lock().await;
    f.rt.set_frozen(id, true).await.unwrap();
    let node = f.node.clone();
    let call = tokio::spawn(async move { node.guest(id).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!call.is_finished(), "the call waits for the snapshot");
    f.rt.set_frozen(id, false).await.unwrap();
    drop(guard);
    call.await.unwrap().unwrap();
}

async fn wait_pool_ready(node: &Node, template: &str, n: u32) -> PoolStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let p = node
            .pools_impl()
            .into_iter()
            .find(|p| p.template == template)
            .expect("pool configured");
        if p.ready >= n && p.starting == 0 {
            return p;
        }
        assert!(std::time::Instant::now() < deadline, "pool stuck: {p:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn pool_sizes_are_checked_and_clamped_to_capacity() {
    let f = fixture().await;
    assert!(matches!(
        f.node
            .set_pool(
                "nope",
                PoolConfig {
                    min: 1,
                    max: 1,
                    microvm: false
                }
            )
            .await,
        Err(NodeError::NotFound { .. })
    ));
    assert!(matches!(
        f.node.set_pool("minimal", PoolConfig { min: 3, max: 2, microvm: false }).await,
        Err(NodeError::InvalidArgument(m)) if m.contains('3') && m.contains('2')
    ));
    let p = f
        .node
        .set_pool(
            "minimal",
            PoolConfig {
                min: 2_000_000_000,
                max: 2_000_000_000,
                microvm: false,
            },
        )
        .await
        .unwrap();
    assert!(p.max < 2_000_000_000, "{p:?}");
    assert!(
        p.warning.as_deref().is_some_and(|w| w.contains("capacity")),
        "{p:?}"
    );
    f.node
        .set_pool(
            "minimal",
            PoolConfig {
                min: 0,
                max: 0,
                microvm: false,
            },
        )
        .await
        .unwrap();
    assert!(f.node.pools_impl().is_empty());
}

#[tokio::test]
async fn pool_members_are_hidden_and_a_failed_hand_out_falls_back_cold() {
    let f = fixture().await;
    let p = f
        .node
        .set_pool(
            "minimal",
            PoolConfig {
                min: 2,
                max: 2,
                microvm: false,
            },
        )
        .await
        .unwrap();
    assert_eq!((p.min, p.max, p.warning), (2, 2, None));
    wait_pool_ready(&f.node, "minimal", 2).await;
    assert_eq!(f.rt.count("launch"), 2);
    // Ready sandboxes are not the node's sandboxes.
    assert!(f.node.list_sandboxes().await.unwrap().is_empty());
    // The fake runtime cannot personalize: the member is destroyed, the create goes cold.
    let st = f
        .node
        .create_sandbox(&spec("aaaaaaaaaaaaaaaaaaaa"))
        .await
        .unwrap();
    assert!(!st.pooled);
    assert_eq!(st.phase, Phase::Running);
    let p = f.node.pools_impl().pop().unwrap();
    assert_eq!((p.hits, p.misses), (1, 0));
    assert_eq!(f.rt.count("destroy"), 1, "{:?}", f.rt.calls());
    // A sandbox dir for the create, and the other ready member's (and its replacement's).
    wait_pool_ready(&f.node, "minimal", 2).await;
    let dirs = std::fs::read_dir(f.dir.path().join("vol/sandboxes"))
        .unwrap()
        .count();
    assert_eq!(dirs, 3);
    // A restart destroys the ready members of the last run; the sandbox stays.
    let node = open(
        f.dir.path(),
        f.rt.clone(),
        f.conn.clone(),
        f.subvols.clone(),
    )
    .await;
    assert_eq!(f.rt.count("destroy"), 3, "{:?}", f.rt.calls());
    let dirs: Vec<_> = std::fs::read_dir(f.dir.path().join("vol/sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(dirs, vec![std::ffi::OsString::from("aaaaaaaaaaaaaaaaaaaa")]);
    assert_eq!(node.list_sandboxes().await.unwrap().len(), 1);
    // Closing the pools destroys what the first node still holds.
    f.node.shutdown().await;
    assert!(f.node.pools_impl().iter().all(|p| p.ready == 0));
}

#[test]
fn a_new_sandbox_is_refused_below_the_memory_floor() {
    assert!(super::admission::admit(300, 256).is_ok());
    assert!(super::admission::admit(256, 256).is_ok());
    assert!(super::admission::admit(0, 0).is_ok());
    let e = super::admission::admit(100, 256).unwrap_err();
    assert!(matches!(e, NodeError::Exhausted(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("100 MiB available, below its floor of 256 MiB")
            && msg.contains("--min-free-memory"),
        "{msg}"
    );
}
