//! What a disk limit costs (decision 0043), limited and unlimited sandboxes in the same run,
//! alternated so that noise falls on both alike:
//! - create -> ready on the miss path (the pool is set to 0 first): a limited create also
//!   makes its quota group and puts the rootfs in it;
//! - a write of `--mib` MiB in the sandbox (`dd ... conv=fsync`, then `rm`), timed around the
//!   exec, in MB/s;
//! - a disk snapshot (a limited one also joins the group).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use space_api::{CreateSandbox, ExecRequest};

use super::report::{section, stats_header, stats_row, value_row};
use super::session::Session;
use super::stats::{Stats, mb_per_s, ms, ratio, stats};

/// The limit the limited sandboxes get: room for the writes, so none is refused.
fn limit_mib(write_mib: u64) -> u64 {
    (write_mib * 4).max(256)
}

#[derive(Debug, Clone, Serialize)]
pub struct Pair {
    pub unlimited: Option<Stats>,
    pub limited: Option<Stats>,
    /// limited p50 / unlimited p50.
    pub p50_ratio: Option<f64>,
}

fn pair(unlimited: &[f64], limited: &[f64]) -> Pair {
    let (u, l) = (stats(unlimited), stats(limited));
    Pair {
        p50_ratio: ratio(l.map(|s| s.p50), u.map(|s| s.p50)),
        unlimited: u,
        limited: l,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DiskReport {
    pub runs: usize,
    pub write_mib: u64,
    pub limit_mib: u64,
    pub create_ready_ms: Pair,
    pub write_mb_per_s: Pair,
    pub snapshot_ms: Pair,
    /// What the limited sandbox's status said it is charged, after the runs.
    pub limited_disk_bytes: Option<u64>,
}

pub async fn measure(s: &Session, runs: usize, write_mib: u64) -> Result<DiskReport> {
    let limit = limit_mib(write_mib);
    if let Err(e) = s.set_pool(0, 0).await {
        eprintln!("space bench: pool not turned off ({e:#}): creates may be pool hits");
    }
    let create = |disk: Option<u64>| async move {
        let t0 = Instant::now();
        let sb =
            s.c.create_sandbox(&CreateSandbox {
                template: Some(s.template.clone()),
                disk_mib: disk,
                ..Default::default()
            })
            .await
            .context(match disk {
                Some(_) => "a create with a disk limit (does spaced have --disk-quotas on?)",
                None => "a create",
            })?;
        s.track(&sb.id);
        s.exec_true(&sb.id).await?;
        anyhow::Ok((ms(t0.elapsed()), sb.id))
    };
    let (mut cu, mut cl) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for i in 0..runs {
        for disk in [None, Some(limit)] {
            let (t, id) = create(disk).await.with_context(|| format!("create #{i}"))?;
            if disk.is_some() { &mut cl } else { &mut cu }.push(t);
            s.c.delete_sandbox(&id).await?;
            s.untrack(&id);
        }
    }
    let (_, free) = create(None).await?;
    let (_, held) = create(Some(limit)).await?;
    let script = format!(
        "dd if=/dev/zero of=/var/tmp/space-bench-disk bs=1M count={write_mib} conv=fsync \
         2>/dev/null && rm /var/tmp/space-bench-disk"
    );
    let (mut wu, mut wl) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    let (mut su, mut sl) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for _ in 0..runs {
        for (id, w, sn) in [(&free, &mut wu, &mut su), (&held, &mut wl, &mut sl)] {
            let t0 = Instant::now();
            let out =
                s.c.exec_output(id, &ExecRequest::new(["sh", "-c", &script]))
                    .await?;
            let took = t0.elapsed();
            if out.status() != 0 {
                bail!(
                    "the write in sandbox {id} exited {}: {}",
                    out.status(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            w.push(mb_per_s(write_mib << 20, took));
            let t0 = Instant::now();
            s.c.create_snapshot(id, None).await?;
            sn.push(ms(t0.elapsed()));
        }
    }
    let limited_disk_bytes = s.c.get_sandbox(&held).await?.disk_bytes;
    Ok(DiskReport {
        runs,
        write_mib,
        limit_mib: limit,
        create_ready_ms: pair(&cu, &cl),
        write_mb_per_s: pair(&wu, &wl),
        snapshot_ms: pair(&su, &sl),
        limited_disk_bytes,
    })
}

pub fn print(r: &DiskReport) {
    section(&format!(
        "disk limits: {} runs each, {} MiB writes, limit {} MiB",
        r.runs, r.write_mib, r.limit_mib
    ));
    stats_header("ms; writes: MB/s (dd conv=fsync)");
    for (name, p) in [
        ("create -> ready", &r.create_ready_ms),
        ("write MB/s", &r.write_mb_per_s),
        ("snapshot (disk)", &r.snapshot_ms),
    ] {
        stats_row(&format!("{name}, no limit"), p.unlimited.as_ref(), 1.0);
        stats_row(&format!("{name}, limited"), p.limited.as_ref(), 1.0);
        value_row(
            &format!("{name}, p50 limited/none"),
            p.p50_ratio.map_or("n/a".into(), |v| format!("{v:.3}")),
        );
    }
    value_row(
        "limited sandbox charged",
        r.limited_disk_bytes
            .map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_leaves_room_for_the_writes() {
        assert_eq!(limit_mib(16), 256);
        assert_eq!(limit_mib(512), 2048);
        let p = pair(&[10.0, 10.0], &[12.0, 12.0]);
        assert_eq!(p.p50_ratio, Some(1.2));
        assert!(pair(&[], &[1.0]).p50_ratio.is_none());
    }
}
