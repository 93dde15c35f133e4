//! PNG plots of a run: the training curves from metrics.jsonl and the test-split equity
//! curve against buy-and-hold.

use anyhow::Result;
use plotters::prelude::*;

use crate::config::RunConfig;
use crate::dataset::Dataset;
use crate::report::Report;
use crate::run_dir::RunDir;

pub fn write_all(dir: &RunDir, _cfg: &RunConfig, data: &Dataset, rep: &Report) -> Result<()> {
    register_font();
    let equity = dir.path("equity.png");
    let series: Vec<(&str, &[f64], RGBColor)> = vec![
        ("agent", &rep.agent.equity, RGBColor(31, 119, 180)),
        ("buy & hold", &rep.buy_and_hold.equity, RGBColor(255, 127, 14)),
        ("flat", &rep.flat.equity, RGBColor(120, 120, 120)),
    ];
    // Equity point i is the account after i test bars: dated by the bar it stands at.
    let dates: Vec<i64> = rep.step_rows.iter().filter_map(|&c| data.calendar.get(c).copied()).collect();
    let title = if data.is_panel() {
        "test-split equity, equal-weight portfolio (start = 1)"
    } else {
        "test-split equity (start = 1)"
    };
    let chart = Chart { title, x_label: "date", dates: Some(&dates), drawdown_of: Some(0) };
    line_chart(&equity, &chart, &series).map_err(|e| anyhow::anyhow!("plotting {}: {e}", equity.display()))?;
    training_curves(dir, "env_steps", "env steps", &[("loss", "loss"), ("mean reward per step", "mean_reward")])
}

/// `name` (e.g. `forecast.png`): curves over bars as the equity plot draws them, the x axis
/// dated by `dates` (Unix seconds of each point; counted in bars without), the first
/// series' drawdown shaded.
pub fn curves(
    dir: &RunDir,
    name: &str,
    dates: Option<&[i64]>,
    title: &str,
    series: &[(&str, &[f64], RGBColor)],
) -> Result<()> {
    register_font();
    let path = dir.path(name);
    let x_label = if dates.is_some() { "date" } else { "bar" };
    let chart = Chart { title, x_label, dates, drawdown_of: Some(0) };
    line_chart(&path, &chart, series).map_err(|e| anyhow::anyhow!("plotting {}: {e}", path.display()))
}

/// `training.png`: one panel per `(title, key)` of metrics.jsonl against `x_key`.
pub fn training_curves(dir: &RunDir, x_key: &str, x_desc: &str, panels: &[(&str, &str)]) -> Result<()> {
    register_font();
    let metrics = read_metrics(&dir.path("metrics.jsonl"))?;
    let series: Vec<Vec<(f64, f64)>> = panels
        .iter()
        .map(|(_, key)| metrics.iter().filter_map(|m| Some((m[x_key].as_f64()?, m[*key].as_f64()?))).collect())
        .collect();
    let named: Vec<(&str, &[(f64, f64)])> = panels.iter().zip(&series).map(|((t, _), s)| (*t, s.as_slice())).collect();
    let training = dir.path("training.png");
    xy_charts(&training, x_desc, &named).map_err(|e| anyhow::anyhow!("plotting {}: {e}", training.display()))?;
    Ok(())
}

fn read_metrics(path: &std::path::Path) -> Result<Vec<serde_json::Value>> {
    // A log that is missing (or not a regular file) has no curve to draw.
    let text = fx_data::files::read_regular_to_string(path, u64::MAX).unwrap_or_default();
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans (Bitstream Vera licence, see assets/): plots render the same everywhere,
        // with no system font lookup.
        let _ =
            plotters::style::register_font("sans-serif", FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"));
    });
}

type Fallible = std::result::Result<(), Box<dyn std::error::Error>>;

/// How [`line_chart`] draws its x axis and what it marks.
struct Chart<'a> {
    title: &'a str,
    x_label: &'a str,
    /// Unix seconds of each x index: tick labels become dates.
    dates: Option<&'a [i64]>,
    /// Shade this series' drawdown (below its running peak) and name the maximum.
    drawdown_of: Option<usize>,
}

/// The date (UTC) of x index `x`, from `dates`, or the index itself; with the hour when
/// the whole axis spans under two weeks (intraday bars).
fn x_tick(dates: Option<&[i64]>, x: f64) -> String {
    let intraday = dates.is_some_and(|d| !d.is_empty() && d[d.len() - 1] - d[0] < 14 * 86_400);
    date_label(dates, x, if intraday { "%m-%d %H:%M" } else { "%Y-%m-%d" })
}

/// [`x_tick`] with the date and the hour, whatever the axis spans.
fn x_tick_hours(dates: Option<&[i64]>, x: f64) -> String {
    date_label(dates, x, "%Y-%m-%d %H:%M")
}

/// x index `x` as `dates[x]` (clamped to the last) in `fmt`, or the index itself.
fn date_label(dates: Option<&[i64]>, x: f64, fmt: &str) -> String {
    let i = x.round().max(0.0) as usize;
    let Some(d) = dates.filter(|d| !d.is_empty()) else {
        return i.to_string();
    };
    chrono::DateTime::from_timestamp(d[i.min(d.len() - 1)], 0)
        .map_or_else(|| i.to_string(), |t| t.format(fmt).to_string())
}

/// Running peak and the maximum drawdown `(peak index, trough index, fraction)` of `ys`.
fn drawdown(ys: &[f64]) -> (Vec<f64>, Option<(usize, usize, f64)>) {
    let (mut peak, mut peak_i, mut worst) = (f64::NEG_INFINITY, 0, None::<(usize, usize, f64)>);
    let mut peaks = Vec::with_capacity(ys.len());
    for (i, &y) in ys.iter().enumerate() {
        if y > peak {
            peak = y;
            peak_i = i;
        }
        peaks.push(peak);
        let dd = if peak > 0.0 { 1.0 - y / peak } else { 0.0 };
        if dd > worst.map_or(0.0, |w| w.2) {
            worst = Some((peak_i, i, dd));
        }
    }
    (peaks, worst)
}

fn line_chart(path: &std::path::Path, c: &Chart<'_>, series: &[(&str, &[f64], RGBColor)]) -> Fallible {
    let root = BitMapBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    // The legend gets its own column to the right, so it never covers a curve.
    let (plot, legend) = root.split_horizontally(760);
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2);
    let (lo, hi) = bounds(series.iter().flat_map(|s| s.1.iter().copied()));
    let mut chart = ChartBuilder::on(&plot)
        .caption(c.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..(n - 1) as f64, lo..hi)?;
    let fmt = |x: &f64| x_tick(c.dates, *x);
    chart.configure_mesh().x_desc(c.x_label).x_labels(6).x_label_formatter(&fmt).draw()?;
    let mut entries: Vec<(String, RGBColor, bool)> = Vec::new();
    if let Some(k) = c.drawdown_of.filter(|&k| k < series.len()) {
        let ys = series[k].1;
        let (peaks, worst) = drawdown(ys);
        let shade = RGBColor(214, 39, 40);
        // The underwater area: between the running peak and the curve.
        let mut poly: Vec<(f64, f64)> = peaks.iter().enumerate().map(|(i, &p)| (i as f64, p)).collect();
        poly.extend(ys.iter().enumerate().rev().map(|(i, &y)| (i as f64, y)));
        chart.draw_series(std::iter::once(Polygon::new(poly, shade.mix(0.18).filled())))?;
        if let Some((p, t, dd)) = worst {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(p as f64, ys[p]), (t as f64, ys[t])],
                shade.stroke_width(1),
            )))?;
            entries.push((format!("{} drawdown", series[k].0), shade, true));
            entries.push((format!("max {:.1}%: from", 100.0 * dd), shade, false));
            let (mut from, mut to) = (x_tick(c.dates, p as f64), x_tick(c.dates, t as f64));
            if from == to {
                // Within one day of a long axis: name the hours.
                (from, to) = (x_tick_hours(c.dates, p as f64), x_tick_hours(c.dates, t as f64));
            }
            entries.push((from, shade, false));
            entries.push((format!("to {to}"), shade, false));
        }
    }
    for (_, ys, color) in series {
        chart
            .draw_series(LineSeries::new(ys.iter().enumerate().map(|(i, &y)| (i as f64, y)), color.stroke_width(2)))?;
    }
    let mut items: Vec<(String, RGBColor, bool)> =
        series.iter().map(|(name, _, color)| (name.to_string(), *color, true)).collect();
    items.extend(entries);
    for (row, (text, color, swatch)) in items.iter().enumerate() {
        let y = 60 + 24 * row as i32;
        if *swatch {
            legend.draw(&PathElement::new(vec![(4, y), (28, y)], color.stroke_width(3)))?;
        }
        legend.draw(&Text::new(text.clone(), (34, y - 8), ("sans-serif", 15)))?;
    }
    root.present()?;
    Ok(())
}

fn xy_charts(path: &std::path::Path, x_desc: &str, panels: &[(&str, &[(f64, f64)])]) -> Fallible {
    let root = BitMapBackend::new(path, (900, 300 * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, (title, pts)) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
        let (x0, x1) = bounds(pts.iter().map(|p| p.0));
        let (y0, y1) = bounds(pts.iter().map(|p| p.1));
        let mut chart = ChartBuilder::on(area)
            .caption(*title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart.configure_mesh().x_desc(x_desc).draw()?;
        chart.draw_series(LineSeries::new(pts.iter().copied(), RGBColor(31, 119, 180).stroke_width(2)))?;
    }
    root.present()?;
    Ok(())
}

/// Axis bounds with a little margin; a flat or empty series still gets a range.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (lo - pad, hi + pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawdown_finds_the_deepest_fall_from_a_peak() {
        let (peaks, worst) = drawdown(&[1.0, 1.2, 0.9, 1.1, 1.3, 1.04, 1.5]);
        assert_eq!(peaks, [1.0, 1.2, 1.2, 1.2, 1.3, 1.3, 1.5]);
        let (p, t, dd) = worst.unwrap();
        assert_eq!((p, t), (1, 2));
        assert!((dd - 0.25).abs() < 1e-12);
        assert!(drawdown(&[1.0, 1.1, 1.2]).1.is_none());
    }

    #[test]
    fn ticks_are_dates_with_hours_for_intraday_axes() {
        let daily: Vec<i64> = (0..30).map(|d| 1_577_836_800 + d * 86_400).collect(); // 2020-01-01
        assert_eq!(x_tick(Some(&daily), 2.0), "2020-01-03");
        let hourly: Vec<i64> = (0..30).map(|h| 1_577_836_800 + h * 3_600).collect();
        assert_eq!(x_tick(Some(&hourly), 5.0), "01-01 05:00");
        assert_eq!(x_tick(Some(&hourly), 99.0), "01-02 05:00", "clamped to the last bar");
        assert_eq!(x_tick_hours(Some(&daily), 2.0), "2020-01-03 00:00");
        assert_eq!(x_tick_hours(None, 4.0), "4");
        assert_eq!(x_tick(None, 7.0), "7");
    }
}
