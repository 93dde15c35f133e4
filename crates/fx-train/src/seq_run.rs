//! `fx-train train|eval` for the sequence models (TFT, MAMBA-2), [`SeqRun`] as a task of
//! the shared `lifecycle`: data → windows → `fx_models::seq::SeqTrainer` epoch by
//! epoch → a checkpoint and a metrics line per epoch → forecast metrics on the test split.
//! The run folder has the RL runs' layout.
//!
//! The target is the next bar's log return in units of its standard deviation over the
//! training rows (so the losses are of order one whatever the bar frequency); inputs are
//! the normalised market features (observed) and the calendar features (known). Losses,
//! MSEs and pinball losses in the report are in those units; directional accuracy,
//! coverage and rank correlation do not depend on them.

use std::ops::{ControlFlow, Range};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fx_models::seq::{
    evaluate, evaluate_forecasts, EpochLog, EvalReport, ForecastMetrics, Mamba2Task, SeqSeries, SeqTask, SeqTrainer,
};
use fx_models::{Mamba2, Tft};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::config::{ModelChoice, RunConfig};
use crate::dataset::Dataset;
use crate::lifecycle::{BarSpec, Chunk, ChunkCtx, RunTask, Timings};
use crate::run_dir::{write_atomic, Checkpoint, RunDir, RunState};
use crate::run_start::{device_for, RunStart};

/// Wall-clock split of a sequence run (seconds).
#[derive(Default, Serialize)]
pub struct SeqProfile {
    /// Loading/computing features, splitting, normalising, building the series.
    pub data_prep: f64,
    /// Training epochs: batches, forward, backward, clipping, optimiser, validation.
    pub train: f64,
    /// Writing checkpoints and metrics.
    pub checkpoint_and_logging: f64,
    /// Forecast metrics on the test split.
    pub evaluation: f64,
    pub other: f64,
    pub total: f64,
    /// GPU runs: the share of the training epochs' time in which a kernel ran on the GPU
    /// (see `gpu_busy`); null on the CPU or without NVML.
    pub gpu_busy_fraction: Option<f64>,
    /// The share of the training epochs' time (validation included) the loop spent
    /// building and uploading training batches (`SeqTrainer::batch_seconds`; nothing
    /// prefetches, so the optimiser waited that long for data: an upper bound on the GPU's
    /// data stall in training; validation's own batch building is not counted).
    pub data_stall_fraction: Option<f64>,
}

/// The report of a sequence run: forecast quality on the test split.
#[derive(Serialize)]
pub struct SeqReport {
    pub model: &'static str,
    pub data_source: String,
    pub test_rows: Range<usize>,
    /// Standard deviation of the next-bar log return over the training rows: the unit of
    /// the targets, losses and MSEs.
    pub target_scale: f64,
    pub epochs_done: usize,
    /// 1-based, as in metrics.jsonl.
    pub best_epoch: usize,
    pub best_val_loss: f64,
    pub stopped_early: bool,
    /// Model loss and MSE of the model, zero and last-value forecasts.
    pub point: EvalReport,
    /// Pinball loss per quantile (TFT), 0.1–0.9 coverage (TFT), directional accuracy and
    /// rank correlation of the point forecast.
    pub forecast: ForecastMetrics,
    /// The model's MSE is below both the zero and the last-value forecast's.
    pub beats_naive: bool,
}

/// The data as the sequence models see it, and the row ranges of the splits.
pub(crate) struct SeqData {
    pub(crate) data: Dataset,
    pub(crate) series: SeqSeries,
    pub(crate) target_scale: f64,
}

fn seq_data(cfg: &RunConfig, saved_norm: Option<fx_data::Normalizer>) -> Result<SeqData> {
    let data = Dataset::load(cfg, saved_norm.map(|n| vec![n]))?;
    let rows = data.single().store.rows();
    let mut market = data.single().store.market_rows(0..rows).to_vec();
    data.single().normalizer.apply_in_place(&mut market);
    let ret = data.single().store.logret_next();
    let train = &ret[data.splits.train.clone()];
    let mean = train.iter().map(|&v| v as f64).sum::<f64>() / train.len().max(1) as f64;
    let var = train.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / train.len().max(1) as f64;
    let target_scale = if var.sqrt() > 0.0 { var.sqrt() } else { 1.0 };
    let target: Vec<f32> = ret.iter().map(|&v| (v as f64 / target_scale) as f32).collect();
    let series = SeqSeries::new(
        market,
        fx_kernels::N_MARKET,
        data.single().store.known().to_vec(),
        fx_data::features::N_KNOWN,
        target,
    )
    .with_context(|| format!("building the sequence series from {}", data.source))?;
    Ok(SeqData { data, series, target_scale })
}

/// Checks that every split holds at least one window of `len` rows.
fn check_windows(d: &SeqData, len: usize, batch_size: usize) -> Result<()> {
    let s = &d.data.splits;
    let train_windows = s.train.len().saturating_sub(len) + 1;
    if s.train.len() >= len && batch_size > train_windows {
        bail!(
            "seq.batch_size {batch_size} exceeds the {train_windows} training windows of {} (use a smaller batch or more data)",
            d.data.source
        );
    }
    for (name, r) in [("training", &s.train), ("validation", &s.valid), ("test", &s.test)] {
        if r.len() < len {
            bail!(
                "{}: the {name} split has {} rows, a window needs {len} (use more data or a shorter L_enc/H/mamba2_seq_len)",
                d.data.source,
                r.len()
            );
        }
    }
    Ok(())
}

/// The run's model, owned (a MAMBA-2 reaches the trainer through a [`Mamba2Task`], which
/// borrows it).
enum SeqModel {
    Tft(Box<Tft>),
    // Boxed like the TFT: with the cuda feature the model holds its fused step's buffers.
    Mamba2 { model: Box<Mamba2>, seq_len: usize },
}

impl SeqModel {
    /// The config's model, its weights seeded by the run's seed.
    fn new(cfg: &RunConfig, device: &Device) -> Result<Self> {
        Ok(match cfg.model {
            ModelChoice::Tft => {
                SeqModel::Tft(Box::new(Tft::new(cfg.tft.clone(), device, cfg.seed).context("building the TFT")?))
            }
            ModelChoice::Mamba2 => SeqModel::Mamba2 {
                model: Box::new(Mamba2::new(cfg.mamba2.clone(), device, cfg.seed).context("building the MAMBA-2")?),
                seq_len: cfg.mamba2_seq_len,
            },
            other => bail!("{} is not a sequence model", other.as_str()),
        })
    }

    /// Calls `f` with the model as a [`SeqTask`] (behind the object-safe [`SeqTaskRun`]).
    fn with<R>(&self, f: impl FnOnce(&dyn SeqTaskRun) -> R) -> R {
        match self {
            SeqModel::Tft(m) => f(m.as_ref()),
            SeqModel::Mamba2 { model, seq_len } => f(&Mamba2Task { model, seq_len: *seq_len }),
        }
    }
}

/// What a run does with its model, written once over every [`SeqTask`] and object-safe so
/// that [`SeqModel::with`] can hand either model over.
trait SeqTaskRun {
    fn window_len(&self) -> usize;
    /// A new trainer, or one restored from checkpoint `c` (weights, optimiser, counters).
    fn trainer(&self, cfg: &RunConfig, c: Option<&Checkpoint>, d: &SeqData) -> Result<SeqTrainer>;
    /// One epoch and its validation; `None` when `on_batch` stopped it half-way.
    fn train_epoch(
        &self,
        trainer: &mut SeqTrainer,
        d: &SeqData,
        on_batch: &mut dyn FnMut(usize, f64) -> ControlFlow<()>,
    ) -> Result<Option<EpochLog>>;
    fn save_state(&self, trainer: &SeqTrainer, path: &Path) -> Result<()>;
    /// The best epoch's weights loaded, the forecast metrics on the test split.
    fn evaluate(&self, trainer: &SeqTrainer, cfg: &RunConfig, d: &SeqData) -> Result<SeqReport>;
    fn forecast_plot(&self, cfg: &RunConfig, d: &SeqData, dir: &RunDir) -> Result<()>;
    fn eval(&self, cfg: &RunConfig, dir: &RunDir, c: &Checkpoint, d: &SeqData) -> Result<()>;
}

impl<T: SeqTask> SeqTaskRun for T {
    fn window_len(&self) -> usize {
        SeqTask::window_len(self)
    }
    fn trainer(&self, cfg: &RunConfig, c: Option<&Checkpoint>, d: &SeqData) -> Result<SeqTrainer> {
        match c {
            Some(c) => restored(self, cfg, c, d),
            None => Ok(SeqTrainer::new(self, d.data.splits.train.clone(), &cfg.seq)?),
        }
    }
    fn train_epoch(
        &self,
        trainer: &mut SeqTrainer,
        d: &SeqData,
        on_batch: &mut dyn FnMut(usize, f64) -> ControlFlow<()>,
    ) -> Result<Option<EpochLog>> {
        Ok(trainer.train_epoch_with(self, &d.series, d.data.splits.valid.clone(), on_batch)?)
    }
    fn save_state(&self, trainer: &SeqTrainer, path: &Path) -> Result<()> {
        Ok(trainer.save_state(self, path)?)
    }
    fn evaluate(&self, trainer: &SeqTrainer, cfg: &RunConfig, d: &SeqData) -> Result<SeqReport> {
        trainer.finish(self)?;
        report(self, cfg, d, trainer)
    }
    fn forecast_plot(&self, cfg: &RunConfig, d: &SeqData, dir: &RunDir) -> Result<()> {
        forecast_plot(self, cfg, d, dir)
    }
    fn eval(&self, cfg: &RunConfig, dir: &RunDir, c: &Checkpoint, d: &SeqData) -> Result<()> {
        let trainer = best_weights(self, cfg, c, d)?;
        let rep = report(self, cfg, d, &trainer)?;
        write_report(dir, "eval.json", &rep, None)?;
        print(&rep, None, dir);
        Ok(())
    }
}

/// A trainer restored from checkpoint `c` (weights, optimiser, counters).
fn restored(task: &impl SeqTask, cfg: &RunConfig, c: &Checkpoint, d: &SeqData) -> Result<SeqTrainer> {
    let mut t = SeqTrainer::new(task, d.data.splits.train.clone(), &cfg.seq)?;
    t.load_state(task, &c.trainer)
        .with_context(|| format!("loading {} checkpoint {}", cfg.model.as_str(), c.trainer.display()))?;
    Ok(t)
}

/// A trainer restored from checkpoint `c` with its best epoch's weights loaded into `task`'s
/// model (what `eval`, `quantize` and `eval --int8` score).
pub(crate) fn best_weights(task: &impl SeqTask, cfg: &RunConfig, c: &Checkpoint, d: &SeqData) -> Result<SeqTrainer> {
    let trainer = restored(task, cfg, c, d)?;
    trainer.finish(task).with_context(|| format!("{}: no epoch is done yet", c.trainer.display()))?;
    Ok(trainer)
}

/// A finished command's view of a run: its latest checkpoint (of the config's model) and
/// the data it was trained on, normalised as then (refused if the config now names other
/// data).
pub(crate) fn latest_with_data(dir: &RunDir, cfg: &RunConfig) -> Result<(Checkpoint, SeqData)> {
    let Some(c) = dir.latest_checkpoint()? else {
        bail!("{} holds no checkpoint yet", dir.root().display());
    };
    c.check_model(cfg.model, "config.toml says")?;
    let d = seq_data(cfg, Some(c.run.normalizer()?))?;
    c.check_source(&d.data.source, "config.toml now names")?;
    Ok((c, d))
}

/// A TFT or MAMBA-2 run being trained: a chunk is an epoch (stopped at the next batch by
/// a signal), with a metrics line and a checkpoint after each; the initial state is
/// checkpointed too, and nothing after an interruption (a half-done epoch cannot be saved:
/// the run resumes from the last epoch's checkpoint). A resumed run continues under the
/// config it started with (its schedule spans the epochs it was started for).
pub(crate) struct SeqRun {
    cfg: RunConfig,
    d: Arc<SeqData>,
    model: SeqModel,
    trainer: SeqTrainer,
    batches_per_epoch: u64,
    /// The trainer's batch-building seconds when this run (or resume) started.
    batch_seconds_start: f64,
    /// The epoch just trained, for its metrics line.
    last: Option<EpochDone>,
}

struct EpochDone {
    /// 1-based.
    epoch: usize,
    log: EpochLog,
    seconds: f64,
    /// Of `seconds`: building and uploading training batches.
    batch_seconds: f64,
}

impl RunTask for SeqRun {
    type Data = SeqData;
    const CHECKPOINT_FIRST: bool = true;
    const CHECKPOINT_LAST: bool = false;

    fn load_data(start: &RunStart) -> Result<SeqData> {
        seq_data(&start.cfg, start.saved_normalizer()?)
    }

    fn data_source(d: &SeqData) -> &str {
        &d.data.source
    }

    fn build(start: &mut RunStart, d: &Arc<SeqData>) -> Result<Self> {
        let model = SeqModel::new(&start.cfg, &start.device)?;
        let len = model.with(|t| t.window_len());
        let train_windows = d.data.splits.train.len().saturating_sub(len) + 1;
        start.settle_batch(Some(train_windows))?;
        check_windows(d, len, start.cfg.seq.batch_size)?;
        let cfg = start.cfg.clone();
        let trainer = model.with(|t| t.trainer(&cfg, start.checkpoint.as_ref(), d))?;
        Ok(Self {
            batches_per_epoch: trainer.batches_per_epoch() as u64,
            batch_seconds_start: trainer.batch_seconds(),
            cfg,
            d: d.clone(),
            model,
            trainer,
            last: None,
        })
    }

    fn bar(&self) -> BarSpec {
        let bpe = self.batches_per_epoch;
        BarSpec { len: bpe * self.cfg.seq.epochs as u64, pos: bpe * self.trainer.epochs_done() as u64, unit: "batches" }
    }

    fn is_done(&self) -> bool {
        self.trainer.is_done()
    }

    fn step_chunk(&mut self, ctx: &ChunkCtx) -> Result<Chunk> {
        let t_epoch = Instant::now();
        let batch_seconds_before = self.trainer.batch_seconds();
        let epoch = self.trainer.epochs_done() + 1;
        let epochs = self.cfg.seq.epochs;
        let Self { model, trainer, d, .. } = self;
        let mut on_batch = |_, loss: f64| {
            ctx.bar.inc(1);
            ctx.bar.set_message(format!("epoch {epoch}/{epochs} | loss {loss:.4}"));
            if ctx.stop_requested() {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let Some(log) = model.with(|t| t.train_epoch(trainer, d, &mut on_batch))? else {
            return Ok(Chunk::Stopped);
        };
        let batch_seconds = self.trainer.batch_seconds() - batch_seconds_before;
        self.last = Some(EpochDone { epoch, log, seconds: t_epoch.elapsed().as_secs_f64(), batch_seconds });
        Ok(Chunk::Trained { log: true, checkpoint: true })
    }

    fn metrics(&mut self, _: &ChunkCtx) -> Result<Map<String, Value>> {
        let e = self.last.as_ref().context("no epoch was trained")?;
        let secs = e.seconds.max(1e-9);
        let rec = json!({
            "epoch": e.epoch,
            "steps": self.trainer.step(),
            "train_loss": e.log.train_loss,
            "val_loss": e.log.val_loss,
            "best_val_loss": self.trainer.best().map(|b| b.1),
            "lr": e.log.lr,
            "train_samples_per_s": self.batches_per_epoch as f64 * self.cfg.seq.batch_size as f64 / secs,
            "data_stall_fraction": e.batch_seconds / secs,
        });
        match rec {
            Value::Object(m) => Ok(m),
            _ => unreachable!("json! of an object"),
        }
    }

    fn checkpoint(&mut self, dir: &RunDir, train_seconds: f64, _last: bool) -> Result<()> {
        let (cfg, d) = (&self.cfg, &self.d);
        let epochs = self.trainer.epochs_done() as u64;
        let run =
            RunState::new_seq(cfg.model, epochs, &d.data.single().normalizer, d.data.source.clone(), train_seconds);
        let (model, trainer) = (&self.model, &self.trainer);
        dir.write_checkpoint(&run, cfg.keep_checkpoints, |p| model.with(|t| t.save_state(trainer, p)))?;
        Ok(())
    }

    fn interrupted_line(&self, dir: &Path) -> String {
        format!(
            "interrupted in epoch {}: the checkpoint after epoch {} is in {}; continue with `fx-train train --resume --out {}`",
            self.trainer.epochs_done() + 1,
            self.trainer.epochs_done(),
            dir.display(),
            dir.display()
        )
    }

    fn report(self, dir: &RunDir, times: Timings) -> Result<()> {
        let Self { cfg, d, model, trainer, batch_seconds_start, .. } = self;
        let mut profile = SeqProfile {
            data_prep: times.data_prep,
            train: times.train,
            checkpoint_and_logging: times.checkpoint_and_logging,
            gpu_busy_fraction: times.gpu_busy_fraction,
            ..SeqProfile::default()
        };
        if profile.train > 0.0 {
            profile.data_stall_fraction = Some((trainer.batch_seconds() - batch_seconds_start) / profile.train);
        }
        let t = Instant::now();
        let rep = model.with(|t| t.evaluate(&trainer, &cfg, &d))?;
        profile.evaluation = t.elapsed().as_secs_f64();
        profile.total = times.t_start.elapsed().as_secs_f64();
        let accounted = profile.data_prep + profile.train + profile.checkpoint_and_logging + profile.evaluation;
        profile.other = (profile.total - accounted).max(0.0);
        write_report(dir, "report.json", &rep, Some(&profile))?;
        crate::plots::training_curves(
            dir,
            "epoch",
            "epoch",
            &[("training loss (mean over the epoch)", "train_loss"), ("validation loss", "val_loss")],
        )?;
        model.with(|t| t.forecast_plot(&cfg, &d, dir))?;
        print(&rep, Some(&profile), dir);
        Ok(())
    }
}

/// `forecast.png`: over the test split, the equity of holding the sign of each bar's
/// one-bar-ahead forecast (long or short, no costs) against buy-and-hold.
fn forecast_plot(task: &impl SeqTask, cfg: &RunConfig, d: &SeqData, dir: &RunDir) -> Result<()> {
    let test = d.data.splits.test.clone();
    let len = task.window_len();
    let starts: Vec<usize> = (test.start..=test.end - len).collect();
    let c = fx_models::Ctx::inference(cfg.precision);
    let device = task.params().device().clone();
    let (mut strat, mut hold) = (vec![1.0f64], vec![1.0f64]);
    for chunk in starts.chunks(cfg.seq.batch_size.max(1)) {
        let batch = task.batch(&d.series, chunk, &device)?;
        let point = task.point(&c, &batch)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        let target = batch.target.to_vec2::<f32>()?;
        // The forecast for the bar after the window's last observed row.
        let col = task.next_bar().column;
        for (p, t) in point.iter().zip(&target) {
            let r = t[col] as f64 * d.target_scale;
            let pos = if p[col] > 0.0 {
                1.0
            } else if p[col] < 0.0 {
                -1.0
            } else {
                0.0
            };
            strat.push(strat[strat.len() - 1] * (pos * r).exp());
            hold.push(hold[hold.len() - 1] * r.exp());
        }
    }
    // Point 0 stands at the first window's forecast row (before its return), point j at
    // the bar j rows later (after j returns): dated by those bars' timestamps. The last
    // point stands one bar past the data (the last row's next-bar return has no bar
    // after it); the axis dates it as the last bar.
    let ts = d.data.single().store.timestamps();
    let first = (test.start + task.next_bar().row).min(ts.len());
    let dates = Some(&ts[first..(first + strat.len()).min(ts.len())]).filter(|d| !d.is_empty());
    crate::plots::curves(
        dir,
        "forecast.png",
        dates,
        "test split: long/short on the sign of the one-bar forecast (no costs)",
        &[
            ("sign of forecast", &strat, plotters::style::RGBColor(31, 119, 180)),
            ("buy & hold", &hold, plotters::style::RGBColor(255, 127, 14)),
        ],
    )
}

fn report(task: &impl SeqTask, cfg: &RunConfig, d: &SeqData, trainer: &SeqTrainer) -> Result<SeqReport> {
    let test = d.data.splits.test.clone();
    let (bs, p) = (cfg.seq.batch_size, cfg.precision);
    let point = evaluate(task, &d.series, test.clone(), bs, p).context("evaluating on the test split")?;
    let forecast = evaluate_forecasts(task, &d.series, test.clone(), bs, p).context("forecast metrics")?;
    let (best_epoch, best_val_loss) = trainer.best().context("no epoch ran")?;
    let rep = trainer.log();
    Ok(SeqReport {
        model: cfg.model.as_str(),
        data_source: d.data.source.clone(),
        test_rows: test,
        target_scale: d.target_scale,
        epochs_done: trainer.epochs_done(),
        best_epoch: best_epoch + 1,
        best_val_loss,
        stopped_early: trainer.is_done() && rep.len() < cfg.seq.epochs,
        beats_naive: point.mse_model < point.mse_zero && point.mse_model < point.mse_last,
        point,
        forecast,
    })
}

fn write_report(dir: &RunDir, name: &str, rep: &SeqReport, profile: Option<&SeqProfile>) -> Result<()> {
    let mut doc = serde_json::to_value(rep)?;
    doc["profile"] = serde_json::to_value(profile)?;
    write_atomic(&dir.path(name), serde_json::to_string_pretty(&doc)?.as_bytes())
}

fn print(rep: &SeqReport, profile: Option<&SeqProfile>, dir: &RunDir) {
    println!(
        "forecasts of {} on the test split ({} rows {}..{} of {}; after {} epochs, best {} with validation loss {:.4})",
        rep.model,
        rep.test_rows.len(),
        rep.test_rows.start,
        rep.test_rows.end,
        rep.data_source,
        rep.epochs_done,
        rep.best_epoch,
        rep.best_val_loss
    );
    println!("next-bar log return in units of its training-split std ({:.3e})", rep.target_scale);
    println!("{:<12} {:>10}", "forecast", "MSE");
    println!("{:<12} {:>10.4}", "model", rep.point.mse_model);
    println!("{:<12} {:>10.4}", "zero", rep.point.mse_zero);
    println!("{:<12} {:>10.4}", "last value", rep.point.mse_last);
    let f = &rep.forecast;
    for (q, l) in f.levels.iter().zip(&f.pinball) {
        println!("pinball loss q={q:<4} {l:.4}");
    }
    if let Some(c) = f.interval_coverage {
        let (lo, hi) = (f.levels.first().copied().unwrap_or(0.0), f.levels.last().copied().unwrap_or(1.0));
        println!("coverage of the {lo}–{hi} band: {:.1}% (nominal {:.0}%)", 100.0 * c, 100.0 * (hi - lo));
    }
    println!(
        "directional accuracy {:.1}%, rank correlation {:.3} over {} forecasts",
        100.0 * f.directional_accuracy,
        f.rank_correlation,
        f.n
    );
    println!(
        "{}",
        if rep.beats_naive {
            "the model beat the zero and last-value forecasts on held-out data"
        } else {
            "the model did NOT beat both the zero and last-value forecasts on held-out data"
        }
    );
    if let Some(p) = profile {
        println!(
            "time: {:.1}s total = data {:.1}s + training {:.1}s + checkpoints/logs {:.1}s + eval {:.1}s + other {:.1}s",
            p.total, p.data_prep, p.train, p.checkpoint_and_logging, p.evaluation, p.other
        );
        if let Some(b) = p.gpu_busy_fraction {
            println!("GPU busy: {:.1}% of the training epochs (driver utilisation samples)", 100.0 * b);
        }
        if let Some(f) = p.data_stall_fraction {
            println!("data stall: {:.1}% of the training epochs building and uploading batches", 100.0 * f);
        }
    }
    println!("run folder: {}", dir.root().display());
}

/// `fx-train eval` of a sequence run: the best weights of its latest checkpoint, forecast
/// metrics on the test split (written to `eval.json`).
pub fn eval(dir: &RunDir, cfg: RunConfig) -> Result<()> {
    let (c, d) = latest_with_data(dir, &cfg)?;
    let device = device_for(&cfg)?;
    SeqModel::new(&cfg, &device)?.with(|task| task.eval(&cfg, dir, &c, &d))
}
