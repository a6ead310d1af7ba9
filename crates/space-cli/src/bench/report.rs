//! Report pieces shared by the sections: outcomes, targets and the table printer.

use serde::Serialize;

use super::stats::Stats;

/// A section of `space bench all`: its report, or why it failed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome<T> {
    Ok(T),
    Failed(String),
}

impl<T> Outcome<T> {
    pub fn from_result(r: anyhow::Result<T>) -> Self {
        match r {
            Ok(v) => Outcome::Ok(v),
            Err(e) => Outcome::Failed(format!("{e:#}")),
        }
    }

    pub fn ok(&self) -> Option<&T> {
        match self {
            Outcome::Ok(v) => Some(v),
            _ => None,
        }
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, Outcome::Failed(_))
    }

    /// Prints the section with `print`, or the reason it has no figures.
    pub fn print(&self, title: &str, print: impl FnOnce(&T)) {
        match self {
            Outcome::Ok(v) => print(v),
            Outcome::Failed(why) => {
                section(title);
                println!("FAILED: {why}");
            }
        }
    }
}

/// A target of issue 5 next to the measured value.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Target {
    pub name: String,
    /// e.g. "<= 5 ms".
    pub target: String,
    pub value: Option<f64>,
    /// None when there is no value to judge.
    pub met: Option<bool>,
}

impl Target {
    pub fn at_most(name: &str, value: Option<f64>, limit: f64, unit: &str) -> Target {
        Target {
            name: name.to_string(),
            target: format!("<= {limit} {unit}"),
            value,
            met: value.map(|v| v <= limit),
        }
    }

    pub fn at_least(name: &str, value: Option<f64>, limit: f64, unit: &str) -> Target {
        Target {
            name: name.to_string(),
            target: format!(">= {limit} {unit}"),
            value,
            met: value.map(|v| v >= limit),
        }
    }

    pub fn verdict(&self) -> &'static str {
        match self.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "n/a",
        }
    }
}

pub fn print_targets(targets: &[Target]) {
    for t in targets {
        let value = t.value.map_or("n/a".to_string(), |v| format!("{v:.2}"));
        println!(
            "  target {:<40} {:<12} measured {:>10}  {}",
            t.name,
            t.target,
            value,
            t.verdict()
        );
    }
}

pub fn section(title: &str) {
    println!("\n== {title} ==");
}

pub fn stats_header(unit_note: &str) {
    println!(
        "{:<38} {:>10} {:>10} {:>10} {:>10} {:>7}   {unit_note}",
        "metric", "p50", "p90", "p99", "max", "count"
    );
}

/// One row of percentiles, divided by `scale` (1 for ms, MiB for bytes).
pub fn stats_row(name: &str, s: Option<&Stats>, scale: f64) {
    match s {
        Some(s) => println!(
            "{:<38} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>7}",
            name,
            s.p50 / scale,
            s.p90 / scale,
            s.p99 / scale,
            s.max / scale,
            s.count
        ),
        None => println!("{name:<38} {:>10}", "n/a"),
    }
}

pub fn value_row(name: &str, value: impl std::fmt::Display) {
    println!("{name:<38} {value}");
}

/// A count and its rate per second, noting when the run stopped at its cap.
pub fn rate_row(name: &str, count: usize, per_s: f64, capped_at: Option<usize>) {
    let cap = capped_at.map_or(String::new(), |c| format!(" (stopped at the cap of {c})"));
    value_row(name, format!("{count} / {per_s:.1}{cap}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_judge_values() {
        let t = Target::at_most("create p50", Some(4.0), 5.0, "ms");
        assert_eq!(
            (t.met, t.verdict(), t.target.as_str()),
            (Some(true), "met", "<= 5 ms")
        );
        let t = Target::at_most("create p50", Some(5.5), 5.0, "ms");
        assert_eq!(t.verdict(), "MISSED");
        let t = Target::at_least("creates/s", Some(199.0), 200.0, "/s");
        assert_eq!(t.met, Some(false));
        let t = Target::at_least("creates/s", None, 200.0, "/s");
        assert_eq!(t.verdict(), "n/a");
    }

    #[test]
    fn outcomes_serialize_tagged() {
        let ok: Outcome<u32> = Outcome::from_result(Ok(3));
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            serde_json::json!({"ok": 3})
        );
        let failed: Outcome<u32> = Outcome::from_result(Err(anyhow::anyhow!("boom")));
        assert!(failed.is_failed() && failed.ok().is_none());
        assert_eq!(
            serde_json::to_value(&failed).unwrap(),
            serde_json::json!({"failed": "boom"})
        );
    }
}
