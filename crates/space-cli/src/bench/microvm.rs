//! The microvm runtime (issue 6): cold boot to first exec, then creates that restore the
//! template's warm checkpoint (the node makes it after the first create), each to its first
//! exec, exec round trips in a restored VM, and forks of that running VM (a memory
//! checkpoint and a restore) to the first exec in the child.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use space_api::{CreateSandbox, ForkRequest, Sandbox};

use super::report::{Target, print_targets, section, stats_header, stats_row, value_row};
use super::session::Session;
use super::stats::{Stats, ms, stats};

/// The most ready VMs `--pool` asks for (each holds a guest's touched RAM).
const MAX_POOL: usize = 20;

/// How long to wait for the node's template checkpoint after the first create.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, Serialize)]
pub struct MicrovmReport {
    pub n: usize,
    pub template: String,
    pub memory_mib: u64,
    /// The first create to its first exec, and whether it booted (no checkpoint yet).
    pub first_ready_ms: f64,
    pub first_booted: bool,
    /// Seconds until a create restored (the node made the checkpoint in the background).
    pub checkpoint_wait_s: f64,
    /// Creates that restored: the create call alone, and create -> first exec.
    pub restore_create_ms: Option<Stats>,
    pub restore_ready_ms: Option<Stats>,
    /// Creates in the timed loop that booted instead (a checkpoint refused, say).
    pub booted: usize,
    /// Exec round trip of `true` in a restored VM.
    pub exec_rtt_ms: Option<Stats>,
    /// Forks of that running VM (no snapshot named: a memory checkpoint, then a restore):
    /// the fork call alone, and fork -> first exec in the child; forks whose child booted
    /// instead of restoring the memory.
    pub fork_call_ms: Option<Stats>,
    pub fork_ready_ms: Option<Stats>,
    pub fork_booted: usize,
    /// With `--pool`: creates served by a microvm pool (default limits), create -> first
    /// exec, and how many were hits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_ready_ms: Option<Stats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_hits: Option<usize>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// Creates a microvm of the template (`memory_mib` None: default limits) and tracks it.
async fn create_vm(s: &Session, memory_mib: Option<u64>) -> Result<Sandbox> {
    let sb =
        s.c.create_sandbox(&CreateSandbox {
            template: Some(s.template.clone()),
            runtime: Some("microvm".into()),
            memory_mib,
            ..Default::default()
        })
        .await?;
    s.track(&sb.id);
    Ok(sb)
}

async fn delete(s: &Session, id: &str) -> Result<()> {
    s.c.delete_sandbox(id)
        .await
        .with_context(|| format!("delete {id}"))?;
    s.untrack(id);
    Ok(())
}

pub async fn measure(s: &Session, n: usize, memory_mib: u64, pool: bool) -> Result<MicrovmReport> {
    let mut notes = Vec::new();
    // 1. The first create: a cold boot unless the node has the checkpoint already.
    let t0 = Instant::now();
    let first = create_vm(s, Some(memory_mib))
        .await
        .context("first microvm create")?;
    s.exec_true(&first.id).await?;
    let first_ready_ms = ms(t0.elapsed());
    let first_booted = !first.restored;
    if !first_booted {
        notes.push("the node had the template checkpoint already: no cold boot measured".into());
    }
    eprintln!(
        "first microvm create -> first exec: {first_ready_ms:.0} ms ({})",
        if first_booted { "booted" } else { "restored" }
    );
    delete(s, &first.id).await?;

    // 2. Wait for the checkpoint: create until one restores (each miss boots: seconds).
    let waited = Instant::now();
    loop {
        let sb = create_vm(s, Some(memory_mib)).await?;
        let restored = sb.restored;
        delete(s, &sb.id).await?;
        if restored {
            break;
        }
        if waited.elapsed() > CHECKPOINT_WAIT {
            bail!(
                "no create restored the template checkpoint within {} s (see the node's log)",
                CHECKPOINT_WAIT.as_secs()
            );
        }
        eprintln!("waiting for the template checkpoint ...");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let checkpoint_wait_s = waited.elapsed().as_secs_f64();

    // 3. n restores, each to its first exec, one at a time.
    let (mut create, mut ready, mut booted) = (Vec::new(), Vec::new(), 0);
    let mut keep = None;
    for i in 0..n {
        let t = Instant::now();
        let sb = create_vm(s, Some(memory_mib))
            .await
            .with_context(|| format!("create #{i}"))?;
        let c = ms(t.elapsed());
        s.exec_true(&sb.id).await?;
        let r = ms(t.elapsed());
        if sb.restored {
            create.push(c);
            ready.push(r);
        } else {
            booted += 1;
        }
        if keep.is_none() && sb.restored {
            keep = Some(sb.id);
        } else {
            delete(s, &sb.id).await?;
        }
    }
    let exec_rtt_ms = match &keep {
        Some(id) => super::exec::round_trips(s, id, 50).await?,
        None => None,
    };
    let (mut fork_call, mut fork_ready, mut fork_booted) = (Vec::new(), Vec::new(), 0);
    if let Some(id) = &keep {
        for i in 0..n {
            let t = Instant::now();
            let children =
                s.c.fork(id, &ForkRequest::default())
                    .await
                    .with_context(|| format!("fork #{i}"))?;
            let c = ms(t.elapsed());
            let child = children
                .into_iter()
                .next()
                .context("a fork made no child")?;
            s.track(&child.id);
            s.exec_true(&child.id).await?;
            let r = ms(t.elapsed());
            if child.restored {
                fork_call.push(c);
                fork_ready.push(r);
            } else {
                fork_booted += 1;
            }
            delete(s, &child.id).await?;
        }
    }
    if let Some(id) = keep {
        delete(s, &id).await?;
    }

    // 4. With a pool: restored VMs kept ready (default limits), handed out on create.
    let (mut pool_ready_ms, mut pool_hits) = (None, None);
    if pool {
        let want = u32::try_from(n.min(MAX_POOL)).context("n too large")?;
        let p = s.set_pool_of(want, want, Some("microvm")).await?;
        if let Some(w) = &p.warning {
            notes.push(format!("the node clamped the pool: {w}"));
        }
        let (now, _) = s
            .wait_pool_ready(p.min.min(want), Duration::from_secs(600))
            .await?;
        let (mut ready, mut hits) = (Vec::new(), 0);
        for i in 0..now.ready.min(want) {
            let t = Instant::now();
            let sb = create_vm(s, None)
                .await
                .with_context(|| format!("pool create #{i}"))?;
            s.exec_true(&sb.id).await?;
            if sb.pooled {
                hits += 1;
                ready.push(ms(t.elapsed()));
            }
        }
        pool_ready_ms = stats(&ready);
        pool_hits = Some(hits);
    }
    Ok(MicrovmReport {
        n,
        template: s.template.clone(),
        memory_mib,
        first_ready_ms,
        first_booted,
        checkpoint_wait_s,
        restore_create_ms: stats(&create),
        restore_ready_ms: stats(&ready),
        booted,
        exec_rtt_ms,
        fork_call_ms: stats(&fork_call),
        fork_ready_ms: stats(&fork_ready),
        fork_booted,
        pool_ready_ms,
        pool_hits,
        notes,
    })
}

pub fn targets(r: &MicrovmReport) -> Vec<Target> {
    let mut t = vec![Target::at_most(
        "create from warm checkpoint -> exec p50",
        r.restore_ready_ms.map(|s| s.p50),
        150.0,
        "ms",
    )];
    t.push(Target::at_most(
        "fork of a running VM -> exec in the child p50",
        r.fork_ready_ms.map(|s| s.p50),
        200.0,
        "ms",
    ));
    if r.pool_hits.is_some() {
        t.push(Target::at_most(
            "pooled (restored) VM create -> exec p50",
            r.pool_ready_ms.map(|s| s.p50),
            150.0,
            "ms",
        ));
    }
    if r.first_booted {
        t.push(Target::at_most(
            "cold boot -> first exec",
            Some(r.first_ready_ms / 1000.0),
            8.0,
            "s",
        ));
    }
    t
}

pub fn print(r: &MicrovmReport) {
    section(&format!(
        "microvm: {} creates from the '{}' template's warm checkpoint, {} MiB guests",
        r.n, r.template, r.memory_mib
    ));
    value_row(
        if r.first_booted {
            "cold boot -> first exec (ms)"
        } else {
            "first create -> first exec (ms, restored)"
        },
        format!("{:.0}", r.first_ready_ms),
    );
    value_row(
        "checkpoint ready after (s)",
        format!("{:.1}", r.checkpoint_wait_s),
    );
    stats_header("ms");
    stats_row("create call (restored)", r.restore_create_ms.as_ref(), 1.0);
    stats_row(
        "create -> first exec (restored)",
        r.restore_ready_ms.as_ref(),
        1.0,
    );
    stats_row("exec round trip (restored VM)", r.exec_rtt_ms.as_ref(), 1.0);
    stats_row("fork call (running VM)", r.fork_call_ms.as_ref(), 1.0);
    stats_row(
        "fork -> first exec in the child",
        r.fork_ready_ms.as_ref(),
        1.0,
    );
    if r.booted > 0 {
        value_row("creates that booted instead", r.booted);
    }
    if r.fork_booted > 0 {
        value_row("forks whose child booted instead", r.fork_booted);
    }
    if let Some(h) = r.pool_hits {
        stats_row(
            "create -> first exec (pool hit)",
            r.pool_ready_ms.as_ref(),
            1.0,
        );
        value_row("pool hits", h);
    }
    for n in &r.notes {
        println!("  note: {n}");
    }
    print_targets(&targets(r));
}
