//! `space`: the command-line client of the space REST API.
//!
//! Configuration: SPACE_URL (default http://127.0.0.1:7070) and SPACE_API_KEY (else the key
//! file $SPACE_DATA_DIR/admin.key, default /var/lib/space/admin.key). Errors print
//! "error: <message> (<code>)" on stderr and exit 1; `exec` exits with the command's status.

mod bench;
mod bench_qemu;
mod build;
mod cp;
mod diff;
mod events;
mod exec;
mod net;
mod node;
mod pool;
mod snapshot;
mod template;
mod tenant;
mod top;
mod usage;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use clap::{Args, Parser, Subcommand};
use space_api::{Client, ClientError, CreateSandbox, SignalRequest, SignalSpec};

#[derive(Debug, Parser)]
#[command(
    name = "space",
    version,
    about = "Secure, stateful sandboxes for AI agents"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// Run a command in a sandbox.
    Exec(exec::ExecArgs),
    /// List sandboxes.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Show the sandboxes with their CPU and memory, refreshed every interval.
    Top(top::TopArgs),
    /// Print a sandbox as JSON (its network address under `network`).
    Inspect {
        id: String,
        /// Accepted for symmetry with other commands: the output is always JSON.
        #[arg(long)]
        json: bool,
    },
    /// Freeze a sandbox (no CPU, memory kept).
    Pause {
        id: String,
        /// Keep only the filesystem: every process ends and memory is freed; `resume`
        /// starts the sandbox again, cold.
        #[arg(long)]
        filesystem_only: bool,
    },
    /// Thaw a paused sandbox, or start a stopped one again on its filesystem.
    Resume { id: String },
    /// Move a sandbox to another node of the cluster, keeping its id, files, snapshots,
    /// network policy and secrets (its processes start again there).
    Migrate {
        id: String,
        /// The node to move it to (an id from `space node ls`); the scheduler picks one
        /// when absent.
        #[arg(long)]
        to: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Set (SECS from now) or clear (--clear) a sandbox's timeout.
    Timeout {
        id: String,
        #[arg(required_unless_present = "clear", conflicts_with = "clear")]
        secs: Option<u64>,
        #[arg(long)]
        clear: bool,
        /// What an expired timeout does: pause (default) or delete.
        #[arg(long, value_parser = parse_on_timeout)]
        on_timeout: Option<space_api::OnTimeout>,
    },
    #[command(flatten)]
    Snap(snapshot::SnapCmd),
    /// Paths added (A), modified (M) and deleted (D) between two snapshots, or from the
    /// sandbox's creation / to its live filesystem.
    Diff(diff::DiffArgs),
    /// Events and audit records of a sandbox, oldest first (also after it is deleted).
    Events(events::EventsArgs),
    /// A sandbox's recent CPU, memory and disk use (samples every 5 s, the last 30 minutes).
    Metrics(usage::MetricsArgs),
    /// Delete sandboxes.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Copy files or directories: `space cp LOCAL ID:PATH` or `space cp ID:PATH LOCAL`.
    Cp(cp::CpArgs),
    /// List a sandbox's processes.
    Ps { id: String },
    /// Stream a process's output (from --offset), until it exits.
    Attach {
        id: String,
        pid: u32,
        #[arg(long, default_value_t = 0)]
        offset: u64,
    },
    /// Print changes under a directory of a sandbox as they happen ("create a.txt"), until
    /// interrupted.
    Watch {
        id: String,
        path: String,
        /// The whole tree, not only the directory's own entries.
        #[arg(long, short)]
        recursive: bool,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Send a signal to a process.
    Kill {
        id: String,
        pid: u32,
        /// Name (KILL, TERM, INT, ...) or number.
        #[arg(long, short, default_value = "KILL")]
        signal: SignalSpec,
    },
    /// Show a sandbox's egress policy and address, or replace the policy (--egress, --allow).
    Net(net::NetArgs),
    /// Print a URL that reaches a TCP port the sandbox listens on.
    Port(net::PortArgs),
    /// E2B compatibility: `eval "$(space e2b env)"` points the official E2B SDKs here.
    #[command(subcommand)]
    E2b(E2bCmd),
    /// Manage secrets (values used by sandboxes without ever being visible inside).
    #[command(subcommand)]
    Secret(net::SecretCmd),
    /// Manage templates.
    #[command(subcommand)]
    Template(template::TemplateCmd),
    /// Warm pools: ready sandboxes kept per template, so that creates are fast.
    #[command(subcommand)]
    Pool(pool::PoolCmd),
    /// Nodes: state, capacity and what their sandboxes claim (`space node ls`).
    #[command(subcommand)]
    Node(node::NodeCmd),
    /// The whole platform at a glance (`space cluster status`).
    #[command(subcommand)]
    Cluster(node::ClusterCmd),
    /// Tenants: who owns which sandboxes (admin key).
    #[command(subcommand)]
    Tenant(tenant::TenantCmd),
    /// API keys: create, list, rotate and revoke (admin key).
    #[command(subcommand)]
    Key(tenant::KeyCmd),
    /// Benchmarks (`space bench all` runs every one and writes a JSON report).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

#[derive(Debug, Args)]
struct CreateArgs {
    /// Make at most one sandbox for this key: a create retried with it (after a timeout, a
    /// lost connection, another replica) answers the sandbox the first try made.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// The template (default: the node's, `base` unless spaced says otherwise).
    #[arg(long)]
    template: Option<String>,
    /// CPU cores (e.g. 0.5).
    #[arg(long)]
    cpu: Option<f64>,
    /// Memory limit in MiB.
    #[arg(long)]
    memory: Option<u64>,
    /// Maximum number of tasks.
    #[arg(long)]
    pids: Option<u32>,
    /// Disk limit in MiB: what the sandbox's files and snapshots may hold together; a write
    /// past it fails inside with "Disk quota exceeded" (namespace runtime).
    #[arg(long, value_name = "MIB")]
    disk: Option<u64>,
    /// A resource limit of every process, soft and hard alike (repeatable): nofile=N,
    /// core=BYTES, memlock=BYTES. Default: nofile 1024 (hard 524288), core 0, memlock 8 MiB.
    #[arg(long = "rlimit", value_name = "NAME=N", value_parser = parse_rlimit)]
    rlimit: Vec<(String, u64)>,
    /// Environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// A label of your own (repeatable), shown by inspect and filtered on by E2B's list.
    #[arg(long = "metadata", value_name = "K=V", value_parser = parse_kv)]
    metadata: Vec<(String, String)>,
    #[arg(long)]
    hostname: Option<String>,
    /// Timeout in seconds (none: no timeout); what happens then: --on-timeout.
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// Pause after this many idle seconds (none: never).
    #[arg(long, value_name = "SECS")]
    auto_pause: Option<u64>,
    /// What an expired timeout does: pause (default), stop (keep only the files) or delete.
    #[arg(long, value_parser = parse_on_timeout)]
    on_timeout: Option<space_api::OnTimeout>,
    /// Automatic snapshot every SECS seconds while its files change.
    #[arg(long, value_name = "SECS")]
    snapshot_every: Option<u64>,
    /// Automatic snapshot after every foreground exec.
    #[arg(long)]
    snapshot_after_exec: bool,
    /// Keep only the newest K automatic snapshots.
    #[arg(long, value_name = "K")]
    keep_last: Option<u32>,
    /// Let retention delete labelled snapshots too (they count towards --keep-last).
    #[arg(long)]
    no_keep_labelled: bool,
    /// Egress: none, allowlist or open (default: the server's; with --allow: allowlist).
    #[arg(long, value_name = "MODE")]
    egress: Option<space_api::Egress>,
    /// Allow rule (repeatable): CIDR, address, domain or *.domain, then :PORTS (443,
    /// 8000-8100 or *; default 80 and 443).
    #[arg(long = "allow", value_name = "RULE")]
    allow: Vec<String>,
    /// Secret the sandbox may use (repeatable): env NAME holds a placeholder.
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    /// A header the egress proxy sets with a secret's value on HTTPS requests to HOST
    /// (repeatable); the sandbox sees nothing of it. `NAME@HOST=Header: template with {}`,
    /// e.g. `GH@api.github.com=Authorization: Bearer {}`.
    #[arg(long = "secret-header", value_name = "NAME@HOST=HEADER", value_parser = parse_secret_header)]
    secret_headers: Vec<space_api::SecretHeader>,
    /// Isolation runtime: namespace (shared kernel) or microvm (a VM with its own kernel);
    /// default: the server's.
    #[arg(long, value_name = "RUNTIME")]
    runtime: Option<String>,
    /// Copies of its snapshots kept on another node (0 or 1; default: the template's
    /// setting, else 0): if its node is lost, it is restored there from its newest
    /// replicated snapshot (a cluster only; decision 0037).
    #[arg(long, value_name = "N")]
    replicas: Option<u32>,
    /// Print the whole sandbox as JSON instead of its id.
    #[arg(long)]
    json: bool,
}

pub(crate) fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected K=V, got {s:?}")),
    }
}

#[derive(Debug, Subcommand)]
enum E2bCmd {
    /// Print `export` lines for E2B_API_KEY (this key in E2B's form), E2B_API_URL and
    /// E2B_SANDBOX_URL (this API's address, which serves both E2B APIs).
    Env {
        /// Print E2B_API_KEY and E2B_DOMAIN instead: the SDKs then reach the server as
        /// `https://api.DOMAIN` and `https://PORT-ID.DOMAIN` (spaced's `--e2b-domain`).
        #[arg(long)]
        domain: bool,
    },
    /// Print the CA certificate (PEM) of the certificates spaced issues for its
    /// `--e2b-domain`, for clients to trust (it vouches for that domain only).
    Ca,
}

/// The shell lines `space e2b env` prints.
fn e2b_env(url: &str, key: &str) -> String {
    format!(
        "export E2B_API_KEY={}\nexport E2B_API_URL={url}\nexport E2B_SANDBOX_URL={url}\n",
        space_api::e2b_key(key)
    )
}

/// The shell lines `space e2b env --domain` prints.
fn e2b_env_domain(domain: &str, key: &str) -> String {
    format!(
        "export E2B_API_KEY={}\nexport E2B_DOMAIN={domain}\n",
        space_api::e2b_key(key)
    )
}

const NO_E2B_DOMAIN: &str =
    "spaced has no E2B domain: start it with --e2b-domain DOMAIN (docs/E2B.md, \"By domain\")";

fn client() -> Result<Client> {
    let (url, key) = connection()?;
    Ok(Client::new(&url, &key)?)
}

/// The API's address and key: `SPACE_URL` (default http://127.0.0.1:7070) and
/// `SPACE_API_KEY`, or the admin key in `SPACE_DATA_DIR` (default /var/lib/space).
fn connection() -> Result<(String, String)> {
    let url = std::env::var("SPACE_URL").unwrap_or_else(|_| "http://127.0.0.1:7070".into());
    let key = match std::env::var("SPACE_API_KEY") {
        Ok(k) if !k.trim().is_empty() => k.trim().to_string(),
        _ => {
            let dir = std::env::var_os("SPACE_DATA_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/var/lib/space"));
            let path = dir.join("admin.key");
            std::fs::read_to_string(&path)
                .with_context(|| {
                    format!(
                        "no API key: set SPACE_API_KEY or make {} readable",
                        path.display()
                    )
                })?
                .trim()
                .to_string()
        }
    };
    Ok((url.trim_end_matches('/').to_string(), key))
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// "error: <message> (<code>)".
fn report(e: &anyhow::Error) -> String {
    if let Some(ce) = e.downcast_ref::<ClientError>() {
        return match ce {
            ClientError::Api { .. } => format!("error: {ce}"),
            other => {
                let mut msg = other.to_string();
                let mut src = std::error::Error::source(other);
                while let Some(s) = src {
                    msg.push_str(&format!(": {s}"));
                    src = s.source();
                }
                format!("error: {msg} ({})", other.code())
            }
        };
    }
    format!("error: {e:#}")
}

/// `space ls | head` closes stdout early. Rust ignores SIGPIPE (so that sockets get EPIPE),
/// which turns the next `println!` into a panic with a backtrace; a closed stdout ends the
/// command quietly instead, with the shell's status for SIGPIPE.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

#[tokio::main]
async fn main() {
    quiet_on_closed_stdout();
    let cli = Cli::parse();
    let code = match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{}", report(&e));
            1
        }
    };
    std::process::exit(code);
}

/// `NAME=N` of `--rlimit`, for the names the API knows.
fn parse_rlimit(s: &str) -> Result<(String, u64), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=N, got {s:?}"))?;
    if !["nofile", "core", "memlock"].contains(&k) {
        return Err(format!(
            "unknown rlimit {k:?}: expected nofile, core or memlock"
        ));
    }
    let n = v
        .parse()
        .map_err(|_| format!("rlimit {k}: {v:?} is not a whole number"))?;
    Ok((k.to_owned(), n))
}

fn rlimits_of(given: &[(String, u64)]) -> Option<space_api::Rlimits> {
    if given.is_empty() {
        return None;
    }
    let mut r = space_api::Rlimits::default();
    for (k, v) in given {
        match k.as_str() {
            "nofile" => r.nofile = Some(*v),
            "core" => r.core = Some(*v),
            _ => r.memlock = Some(*v),
        }
    }
    Some(r)
}

async fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Command::Create(a) => {
            let c = client()?;
            let req = CreateSandbox {
                template: a.template,
                cpu: a.cpu,
                memory_mib: a.memory,
                pids: a.pids,
                disk_mib: a.disk,
                rlimits: rlimits_of(&a.rlimit),
                env: a.env.into_iter().collect::<BTreeMap<_, _>>(),
                metadata: a.metadata.into_iter().collect(),
                hostname: a.hostname,
                timeout_secs: a.timeout,
                auto_pause_secs: a.auto_pause,
                on_timeout: a.on_timeout,
                snapshot_policy: Some(space_api::SnapshotPolicy {
                    every_secs: a.snapshot_every,
                    after_exec: a.snapshot_after_exec,
                    keep_last: a.keep_last,
                    keep_labelled: !a.no_keep_labelled,
                })
                .filter(|p| !p.is_empty()),
                network: net::policy_from_flags(a.egress, &a.allow),
                secrets: a.secrets,
                secret_headers: a.secret_headers,
                runtime: a.runtime,
                replicas: a.replicas,
            };
            let sb = match &a.idempotency_key {
                Some(key) => c.create_sandbox_keyed(&req, key).await?,
                None => c.create_sandbox(&req).await?,
            };
            if a.json {
                print_json(&sb)?;
            } else {
                println!("{}", sb.id);
            }
            Ok(0)
        }
        Command::Exec(a) => exec::run(client()?, a).await,
        Command::Ls { json } => {
            let list = client()?.list_sandboxes().await?;
            if json {
                print_json(&space_api::SandboxList { sandboxes: list })?;
            } else {
                println!(
                    "{:<20}  {:<12}  {:<9}  {:>5}  {:>8}  {:<24}  ERROR",
                    "ID", "TEMPLATE", "STATE", "CPU", "MEM_MIB", "CREATED"
                );
                for s in list {
                    println!(
                        "{:<20}  {:<12}  {:<9}  {:>5}  {:>8}  {:<24}  {}",
                        s.id,
                        s.template,
                        s.state,
                        s.cpu,
                        s.memory_mib,
                        s.created_at,
                        match (s.node_unreachable, s.error) {
                            (true, None) => "its node is unreachable".to_owned(),
                            (true, Some(e)) => format!("its node is unreachable; {e}"),
                            (false, e) => e.unwrap_or_default(),
                        }
                    );
                }
            }
            Ok(0)
        }
        Command::Top(a) => top::run(client()?, a).await,
        Command::Inspect { id, json: _ } => {
            print_json(&client()?.get_sandbox(&id).await?)?;
            Ok(0)
        }
        Command::Pause {
            id,
            filesystem_only,
        } => {
            let req = space_api::PauseRequest {
                memory: filesystem_only.then_some(false),
            };
            let sb = client()?.pause_sandbox_with(&id, &req).await?;
            println!("{} {}", sb.id, sb.state);
            Ok(0)
        }
        Command::Migrate { id, to, json } => {
            eprintln!("moving {id}: its snapshots and disk first, then what changes meanwhile...");
            let m = client()?
                .migrate_sandbox(&id, &space_api::MigrateRequest { to })
                .await?;
            if json {
                print_json(&m)?;
            } else {
                println!("{}", node::migration_line(&m));
            }
            Ok(0)
        }
        Command::Resume { id } => {
            let sb = client()?.resume_sandbox(&id).await?;
            println!("{} {}", sb.id, sb.state);
            Ok(0)
        }
        Command::Timeout {
            id,
            secs,
            clear: _,
            on_timeout,
        } => {
            let req = space_api::SetTimeout {
                timeout_secs: secs,
                on_timeout,
            };
            let sb = client()?.set_timeout(&id, &req).await?;
            println!("{} {}", sb.id, sb.timeout_at.as_deref().unwrap_or("none"));
            Ok(0)
        }
        Command::Rm { ids } => {
            let c = client()?;
            let mut failed = false;
            for id in ids {
                match c.delete_sandbox(&id).await {
                    Ok(()) => println!("{id}"),
                    Err(e) => {
                        eprintln!("{}", report(&anyhow!(e)));
                        failed = true;
                    }
                }
            }
            Ok(i32::from(failed))
        }
        Command::Cp(args) => {
            cp::run(&client()?, &args).await?;
            Ok(0)
        }
        Command::Ps { id } => {
            let procs = client()?.list_processes(&id).await?;
            println!(
                "{:>7}  {:<8}  {:>6}  {:<12}  CMD",
                "PID", "STATE", "EXIT", "TAG"
            );
            for p in procs {
                let exit = match (p.exit_code, p.signal) {
                    (_, Some(s)) => format!("sig{s}"),
                    (Some(c), None) => c.to_string(),
                    _ => "-".into(),
                };
                println!(
                    "{:>7}  {:<8}  {:>6}  {:<12}  {}",
                    p.pid,
                    if p.running { "running" } else { "exited" },
                    exit,
                    p.tag,
                    p.cmd.join(" ")
                );
            }
            Ok(0)
        }
        Command::Attach { id, pid, offset } => {
            let c = client()?;
            let events = c.process_output(&id, pid, offset, true).await?;
            exec::print_events(events, None).await
        }
        Command::Watch {
            id,
            path,
            recursive,
            json,
        } => {
            let mut events = client()?.watch(&id, &path, recursive).await?;
            while let Some(ev) = futures::StreamExt::next(&mut events).await {
                let ev = ev?;
                if json {
                    println!("{}", serde_json::to_string(&ev)?);
                } else if ev.kind == space_api::WatchKind::Started {
                    eprintln!(
                        "watching {path}{}",
                        if recursive { " (recursive)" } else { "" }
                    );
                } else {
                    let slash = if ev.is_dir { "/" } else { "" };
                    println!("{} {}{slash}", ev.kind.as_str(), ev.name);
                }
            }
            Ok(0)
        }
        Command::Kill { id, pid, signal } => {
            client()?
                .signal(
                    &id,
                    pid,
                    &SignalRequest {
                        signal,
                        group: false,
                    },
                )
                .await?;
            Ok(0)
        }
        Command::Template(c) => template::run(client()?, c).await,
        Command::Bench(c) => bench::run(client()?, c).await,
        Command::Snap(c) => snapshot::run(client()?, c).await,
        Command::Diff(a) => diff::run(client()?, a).await,
        Command::Events(a) => events::run(client()?, a).await,
        Command::Metrics(a) => usage::run(client()?, a).await,
        Command::Net(a) => net::run_net(client()?, a).await,
        Command::Port(a) => net::run_port(client()?, a).await,
        Command::Secret(c) => net::run_secret(client()?, c).await,
        Command::E2b(E2bCmd::Env { domain: false }) => {
            let (url, key) = connection()?;
            print!("{}", e2b_env(&url, &key));
            Ok(0)
        }
        Command::E2b(E2bCmd::Env { domain: true }) => {
            let (_, key) = connection()?;
            let settings = client()?.e2b_settings().await?;
            let domain = settings.domain.context(NO_E2B_DOMAIN)?;
            print!("{}", e2b_env_domain(&domain, &key));
            Ok(0)
        }
        Command::E2b(E2bCmd::Ca) => {
            let settings = client()?.e2b_settings().await?;
            if settings.domain.is_none() {
                anyhow::bail!(NO_E2B_DOMAIN);
            }
            let ca = settings.ca.context(
                "spaced serves the certificate it was given (--tls-cert): trust that certificate's issuer",
            )?;
            print!("{ca}");
            Ok(0)
        }
        Command::Pool(c) => pool::run(client()?, c).await,
        Command::Node(c) => node::run_node(client()?, c).await,
        Command::Cluster(c) => node::run_cluster(client()?, c).await,
        Command::Tenant(c) => tenant::run_tenant(client()?, c).await,
        Command::Key(c) => tenant::run_key(client()?, c).await,
    }
}

fn parse_on_timeout(s: &str) -> Result<space_api::OnTimeout, String> {
    space_api::OnTimeout::parse(s)
        .ok_or_else(|| format!("expected pause, stop or delete, got {s:?}"))
}

/// `NAME@HOST=Header: template`: one `--secret-header`.
fn parse_secret_header(s: &str) -> Result<space_api::SecretHeader, String> {
    let bad = || {
        format!(
            "expected NAME@HOST=Header: template (e.g. GH@api.github.com=Authorization: Bearer {{}}), got {s:?}"
        )
    };
    let (target, header) = s.split_once('=').ok_or_else(bad)?;
    let (secret, host) = target.split_once('@').ok_or_else(bad)?;
    if secret.is_empty() || host.is_empty() || header.trim().is_empty() {
        return Err(bad());
    }
    Ok(space_api::SecretHeader {
        secret: secret.to_owned(),
        hosts: vec![host.to_owned()],
        header: header.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands() {
        let cli = Cli::try_parse_from([
            "space", "exec", "abc", "-i", "-t", "--env", "A=1", "--", "ls", "-la",
        ])
        .unwrap();
        let Command::Exec(a) = cli.cmd else { panic!() };
        assert!(a.interactive && a.tty);
        assert_eq!(a.cmd, vec!["ls", "-la"]);
        assert_eq!(a.env, vec![("A".to_string(), "1".to_string())]);

        let cli = Cli::try_parse_from(["space", "kill", "x", "7", "--signal", "TERM"]).unwrap();
        let Command::Kill { signal, .. } = cli.cmd else {
            panic!()
        };
        assert_eq!(signal.number(), Some(15));
        assert!(Cli::try_parse_from(["space", "kill", "x", "7", "--signal", "NOPE"]).is_err());
        assert!(Cli::try_parse_from(["space", "create", "--env", "novalue"]).is_err());
        assert!(Cli::try_parse_from(["space", "rm"]).is_err());
        let cli = Cli::try_parse_from(["space", "bench", "create", "-n", "5", "--peers"]).unwrap();
        let Command::Bench(bench::BenchCmd::Create(b)) = cli.cmd else {
            panic!()
        };
        assert_eq!(b.n, 5);
        assert!(b.peers);
    }

    #[test]
    fn parses_network_commands() {
        let cli = Cli::try_parse_from([
            "space",
            "create",
            "--egress",
            "allowlist",
            "--allow",
            "api.x.com",
            "--allow",
            "10.0.0.0/8",
            "--secret",
            "K1",
            "--secret",
            "K2",
        ])
        .unwrap();
        let Command::Create(a) = cli.cmd else {
            panic!()
        };
        assert_eq!(a.egress, Some(space_api::Egress::Allowlist));
        assert_eq!(a.allow, vec!["api.x.com", "10.0.0.0/8"]);
        assert_eq!(a.secrets, vec!["K1", "K2"]);
        let cli = Cli::try_parse_from([
            "space",
            "create",
            "--secret-header",
            "GH@api.github.com=Authorization: Bearer {}",
        ])
        .unwrap();
        let Command::Create(a) = cli.cmd else {
            panic!()
        };
        assert_eq!(
            a.secret_headers,
            [space_api::SecretHeader {
                secret: "GH".into(),
                hosts: vec!["api.github.com".into()],
                header: "Authorization: Bearer {}".into(),
            }]
        );
        for bad in ["GH", "GH@x", "@x=A: {}", "GH@=A: {}"] {
            assert!(
                Cli::try_parse_from(["space", "create", "--secret-header", bad]).is_err(),
                "{bad}"
            );
        }
        assert!(Cli::try_parse_from(["space", "create", "--egress", "closed"]).is_err());

        assert!(Cli::try_parse_from(["space", "net", "x"]).is_ok());
        assert!(Cli::try_parse_from(["space", "net", "x", "--egress", "none"]).is_ok());
        assert!(
            Cli::try_parse_from(["space", "net", "x", "--allow", "a.com", "--allow", "b.com"])
                .is_ok()
        );

        assert!(Cli::try_parse_from(["space", "port", "x", "8080"]).is_ok());
        for bad in ["0", "65536", "-1", "http"] {
            assert!(
                Cli::try_parse_from(["space", "port", "x", bad]).is_err(),
                "{bad}"
            );
        }

        let cli = Cli::try_parse_from([
            "space",
            "secret",
            "set",
            "K",
            "--host",
            "api.x.com",
            "--host",
            "*.y.com",
            "--header",
            "Authorization: Bearer {}",
        ])
        .unwrap();
        let Command::Secret(net::SecretCmd::Set {
            name,
            hosts,
            header,
        }) = cli.cmd
        else {
            panic!()
        };
        assert_eq!(name, "K");
        assert_eq!(hosts, vec!["api.x.com", "*.y.com"]);
        assert_eq!(header, "Authorization: Bearer {}");
        // --host and --header are required.
        assert!(Cli::try_parse_from(["space", "secret", "set", "K", "--header", "X: {}"]).is_err());
        assert!(Cli::try_parse_from(["space", "secret", "set", "K", "--host", "a.com"]).is_err());
        assert!(Cli::try_parse_from(["space", "secret", "ls", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["space", "secret", "rm", "K"]).is_ok());
    }

    #[test]
    fn parses_pool_commands() {
        let cli = Cli::try_parse_from([
            "space", "pool", "set", "base", "--min", "2", "--max", "8", "--json",
        ])
        .unwrap();
        let Command::Pool(pool::PoolCmd::Set {
            template,
            min,
            max,
            runtime,
            json,
        }) = cli.cmd
        else {
            panic!()
        };
        assert_eq!(
            (template.as_str(), min, max, runtime, json),
            ("base", 2, Some(8), None, true)
        );
        assert!(Cli::try_parse_from(["space", "pool", "ls", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["space", "pool", "get", "base"]).is_ok());
        // --min is required and sizes are unsigned 32-bit numbers.
        for bad in [
            &["space", "pool", "set", "base"][..],
            &["space", "pool", "set", "base", "--min", "-1"],
            &["space", "pool", "set", "base", "--min", "4294967296"],
            &["space", "pool", "set", "--min", "1"],
            &["space", "pool", "get"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reports_api_errors_in_the_documented_form() {
        let e = anyhow!(ClientError::Api {
            status: 404,
            code: "not_found".into(),
            message: "sandbox x not found".into(),
        });
        assert_eq!(report(&e), "error: sandbox x not found (not_found)");
    }

    #[test]
    fn e2b_env_prints_the_three_exports_with_the_key_in_e2b_form() {
        let out = e2b_env("http://10.1.2.3:7070", "sk_AB");
        assert_eq!(
            out,
            "export E2B_API_KEY=e2b_736b5f4142\n\
             export E2B_API_URL=http://10.1.2.3:7070\n\
             export E2B_SANDBOX_URL=http://10.1.2.3:7070\n"
        );
        assert!(Cli::try_parse_from(["space", "e2b", "env"]).is_ok());
        assert_eq!(
            e2b_env_domain("sb.example.com", "sk_AB"),
            "export E2B_API_KEY=e2b_736b5f4142\nexport E2B_DOMAIN=sb.example.com\n"
        );
        assert!(Cli::try_parse_from(["space", "e2b", "env", "--domain"]).is_ok());
        assert!(Cli::try_parse_from(["space", "e2b", "ca"]).is_ok());
    }

    #[test]
    fn tars_directories() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        std::fs::write(dir.path().join("bin/tool"), b"#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("tool", dir.path().join("bin/link")).unwrap();
        let out = tempfile::NamedTempFile::new().unwrap();
        let mut b = tar::Builder::new(out.reopen().unwrap());
        b.follow_symlinks(false);
        b.append_dir_all(".", dir.path()).unwrap();
        b.into_inner().unwrap();
        let mut a = tar::Archive::new(std::fs::File::open(out.path()).unwrap());
        let names: Vec<String> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert!(names.iter().any(|n| n.ends_with("bin/tool")), "{names:?}");
        assert!(names.iter().any(|n| n.ends_with("bin/link")), "{names:?}");
    }
}
