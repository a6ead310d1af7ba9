//! Snapshot, fork and rollback latency on one sandbox, through the REST API:
//! - snapshot: `POST .../snapshots` (a disk snapshot) until it answers;
//! - fork: `POST .../fork` from the first snapshot, until the first exec of `true` in the
//!   child is done (the child is deleted after each run, untimed);
//! - rollback: `POST .../rollback` to the first snapshot until it answers.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use space_api::ForkRequest;

use super::report::{section, stats_header, stats_row};
use super::session::Session;
use super::stats::{Stats, ms, stats};

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotReport {
    pub runs: usize,
    pub snapshot_ms: Option<Stats>,
    pub fork_ready_ms: Option<Stats>,
    pub rollback_ms: Option<Stats>,
}

pub async fn measure(s: &Session, runs: usize) -> Result<SnapshotReport> {
    let sb = s.create().await?;
    let out =
        s.c.exec_output(
            &sb.id,
            &space_api::ExecRequest::new(["sh", "-c", "echo bench > /tmp/space-bench-state"]),
        )
        .await?;
    if out.status() != 0 {
        bail!("preparing the sandbox failed with status {}", out.status());
    }
    let mut snap = Vec::with_capacity(runs);
    let mut first = None;
    for _ in 0..runs {
        let t0 = Instant::now();
        let sn = s.c.create_snapshot(&sb.id, None).await?;
        snap.push(ms(t0.elapsed()));
        first.get_or_insert(sn.id);
    }
    let first = first.context("no snapshot taken")?;
    let mut fork = Vec::with_capacity(runs);
    for _ in 0..runs {
        let req = ForkRequest {
            snapshot: Some(first.clone()),
            count: Some(1),
        };
        let t0 = Instant::now();
        let children = s.c.fork(&sb.id, &req).await?;
        for c in &children {
            s.track(&c.id);
        }
        let child = children.first().context("fork returned no sandbox")?;
        s.exec_true(&child.id).await?;
        fork.push(ms(t0.elapsed()));
        for c in &children {
            if let Err(e) = s.c.delete_sandbox(&c.id).await {
                eprintln!("space bench: cannot delete fork {}: {e}", c.id);
            }
        }
    }
    let mut rollback = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        s.c.rollback(&sb.id, &first).await?;
        rollback.push(ms(t0.elapsed()));
    }
    // The sandbox works after the rollbacks.
    s.exec_true(&sb.id).await?;
    Ok(SnapshotReport {
        runs,
        snapshot_ms: stats(&snap),
        fork_ready_ms: stats(&fork),
        rollback_ms: stats(&rollback),
    })
}

pub fn print(r: &SnapshotReport) {
    section(&format!("snapshot, fork, rollback: {} runs each", r.runs));
    stats_header("ms");
    stats_row("snapshot (disk)", r.snapshot_ms.as_ref(), 1.0);
    stats_row(
        "fork -> first exec done in the child",
        r.fork_ready_ms.as_ref(),
        1.0,
    );
    stats_row("rollback", r.rollback_ms.as_ref(), 1.0);
}
