//! `space top [--interval SECS] [--once] [--json]`: the sandboxes with their CPU and memory.
//!
//! CPU % comes from two samples of each sandbox's `cpu_usage_usec` (its cgroup's CPU time):
//! the delta over the wall time between the samples, in percent of one core (so a sandbox
//! using two full cores shows 200). Before a second sample it shows `-`.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use space_api::{Client, Sandbox};

const MAX_INTERVAL_SECS: u64 = 3600;

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Seconds between samples (1 to 3600).
    #[arg(long, value_name = "SECS", default_value_t = 2, value_parser = parse_interval)]
    interval: u64,
    /// Print one table, after one interval, and exit.
    #[arg(long)]
    once: bool,
    /// With --once: print the rows as JSON.
    #[arg(long, requires = "once")]
    json: bool,
}

fn parse_interval(s: &str) -> Result<u64, String> {
    let secs: u64 = s
        .parse()
        .map_err(|_| format!("expected whole seconds, got {s:?}"))?;
    if secs == 0 || secs > MAX_INTERVAL_SECS {
        return Err(format!(
            "the interval must be 1 to {MAX_INTERVAL_SECS} seconds, got {secs}"
        ));
    }
    Ok(secs)
}

/// One line of the table (and one JSON row).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub id: String,
    pub state: String,
    /// Percent of one core over the last interval; None before a second sample.
    pub cpu_percent: Option<f64>,
    pub memory_bytes: Option<u64>,
    /// The sandbox's task limit.
    pub pids: u32,
    pub template: String,
}

/// The sandboxes as listed at one moment.
struct Sample {
    at: Instant,
    sandboxes: Vec<Sandbox>,
}

/// CPU % of one core used between two readings of a cgroup's CPU time taken `elapsed` apart.
/// None when a reading is missing, the counter went back (a restarted sandbox) or no time
/// passed.
pub fn cpu_percent(
    prev_usec: Option<u64>,
    cur_usec: Option<u64>,
    elapsed: Duration,
) -> Option<f64> {
    let delta = cur_usec?.checked_sub(prev_usec?)?;
    let wall = elapsed.as_micros();
    if wall == 0 {
        return None;
    }
    Some(delta as f64 * 100.0 / wall as f64)
}

/// Rows of `cur`, with CPU % against `prev` (None: the first sample), sorted busiest first:
/// by CPU, then memory, then id.
fn rows(prev: Option<&Sample>, cur: &Sample) -> Vec<Row> {
    let before: HashMap<&str, Option<u64>> = prev
        .map(|p| {
            p.sandboxes
                .iter()
                .map(|s| (s.id.as_str(), s.cpu_usage_usec))
                .collect()
        })
        .unwrap_or_default();
    let elapsed = prev.map_or(Duration::ZERO, |p| cur.at.saturating_duration_since(p.at));
    let mut rows: Vec<Row> = cur
        .sandboxes
        .iter()
        .map(|s| Row {
            id: s.id.clone(),
            state: s.state.to_string(),
            cpu_percent: before
                .get(s.id.as_str())
                .and_then(|&p| cpu_percent(p, s.cpu_usage_usec, elapsed)),
            memory_bytes: s.memory_bytes,
            pids: s.pids,
            template: s.template.clone(),
        })
        .collect();
    sort_rows(&mut rows);
    rows
}

fn sort_rows(rows: &mut [Row]) {
    rows.sort_by(|a, b| {
        let cpu = |r: &Row| r.cpu_percent.unwrap_or(-1.0);
        cpu(b)
            .total_cmp(&cpu(a))
            .then(b.memory_bytes.cmp(&a.memory_bytes))
            .then(a.id.cmp(&b.id))
    });
}

/// The table: a header and one line per row.
pub fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<20}  {:<9}  {:>6}  {:>9}  {:>6}  TEMPLATE\n",
        "ID", "STATE", "CPU%", "MEM_MIB", "PIDS"
    );
    for r in rows {
        let cpu = r
            .cpu_percent
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.1}"));
        let mem = r.memory_bytes.map_or_else(
            || "-".to_owned(),
            |b| format!("{:.1}", b as f64 / (1024.0 * 1024.0)),
        );
        let pids = if r.pids == 0 {
            "-".to_owned()
        } else {
            r.pids.to_string()
        };
        out.push_str(&format!(
            "{:<20}  {:<9}  {cpu:>6}  {mem:>9}  {pids:>6}  {}\n",
            r.id, r.state, r.template
        ));
    }
    out
}

async fn sample(c: &Client) -> Result<Sample> {
    let sandboxes = c.list_sandboxes().await?;
    Ok(Sample {
        at: Instant::now(),
        sandboxes,
    })
}

pub async fn run(c: Client, a: TopArgs) -> Result<i32> {
    let interval = Duration::from_secs(a.interval);
    let mut prev = sample(&c).await?;
    if a.once {
        tokio::time::sleep(interval).await;
        let cur = sample(&c).await?;
        let rows = rows(Some(&prev), &cur);
        if a.json {
            crate::print_json(&rows)?;
        } else {
            print!("{}", render(&rows));
        }
        return Ok(0);
    }
    let tty = std::io::stdout().is_terminal();
    show(tty, &rows(None, &prev))?;
    loop {
        tokio::time::sleep(interval).await;
        let cur = sample(&c).await?;
        show(tty, &rows(Some(&prev), &cur))?;
        prev = cur;
    }
}

/// On a terminal: redraw in place (clear the screen, cursor home); elsewhere: append the
/// table, then a blank line.
fn show(tty: bool, rows: &[Row]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if tty {
        write!(out, "\x1b[H\x1b[2J{}", render(rows))?;
    } else {
        writeln!(out, "{}", render(rows))?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, cpu: Option<u64>, mem: Option<u64>) -> Sandbox {
        serde_json::from_value(serde_json::json!({
            "id": id,
            "template": "base",
            "runtime": "namespace",
            "state": "running",
            "created_at": "2026-01-01T00:00:00Z",
            "cpu": 1.0,
            "memory_mib": 512,
            "pids": 256,
            "hostname": id,
            "memory_bytes": mem,
            "cpu_usage_usec": cpu,
        }))
        .unwrap()
    }

    #[test]
    fn cpu_percent_is_the_delta_over_wall_time() {
        let s = Duration::from_secs(2);
        assert_eq!(cpu_percent(Some(1_000_000), Some(2_000_000), s), Some(50.0));
        // Two full cores.
        assert_eq!(cpu_percent(Some(0), Some(4_000_000), s), Some(200.0));
        assert_eq!(cpu_percent(Some(5), Some(5), s), Some(0.0));
        assert_eq!(cpu_percent(None, Some(5), s), None);
        assert_eq!(cpu_percent(Some(5), None, s), None);
        // A counter that went back (the sandbox restarted) gives no number, not a huge one.
        assert_eq!(cpu_percent(Some(10), Some(5), s), None);
        assert_eq!(cpu_percent(Some(1), Some(2), Duration::ZERO), None);
    }

    #[test]
    fn rows_compare_samples_by_id_and_sort_busiest_first() {
        let t0 = Instant::now();
        let prev = Sample {
            at: t0,
            sandboxes: vec![
                sandbox("idle", Some(1_000), Some(3 << 20)),
                sandbox("busy", Some(10_000), Some(1 << 20)),
                sandbox("bigmem", Some(0), Some(9 << 20)),
            ],
        };
        let cur = Sample {
            at: t0 + Duration::from_secs(1),
            sandboxes: vec![
                sandbox("idle", Some(2_000), Some(3 << 20)),
                sandbox("new", Some(50), Some(1 << 20)),
                sandbox("bigmem", Some(1_000), Some(9 << 20)),
                sandbox("busy", Some(910_000), Some(1 << 20)),
            ],
        };
        let r = rows(Some(&prev), &cur);
        let got: Vec<_> = r.iter().map(|r| (r.id.as_str(), r.cpu_percent)).collect();
        assert_eq!(
            got,
            vec![
                ("busy", Some(90.0)),
                ("bigmem", Some(0.1)),
                ("idle", Some(0.1)),
                ("new", None),
            ]
        );
        // First sample: no CPU for anyone, sorted by memory.
        let first: Vec<_> = rows(None, &prev).into_iter().map(|r| r.id).collect();
        assert_eq!(first, vec!["bigmem", "idle", "busy"]);
    }

    #[test]
    fn renders_a_table_with_dashes_for_unknowns() {
        let rows = vec![
            Row {
                id: "sb-busy".into(),
                state: "running".into(),
                cpu_percent: Some(99.44),
                memory_bytes: Some(3 << 19),
                pids: 256,
                template: "base".into(),
            },
            Row {
                id: "sb-stopped".into(),
                state: "stopped".into(),
                cpu_percent: None,
                memory_bytes: None,
                pids: 0,
                template: "py".into(),
            },
        ];
        let t = render(&rows);
        let lines: Vec<_> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            "ID                    STATE        CPU%    MEM_MIB    PIDS  TEMPLATE"
        );
        assert_eq!(
            lines[1],
            "sb-busy               running      99.4        1.5     256  base"
        );
        assert_eq!(
            lines[2],
            "sb-stopped            stopped         -          -       -  py"
        );
    }

    #[test]
    fn refuses_bad_intervals() {
        assert_eq!(parse_interval("1"), Ok(1));
        assert_eq!(parse_interval("3600"), Ok(3600));
        assert!(parse_interval("0").unwrap_err().contains("1 to 3600"));
        assert!(parse_interval("3601").unwrap_err().contains("1 to 3600"));
        assert!(parse_interval("x").is_err());
        assert!(parse_interval("-1").is_err());
    }

    #[test]
    fn parses_the_command_line() {
        use clap::Parser;
        let top = |args: &[&str]| {
            crate::Cli::try_parse_from(["space", "top"].iter().chain(args)).map(|c| match c.cmd {
                crate::Command::Top(a) => (a.interval, a.once, a.json),
                other => panic!("parsed as {other:?}"),
            })
        };
        assert_eq!(top(&[]).unwrap(), (2, false, false));
        assert_eq!(
            top(&["--once", "--json", "--interval", "1"]).unwrap(),
            (1, true, true)
        );
        let err = top(&["--interval", "0"]).unwrap_err().to_string();
        assert!(err.contains("1 to 3600"), "{err}");
        // JSON rows only make sense for one table.
        assert!(top(&["--json"]).is_err());
    }
}
