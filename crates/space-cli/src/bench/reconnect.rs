//! Reconnect latency: a background process has printed output; time from asking for its
//! output from offset 0 (`GET .../processes/{pid}/output?follow=true`, what `space attach`
//! does) to the first output event.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde::Serialize;
use space_api::{ExecEvent, ExecRequest};

use super::report::{section, stats_header, stats_row};
use super::session::Session;
use super::stats::{Stats, ms, stats};

#[derive(Debug, Clone, Serialize)]
pub struct ReconnectReport {
    pub runs: usize,
    pub first_byte_ms: Option<Stats>,
}

/// Attaches from offset 0 and waits for the first event; true when it carries output.
async fn first_output(s: &Session, id: &str, pid: u32) -> Result<bool> {
    let mut events = s.c.process_output(id, pid, 0, true).await?;
    let ev = events
        .next()
        .await
        .context("the output stream ended without an event")??;
    Ok(matches!(ev, ExecEvent::Stdout { .. }))
}

pub async fn measure(s: &Session, runs: usize) -> Result<ReconnectReport> {
    let sb = s.create().await?;
    let pid =
        s.c.exec_background(
            &sb.id,
            &ExecRequest::new(["sh", "-c", "echo ready; exec sleep 100000"]),
        )
        .await?;
    // Wait (bounded) until the process has printed.
    let t0 = Instant::now();
    while !first_output(s, &sb.id, pid).await? {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("the background process printed nothing within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        if !first_output(s, &sb.id, pid).await? {
            bail!("reconnecting did not return the process's output first");
        }
        samples.push(ms(t0.elapsed()));
    }
    Ok(ReconnectReport {
        runs,
        first_byte_ms: stats(&samples),
    })
}

pub fn print(r: &ReconnectReport) {
    section(&format!("reconnect: {} attaches from offset 0", r.runs));
    stats_header("ms");
    stats_row("attach -> first output byte", r.first_byte_ms.as_ref(), 1.0);
}
