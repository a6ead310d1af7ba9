//! Churn (issue 16): C clients, each looping create → exec `true` → remove for D seconds.
//! Unlike the throughput run nothing is pre-warmed and the live count stays at most C, so
//! the template's pool as the node runs it (its refill rate) and the cost of a remove set
//! the pace. Bounded: at most C tasks, D seconds, and a cap on the cycles
//! (MAX_CREATES_PER_SECOND x D).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::limits::MAX_TASK_ERRORS;
use super::report::{Target, print_targets, rate_row, section, stats_header, stats_row, value_row};
use super::session::Session;
use super::stats::{Stats, ms, rate_window, stats};

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub duration: Duration,
    pub concurrency: usize,
    /// Most cycles the run starts.
    pub cap: usize,
}

/// The template's pool as the node reported it before and after the run.
#[derive(Debug, Clone, Serialize)]
pub struct PoolView {
    pub min: u32,
    pub max: u32,
    pub target: u32,
    pub ready: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    pub duration_s: f64,
    pub concurrency: usize,
    pub cap: usize,
    /// Cycles (create, exec, remove) completed within the window.
    pub cycles: usize,
    pub creates_per_s: f64,
    /// The run stopped early at the cap.
    pub capped: bool,
    /// Create → ready (the API call), exec of `true`, remove, and the whole cycle.
    pub create_ms: Option<Stats>,
    pub exec_ms: Option<Stats>,
    pub remove_ms: Option<Stats>,
    pub cycle_ms: Option<Stats>,
    /// Creates served by the pool (`pooled`) and not.
    pub hits: usize,
    pub misses: usize,
    pub errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_before: Option<PoolView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_after: Option<PoolView>,
    /// Every create → ready sample, for the plots.
    #[serde(skip)]
    pub create_samples: Vec<f64>,
}

/// Churn at several concurrency levels, one after the other: the throughput-latency curve.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnCurve {
    pub levels: Vec<ChurnReport>,
}

#[derive(Default)]
struct Samples {
    create: Vec<f64>,
    exec: Vec<f64>,
    remove: Vec<f64>,
    cycle: Vec<f64>,
    /// When each completed cycle ended, from the start of the run.
    done_at: Vec<Duration>,
    hits: usize,
    errors: Vec<String>,
}

impl Samples {
    fn extend(&mut self, o: Samples) {
        self.create.extend(o.create);
        self.exec.extend(o.exec);
        self.remove.extend(o.remove);
        self.cycle.extend(o.cycle);
        self.done_at.extend(o.done_at);
        self.hits += o.hits;
        self.errors.extend(o.errors);
    }
}

async fn pool_view(s: &Session) -> Option<PoolView> {
    let p = s.c.get_pool(&s.template).await.ok()?;
    Some(PoolView {
        min: p.min,
        max: p.max,
        target: p.target,
        ready: p.ready,
    })
}

/// One client's loop until the deadline, the cap or too many errors.
async fn client(
    s: Session,
    t0: Instant,
    deadline: Instant,
    cap: usize,
    started: Arc<AtomicUsize>,
) -> Samples {
    let mut out = Samples::default();
    while Instant::now() < deadline && out.errors.len() < MAX_TASK_ERRORS {
        if started.fetch_add(1, Ordering::SeqCst) >= cap {
            break;
        }
        let c0 = Instant::now();
        let sb = match s.create().await {
            Ok(sb) => sb,
            Err(e) => {
                out.errors.push(format!("create: {e:#}"));
                continue;
            }
        };
        let create = ms(c0.elapsed());
        let e0 = Instant::now();
        let exec = s.exec_true(&sb.id).await;
        let exec_ms = ms(e0.elapsed());
        let r0 = Instant::now();
        // A failed remove leaves the sandbox tracked: the session's cleanup tries again.
        let removed = s.c.delete_sandbox(&sb.id).await;
        let remove_ms = ms(r0.elapsed());
        match (exec, removed) {
            (Ok(()), Ok(())) => {
                s.untrack(&sb.id);
                out.create.push(create);
                out.exec.push(exec_ms);
                out.remove.push(remove_ms);
                out.cycle.push(ms(c0.elapsed()));
                out.done_at.push(t0.elapsed());
                out.hits += usize::from(sb.pooled);
            }
            (Err(e), removed) => {
                if removed.is_ok() {
                    s.untrack(&sb.id);
                }
                out.errors.push(format!("exec in {}: {e:#}", sb.id));
            }
            (Ok(()), Err(e)) => out.errors.push(format!("remove {}: {e}", sb.id)),
        }
    }
    out
}

pub async fn measure(s: &Session, plan: Plan) -> Result<ChurnReport> {
    let pool_before = pool_view(s).await;
    eprintln!(
        "space bench: churn: {} clients looping create, exec, remove for {:.0} s",
        plan.concurrency,
        plan.duration.as_secs_f64()
    );
    let started = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let deadline = t0 + plan.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..plan.concurrency {
        tasks.spawn(client(s.clone(), t0, deadline, plan.cap, started.clone()));
    }
    let mut all = Samples::default();
    while let Some(r) = tasks.join_next().await {
        all.extend(r?);
    }
    let elapsed = t0.elapsed();
    let pool_after = pool_view(s).await;
    let (capped, window) = rate_window(
        started.load(Ordering::SeqCst),
        plan.cap,
        elapsed,
        plan.duration,
    );
    let cycles = all.done_at.iter().filter(|d| **d <= window).count();
    Ok(ChurnReport {
        duration_s: plan.duration.as_secs_f64(),
        concurrency: plan.concurrency,
        cap: plan.cap,
        cycles,
        creates_per_s: cycles as f64 / window.as_secs_f64().max(1e-3),
        capped,
        create_ms: stats(&all.create),
        exec_ms: stats(&all.exec),
        remove_ms: stats(&all.remove),
        cycle_ms: stats(&all.cycle),
        hits: all.hits,
        misses: all.create.len() - all.hits,
        create_samples: all.create,
        errors: all.errors.len(),
        first_error: all.errors.into_iter().next(),
        pool_before,
        pool_after,
    })
}

pub fn targets(r: &ChurnReport) -> Vec<Target> {
    vec![
        Target::at_least(
            &format!("churn creates/s ({:.0} s)", r.duration_s),
            Some(r.creates_per_s),
            150.0,
            "/s",
        ),
        Target::at_most(
            "churn create -> ready p99",
            r.create_ms.map(|s| s.p99),
            30.0,
            "ms",
        ),
    ]
}

fn pool_line(p: &Option<PoolView>) -> String {
    match p {
        Some(p) => format!(
            "min {} max {} target {} ready {}",
            p.min, p.max, p.target, p.ready
        ),
        None => "none".into(),
    }
}

/// The curve as one table: a row per level.
pub fn print_curve(c: &ChurnCurve) {
    section("churn: the throughput-latency curve (create -> ready, ms)");
    println!(
        "  {:>7} {:>10} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "clients", "creates/s", "p50", "p90", "p99", "max", "errors"
    );
    for r in &c.levels {
        let s = r.create_ms;
        let f = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
        println!(
            "  {:>7} {:>10.1} {:>8} {:>8} {:>8} {:>8} {:>7}",
            r.concurrency,
            r.creates_per_s,
            f(s.map(|s| s.p50)),
            f(s.map(|s| s.p90)),
            f(s.map(|s| s.p99)),
            f(s.map(|s| s.max)),
            r.errors
        );
    }
    for r in &c.levels {
        print(r);
    }
}

pub fn print(r: &ChurnReport) {
    section(&format!(
        "churn: {} clients looping create, exec `true`, remove for {:.0} s",
        r.concurrency, r.duration_s
    ));
    rate_row(
        "cycles completed / creates per second",
        r.cycles,
        r.creates_per_s,
        r.capped.then_some(r.cap),
    );
    stats_header("ms");
    stats_row("create -> ready (API call)", r.create_ms.as_ref(), 1.0);
    stats_row("exec `true`", r.exec_ms.as_ref(), 1.0);
    stats_row("remove", r.remove_ms.as_ref(), 1.0);
    stats_row("whole cycle", r.cycle_ms.as_ref(), 1.0);
    value_row(
        "served by the pool (pooled)",
        format!("{} hits, {} misses", r.hits, r.misses),
    );
    value_row("pool before", pool_line(&r.pool_before));
    value_row("pool after", pool_line(&r.pool_after));
    if r.pool_before.as_ref().is_none_or(|p| p.max == 0) {
        println!(
            "  note: template without a warm pool: every create was built cold \
             (--pool 4:32 gives it spaced's default pool for the run)"
        );
    }
    if r.errors > 0 {
        println!(
            "  note: {} cycles failed, first: {}",
            r.errors,
            r.first_error.as_deref().unwrap_or("")
        );
    }
    print_targets(&targets(r));
}
