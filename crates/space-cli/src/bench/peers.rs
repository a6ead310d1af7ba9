//! Peers on the same rootfs, in the same run: `runc run` and `bwrap --unshare-all` of
//! `/bin/true` from the template's rootfs, and a QEMU microvm boot and restore
//! (`crate::bench_qemu`). Ratios are space's create -> ready p50 over the peer's p50.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::report::{section, stats_header, stats_row};
use super::session::Session;
use super::stats::{Stats, ms, ratio, stats};

#[derive(Debug, Clone, Serialize)]
pub struct Peer {
    pub name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_ms: Option<Stats>,
    /// space create -> ready p50 (pool hit) / peer p50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_hit: Option<f64>,
    /// space create -> ready p50 (pool miss) / peer p50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_miss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeersReport {
    pub runs: usize,
    pub qemu_runs: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<String>,
    pub space_hit_p50_ms: Option<f64>,
    pub space_miss_p50_ms: Option<f64>,
    pub peers: Vec<Peer>,
}

const RUNC: &str = "runc run";
const BWRAP: &str = "bwrap --unshare-all";
const QEMU_BOOT: &str = "qemu microvm boot";
const QEMU_RESTORE: &str = "qemu microvm restore";

/// What to run: `qemu_runs` 0 skips QEMU.
#[derive(Debug, Clone, Copy)]
pub struct PeerPlan {
    pub runs: usize,
    pub qemu_runs: usize,
    pub space_hit_p50: Option<f64>,
    pub space_miss_p50: Option<f64>,
}

fn peer(name: &'static str, r: Result<Vec<f64>>, plan: &PeerPlan) -> Peer {
    match r {
        Ok(samples) => {
            let st = stats(&samples);
            let p50 = st.map(|s| s.p50);
            Peer {
                name,
                run_ms: st,
                ratio_hit: ratio(plan.space_hit_p50, p50),
                ratio_miss: ratio(plan.space_miss_p50, p50),
                skipped: None,
            }
        }
        Err(e) => skipped(name, &format!("{e:#}")),
    }
}

fn skipped(name: &'static str, why: &str) -> Peer {
    Peer {
        name,
        run_ms: None,
        ratio_hit: None,
        ratio_miss: None,
        skipped: Some(why.to_string()),
    }
}

async fn blocking(f: impl FnOnce() -> Result<Vec<f64>> + Send + 'static) -> Result<Vec<f64>> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(anyhow::anyhow!("{e}")))
}

pub async fn measure(s: &Session, plan: PeerPlan) -> PeersReport {
    let mut peers = Vec::new();
    let rootfs = match template_rootfs(s, &s.template).await {
        Ok(p) if p.is_dir() => Ok(p),
        Ok(p) => Err(format!(
            "template rootfs {} is not on this host",
            p.display()
        )),
        Err(e) => Err(format!("{e:#}")),
    };
    match &rootfs {
        Ok(root) => {
            let (n, r) = (plan.runs, root.clone());
            peers.push(peer(RUNC, blocking(move || time_runc(&r, n)).await, &plan));
            let (n, r) = (plan.runs, root.clone());
            peers.push(peer(
                BWRAP,
                blocking(move || time_bwrap(&r, n)).await,
                &plan,
            ));
        }
        Err(why) => {
            peers.push(skipped(RUNC, why));
            peers.push(skipped(BWRAP, why));
        }
    }
    if plan.qemu_runs == 0 {
        peers.push(skipped(QEMU_BOOT, "QEMU peers turned off (--no-qemu)"));
        peers.push(skipped(QEMU_RESTORE, "QEMU peers turned off (--no-qemu)"));
    } else if let Ok(root) = &rootfs {
        let (n, r) = (plan.qemu_runs, root.clone());
        let boot = blocking(move || crate::bench_qemu::qemu_boot(&r, n)).await;
        peers.push(peer(QEMU_BOOT, boot, &plan));
        let (n, r) = (plan.qemu_runs, root.clone());
        let restore = blocking(move || crate::bench_qemu::qemu_restore(&r, n)).await;
        peers.push(peer(QEMU_RESTORE, restore, &plan));
    } else if let Err(why) = &rootfs {
        peers.push(skipped(QEMU_BOOT, why));
        peers.push(skipped(QEMU_RESTORE, why));
    }
    PeersReport {
        runs: plan.runs,
        qemu_runs: plan.qemu_runs,
        rootfs: rootfs.ok().map(|p| p.display().to_string()),
        space_hit_p50_ms: plan.space_hit_p50,
        space_miss_p50_ms: plan.space_miss_p50,
        peers,
    }
}

fn find_binary(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

async fn template_rootfs(s: &Session, name: &str) -> Result<PathBuf> {
    let t =
        s.c.list_templates()
            .await?
            .into_iter()
            .filter(|t| t.name == name)
            .max_by_key(|t| t.version)
            .with_context(|| format!("template {name} not found"))?;
    let path = t
        .path
        .with_context(|| format!("the server does not report the path of template {name}"))?;
    Ok(PathBuf::from(path))
}

fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `runc run` of `/bin/true` on a bundle whose rootfs is a copy of the template's.
fn time_runc(rootfs: &Path, n: usize) -> Result<Vec<f64>> {
    let runc = find_binary("runc").context("runc is not installed")?;
    let bundle = tempfile::tempdir()?;
    let root = bundle.path().join("rootfs");
    run_quiet(Command::new("cp").arg("-a").arg(rootfs).arg(&root))?;
    run_quiet(
        Command::new(&runc)
            .arg("spec")
            .arg("--bundle")
            .arg(bundle.path()),
    )?;
    let cfg_path = bundle.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path)?)?;
    cfg["process"]["args"] = serde_json::json!(["/bin/true"]);
    cfg["process"]["terminal"] = serde_json::json!(false);
    cfg["root"]["path"] = serde_json::json!(root);
    cfg["root"]["readonly"] = serde_json::json!(true);
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg)?)?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("space-bench-{}-{i}", std::process::id());
        let t0 = Instant::now();
        run_quiet(
            Command::new(&runc)
                .arg("run")
                .arg("--bundle")
                .arg(bundle.path())
                .arg(&id),
        )?;
        samples.push(ms(t0.elapsed()));
    }
    Ok(samples)
}

fn time_bwrap(rootfs: &Path, n: usize) -> Result<Vec<f64>> {
    let bwrap = find_binary("bwrap").context("bwrap is not installed")?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        run_quiet(
            Command::new(&bwrap)
                .args(["--unshare-all", "--die-with-parent", "--ro-bind"])
                .arg(rootfs)
                .args(["/", "/bin/true"]),
        )?;
        samples.push(ms(t0.elapsed()));
    }
    Ok(samples)
}

/// The ratio with what it means: "0.092 (10.9x faster)", "1.37 (1.4x slower)".
fn fmt_ratio(v: f64) -> String {
    if v > 0.0 && v < 1.0 {
        format!("{v:.3} ({:.1}x faster)", 1.0 / v)
    } else {
        format!("{v:.2} ({v:.1}x slower)")
    }
}

pub fn print(r: &PeersReport) {
    section(&format!(
        "peers on the same rootfs: {} runs each, QEMU {}",
        r.runs, r.qemu_runs
    ));
    stats_header("ms");
    for p in &r.peers {
        match (&p.run_ms, &p.skipped) {
            (Some(s), _) => {
                stats_row(p.name, Some(s), 1.0);
                let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), fmt_ratio);
                println!(
                    "  space create->ready p50 / {} p50: pool hit {}, pool miss {}",
                    p.name,
                    fmt(p.ratio_hit),
                    fmt(p.ratio_miss)
                );
            }
            (None, Some(why)) => println!("{:<38} skipped: {why}", p.name),
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_space_over_peer() {
        let plan = PeerPlan {
            runs: 3,
            qemu_runs: 0,
            space_hit_p50: Some(4.0),
            space_miss_p50: Some(10.0),
        };
        let p = peer(RUNC, Ok(vec![20.0, 20.0, 30.0]), &plan);
        assert_eq!(p.ratio_hit, Some(0.2));
        assert_eq!(p.ratio_miss, Some(0.5));
        assert!(p.skipped.is_none());
        let p = peer(BWRAP, Err(anyhow::anyhow!("bwrap is not installed")), &plan);
        assert_eq!(p.skipped.as_deref(), Some("bwrap is not installed"));
        assert!(p.run_ms.is_none() && p.ratio_hit.is_none());
        assert_eq!(fmt_ratio(0.5), "0.500 (2.0x faster)");
        assert_eq!(fmt_ratio(0.00125), "0.001 (800.0x faster)");
        assert_eq!(fmt_ratio(1.37), "1.37 (1.4x slower)");
    }
}
