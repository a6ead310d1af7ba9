//! Create latency: create -> ready (the create, then the first exec of `true` completes) and
//! the create call alone, on the pool-hit path (the template's pool holds >= n ready
//! sandboxes first) or the miss path (the pool is set to 0 first, so every create builds).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::report::{Target, print_targets, section, stats_header, stats_row, value_row};
use super::session::{Session, pool_wait_limit};
use super::stats::{MIB, Stats, ms, stats};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Served from a warm pool.
    Hit,
    /// Built on create.
    Miss,
}

/// What the pool looked like around the timed creates (hit path).
#[derive(Debug, Clone, Serialize)]
pub struct PoolRun {
    /// Ready sandboxes asked for.
    pub requested: u32,
    /// The pool's min after the node's clamping.
    pub min: u32,
    /// Ready when the timed creates began.
    pub ready_before: u32,
    /// Seconds spent waiting for the pool to fill.
    pub wait_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// The pool's own hit and miss counters over the timed creates.
    pub hits: u64,
    pub misses: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CreateReport {
    pub path: Path,
    pub n: usize,
    pub template: String,
    /// The create call alone.
    pub create_ms: Option<Stats>,
    /// Create, then the first exec of `true` to completion.
    pub create_ready_ms: Option<Stats>,
    /// The samples behind `create_ready_ms`, in run order (for plots).
    #[serde(skip)]
    pub ready_samples: Vec<f64>,
    /// Creates whose sandbox says it came from the pool (`pooled`), and the others.
    pub hits: usize,
    pub misses: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolRun>,
    /// `space bench create` only: exec round trip of `true` on the first sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exec_rtt_ms: Option<Stats>,
    /// `space bench create` only: memory cgroup bytes per sandbox after 1 s idle.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_memory_bytes: Option<Stats>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// Times `n` sequential creates on `path`. The sandboxes stay tracked by the session (the
/// caller decides when to clean up); their ids are returned in creation order.
pub async fn measure(s: &Session, n: usize, path: Path) -> Result<(CreateReport, Vec<String>)> {
    let mut notes = Vec::new();
    let mut pool = None;
    match path {
        Path::Miss => {
            if let Err(e) = s.set_pool(0, 0).await {
                // A node without pools builds every sandbox on create anyway.
                notes.push(format!("pool not turned off: {e:#}"));
            }
        }
        Path::Hit => {
            let want = u32::try_from(n).context("n too large")?;
            let p = s.set_pool(want, want).await?;
            let reach = p.min.min(want);
            if let Some(w) = &p.warning {
                notes.push(format!("the node clamped the pool: {w}"));
            }
            let (now, waited) = s.wait_pool_ready(reach, pool_wait_limit(n)).await?;
            if now.ready < want {
                notes.push(format!(
                    "the pool held {} ready of the {want} asked for after {:.0} s",
                    now.ready,
                    waited.as_secs_f64()
                ));
            }
            pool = Some(PoolRun {
                requested: want,
                min: p.min,
                ready_before: now.ready,
                wait_s: waited.as_secs_f64(),
                warning: p.warning,
                hits: now.hits,
                misses: now.misses,
            });
        }
    }
    let mut create = Vec::with_capacity(n);
    let mut ready = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    let mut hits = 0;
    for i in 0..n {
        let t0 = Instant::now();
        let sb = s.create().await.with_context(|| format!("create #{i}"))?;
        create.push(ms(t0.elapsed()));
        s.exec_true(&sb.id).await?;
        ready.push(ms(t0.elapsed()));
        if sb.pooled {
            hits += 1;
        }
        ids.push(sb.id);
    }
    if let Some(p) = pool.as_mut()
        && let Ok(after) = s.c.get_pool(&s.template).await
    {
        p.hits = after.hits.saturating_sub(p.hits);
        p.misses = after.misses.saturating_sub(p.misses);
    }
    if path == Path::Hit && hits < n {
        notes.push(format!(
            "{} of {n} creates were not served by the pool",
            n - hits
        ));
    }
    for note in &notes {
        eprintln!("space bench: {note}");
    }
    let report = CreateReport {
        path,
        n,
        template: s.template.clone(),
        create_ms: stats(&create),
        create_ready_ms: stats(&ready),
        ready_samples: ready,
        hits,
        misses: n - hits,
        pool,
        exec_rtt_ms: None,
        idle_memory_bytes: None,
        notes,
    };
    Ok((report, ids))
}

/// `space bench create`'s extras: exec round trips on the first sandbox, then the memory
/// cgroup of every sandbox after a second idle.
pub async fn extras(
    s: &Session,
    r: &mut CreateReport,
    ids: &[String],
    exec_runs: usize,
) -> Result<()> {
    if let Some(first) = ids.first() {
        s.wait_pool_idle(Duration::from_secs(60)).await;
        r.exec_rtt_ms = super::exec::round_trips(s, first, exec_runs).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mem: Vec<f64> =
        s.c.list_sandboxes()
            .await?
            .into_iter()
            .filter(|sb| ids.contains(&sb.id))
            .filter_map(|sb| sb.memory_bytes.map(|b| b as f64))
            .collect();
    r.idle_memory_bytes = stats(&mem);
    Ok(())
}

/// Targets for a create report: pool hit p50 <= 5 ms, p90 <= 8, p99 <= 20 (create -> ready).
pub fn targets(r: &CreateReport) -> Vec<Target> {
    if r.path != Path::Hit {
        return Vec::new();
    }
    let s = r.create_ready_ms;
    vec![
        Target::at_most("pool-hit create->ready p50", s.map(|s| s.p50), 5.0, "ms"),
        Target::at_most("pool-hit create->ready p90", s.map(|s| s.p90), 8.0, "ms"),
        Target::at_most("pool-hit create->ready p99", s.map(|s| s.p99), 20.0, "ms"),
    ]
}

pub fn print(r: &CreateReport) {
    let what = match r.path {
        Path::Hit => "pool hit",
        Path::Miss => "pool miss (built on create)",
    };
    section(&format!(
        "create, {what}: {} sandboxes of template {}",
        r.n, r.template
    ));
    stats_header("ms unless noted");
    stats_row("create (API call)", r.create_ms.as_ref(), 1.0);
    stats_row(
        "create -> ready (first exec done)",
        r.create_ready_ms.as_ref(),
        1.0,
    );
    if r.exec_rtt_ms.is_some() {
        stats_row("exec round trip of `true`", r.exec_rtt_ms.as_ref(), 1.0);
    }
    if r.idle_memory_bytes.is_some() {
        stats_row(
            "idle memory (MiB, memory cgroup)",
            r.idle_memory_bytes.as_ref(),
            MIB,
        );
    }
    value_row(
        "served by the pool (pooled)",
        format!("{} hits, {} misses", r.hits, r.misses),
    );
    if let Some(p) = &r.pool {
        value_row(
            "pool",
            format!(
                "{} asked, min {}, {} ready before ({:.1} s to fill); counters: {} hits, {} misses",
                p.requested, p.min, p.ready_before, p.wait_s, p.hits, p.misses
            ),
        );
    }
    for n in &r.notes {
        println!("  note: {n}");
    }
    print_targets(&targets(r));
}
