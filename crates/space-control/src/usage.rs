//! `GET /v1/sandboxes/{id}/metrics` (decision 0024): the node's cgroup samples of a sandbox
//! turned into CPU percentages and memory figures. E2B's `GET /sandboxes/{id}/metrics`
//! serves the same figures in its own shape (`e2b/control.rs`).

use space_api::{MetricSample, SandboxMetrics, rfc3339_from_unix_ms};
use space_node_api::{SandboxUsage, UsageSample};

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};

impl Engine {
    /// The samples taken in `[since_ms, until_ms]`. 404 for an unknown sandbox.
    pub async fn sandbox_metrics(
        &self,
        id: &str,
        since_ms: Option<i64>,
        until_ms: Option<i64>,
    ) -> ControlResult<SandboxMetrics> {
        let row = match self.store.get_sandbox(id).await? {
            Some(r) if r.deleted_at.is_none() => r,
            _ => return Err(ControlError::not_found(format!("sandbox {id} not found"))),
        };
        let usage = self.node.sandbox_usage(id).await?;
        let mut m = metrics_of(&usage, row.spec.cpu, row.created_at, since_ms, until_ms);
        m.memory_limit_bytes = row.spec.memory_mib << 20;
        Ok(m)
    }
}

/// CPU use between consecutive samples, in percent of `cpu` cores (clamped to 0..=100), for
/// the samples taken in `[since_ms, until_ms]`. The first sample has no predecessor and is
/// left out, unless it is the only one: then it is measured from the sandbox's creation.
pub fn metrics_of(
    usage: &SandboxUsage,
    cpu: f64,
    created_ms: i64,
    since_ms: Option<i64>,
    until_ms: Option<i64>,
) -> SandboxMetrics {
    let pct = |prev: (u64, u64), s: &UsageSample| {
        let wall_us = s.unix_ms.saturating_sub(prev.0).saturating_mul(1000);
        let used = s.cpu_usage_usec.saturating_sub(prev.1);
        if wall_us == 0 || cpu <= 0.0 {
            return 0.0;
        }
        let p = used as f64 / wall_us as f64 / cpu * 100.0;
        (p.clamp(0.0, 100.0) * 100.0).round() / 100.0
    };
    let sample = |s: &UsageSample, cpu_pct| MetricSample {
        time: rfc3339_from_unix_ms(s.unix_ms as i64),
        cpu_pct,
        memory_bytes: s.memory_bytes.saturating_sub(s.memory_cache_bytes),
        memory_cache_bytes: s.memory_cache_bytes,
    };
    let within = |s: &UsageSample| {
        let t = s.unix_ms as i64;
        since_ms.is_none_or(|a| t >= a) && until_ms.is_none_or(|b| t <= b)
    };
    let samples = match usage.samples.as_slice() {
        [] => Vec::new(),
        [only] => std::iter::once(only)
            .filter(|s| within(s))
            .map(|s| sample(s, pct((created_ms.max(0) as u64, 0), s)))
            .collect(),
        all => all
            .windows(2)
            .filter(|w| within(&w[1]))
            .map(|w| sample(&w[1], pct((w[0].unix_ms, w[0].cpu_usage_usec), &w[1])))
            .collect(),
    };
    SandboxMetrics {
        cpu,
        memory_limit_bytes: 0,
        disk_total_bytes: usage.disk_total_bytes,
        disk_used_bytes: usage.disk_used_bytes,
        samples,
    }
}

/// A query bound: RFC 3339, or 400 naming the field.
pub(crate) fn bound(name: &str, v: Option<&str>) -> ControlResult<Option<i64>> {
    v.map(|s| {
        space_api::unix_ms_from_rfc3339(s).ok_or_else(|| {
            ControlError::invalid(format!(
                "{name} must be an RFC 3339 UTC time such as 2026-01-02T03:04:05Z, got {s:?}"
            ))
        })
    })
    .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(unix_ms: u64, cpu_usage_usec: u64) -> UsageSample {
        UsageSample {
            unix_ms,
            cpu_usage_usec,
            memory_bytes: 10 << 20,
            memory_cache_bytes: 4 << 20,
        }
    }

    #[test]
    fn cpu_percent_is_per_interval_and_of_the_limit() {
        let usage = SandboxUsage {
            // 5 s apart: 2.5 s of CPU, then none, then a counter that went back (restart).
            samples: vec![
                s(10_000, 1_000_000),
                s(15_000, 3_500_000),
                s(20_000, 3_500_000),
                s(25_000, 100),
            ],
            disk_total_bytes: Some(100),
            disk_used_bytes: Some(7),
        };
        let m = metrics_of(&usage, 0.5, 0, None, None);
        let pcts: Vec<f64> = m.samples.iter().map(|x| x.cpu_pct).collect();
        assert_eq!(pcts, vec![100.0, 0.0, 0.0]);
        let m = metrics_of(&usage, 2.0, 0, None, None);
        assert_eq!(m.samples[0].cpu_pct, 25.0);
        assert_eq!(m.samples[0].time, "1970-01-01T00:00:15.000Z");
        assert_eq!(m.samples[0].memory_bytes, 6 << 20);
        assert_eq!(m.samples[0].memory_cache_bytes, 4 << 20);
        assert_eq!(
            (m.disk_total_bytes, m.disk_used_bytes),
            (Some(100), Some(7))
        );
    }

    #[test]
    fn a_single_sample_is_measured_from_creation_and_none_gives_none() {
        let one = SandboxUsage {
            samples: vec![s(2_000, 500_000)],
            ..Default::default()
        };
        assert_eq!(
            metrics_of(&one, 1.0, 1_000, None, None).samples[0].cpu_pct,
            50.0
        );
        // A clock that says the sample is older than the sandbox: no division by zero.
        assert_eq!(
            metrics_of(&one, 1.0, 9_000, None, None).samples[0].cpu_pct,
            0.0
        );
        assert!(
            metrics_of(&SandboxUsage::default(), 1.0, 0, None, None)
                .samples
                .is_empty()
        );
    }

    #[test]
    fn bounds_are_rfc3339_or_a_named_400() {
        assert_eq!(bound("since", None).unwrap(), None);
        assert_eq!(
            bound("since", Some("1970-01-01T00:00:01Z")).unwrap(),
            Some(1000)
        );
        let e = bound("until", Some("yesterday")).unwrap_err();
        assert!(e.message.contains("until"), "{}", e.message);
    }
}
