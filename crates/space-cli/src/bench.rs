//! `space bench create`: create -> ready latency (create, then the first exec of `true`
//! completes), exec round trip of `true`, idle memory per sandbox; optionally the same
//! workload under runc and bwrap for comparison. Deletes what it created.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use space_api::{Client, CreateSandbox, ExecRequest};

pub const MAX_N: usize = 1000;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Number of sandboxes (at most 1000).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub n: usize,
    /// Exec round trips measured on one sandbox.
    #[arg(long, default_value_t = 200)]
    pub exec_runs: usize,
    #[arg(long, default_value = "base")]
    pub template: String,
    /// Also time runc and bwrap running `true` from the template's rootfs.
    #[arg(long)]
    pub peers: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Stats {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub count: usize,
}

/// Nearest-rank percentiles.
pub fn stats(samples: &[f64]) -> Option<Stats> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let pick = |p: f64| {
        let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
        s[rank.clamp(1, s.len()) - 1]
    };
    Some(Stats {
        p50: pick(50.0),
        p90: pick(90.0),
        p99: pick(99.0),
        max: s[s.len() - 1],
        count: s.len(),
    })
}

#[derive(Debug, Serialize)]
struct Peer {
    name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_ms: Option<Stats>,
    /// space create->ready p50 / peer p50.
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    n: usize,
    template: String,
    create_ready_ms: Option<Stats>,
    exec_rtt_ms: Option<Stats>,
    idle_memory_bytes: Option<Stats>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    peers: Vec<Peer>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub async fn run(c: Client, a: BenchArgs) -> Result<i32> {
    if a.n == 0 || a.n > MAX_N {
        bail!("-n must be between 1 and {MAX_N} (the limit), got {}", a.n);
    }
    let mut created: Vec<String> = Vec::with_capacity(a.n);
    let result = measure(&c, &a, &mut created).await;
    // Always clean up, even after a failure.
    for id in &created {
        if let Err(e) = c.delete_sandbox(id).await {
            eprintln!("space: cannot delete {id}: {e}");
        }
    }
    let mut report = result?;
    if a.peers {
        report.peers = peers(&c, &a, report.create_ready_ms.map(|s| s.p50)).await;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(0)
}

async fn measure(c: &Client, a: &BenchArgs, created: &mut Vec<String>) -> Result<Report> {
    let truecmd = ExecRequest::new(["true"]);
    let mut ready = Vec::with_capacity(a.n);
    for i in 0..a.n {
        let t0 = Instant::now();
        let sb = c
            .create_sandbox(&CreateSandbox {
                template: Some(a.template.clone()),
                ..Default::default()
            })
            .await
            .with_context(|| format!("create #{i}"))?;
        created.push(sb.id.clone());
        let out = c.exec_output(&sb.id, &truecmd).await?;
        ready.push(ms(t0.elapsed()));
        if out.status() != 0 {
            bail!("`true` exited with {} in sandbox {}", out.status(), sb.id);
        }
    }
    let mut rtt = Vec::with_capacity(a.exec_runs);
    if let Some(first) = created.first() {
        for _ in 0..a.exec_runs {
            let t0 = Instant::now();
            c.exec_output(first, &truecmd).await?;
            rtt.push(ms(t0.elapsed()));
        }
    }
    // Let the sandboxes settle, then read their memory cgroups.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mem: Vec<f64> = c
        .list_sandboxes()
        .await?
        .into_iter()
        .filter(|s| created.contains(&s.id))
        .filter_map(|s| s.memory_bytes.map(|b| b as f64))
        .collect();
    Ok(Report {
        n: a.n,
        template: a.template.clone(),
        create_ready_ms: stats(&ready),
        exec_rtt_ms: stats(&rtt),
        idle_memory_bytes: stats(&mem),
        peers: Vec::new(),
    })
}

fn find_binary(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

async fn template_rootfs(c: &Client, name: &str) -> Result<PathBuf> {
    let t = c
        .list_templates()
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

async fn peers(c: &Client, a: &BenchArgs, space_p50: Option<f64>) -> Vec<Peer> {
    let rootfs = match template_rootfs(c, &a.template).await {
        Ok(p) if p.is_dir() => p,
        Ok(p) => {
            let why = format!("template rootfs {} is not on this host", p.display());
            return vec![skipped("runc", &why), skipped("bwrap", &why)];
        }
        Err(e) => {
            let why = format!("{e:#}");
            return vec![skipped("runc", &why), skipped("bwrap", &why)];
        }
    };
    let n = a.n;
    let root = rootfs.clone();
    let runc = tokio::task::spawn_blocking(move || time_runc(&root, n))
        .await
        .unwrap_or_else(|e| Err(anyhow::anyhow!("{e}")));
    let bwrap = tokio::task::spawn_blocking(move || time_bwrap(&rootfs, n))
        .await
        .unwrap_or_else(|e| Err(anyhow::anyhow!("{e}")));
    [("runc", runc), ("bwrap", bwrap)]
        .into_iter()
        .map(|(name, r)| match r {
            Ok(samples) => {
                let st = stats(&samples);
                Peer {
                    name,
                    ratio: match (space_p50, st) {
                        (Some(s), Some(p)) if p.p50 > 0.0 => Some(s / p.p50),
                        _ => None,
                    },
                    run_ms: st,
                    skipped: None,
                }
            }
            Err(e) => skipped(name, &format!("{e:#}")),
        })
        .collect()
}

fn skipped(name: &'static str, why: &str) -> Peer {
    Peer {
        name,
        run_ms: None,
        ratio: None,
        skipped: Some(why.to_string()),
    }
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

fn print_table(r: &Report) {
    println!(
        "space bench create: {} sandboxes, template {}",
        r.n, r.template
    );
    println!(
        "{:<26} {:>10} {:>10} {:>10} {:>10}",
        "metric", "p50", "p90", "p99", "max"
    );
    let row = |name: &str, s: Option<Stats>, scale: f64| match s {
        Some(s) => println!(
            "{:<26} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            name,
            s.p50 / scale,
            s.p90 / scale,
            s.p99 / scale,
            s.max / scale
        ),
        None => println!("{name:<26} {:>10}", "n/a"),
    };
    row("create->ready (ms)", r.create_ready_ms, 1.0);
    row("exec round trip (ms)", r.exec_rtt_ms, 1.0);
    row("idle memory (MiB)", r.idle_memory_bytes, 1024.0 * 1024.0);
    for p in &r.peers {
        match (&p.run_ms, &p.skipped) {
            (Some(s), _) => {
                row(&format!("{} run true (ms)", p.name), Some(*s), 1.0);
                if let Some(ratio) = p.ratio {
                    println!("  space p50 / {} p50 = {ratio:.2}", p.name);
                }
            }
            (None, Some(why)) => println!("{:<26} skipped: {why}", p.name),
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let s = stats(&(1..=100).map(f64::from).collect::<Vec<_>>()).unwrap();
        assert_eq!((s.p50, s.p90, s.p99, s.max), (50.0, 90.0, 99.0, 100.0));
        let s = stats(&[3.0]).unwrap();
        assert_eq!((s.p50, s.p99, s.max), (3.0, 3.0, 3.0));
        assert!(stats(&[]).is_none());
    }

    #[tokio::test]
    async fn refuses_more_than_the_limit() {
        let c = Client::new("http://127.0.0.1:1", "k").unwrap();
        let a = BenchArgs {
            n: 1001,
            exec_runs: 1,
            template: "base".into(),
            peers: false,
            json: false,
        };
        let e = run(c, a).await.unwrap_err();
        assert!(e.to_string().contains("1000"), "{e}");
    }
}
