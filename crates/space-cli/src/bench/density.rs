//! Density: N idle sandboxes, then per sandbox its memory cgroup bytes, the RSS and PSS of its
//! processes (its init and every descendant, from /proc/<pid>/smaps_rollup on this host), and
//! the node's MemAvailable before and after divided by N.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::report::{Target, print_targets, section, stats_header, stats_row, value_row};
use super::session::Session;
use super::stats::{MIB, Stats, stats};

const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Serialize)]
pub struct DensityReport {
    pub n: usize,
    pub settle_s: u64,
    /// Seconds to create the N sandboxes ([`Session::fill`]).
    pub fill_s: f64,
    pub memory_cgroup_bytes: Option<Stats>,
    pub rss_bytes: Option<Stats>,
    pub pss_bytes: Option<Stats>,
    /// Why RSS/PSS are missing, when they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proc_skipped: Option<String>,
    pub mem_available_before: u64,
    pub mem_available_after: u64,
    /// (before - after) / N: what each sandbox costs the node.
    pub node_bytes_per_sandbox: f64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The parent pid in a /proc/<pid>/stat line (the comm may hold spaces and parentheses).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// (Rss, Pss) in bytes from /proc/<pid>/smaps_rollup.
pub fn parse_smaps_rollup(text: &str) -> Option<(u64, u64)> {
    let field = |key: &str| {
        text.lines().find_map(|l| {
            let v = l.strip_prefix(key)?.strip_prefix(':')?;
            let kb: u64 = v.split_whitespace().next()?.parse().ok()?;
            Some(kb * 1024)
        })
    };
    Some((field("Rss")?, field("Pss")?))
}

/// `root` and every descendant, from a child list by parent.
pub fn descendants(root: u32, children: &HashMap<u32, Vec<u32>>) -> Vec<u32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        if let Some(kids) = children.get(&out[i]) {
            let new: Vec<u32> = kids.iter().copied().filter(|k| !out.contains(k)).collect();
            out.extend(new);
        }
        i += 1;
    }
    out
}

/// Every process's children, read from /proc.
fn process_tree(proc: &Path) -> HashMap<u32, Vec<u32>> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let Ok(rd) = std::fs::read_dir(proc) else {
        return children;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(ppid) = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .as_deref()
            .and_then(parse_ppid)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    children
}

/// Sum of (Rss, Pss) over the processes; processes that exited meanwhile count 0.
fn memory_of(proc: &Path, pids: &[u32]) -> (u64, u64) {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(proc.join(p.to_string()).join("smaps_rollup")).ok())
        .filter_map(|t| parse_smaps_rollup(&t))
        .fold((0, 0), |(r, p), (r2, p2)| (r + r2, p + p2))
}

pub async fn measure(s: &Session, n: usize) -> Result<DensityReport> {
    let mut notes = Vec::new();
    if let Err(e) = s.set_pool(0, 0).await {
        notes.push(format!("pool not turned off: {e:#}"));
    }
    // Let pool sandboxes being destroyed go first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = super::limits::mem_available()?;
    let t0 = Instant::now();
    let made = s.fill(n, "density").await?;
    let fill_s = t0.elapsed().as_secs_f64();
    tokio::time::sleep(SETTLE).await;
    let sandboxes: Vec<_> =
        s.c.list_sandboxes()
            .await?
            .into_iter()
            .filter(|sb| made.contains(&sb.id))
            .collect();
    let cgroup: Vec<f64> = sandboxes
        .iter()
        .filter_map(|sb| sb.memory_bytes.map(|b| b as f64))
        .collect();
    let proc = Path::new("/proc");
    let mut rss = Vec::new();
    let mut pss = Vec::new();
    let mut proc_skipped = None;
    let tree = process_tree(proc);
    for sb in &sandboxes {
        match sb.init_pid {
            Some(pid) if proc.join(pid.to_string()).exists() => {
                let (r, p) = memory_of(proc, &descendants(pid, &tree));
                rss.push(r as f64);
                pss.push(p as f64);
            }
            Some(pid) => {
                proc_skipped = Some(format!(
                    "/proc/{pid} (init of {}) is not visible here: the CLI does not run on the \
                     sandboxes' node",
                    sb.id
                ));
                break;
            }
            None => {
                proc_skipped = Some(format!("the server reports no init pid for {}", sb.id));
                break;
            }
        }
    }
    if proc_skipped.is_some() {
        rss.clear();
        pss.clear();
    }
    let after = super::limits::mem_available()?;
    Ok(DensityReport {
        n,
        settle_s: SETTLE.as_secs(),
        fill_s,
        memory_cgroup_bytes: stats(&cgroup),
        rss_bytes: stats(&rss),
        pss_bytes: stats(&pss),
        proc_skipped,
        mem_available_before: before,
        mem_available_after: after,
        node_bytes_per_sandbox: (before as f64 - after as f64) / n as f64,
        notes,
    })
}

/// 1,000 idle sandboxes at <= 4 MiB each (judged at the N measured).
pub fn targets(r: &DensityReport) -> Vec<Target> {
    vec![
        Target::at_most(
            &format!("idle memory cgroup mean (N={})", r.n),
            r.memory_cgroup_bytes.map(|s| s.mean / MIB),
            4.0,
            "MiB",
        ),
        node_target(r),
    ]
}

/// MemAvailable moves with everything else on the node: a drop of zero or less says only that
/// N was too small to see, so it is not judged.
fn node_target(r: &DensityReport) -> Target {
    let per = r.node_bytes_per_sandbox / MIB;
    let mut t = Target::at_most(
        &format!("node memory per sandbox (N={})", r.n),
        Some(per),
        4.0,
        "MiB",
    );
    if per <= 0.0 {
        t.met = None;
    }
    t
}

pub fn print(r: &DensityReport) {
    section(&format!(
        "density: {} idle sandboxes (filled in {:.1} s, then {} s idle)",
        r.n, r.fill_s, r.settle_s
    ));
    stats_header("MiB per sandbox");
    stats_row("memory cgroup", r.memory_cgroup_bytes.as_ref(), MIB);
    match &r.proc_skipped {
        None => {
            stats_row("RSS (init + descendants)", r.rss_bytes.as_ref(), MIB);
            stats_row("PSS (init + descendants)", r.pss_bytes.as_ref(), MIB);
        }
        Some(why) => value_row("RSS/PSS", format!("skipped: {why}")),
    }
    value_row(
        "node MemAvailable before -> after",
        format!(
            "{:.0} -> {:.0} MiB: {:.2} MiB per sandbox",
            r.mem_available_before as f64 / MIB,
            r.mem_available_after as f64 / MIB,
            r.node_bytes_per_sandbox / MIB
        ),
    );
    for n in &r.notes {
        println!("  note: {n}");
    }
    print_targets(&targets(r));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        assert_eq!(parse_ppid("42 (sh) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parse_ppid("42 (a b) c) R 9 1 1"), Some(9));
        assert_eq!(parse_ppid("garbage"), None);
        let rollup = "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss:                1536 kB\n\
                      Pss:                 700 kB\nPss_Anon:            300 kB\n";
        assert_eq!(parse_smaps_rollup(rollup), Some((1536 * 1024, 700 * 1024)));
        assert_eq!(parse_smaps_rollup("Rss: 1 kB\n"), None);
    }

    #[test]
    fn node_memory_is_judged_only_when_it_moved() {
        let mut r = DensityReport {
            n: 10,
            settle_s: 2,
            fill_s: 0.1,
            memory_cgroup_bytes: stats(&[MIB, 3.0 * MIB]),
            rss_bytes: None,
            pss_bytes: None,
            proc_skipped: None,
            mem_available_before: 1000 * MIB as u64,
            mem_available_after: 970 * MIB as u64,
            node_bytes_per_sandbox: 3.0 * MIB,
            notes: Vec::new(),
        };
        let t = targets(&r);
        assert_eq!(t[0].value, Some(2.0));
        assert_eq!((t[0].met, t[1].met), (Some(true), Some(true)));
        r.node_bytes_per_sandbox = 5.0 * MIB;
        assert_eq!(targets(&r)[1].met, Some(false));
        r.node_bytes_per_sandbox = -MIB;
        assert_eq!(targets(&r)[1].met, None);
    }

    #[test]
    fn walks_descendants() {
        let mut tree: HashMap<u32, Vec<u32>> = HashMap::new();
        tree.insert(1, vec![10, 11]);
        tree.insert(10, vec![100]);
        tree.insert(2, vec![20]);
        let mut d = descendants(1, &tree);
        d.sort_unstable();
        assert_eq!(d, vec![1, 10, 11, 100]);
        assert_eq!(descendants(5, &tree), vec![5]);
    }

    #[test]
    fn reads_this_process() {
        let proc = Path::new("/proc");
        let me = std::process::id();
        let tree = process_tree(proc);
        let parent = std::fs::read_to_string(format!("/proc/{me}/stat"))
            .ok()
            .as_deref()
            .and_then(parse_ppid)
            .unwrap();
        assert!(tree[&parent].contains(&me));
        let (rss, pss) = memory_of(proc, &[me]);
        assert!(rss > 0 && pss > 0 && pss <= rss, "{rss} {pss}");
    }
}
