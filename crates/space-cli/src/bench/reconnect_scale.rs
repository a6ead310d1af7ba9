//! Reconnects at scale (issue 16): C clients, each attached to its own background process,
//! each dropping its connection and reconnecting from its byte offset in a loop for D
//! seconds. Every process prints the same known stream (`seq 1 L`: 3,893 bytes for the
//! default L = 1,000, 48,894 for 10,000) and then sleeps; a client keeps a random prefix of
//! the first chunk each attach returns (1 byte up to the whole chunk, so drops land
//! mid-line too), checks it against the stream at its offset, and attaches again where it
//! stopped. A client that reaches the
//! end has read the whole stream once, in pieces, with nothing lost or repeated; it starts
//! over at 0. Any chunk at the wrong offset, with the wrong bytes or past the end, and any
//! gap, counts as a mismatch. Bounded: C tasks, D seconds, and a cap on the reconnects.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde::Serialize;
use space_api::{ExecEvent, ExecRequest};

use super::limits::MAX_TASK_ERRORS;
use super::report::{Target, print_targets, rate_row, section, stats_header, stats_row, value_row};
use super::session::Session;
use super::stats::{Stats, ms, rate_window, stats};

/// Processes started at once during setup.
const START_CONCURRENCY: usize = 16;
/// How long setup waits for every process to have printed its stream.
const READY_LIMIT: Duration = Duration::from_secs(60);
/// How long one attach may wait for its first chunk.
const ATTACH_LIMIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub clients: usize,
    pub per_sandbox: usize,
    /// Each process prints `seq 1 lines`.
    pub lines: u32,
    pub duration: Duration,
    /// Most reconnects the run starts.
    pub cap: usize,
}

impl Plan {
    pub fn sandboxes(&self) -> usize {
        self.clients.div_ceil(self.per_sandbox)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ReconnectScaleReport {
    pub clients: usize,
    pub sandboxes: usize,
    /// Bytes of each process's stream (`seq 1 lines`).
    pub stream_bytes: u64,
    pub duration_s: f64,
    pub cap: usize,
    /// Reconnects completed within the window (attach, first chunk checked, drop).
    pub reconnects: usize,
    pub reconnects_per_s: f64,
    pub capped: bool,
    /// Attach from an offset → first chunk, per reconnect.
    pub reconnect_ms: Option<Stats>,
    /// Bytes of the stream checked, in order, across all clients.
    pub verified_bytes: u64,
    /// Mean size of the first chunk an attach returned (the backlog it was sent from its
    /// offset, up to one message).
    pub first_chunk_bytes: Option<f64>,
    /// Whole streams read end to end in pieces.
    pub full_passes: usize,
    /// Chunks at the wrong offset, with the wrong bytes or past the end, and gaps: bytes
    /// lost or repeated. Must be 0.
    pub mismatches: usize,
    pub errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Setup: sandboxes made, processes started and their streams printed.
    pub setup_s: f64,
}

/// The bytes `seq 1 last` prints.
fn expected_stream(last: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 1..=last {
        out.extend_from_slice(i.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

/// A small xorshift: where each client cuts its chunks (no need for a crate's quality).
struct Cuts(u64);

impl Cuts {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// 1..=n.
    fn upto(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        1 + (self.0 % n as u64) as usize
    }
}

/// What one attach returned first.
enum First {
    Data(u64, Vec<u8>),
    Gap(u64, u64),
    Other(String),
}

/// Attaches to `pid`'s output from `offset` (following, as `space attach` does) and
/// returns its first chunk; the connection is dropped on return.
async fn attach_once(s: &Session, id: &str, pid: u32, offset: u64) -> Result<First> {
    let mut events = s.c.process_output(id, pid, offset, true).await?;
    loop {
        let ev = tokio::time::timeout(ATTACH_LIMIT, events.next())
            .await
            .context("no output within 10 s")?
            .context("the output stream ended without output")??;
        return Ok(match ev {
            ExecEvent::Stdout { offset, data } | ExecEvent::Pty { offset, data } => {
                First::Data(offset, data)
            }
            ExecEvent::Gap { from, to } => First::Gap(from, to),
            ExecEvent::Started { .. } => continue,
            other => First::Other(format!("{other:?}")),
        });
    }
}

#[derive(Default)]
struct Samples {
    latency: Vec<f64>,
    chunk_bytes: u64,
    done_at: Vec<Duration>,
    verified: u64,
    passes: usize,
    mismatches: usize,
    errors: Vec<String>,
}

impl Samples {
    fn extend(&mut self, o: Samples) {
        self.latency.extend(o.latency);
        self.chunk_bytes += o.chunk_bytes;
        self.done_at.extend(o.done_at);
        self.verified += o.verified;
        self.passes += o.passes;
        self.mismatches += o.mismatches;
        self.errors.extend(o.errors);
    }
}

struct Run {
    t0: Instant,
    deadline: Instant,
    cap: usize,
    started: AtomicUsize,
    stream: Vec<u8>,
}

/// One client's loop on one process until the deadline, the cap or too many errors.
async fn client(s: Session, run: Arc<Run>, id: String, pid: u32, seed: u64) -> Samples {
    let mut out = Samples::default();
    let mut cuts = Cuts::new(seed);
    let total = run.stream.len() as u64;
    let mut offset = 0u64;
    while Instant::now() < run.deadline && out.errors.len() < MAX_TASK_ERRORS {
        if run.started.fetch_add(1, Ordering::SeqCst) >= run.cap {
            break;
        }
        let a0 = Instant::now();
        let first = match attach_once(&s, &id, pid, offset).await {
            Ok(f) => f,
            Err(e) => {
                out.errors
                    .push(format!("attach {id}/{pid} at {offset}: {e:#}"));
                continue;
            }
        };
        let latency = ms(a0.elapsed());
        match first {
            First::Data(at, data) => {
                let end = at + data.len() as u64;
                if at != offset || end > total || run.stream[at as usize..end as usize] != data[..]
                {
                    out.mismatches += 1;
                    out.errors.push(format!(
                        "{id}/{pid}: asked for offset {offset}, got {} bytes at {at} that are \
                         not the stream there",
                        data.len()
                    ));
                    continue;
                }
                out.chunk_bytes += data.len() as u64;
                let keep = cuts.upto(data.len());
                offset += keep as u64;
                out.verified += keep as u64;
                if offset == total {
                    out.passes += 1;
                    offset = 0;
                }
                out.latency.push(latency);
                out.done_at.push(run.t0.elapsed());
            }
            First::Gap(from, to) => {
                out.mismatches += 1;
                out.errors
                    .push(format!("{id}/{pid}: bytes {from}..{to} were dropped"));
            }
            First::Other(ev) => out
                .errors
                .push(format!("{id}/{pid}: attach at {offset} began with {ev}")),
        }
    }
    out
}

/// Starts the processes, `per_sandbox` in each sandbox, and waits until each has printed
/// its whole stream.
async fn setup(s: &Session, plan: &Plan, total: u64) -> Result<Vec<(String, u32)>> {
    let ids = s.fill(plan.sandboxes(), "reconnect").await?;
    let script = format!("seq 1 {}; exec sleep 1000000", plan.lines);
    let slots: Vec<String> = ids
        .iter()
        .flat_map(|id| std::iter::repeat_n(id.clone(), plan.per_sandbox))
        .take(plan.clients)
        .collect();
    let mut started = futures::stream::iter(slots)
        .map(|id| {
            let c = s.c.clone();
            let req = ExecRequest::new(["sh", "-c", script.as_str()]);
            async move {
                let pid = c
                    .exec_background(&id, &req)
                    .await
                    .with_context(|| format!("starting a process in {id}"))?;
                anyhow::Ok((id, pid))
            }
        })
        .buffer_unordered(START_CONCURRENCY);
    let mut procs = Vec::with_capacity(plan.clients);
    while let Some(r) = started.next().await {
        procs.push(r?);
    }
    eprintln!(
        "space bench: reconnect: {} processes started; waiting for their output",
        procs.len()
    );
    // Ready when the stream's last byte can be read.
    let t0 = Instant::now();
    let mut waits = futures::stream::iter(procs.clone())
        .map(|(id, pid)| async move {
            loop {
                // 416 (out of range) until the process has printed that far.
                match s.c.process_output(&id, pid, total - 1, false).await {
                    Ok(mut ev) => {
                        if let Some(Ok(ExecEvent::Stdout { .. })) = ev.next().await {
                            return anyhow::Ok(());
                        }
                    }
                    Err(e) if e.status() == Some(416) => {}
                    Err(e) => return Err(e.into()),
                }
                if t0.elapsed() > READY_LIMIT {
                    bail!("process {pid} in {id} did not print its stream within 60 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .buffer_unordered(START_CONCURRENCY);
    while let Some(r) = waits.next().await {
        r?;
    }
    Ok(procs)
}

pub async fn measure(s: &Session, plan: Plan) -> Result<ReconnectScaleReport> {
    let stream = expected_stream(plan.lines);
    let total = stream.len() as u64;
    eprintln!(
        "space bench: reconnect: {} clients on {} processes in {} sandboxes, {:.0} s",
        plan.clients,
        plan.clients,
        plan.sandboxes(),
        plan.duration.as_secs_f64()
    );
    let s0 = Instant::now();
    let procs = setup(s, &plan, total).await?;
    let setup_s = s0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let run = Arc::new(Run {
        t0,
        deadline: t0 + plan.duration,
        cap: plan.cap,
        started: AtomicUsize::new(0),
        stream,
    });
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (id, pid)) in procs.into_iter().enumerate() {
        tasks.spawn(client(s.clone(), run.clone(), id, pid, i as u64 + 1));
    }
    let mut all = Samples::default();
    while let Some(r) = tasks.join_next().await {
        all.extend(r?);
    }
    let (capped, window) = rate_window(
        run.started.load(Ordering::SeqCst),
        plan.cap,
        t0.elapsed(),
        plan.duration,
    );
    let reconnects = all.done_at.iter().filter(|d| **d <= window).count();
    Ok(ReconnectScaleReport {
        clients: plan.clients,
        sandboxes: plan.sandboxes(),
        stream_bytes: total,
        duration_s: plan.duration.as_secs_f64(),
        cap: plan.cap,
        reconnects,
        reconnects_per_s: reconnects as f64 / window.as_secs_f64().max(1e-3),
        capped,
        reconnect_ms: stats(&all.latency),
        first_chunk_bytes: (!all.latency.is_empty())
            .then(|| all.chunk_bytes as f64 / all.latency.len() as f64),
        verified_bytes: all.verified,
        full_passes: all.passes,
        mismatches: all.mismatches,
        errors: all.errors.len(),
        first_error: all.errors.into_iter().next(),
        setup_s,
    })
}

pub fn targets(r: &ReconnectScaleReport) -> Vec<Target> {
    vec![
        Target::at_least(
            &format!("reconnects/s ({} clients)", r.clients),
            Some(r.reconnects_per_s),
            5000.0,
            "/s",
        ),
        Target::at_most(
            "bytes lost or repeated (mismatches)",
            Some(r.mismatches as f64),
            0.0,
            "",
        ),
    ]
}

pub fn print(r: &ReconnectScaleReport) {
    section(&format!(
        "reconnect at scale: {} clients, each on its own process ({} sandboxes), dropping and \
         reattaching from its offset for {:.0} s",
        r.clients, r.sandboxes, r.duration_s
    ));
    rate_row(
        "reconnects / per second",
        r.reconnects,
        r.reconnects_per_s,
        r.capped.then_some(r.cap),
    );
    stats_header("ms");
    stats_row(
        "attach at offset -> first chunk",
        r.reconnect_ms.as_ref(),
        1.0,
    );
    value_row(
        "stream per process / mean first chunk",
        format!(
            "{} B / {:.0} B",
            r.stream_bytes,
            r.first_chunk_bytes.unwrap_or(0.0)
        ),
    );
    value_row(
        "stream bytes checked in order",
        format!("{} ({} whole streams)", r.verified_bytes, r.full_passes),
    );
    value_row("chunks lost, repeated or wrong", r.mismatches);
    value_row(
        "setup (sandboxes, processes, output)",
        format!("{:.1} s", r.setup_s),
    );
    if r.errors > 0 {
        println!(
            "  note: {} reconnects failed, first: {}",
            r.errors,
            r.first_error.as_deref().unwrap_or("")
        );
    }
    print_targets(&targets(r));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_what_seq_prints() {
        let s = expected_stream(10_000);
        assert_eq!(s.len(), 48_894);
        assert_eq!(expected_stream(1000).len(), 3893);
        assert!(s.starts_with(b"1\n2\n3\n"));
        assert!(s.ends_with(b"9999\n10000\n"));
    }

    #[test]
    fn cuts_stay_within_the_chunk_and_vary() {
        let mut c = Cuts::new(7);
        let picks: Vec<usize> = (0..1000).map(|_| c.upto(10)).collect();
        assert!(picks.iter().all(|p| (1..=10).contains(p)));
        assert!(picks.contains(&1) && picks.contains(&10));
        assert_eq!(Cuts::new(3).upto(1), 1);
    }
}
