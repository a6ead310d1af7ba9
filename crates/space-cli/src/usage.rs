//! `space metrics ID [--since TIME] [--json]`: a sandbox's recent CPU, memory and disk use,
//! one line per sample (decision 0024).

use anyhow::Result;
use clap::Args;
use space_api::{Client, MetricsQuery, SandboxMetrics};

#[derive(Debug, Args)]
pub struct MetricsArgs {
    id: String,
    /// Only samples at or after this RFC 3339 time (2026-01-02T03:04:05Z).
    #[arg(long)]
    since: Option<String>,
    #[arg(long)]
    json: bool,
}

pub async fn run(c: Client, a: MetricsArgs) -> Result<i32> {
    let q = MetricsQuery {
        since: a.since,
        until: None,
    };
    let m = c.sandbox_metrics(&a.id, &q).await?;
    if a.json {
        crate::print_json(&m)?;
    } else {
        print!("{}", render(&m));
    }
    Ok(0)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1024.0 * 1024.0))
}

fn render(m: &SandboxMetrics) -> String {
    let disk = match (m.disk_used_bytes, m.disk_total_bytes) {
        (Some(u), Some(t)) => format!("{} of {} MiB", mib(u), mib(t)),
        _ => "unknown (paused or stopped)".to_owned(),
    };
    let mut out = format!(
        "cpu limit {} cores, memory limit {} MiB, disk {disk}\n{:<24}  {:>6}  {:>9}  {:>9}\n",
        m.cpu,
        mib(m.memory_limit_bytes),
        "TIME",
        "CPU%",
        "MEM_MIB",
        "CACHE_MIB"
    );
    for s in &m.samples {
        out.push_str(&format!(
            "{:<24}  {:>6.1}  {:>9}  {:>9}\n",
            s.time,
            s.cpu_pct,
            mib(s.memory_bytes),
            mib(s.memory_cache_bytes)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_api::MetricSample;

    #[test]
    fn renders_limits_disk_and_one_line_per_sample() {
        let mut m = SandboxMetrics {
            cpu: 1.0,
            memory_limit_bytes: 512 << 20,
            disk_total_bytes: Some(1 << 30),
            disk_used_bytes: Some(3 << 19),
            samples: vec![MetricSample {
                time: "2026-12-01T10:00:00.000Z".into(),
                cpu_pct: 12.345,
                memory_bytes: 5 << 20,
                memory_cache_bytes: 1 << 20,
            }],
        };
        let out = render(&m);
        assert!(
            out.starts_with("cpu limit 1 cores, memory limit 512.0 MiB, disk 1.5 of 1024.0 MiB\n"),
            "{out}"
        );
        assert!(
            out.contains("2026-12-01T10:00:00.000Z    12.3        5.0        1.0\n"),
            "{out}"
        );
        m.disk_used_bytes = None;
        assert!(render(&m).contains("disk unknown (paused or stopped)"));
    }
}
