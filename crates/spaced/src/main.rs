//! spaced: the space server. All-in-one by default: the in-process node agent
//! (`space_node::Node`) plus the control plane (REST API, store, reconciler) on `--listen`.
//! `spaced node` runs the node agent alone, serving the node contract over gRPC
//! (`space_rpc`); `spaced control --node URL` runs the control plane alone, driving it.
//! SIGTERM/SIGINT shut the server down gracefully; sandboxes keep running and are adopted
//! again on the next start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use space_control::{ControlConfig, ControlPlane};
use space_node::{Node, NodeConfig};

mod daemon_bin;
mod heap;
use daemon_bin::daemon_binary;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Parser)]
#[command(
    name = "spaced",
    version,
    about = "The space server: all-in-one (control plane and node agent) unless a role is named",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    all: Args,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// The control plane alone (REST API, store, reconciler), driving a node agent that runs
    /// as `spaced node`: one that joined it with a token (`space node token`), over mTLS,
    /// or the one at --node.
    Control(ControlRole),
    /// A node agent alone (sandboxes, storage, networking), serving the node contract over
    /// gRPC: to the control plane it joined (--control, --join-token; mTLS), or, not joined,
    /// on loopback to `spaced control --node URL`.
    Node(NodeRole),
}

/// All-in-one: the node agent in-process under the control plane.
#[derive(Debug, clap::Args)]
struct Args {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    control: ControlArgs,
}

#[derive(Debug, clap::Args)]
struct ControlRole {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    control: ControlArgs,
    /// A node agent on loopback that joined no control plane, to drive without TLS: its
    /// address as `spaced node` printed it (http://127.0.0.1:PORT). Without it, the control
    /// plane drives the node that joined it.
    #[arg(long = "node", value_name = "URL")]
    node_url: Option<String>,
    /// Where nodes join and report (TLS; their certificates come from the cluster CA in
    /// DATA_DIR/cluster-ca). Not served with --node.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:7443")]
    cluster_listen: SocketAddr,
    /// Seconds a joined node may be silent (no heartbeat) before it counts as lost: its
    /// sandboxes with a replica are then restored on another node from their newest
    /// replicated snapshot, and the others marked `lost` (decision 0037). A node is
    /// `unreachable` after 20 s already; nothing is restored before this.
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    node_lost_after: u64,
}

#[derive(Debug, clap::Args)]
struct NodeRole {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    node: NodeArgs,
    /// Address of the node contract's gRPC service. A node that joined a control plane serves
    /// it over mTLS (only the control plane may call); one that did not, on loopback only.
    #[arg(long = "listen", default_value = "127.0.0.1:7071")]
    node_listen: SocketAddr,
    /// The control plane's cluster listener (HOST:PORT; replicas: HOST:PORT,HOST:PORT,...):
    /// joined with --join-token on the first start; later, the addresses to use from now on.
    #[arg(long, value_name = "HOST:PORT[,...]")]
    control: Option<String>,
    /// The one-time token `space node token` printed on the control plane.
    #[arg(long, value_name = "TOKEN", requires = "control")]
    join_token: Option<String>,
    /// Where the control plane reaches this node's service (HOST:PORT). Default: --listen,
    /// unless that is 0.0.0.0.
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// Largest template archive the control plane may upload (bytes or K/M/G/T).
    #[arg(long = "max-upload", default_value = "10G", value_parser = parse_size)]
    node_max_upload: u64,
}

/// What every role reads.
#[derive(Debug, clap::Args)]
struct Common {
    /// Persistent state: store, admin key, templates, sandboxes.
    #[arg(long, default_value = "/var/lib/space", env = "SPACE_DATA_DIR")]
    data_dir: PathBuf,
    /// Log lines as text or as JSON objects (one per line, with the spans they happened in).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Also log a line when a span closes (an API request, a node operation such as
    /// node.create or node.snapshot, a warm pool build, a reconcile pass) with its busy and
    /// idle time: where a slow request spent it. Which spans is up to RUST_LOG (reconcile
    /// passes are debug).
    #[arg(long)]
    log_spans: bool,
    /// Egress policy of sandboxes created without one: none, allowlist or open.
    #[arg(long, default_value = "open")]
    default_egress: space_node::net::Egress,
    /// The runtime of sandboxes created without one: namespace or microvm.
    #[arg(long, default_value = "namespace", value_parser = ["namespace", "microvm"])]
    default_runtime: String,
}

/// The node agent's settings.
#[derive(Debug, clap::Args)]
struct NodeArgs {
    /// Runtime state (sockets, network namespace mounts); lost on reboot. Default:
    /// /run/space for the default data dir, else /run/space-<hash of the data dir>, so that
    /// two spaced with different data dirs never share one. A run dir held by a live spaced
    /// is refused.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Size of the btrfs image created when the data dir is not btrfs (bytes, or K/M/G/T).
    #[arg(long, default_value = "16G", value_parser = parse_size)]
    image_size: u64,
    /// The static space-daemon binary. Default: $SPACE_DAEMON_BINARY, else `space-daemon`
    /// next to this executable, else /usr/local/lib/space/space-daemon.
    #[arg(long)]
    daemon_binary: Option<PathBuf>,
    /// Static busybox the `minimal` template is built from.
    #[arg(long, default_value = "/bin/busybox")]
    busybox: PathBuf,
    /// The machine's cache of the Debian `base` template (`rootfs/` and `defaults.json`, built
    /// once by scripts/up and scripts/test with mmdebstrap), imported when the node has no
    /// Debian `base` yet; `none` for none.
    #[arg(long, default_value = "/var/cache/space/base-debian12")]
    base_cache: PathBuf,
    /// First host uid of the sandbox uid ranges.
    #[arg(long, default_value_t = NodeConfig::default().uid_base_start)]
    uid_base: u32,
    /// Cgroup under which sandboxes get their own.
    #[arg(long, default_value = "space")]
    cgroup_parent: String,
    /// Output kept per process for reconnects (bytes or K/M/G); older output is reported as a
    /// gap. Applies to sandboxes started from now on.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    output_buffer: u64,
    /// Seconds between samples of every sandbox's CPU and memory (`space metrics`, E2B's
    /// metrics; decision 0024). 0 turns sampling off.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    usage_interval: u64,
    /// Seconds a namespace sandbox's daemon connection may go unused before it is closed (the
    /// next call connects again; decision 0064). 0 keeps every connection open.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    guest_idle: u64,
    /// Per-sandbox disk limits (`disk_mib`, decision 0043): `on` turns btrfs simple quotas on
    /// for the volume (Linux 6.7+; a volume with full qgroups keeps them); `off` refuses
    /// creates that ask for a disk limit.
    #[arg(long, value_enum, default_value = "on")]
    disk_quotas: OnOff,
    /// New sandboxes (creates, forks, pool members) are refused while the node's
    /// MemAvailable is below this many MiB (decision 0049); 0 never refuses.
    #[arg(long, value_name = "MIB", default_value_t = NodeConfig::default().min_free_memory_mib)]
    min_free_memory: u64,
    /// Seconds a finished process stays listed and attachable. Applies to sandboxes started
    /// from now on.
    #[arg(long, default_value_t = NodeConfig::default().exited_retention_secs)]
    exited_retention: u64,
    /// Networking of sandboxes: `on` gives each a network slot with an egress policy, DNS and
    /// the egress proxy; `off` leaves them with loopback only.
    #[arg(long, value_enum, default_value = "on")]
    network: OnOff,
    /// Node subnet cut into one /30 per sandbox (IPv4, /8 to /28).
    #[arg(long, default_value = "10.213.0.0/16", value_parser = parse_subnet)]
    slot_subnet: ipnet::Ipv4Net,
    /// Network slots kept ready for creates.
    #[arg(long, default_value_t = 32)]
    slot_pool: usize,
    /// Upstream DNS server (IP or IP:PORT; repeat for more). Default: the nameservers of
    /// /etc/resolv.conf.
    #[arg(long = "dns-upstream", value_parser = parse_dns)]
    dns_upstream: Vec<SocketAddr>,
    /// Extra CA certificates (PEM) the egress proxy trusts for upstream TLS, on top of the
    /// system and webpki roots.
    #[arg(long)]
    upstream_ca: Option<PathBuf>,
    /// The microvm runtime (a QEMU microvm per sandbox, decision 0014): on makes it available
    /// (set up on first use; a missing QEMU or guest kernel is then a clear create error).
    #[arg(long, value_enum, default_value = "on")]
    microvm: OnOff,
    /// The microvm accelerator: auto (KVM when a quick probe shows it works, else TCG with a
    /// warning), kvm or tcg.
    #[arg(long, default_value = "auto")]
    microvm_accel: space_node::runtime::microvm::Accel,
    /// How a microvm restored from a checkpoint maps its RAM: private (nothing written to
    /// disk while it runs; its checkpoints and forks carry its RAM in their stream) or shared
    /// (its RAM is a file on the node's volume, written back as the guest dirties it; its
    /// checkpoints and forks reflink the file). Decision 0014, "Memory snapshots".
    #[arg(long, default_value = "private", value_name = "private|shared")]
    microvm_ram: space_node::runtime::microvm::RestoredRam,
}

/// The control plane's settings.
#[derive(Debug, clap::Args)]
struct ControlArgs {
    /// Address of the REST API.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// The template of creates that name none (and of the default warm pool).
    #[arg(long, default_value = space_api::DEFAULT_TEMPLATE)]
    default_template: String,
    /// Store URL (postgres://...); default SQLite at DATA_DIR/space.db.
    #[arg(long, env = "SPACE_DATABASE_URL")]
    database_url: Option<String>,
    /// Limit of streamed uploads (files, templates), bytes or K/M/G/T.
    #[arg(long, default_value = "10G", value_parser = parse_size)]
    max_upload: u64,
    /// Days events are kept (the audit trail of every sandbox, removed ones included); older
    /// ones are deleted every hour. 0 keeps them forever.
    #[arg(long, value_name = "DAYS", default_value_t = 30)]
    events_retention_days: u64,
    /// The disk limit (MiB) of a namespace sandbox whose create names none and whose tenant
    /// has no disk quota (decision 0043), so that no sandbox can fill the node's volume; none
    /// by default. Needs disk quotas on the nodes.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(16..=16_777_216))]
    default_disk: Option<u64>,
    /// Warm pool of the `base` template as MIN:MAX ready sandboxes, while none was set through
    /// the API (`space pool set base`); 0:0 turns it off.
    #[arg(long, default_value = "4:32", value_name = "MIN:MAX", value_parser = parse_pool)]
    warm_pool: space_node::api::PoolConfig,
    /// E2B's host form (decision 0030): serve `api.DOMAIN` and `PORT-ID.DOMAIN` (port PORT
    /// of sandbox ID; envd's is 49983) as E2B's edge does, for SDKs given `E2B_DOMAIN`.
    /// Point a wildcard DNS record for `*.DOMAIN` (and `DOMAIN`) at this server. Turns on the
    /// HTTPS listener.
    #[arg(long, value_name = "DOMAIN", value_parser = parse_domain)]
    e2b_domain: Option<String>,
    /// Address of the HTTPS listener (the whole API over TLS). Default: 0.0.0.0:443 with
    /// --e2b-domain, else none.
    #[arg(long, value_name = "ADDR")]
    tls_listen: Option<SocketAddr>,
    /// The HTTPS listener's certificate chain (PEM). Default with --e2b-domain: certificates
    /// spaced issues for the domain from its own CA, name-constrained to the domain
    /// (DATA_DIR/tls/DOMAIN/ca.pem; `space e2b ca` prints it).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// A DNS name for --e2b-domain, lowercased: labels of letters, digits and inner hyphens, with
/// room under 253 characters for E2B's `PORT-ID.` in front.
fn parse_domain(s: &str) -> Result<String, String> {
    let d = s.trim_end_matches('.').to_ascii_lowercase();
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if d.len() > 200 || !d.split('.').all(label_ok) {
        return Err(format!(
            "{s:?} is not a DNS name (letters, digits and hyphens in dot-separated labels, at most 200 characters)"
        ));
    }
    Ok(d)
}

/// spaced's API CA (the node crate's CA type, name-constrained to `--e2b-domain`) as the
/// listener's certificate issuer.
struct ApiCa(space_node::net::ca::Ca);

impl space_control::tls::IssueCert for ApiCa {
    fn leaf(&self, name: &str) -> Result<Arc<rustls::sign::CertifiedKey>, String> {
        self.0
            .leaf(name)
            .map_err(|e| space_control::error_chain(&e))
    }
}

/// The HTTPS listener, as the flags ask for it.
struct TlsSetup {
    listen: SocketAddr,
    certs: space_control::tls::ServerCerts,
    /// The CA certificate (PEM) when spaced issues the certificates.
    ca_pem: Option<String>,
}

/// The HTTPS listener from the flags; None when they ask for none.
fn tls_setup(data_dir: &std::path::Path, args: &ControlArgs) -> Result<Option<TlsSetup>> {
    use space_control::tls::{ServerCerts, load_given};
    let listen = match (args.tls_listen, &args.e2b_domain) {
        (Some(a), _) => a,
        (None, Some(_)) => SocketAddr::from(([0, 0, 0, 0], 443)),
        (None, None) => {
            anyhow::ensure!(
                args.tls_cert.is_none(),
                "--tls-cert needs --tls-listen (or --e2b-domain) to serve it on"
            );
            return Ok(None);
        }
    };
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        let given = load_given(cert, key).map_err(anyhow::Error::msg)?;
        return Ok(Some(TlsSetup {
            listen,
            certs: ServerCerts::Given(Arc::new(given)),
            ca_pem: None,
        }));
    }
    let domain = args.e2b_domain.clone().context(
        "--tls-listen needs --tls-cert and --tls-key, or --e2b-domain for certificates spaced issues",
    )?;
    let dir = data_dir.join("tls").join(&domain);
    let profile = space_node::net::ca::CaProfile::api(&domain);
    let ca = space_node::net::ca::Ca::load_or_create_as(&dir, &profile)
        .map_err(|e| anyhow::anyhow!(space_control::error_chain(&e)))
        .context("failed to load or make the API CA")?;
    let pem = ca.cert_pem().to_owned();
    let certs = ServerCerts::Issued {
        ca: Arc::new(ApiCa(ca)),
        domain,
    };
    Ok(Some(TlsSetup {
        listen,
        certs,
        ca_pem: Some(pem),
    }))
}

/// Parses "MIN:MAX" (MIN <= MAX).
fn parse_pool(s: &str) -> Result<space_node::api::PoolConfig, String> {
    let (min, max) = s
        .split_once(':')
        .ok_or_else(|| "expected MIN:MAX, e.g. 4:32".to_string())?;
    let num = |what: &str, v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("{what} {v:?} is not a number from 0 to {}", u32::MAX))
    };
    let (min, max) = (num("MIN", min)?, num("MAX", max)?);
    if min > max {
        return Err(format!("MIN ({min}) must not exceed MAX ({max})"));
    }
    Ok(space_node::api::PoolConfig {
        min,
        max,
        microvm: false,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn parse_subnet(s: &str) -> Result<ipnet::Ipv4Net, String> {
    let n: ipnet::Ipv4Net = s
        .parse()
        .map_err(|e| format!("invalid subnet {s:?}: {e}"))?;
    if !(8..=28).contains(&n.prefix_len()) {
        return Err(format!(
            "subnet {s:?} must be /8 to /28 (one /30 per sandbox)"
        ));
    }
    if n.trunc() != n {
        return Err(format!(
            "subnet {s:?} has host bits set; did you mean {}?",
            n.trunc()
        ));
    }
    Ok(n)
}

fn parse_dns(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    s.parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| format!("invalid DNS server {s:?}: expected IP or IP:PORT"))
}

/// Parses "1048576", "512K", "16M", "16G", "1T" (powers of 1024; optional trailing "B"/"iB").
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected bytes or a K/M/G/T suffix"))?;
    n.checked_mul(1u64 << shift)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("invalid size {s:?}"))
}

fn init_logging(format: LogFormat, spans: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let events = if spans {
        tracing_subscriber::fmt::format::FmtSpan::CLOSE
    } else {
        tracing_subscriber::fmt::format::FmtSpan::NONE
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(events)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot install the SIGTERM handler");
            std::future::pending::<()>().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    // Every role holds a descriptor per peer: a control replica one per node it drives and per
    // node's heartbeat stream, a node one per sandbox (decision 0059). A thousand nodes are far
    // past a default soft limit of 1,024.
    if let Err(e) = space_sys::process::raise_open_file_limit() {
        eprintln!("spaced: cannot raise the open file limit: {e}");
    }
    heap::spawn_trim();
    match cli.role {
        None => all_in_one(cli.all).await,
        Some(Role::Control(c)) => control_role(c).await,
        Some(Role::Node(n)) => node_role(n).await,
    }
}

/// Fails with the error's whole chain (the node's and control plane's errors nest).
fn chain(e: &dyn std::error::Error) -> anyhow::Error {
    anyhow::anyhow!(space_control::error_chain(e))
}

/// The node agent, opened; the run dir's lock is held as long as the guard lives.
async fn open_node(
    common: &Common,
    args: &NodeArgs,
) -> Result<(Arc<Node>, space_node::run_dir::RunDirLock)> {
    let daemon = daemon_binary(args.daemon_binary.clone())?;
    let run_dir = args
        .run_dir
        .clone()
        .unwrap_or_else(|| space_node::run_dir::default_for(&common.data_dir));
    // Held until the process exits: a second spaced on this run dir is refused.
    let run_lock = space_node::run_dir::RunDirLock::acquire(&run_dir, &common.data_dir)
        .map_err(|e| chain(&e))?;

    anyhow::ensure!(
        (4 << 10..=256 << 20).contains(&args.output_buffer),
        "--output-buffer must be between 4K and 256M, got {} bytes",
        args.output_buffer
    );
    let node_cfg = NodeConfig {
        data_dir: common.data_dir.clone(),
        run_dir: run_dir.clone(),
        image_size_bytes: args.image_size,
        daemon_binary: daemon,
        busybox: args.busybox.clone(),
        base_cache: Some(args.base_cache.clone()).filter(|p| p.as_os_str() != "none"),
        uid_base_start: args.uid_base,
        cgroup_parent: args.cgroup_parent.clone(),
        output_buffer_bytes: args.output_buffer,
        exited_retention_secs: args.exited_retention,
        net: space_node::net::NetConfig {
            enabled: args.network == OnOff::On,
            subnet: args.slot_subnet,
            pool_size: args.slot_pool,
            dns_upstream: args.dns_upstream.clone(),
            upstream_ca: args.upstream_ca.clone(),
            default_egress: common.default_egress,
        },
        microvm: (args.microvm == OnOff::On).then(|| space_node::runtime::microvm::MicrovmConfig {
            accel: args.microvm_accel,
            restored_ram: args.microvm_ram,
            // The jailed QEMUs' cgroups: next to the sandboxes', `space-vm` by default.
            cgroup_parent: format!("{}-vm", args.cgroup_parent),
            ..Default::default()
        }),
        default_runtime: common
            .default_runtime
            .parse()
            .map_err(|e: space_node::api::NodeError| anyhow::anyhow!("--default-runtime: {e}"))?,
        usage_interval: Duration::from_secs(args.usage_interval),
        disk_quotas: args.disk_quotas == OnOff::On,
        min_free_memory_mib: args.min_free_memory,
        guest_idle: Duration::from_secs(args.guest_idle),
        ..NodeConfig::default()
    };
    if let Some(ca) = &args.upstream_ca {
        anyhow::ensure!(
            ca.is_file(),
            "--upstream-ca {} does not exist",
            ca.display()
        );
    }
    let node = Node::open(node_cfg)
        .await
        .map_err(|e| chain(&e))
        .context("failed to open the node")?;
    Ok((node, run_lock))
}

/// What a control plane drives.
enum Drives {
    /// One node, in-process or at a fixed address.
    One(Arc<dyn space_node::NodeApi>),
    /// The nodes that joined it: the cluster listener's address as join commands show it,
    /// the address it listens on, and how long a node may be silent before it is lost. The
    /// cluster CA is opened with the control plane (the replicas share it through the store).
    Cluster(String, SocketAddr, Duration),
}

/// The control plane over what it drives, serving until SIGTERM or SIGINT.
async fn run_control(
    common: &Common,
    args: &ControlArgs,
    drives: Drives,
    on_open: impl FnOnce(&ControlPlane),
) -> Result<()> {
    let mut cfg = ControlConfig::new(&common.data_dir);
    cfg.max_upload_bytes = args.max_upload;
    cfg.events_retention = (args.events_retention_days > 0)
        .then(|| Duration::from_secs(args.events_retention_days.saturating_mul(86_400)));
    cfg.shutdown_timeout = Duration::from_secs(5);
    cfg.default_disk_mib = args.default_disk;
    cfg.default_egress = space_control::net::egress_from_node(common.default_egress);
    cfg.default_pool = Some(args.warm_pool).filter(|p| p.max > 0);
    cfg.default_runtime = common.default_runtime.clone();
    let tls = tls_setup(&common.data_dir, args)?;
    cfg.e2b_domain = args.e2b_domain.clone();
    cfg.e2b_ca_pem = tls.as_ref().and_then(|t| t.ca_pem.clone());
    anyhow::ensure!(
        space_api::is_valid_template_name(&args.default_template),
        "--default-template {:?} is not a valid template name",
        args.default_template
    );
    cfg.default_template = args.default_template.clone();
    if let Drives::Cluster(_, _, lost_after) = &drives {
        cfg.node_lost_after = *lost_after;
    }
    let db = args.database_url.as_deref();
    let cp = match &drives {
        Drives::One(node) => ControlPlane::open(cfg, db, node.clone()).await,
        Drives::Cluster(shown, ..) => ControlPlane::open_cluster(cfg, db, shown.clone()).await,
    }
    .map_err(|e| chain(&e))
    .context("failed to open the control plane")?;
    on_open(&cp);
    let cluster_server = match drives {
        Drives::One(_) => None,
        Drives::Cluster(_, listen, _) => {
            let cluster = cp
                .cluster()
                .context("a cluster control plane without its cluster")?;
            let tcp = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("failed to listen on {listen} (--cluster-listen)"))?;
            let config =
                space_rpc::tls::control_server_config(&cluster.tls).map_err(anyhow::Error::msg)?;
            let l = space_rpc::tls::TlsListener::new(tcp, config)?;
            println!(
                "cluster listener on {} (mTLS; nodes join with `space node token`)",
                l.address()
            );
            let service = space_control::cluster::ControlService::new(
                cp.state.engine.store().clone(),
                cluster,
                cp.secret_source(),
            );
            let app = service
                .router()
                .into_make_service_with_connect_info::<space_rpc::tls::PeerCert>();
            Some(tokio::spawn(axum::serve(l, app).into_future()))
        }
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("failed to listen on {}", args.listen))?;
    let addr = listener.local_addr().unwrap_or(args.listen);
    println!("spaced listening on http://{addr}");
    let tls = match tls {
        Some(TlsSetup { listen, certs, .. }) => {
            let tcp = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("failed to listen on {listen} (--tls-listen)"))?;
            let l = space_control::tls::TlsListener::new(
                tcp,
                space_control::tls::server_config(certs),
            )?;
            println!("spaced listening on https://{}", l.address());
            Some(l)
        }
        None => None,
    };
    if let Some(d) = &args.e2b_domain {
        println!("E2B domain: {d} (`space e2b env --domain`)");
    }
    println!("admin key: {}", cp.admin_key_path.display());
    tracing::info!(%addr, key_file = %cp.admin_key_path.display(), "spaced started");

    let served = space_control::serve_with_tls(listener, tls, cp.state, shutdown_signal())
        .await
        .map_err(|e| chain(&e));
    if let Some(t) = cluster_server {
        t.abort();
    }
    served
}

async fn all_in_one(args: Args) -> Result<()> {
    init_logging(args.common.log_format, args.common.log_spans);
    let (node, _run_lock) = open_node(&args.common, &args.node).await?;
    let in_process: Arc<dyn space_node::NodeApi> = node.clone();
    run_control(&args.common, &args.control, Drives::One(in_process), |cp| {
        node.set_secret_source(cp.secret_source())
    })
    .await?;
    node.shutdown().await;
    tracing::info!("spaced stopped (sandboxes keep running)");
    Ok(())
}

async fn control_role(args: ControlRole) -> Result<()> {
    init_logging(args.common.log_format, args.common.log_spans);
    let drives = match &args.node_url {
        Some(url) => {
            let channel = space_rpc::channel(url).map_err(anyhow::Error::msg)?;
            println!("driving the node agent at {url}");
            Drives::One(Arc::new(space_rpc::RemoteNode::new(url.clone(), channel)))
        }
        None => {
            let listen = args.cluster_listen;
            let shown = if listen.ip().is_unspecified() {
                format!("CONTROL-ADDRESS:{}", listen.port())
            } else {
                listen.to_string()
            };
            Drives::Cluster(shown, listen, Duration::from_secs(args.node_lost_after))
        }
    };
    run_control(&args.common, &args.control, drives, |_| {}).await?;
    tracing::info!("spaced control stopped");
    Ok(())
}

/// This node's membership: the one kept in the data dir, or a new one from a join.
async fn membership(args: &NodeRole) -> Result<Option<space_rpc::join::Membership>> {
    use space_rpc::join::{Membership, join};
    let dir = Membership::dir(&args.common.data_dir);
    if let Some(mut m) = Membership::load(&dir).map_err(anyhow::Error::msg)? {
        if let Some(c) = args.control.as_ref().filter(|c| **c != m.control) {
            // Other addresses of the same control plane (replicas added or moved): its
            // certificate, checked against the cluster CA at every connection, tells a
            // foreign one. Joining another cluster means removing the membership.
            anyhow::ensure!(
                args.join_token.is_none(),
                "this node joined the control plane at {} already; to join another, remove {} first",
                m.control,
                dir.display()
            );
            println!("control plane addresses: {} (were {})", c, m.control);
            m.control = c.clone();
            m.save(&dir).map_err(anyhow::Error::msg)?;
        }
        return Ok(Some(m));
    }
    let (control, token) = match (&args.control, &args.join_token) {
        (Some(c), Some(t)) => (c, t),
        (Some(c), None) => anyhow::bail!(
            "this node has not joined a control plane yet: --control {c} needs --join-token (from `space node token`)"
        ),
        _ => return Ok(None),
    };
    let advertise = match &args.advertise {
        Some(a) => a.clone(),
        None if !args.node_listen.ip().is_unspecified() => args.node_listen.to_string(),
        None => anyhow::bail!(
            "--listen {} says nothing of where the control plane reaches this node: give --advertise HOST:PORT",
            args.node_listen
        ),
    };
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let m = join(control, token, &name, &advertise)
        .await
        .map_err(anyhow::Error::msg)?;
    m.save(&dir).map_err(anyhow::Error::msg)?;
    println!(
        "joined the control plane at {control} as node {}",
        m.node_id
    );
    Ok(Some(m))
}

async fn node_role(args: NodeRole) -> Result<()> {
    init_logging(args.common.log_format, args.common.log_spans);
    let member = membership(&args).await?;
    anyhow::ensure!(
        member.is_some() || args.node_listen.ip().is_loopback(),
        "--listen {}: a node that joined no control plane (--control, --join-token) serves loopback addresses only",
        args.node_listen
    );
    let (node, _run_lock) = open_node(&args.common, &args.node).await?;
    let scratch = args.common.data_dir.join("uploads");
    space_node::storage::dir_with_mode(&scratch, 0o700)
        .with_context(|| format!("failed to create {}", scratch.display()))?;
    let service = space_rpc::NodeService::new(node.clone(), scratch, args.node_max_upload);
    let listener = tokio::net::TcpListener::bind(args.node_listen)
        .await
        .with_context(|| format!("failed to listen on {}", args.node_listen))?;
    let addr = listener.local_addr().unwrap_or(args.node_listen);
    match member {
        Some(m) => {
            let config = space_rpc::tls::node_server_config(&m.tls().map_err(anyhow::Error::msg)?)
                .map_err(anyhow::Error::msg)?;
            let tls = space_rpc::tls::TlsListener::new(listener, config)?;
            let control = m.control_client().map_err(anyhow::Error::msg)?;
            node.set_secret_source(Arc::new(space_rpc::join::ControlSecrets(control.clone())));
            let beat = tokio::spawn(space_rpc::join::heartbeats(
                control,
                space_control::cluster::HEARTBEAT_EVERY,
                node.clone(),
            ));
            println!(
                "spaced node listening on https://{addr} (node {}, mTLS; control plane {})",
                m.node_id, m.control
            );
            tracing::info!(%addr, node = %m.node_id, "spaced node started");
            let served = axum::serve(tls, space_rpc::router(service))
                .with_graceful_shutdown(shutdown_signal())
                .await;
            beat.abort();
            served.context("the node service failed")?;
        }
        None => {
            println!("spaced node listening on http://{addr}");
            println!("next: spaced control --node http://{addr}");
            tracing::info!(%addr, "spaced node started");
            use axum::serve::ListenerExt;
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, space_rpc::router(service))
                .with_graceful_shutdown(shutdown_signal())
                .await
                .context("the node service failed")?;
        }
    }
    node.shutdown().await;
    tracing::info!("spaced node stopped (sandboxes keep running)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The all-in-one arguments of `argv`.
    fn all(argv: &[&str]) -> Result<Args, clap::Error> {
        let cli = Cli::try_parse_from(argv)?;
        assert!(cli.role.is_none(), "{argv:?} named a role");
        Ok(cli.all)
    }

    #[test]
    fn roles_parse_their_own_flags() {
        let c = Cli::try_parse_from([
            "spaced",
            "control",
            "--node",
            "http://127.0.0.1:7071",
            "--listen",
            "127.0.0.1:7080",
        ])
        .unwrap();
        let Some(Role::Control(c)) = c.role else {
            panic!("not the control role");
        };
        assert_eq!(c.node_url.as_deref(), Some("http://127.0.0.1:7071"));
        assert_eq!(c.control.listen.to_string(), "127.0.0.1:7080");
        let n = Cli::try_parse_from(["spaced", "node", "--data-dir", "/tmp/n1"]).unwrap();
        let Some(Role::Node(n)) = n.role else {
            panic!("not the node role");
        };
        assert_eq!(n.node_listen.to_string(), "127.0.0.1:7071");
        assert_eq!(n.common.data_dir, PathBuf::from("/tmp/n1"));
        // A joined node's control-plane addresses may change at a later start (replicas).
        let n = Cli::try_parse_from(["spaced", "node", "--control", "a:7443,b:7443"]).unwrap();
        let Some(Role::Node(n)) = n.role else {
            panic!("not the node role");
        };
        assert_eq!(n.control.as_deref(), Some("a:7443,b:7443"));
        // Each role refuses the other's flags; a join needs both the control plane and a token.
        for bad in [
            &["spaced", "node", "--database-url", "postgres://x"][..],
            &[
                "spaced",
                "control",
                "--node",
                "http://n",
                "--image-size",
                "1G",
            ],
            &["spaced", "node", "--join-token", "sj1.x"],
            &["spaced", "--listen", "127.0.0.1:1", "node"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn args_parse() {
        let a = all(&["spaced", "--image-size", "1G", "--log-format", "json"]).unwrap();
        assert_eq!(a.node.image_size, 1 << 30);
        assert_eq!(a.control.default_disk, None);
        let a = all(&["spaced", "--default-disk", "2048"]).unwrap();
        assert_eq!(a.control.default_disk, Some(2048));
        assert!(
            all(&["spaced", "--default-disk", "8"]).is_err(),
            "below a create's least"
        );
        assert_eq!(a.control.listen.to_string(), "127.0.0.1:7070");
        assert!(all(&["spaced", "--image-size", "lots"]).is_err());
        let a = all(&[
            "spaced",
            "--dns-upstream",
            "203.0.113.53",
            "--dns-upstream",
            "203.0.113.54:5353",
            "--default-egress",
            "allowlist",
        ])
        .unwrap();
        assert_eq!(a.node.dns_upstream.len(), 2);
        assert_eq!(a.node.dns_upstream[0].port(), 53);
        assert_eq!(a.common.default_egress, space_node::net::Egress::Allowlist);
        assert_eq!(a.node.network, OnOff::On);
        assert_eq!(
            (a.control.warm_pool.min, a.control.warm_pool.max),
            (4, 32),
            "--warm-pool default"
        );
        assert_eq!(a.control.events_retention_days, 30, "events kept 30 days");
        let a = all(&["spaced", "--events-retention-days", "0"]).unwrap();
        assert_eq!(a.control.events_retention_days, 0);
        assert!(all(&["spaced", "--events-retention-days", "-1"]).is_err());
        let a = all(&["spaced", "--warm-pool", "0:0"]).unwrap();
        assert_eq!((a.control.warm_pool.min, a.control.warm_pool.max), (0, 0));
        let a = all(&["spaced", "--warm-pool", "2:2"]).unwrap();
        assert_eq!((a.control.warm_pool.min, a.control.warm_pool.max), (2, 2));
        for (bad, needle) in [
            ("4", "expected MIN:MAX"),
            ("8:4", "MIN (8) must not exceed MAX (4)"),
            ("-1:4", "MIN \"-1\""),
            ("1:lots", "MAX \"lots\""),
            ("1:4294967296", "MAX \"4294967296\""),
        ] {
            let arg = format!("--warm-pool={bad}");
            let e = all(&["spaced", arg.as_str()]).unwrap_err();
            let e = e.to_string();
            assert!(
                e.contains("--warm-pool") && e.contains(needle),
                "{bad}: {e}"
            );
        }
        for bad in [
            ["spaced", "--slot-subnet", "10.0.0.0/30"],
            ["spaced", "--slot-subnet", "10.0.0.1/16"],
            ["spaced", "--dns-upstream", "resolver"],
            ["spaced", "--default-egress", "most"],
        ] {
            assert!(all(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn e2b_domain_and_tls_flags() {
        let a = all(&["spaced", "--e2b-domain", "SB.Example.com."]).unwrap();
        assert_eq!(a.control.e2b_domain.as_deref(), Some("sb.example.com"));
        for bad in [
            "-x.com",
            "a..b",
            "a_b.com",
            "",
            &"a".repeat(64),
            &"ab.".repeat(70),
        ] {
            assert!(parse_domain(bad).is_err(), "{bad:?}");
        }
        // A certificate without its key (and the other way round) is refused by clap.
        assert!(all(&["spaced", "--tls-cert", "c.pem"]).is_err());
        assert!(all(&["spaced", "--tls-key", "k.pem"]).is_err());
        // TLS with nothing to serve: clear errors before anything starts.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_str().unwrap();
        let setup = |extra: &[&str]| {
            let mut argv = vec!["spaced", "--data-dir", dir];
            argv.extend_from_slice(extra);
            let a = all(&argv).unwrap();
            tls_setup(&a.common.data_dir, &a.control).map(|t| t.map(|t| (t.listen, t.ca_pem)))
        };
        assert!(setup(&[]).unwrap().is_none());
        let e = setup(&["--tls-listen", "127.0.0.1:8443"]).unwrap_err();
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = setup(&["--tls-cert", "c.pem", "--tls-key", "k.pem"]).unwrap_err();
        assert!(e.to_string().contains("--tls-listen"), "{e}");
        let (addr, ca) = setup(&["--e2b-domain", "sb.example.com"]).unwrap().unwrap();
        assert_eq!(addr.to_string(), "0.0.0.0:443");
        assert!(ca.unwrap().contains("BEGIN CERTIFICATE"));
        assert!(tmp.path().join("tls/sb.example.com/ca.key").is_file());
    }
}
