//! What `GET /metrics` shows, in the Prometheus text exposition format (version 0.0.4):
//! counters, latency histograms and errors by code, kept here; sandbox counts (from the
//! store) and node series (from [`NodeApi::metrics`](space_node_api::NodeApi::metrics))
//! are added by [`Engine::metrics_text`](crate::Engine::metrics_text).
//!
//! Recording is lock-free (relaxed atomics) except for errors by code, a small map touched
//! only on error responses.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the latency buckets: fine where our budgets are (ms), coarse up
/// to 10 s. `+Inf` is implicit.
pub const BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A latency histogram over [`BUCKETS`]. Each observation lands in exactly one slot (the
/// first bucket that holds it, or the overflow slot); rendering accumulates them, and derives
/// `_count` from the same loads as the `+Inf` bucket, so a scrape racing an observation still
/// shows `_count` equal to `+Inf` and non-decreasing buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    /// `slots[i]`: observations in `(BUCKETS[i-1], BUCKETS[i]]`; the last one is `> 10 s`.
    slots: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(BUCKETS.len());
        self.slots[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observes the time since `start`.
    pub fn since(&self, start: Instant) {
        self.observe(start.elapsed());
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0u64;
        for (i, slot) in self.slots.iter().enumerate() {
            total += slot.load(Ordering::Relaxed);
            match BUCKETS.get(i) {
                Some(le) => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
                }
            }
        }
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {total}");
    }
}

/// Everything the control plane counts for `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub http_requests: AtomicU64,
    /// Error responses (4xx, 5xx) by their [`ErrorCode`](crate::error::ErrorCode); `other`
    /// for an error response that carries none (a proxied upstream's, say).
    http_errors: Mutex<BTreeMap<&'static str, u64>>,
    pub sandboxes_created: AtomicU64,
    pub sandbox_create_errors: AtomicU64,
    pub sandboxes_deleted: AtomicU64,
    pub execs: AtomicU64,
    pub reconcile_runs: AtomicU64,
    pub reconcile_errors: AtomicU64,
    /// `create_sandbox`, entry to the running sandbox's reply (successes only).
    pub create_seconds: Histogram,
    /// `exec`, entry to the process's start: its first event (foreground) or its pid
    /// (background). Not the process's run time (successes only).
    pub exec_seconds: Histogram,
    /// A snapshot's node work and records, API, checkpoint and policy snapshots alike
    /// (successes only; the wait for the sandbox's lock is not in it).
    pub snapshot_seconds: Histogram,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Metrics {
    /// Counts one error response with code `code`.
    pub fn http_error(&self, code: &'static str) {
        let mut m = self.http_errors.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(code).or_default() += 1;
    }

    /// Error responses with code `code` so far.
    pub fn http_errors(&self, code: &str) -> u64 {
        let m = self.http_errors.lock().unwrap_or_else(|e| e.into_inner());
        m.get(code).copied().unwrap_or(0)
    }

    /// The text of everything here, then `sandboxes` (count per state) and `node` series
    /// (names ending in `_total` are counters, the rest gauges).
    pub fn render(&self, sandboxes: &[(String, i64)], node: &[(String, f64)]) -> String {
        let mut out = String::new();
        let counters = [
            (
                "space_http_requests_total",
                "HTTP requests answered.",
                &self.http_requests,
            ),
            (
                "space_sandboxes_created_total",
                "Sandboxes created.",
                &self.sandboxes_created,
            ),
            (
                "space_sandbox_create_errors_total",
                "Sandbox creates that failed on the node.",
                &self.sandbox_create_errors,
            ),
            (
                "space_sandboxes_deleted_total",
                "Sandboxes deleted through the API.",
                &self.sandboxes_deleted,
            ),
            ("space_execs_total", "Execs started.", &self.execs),
            (
                "space_reconcile_runs_total",
                "Reconciler passes.",
                &self.reconcile_runs,
            ),
            (
                "space_reconcile_errors_total",
                "Reconcile steps that failed.",
                &self.reconcile_errors,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP space_http_errors_total HTTP error responses by error code.\n\
             # TYPE space_http_errors_total counter"
        );
        {
            let m = self.http_errors.lock().unwrap_or_else(|e| e.into_inner());
            for (code, n) in m.iter() {
                let _ = writeln!(out, "space_http_errors_total{{code=\"{code}\"}} {n}");
            }
        }
        self.create_seconds.render(
            &mut out,
            "space_sandbox_create_seconds",
            "Sandbox create latency, request to running sandbox.",
        );
        self.exec_seconds.render(
            &mut out,
            "space_exec_seconds",
            "Exec latency, request to the process's start (first event or pid).",
        );
        self.snapshot_seconds.render(
            &mut out,
            "space_snapshot_seconds",
            "Snapshot latency (node snapshot and its records).",
        );
        let _ = writeln!(
            out,
            "# HELP space_sandboxes Sandboxes by state.\n# TYPE space_sandboxes gauge"
        );
        for (state, n) in sandboxes {
            let _ = writeln!(out, "space_sandboxes{{state=\"{state}\"}} {n}");
        }
        let mut typed = std::collections::BTreeSet::new();
        for (series, v) in node {
            let family = series.split('{').next().unwrap_or(series);
            if typed.insert(family.to_string()) {
                let kind = if family.ends_with("_total") {
                    "counter"
                } else {
                    "gauge"
                };
                let _ = writeln!(out, "# TYPE {family} {kind}");
            }
            let _ = writeln!(out, "{series} {v}");
        }
        render_process(&mut out, &ProcessStats::read());
        out
    }
}

/// What `/proc/self` says of this process, for the standard `process_*` series (the names
/// the Prometheus client libraries use), so that `space bench scale` and any scraper can
/// follow spaced's own memory and CPU as a node fills. Fields it could not read are None.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProcessStats {
    pub resident_bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    pub threads: Option<u64>,
    pub open_fds: Option<u64>,
    /// The soft limit on open files: a node holds several per sandbox (docs/BENCHMARKS.md).
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    pub fn read() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        Self {
            max_fds: soft_open_files(&limits),
            ..Self::parse(&status, &stat, fds)
        }
    }

    /// From the text of `/proc/self/status` and `/proc/self/stat`. CPU time is utime + stime
    /// in clock ticks, which Linux reports in USER_HZ: 100 on every architecture it runs on.
    pub fn parse(status: &str, stat: &str, open_fds: Option<u64>) -> Self {
        let field = |key: &str| {
            status.lines().find_map(|l| {
                let v = l.strip_prefix(key)?.strip_prefix(':')?;
                v.split_whitespace().next()?.parse::<u64>().ok()
            })
        };
        // After the comm's closing parenthesis: state is field 3, utime 14, stime 15.
        let cpu = stat.rfind(')').and_then(|i| {
            let rest: Vec<&str> = stat[i + 1..].split_whitespace().collect();
            let ticks = |n: usize| rest.get(n - 3)?.parse::<u64>().ok();
            Some((ticks(14)? + ticks(15)?) as f64 / 100.0)
        });
        Self {
            resident_bytes: field("VmRSS").map(|kb| kb * 1024),
            cpu_seconds: cpu,
            threads: field("Threads"),
            open_fds,
            max_fds: None,
        }
    }
}

/// The soft limit of `Max open files` in the text of `/proc/self/limits`.
fn soft_open_files(limits: &str) -> Option<u64> {
    let l = limits.lines().find(|l| l.starts_with("Max open files"))?;
    l["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn render_process(out: &mut String, p: &ProcessStats) {
    let series = [
        (
            "process_resident_memory_bytes",
            "Resident memory of this spaced process in bytes.",
            "gauge",
            p.resident_bytes.map(|v| v as f64),
        ),
        (
            "process_cpu_seconds_total",
            "User and system CPU time of this spaced process in seconds.",
            "counter",
            p.cpu_seconds,
        ),
        (
            "process_threads",
            "Threads of this spaced process.",
            "gauge",
            p.threads.map(|v| v as f64),
        ),
        (
            "process_open_fds",
            "Open file descriptors of this spaced process.",
            "gauge",
            p.open_fds.map(|v| v as f64),
        ),
        (
            "process_max_fds",
            "The open-files limit (soft) of this spaced process.",
            "gauge",
            p.max_fds.map(|v| v as f64),
        ),
    ];
    for (name, help, kind, v) in series {
        if let Some(v) = v {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A strict reading of one sample line: `name{l="v",...} value`.
    fn sample(line: &str) -> (String, BTreeMap<String, String>, f64) {
        let (head, value) = line.rsplit_once(' ').expect("sample has a value");
        let value = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse::<f64>().expect("value is a float"),
        };
        let (name, labels) = match head.split_once('{') {
            None => (head, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("labels end with }");
                let labels = body
                    .split(',')
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').expect("label is k=v");
                        let v = v
                            .strip_prefix('"')
                            .and_then(|v| v.strip_suffix('"'))
                            .expect("label value is quoted");
                        assert!(valid_name(k), "label name {k}");
                        (k.to_string(), v.to_string())
                    })
                    .collect();
                (name, labels)
            }
        };
        assert!(valid_name(name), "metric name {name:?}");
        (name.to_string(), labels, value)
    }

    fn valid_name(n: &str) -> bool {
        let mut chars = n.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    type Samples = Vec<(String, BTreeMap<String, String>, f64)>;

    /// Every line is a comment (`# HELP`/`# TYPE name kind`) or a sample; each family is typed
    /// once, before its samples.
    fn parse(text: &str) -> (BTreeMap<String, String>, Samples) {
        let mut types = BTreeMap::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                assert!(types.insert(name.to_string(), kind.to_string()).is_none());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                assert!(rest.split_once(' ').is_some(), "{line}");
            } else {
                assert!(!line.is_empty() && !line.starts_with('#'), "{line:?}");
                let s = sample(line);
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suf| s.0.strip_suffix(suf))
                    .filter(|f| types.get(*f).is_some_and(|k| k == "histogram"))
                    .unwrap_or(&s.0);
                assert!(types.contains_key(family), "untyped sample {line}");
                samples.push(s);
            }
        }
        (types, samples)
    }

    fn value(samples: &Samples, name: &str, label: Option<(&str, &str)>) -> f64 {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name && label.is_none_or(|(k, v)| l.get(k).is_some_and(|x| x == v))
            })
            .unwrap_or_else(|| panic!("no sample {name} {label:?}"))
            .2
    }

    #[test]
    fn renders_valid_text_with_cumulative_histograms() {
        let m = Metrics::default();
        inc(&m.sandboxes_created);
        inc(&m.sandboxes_created);
        m.http_error("not_found");
        m.http_error("not_found");
        m.http_error("conflict");
        for ms in [0, 1, 3, 3, 40, 700, 20_000] {
            m.create_seconds.observe(Duration::from_millis(ms));
        }
        m.exec_seconds.observe(Duration::from_micros(800));
        let text = m.render(
            &[("running".into(), 2), ("stopped".into(), 0)],
            &[
                ("space_net_slots_ready".into(), 5.0),
                ("space_net_pool_hits_total".into(), 7.0),
            ],
        );
        let (types, samples) = parse(&text);
        assert_eq!(types["space_sandbox_create_seconds"], "histogram");
        assert_eq!(types["space_net_slots_ready"], "gauge");
        assert_eq!(types["space_net_pool_hits_total"], "counter");
        assert_eq!(value(&samples, "space_sandboxes_created_total", None), 2.0);
        let err = |code| value(&samples, "space_http_errors_total", Some(("code", code)));
        assert_eq!((err("not_found"), err("conflict")), (2.0, 1.0));
        assert_eq!(value(&samples, "space_net_slots_ready", None), 5.0);
        // This test process's own: resident, using CPU, with threads and fds.
        assert_eq!(types["process_cpu_seconds_total"], "counter");
        assert!(value(&samples, "process_resident_memory_bytes", None) > 1e6);
        assert!(value(&samples, "process_threads", None) >= 1.0);
        assert!(value(&samples, "process_open_fds", None) >= 3.0);
        assert_eq!(
            value(&samples, "space_sandboxes", Some(("state", "running"))),
            2.0
        );

        for family in [
            "space_sandbox_create_seconds",
            "space_exec_seconds",
            "space_snapshot_seconds",
        ] {
            let buckets: Vec<(f64, f64)> = samples
                .iter()
                .filter(|(n, _, _)| *n == format!("{family}_bucket"))
                .map(|(_, l, v)| {
                    let le = match l["le"].as_str() {
                        "+Inf" => f64::INFINITY,
                        s => s.parse().unwrap(),
                    };
                    (le, *v)
                })
                .collect();
            assert_eq!(buckets.len(), BUCKETS.len() + 1, "{family}");
            assert!(
                buckets
                    .windows(2)
                    .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1)
            );
            assert_eq!(buckets.last().unwrap().0, f64::INFINITY);
            let count = value(&samples, &format!("{family}_count"), None);
            assert_eq!(count, buckets.last().unwrap().1, "{family}");
        }
        let le = |b: &str| {
            value(
                &samples,
                "space_sandbox_create_seconds_bucket",
                Some(("le", b)),
            )
        };
        // 0 and 1 ms are <= 0.001; 3 ms twice in (0.0025, 0.005]; 40 ms; 700 ms; 20 s over.
        assert_eq!(
            (le("0.001"), le("0.0025"), le("0.005"), le("0.05")),
            (2.0, 2.0, 4.0, 5.0)
        );
        assert_eq!((le("1"), le("10"), le("+Inf")), (6.0, 6.0, 7.0));
        let sum = value(&samples, "space_sandbox_create_seconds_sum", None);
        assert!((sum - 20.747).abs() < 1e-9, "{sum}");
        assert_eq!(value(&samples, "space_exec_seconds_count", None), 1.0);
        assert_eq!(value(&samples, "space_snapshot_seconds_count", None), 0.0);
    }

    #[test]
    fn reads_process_stats_from_proc_text() {
        let status = "Name:\tspaced\nVmPeak:\t  9000 kB\nVmRSS:\t  2048 kB\nThreads:\t7\n";
        // The comm holds a space and a parenthesis; utime 250 and stime 50 ticks.
        let stat = "42 (spa ce)) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0";
        assert_eq!(
            ProcessStats::parse(status, stat, Some(9)),
            ProcessStats {
                resident_bytes: Some(2048 * 1024),
                cpu_seconds: Some(3.0),
                threads: Some(7),
                open_fds: Some(9),
                max_fds: None,
            }
        );
        let mut out = String::new();
        render_process(&mut out, &ProcessStats::read());
        assert!(out.contains("\nprocess_max_fds "), "{out}");
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max processes             95452                95452                processes\n\
                      Max open files            20000                40000                files\n";
        assert_eq!(soft_open_files(limits), Some(20000));
        assert_eq!(
            soft_open_files("Max open files  unlimited  unlimited files"),
            None
        );
        assert_eq!(
            ProcessStats::parse("", "garbage", None),
            ProcessStats::default()
        );
        let mut out = String::new();
        render_process(&mut out, &ProcessStats::default());
        assert!(out.is_empty(), "nothing unread is rendered: {out}");
    }
}
