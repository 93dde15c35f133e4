//! Held-out metrics: the model's loss against the zero and last-value forecasts
//! ([`evaluate`]) and forecast quality ([`forecast_metrics`]: pinball, coverage, direction,
//! rank correlation) over every window of a range.

use candle_core::{DType, Tensor};
use fx_precision::Precision;
use serde::Serialize;

use super::ops::Ctx;
use super::series::{sampler, SeqBatch, SeqSeries, Spans};
use super::task::SeqTask;
use crate::error::{Context, Error, Result};

/// Held-out metrics of [`evaluate`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalReport {
    /// The model's loss (pinball for TFT, MSE for MAMBA-2).
    pub loss: f64,
    /// MSE of the point forecast.
    pub mse_model: f64,
    /// MSE of the zero forecast.
    pub mse_zero: f64,
    /// MSE of the last-value forecast.
    pub mse_last: f64,
}

/// A finite loss (or other scalar) read to the host; a non-finite one is an error.
pub(super) fn scalar(t: &Tensor, context: &'static str) -> Result<f64> {
    let v = t.to_dtype(DType::F64).and_then(|t| t.to_scalar::<f64>()).ctx(context)?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(Error::NonFinite { what: "loss", context })
    }
}

/// Loss and point-forecast metrics over every window in `rows` (inference, no tape).
pub fn evaluate(
    task: &impl SeqTask,
    series: &SeqSeries,
    rows: impl Into<Spans>,
    batch_size: usize,
    precision: Precision,
) -> Result<EvalReport> {
    let dev = task.params().device().clone();
    let smp = sampler(&rows.into(), task.window_len(), batch_size, 0)?;
    let c = Ctx::inference(precision);
    let (mut loss, mut n_b) = (0.0, 0usize);
    let (mut se_m, mut se_z, mut se_l, mut n) = (0.0, 0.0, 0.0, 0usize);
    let sse = |a: &Tensor, b: &Tensor| -> Result<f64> {
        scalar(&(a - b).and_then(|d| d.sqr()).and_then(|d| d.sum_all()).ctx("evaluate")?, "evaluate")
    };
    for bi in smp.epoch_batches(0) {
        let batch = task.batch(series, &bi.starts, &dev)?;
        loss += scalar(&task.loss(&c, &batch)?, "evaluate")?;
        n_b += 1;
        let p = task.point(&c, &batch)?;
        se_m += sse(&p, &batch.target)?;
        se_z += scalar(&batch.target.sqr().and_then(|t| t.sum_all()).ctx("evaluate")?, "evaluate")?;
        se_l += sse(&batch.last_value, &batch.target)?;
        n += batch.target.elem_count();
    }
    let n = n.max(1) as f64;
    Ok(EvalReport { loss: loss / n_b.max(1) as f64, mse_model: se_m / n, mse_zero: se_z / n, mse_last: se_l / n })
}

/// Forecast quality on held-out data, as the training report gives it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForecastMetrics {
    /// Number of forecasts (samples × horizon steps).
    pub n: usize,
    /// Quantile levels (empty for point forecasters).
    pub levels: Vec<f64>,
    /// Mean pinball loss per quantile level.
    pub pinball: Vec<f64>,
    /// Fraction of targets inside [lowest, highest] quantile (the 0.1–0.9 band with
    /// the default levels); `None` for point forecasters.
    pub interval_coverage: Option<f64>,
    /// Fraction of forecasts whose sign matches the realised return's (zero targets
    /// excluded).
    pub directional_accuracy: f64,
    /// Spearman rank correlation of point forecast and realised return (average ranks
    /// for ties).
    pub rank_correlation: f64,
}

fn ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = avg;
        }
        i = j + 1;
    }
    r
}

fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma) * (x - ma);
        sbb += (y - mb) * (y - mb);
    }
    if saa == 0.0 || sbb == 0.0 {
        0.0
    } else {
        sab / (saa * sbb).sqrt()
    }
}

/// Forecast metrics from flat host vectors: `point[i]` and `target[i]`, and for a
/// quantile forecaster `quantiles[i · L + k]` at `levels[k]` (levels ascending).
pub fn forecast_metrics(levels: &[f64], quantiles: &[f64], point: &[f64], target: &[f64]) -> Result<ForecastMetrics> {
    let n = target.len();
    if point.len() != n || quantiles.len() != n * levels.len() || n == 0 {
        return Err(Error::shape(
            "forecasts",
            "forecast_metrics",
            format!("{n} points and {n}×{} quantiles, n > 0", levels.len()),
            format!("{} and {}", point.len(), quantiles.len()),
        ));
    }
    let l = levels.len();
    let mut pinball = vec![0.0; l];
    let mut inside = 0usize;
    for i in 0..n {
        for (k, &q) in levels.iter().enumerate() {
            let e = target[i] - quantiles[i * l + k];
            pinball[k] += (q * e).max((q - 1.0) * e) / n as f64;
        }
        if l >= 2 && target[i] >= quantiles[i * l] && target[i] <= quantiles[i * l + l - 1] {
            inside += 1;
        }
    }
    let (mut hit, mut m) = (0usize, 0usize);
    for (p, t) in point.iter().zip(target) {
        if *t != 0.0 {
            m += 1;
            if p.signum() == t.signum() && *p != 0.0 {
                hit += 1;
            }
        }
    }
    Ok(ForecastMetrics {
        n,
        levels: levels.to_vec(),
        pinball,
        interval_coverage: (l >= 2).then(|| inside as f64 / n as f64),
        directional_accuracy: if m == 0 { 0.0 } else { hit as f64 / m as f64 },
        rank_correlation: pearson(&ranks(point), &ranks(target)),
    })
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f64>()).ctx("evaluate_forecasts")
}

/// [`ForecastMetrics`] over every window in `rows` (inference, no tape).
pub fn evaluate_forecasts(
    task: &impl SeqTask,
    series: &SeqSeries,
    rows: impl Into<Spans>,
    batch_size: usize,
    precision: Precision,
) -> Result<ForecastMetrics> {
    let c = Ctx::inference(precision);
    let dev = task.params().device().clone();
    evaluate_forecasts_with(task, series, rows, batch_size, &dev, |batch| {
        Ok(Forecasts { point: task.point(&c, batch)?, quantiles: task.quantiles(&c, batch)? })
    })
}

/// One batch's forecasts, as [`evaluate_forecasts_with`] scores them.
#[derive(Debug, Clone)]
pub struct Forecasts {
    /// The point forecast, shaped as the batch's target.
    pub point: Tensor,
    /// Quantile levels and forecasts `[.., levels]`, for quantile forecasters.
    pub quantiles: Option<(Vec<f64>, Tensor)>,
}

/// [`ForecastMetrics`] over every window in `rows`, in `task`'s batches on `device`, of
/// the forecasts `forecast` makes of each batch (another implementation of the task's
/// model, such as its INT8 version, scored on exactly the windows
/// [`evaluate_forecasts`] uses).
pub fn evaluate_forecasts_with(
    task: &impl SeqTask,
    series: &SeqSeries,
    rows: impl Into<Spans>,
    batch_size: usize,
    device: &candle_core::Device,
    mut forecast: impl FnMut(&SeqBatch) -> Result<Forecasts>,
) -> Result<ForecastMetrics> {
    let smp = sampler(&rows.into(), task.window_len(), batch_size, 0)?;
    let (mut levels, mut qs, mut pts, mut ys) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for bi in smp.epoch_batches(0) {
        let batch = task.batch(series, &bi.starts, device)?;
        let f = forecast(&batch)?;
        pts.extend(host(&f.point)?);
        ys.extend(host(&batch.target)?);
        if let Some((lv, q)) = f.quantiles {
            levels = lv;
            qs.extend(host(&q)?);
        }
    }
    forecast_metrics(&levels, &qs, &pts, &ys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forecast_metrics_by_hand() {
        let levels = [0.1, 0.5, 0.9];
        // three forecasts: target inside, above and below the band
        let q = [-1.0, 0.0, 1.0, -1.0, 0.5, 1.0, 0.0, 1.0, 2.0];
        let point = [0.0, 0.5, 1.0];
        let target = [0.5, 2.0, -1.0];
        let m = forecast_metrics(&levels, &q, &point, &target).unwrap();
        assert_eq!(m.n, 3);
        assert!((m.interval_coverage.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        // q=0.1: e = 1.5, 3, -1 → 0.15, 0.3, 0.9 → mean 0.45
        assert!((m.pinball[0] - 0.45).abs() < 1e-12);
        // q=0.5: e = 0.5, 1.5, -2 → 0.25, 0.75, 1.0 → mean 2/3
        assert!((m.pinball[1] - 2.0 / 3.0).abs() < 1e-12);
        // signs: 0 vs + (miss), + vs + (hit), + vs − (miss)
        assert!((m.directional_accuracy - 1.0 / 3.0).abs() < 1e-12);
        // ranks of point 1,2,3 vs target 2,3,1 → Spearman −0.5
        assert!((m.rank_correlation + 0.5).abs() < 1e-12);
        let r = ranks(&[3.0, 1.0, 3.0, 2.0]);
        assert_eq!(r, vec![3.5, 1.0, 3.5, 2.0]);
        assert!(forecast_metrics(&levels, &q[..8], &point, &target).is_err());
    }
}
