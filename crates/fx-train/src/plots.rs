//! PNG plots of a run: the training curves from metrics.jsonl and the test-split equity
//! curve against buy-and-hold.

use anyhow::Result;
use plotters::prelude::*;

use crate::config::RunConfig;
use crate::dataset::Dataset;
use crate::report::Report;
use crate::run_dir::RunDir;

pub fn write_all(dir: &RunDir, _cfg: &RunConfig, _data: &Dataset, rep: &Report) -> Result<()> {
    register_font();
    let equity = dir.path("equity.png");
    let series: Vec<(&str, &[f64], RGBColor)> = vec![
        ("agent", &rep.agent.equity, RGBColor(31, 119, 180)),
        ("buy & hold", &rep.buy_and_hold.equity, RGBColor(255, 127, 14)),
        ("flat", &rep.flat.equity, RGBColor(120, 120, 120)),
    ];
    line_chart(&equity, "test-split equity (start = 1)", "bar", &series)
        .map_err(|e| anyhow::anyhow!("plotting {}: {e}", equity.display()))?;
    training_curves(dir, "env_steps", "env steps", &[("loss", "loss"), ("mean reward per step", "mean_reward")])
}

/// `name` (e.g. `forecast.png`): curves indexed by bar, as the equity plot draws them.
pub fn curves(dir: &RunDir, name: &str, title: &str, series: &[(&str, &[f64], RGBColor)]) -> Result<()> {
    register_font();
    let path = dir.path(name);
    line_chart(&path, title, "bar", series).map_err(|e| anyhow::anyhow!("plotting {}: {e}", path.display()))
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
    let text = std::fs::read_to_string(path).unwrap_or_default();
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

fn line_chart(path: &std::path::Path, title: &str, x_label: &str, series: &[(&str, &[f64], RGBColor)]) -> Fallible {
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2);
    let (lo, hi) = bounds(series.iter().flat_map(|s| s.1.iter().copied()));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, lo..hi)?;
    chart.configure_mesh().x_desc(x_label).draw()?;
    for (name, ys, color) in series {
        let color = *color;
        chart
            .draw_series(LineSeries::new(ys.iter().enumerate().map(|(i, &y)| (i as f64, y)), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
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
