//! `--plot DIR`: SVG plots of a bench report (plotters, SVG backend only). Text is written as
//! SVG `<text>` and laid out by plotters' built-in estimate, so no font is read or needed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

use super::churn::ChurnReport;
use super::scale::ScaleReport;
use super::stats::MIB;

const SIZE: (u32, u32) = (900, 540);

/// One named line: (x, y) points; points whose y is not positive are left out (log axes).
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    fn new(name: &str, points: impl IntoIterator<Item = (f64, Option<f64>)>) -> Self {
        Self {
            name: name.to_string(),
            points: points
                .into_iter()
                .filter_map(|(x, y)| Some((x, y.filter(|y| y.is_finite() && *y > 0.0)?)))
                .collect(),
        }
    }
}

fn bounds(series: &[Series], pick: impl Fn(&(f64, f64)) -> f64) -> Option<(f64, f64)> {
    let vals = series.iter().flat_map(|s| s.points.iter().map(&pick));
    vals.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Lines (with a dot per point) on a linear x axis and a log y axis.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()> {
    let (x0, x1) = bounds(series, |p| p.0).context("nothing to plot")?;
    let (y0, y1) = bounds(series, |p| p.1).context("nothing to plot")?;
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1 * 1.02, (y0 / 1.5..y1 * 1.5).log_scale())
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Bins per histogram.
const BINS: usize = 24;

/// Share of `samples` in each of [`BINS`] log-spaced bins from `lo` to `hi`: (bin centre,
/// share).
pub fn log_bins(samples: &[f64], lo: f64, hi: f64) -> Vec<(f64, f64)> {
    let (l0, l1) = (lo.ln(), hi.ln().max(lo.ln() + 1e-9));
    let width = (l1 - l0) / BINS as f64;
    let mut counts = [0usize; BINS];
    for &v in samples.iter().filter(|v| **v > 0.0) {
        let i = (((v.ln() - l0) / width) as usize).min(BINS - 1);
        counts[i] += 1;
    }
    let n = samples.len().max(1) as f64;
    (0..BINS)
        .map(|i| ((l0 + (i as f64 + 0.5) * width).exp(), counts[i] as f64 / n))
        .collect()
}

/// Latency histograms as lines (one per sample set) over a log x axis.
pub fn histograms(
    path: &Path,
    title: &str,
    x_desc: &str,
    sets: &[(String, Vec<f64>)],
) -> Result<()> {
    let all: Vec<f64> = sets
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .filter(|v| *v > 0.0)
        .collect();
    if all.is_empty() {
        return Err(anyhow!("nothing to plot"));
    }
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = all.iter().copied().fold(0.0, f64::max);
    let binned: Vec<(String, Vec<(f64, f64)>)> = sets
        .iter()
        .map(|(name, s)| (name.clone(), log_bins(s, lo, hi * 1.0001)))
        .collect();
    let top = binned
        .iter()
        .flat_map(|(_, b)| b.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((lo / 1.2..hi * 1.2).log_scale(), 0.0..top * 1.1 + 1e-9)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("share of runs")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (name, pts)) in binned.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// `space bench scale --plot DIR`: latency and memory against the live count, and the
/// create -> ready histogram of each level. Returns the files written.
pub fn scale(dir: &Path, r: &ScaleReport) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let live = |f: &dyn Fn(&super::scale::Level) -> Option<f64>| {
        r.levels
            .iter()
            .map(|l| (l.live as f64, f(l)))
            .collect::<Vec<_>>()
    };
    let latency = [
        Series::new(
            "create -> ready, pool, p50",
            live(&|l| l.create_hit.create_ready_ms.map(|s| s.p50)),
        ),
        Series::new(
            "create -> ready, pool, p99",
            live(&|l| l.create_hit.create_ready_ms.map(|s| s.p99)),
        ),
        Series::new(
            "create -> ready, cold, p50",
            live(&|l| l.create_miss.create_ready_ms.map(|s| s.p50)),
        ),
        Series::new(
            "create -> ready, cold, p99",
            live(&|l| l.create_miss.create_ready_ms.map(|s| s.p99)),
        ),
        Series::new("exec, p50", live(&|l| l.exec_ms.map(|s| s.p50))),
        Series::new("snapshot, p50", live(&|l| l.snapshot_ms.map(|s| s.p50))),
    ];
    let memory = [
        Series::new(
            "spaced RSS (MiB)",
            live(&|l| l.spaced_rss_bytes.map(|b| b / MIB)),
        ),
        Series::new(
            "node memory per idle sandbox (MiB)",
            live(&|l| l.node_bytes_per_sandbox.map(|b| b / MIB)),
        ),
        Series::new(
            "spaced CPU at rest (% of a core)",
            live(&|l| l.spaced_cpu_at_rest.map(|c| c * 100.0)),
        ),
    ];
    let mut sets: Vec<(String, Vec<f64>)> = Vec::new();
    for l in &r.levels {
        sets.push((
            format!("pool, {} live", l.live),
            l.create_hit.ready_samples.clone(),
        ));
        sets.push((
            format!("cold, {} live", l.live),
            l.create_miss.ready_samples.clone(),
        ));
    }
    let files = [
        dir.join("scale-latency.svg"),
        dir.join("scale-memory.svg"),
        dir.join("scale-create-histogram.svg"),
    ];
    let what = format!("template {}", r.template);
    lines(
        &files[0],
        &format!("Latency as the node fills ({what})"),
        "live idle sandboxes",
        "ms (log)",
        &latency,
    )?;
    lines(
        &files[1],
        &format!("spaced and node memory as the node fills ({what})"),
        "live idle sandboxes",
        "log scale",
        &memory,
    )?;
    histograms(
        &files[2],
        &format!("create -> ready at each level ({what})"),
        "ms (log)",
        &sets,
    )?;
    Ok(files.to_vec())
}

/// `space bench churn --plot DIR`: create -> ready against the creates per second each
/// concurrency level reached (the throughput-latency curve), and each level's histogram.
pub fn churn(dir: &Path, template: &str, levels: &[ChurnReport]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let at = |f: &dyn Fn(&ChurnReport) -> Option<f64>| {
        levels
            .iter()
            .map(|r| (r.creates_per_s, f(r)))
            .collect::<Vec<_>>()
    };
    let curve = [
        Series::new("create -> ready, p50", at(&|r| r.create_ms.map(|s| s.p50))),
        Series::new("create -> ready, p99", at(&|r| r.create_ms.map(|s| s.p99))),
        Series::new(
            "whole cycle (create, exec, remove), p50",
            at(&|r| r.cycle_ms.map(|s| s.p50)),
        ),
    ];
    let sets: Vec<(String, Vec<f64>)> = levels
        .iter()
        .map(|r| {
            (
                format!("{} clients", r.concurrency),
                r.create_samples.clone(),
            )
        })
        .collect();
    let files = [
        dir.join("churn-throughput-latency.svg"),
        dir.join("churn-create-histogram.svg"),
    ];
    let clients: Vec<String> = levels.iter().map(|r| r.concurrency.to_string()).collect();
    lines(
        &files[0],
        &format!(
            "Churn: latency against throughput, {} clients (template {template})",
            clients.join(", ")
        ),
        "creates per second reached",
        "ms (log)",
        &curve,
    )?;
    histograms(
        &files[1],
        &format!("Churn: create -> ready at each level (template {template})"),
        "ms (log)",
        &sets,
    )?;
    Ok(files.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_share_every_sample() {
        let samples = [1.0, 1.1, 2.0, 10.0, 100.0];
        let bins = log_bins(&samples, 1.0, 100.0001);
        assert_eq!(bins.len(), BINS);
        let total: f64 = bins.iter().map(|b| b.1).sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        assert!(bins.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(
            bins[0].1 >= 0.4,
            "1.0 and 1.1 share the first bin: {bins:?}"
        );
        assert!(bins[BINS - 1].1 > 0.0);
    }

    #[test]
    fn writes_svg_lines_and_histograms() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("l.svg");
        let s = [
            Series::new("a", [(0.0, Some(1.0)), (10.0, Some(2.5)), (20.0, None)]),
            Series::new("b", [(0.0, Some(0.0)), (10.0, Some(40.0))]),
        ];
        assert_eq!(s[0].points.len(), 2);
        assert_eq!(s[1].points.len(), 1, "a zero has no place on a log axis");
        lines(&f, "t", "x", "y", &s).unwrap();
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            text.starts_with("<svg") && text.contains("<polyline"),
            "{text}"
        );
        let h = dir.path().join("h.svg");
        histograms(&h, "t", "ms", &[("one".into(), vec![1.0, 2.0, 3.0])]).unwrap();
        assert!(std::fs::read_to_string(&h).unwrap().contains("one"));
        let empty = lines(
            &dir.path().join("e.svg"),
            "t",
            "x",
            "y",
            &[Series::new("a", [])],
        );
        assert!(empty.is_err());
    }
}
