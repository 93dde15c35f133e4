//! `fx-train quantize` and `eval --int8` of the sequence models: the TFT's INT8 file
//! (`fx_quant::quantize_tft`, scored against F32 on the test split) and the MAMBA-2 INT8
//! one-bar step (no file: it quantises when built), over the run's latest checkpoint.

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fx_models::seq::{evaluate_forecasts, forecast_metrics, ForecastMetrics, Mamba2Task, SeqTask};
use fx_models::{Mamba2, Tft};
use serde_json::{json, Value};

use crate::config::RunConfig;
use crate::run_dir::{write_atomic, Checkpoint, RunDir};
use crate::seq_run::{best_weights, latest_with_data, SeqData};

/// Issue 13's TFT bars: the INT8 model's mean pinball loss within this relative distance
/// of F32's, and its interval coverage within this many points. Below them the commands
/// say so on stderr (the files are still written: the numbers are the user's to judge).
const PINBALL_REL_TARGET: f64 = 0.01;
const COVERAGE_TARGET: f64 = 0.01;

/// Where a TFT's calibration windows come from (the reports say).
const TFT_CALIB_FROM: &str = "forecast windows spread evenly over the training split";

/// Forecast windows per INT8 evaluation batch.
const INT8_EVAL_BATCH: usize = 32;

/// A TFT run's latest checkpoint with its best epoch's weights, on the CPU (where the
/// INT8 model runs), and its data.
fn best_tft_on_cpu(dir: &RunDir, cfg: &RunConfig) -> Result<(Checkpoint, SeqData, Tft)> {
    let (c, d) = latest_with_data(dir, cfg)?;
    refuse_panel(dir, &d)?;
    let model = Tft::new(cfg.tft.clone(), &Device::Cpu, cfg.seed).context("building the TFT")?;
    best_weights(&model, cfg, &c, &d)?;
    Ok((c, d, model))
}

/// The INT8 forecasters (the TFT's file, MAMBA-2's one-bar step) are one instrument's:
/// a panel run's model also takes the instrument, which they do not.
fn refuse_panel(dir: &RunDir, d: &SeqData) -> Result<()> {
    if d.data.is_panel() {
        bail!(
            "{} was trained on a panel of {} instruments ({}): INT8 forecasters are built for one instrument's runs",
            dir.root().display(),
            d.data.instruments.len(),
            d.data.source
        );
    }
    Ok(())
}

/// F32 (candle's forward) and INT8 forecast metrics on the test split, on the same windows.
fn tft_int8_metrics(
    model: &Tft,
    q: &fx_quant::QuantTft,
    d: &SeqData,
) -> Result<(ForecastMetrics, ForecastMetrics, fx_quant::Isa)> {
    let test = d.data.splits.test.clone();
    let p = fx_precision::Precision::F32;
    let f32m = evaluate_forecasts(model, &d.series, test.clone(), INT8_EVAL_BATCH, p).context("F32 forecasts")?;
    let int8 = fx_quant::Int8Tft::new(q, INT8_EVAL_BATCH)?;
    let levels = model.config().quantiles.clone();
    let i8m = fx_models::seq::evaluate_forecasts_with(model, &d.series, test, INT8_EVAL_BATCH, &Device::Cpu, |b| {
        let qs = int8
            .forecast(&b.inputs[0], &b.inputs[1])
            .map_err(|e| fx_models::Error::Config { context: "INT8 TFT forecast", message: e.to_string() })?;
        let point = fx_models::tft::point_forecast(&levels, &qs)?;
        Ok(fx_models::seq::Forecasts { point, quantiles: Some((levels.clone(), qs)) })
    })
    .context("INT8 forecasts")?;
    Ok((f32m, i8m, int8.isa()))
}

/// The comparison's JSON, its console lines, and warnings past the targets.
fn tft_int8_comparison(f32m: &ForecastMetrics, i8m: &ForecastMetrics, target_scale: f64) -> Value {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (pf, pq) = (mean(&f32m.pinball), mean(&i8m.pinball));
    let rel = if pf > 0.0 { (pq - pf).abs() / pf } else { (pq - pf).abs() };
    let (cf, cq) = (f32m.interval_coverage.unwrap_or(0.0), i8m.interval_coverage.unwrap_or(0.0));
    println!("test split ({} forecasts), F32 against INT8:", f32m.n);
    for (k, q) in f32m.levels.iter().enumerate() {
        println!("  pinball loss q={q:<4} {:.5} / {:.5}", f32m.pinball[k], i8m.pinball[k]);
    }
    println!("  mean pinball loss {pf:.5} / {pq:.5} ({:.3}% apart)", 100.0 * rel);
    println!("  band coverage {:.2}% / {:.2}% ({:+.2} points)", 100.0 * cf, 100.0 * cq, 100.0 * (cq - cf));
    println!(
        "  directional accuracy {:.2}% / {:.2}%",
        100.0 * f32m.directional_accuracy,
        100.0 * i8m.directional_accuracy
    );
    if rel > PINBALL_REL_TARGET || (cq - cf).abs() > COVERAGE_TARGET {
        eprintln!(
            "warning: the INT8 TFT's mean pinball loss is {:.2}% from F32's (target {:.0}%) and its coverage {:+.2} \
             points (target ±{:.0}): check it before deploying it, or try another --method",
            100.0 * rel,
            100.0 * PINBALL_REL_TARGET,
            100.0 * (cq - cf),
            100.0 * COVERAGE_TARGET
        );
    }
    json!({
        "target_units": format!("target / {target_scale:.6e} (the training split's return std)"),
        "f32": f32m,
        "int8": i8m,
        "mean_pinball_f32": pf,
        "mean_pinball_int8": pq,
        "pinball_rel_diff": rel,
        "coverage_f32": cf,
        "coverage_int8": cq,
        "coverage_diff_points": 100.0 * (cq - cf),
    })
}

/// `fx-train quantize` of a TFT run: the best weights of its latest checkpoint quantised
/// with input scales from `windows` forecast windows spread evenly over the training
/// split, written beside the checkpoint (`fx_quant::int8_file::save_tft`), read back
/// through the checked loader and scored against F32 on the test split
/// (`quant_report.json`).
pub(super) fn quantize_tft(dir: &RunDir, cfg: RunConfig, windows: usize, method: fx_quant::CalibMethod) -> Result<()> {
    let (c, d, model) = best_tft_on_cpu(dir, &cfg)?;
    let train = d.data.splits.train.clone();
    let win = SeqTask::window_len(&model);
    let last = train
        .end
        .checked_sub(win)
        .filter(|&l| l >= train.start)
        .context("the training split is shorter than a window")?;
    let span = last - train.start + 1;
    // Equal batches of at most INT8_EVAL_BATCH windows (the calibration pass takes one batch
    // size), spread evenly over the split: up to chunks − 1 fewer windows than asked.
    let want = windows.min(span);
    let chunks = want.div_ceil(INT8_EVAL_BATCH);
    let per = want / chunks;
    let n = per * chunks;
    let starts: Vec<usize> = (0..n).map(|k| train.start + k * span / n).collect();
    let mut calib = Vec::new();
    for chunk in starts.chunks(per) {
        let b = model.batch(&d.series, chunk, &Device::Cpu)?;
        calib.push((b.inputs[0].clone(), b.inputs[1].clone()));
    }
    let q = fx_quant::quantize_tft(&model, &calib, method)?;
    let provenance = fx_quant::int8_file::Provenance {
        source_sha256: fx_quant::int8_file::sha256_file(&c.trainer)?,
        source: c.trainer.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    };
    let out = super::int8_path(&c.trainer);
    fx_quant::int8_file::save_tft(&q, &provenance, &out)?;
    let (q, _) = fx_quant::int8_file::load_tft(&out, Some(&provenance.source_sha256))?;
    let f32_bytes = 4 * model.params().param_count();
    println!(
        "wrote {} ({} TFT matrices INT8, calibrated on {} training-split windows, {method}); weights {:.0} KiB F32 -> \
         {:.0} KiB INT8 ({:.2}x)",
        out.display(),
        q.matrices.len(),
        q.calibration.rows,
        f32_bytes as f64 / 1024.0,
        q.bytes() as f64 / 1024.0,
        f32_bytes as f64 / q.bytes() as f64
    );
    let (f32m, i8m, isa) = tft_int8_metrics(&model, &q, &d)?;
    let mut report = tft_int8_comparison(&f32m, &i8m, d.target_scale());
    let file_bytes = std::fs::metadata(&out).with_context(|| format!("reading {}", out.display()))?.len();
    let head = super::report_head("tft", &c.trainer, &out, &provenance, &q.calibration, TFT_CALIB_FROM);
    super::extend(&mut report, head);
    let sizes = json!({
        "int8_matrices": q.matrices.len(),
        "f32_parameters": q.floats.len(),
        "isa": isa.name(),
        "f32_bytes": f32_bytes,
        "int8_bytes": q.bytes(),
        "size_ratio": f32_bytes as f64 / q.bytes() as f64,
        "file_bytes": file_bytes,
    });
    super::extend(&mut report, sizes);
    write_atomic(&dir.path("quant_report.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
    println!("report: {}", dir.path("quant_report.json").display());
    Ok(())
}

/// `fx-train eval --int8` of a TFT run: the INT8 file of its latest checkpoint (refused if
/// it came from another checkpoint) scored beside F32 on the test split (`eval_int8.json`).
pub(super) fn eval_int8_tft(dir: &RunDir, cfg: RunConfig) -> Result<()> {
    let (c, d, model) = best_tft_on_cpu(dir, &cfg)?;
    let path = super::int8_path(&c.trainer);
    if !path.exists() {
        bail!(
            "{} has no INT8 model for {}: run `fx-train quantize --checkpoint {}` first",
            dir.root().display(),
            c.trainer.file_name().unwrap_or_default().to_string_lossy(),
            dir.root().display()
        );
    }
    let sha = match &c.run.trainer_sha256 {
        Some(s) => s.clone(),
        None => fx_quant::int8_file::sha256_file(&c.trainer)?,
    };
    let (q, provenance) = fx_quant::int8_file::load_tft(&path, Some(&sha))?;
    let (f32m, i8m, isa) = tft_int8_metrics(&model, &q, &d)?;
    let mut doc = tft_int8_comparison(&f32m, &i8m, d.target_scale());
    let head = super::report_head("tft", &c.trainer, &path, &provenance, &q.calibration, TFT_CALIB_FROM);
    super::extend(&mut doc, head);
    super::extend(&mut doc, json!({ "isa": isa.name() }));
    write_atomic(&dir.path("eval_int8.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    println!("report: {}", dir.path("eval_int8.json").display());
    Ok(())
}

/// Issue 13's MAMBA-2 bar: the INT8 step's forecast MSE within this relative distance of
/// the F32 step's.
const MSE_REL_TARGET: f64 = 0.01;

/// `fx-train quantize` and `eval --int8` of a MAMBA-2 run: no file (the INT8 one-bar step,
/// `fx_quant::mamba2_int8_step`, quantises the loaded model's projections with dynamic input
/// scales when it is built); the best weights of the latest checkpoint fed every bar of the
/// series one at a time from a zero state, as a trading loop feeds them, through the F32 CPU
/// step and the INT8 one, scored on the test split's bars (`report` in the run folder).
pub(super) fn int8_mamba2(dir: &RunDir, cfg: RunConfig, report: &str) -> Result<()> {
    let (c, d) = latest_with_data(dir, &cfg)?;
    refuse_panel(dir, &d)?;
    let model = Mamba2::new(cfg.mamba2.clone(), &Device::Cpu, cfg.seed).context("building the MAMBA-2")?;
    let task = Mamba2Task { model: &model, seq_len: cfg.mamba2_seq_len };
    best_weights(&task, &cfg, &c, &d)?;
    let (mut f32_step, mut int8_step) = (model.cpu_step()?, fx_quant::mamba2_int8_step(&model)?);
    let test = d.data.splits.test.clone();
    let target = d.series.targets();
    // Predictions of the test split's bars (each the return from its bar to the next).
    let (mut pf, mut pq, mut ys) = (Vec::new(), Vec::new(), Vec::new());
    for (r, &y) in target.iter().enumerate().take(test.end) {
        let bar = d.series.observed_row(r);
        let (a, b) = (f64::from(f32_step.step(bar)?), f64::from(int8_step.step(bar)?));
        if r >= test.start {
            pf.push(a);
            pq.push(b);
            ys.push(f64::from(y));
        }
    }
    let n = ys.len();
    if n == 0 {
        bail!("{}: the test split holds no bars", dir.root().display());
    }
    let mse = |p: &[f64]| p.iter().zip(&ys).map(|(p, y)| (p - y) * (p - y)).sum::<f64>() / n as f64;
    let (mse_f, mse_q) = (mse(&pf), mse(&pq));
    let max_diff = pf.iter().zip(&pq).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    let (mf, mq) = (forecast_metrics(&[], &[], &pf, &ys)?, forecast_metrics(&[], &[], &pq, &ys)?);
    let rel = if mse_f > 0.0 { (mse_q - mse_f).abs() / mse_f } else { (mse_q - mse_f).abs() };
    let (pb_f, pb_q) = (f32_step.projection_bytes(), int8_step.projection_bytes());
    println!(
        "MAMBA-2 fed {} bars one at a time, scored on the test split's {n}: forecast MSE F32 {mse_f:.5}, INT8 {mse_q:.5} \
         ({:.3}% apart), max |Δprediction| {max_diff:.3e}; directional accuracy {:.2}% / {:.2}%; projections {:.0} KiB \
         F32 -> {:.0} KiB INT8",
        test.end.min(d.series.rows()),
        100.0 * rel,
        100.0 * mf.directional_accuracy,
        100.0 * mq.directional_accuracy,
        pb_f as f64 / 1024.0,
        pb_q as f64 / 1024.0
    );
    if rel > MSE_REL_TARGET {
        eprintln!(
            "warning: the INT8 step's forecast MSE is {:.2}% from F32's (target {:.0}%)",
            100.0 * rel,
            100.0 * MSE_REL_TARGET
        );
    }
    let doc = json!({
        "model": "mamba2",
        "checkpoint": c.trainer.display().to_string(),
        "int8_file": null,
        "int8": "fx_quant::mamba2_int8_step: in_proj and out_proj per-row INT8, dynamic input scales, built from the F32 model",
        "target_units": format!("target / {:.6e} (the training split's return std)", d.target_scale()),
        "test_bars": n,
        "mse_f32": mse_f,
        "mse_int8": mse_q,
        "mse_rel_diff": rel,
        "max_abs_prediction_diff": max_diff,
        "directional_accuracy_f32": mf.directional_accuracy,
        "directional_accuracy_int8": mq.directional_accuracy,
        "projection_bytes_f32": pb_f,
        "projection_bytes_int8": pb_q,
        "isa": fx_quant::Isa::detect().name(),
    });
    write_atomic(&dir.path(report), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    println!("report: {}", dir.path(report).display());
    Ok(())
}
