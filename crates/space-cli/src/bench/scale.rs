//! `space bench scale`: what the node's operations cost as it fills (issue 16). For each level
//! of `--live` (ascending), the node is filled with idle sandboxes of the template up to that
//! count, left to settle, and then:
//! - spaced's resident memory and its CPU use at rest over [`REST_WINDOW`] (from its own
//!   `process_*` series on `/metrics`): what the reconciler and the node's timers cost per
//!   idle sandbox;
//! - node memory per sandbox: MemAvailable before the run minus now, over the live count;
//! - create -> ready from the pool and on the cold path (`-n` each; those sandboxes are
//!   removed again, so the live count stays the level's);
//! - exec round trip and snapshot latency on one probe sandbox, held for the whole run (each
//!   snapshot is deleted again, so the probe's own snapshot count does not grow with the run).
//!
//! Before anything is made, the top level is checked against the node's memory and spaced's
//! open-files limit (`process_max_fds`; [`FDS_PER_SANDBOX`] each), and refused with what the
//! node holds when either is short.
//!
//! A level the node cannot reach (a create fails: memory, slots, any limit) ends the run
//! there; the levels measured below it are kept, printed and plotted, and the report says
//! where and why it stopped. The fill looks at MemAvailable every [`FILL_STEP`] sandboxes:
//! what one costs grows with the count, so a node that runs low before a level is measured
//! at the count it reached, and the run ends there. Everything is removed at the end, also after Ctrl-C.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde::Serialize;

use super::create::{self, Path};
use super::limits::{FDS_PER_SANDBOX, FDS_SPARE, MAX_LIVE, SCALE_BUDGET_BYTES, check_range};
use super::report::{Target, print_targets, section, value_row};
use super::session::Session;
use super::stats::{MIB, Stats, ms, ratio, stats};

/// How long spaced's CPU use is watched at rest at each level.
pub const REST_WINDOW: Duration = Duration::from_secs(5);
/// Sandboxes deleted at once when the timed creates of a level are removed again.
const REMOVE_CONCURRENCY: usize = 8;

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Live idle sandboxes at each level, ascending.
    pub levels: Vec<usize>,
    /// Creates timed on each path at each level.
    pub runs: usize,
    pub exec_runs: usize,
    pub snapshot_runs: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plot: Option<PathBuf>,
}

/// Checks `--live` and the run counts, and that the top level fits in this node's memory at
/// [`SCALE_BUDGET_BYTES`] per sandbox with a GiB to spare.
pub fn plan(
    levels: Vec<usize>,
    runs: usize,
    exec_runs: usize,
    snapshot_runs: usize,
    plot: Option<PathBuf>,
    mem_available: u64,
) -> Result<Plan> {
    if levels.is_empty() {
        bail!("--live needs at least one level, e.g. --live 0,1000,5000,10000");
    }
    if levels.windows(2).any(|w| w[0] >= w[1]) {
        bail!("--live levels must rise, each above the one before: {levels:?}");
    }
    let top = *levels.last().unwrap_or(&0);
    check_range("--live", top as u64, 0, MAX_LIVE as u64)?;
    check_range("-n", runs as u64, 1, 1000)?;
    check_range("--exec-runs", exec_runs as u64, 1, 10_000)?;
    check_range("--snapshot-runs", snapshot_runs as u64, 1, 1000)?;
    let need = (top + runs + 1) as u64 * SCALE_BUDGET_BYTES;
    let spare = 1u64 << 30;
    if need + spare > mem_available {
        let fits = mem_available.saturating_sub(spare) / SCALE_BUDGET_BYTES;
        bail!(
            "--live {top} needs about {} MiB ({} MiB per idle sandbox) and this node keeps a GiB \
             spare, but MemAvailable is {} MiB: it holds about {} here",
            need / (1 << 20),
            SCALE_BUDGET_BYTES / (1 << 20),
            mem_available / (1 << 20),
            fits.saturating_sub(runs as u64 + 1)
        );
    }
    if let Some(dir) = &plot
        && dir.exists()
        && !dir.is_dir()
    {
        bail!("--plot {} is not a directory", dir.display());
    }
    Ok(Plan {
        levels,
        runs,
        exec_runs,
        snapshot_runs,
        plot,
    })
}

/// Sandboxes created between two looks at the node's memory while filling.
const FILL_STEP: usize = 250;
/// MemAvailable a fill leaves at least (plus what the level's timed creates need).
const MEMORY_FLOOR: u64 = 1 << 30;

/// Everything measured at one level.
#[derive(Debug, Clone, Serialize)]
pub struct Level {
    /// Idle sandboxes the bench held (the probe not counted).
    pub live: usize,
    /// Seconds to create the sandboxes added since the level below.
    pub fill_s: f64,
    /// Sandboxes added per second while filling.
    pub fill_per_s: Option<f64>,
    pub spaced_rss_bytes: Option<f64>,
    /// spaced's open file descriptors at rest, and (that - the count before filling) / live.
    pub spaced_open_fds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fds_per_sandbox: Option<f64>,
    /// spaced's CPU seconds per second at rest.
    pub spaced_cpu_at_rest: Option<f64>,
    /// (MemAvailable before the run - now) / live; None at 0.
    pub node_bytes_per_sandbox: Option<f64>,
    pub mem_available: u64,
    pub create_hit: create::CreateReport,
    pub create_miss: create::CreateReport,
    pub exec_ms: Option<Stats>,
    pub snapshot_ms: Option<Stats>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub template: String,
    pub plan: Plan,
    pub mem_available_before: u64,
    pub levels: Vec<Level>,
    /// Where and why the run ended before its top level.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    pub targets: Vec<Target>,
    /// The SVG files written (`--plot`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub plots: Vec<PathBuf>,
}

/// spaced's own series from `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessFigures {
    pub rss: Option<f64>,
    pub cpu_s: Option<f64>,
    pub open_fds: Option<f64>,
    pub max_fds: Option<f64>,
}

pub async fn process_figures(s: &Session) -> ProcessFigures {
    let Ok(text) = s.c.metrics().await else {
        return ProcessFigures::default();
    };
    ProcessFigures {
        rss: metric(&text, "process_resident_memory_bytes"),
        cpu_s: metric(&text, "process_cpu_seconds_total"),
        open_fds: metric(&text, "process_open_fds"),
        max_fds: metric(&text, "process_max_fds"),
    }
}

/// Refuses a top level that spaced's open-files limit cannot hold at [`FDS_PER_SANDBOX`]
/// each, with the timed creates and spare slots on top. Passes when spaced does not say.
pub fn check_open_files(top: usize, runs: usize, p: &ProcessFigures) -> Result<()> {
    let (Some(open), Some(max)) = (p.open_fds, p.max_fds) else {
        return Ok(());
    };
    let (open, max) = (open as u64, max as u64);
    let need = open + (top + runs + 1) as u64 * FDS_PER_SANDBOX + FDS_SPARE;
    if need > max {
        let fits = max.saturating_sub(open + FDS_SPARE) / FDS_PER_SANDBOX;
        bail!(
            "--live {top} needs about {need} open files in spaced ({FDS_PER_SANDBOX} per idle \
             sandbox, {open} open now), but its limit is {max}: it holds about {} here. Raise \
             spaced's limit (`ulimit -n` or systemd's LimitNOFILE; spaced lifts its soft limit to \
             the hard one itself)",
            fits.saturating_sub(runs as u64 + 1)
        );
    }
    Ok(())
}

/// The value of an unlabelled sample `name` in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let v = l.strip_prefix(name)?.strip_prefix(' ')?;
        v.trim().parse().ok()
    })
}

/// Deletes `ids` now (untimed) and forgets them.
async fn remove(s: &Session, ids: Vec<String>) -> Result<()> {
    let mut dels = futures::stream::iter(ids)
        .map(|id| async move { (s.c.delete_sandbox(&id).await, id) })
        .buffer_unordered(REMOVE_CONCURRENCY);
    while let Some((r, id)) = dels.next().await {
        match r {
            Ok(()) => s.untrack(&id),
            Err(e) if e.status() == Some(404) => s.untrack(&id),
            Err(e) => return Err(e).with_context(|| format!("cannot remove {id}")),
        }
    }
    Ok(())
}

/// `runs` snapshots of the probe, each deleted again (untimed).
async fn snapshots(s: &Session, probe: &str, runs: usize) -> Result<Option<Stats>> {
    let mut took = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        let sn = s.c.create_snapshot(probe, None).await?;
        took.push(ms(t0.elapsed()));
        s.c.delete_snapshot(probe, &sn.id).await?;
    }
    Ok(stats(&took))
}

/// The node before the run filled it (the probe sandbox made).
#[derive(Debug, Clone, Copy)]
struct Baseline {
    mem_available: u64,
    open_fds: Option<f64>,
}

async fn measure_level(
    s: &Session,
    plan: &Plan,
    probe: &str,
    live: usize,
    fill_s: f64,
    added: usize,
    base: Baseline,
) -> Result<Level> {
    // Rest: nothing of the bench's in flight, no pool building.
    s.wait_pool_idle(Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = process_figures(s).await.cpu_s;
    let t0 = Instant::now();
    tokio::time::sleep(REST_WINDOW).await;
    let at_rest = process_figures(s).await;
    let (rss, cpu1) = (at_rest.rss, at_rest.cpu_s);
    let cpu = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some((b - a) / t0.elapsed().as_secs_f64()),
        _ => None,
    };
    let mem_available = super::limits::mem_available()?;
    let node = (live > 0).then(|| (base.mem_available as f64 - mem_available as f64) / live as f64);
    eprintln!("space bench: scale: {live} live: exec and snapshot on the probe");
    let exec_ms = super::exec::round_trips(s, probe, plan.exec_runs).await?;
    let snapshot_ms = snapshots(s, probe, plan.snapshot_runs).await?;
    eprintln!("space bench: scale: {live} live: creates from the pool");
    let (create_hit, ids) = create::measure(s, plan.runs, Path::Hit).await?;
    s.set_pool(0, 0).await?;
    remove(s, ids).await?;
    s.wait_pool_idle(Duration::from_secs(120)).await;
    eprintln!("space bench: scale: {live} live: cold creates");
    let (create_miss, ids) = create::measure(s, plan.runs, Path::Miss).await?;
    remove(s, ids).await?;
    Ok(Level {
        live,
        fill_s,
        fill_per_s: (added > 0 && fill_s > 0.0).then(|| added as f64 / fill_s),
        spaced_rss_bytes: rss,
        spaced_open_fds: at_rest.open_fds,
        fds_per_sandbox: match (at_rest.open_fds, base.open_fds) {
            (Some(now), Some(b)) if live > 0 => Some((now - b) / live as f64),
            _ => None,
        },
        spaced_cpu_at_rest: cpu,
        node_bytes_per_sandbox: node,
        mem_available,
        create_hit,
        create_miss,
        exec_ms,
        snapshot_ms,
    })
}

pub async fn measure(s: &Session, plan: Plan) -> Result<ScaleReport> {
    // Fillers are built on create, not taken from (and refilled into) the pool.
    s.set_pool(0, 0).await?;
    s.wait_pool_idle(Duration::from_secs(120)).await;
    let before = super::limits::mem_available()?;
    let probe = s.create().await.context("creating the probe sandbox")?.id;
    s.wait_pool_idle(Duration::from_secs(120)).await;
    let base = Baseline {
        mem_available: before,
        open_fds: process_figures(s).await.open_fds,
    };
    let mut levels = Vec::new();
    let mut live = 0;
    let mut stopped = None;
    // What a level's timed creates (pool and cold) need on top of its idle sandboxes.
    let floor = MEMORY_FLOOR + (2 * plan.runs as u64 + 1) * SCALE_BUDGET_BYTES;
    'levels: for &want in &plan.levels {
        let t0 = Instant::now();
        let from = live;
        // In steps, each after a look at the node's memory: what a sandbox costs grows with
        // the count (kernel memory per memory cgroup, decision 0059), so the plan's estimate
        // can be short. A node that runs low is measured where it stands, and the run ends.
        let mut short = None;
        while live < want {
            let step = FILL_STEP.min(want - live);
            if let Err(e) = s
                .fill(step, &format!("scale: filling to {want} (at {live})"))
                .await
            {
                // What the failed fill made is live now; the count is the server's.
                let now = s.c.list_sandboxes().await.map(|l| l.len()).unwrap_or(0);
                stopped = Some(format!(
                    "could not reach {want} live sandboxes (about {} on the node): {e:#}",
                    now.saturating_sub(1)
                ));
                break 'levels;
            }
            live += step;
            let avail = super::limits::mem_available()?;
            if live < want && avail < floor {
                short = Some(avail);
                break;
            }
        }
        let fill_s = t0.elapsed().as_secs_f64();
        if let Some(avail) = short {
            stopped = Some(format!(
                "MemAvailable fell to {} MiB at {live} live sandboxes, under the {} MiB this \
                 run keeps free: the node cannot hold {want}; measured at {live} instead",
                avail >> 20,
                floor >> 20
            ));
            eprintln!(
                "space bench: scale: {}",
                stopped.as_deref().unwrap_or_default()
            );
        }
        eprintln!("space bench: scale: {live} live ({fill_s:.1} s to fill); measuring");
        match measure_level(s, &plan, &probe, live, fill_s, live - from, base).await {
            Ok(l) => levels.push(l),
            Err(e) => {
                stopped = Some(format!("measuring at {live} live sandboxes failed: {e:#}"));
                break;
            }
        }
        if short.is_some() {
            break;
        }
    }
    if levels.is_empty() {
        bail!(
            "no level was measured: {}",
            stopped.unwrap_or_else(|| "no levels".into())
        );
    }
    let mut report = ScaleReport {
        template: s.template.clone(),
        plan,
        mem_available_before: before,
        targets: Vec::new(),
        levels,
        stopped,
        plots: Vec::new(),
    };
    report.targets = targets(&report);
    if let Some(dir) = report.plan.plot.clone() {
        report.plots = super::plot::scale(&dir, &report)?;
    }
    Ok(report)
}

/// Issue 16's goals, judged at the highest level measured against the lowest.
pub fn targets(r: &ScaleReport) -> Vec<Target> {
    let (Some(low), Some(top)) = (r.levels.first(), r.levels.last()) else {
        return Vec::new();
    };
    let p50 = |s: &Option<Stats>| s.map(|s| s.p50);
    let grow = |name: &str, a: &Option<Stats>, b: &Option<Stats>| {
        Target::at_most(
            &format!("{name} p50 at {} / at {}", top.live, low.live),
            ratio(p50(b), p50(a)),
            1.5,
            "x",
        )
    };
    let mut t = vec![Target::at_least(
        "idle sandboxes held",
        Some(top.live as f64),
        10_000.0,
        "",
    )];
    if top.live > low.live {
        t.push(grow(
            "create (pool) -> ready",
            &low.create_hit.create_ready_ms,
            &top.create_hit.create_ready_ms,
        ));
        t.push(grow(
            "create (cold) -> ready",
            &low.create_miss.create_ready_ms,
            &top.create_miss.create_ready_ms,
        ));
        t.push(grow("exec", &low.exec_ms, &top.exec_ms));
    }
    t.push(Target::at_most(
        &format!("node memory per idle sandbox at {}", top.live),
        top.node_bytes_per_sandbox.map(|b| b / MIB),
        1.5,
        "MiB",
    ));
    t
}

pub fn print(r: &ScaleReport) {
    section(&format!(
        "scale: template {}, levels {:?}, {} creates per path, {} execs, {} snapshots",
        r.template, r.plan.levels, r.plan.runs, r.plan.exec_runs, r.plan.snapshot_runs
    ));
    let p = |s: &Option<Stats>, f: fn(&Stats) -> f64| s.as_ref().map_or(f64::NAN, f);
    println!(
        "{:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7}",
        "live",
        "hit p50",
        "hit p99",
        "cold p50",
        "cold p99",
        "exec p50",
        "snap p50",
        "fill/s",
        "node MiB",
        "RSS MiB",
        "CPU rest",
        "fds/sbx"
    );
    for l in &r.levels {
        println!(
            "{:>7} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.1} {:>9.2} {:>9.1} {:>9.3} {:>7.2}",
            l.live,
            p(&l.create_hit.create_ready_ms, |s| s.p50),
            p(&l.create_hit.create_ready_ms, |s| s.p99),
            p(&l.create_miss.create_ready_ms, |s| s.p50),
            p(&l.create_miss.create_ready_ms, |s| s.p99),
            p(&l.exec_ms, |s| s.p50),
            p(&l.snapshot_ms, |s| s.p50),
            l.fill_per_s.unwrap_or(f64::NAN),
            l.node_bytes_per_sandbox.map_or(f64::NAN, |b| b / MIB),
            l.spaced_rss_bytes.map_or(f64::NAN, |b| b / MIB),
            l.spaced_cpu_at_rest.unwrap_or(f64::NAN),
            l.fds_per_sandbox.unwrap_or(f64::NAN),
        );
    }
    println!(
        "  (ms; hit: create -> ready from the pool; cold: built on create; node MiB: MemAvailable \
         drop per live sandbox; RSS and CPU rest: spaced's own, CPU-s per s over {} s idle; \
         fds/sbx: spaced's open files per live sandbox)",
        REST_WINDOW.as_secs()
    );
    for l in &r.levels {
        for n in l.create_hit.notes.iter().chain(&l.create_miss.notes) {
            println!("  note at {}: {n}", l.live);
        }
    }
    if let Some(why) = &r.stopped {
        value_row("stopped early", why);
    }
    for p in &r.plots {
        value_row("plot", p.display());
    }
    print_targets(&r.targets);
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn plans_are_checked_before_anything_is_made() {
        let p = plan(vec![0, 1000, 5000, 10_000], 20, 100, 10, None, 23 * GIB).unwrap();
        assert_eq!(p.levels, vec![0, 1000, 5000, 10_000]);
        let err = |levels: Vec<usize>, mem: u64| {
            plan(levels, 20, 100, 10, None, mem)
                .unwrap_err()
                .to_string()
        };
        assert!(err(vec![], 23 * GIB).contains("at least one level"));
        assert!(err(vec![1000, 10], 23 * GIB).contains("must rise"));
        assert!(err(vec![5, 5], 23 * GIB).contains("must rise"));
        assert!(err(vec![0, MAX_LIVE + 1], 1 << 50).contains("--live must be between"));
        let e = err(vec![0, 10_000], 8 * GIB);
        assert!(
            e.contains("--live 10000") && e.contains("MemAvailable"),
            "{e}"
        );
        let e = plan(vec![0], 0, 100, 10, None, 23 * GIB).unwrap_err();
        assert!(e.to_string().contains("-n must be between"), "{e}");
        let file = tempfile::NamedTempFile::new().unwrap();
        let e = plan(vec![0], 5, 5, 5, Some(file.path().into()), 23 * GIB).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn levels_beyond_spaceds_open_files_are_refused() {
        let figures = |open, max| ProcessFigures {
            open_fds: Some(open),
            max_fds: Some(max),
            ..Default::default()
        };
        // This machine: a 20,000 hard limit that root may not raise (no CAP_SYS_RESOURCE),
        // one open file per sandbox (decision 0059).
        let e = check_open_files(19_500, 20, &figures(200.0, 20_000.0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--live 19500") && e.contains("20233") && e.contains("limit is 20000"),
            "{e}"
        );
        assert!(e.contains("holds about 19267 here"), "{e}");
        check_open_files(10_000, 20, &figures(200.0, 20_000.0)).unwrap();
        check_open_files(10_000, 20, &figures(200.0, 1_048_576.0)).unwrap();
        // A server that does not say is not refused.
        check_open_files(10_000, 20, &ProcessFigures::default()).unwrap();
    }

    #[test]
    fn reads_unlabelled_samples() {
        let text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n\
                    process_cpu_seconds_total_x 1\nspace_sandboxes{state=\"running\"} 3\n";
        assert_eq!(metric(text, "process_cpu_seconds_total"), Some(12.5));
        assert_eq!(metric(text, "space_sandboxes"), None);
        assert_eq!(metric(text, "process_resident_memory_bytes"), None);
    }
}
