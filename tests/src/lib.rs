//! Harness for the integration tests: each test starts its own real `spaced` on a temporary
//! data dir (which is not btrfs, so spaced makes and loop-mounts its own image), with its own
//! run dir, cgroup parent, uid range and port, and drives it through the CLI and the REST API.
//!
//! Every spaced runs in its own network namespace (`spt-<pid>-<n>`, made here with `ip netns`),
//! reached over a veth pair that carries a private /30 out of 10.251.0.0/16: the node's slots,
//! nftables tables and sysctls never touch the host's, and tests may run in parallel.
//! `Spaced::start_host_netns` is the opt-out (spaced in the host netns, `--network off`).
//! [`netlab::NetLab`] adds a fake internet behind the node for the network tests.
//!
//! Needs root. The binaries come from `SPACE_BIN_DIR` (spaced, space), `SPACE_DAEMON_BINARY`
//! and `SPACE_PROBE_BINARY`; `scripts/test` sets all four.

pub mod fake_node;
pub mod netlab;
pub mod oci;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

static INSTANCE: AtomicU32 = AtomicU32::new(0);

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Where `scripts/test` builds every binary, all static (decision 0026).
fn static_debug_dir() -> PathBuf {
    workspace_root()
        .join("target")
        .join(format!("{}-unknown-linux-gnu", std::env::consts::ARCH))
        .join("debug")
}

/// Directory holding the `spaced` and `space` binaries.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("SPACE_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(static_debug_dir)
}

fn guest_bin(var: &str, name: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| static_debug_dir().join(name))
}

/// `n` random bytes from the kernel, as lowercase hex.
pub fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The static space-daemon.
pub fn daemon_binary() -> PathBuf {
    guest_bin("SPACE_DAEMON_BINARY", "space-daemon")
}

/// The static isolation probe.
pub fn probe_binary() -> PathBuf {
    guest_bin("SPACE_PROBE_BINARY", "space-probe")
}

/// Fails the test loudly unless it runs as root: these tests are never silently skipped.
/// The Debian base rootfs cache (`SPACE_BASE_CACHE`, else /var/cache/space/base-debian12),
/// or `None` where it was never built. With SPACE_REQUIRE_BASE=1 that is a failure.
pub fn base_cache() -> Option<PathBuf> {
    let p = std::env::var_os("SPACE_BASE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/space/base-debian12"));
    if p.join("rootfs").is_dir() {
        return Some(p);
    }
    let why = format!(
        "no Debian base rootfs at {} (scripts/test builds it)",
        p.display()
    );
    if std::env::var("SPACE_REQUIRE_BASE").as_deref() == Ok("1") {
        panic!("SPACE_REQUIRE_BASE=1 but {why}");
    }
    eprintln!("skipping: {why} (set SPACE_REQUIRE_BASE=1 to require it)");
    None
}

/// The Python of a venv with the official `e2b` SDK (`SPACE_E2B_PYTHON`, set by scripts/test,
/// which installs it), or `None` where there is none. With SPACE_REQUIRE_E2B=1 that is a
/// failure.
pub fn e2b_python() -> Option<PathBuf> {
    python_from("SPACE_E2B_PYTHON")
}

/// The same for the older SDK that still calls E2B's pre-v2 paths (`SPACE_E2B_OLD_PYTHON`).
pub fn e2b_old_python() -> Option<PathBuf> {
    python_from("SPACE_E2B_OLD_PYTHON")
}

/// The node that runs the JS SDK tests (`SPACE_E2B_NODE`, >= 20.18.1).
pub fn e2b_node() -> Option<PathBuf> {
    path_from("SPACE_E2B_NODE", "scripts/test finds or installs it")
}

/// The node_modules of the newest JS SDK (`SPACE_E2B_JS`).
pub fn e2b_js() -> Option<PathBuf> {
    path_from("SPACE_E2B_JS", "scripts/test installs the SDK from npm")
}

/// The node_modules of the older JS SDK, which still calls the pre-v2 paths
/// (`SPACE_E2B_OLD_JS`).
pub fn e2b_old_js() -> Option<PathBuf> {
    path_from("SPACE_E2B_OLD_JS", "scripts/test installs the SDK from npm")
}

/// The Python of a venv with space's own SDK installed from `sdk/python` (`SPACE_SDK_PYTHON`,
/// set by scripts/test, which installs it).
pub fn sdk_python() -> Option<PathBuf> {
    path_from("SPACE_SDK_PYTHON", "scripts/test installs sdk/python")
}

/// The wheels the `code-interpreter` template installs offline (`SPACE_CI_WHEELS`, a
/// directory that scripts/test fills from PyPI).
pub fn ci_wheels() -> Option<PathBuf> {
    path_from("SPACE_CI_WHEELS", "scripts/test downloads them")
}

fn python_from(var: &str) -> Option<PathBuf> {
    path_from(var, "scripts/test installs the SDK")
}

/// The file or directory `var` names, or None (a panic with SPACE_REQUIRE_E2B=1).
fn path_from(var: &str, how: &str) -> Option<PathBuf> {
    let why = match std::env::var_os(var).map(PathBuf::from) {
        Some(p) if p.exists() => return Some(p),
        Some(p) => format!("{var}={} does not exist", p.display()),
        None => format!("{var} is not set ({how})"),
    };
    if std::env::var("SPACE_REQUIRE_E2B").as_deref() == Ok("1") {
        panic!("SPACE_REQUIRE_E2B=1 but {why}");
    }
    eprintln!("skipping: {why} (set SPACE_REQUIRE_E2B=1 to require it)");
    None
}

pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "integration tests need root (namespaces, cgroups, btrfs, loop devices)"
    );
}

/// Run a command to completion; fail with its stderr unless it succeeds.
pub fn run_cmd(prog: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {prog}"))?;
    if !out.status.success() {
        bail!(
            "{prog} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The node's own network namespace and the veth pair that reaches it from the host.
pub struct NodeNet {
    /// `ip netns` name; the namespace is pinned at `/run/netns/<name>`.
    pub name: String,
    /// Host-side address of the veth (10.251.x.y+1).
    pub host_ip: std::net::Ipv4Addr,
    /// Node-side address of the veth (10.251.x.y+2): spaced listens here.
    pub node_ip: std::net::Ipv4Addr,
    /// Host-side veth name.
    pub host_if: String,
}

/// Port spaced listens on inside its own namespace (which is fresh, so nothing else holds it).
const NODE_PORT: u16 = 7070;
/// /30s of 10.251.0.0/16.
const HARNESS_SLOTS: u32 = 16_384;

impl NodeNet {
    /// `ip netns add` a namespace with lo up and a veth pair to the host carrying a /30 out of
    /// 10.251.0.0/16. The veth's host-side name encodes the /30, so creating it is the lock:
    /// on a collision (another test process holds that /30) the next one is tried.
    pub fn create(pid: u32, n: u32) -> Result<NodeNet> {
        sweep_stale_namespaces();
        let name = format!("spt-{pid}-{n}");
        run_cmd("ip", &["netns", "add", &name])?;
        let made = (|| -> Result<NodeNet> {
            run_cmd("ip", &["-n", &name, "link", "set", "lo", "up"])?;
            let start = (pid.wrapping_mul(2_654_435_761) ^ n.wrapping_mul(40_503)) % HARNESS_SLOTS;
            for k in 0..64 {
                let slot = (start + k * 97) % HARNESS_SLOTS;
                let host_if = format!("spth{slot}");
                let node_if = format!("sptn{slot}");
                let r = run_cmd(
                    "ip",
                    &[
                        "link", "add", &host_if, "type", "veth", "peer", "name", &node_if, "netns",
                        &name,
                    ],
                );
                if let Err(e) = r {
                    if e.to_string().contains("exists") {
                        continue;
                    }
                    return Err(e);
                }
                let base = u32::from(std::net::Ipv4Addr::new(10, 251, 0, 0)) + slot * 4;
                let host_ip = std::net::Ipv4Addr::from(base + 1);
                let node_ip = std::net::Ipv4Addr::from(base + 2);
                let net = NodeNet {
                    name: name.clone(),
                    host_ip,
                    node_ip,
                    host_if: host_if.clone(),
                };
                run_cmd(
                    "ip",
                    &["addr", "add", &format!("{host_ip}/30"), "dev", &host_if],
                )?;
                run_cmd("ip", &["link", "set", &host_if, "up"])?;
                run_cmd(
                    "ip",
                    &[
                        "-n",
                        &name,
                        "addr",
                        "add",
                        &format!("{node_ip}/30"),
                        "dev",
                        &node_if,
                    ],
                )?;
                run_cmd("ip", &["-n", &name, "link", "set", &node_if, "up"])?;
                return Ok(net);
            }
            bail!("no free /30 in 10.251.0.0/16 after 64 tries")
        })();
        if made.is_err() {
            let _ = run_cmd("ip", &["netns", "del", &name]);
        }
        made
    }

    /// A node namespace without a spaced (e.g. to check the lab from the node's side).
    pub fn create_fresh() -> Result<NodeNet> {
        require_root();
        Self::create(std::process::id(), INSTANCE.fetch_add(1, Ordering::SeqCst))
    }

    /// Routes 10.251.0.0/16 (the harness's namespaces) through the host, so that this
    /// namespace reaches the others' addresses (the host forwards between its veths).
    pub fn route_harness_via_host(&self) -> Result<()> {
        let via = self.host_ip.to_string();
        let out = Command::new("ip")
            .args([
                "-n",
                &self.name,
                "route",
                "replace",
                "10.251.0.0/16",
                "via",
                &via,
            ])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "ip route in {}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Path of the pinned namespace.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// A command that runs inside the node's network namespace.
    pub fn command(&self, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(prog);
        c
    }
}

impl Drop for NodeNet {
    fn drop(&mut self) {
        // Deleting the namespace destroys the veth pair with it (once nothing else holds it).
        let _ = run_cmd("ip", &["netns", "del", &self.name]);
        let _ = run_cmd("ip", &["link", "del", &self.host_if]);
    }
}

/// Namespaces left by test processes that died without cleaning up (`spt-<pid>-*`,
/// `splab-<pid>-*` whose pid is gone): delete them so their veths and /30s come back.
fn sweep_stale_namespaces() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(rd) = std::fs::read_dir("/run/netns") else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name
                .strip_prefix("spt-")
                .or_else(|| name.strip_prefix("splab-"))
            else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !Path::new("/proc").join(pid.to_string()).exists() {
                let _ = run_cmd("ip", &["netns", "del", &name]);
            }
        }
    });
}

/// One running spaced with everything it owns.
pub struct Spaced {
    pub dir: tempfile::TempDir,
    pub url: String,
    pub key: String,
    pub listen: String,
    pub uid_base: u32,
    pub cgroup_parent: String,
    /// The node's network namespace; `None` when spaced runs in the host's.
    pub net: Option<NodeNet>,
    /// Extra spaced flags, kept for restarts.
    extra_args: Vec<String>,
    child: Option<Child>,
    /// Split roles ([`Spaced::start_split`]): the node agent's flags; `child` is then
    /// `spaced control` and `node_child` `spaced node`.
    split: Option<Vec<String>>,
    /// Split, with the node joined to the control plane by a token (mTLS) instead of at
    /// `--node` on loopback.
    joined: bool,
    /// The token the joined node joined with.
    pub join_token: Option<String>,
    /// A joined node of its own ([`Spaced::join_node`]): the control plane's cluster listener,
    /// and where the control plane reaches this node. None: the node beside the control plane.
    node_only: Option<(String, String)>,
    /// A control-plane replica without a node of its own ([`Spaced::add_replica`]).
    control_only: bool,
    node_child: Option<Child>,
    http: reqwest::Client,
}

/// Starts `cmd` (a spaced) with its output appended to `log`.
fn launch(mut cmd: Command, log: &Path) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    cmd.env("RUST_LOG", "info")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {cmd:?}"))
}

/// Polls `f` every 50 ms until it holds (true) or `timeout` passes (false).
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where a split node agent serves the node contract, inside the node's namespace.
pub const SPLIT_NODE_ADDR: &str = "127.0.0.1:7071";
/// Where a joined split's control plane takes joins and heartbeats, inside the namespace.
pub const CLUSTER_ADDR: &str = "127.0.0.1:7443";
/// The port of the cluster listener (on every address of the control plane's namespace).
pub const CLUSTER_PORT: u16 = 7443;

/// The longest one CLI call of a test may take (`space bench microvm` takes minutes).
pub const CLI_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// The isolation runtime a test runs its sandboxes on (issue 6: the same integration tests
/// run against both; see [`on_each_runtime`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Namespace,
    Microvm,
}

impl Runtime {
    /// The spaced flags that make it the runtime of every create that names none. With
    /// microvm, `base`'s default pool (a microvm pool then) keeps one VM ready, not four: on
    /// two cores, four VMs booting at spaced's start starve the test's own (one such boot
    /// came up with its APIC timer disabled, see `space_proto::GUEST_NO_TIMER`).
    pub fn spaced_args(self) -> &'static [&'static str] {
        match self {
            Runtime::Namespace => &[],
            Runtime::Microvm => &["--default-runtime", "microvm", "--warm-pool", "1:4"],
        }
    }
}

/// Defines one test per runtime from one body: `on_each_runtime! { fn name(rt) { ... } }`
/// gives `name::namespace` and `name::microvm`, each calling the body with its
/// [`Runtime`]. The body starts spaced with `Spaced::start_on(rt)`.
#[macro_export]
macro_rules! on_each_runtime {
    ($(#[$meta:meta])* fn $name:ident($rt:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body($rt: $crate::Runtime) $body
            #[test]
            fn namespace() {
                body($crate::Runtime::Namespace)
            }
            #[test]
            fn microvm() {
                body($crate::Runtime::Microvm)
            }
        }
    };
    ($(#[$meta:meta])* async fn $name:ident($rt:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            async fn body($rt: $crate::Runtime) $body
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn namespace() {
                body($crate::Runtime::Namespace).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn microvm() {
                body($crate::Runtime::Microvm).await
            }
        }
    };
}

impl Spaced {
    /// Start a fresh spaced whose creates default to `rt`.
    pub fn start_on(rt: Runtime) -> Result<Spaced> {
        Self::start_with(rt.spaced_args())
    }

    /// Start a fresh spaced and wait until it answers /healthz with a key on disk.
    pub fn start() -> Result<Spaced> {
        Self::start_with(&[])
    }

    /// Start a fresh spaced with extra flags (e.g. `--database-url`).
    pub fn start_with(extra_args: &[&str]) -> Result<Spaced> {
        let mut s = Self::prepare(extra_args, true)?;
        s.spawn()?;
        Ok(s)
    }

    /// Start spaced in the host's network namespace with `--network off`: only for a test that
    /// truly needs the host's network (nothing here does today).
    pub fn start_host_netns(extra_args: &[&str]) -> Result<Spaced> {
        let mut all = vec!["--network", "off"];
        all.extend_from_slice(extra_args);
        let mut s = Self::prepare(&all, false)?;
        s.spawn()?;
        Ok(s)
    }

    /// Everything but the process: data dir, uid range, cgroup parent and (with `own_netns`)
    /// the node's network namespace. `spawn` starts spaced.
    pub fn prepare(extra_args: &[&str], own_netns: bool) -> Result<Spaced> {
        require_root();
        let dir = tempfile::Builder::new()
            .prefix("space-it-")
            .tempdir_in("/var/tmp")
            .context("tempdir")?;
        let n = INSTANCE.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // Distinct uid ranges per test instance: 2^16 sandboxes' worth apart per process slot.
        let uid_base = 1_100_000_000u32 + ((pid % 32) * 16 + n % 16) * 4_194_304;
        let cgroup_parent = format!("space-it-{pid}-{n}");
        let (net, listen) = if own_netns {
            let net = NodeNet::create(pid, n)?;
            let listen = format!("{}:{NODE_PORT}", net.node_ip);
            (Some(net), listen)
        } else {
            let l = TcpListener::bind("127.0.0.1:0")?;
            (None, l.local_addr()?.to_string())
        };
        Ok(Spaced {
            dir,
            url: String::new(),
            key: String::new(),
            listen,
            uid_base,
            cgroup_parent,
            net,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            child: None,
            split: None,
            joined: false,
            join_token: None,
            node_only: None,
            control_only: false,
            node_child: None,
            http: {
                space_api::client::install_crypto_provider();
                reqwest::Client::new()
            },
        })
    }

    /// The roles apart (issue 14): `spaced node` and `spaced control --node` in one network
    /// namespace, on one data dir (the layout all-in-one has), each with its flags.
    pub fn start_split(node_args: &[&str], control_args: &[&str]) -> Result<Spaced> {
        let mut s = Self::prepare(control_args, true)?;
        s.split = Some(node_args.iter().map(|a| a.to_string()).collect());
        s.spawn()?;
        Ok(s)
    }

    /// [`Spaced::start_split`], with the node joined to the control plane by a token from
    /// `space node token` (mTLS between them, decision 0033).
    pub fn start_joined(node_args: &[&str], control_args: &[&str]) -> Result<Spaced> {
        let mut s = Self::prepare(control_args, true)?;
        s.split = Some(node_args.iter().map(|a| a.to_string()).collect());
        s.joined = true;
        s.spawn()?;
        Ok(s)
    }

    /// A control plane alone (`spaced control` with a cluster listener, no node of its own),
    /// in its own network namespace, with `control_args` (e.g. `--database-url`): nodes join
    /// it with tokens ([`Spaced::join_node`], or the fake agents of [`fake_node`]).
    pub fn start_control_only(control_args: &[&str]) -> Result<Spaced> {
        let mut s = Self::prepare(control_args, true)?;
        s.split = Some(Vec::new());
        s.joined = true;
        s.control_only = true;
        s.spawn()?;
        Ok(s)
    }

    /// Another node for this joined control plane, in a network namespace, data dir, uid range
    /// and cgroup of its own: a `Spaced` with only a node agent (its CLI reaches the control
    /// plane). Each namespace routes the harness's 10.251.0.0/16 through the host, so the
    /// node and the control plane reach each other's addresses and nothing else.
    pub fn join_node(&self, node_args: &[&str]) -> Result<Spaced> {
        self.join_node_via(&[], node_args)
    }

    /// [`Spaced::join_node`], the node given the cluster listeners of this control plane and
    /// of `replicas` (`--control A,B`): its heartbeats go to whichever answers.
    pub fn join_node_via(&self, replicas: &[&Spaced], node_args: &[&str]) -> Result<Spaced> {
        anyhow::ensure!(self.joined, "join_node needs Spaced::start_joined");
        let control_net = self.net.as_ref().context("the control plane's namespace")?;
        let mut n = Self::prepare(&[], true)?;
        let net = n.net.as_ref().context("the node's namespace")?;
        let mut controls = vec![format!("{}:{CLUSTER_PORT}", control_net.node_ip)];
        for ns in [control_net, net] {
            ns.route_harness_via_host()?;
        }
        for r in replicas {
            let rnet = r.net.as_ref().context("the replica's namespace")?;
            rnet.route_harness_via_host()?;
            controls.push(format!("{}:{CLUSTER_PORT}", rnet.node_ip));
        }
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
        n.node_only = Some((controls.join(","), format!("{}:7071", net.node_ip)));
        n.split = Some(node_args.iter().map(|a| a.to_string()).collect());
        n.joined = true;
        n.url = self.url.clone();
        n.key = self.key.clone();
        n.spawn_node()?;
        Ok(n)
    }

    /// A second control-plane replica of this joined control plane (issue 14): a network
    /// namespace and data dir of its own, the same PostgreSQL (`--database-url` among this
    /// one's flags), and a copy of the one file replicas must be given, `secrets.key`; it
    /// takes `admin.key`, `ports.key` and `cluster-ca/` from the store (decision 0054). It
    /// drives the same nodes; those joined with [`Spaced::join_node_via`] listing it
    /// heartbeat to it when this one is gone.
    pub fn add_replica(&self) -> Result<Spaced> {
        anyhow::ensure!(self.joined, "add_replica needs Spaced::start_joined");
        anyhow::ensure!(
            self.extra_args.iter().any(|a| a == "--database-url"),
            "replicas share a PostgreSQL: start the first with --database-url"
        );
        let args: Vec<&str> = self.extra_args.iter().map(String::as_str).collect();
        let mut r = Self::prepare(&args, true)?;
        std::fs::create_dir_all(r.data_dir())?;
        std::fs::copy(
            self.data_dir().join("secrets.key"),
            r.data_dir().join("secrets.key"),
        )
        .context("copy secrets.key")?;
        for net in [&self.net, &r.net] {
            net.as_ref()
                .context("a replica's namespace")?
                .route_harness_via_host()?;
        }
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
        r.split = Some(Vec::new());
        r.joined = true;
        r.control_only = true;
        r.spawn()?;
        Ok(r)
    }

    /// Add spaced flags for the next `spawn` (and every restart).
    pub fn add_args(&mut self, args: &[&str]) {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The node's sandbox dirs (`volume/sandboxes/<id>`), without the warm pool's ready
    /// sandboxes: their records say `pool_member`, and they belong to no user. A dir made in
    /// the last 10 s without a record yet is a sandbox being built (a pool member, say: its
    /// record is written after its rootfs), not counted either.
    pub fn user_sandbox_dirs(&self) -> std::collections::BTreeSet<String> {
        std::fs::read_dir(self.data_dir().join("volume/sandboxes"))
            .map(|rd| {
                rd.flatten()
                    .filter(|e| {
                        let rec = std::fs::read(e.path().join("sandbox.json")).ok();
                        let building = rec.is_none()
                            && e.metadata()
                                .and_then(|m| m.modified())
                                .ok()
                                .and_then(|t| t.elapsed().ok())
                                .is_some_and(|age| age < Duration::from_secs(10));
                        let rec: Option<Value> = rec.and_then(|r| serde_json::from_slice(&r).ok());
                        !building && !rec.is_some_and(|r| r["pool_member"] == true)
                    })
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("spaced.log")
    }

    /// `spaced` in the node's namespace: nsenter execs it, so the child's pid is spaced's
    /// (kill9 and stop keep working).
    fn spaced_command(&self) -> Command {
        match &self.net {
            Some(net) => net.command(bin_dir().join("spaced")),
            None => Command::new(bin_dir().join("spaced")),
        }
    }

    /// The split node agent's log.
    pub fn node_log_path(&self) -> PathBuf {
        self.dir.path().join("spaced-node.log")
    }

    /// (Re)starts the split node agent and waits until it serves.
    pub fn spawn_node(&mut self) -> Result<()> {
        let node_args = self.split.clone().context("not split")?;
        let log_path = self.node_log_path();
        let start = std::fs::metadata(&log_path).map_or(0, |m| m.len() as usize);
        let mut cmd = self.spaced_command();
        cmd.arg("node");
        if self.joined {
            // The token is used once; a node that joined already starts without one.
            let token = if self.data_dir().join("cluster/node_id").exists() {
                None
            } else {
                let out = self.space_ok(&["node", "token"]);
                Some(out.lines().next().unwrap_or_default().trim().to_owned())
            };
            let (control, advertise) = self
                .node_only
                .clone()
                .unwrap_or_else(|| (CLUSTER_ADDR.to_owned(), SPLIT_NODE_ADDR.to_owned()));
            cmd.args(["--listen", "0.0.0.0:7071", "--advertise", &advertise]);
            if let Some(t) = token {
                cmd.args(["--control", &control, "--join-token", &t]);
                self.join_token = Some(t);
            }
        } else {
            cmd.args(["--listen", SPLIT_NODE_ADDR]);
        }
        self.node_flags(&mut cmd);
        if !node_args.iter().any(|a| a == "--base-cache") {
            cmd.args(["--base-cache", "none"]);
        }
        cmd.args(&node_args);
        self.node_child = Some(launch(cmd, &log_path)?);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let log = std::fs::read(&log_path).unwrap_or_default();
            if String::from_utf8_lossy(&log[start.min(log.len())..])
                .contains("spaced node listening on")
            {
                return Ok(());
            }
            if let Some(status) = self.node_child.as_mut().and_then(|c| c.try_wait().ok()?) {
                bail!("spaced node exited with {status}:\n{}", self.log_tail());
            }
            if Instant::now() > deadline {
                bail!("spaced node did not start:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL the split node agent (a crashed node); its sandboxes are left as they are.
    pub fn kill9_node(&mut self) {
        if let Some(mut c) = self.node_child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The node agent's flags, all-in-one or split.
    fn node_flags(&self, cmd: &mut Command) {
        cmd.arg("--data-dir")
            .arg(self.data_dir())
            .arg("--run-dir")
            .arg(self.run_dir())
            .arg("--image-size")
            .arg("4G")
            .arg("--daemon-binary")
            .arg(daemon_binary())
            .arg("--uid-base")
            .arg(self.uid_base.to_string())
            .arg("--cgroup-parent")
            .arg(&self.cgroup_parent)
            // A small pool: dozens of test spaceds run one after another on two cores.
            .arg("--slot-pool")
            .arg("4");
    }

    /// (Re)start the spaced process on the same data dir. Split: the node agent first,
    /// unless it runs; joined: the control plane first (the node joins it).
    pub fn spawn(&mut self) -> Result<()> {
        self.url = format!("http://{}", self.listen);
        let split = self.split.is_some();
        if split && !self.joined && self.node_child.is_none() {
            self.spawn_node()?;
        }
        let mut cmd = self.spaced_command();
        if split {
            cmd.arg("control");
            if self.joined {
                cmd.args(["--cluster-listen", &format!("0.0.0.0:{CLUSTER_PORT}")]);
            } else {
                cmd.arg("--node").arg(format!("http://{SPLIT_NODE_ADDR}"));
            }
            cmd.arg("--listen")
                .arg(&self.listen)
                .arg("--data-dir")
                .arg(self.data_dir());
            if !self.extra_args.iter().any(|a| a == "--default-template") {
                cmd.args(["--default-template", "minimal"]);
            }
        } else {
            cmd.arg("--listen").arg(&self.listen);
            self.node_flags(&mut cmd);
            cmd.args(self.template_args());
        }
        cmd.args(&self.extra_args);
        self.child = Some(launch(cmd, &self.log_path())?);
        self.wait_ready()?;
        if self.joined && !self.control_only && self.node_child.is_none() {
            self.spawn_node()?;
        }
        Ok(())
    }

    /// Tests create from `minimal` (busybox) unless they start spaced with
    /// [`Spaced::start_with_base`]: importing the Debian `base` into each of the suite's many
    /// fresh data dirs would cost seconds apiece.
    fn template_args(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if !self.extra_args.iter().any(|a| a == "--default-template") {
            v.extend(["--default-template", "minimal"]);
        }
        if !self.extra_args.iter().any(|a| a == "--base-cache") {
            v.extend(["--base-cache", "none"]);
        }
        v
    }

    /// Start a spaced whose default template is the Debian `base`, imported from the
    /// machine's cache, or `None` (after saying why) where no cache was built; with
    /// SPACE_REQUIRE_BASE=1 (scripts/test, which builds it) a missing cache fails the test.
    pub fn start_with_base(extra_args: &[&str]) -> Option<Spaced> {
        let cache = base_cache()?;
        let cache = cache.to_str().expect("utf-8 path").to_owned();
        let mut args = vec!["--default-template", "base", "--base-cache", cache.as_str()];
        args.extend_from_slice(extra_args);
        Some(Self::start_with(&args).unwrap())
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "spaced exited with {status} during start:\n{}",
                    self.log_tail()
                );
            }
            let ok = std::net::TcpStream::connect(&self.listen).is_ok();
            if ok && let Ok(key) = std::fs::read_to_string(self.data_dir().join("admin.key")) {
                self.key = key.trim().to_string();
                let health = Command::new("curl")
                    .args(["-fsS", &format!("{}/healthz", self.url)])
                    .output()?;
                if health.status.success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("spaced did not become ready:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last lines of spaced's log (split: the control plane's, then the node agent's),
    /// for failure messages.
    pub fn log_tail(&self) -> String {
        let tail = |path: PathBuf| {
            let log = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        match self.split {
            None => tail(self.log_path()),
            Some(_) => format!(
                "spaced control:\n{}\nspaced node:\n{}",
                tail(self.log_path()),
                tail(self.node_log_path())
            ),
        }
    }

    /// Host pid of spaced.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGKILL spaced (a crash); sandboxes are left as they are.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM spaced and wait for a graceful exit.
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        let mut c = self.child.take().context("spaced not running")?;
        Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = c.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                bail!("spaced did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A `space` CLI command pointed at this spaced.
    pub fn cli(&self) -> Command {
        let mut c = Command::new(bin_dir().join("space"));
        c.env("SPACE_URL", &self.url)
            .env("SPACE_API_KEY", &self.key)
            .stdin(Stdio::null());
        c
    }

    /// Run the CLI; returns its output whatever the exit code. A call that runs past
    /// [`CLI_TIMEOUT`] is killed and fails the test with the node's log, rather than leaving
    /// CI waiting on a sandbox that will never answer.
    pub fn space(&self, args: &[&str]) -> Output {
        let mut child = self
            .cli()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run space");
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let out_reader = std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = std::io::Read::read_to_end(&mut out, &mut b);
            b
        });
        let err_reader = std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = std::io::Read::read_to_end(&mut err, &mut b);
            b
        });
        let deadline = std::time::Instant::now() + CLI_TIMEOUT;
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for space") {
                break st;
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "space {args:?} still ran after {CLI_TIMEOUT:?}: killed\nspaced log:\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        Output {
            status,
            stdout: out_reader.join().unwrap_or_default(),
            stderr: err_reader.join().unwrap_or_default(),
        }
    }

    /// Run the CLI and require success; returns stdout.
    pub fn space_ok(&self, args: &[&str]) -> String {
        let out = self.space(args);
        assert!(
            out.status.success(),
            "space {args:?} failed ({}):\nstdout: {}\nstderr: {}\nspaced log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    }

    /// `space create` with extra args; returns the id.
    pub fn create(&self, args: &[&str]) -> String {
        let mut all = vec!["create"];
        all.extend_from_slice(args);
        let id = self.space_ok(&all).trim().to_string();
        assert_eq!(id.len(), 20, "id {id:?}");
        id
    }

    /// `space exec ID -- sh -c SCRIPT`; returns (exit code, stdout, stderr).
    pub fn sh(&self, id: &str, script: &str) -> (i32, String, String) {
        let out = self.space(&["exec", id, "--", "sh", "-c", script]);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// An HTTP request with the admin key.
    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key)
    }

    /// An HTTP request without any key.
    pub fn req_anon(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.url))
    }

    /// GET a JSON document with the admin key.
    pub async fn get_json(&self, path: &str) -> Result<(u16, Value)> {
        let r = self.req(reqwest::Method::GET, path).send().await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }

    /// (status, JSON body) of one API call, from synchronous test code.
    pub fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        rt.block_on(async {
            let mut rb = self.req(method, path);
            if let Some(b) = body {
                rb = rb.json(&b);
            }
            let r = rb.send().await.expect("send");
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        })
    }

    /// One API call whose answer is text (e.g. `/metrics`): status and body.
    pub fn call_text(&self, method: reqwest::Method, path: &str) -> (u16, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        rt.block_on(async {
            let r = self.req(method, path).send().await.expect("send");
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        })
    }

    /// `space inspect ID` as JSON.
    pub fn inspect(&self, id: &str) -> Value {
        serde_json::from_str(&self.space_ok(&["inspect", id])).expect("inspect prints JSON")
    }

    /// `space snapshots ID --json`: the sandbox's snapshots, oldest first.
    pub fn snapshots(&self, id: &str) -> Vec<Value> {
        let v: Value = serde_json::from_str(&self.space_ok(&["snapshots", id, "--json"]))
            .expect("snapshots prints JSON");
        v["snapshots"].as_array().cloned().unwrap_or_default()
    }

    /// The probe's arguments that name host things it must not reach: a marker file, this
    /// test process's pid, and an abstract unix socket this test listens on (kept alive by
    /// the returned listener).
    pub fn host_references(&self) -> (Vec<String>, std::os::unix::net::UnixListener) {
        use std::os::linux::net::SocketAddrExt;
        let marker = self.dir.path().join("host-only-marker");
        std::fs::write(&marker, "x").expect("write the host marker");
        let name = format!("space-it-{}", random_hex(8));
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .expect("an abstract socket name");
        let listener =
            std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind an abstract socket");
        let args = vec![
            "--host-marker".to_owned(),
            marker.to_string_lossy().into_owned(),
            "--host-pid".to_owned(),
            std::process::id().to_string(),
            "--host-abstract".to_owned(),
            name,
        ];
        (args, listener)
    }

    /// Copy the static probe into the sandbox and run it; returns its JSON report.
    pub fn probe(&self, id: &str, args: &[&str]) -> Value {
        self.probe_via(id, &[], args)
    }

    /// [`Spaced::probe`], run through `via` inside (e.g. `["sudo", "-n"]`).
    pub fn probe_via(&self, id: &str, via: &[&str], args: &[&str]) -> Value {
        let dst = format!("{id}:/tmp/space-probe");
        self.space_ok(&["cp", probe_binary().to_str().unwrap(), &dst]);
        let mut all = vec!["exec", id, "--"];
        all.extend_from_slice(via);
        all.push("/tmp/space-probe");
        all.extend_from_slice(args);
        let out = self.space(&all);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "probe output is not JSON ({e}): {}\nstderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    /// Lazily unmount everything mounted under the run dir (slot network namespaces are bind
    /// mounts under `<run_dir>/netns/`), deepest first.
    pub fn unmount_run_dir(&self) {
        let run_dir = self.run_dir();
        let mut under_run: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
            .filter(|m| m.starts_with(&run_dir))
            .collect();
        under_run.sort();
        for m in under_run.iter().rev() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(m)
                .stderr(Stdio::null())
                .status();
        }
    }

    /// What a host reboot does to the node's network (spaced must be dead): the slot
    /// namespaces go (their veths with them) and the node's nftables rules are flushed. The
    /// links the harness and the lab made stay, as a host's configured interfaces would.
    pub fn reset_network_as_after_reboot(&self) {
        self.unmount_run_dir();
        if let Some(net) = &self.net {
            let _ = net.command("nft").args(["flush", "ruleset"]).status();
        }
    }

    /// Remove every sandbox this instance holds, stop spaced, and unmount its volume.
    fn teardown(&mut self) {
        if self.child.is_some() {
            let out = self.space(&["ls", "--json"]);
            if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
                let ids: Vec<String> = v
                    .as_array()
                    .or_else(|| v.get("sandboxes").and_then(Value::as_array))
                    .map(|a| {
                        a.iter()
                            .filter_map(|s| s.get("id").and_then(Value::as_str).map(String::from))
                            .collect()
                    })
                    .unwrap_or_default();
                for id in ids {
                    let _ = self.space(&["rm", &id]);
                }
            }
        }
        self.kill9();
        self.kill9_node();
        // Anything left (a test that killed spaced mid-way): kill by cgroup, then unmount.
        for ctrl in ["memory", "pids", "cpu", "cpuacct", "freezer", ""] {
            let base = if ctrl.is_empty() {
                PathBuf::from("/sys/fs/cgroup")
            } else {
                Path::new("/sys/fs/cgroup").join(ctrl)
            };
            // The sandboxes', and the microvm runtime's QEMUs' (`<parent>-vm`).
            for parent in [
                base.join(&self.cgroup_parent),
                base.join(format!("{}-vm", self.cgroup_parent)),
            ] {
                if let Ok(rd) = std::fs::read_dir(&parent) {
                    for e in rd.flatten() {
                        if e.path().is_dir() {
                            if let Ok(procs) =
                                std::fs::read_to_string(e.path().join("cgroup.procs"))
                            {
                                for p in procs.split_whitespace() {
                                    let _ = Command::new("kill").args(["-9", p]).status();
                                }
                            }
                            // A killed QEMU takes a moment to leave its cgroup (its RAM is
                            // freed first): retry the removal for up to 2 s.
                            for _ in 0..40 {
                                std::thread::sleep(Duration::from_millis(50));
                                if std::fs::remove_dir(e.path()).is_ok() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = std::fs::remove_dir(&parent);
                }
            }
        }
        self.unmount_run_dir();
        let volume = self.data_dir().join("volume");
        // (A control plane alone has no volume: nothing to say then.)
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&volume)
            .stderr(Stdio::null())
            .status();
        let img = self.data_dir().join("space-btrfs.img");
        if let Ok(out) = Command::new("losetup").arg("-j").arg(&img).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(dev) = line.split(':').next() {
                    let _ = Command::new("losetup").args(["-d", dev]).status();
                }
            }
        }
    }
}

impl Drop for Spaced {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The whole cluster of issue 14's harness: a real PostgreSQL, two `spaced control`
/// replicas on it, and node agents, each in a network namespace and data dir of its own,
/// every node listing both replicas (`--control A,B`: its heartbeats go to whichever
/// answers). Fields drop in order: the replicas remove what is left while nodes and
/// PostgreSQL still run.
pub struct ClusterLab {
    /// The first replica, then the second ([`Spaced::add_replica`]). Either drives every node.
    pub replicas: Vec<Spaced>,
    pub nodes: Vec<Spaced>,
    pub pg: Postgres,
}

impl ClusterLab {
    /// Starts PostgreSQL, two replicas with `control_args` and `nodes` node agents with
    /// `node_args`, and waits until every node has reported to both replicas.
    pub fn start(nodes: usize, control_args: &[&str], node_args: &[&str]) -> Result<ClusterLab> {
        let pg = Postgres::start()?;
        let mut args = vec!["--database-url", pg.socket_url.as_str()];
        args.extend_from_slice(control_args);
        let first = Spaced::start_control_only(&args)?;
        let second = first.add_replica()?;
        let mut joined = Vec::new();
        for _ in 0..nodes {
            joined.push(first.join_node_via(&[&second], node_args)?);
        }
        let lab = ClusterLab {
            replicas: vec![first, second],
            nodes: joined,
            pg,
        };
        for r in &lab.replicas {
            for n in &lab.nodes {
                let id = lab.node_id(n);
                let reported = eventually(Duration::from_secs(30), || {
                    let out = r.space(&["node", "ls", "--json"]);
                    serde_json::from_slice::<Value>(&out.stdout)
                        .ok()
                        .and_then(|v| {
                            v["nodes"]
                                .as_array()?
                                .iter()
                                .find(|x| x["id"] == id.as_str())
                                .map(|x| x["cpus"].as_u64().unwrap_or(0) > 0)
                        })
                        .unwrap_or(false)
                });
                anyhow::ensure!(reported, "node {id} did not report to {}", r.url);
            }
        }
        Ok(lab)
    }

    /// The cluster id of node agent `n`.
    pub fn node_id(&self, n: &Spaced) -> String {
        std::fs::read_to_string(n.data_dir().join("cluster/node_id"))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }
}

/// Percentile of sorted durations (nearest rank).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A throwaway PostgreSQL server (Debian's postgresql package) on a temporary directory and a
/// free loopback port, for running the control plane's store on PostgreSQL.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// TCP URL (host loopback).
    pub url: String,
    /// The same server through its unix socket: reachable from spaced in its own network
    /// namespace (a path socket does not belong to a network namespace).
    pub socket_url: String,
    port: u16,
}

impl Postgres {
    fn as_postgres(&self, prog: &str) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(self.bin.join(prog));
        c
    }

    pub fn start() -> Result<Postgres> {
        require_root();
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .context("PostgreSQL is not installed (Debian package postgresql)")?
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|b| b.join("initdb").is_file())
            .max()
            .context("no initdb under /usr/lib/postgresql/*/bin")?;
        let dir = tempfile::Builder::new()
            .prefix("space-pg-")
            .tempdir_in("/var/tmp")?;
        let st = Command::new("chown")
            .arg("postgres:postgres")
            .arg(dir.path())
            .status()?;
        anyhow::ensure!(st.success(), "chown of the PostgreSQL dir failed");
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let pg = Postgres {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            socket_url: format!(
                "postgres://postgres@localhost:{port}/postgres?host={}",
                dir.path().display()
            ),
            dir,
            bin,
            port,
        };
        let data = pg.dir.path().join("data");
        let out = pg
            .as_postgres("initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg.start_server()?;
        Ok(pg)
    }
}

impl Postgres {
    /// Starts the server on its data dir; pg_ctl -w returns once it accepts connections (or
    /// fails), within -t seconds.
    pub fn start_server(&self) -> Result<()> {
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {}",
            self.port,
            self.dir.path().display()
        );
        let out = self
            .as_postgres("pg_ctl")
            .args(["-w", "-t", "60", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("-l")
            .arg(self.dir.path().join("server.log"))
            .args(["-o", &opts, "start"])
            .stdin(Stdio::null())
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "postgres did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Stops the server at once (`-m immediate`: as a crash, no checkpoint).
    pub fn stop_server(&self) -> Result<()> {
        let out = self
            .as_postgres("pg_ctl")
            .args(["-m", "immediate", "-w", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "postgres did not stop: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// A new, empty database on this server; its TCP URL.
    /// `psql` on this server's `postgres` database as the postgres user, stopping at the
    /// first error: for a test's own SQL (`-c ...`).
    pub fn psql(&self) -> Command {
        let mut c = self.as_postgres("psql");
        c.args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "postgres"]);
        c
    }

    pub fn create_database(&self, name: &str) -> Result<String> {
        let port = self.port.to_string();
        let out = self
            .as_postgres("createdb")
            .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres", name])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "createdb {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(format!("postgres://postgres@127.0.0.1:{port}/{name}"))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .as_postgres("pg_ctl")
            .args(["-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The `p` quantile (0..=1) of unsorted seconds `v` (for benchmark reports).
pub fn quantile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[((s.len() - 1) as f64 * p).round() as usize]
}
