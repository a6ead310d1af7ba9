//! Exec round trip: `POST .../exec` of `true` until its exit event, on one running sandbox.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use super::report::{Target, print_targets, section, stats_header, stats_row};
use super::session::Session;
use super::stats::{Stats, ms, stats};

#[derive(Debug, Clone, Serialize)]
pub struct ExecReport {
    pub runs: usize,
    pub rtt_ms: Option<Stats>,
}

/// `runs` timed execs of `true` in sandbox `id` (after one untimed warm-up).
pub async fn round_trips(s: &Session, id: &str, runs: usize) -> Result<Option<Stats>> {
    s.exec_true(id).await?;
    let mut rtt = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        s.exec_true(id).await?;
        rtt.push(ms(t0.elapsed()));
    }
    Ok(stats(&rtt))
}

/// Creates one sandbox and times `runs` execs in it.
pub async fn measure(s: &Session, runs: usize) -> Result<ExecReport> {
    let sb = s.create().await?;
    // The create may have started a refill; let it finish first.
    s.wait_pool_idle(std::time::Duration::from_secs(60)).await;
    Ok(ExecReport {
        runs,
        rtt_ms: round_trips(s, &sb.id, runs).await?,
    })
}

pub fn targets(r: &ExecReport) -> Vec<Target> {
    vec![Target::at_most(
        "exec round trip p50",
        r.rtt_ms.map(|s| s.p50),
        2.0,
        "ms",
    )]
}

pub fn print(r: &ExecReport) {
    section(&format!("exec round trip: {} runs of `true`", r.runs));
    stats_header("ms");
    stats_row("exec round trip", r.rtt_ms.as_ref(), 1.0);
    print_targets(&targets(r));
}
