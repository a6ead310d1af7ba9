//! `space bench`: benchmarks of a running space node through its REST API, one file per
//! benchmark. `space bench all` runs every section in sequence, prints one table per section
//! with the targets next to the results, and writes the whole report as JSON.
//!
//! Every subcommand checks its parameters (limits in [`limits`]) before it creates anything,
//! and deletes everything it created at the end, also after a failure or Ctrl-C; a template
//! pool it changed is put back as it was.

mod churn;
mod create;
mod density;
mod disk;
mod exec;
mod files;
pub mod limits;
mod microvm;
mod peers;
mod plot;
mod reconnect;
mod reconnect_scale;
mod report;
mod scale;
mod session;
mod snapshot;
mod stats;
mod throughput;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use serde::Serialize;
use space_api::Client;

use limits::*;
use report::{Outcome, Target};
use session::Session;

#[derive(Debug, Clone, Args)]
pub struct Common {
    /// The template benchmarked: `minimal` (busybox) by default, so the figures measure the
    /// engine, not a userland (`--template base` for the Debian one).
    #[arg(long, default_value = "minimal")]
    pub template: String,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Create -> ready latency (pool hit with --pool, else the cold path), exec round trip
    /// and idle memory; --peers adds runc, bwrap and QEMU.
    Create(CreateArgs),
    /// Sustained create throughput from concurrent tasks, with a pre-warmed pool.
    Throughput(ThroughputArgs),
    /// Churn: concurrent clients each looping create, exec `true`, remove, with the pool
    /// as the node runs it (nothing pre-warmed): the refill rate and the remove cost set
    /// the pace.
    Churn(ChurnArgs),
    /// Exec round trip of `true` (-n runs, default 200).
    Exec(RunsArgs),
    /// File write and read throughput through the files API.
    Files(FilesArgs),
    /// Snapshot, fork and rollback latency (-n runs each, default 20).
    Snapshot(RunsArgs),
    /// Reconnect latency: attach to a process's output from offset 0 until the first byte
    /// (-n runs, default 100); with --clients C, C clients each dropping and reattaching
    /// from its offset in a loop, every byte checked.
    Reconnect(ReconnectArgs),
    /// Memory of N idle sandboxes: memory cgroup, RSS and PSS per sandbox, node memory.
    Density(DensityArgs),
    /// Cost as the node fills: at each --live level of idle sandboxes, create -> ready
    /// (pool and cold), exec, snapshot, spaced's RSS and CPU at rest, node memory per
    /// sandbox; --plot DIR writes SVG plots.
    Scale(ScaleArgs),
    /// runc, bwrap and QEMU microvm peers on the template's rootfs.
    Peers(PeersArgs),
    /// The microvm runtime: cold boot, creates that restore the template's warm checkpoint
    /// (-n, default 20), exec round trip in a restored VM. Needs a node with microvm on.
    Microvm(MicrovmArgs),
    /// What a disk limit costs: create, write and snapshot, limited against unlimited in
    /// the same run (-n runs each, default 20). Needs spaced with --disk-quotas on.
    Disk(DiskArgs),
    /// Every benchmark in sequence; tables on stdout, the whole report as JSON to --out.
    All(AllArgs),
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Number of sandboxes (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub n: usize,
    /// Exec round trips measured on one sandbox.
    #[arg(long, default_value_t = 200)]
    pub exec_runs: usize,
    /// Measure the pool-hit path: fill the template's pool with n ready sandboxes first.
    /// Without it the pool is set to 0 so that every create builds its sandbox.
    #[arg(long)]
    pub pool: bool,
    /// Also time runc, bwrap (n runs each) and QEMU.
    #[arg(long)]
    pub peers: bool,
    #[command(flatten)]
    pub qemu: QemuArgs,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct ThroughputArgs {
    /// Seconds of sustained creates (1 to 60).
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Concurrent create tasks (1 to 64).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Ready sandboxes asked of the pool first (default: 250 per second of duration, within
    /// half of MemAvailable at 4 MiB each; at most 5000).
    #[arg(long)]
    pub prewarm: Option<usize>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct ChurnArgs {
    /// Seconds of churn at each level (1 to 60).
    #[arg(long, default_value_t = 60)]
    pub duration: u64,
    /// Concurrent clients (1 to 64); each holds at most one sandbox at a time. Several
    /// (`1,2,4,8,16`) run one after the other and give the throughput-latency curve.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub concurrency: Vec<usize>,
    /// Write SVG plots into this directory (created if missing): the throughput-latency
    /// curve and the create -> ready histogram of each level.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Give the template this warm pool for the run (`4:32` is spaced's default pool), put
    /// back as it was after. Without it the pool is the node's as it stands: a template
    /// without one builds every create cold.
    #[arg(long, value_name = "MIN:MAX", value_parser = parse_min_max)]
    pub pool: Option<(u32, u32)>,
    #[command(flatten)]
    pub common: Common,
}

/// `MIN:MAX`, MIN at most MAX.
fn parse_min_max(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected MIN:MAX, e.g. 4:32"))?;
    let n = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|e| format!("{v:?} in {s:?}: {e}"))
    };
    let (min, max) = (n(a)?, n(b)?);
    if min > max {
        return Err(format!("{s:?}: MIN is above MAX"));
    }
    Ok((min, max))
}

#[derive(Debug, Args)]
pub struct RunsArgs {
    /// Timed runs.
    #[arg(short = 'n', long)]
    pub n: Option<usize>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct ReconnectArgs {
    /// Timed runs of the single-client latency (default 100).
    #[arg(short = 'n', long, conflicts_with = "clients")]
    pub n: Option<usize>,
    /// Reconnects at scale: this many clients (1 to 5000), each attached to its own
    /// background process, each dropping and reattaching from its offset in a loop.
    #[arg(long)]
    pub clients: Option<usize>,
    /// With --clients: processes per sandbox (1 to 100).
    #[arg(long, default_value_t = 10, requires = "clients")]
    pub per_sandbox: usize,
    /// With --clients: each process prints `seq 1 LINES` (1 to 100,000; 1,000 is 3,893
    /// bytes), the backlog a reconnect is sent from its offset.
    #[arg(long, default_value_t = 1000, requires = "clients")]
    pub lines: u32,
    /// With --clients: seconds of reconnecting (1 to 60).
    #[arg(long, default_value_t = 10, requires = "clients")]
    pub duration: u64,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct DiskArgs {
    /// Timed runs of each measurement, limited and unlimited (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 20)]
    pub n: usize,
    /// MiB written per run (1 to 1024).
    #[arg(long, default_value_t = 64)]
    pub mib: u64,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct FilesArgs {
    /// Size of the file in MiB (1 to 1024).
    #[arg(long, default_value_t = 64)]
    pub mib: u64,
    /// Write + read runs (1 to 100).
    #[arg(short = 'n', long, default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct DensityArgs {
    /// Idle sandboxes (1 to 1000, and N x 4 MiB within half of MemAvailable).
    #[arg(short = 'n', long = "density", default_value_t = 100)]
    pub n: usize,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Live idle sandboxes at each level, rising (at most 20,000, and 2 MiB each within
    /// MemAvailable less a GiB).
    #[arg(long, value_delimiter = ',', default_value = "0,100,500,1000")]
    pub live: Vec<usize>,
    /// Creates timed at each level, from the pool and cold each (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 20)]
    pub n: usize,
    /// Exec round trips timed at each level.
    #[arg(long, default_value_t = 100)]
    pub exec_runs: usize,
    /// Snapshots timed at each level.
    #[arg(long, default_value_t = 10)]
    pub snapshot_runs: usize,
    /// Write SVG plots into this directory (created if missing).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Args)]
pub struct QemuArgs {
    /// QEMU microvm boots and restores (1 to 100).
    #[arg(long, default_value_t = 5)]
    pub qemu_runs: usize,
    /// Leave the QEMU peers out.
    #[arg(long)]
    pub no_qemu: bool,
}

#[derive(Debug, Args)]
pub struct MicrovmArgs {
    /// Creates from the warm checkpoint (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 20)]
    pub n: usize,
    /// Guest RAM in MiB (the checkpoint is per size).
    #[arg(long, default_value_t = 256)]
    pub memory: u64,
    /// Also measure creates served by a microvm pool of the template (n ready VMs, at most
    /// 20, default limits); the template's pool is put back after.
    #[arg(long)]
    pub pool: bool,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct PeersArgs {
    /// runc and bwrap runs (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 20)]
    pub n: usize,
    #[command(flatten)]
    pub qemu: QemuArgs,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct AllArgs {
    /// Creates timed on each path, pool hit and miss (1 to 1000).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub n: usize,
    /// Idle sandboxes of the density section (1 to 1000).
    #[arg(long, default_value_t = 100)]
    pub density: usize,
    /// Seconds of sustained creates (1 to 60).
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Concurrent create tasks (1 to 64).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Ready sandboxes asked of the pool before the throughput section (default 250 per
    /// second of duration, within half of MemAvailable at 4 MiB each; at most 5000).
    #[arg(long)]
    pub prewarm: Option<usize>,
    #[arg(long, default_value_t = 200)]
    pub exec_runs: usize,
    /// Size of the file of the file throughput section, in MiB (1 to 1024).
    #[arg(long, default_value_t = 64)]
    pub file_mib: u64,
    #[arg(long, default_value_t = 3)]
    pub file_runs: usize,
    #[arg(long, default_value_t = 10)]
    pub snapshot_runs: usize,
    #[arg(long, default_value_t = 100)]
    pub reconnect_runs: usize,
    /// runc and bwrap runs.
    #[arg(long, default_value_t = 20)]
    pub peer_runs: usize,
    #[command(flatten)]
    pub qemu: QemuArgs,
    /// Where the JSON report goes (default ./space-bench-<unix time>.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

/// Runs per subcommand when -n is not given.
const EXEC_RUNS: usize = 200;
const SNAPSHOT_RUNS: usize = 20;
const RECONNECT_RUNS: usize = 100;

fn check_n(n: usize) -> Result<()> {
    check_range("-n", n as u64, 1, MAX_N as u64)
}

fn check_runs(flag: &str, n: usize, max: usize) -> Result<()> {
    check_range(flag, n as u64, 1, max as u64)
}

/// QEMU runs to do (0: none).
fn qemu_plan(q: &QemuArgs) -> Result<usize> {
    if q.no_qemu {
        return Ok(0);
    }
    check_runs("--qemu-runs", q.qemu_runs, MAX_QEMU_RUNS)?;
    Ok(q.qemu_runs)
}

fn throughput_plan(
    duration: u64,
    concurrency: usize,
    prewarm: Option<usize>,
    mem_available: u64,
) -> Result<throughput::Plan> {
    check_range("--duration", duration, 1, MAX_DURATION_S)?;
    check_runs("--concurrency", concurrency, MAX_CONCURRENCY)?;
    check_sandbox_memory("--concurrency", concurrency, mem_available)?;
    let budget = sandbox_budget(mem_available);
    let prewarm = match prewarm {
        Some(p) => {
            check_range("--prewarm", p as u64, 0, MAX_PREWARM as u64)?;
            check_sandbox_memory("--prewarm", p, mem_available)?;
            p
        }
        None => (duration as usize * PREWARM_PER_SECOND)
            .min(MAX_PREWARM)
            .min(budget),
    };
    Ok(throughput::Plan {
        duration: Duration::from_secs(duration),
        concurrency,
        prewarm,
        cap: (duration as usize * MAX_CREATES_PER_SECOND).min(budget),
    })
}

fn churn_plan(duration: u64, concurrency: usize, mem_available: u64) -> Result<churn::Plan> {
    check_range("--duration", duration, 1, MAX_DURATION_S)?;
    check_runs("--concurrency", concurrency, MAX_CONCURRENCY)?;
    check_sandbox_memory("--concurrency", concurrency, mem_available)?;
    Ok(churn::Plan {
        duration: Duration::from_secs(duration),
        concurrency,
        cap: duration as usize * MAX_CREATES_PER_SECOND,
    })
}

/// The open-files limit of this process, raised to its hard limit first: each client of
/// the reconnect run holds a connection.
fn open_file_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let cur = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: cur.maximum,
            maximum: cur.maximum,
        },
    );
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

fn reconnect_plan(
    a: &ReconnectArgs,
    mem_available: u64,
    open_files: u64,
) -> Result<reconnect_scale::Plan> {
    let clients = a.clients.unwrap_or(0);
    check_runs("--clients", clients, MAX_CLIENTS)?;
    check_runs("--per-sandbox", a.per_sandbox, MAX_PER_SANDBOX)?;
    check_range("--duration", a.duration, 1, MAX_DURATION_S)?;
    check_range("--lines", a.lines.into(), 1, MAX_LINES)?;
    let plan = reconnect_scale::Plan {
        clients,
        per_sandbox: a.per_sandbox,
        lines: a.lines,
        duration: Duration::from_secs(a.duration),
        cap: a.duration as usize * MAX_RECONNECTS_PER_SECOND,
    };
    check_sandbox_memory("--clients", plan.sandboxes(), mem_available)?;
    let need = clients as u64 + FILES_SPARE;
    if need > open_files {
        bail!(
            "--clients {clients} needs about {need} open files (one connection each), more \
             than this process's limit of {open_files} (ulimit -n)"
        );
    }
    Ok(plan)
}

fn check_files(mib: u64, runs: usize, mem_available: u64) -> Result<()> {
    check_range("--file-mib", mib, 1, MAX_FILE_MIB)?;
    check_buffer_memory("--file-mib", mib * 1024 * 1024, mem_available)?;
    check_runs("--file-runs", runs, MAX_FILE_RUNS)
}

fn check_density(n: usize, mem_available: u64) -> Result<()> {
    check_runs("--density", n, MAX_DENSITY)?;
    check_sandbox_memory("--density", n, mem_available)
}

/// Where the report goes: a file in an existing directory.
fn out_path(out: Option<PathBuf>, unix: u64) -> Result<PathBuf> {
    let path = out.unwrap_or_else(|| PathBuf::from(format!("space-bench-{unix}.json")));
    if path.is_dir() {
        bail!("--out {} is a directory", path.display());
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        bail!(
            "--out {}: directory {} does not exist",
            path.display(),
            parent.display()
        );
    }
    Ok(path)
}

/// Everything `space bench all` will do, checked.
#[derive(Debug, Clone, Serialize)]
struct AllPlan {
    template: String,
    n: usize,
    density: usize,
    duration_s: u64,
    concurrency: usize,
    prewarm: usize,
    create_cap: usize,
    exec_runs: usize,
    file_mib: u64,
    file_runs: usize,
    snapshot_runs: usize,
    reconnect_runs: usize,
    peer_runs: usize,
    qemu_runs: usize,
    #[serde(skip)]
    throughput: throughput::Plan,
    out: PathBuf,
}

fn all_plan(a: AllArgs, mem_available: u64, unix: u64) -> Result<AllPlan> {
    check_n(a.n)?;
    check_sandbox_memory("-n", a.n, mem_available)?;
    check_density(a.density, mem_available)?;
    let tp = throughput_plan(a.duration, a.concurrency, a.prewarm, mem_available)?;
    check_runs("--exec-runs", a.exec_runs, MAX_RUNS)?;
    check_files(a.file_mib, a.file_runs, mem_available)?;
    check_runs("--snapshot-runs", a.snapshot_runs, MAX_HEAVY_RUNS)?;
    check_runs("--reconnect-runs", a.reconnect_runs, MAX_RUNS)?;
    check_runs("--peer-runs", a.peer_runs, MAX_HEAVY_RUNS)?;
    let qemu_runs = qemu_plan(&a.qemu)?;
    Ok(AllPlan {
        template: a.common.template,
        n: a.n,
        density: a.density,
        duration_s: a.duration,
        concurrency: a.concurrency,
        prewarm: tp.prewarm,
        create_cap: tp.cap,
        exec_runs: a.exec_runs,
        file_mib: a.file_mib,
        file_runs: a.file_runs,
        snapshot_runs: a.snapshot_runs,
        reconnect_runs: a.reconnect_runs,
        peer_runs: a.peer_runs,
        qemu_runs,
        throughput: tp,
        out: out_path(a.out, unix)?,
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn emit<T: Serialize>(json: bool, report: &T, print: impl FnOnce(&T)) -> Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print(report);
    }
    Ok(0)
}

pub async fn run(c: Client, cmd: BenchCmd) -> Result<i32> {
    match cmd {
        BenchCmd::Create(a) => run_create(c, a).await,
        BenchCmd::Throughput(a) => {
            let plan = throughput_plan(a.duration, a.concurrency, a.prewarm, mem_available()?)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(throughput::measure(&s, plan)).await?;
            emit(a.common.json, &r, throughput::print)
        }
        BenchCmd::Churn(a) => run_churn(c, a).await,
        BenchCmd::Exec(a) => {
            let runs = a.n.unwrap_or(EXEC_RUNS);
            check_runs("-n", runs, MAX_RUNS)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(exec::measure(&s, runs)).await?;
            emit(a.common.json, &r, exec::print)
        }
        BenchCmd::Files(a) => {
            check_files(a.mib, a.runs, mem_available()?)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(files::measure(&s, a.mib, a.runs)).await?;
            emit(a.common.json, &r, files::print)
        }
        BenchCmd::Snapshot(a) => {
            let runs = a.n.unwrap_or(SNAPSHOT_RUNS);
            check_runs("-n", runs, MAX_HEAVY_RUNS)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(snapshot::measure(&s, runs)).await?;
            emit(a.common.json, &r, snapshot::print)
        }
        BenchCmd::Reconnect(a) if a.clients.is_some() => {
            let plan = reconnect_plan(&a, mem_available()?, open_file_limit())?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(reconnect_scale::measure(&s, plan)).await?;
            emit(a.common.json, &r, reconnect_scale::print)
        }
        BenchCmd::Reconnect(a) => {
            let runs = a.n.unwrap_or(RECONNECT_RUNS);
            check_runs("-n", runs, MAX_RUNS)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(reconnect::measure(&s, runs)).await?;
            emit(a.common.json, &r, reconnect::print)
        }
        BenchCmd::Density(a) => {
            check_density(a.n, mem_available()?)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(density::measure(&s, a.n)).await?;
            emit(a.common.json, &r, density::print)
        }
        BenchCmd::Scale(a) => {
            let plan = scale::plan(
                a.live,
                a.n,
                a.exec_runs,
                a.snapshot_runs,
                a.plot,
                mem_available()?,
            )?;
            let s = Session::new(c, &a.common.template);
            let top = plan.levels.last().copied().unwrap_or(0);
            scale::check_open_files(top, plan.runs, &scale::process_figures(&s).await)?;
            let r = s.guarded(scale::measure(&s, plan)).await?;
            emit(a.common.json, &r, scale::print)
        }
        BenchCmd::Microvm(a) => {
            check_runs("-n", a.n, MAX_HEAVY_RUNS)?;
            if !(128..=65536).contains(&a.memory) {
                bail!("--memory {} is out of range: 128 to 65536 MiB", a.memory);
            }
            let s = Session::new(c, &a.common.template);
            let r = s
                .guarded(microvm::measure(&s, a.n, a.memory, a.pool))
                .await?;
            emit(a.common.json, &r, microvm::print)
        }
        BenchCmd::Peers(a) => {
            check_runs("-n", a.n, MAX_HEAVY_RUNS)?;
            let qemu_runs = qemu_plan(&a.qemu)?;
            let s = Session::new(c, &a.common.template);
            let plan = peers::PeerPlan {
                runs: a.n,
                qemu_runs,
                space_hit_p50: None,
                space_miss_p50: None,
            };
            let r = peers::measure(&s, plan).await;
            emit(a.common.json, &r, peers::print)
        }
        BenchCmd::Disk(a) => {
            check_runs("-n", a.n, MAX_HEAVY_RUNS)?;
            check_range("--mib", a.mib, 1, MAX_FILE_MIB)?;
            let s = Session::new(c, &a.common.template);
            let r = s.guarded(disk::measure(&s, a.n, a.mib)).await?;
            emit(a.common.json, &r, disk::print)
        }
        BenchCmd::All(a) => run_all(c, a).await,
    }
}

/// `space bench churn`: one level gives its report; several give the curve (`levels`).
async fn run_churn(c: Client, a: ChurnArgs) -> Result<i32> {
    let mem = mem_available()?;
    if a.concurrency.is_empty() {
        bail!("--concurrency needs at least one level");
    }
    let plans = a
        .concurrency
        .iter()
        .map(|&n| churn_plan(a.duration, n, mem))
        .collect::<Result<Vec<_>>>()?;
    let s = Session::new(c, &a.common.template);
    let levels = s
        .guarded(async {
            if let Some((min, max)) = a.pool {
                s.set_pool(min, max).await?;
                eprintln!("space bench: churn: waiting for the pool ({min}:{max}) to fill");
                s.wait_pool_ready(min, Duration::from_secs(120)).await?;
            }
            let mut levels = Vec::with_capacity(plans.len());
            for plan in &plans {
                levels.push(churn::measure(&s, *plan).await?);
            }
            Ok(levels)
        })
        .await?;
    let plots = match &a.plot {
        Some(dir) => plot::churn(dir, &a.common.template, &levels)?,
        None => Vec::new(),
    };
    for f in &plots {
        eprintln!("space bench: wrote {}", f.display());
    }
    match <[churn::ChurnReport; 1]>::try_from(levels) {
        Ok([one]) => emit(a.common.json, &one, churn::print),
        Err(levels) => {
            let curve = churn::ChurnCurve { levels };
            emit(a.common.json, &curve, churn::print_curve)
        }
    }
}

#[derive(Debug, Serialize)]
struct CreateCmdReport {
    #[serde(flatten)]
    create: create::CreateReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    peers: Option<peers::PeersReport>,
}

async fn run_create(c: Client, a: CreateArgs) -> Result<i32> {
    check_n(a.n)?;
    check_runs("--exec-runs", a.exec_runs, MAX_RUNS)?;
    check_sandbox_memory("-n", a.n, mem_available()?)?;
    let qemu_runs = if a.peers { qemu_plan(&a.qemu)? } else { 0 };
    let path = if a.pool {
        create::Path::Hit
    } else {
        create::Path::Miss
    };
    let s = Session::new(c, &a.common.template);
    let mut r = s
        .guarded(async {
            let (mut r, ids) = create::measure(&s, a.n, path).await?;
            create::extras(&s, &mut r, &ids, a.exec_runs).await?;
            Ok(r)
        })
        .await?;
    let peers = if a.peers {
        let p50 = r.create_ready_ms.map(|s| s.p50);
        let plan = peers::PeerPlan {
            runs: a.n,
            qemu_runs,
            space_hit_p50: p50.filter(|_| a.pool),
            space_miss_p50: p50.filter(|_| !a.pool),
        };
        Some(peers::measure(&s, plan).await)
    } else {
        None
    };
    r.notes.retain(|n| !n.is_empty());
    let report = CreateCmdReport { create: r, peers };
    emit(a.common.json, &report, |r| {
        create::print(&r.create);
        if let Some(p) = &r.peers {
            peers::print(p);
        }
    })
}

/// The machine the bench ran on.
#[derive(Debug, Clone, Serialize)]
struct Machine {
    cores: usize,
    memory_total_bytes: u64,
    mem_available_bytes: u64,
    /// uname: sysname release version machine.
    kernel: String,
    hostname: String,
    cli_version: String,
    /// The server's version (`/healthz`).
    server_version: Option<String>,
}

async fn machine(c: &Client) -> Result<Machine> {
    let (avail, total) = meminfo()?;
    let u = rustix::system::uname();
    let s = |c: &std::ffi::CStr| c.to_string_lossy().into_owned();
    Ok(Machine {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_total_bytes: total,
        mem_available_bytes: avail,
        kernel: format!(
            "{} {} {} {}",
            s(u.sysname()),
            s(u.release()),
            s(u.version()),
            s(u.machine())
        ),
        hostname: s(u.nodename()),
        cli_version: env!("CARGO_PKG_VERSION").to_string(),
        server_version: c.health().await.ok().map(|h| h.version),
    })
}

#[derive(Debug, Serialize)]
struct AllReport {
    started_at_unix: u64,
    elapsed_s: f64,
    machine: Machine,
    parameters: AllPlan,
    create_miss: Outcome<create::CreateReport>,
    create_hit: Outcome<create::CreateReport>,
    throughput: Outcome<throughput::ThroughputReport>,
    exec: Outcome<exec::ExecReport>,
    files: Outcome<files::FilesReport>,
    snapshot: Outcome<snapshot::SnapshotReport>,
    reconnect: Outcome<reconnect::ReconnectReport>,
    density: Outcome<density::DensityReport>,
    peers: Outcome<peers::PeersReport>,
    /// Issue 5's targets next to the measured values.
    targets: Vec<Target>,
}

impl AllReport {
    fn failed_sections(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        let mut f = |name, failed: bool| {
            if failed {
                out.push(name);
            }
        };
        f("create_miss", self.create_miss.is_failed());
        f("create_hit", self.create_hit.is_failed());
        f("throughput", self.throughput.is_failed());
        f("exec", self.exec.is_failed());
        f("files", self.files.is_failed());
        f("snapshot", self.snapshot.is_failed());
        f("reconnect", self.reconnect.is_failed());
        f("density", self.density.is_failed());
        f("peers", self.peers.is_failed());
        out
    }

    fn collect_targets(&mut self) {
        let mut t = Vec::new();
        if let Some(r) = self.create_hit.ok() {
            t.extend(create::targets(r));
        }
        if let Some(r) = self.throughput.ok() {
            t.extend(throughput::targets(r));
        }
        if let Some(r) = self.density.ok() {
            t.extend(density::targets(r));
        }
        if let Some(r) = self.exec.ok() {
            t.extend(exec::targets(r));
        }
        self.targets = t;
    }
}

/// Runs one section: progress on stderr, its table on stdout (unless JSON), then deletes
/// what it created.
async fn section<T>(
    s: &Session,
    name: &str,
    json: bool,
    body: impl Future<Output = Result<T>>,
    print: impl FnOnce(&T),
) -> Outcome<T> {
    eprintln!("space bench: {name}...");
    let t0 = Instant::now();
    let r = Outcome::from_result(body.await);
    s.cleanup().await;
    eprintln!(
        "space bench: {name} done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    if !json {
        r.print(name, print);
    }
    r
}

async fn run_all(c: Client, a: AllArgs) -> Result<i32> {
    let started = unix_now();
    let json = a.common.json;
    let plan = all_plan(a, mem_available()?, started)?;
    let s = Session::new(c.clone(), &plan.template);
    let machine = machine(&c).await?;
    let t0 = Instant::now();
    let mut report = s
        .guarded(async {
            let p = &plan;
            let create_miss = section(
                &s,
                "create (pool miss)",
                json,
                async { Ok(create::measure(&s, p.n, create::Path::Miss).await?.0) },
                create::print,
            )
            .await;
            let create_hit = section(
                &s,
                "create (pool hit)",
                json,
                async { Ok(create::measure(&s, p.n, create::Path::Hit).await?.0) },
                create::print,
            )
            .await;
            let throughput = section(
                &s,
                "throughput",
                json,
                throughput::measure(&s, p.throughput),
                throughput::print,
            )
            .await;
            let exec = section(
                &s,
                "exec",
                json,
                exec::measure(&s, p.exec_runs),
                exec::print,
            )
            .await;
            let files = section(
                &s,
                "files",
                json,
                files::measure(&s, p.file_mib, p.file_runs),
                files::print,
            )
            .await;
            let snapshot = section(
                &s,
                "snapshot",
                json,
                snapshot::measure(&s, p.snapshot_runs),
                snapshot::print,
            )
            .await;
            let reconnect = section(
                &s,
                "reconnect",
                json,
                reconnect::measure(&s, p.reconnect_runs),
                reconnect::print,
            )
            .await;
            let density = section(
                &s,
                "density",
                json,
                density::measure(&s, p.density),
                density::print,
            )
            .await;
            let p50 = |o: &Outcome<create::CreateReport>| {
                o.ok().and_then(|r| r.create_ready_ms).map(|s| s.p50)
            };
            let peer_plan = peers::PeerPlan {
                runs: p.peer_runs,
                qemu_runs: p.qemu_runs,
                space_hit_p50: p50(&create_hit),
                space_miss_p50: p50(&create_miss),
            };
            let peers = section(
                &s,
                "peers",
                json,
                async { Ok(peers::measure(&s, peer_plan).await) },
                peers::print,
            )
            .await;
            Ok(AllReport {
                started_at_unix: started,
                elapsed_s: 0.0,
                machine: machine.clone(),
                parameters: plan.clone(),
                create_miss,
                create_hit,
                throughput,
                exec,
                files,
                snapshot,
                reconnect,
                density,
                peers,
                targets: Vec::new(),
            })
        })
        .await?;
    report.elapsed_s = t0.elapsed().as_secs_f64();
    report.collect_targets();
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(&plan.out, format!("{text}\n"))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", plan.out.display()))?;
    if json {
        println!("{text}");
    } else {
        report::section("targets (issue 5)");
        report::print_targets(&report.targets);
        println!(
            "\nmachine: {} cores, {:.1} GiB, {}; space {} (server {})",
            machine.cores,
            machine.memory_total_bytes as f64 / (1024.0 * 1024.0 * 1024.0),
            machine.kernel,
            machine.cli_version,
            machine.server_version.as_deref().unwrap_or("unknown")
        );
    }
    eprintln!(
        "space bench: report written to {} ({:.0} s)",
        plan.out.display(),
        report.elapsed_s
    );
    let failed = report.failed_sections();
    if failed.is_empty() {
        Ok(0)
    } else {
        eprintln!("space bench: failed sections: {}", failed.join(", "));
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(subcommand)]
        cmd: BenchCmd,
    }

    const GIB: u64 = 1024 * 1024 * 1024;

    fn try_parse(args: &[&str]) -> Result<BenchCmd, clap::Error> {
        let mut all = vec!["bench"];
        all.extend_from_slice(args);
        T::try_parse_from(all).map(|t| t.cmd)
    }

    fn parse(args: &[&str]) -> BenchCmd {
        try_parse(args).unwrap()
    }

    fn all_args(extra: &[&str]) -> AllArgs {
        let mut args = vec!["all"];
        args.extend_from_slice(extra);
        match parse(&args) {
            BenchCmd::All(a) => a,
            other => panic!("{other:?}"),
        }
    }

    fn refused(extra: &[&str], mem: u64) -> String {
        all_plan(all_args(extra), mem, 1)
            .map(|p| panic!("{extra:?} accepted: {p:?}"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_subcommands() {
        let BenchCmd::Create(c) = parse(&["create", "-n", "5", "--pool", "--peers", "--no-qemu"])
        else {
            panic!()
        };
        assert!(c.pool && c.peers && c.qemu.no_qemu);
        assert_eq!(
            (c.n, c.exec_runs, c.common.template.as_str()),
            (5, 200, "minimal")
        );
        let BenchCmd::Create(c) = parse(&["create"]) else {
            panic!()
        };
        assert!(!c.pool && !c.peers);
        let BenchCmd::Scale(sc) = parse(&["scale", "--live", "0,10,20", "--plot", "/tmp/p"]) else {
            panic!()
        };
        assert_eq!((sc.live, sc.n), (vec![0, 10, 20], 20));
        assert_eq!(sc.plot.as_deref(), Some(std::path::Path::new("/tmp/p")));
        let BenchCmd::Scale(sc) = parse(&["scale"]) else {
            panic!()
        };
        assert_eq!(sc.live, vec![0, 100, 500, 1000]);
        let a = all_args(&[
            "-n",
            "3",
            "--density",
            "3",
            "--duration",
            "1",
            "--concurrency",
            "2",
            "--json",
            "--out",
            "/tmp/x.json",
        ]);
        assert_eq!((a.n, a.density, a.duration, a.concurrency), (3, 3, 1, 2));
        assert!(a.common.json);
        assert_eq!(a.out, Some(PathBuf::from("/tmp/x.json")));
        assert!(matches!(
            parse(&["exec", "-n", "7"]),
            BenchCmd::Exec(RunsArgs { n: Some(7), .. })
        ));
        assert!(matches!(
            parse(&["density", "--density", "9"]),
            BenchCmd::Density(DensityArgs { n: 9, .. })
        ));
        assert!(matches!(
            parse(&["throughput"]),
            BenchCmd::Throughput(ThroughputArgs {
                duration: 10,
                concurrency: 8,
                prewarm: None,
                ..
            })
        ));
        let BenchCmd::Churn(a) = parse(&["churn"]) else {
            panic!()
        };
        assert_eq!((a.duration, a.concurrency), (60, vec![8]));
        let BenchCmd::Churn(a) = parse(&["churn", "--concurrency", "1,2,4"]) else {
            panic!()
        };
        assert_eq!(a.concurrency, vec![1, 2, 4]);
        let BenchCmd::Churn(a) = parse(&["churn", "--pool", "4:32"]) else {
            panic!()
        };
        assert_eq!(a.pool, Some((4, 32)));
        for bad in ["4", "32:4", "a:1", "1:-2"] {
            assert!(try_parse(&["churn", "--pool", bad]).is_err(), "{bad}");
        }
        assert!(T::try_parse_from(["bench", "all", "-n", "many"]).is_err());
        assert!(T::try_parse_from(["bench", "nope"]).is_err());
    }

    #[test]
    fn all_defaults_fit_a_big_node() {
        let p = all_plan(all_args(&[]), 20 * GIB, 7).unwrap();
        assert_eq!(
            (p.n, p.density, p.duration_s, p.concurrency),
            (50, 100, 10, 8)
        );
        // 250 per second, within half of 20 GiB at 4 MiB each (2560).
        assert_eq!(p.prewarm, 2500);
        assert_eq!(p.create_cap, 2560);
        assert_eq!(p.qemu_runs, 5);
        assert_eq!(p.out, PathBuf::from("space-bench-7.json"));
        let p = all_plan(all_args(&["--no-qemu"]), 20 * GIB, 7).unwrap();
        assert_eq!(p.qemu_runs, 0);
    }

    #[test]
    fn refusals_name_the_limit() {
        let big = 64 * GIB;
        for (args, want) in [
            (&["-n", "0"][..], "-n must be between 1 and 1000"),
            (&["-n", "1001"], "-n must be between 1 and 1000"),
            (
                &["--density", "1001"],
                "--density must be between 1 and 1000",
            ),
            (&["--duration", "61"], "--duration must be between 1 and 60"),
            (&["--duration", "0"], "--duration must be between 1 and 60"),
            (
                &["--concurrency", "65"],
                "--concurrency must be between 1 and 64",
            ),
            (
                &["--prewarm", "5001"],
                "--prewarm must be between 0 and 5000",
            ),
            (
                &["--file-mib", "2048"],
                "--file-mib must be between 1 and 1024",
            ),
            (
                &["--exec-runs", "0"],
                "--exec-runs must be between 1 and 10000",
            ),
            (
                &["--snapshot-runs", "1001"],
                "--snapshot-runs must be between 1 and 1000",
            ),
            (
                &["--qemu-runs", "101"],
                "--qemu-runs must be between 1 and 100",
            ),
        ] {
            let e = refused(args, big);
            assert!(e.contains(want), "{args:?}: {e}");
        }
        // Memory: 1000 sandboxes at 4 MiB need 4000 MiB, more than half of 6 GiB.
        let e = refused(&["--density", "1000"], 6 * GIB);
        assert!(e.contains("--density 1000") && e.contains("half"), "{e}");
        let e = refused(&["--prewarm", "1000"], 6 * GIB);
        assert!(e.contains("--prewarm 1000"), "{e}");
        let e = refused(&["--file-mib", "1024"], GIB);
        assert!(
            e.contains("--file-mib") && e.contains("half of MemAvailable"),
            "{e}"
        );
        let e = refused(&["--out", "/nonexistent-dir/r.json"], big);
        assert!(e.contains("does not exist"), "{e}");
        let e = refused(&["--out", "/tmp"], big);
        assert!(e.contains("is a directory"), "{e}");
    }

    #[test]
    fn reconnect_plan_spreads_clients_and_checks_open_files() {
        let BenchCmd::Reconnect(a) = parse(&["reconnect", "--clients", "1000"]) else {
            panic!()
        };
        let p = reconnect_plan(&a, 64 * GIB, 20_000).unwrap();
        assert_eq!((p.clients, p.per_sandbox, p.sandboxes()), (1000, 10, 100));
        assert_eq!(p.cap, 10 * MAX_RECONNECTS_PER_SECOND);
        let e = reconnect_plan(&a, 64 * GIB, 1024).unwrap_err().to_string();
        assert!(e.contains("1064 open files") && e.contains("1024"), "{e}");
        // 100 sandboxes at 4 MiB need 400 MiB: more than half of 512 MiB.
        let e = reconnect_plan(&a, 512 << 20, 20_000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--clients 100"), "{e}");
        let BenchCmd::Reconnect(a) =
            parse(&["reconnect", "--clients", "25", "--per-sandbox", "10"])
        else {
            panic!()
        };
        assert_eq!(reconnect_plan(&a, 64 * GIB, 20_000).unwrap().sandboxes(), 3);
        // The per-sandbox and duration flags belong to --clients; -n to the latency run.
        assert!(try_parse(&["reconnect", "--per-sandbox", "5"]).is_err());
        assert!(try_parse(&["reconnect", "-n", "5", "--clients", "5"]).is_err());
    }

    #[test]
    fn throughput_plan_is_bounded_by_memory() {
        // 2 GiB available: 256 sandboxes of budget.
        let p = throughput_plan(10, 8, None, 2 * GIB).unwrap();
        assert_eq!((p.prewarm, p.cap), (256, 256));
        let p = throughput_plan(1, 2, Some(5), 2 * GIB).unwrap();
        assert_eq!((p.prewarm, p.cap, p.concurrency), (5, 256, 2));
        let p = throughput_plan(60, 64, None, 1024 * GIB).unwrap();
        assert_eq!(
            (p.prewarm, p.cap),
            (MAX_PREWARM, 60 * MAX_CREATES_PER_SECOND)
        );
        assert_eq!(p.duration, Duration::from_secs(60));
    }

    #[tokio::test]
    async fn refuses_before_creating_anything() {
        // Nothing listens on port 1: a refusal must come from the checks, not the network.
        let c = Client::new("http://127.0.0.1:1", "k").unwrap();
        for (args, want) in [
            (&["create", "-n", "1001"][..], "1000"),
            (
                &["create", "--pool", "-n", "0"],
                "-n must be between 1 and 1000",
            ),
            (
                &["throughput", "--concurrency", "65"],
                "--concurrency must be between 1 and 64",
            ),
            (
                &["churn", "--duration", "61"],
                "--duration must be between 1 and 60",
            ),
            (
                &["churn", "--concurrency", "0"],
                "--concurrency must be between 1 and 64",
            ),
            (
                &["churn", "--concurrency", "1,2,65"],
                "--concurrency must be between 1 and 64",
            ),
            (&["exec", "-n", "0"], "-n must be between 1 and 10000"),
            (
                &["files", "--mib", "0"],
                "--file-mib must be between 1 and 1024",
            ),
            (&["snapshot", "-n", "1001"], "-n must be between 1 and 1000"),
            (
                &["reconnect", "-n", "10001"],
                "-n must be between 1 and 10000",
            ),
            (
                &["density", "--density", "1001"],
                "--density must be between 1 and 1000",
            ),
            (
                &["peers", "--qemu-runs", "0"],
                "--qemu-runs must be between 1 and 100",
            ),
            (
                &["all", "--duration", "61"],
                "--duration must be between 1 and 60",
            ),
            (
                &["reconnect", "--clients", "5001"],
                "--clients must be between 1 and 5000",
            ),
            (
                &["reconnect", "--clients", "10", "--per-sandbox", "0"],
                "--per-sandbox must be between 1 and 100",
            ),
            (
                &["reconnect", "--clients", "10", "--lines", "0"],
                "--lines must be between 1 and 100000",
            ),
            (
                &["reconnect", "--clients", "10", "--duration", "61"],
                "--duration must be between 1 and 60",
            ),
        ] {
            let e = run(c.clone(), parse(args)).await.unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }
}
