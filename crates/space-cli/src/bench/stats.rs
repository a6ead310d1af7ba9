//! Percentiles and unit helpers shared by every benchmark.

use std::time::Duration;

use serde::Serialize;

/// Nearest-rank percentiles of a sample set (in the samples' own unit).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Stats {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
    pub count: usize,
}

/// Nearest-rank percentiles; `None` for no samples.
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
        mean: s.iter().sum::<f64>() / s.len() as f64,
        count: s.len(),
    })
}

/// Whether a run of `duration` stopped early at its cap (`started` reached `cap` before
/// `elapsed` reached `duration`), and the window its rate is taken over.
pub fn rate_window(
    started: usize,
    cap: usize,
    elapsed: Duration,
    duration: Duration,
) -> (bool, Duration) {
    let capped = started >= cap && elapsed < duration;
    (capped, if capped { elapsed } else { duration })
}

/// Milliseconds, as a float.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Throughput in MB/s (10^6 bytes per second); 0 for a zero duration.
pub fn mb_per_s(bytes: u64, d: Duration) -> f64 {
    let secs = d.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / 1e6 / secs
}

pub const MIB: f64 = 1024.0 * 1024.0;

/// `a / b` when both are known and `b` is positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let s = stats(&(1..=100).map(f64::from).collect::<Vec<_>>()).unwrap();
        assert_eq!((s.p50, s.p90, s.p99, s.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(s.mean, 50.5);
        assert_eq!(s.count, 100);
        let s = stats(&[3.0]).unwrap();
        assert_eq!((s.p50, s.p99, s.max), (3.0, 3.0, 3.0));
        assert!(stats(&[]).is_none());
        // Order does not matter.
        let s = stats(&[9.0, 1.0, 5.0]).unwrap();
        assert_eq!((s.p50, s.max), (5.0, 9.0));
    }

    #[test]
    fn units() {
        assert_eq!(ms(Duration::from_micros(1500)), 1.5);
        assert_eq!(mb_per_s(64_000_000, Duration::from_secs(2)), 32.0);
        assert_eq!(mb_per_s(1, Duration::ZERO), 0.0);
        assert_eq!(ratio(Some(10.0), Some(4.0)), Some(2.5));
        assert_eq!(ratio(Some(10.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }
}
