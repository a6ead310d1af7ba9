//! Sustained create throughput: the pool is pre-warmed, then C tasks create sandboxes for D
//! seconds; creates that completed within the window count. Bounded: at most C tasks, D
//! seconds, and a cap on the creates (MAX_CREATES_PER_SECOND x D, and the node's memory).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::limits::MAX_TASK_ERRORS;
use super::report::{Target, print_targets, rate_row, section, stats_header, stats_row, value_row};
use super::session::{Session, pool_wait_limit};
use super::stats::{Stats, ms, rate_window, stats};

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub duration: Duration,
    pub concurrency: usize,
    /// Ready sandboxes asked of the pool first (0: no pre-warm).
    pub prewarm: usize,
    /// Most creates the run makes.
    pub cap: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Prewarm {
    pub requested: usize,
    /// The pool's min after the node's clamping.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    /// Ready when the creates began.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<u32>,
    pub wait_s: f64,
    /// Sandboxes the node built for the pool per second of the wait (the background build
    /// rate), and this host's CPU time per sandbox built meanwhile (busy time of every core
    /// from /proc/stat: meaningful when the bench runs on the node, as it does all-in-one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub built_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms_per_sandbox: Option<f64>,
    /// What kept the pool from the requested size, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ThroughputReport {
    pub duration_s: f64,
    pub concurrency: usize,
    pub cap: usize,
    pub prewarm: Prewarm,
    /// Creates that completed within the window.
    pub creates: usize,
    pub creates_per_s: f64,
    /// The run stopped early at the cap.
    pub capped: bool,
    pub create_ms: Option<Stats>,
    /// The creates started while the pool still had members: before the first create it
    /// could not serve (all of them when it never drained).
    pub before_drain_ms: Option<Stats>,
    /// When the first create found the pool empty, from the start of the creates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drained_after_s: Option<f64>,
    /// Creates served by the pool (`pooled`) and not.
    pub hits: usize,
    pub misses: usize,
    pub errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Seconds to delete everything afterwards.
    pub delete_s: f64,
}

struct Sample {
    latency_ms: f64,
    started_at: Duration,
    done_at: Duration,
    pooled: bool,
}

/// Busy CPU seconds of every core of this host so far (/proc/stat: user, nice, system, irq,
/// softirq and steal, in USER_HZ, which is 100 on Linux).
fn host_busy_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let busy = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| f.get(i).copied().unwrap_or(0))
        .sum::<u64>();
    Some(busy as f64 / 100.0)
}

async fn prewarm(s: &Session, want: usize) -> Prewarm {
    let t0 = Instant::now();
    let mut p = Prewarm {
        requested: want,
        min: None,
        ready: None,
        wait_s: 0.0,
        built_per_s: None,
        cpu_ms_per_sandbox: None,
        warning: None,
    };
    if want == 0 {
        return p;
    }
    let want32 = u32::try_from(want).unwrap_or(u32::MAX);
    let ready_before = s.c.get_pool(&s.template).await.map_or(0, |p| p.ready);
    let cpu_before = host_busy_cpu_s();
    match s.set_pool(want32, want32).await {
        Ok(pool) => {
            p.min = Some(pool.min);
            p.warning = pool.warning.clone();
            match s
                .wait_pool_ready(pool.min.min(want32), pool_wait_limit(want))
                .await
            {
                Ok((now, waited)) => {
                    p.ready = Some(now.ready);
                    let built = now.ready.saturating_sub(ready_before);
                    if built > 0 {
                        p.built_per_s = Some(f64::from(built) / waited.as_secs_f64().max(1e-3));
                        p.cpu_ms_per_sandbox = host_busy_cpu_s()
                            .zip(cpu_before)
                            .map(|(after, before)| (after - before) * 1000.0 / f64::from(built));
                    }
                    if now.ready < want32 && p.warning.is_none() {
                        p.warning = Some(format!(
                            "the pool reached {} ready of {want} within the wait limit",
                            now.ready
                        ));
                    }
                }
                Err(e) => p.warning = Some(format!("cannot read the pool: {e:#}")),
            }
        }
        Err(e) => p.warning = Some(format!("no pre-warm: {e:#}")),
    }
    p.wait_s = t0.elapsed().as_secs_f64();
    if let Some(w) = &p.warning {
        eprintln!("space bench: throughput: {w}; running anyway");
    }
    p
}

pub async fn measure(s: &Session, plan: Plan) -> Result<ThroughputReport> {
    let pre = prewarm(s, plan.prewarm).await;
    eprintln!(
        "space bench: throughput: {} tasks creating for {:.0} s",
        plan.concurrency,
        plan.duration.as_secs_f64()
    );
    let started = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let deadline = t0 + plan.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..plan.concurrency {
        let s = s.clone();
        let started = started.clone();
        tasks.spawn(async move {
            let mut samples = Vec::new();
            let mut errors = Vec::new();
            while Instant::now() < deadline && errors.len() < MAX_TASK_ERRORS {
                if started.fetch_add(1, Ordering::SeqCst) >= plan.cap {
                    break;
                }
                let c0 = Instant::now();
                let started_at = t0.elapsed();
                match s.create().await {
                    Ok(sb) => samples.push(Sample {
                        latency_ms: ms(c0.elapsed()),
                        started_at,
                        done_at: t0.elapsed(),
                        pooled: sb.pooled,
                    }),
                    Err(e) => errors.push(format!("{e:#}")),
                }
            }
            (samples, errors)
        });
    }
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let (s, e) = r?;
        samples.extend(s);
        errors.extend(e);
    }
    let elapsed = t0.elapsed();
    let (capped, window) = rate_window(
        started.load(Ordering::SeqCst),
        plan.cap,
        elapsed,
        plan.duration,
    );
    let creates = samples.iter().filter(|x| x.done_at <= window).count();
    let hits = samples.iter().filter(|x| x.pooled).count();
    let latencies: Vec<f64> = samples.iter().map(|x| x.latency_ms).collect();
    let drained = samples
        .iter()
        .filter(|x| !x.pooled)
        .map(|x| x.started_at)
        .min();
    let before_drain: Vec<f64> = samples
        .iter()
        .filter(|x| drained.is_none_or(|d| x.started_at < d))
        .map(|x| x.latency_ms)
        .collect();
    eprintln!(
        "space bench: throughput: {} creates, deleting them",
        samples.len()
    );
    // Stop the pool refilling before the deletes, then delete everything.
    if let Err(e) = s.set_pool(0, 0).await
        && pre.min.is_some()
    {
        eprintln!("space bench: cannot turn the pool off: {e:#}");
    }
    let d0 = Instant::now();
    s.cleanup().await;
    Ok(ThroughputReport {
        duration_s: plan.duration.as_secs_f64(),
        concurrency: plan.concurrency,
        cap: plan.cap,
        prewarm: pre,
        creates,
        creates_per_s: creates as f64 / window.as_secs_f64().max(1e-3),
        capped,
        create_ms: stats(&latencies),
        before_drain_ms: stats(&before_drain),
        drained_after_s: drained.map(|d| d.as_secs_f64()),
        hits,
        misses: samples.len() - hits,
        errors: errors.len(),
        first_error: errors.into_iter().next(),
        delete_s: d0.elapsed().as_secs_f64(),
    })
}

pub fn targets(r: &ThroughputReport) -> Vec<Target> {
    vec![
        Target::at_least(
            &format!("sustained creates/s ({:.0} s, with the pool)", r.duration_s),
            Some(r.creates_per_s),
            200.0,
            "/s",
        ),
        Target::at_most(
            "create p99 while the pool has members",
            r.before_drain_ms.map(|s| s.p99),
            50.0,
            "ms",
        ),
        Target::at_least(
            "pool build rate (pre-warm)",
            r.prewarm.built_per_s,
            80.0,
            "/s",
        ),
    ]
}

pub fn print(r: &ThroughputReport) {
    section(&format!(
        "sustained create throughput: {} tasks for {:.0} s",
        r.concurrency, r.duration_s
    ));
    rate_row(
        "creates completed / per second",
        r.creates,
        r.creates_per_s,
        r.capped.then_some(r.cap),
    );
    stats_header("ms");
    stats_row("create (API call) under load", r.create_ms.as_ref(), 1.0);
    stats_row(
        "  while the pool had members",
        r.before_drain_ms.as_ref(),
        1.0,
    );
    value_row(
        "pool drained",
        match r.drained_after_s {
            Some(d) => format!(
                "after {d:.2} s; {} creates in all were built on demand",
                r.misses
            ),
            None => "never: every create was served by the pool".into(),
        },
    );
    value_row(
        "served by the pool (pooled)",
        format!("{} hits, {} misses", r.hits, r.misses),
    );
    value_row(
        "pool pre-warm",
        format!(
            "{} asked, min {}, {} ready after {:.1} s",
            r.prewarm.requested,
            r.prewarm.min.map_or("n/a".into(), |m| m.to_string()),
            r.prewarm.ready.map_or("n/a".into(), |m| m.to_string()),
            r.prewarm.wait_s
        ),
    );
    if let (Some(rate), Some(cpu)) = (r.prewarm.built_per_s, r.prewarm.cpu_ms_per_sandbox) {
        value_row(
            "pool build rate / host CPU per sandbox",
            format!("{rate:.1}/s / {cpu:.1} ms"),
        );
    }
    if let Some(w) = &r.prewarm.warning {
        println!("  note: {w}");
    }
    if r.errors > 0 {
        println!(
            "  note: {} creates failed, first: {}",
            r.errors,
            r.first_error.as_deref().unwrap_or("")
        );
    }
    value_row("delete everything", format!("{:.1} s", r.delete_s));
    print_targets(&targets(r));
}
