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
//!
//! On a panel, the series is every instrument's rows one after another, each instrument
//! normalised and scaled by its own training rows; a split is one span per instrument
//! (windows never cross instruments or splits), training windows are drawn from all of
//! them, and the model is built for the panel: the TFT takes the instrument as a static
//! covariate, MAMBA-2 a learned instrument embedding added to its input
//! (`fx_models::seq::SeqSeries::with_instruments`). The report gives the pooled metrics,
//! each instrument's, and the sign strategy per instrument and as an equal-weight
//! portfolio, as an RL panel's report does.

use std::ops::{ControlFlow, Range};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fx_models::seq::{
    evaluate, evaluate_forecasts, EpochLog, EvalReport, ForecastMetrics, Mamba2Task, SeqSeries, SeqTask, SeqTrainer,
    Spans,
};
use fx_models::{Backtest, Mamba2, Tft};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::config::{ModelChoice, RunConfig};
use crate::dataset::{own_rows, Dataset};
use crate::lifecycle::{BarSpec, Chunk, ChunkCtx, RunTask, Timings};
use crate::report::{InstrumentReport, Leg};
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

/// The report of a sequence run: forecast quality on the test split (a sweep's trial:
/// the validation split, `RunConfig::validation_only`).
#[derive(Serialize)]
pub struct SeqReport {
    pub model: &'static str,
    pub data_source: String,
    /// `test`, or `validation` for a sweep's trial.
    pub split: &'static str,
    /// The split's (calendar) rows.
    pub rows: Range<usize>,
    /// Standard deviation of the next-bar log return over the training rows: the unit of
    /// the targets, losses and MSEs (a panel: the median of its instruments', each of
    /// which is in `instrument_forecasts`).
    pub target_scale: f64,
    pub epochs_done: usize,
    /// Optimiser steps taken, and of them skipped by the non-finite guard.
    pub steps: usize,
    pub skipped_steps: usize,
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
    /// A panel's instruments, each scored on its own rows of the split (the metrics above
    /// pool them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instrument_forecasts: Vec<InstrumentForecast>,
    /// Bars per year of the data (the backtests' annualisation).
    pub periods_per_year: f64,
    /// What `backtest.agent` trades ([`SIGN_RULE`]).
    pub strategy: &'static str,
    /// The strategy's backtest on the test split beside the baselines; its entries sit at
    /// the report's top level as `agent`, `buy_and_hold`, `flat`, `random`, as in an RL
    /// run's report.
    #[serde(flatten)]
    pub backtest: SignBacktest,
}

/// One instrument's forecasts in a panel's report.
#[derive(Serialize)]
pub struct InstrumentForecast {
    pub name: String,
    /// Its training rows' next-bar return std (the unit of its targets and MSEs).
    pub target_scale: f64,
    pub point: EvalReport,
    pub forecast: ForecastMetrics,
    pub beats_naive: bool,
}

/// The data as the sequence models see it: the series (a panel's instruments one after
/// another) and where each instrument's rows start in it.
pub(crate) struct SeqData {
    pub(crate) data: Dataset,
    pub(crate) series: SeqSeries,
    /// Per instrument of `data`: the series row of its first row, and its target scale.
    parts: Vec<(usize, f64)>,
}

impl SeqData {
    /// Each instrument's rows of the calendar span, as series rows (one range per
    /// instrument).
    pub(crate) fn spans(&self, span: &Range<usize>) -> Spans {
        Spans::new((0..self.parts.len()).map(|i| self.instrument_rows(i, span)).collect())
    }

    /// Instrument `i`'s rows of the calendar span, as series rows.
    fn instrument_rows(&self, i: usize, span: &Range<usize>) -> Range<usize> {
        let own = own_rows(&self.data.instruments[i].calendar_rows, span);
        let at = self.parts[i].0;
        at + own.start..at + own.end
    }

    /// The unit of the targets: one instrument's, or the median of a panel's.
    pub(crate) fn target_scale(&self) -> f64 {
        let mut s: Vec<f64> = self.parts.iter().map(|p| p.1).collect();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    }

    /// Instruments of the panel the model is built for (0 for one instrument).
    fn n_instruments(&self) -> usize {
        if self.data.is_panel() {
            self.parts.len()
        } else {
            0
        }
    }
}

fn seq_data(cfg: &RunConfig, saved_norms: Option<Vec<fx_data::Normalizer>>) -> Result<SeqData> {
    let data = Dataset::load(cfg, saved_norms)?;
    let (mut market, mut known, mut target, mut ids) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut parts = Vec::with_capacity(data.instruments.len());
    for (i, inst) in data.instruments.iter().enumerate() {
        let rows = inst.store.rows();
        let mut m = inst.store.market_rows(0..rows).to_vec();
        inst.normalizer.apply_in_place(&mut m);
        let ret = inst.store.logret_next();
        let train = &ret[own_rows(&inst.calendar_rows, &data.splits.train)];
        let mean = train.iter().map(|&v| v as f64).sum::<f64>() / train.len().max(1) as f64;
        let var = train.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / train.len().max(1) as f64;
        let scale = if var.sqrt() > 0.0 { var.sqrt() } else { 1.0 };
        parts.push((target.len(), scale));
        market.extend(m);
        known.extend_from_slice(inst.store.known());
        target.extend(ret.iter().map(|&v| (v as f64 / scale) as f32));
        ids.extend(std::iter::repeat_n(i as u32, rows));
    }
    let context = || format!("building the sequence series from {}", data.source);
    let mut series = SeqSeries::new(market, fx_kernels::N_MARKET, known, fx_data::features::N_KNOWN, target)
        .with_context(context)?;
    if data.is_panel() {
        series = series.with_instruments(ids, parts.len()).with_context(context)?;
    }
    Ok(SeqData { data, series, parts })
}

/// The rows one window of `cfg`'s forecaster reaches (the model's `window_len`, from its
/// config alone).
pub(crate) fn window_len(cfg: &RunConfig) -> Result<usize> {
    Ok(match cfg.model {
        ModelChoice::Tft => cfg.tft.window_len(),
        ModelChoice::Mamba2 => Mamba2Task::window_len_of(cfg.mamba2_seq_len),
        other => bail!("{} is not a sequence model", other.as_str()),
    })
}

/// Checks that every split holds at least one window of `len` rows (a panel: in at
/// least one instrument's rows of it).
fn check_windows(d: &SeqData, len: usize, batch_size: usize) -> Result<()> {
    let s = &d.data.splits;
    let train_windows = d.spans(&s.train).window_starts(len).len();
    if train_windows > 0 && batch_size > train_windows {
        bail!(
            "seq.batch_size {batch_size} exceeds the {train_windows} training windows of {} (use a smaller batch or more data)",
            d.data.source
        );
    }
    for (name, r) in [("training", &s.train), ("validation", &s.valid), ("test", &s.test)] {
        let spans = d.spans(r);
        if spans.window_starts(len).is_empty() {
            let most = spans.ranges().iter().map(|r| r.len()).max().unwrap_or(0);
            let rows = if d.data.is_panel() {
                format!("at most {most} rows of an instrument")
            } else {
                format!("{most} rows")
            };
            bail!(
                "{}: the {name} split has {rows}, a window needs {len} (use more data or a shorter L_enc/H/mamba2_seq_len)",
                d.data.source
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
    /// The config's model for `d` (a panel's: built for its instruments), its weights
    /// seeded by the run's seed.
    fn new(cfg: &RunConfig, d: &SeqData, device: &Device) -> Result<Self> {
        let n = d.n_instruments();
        Ok(match cfg.model {
            ModelChoice::Tft => {
                SeqModel::Tft(Box::new(Tft::new(panel_tft(cfg, n)?, device, cfg.seed).context("building the TFT")?))
            }
            ModelChoice::Mamba2 => SeqModel::Mamba2 {
                model: Box::new(Mamba2::new(panel_mamba2(cfg, n), device, cfg.seed).context("building the MAMBA-2")?),
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

/// `cfg`'s TFT for a panel of `n` instruments (0: one instrument, the spec's model): the
/// instrument count comes from the data, so a config's own `[tft] n_instruments` must be
/// absent (0) or that count, never overwritten in silence.
pub(crate) fn panel_tft(cfg: &RunConfig, n: usize) -> Result<fx_models::TftConfig> {
    let set = cfg.tft.n_instruments;
    if set != 0 && set != n {
        bail!(
            "[tft] n_instruments = {set}, but the data has {}: the count is taken from the data (leave the key out)",
            if n == 0 { "one instrument".to_string() } else { format!("{n} instruments") }
        );
    }
    Ok(fx_models::TftConfig { n_instruments: n, ..cfg.tft.clone() })
}

/// `cfg`'s MAMBA-2 for a panel of `n` instruments: its input is the features and the
/// instrument's one-hot row, so `embed` adds a learned embedding of the instrument.
pub(crate) fn panel_mamba2(cfg: &RunConfig, n: usize) -> fx_models::Mamba2Config {
    fx_models::Mamba2Config { n_in: cfg.mamba2.n_in + n, ..cfg.mamba2.clone() }
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
    /// A fresh trainer's model set to another run's best-validation weights (`init_from`).
    fn warm_start(&self, trainer: &mut SeqTrainer, path: &Path) -> Result<()>;
    /// The best epoch's weights loaded, the forecast metrics on the test split.
    fn evaluate(&self, trainer: &SeqTrainer, cfg: &RunConfig, d: &SeqData) -> Result<SeqReport>;
    fn eval(&self, cfg: &RunConfig, dir: &RunDir, c: &Checkpoint, d: &SeqData) -> Result<()>;
}

impl<T: SeqTask> SeqTaskRun for T {
    fn window_len(&self) -> usize {
        SeqTask::window_len(self)
    }
    fn trainer(&self, cfg: &RunConfig, c: Option<&Checkpoint>, d: &SeqData) -> Result<SeqTrainer> {
        match c {
            Some(c) => restored(self, cfg, c, d),
            None => Ok(SeqTrainer::new(self, d.spans(&d.data.splits.train), &cfg.seq)?),
        }
    }
    fn train_epoch(
        &self,
        trainer: &mut SeqTrainer,
        d: &SeqData,
        on_batch: &mut dyn FnMut(usize, f64) -> ControlFlow<()>,
    ) -> Result<Option<EpochLog>> {
        Ok(trainer.train_epoch_with(self, &d.series, d.spans(&d.data.splits.valid), on_batch)?)
    }
    fn save_state(&self, trainer: &SeqTrainer, path: &Path) -> Result<()> {
        Ok(trainer.save_state(self, path)?)
    }
    fn warm_start(&self, trainer: &mut SeqTrainer, path: &Path) -> Result<()> {
        trainer.warm_start(self, path).context("warm start")
    }
    fn evaluate(&self, trainer: &SeqTrainer, cfg: &RunConfig, d: &SeqData) -> Result<SeqReport> {
        trainer.finish(self)?;
        report(self, cfg, d, trainer)
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
    let mut t = SeqTrainer::new(task, d.spans(&d.data.splits.train), &cfg.seq)?;
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
    let d = seq_data(cfg, Some(c.run.normalizers()?))?;
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
        seq_data(&start.cfg, start.saved_normalizers()?)
    }

    fn data_source(d: &SeqData) -> &str {
        &d.data.source
    }

    fn build(start: &mut RunStart, d: &Arc<SeqData>) -> Result<Self> {
        let model = SeqModel::new(&start.cfg, d, &start.device)?;
        let len = model.with(|t| t.window_len());
        let train_windows = d.spans(&d.data.splits.train).window_starts(len).len();
        start.settle_batch(Some(train_windows))?;
        check_windows(d, len, start.cfg.seq.batch_size)?;
        let cfg = start.cfg.clone();
        let mut trainer = model.with(|t| t.trainer(&cfg, start.checkpoint.as_ref(), d))?;
        if let (None, Some(from)) = (&start.checkpoint, &cfg.init_from) {
            model.with(|t| t.warm_start(&mut trainer, from))?;
        }
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
            "skipped_steps": self.trainer.log().iter().map(|e| e.skipped).sum::<usize>(),
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
        let run = RunState::new_seq(cfg.model, epochs, &d.data.normalizers(), d.data.source.clone(), train_seconds);
        let (model, trainer) = (&self.model, &self.trainer);
        dir.write_checkpoint(&run, cfg.keep_checkpoints, |p| model.with(|t| t.save_state(trainer, p)))?;
        Ok(())
    }

    fn progress(&self) -> Option<u64> {
        Some(self.trainer.epochs_done() as u64)
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
        forecast_plot(&rep, &d, dir)?;
        // A sweep's trials are summed up by its leaderboard.
        if !cfg.validation_only {
            print(&rep, Some(&profile), dir);
        }
        Ok(())
    }
}

/// The trading rule a forecaster's report backtests (the `agent` of its report, named as
/// an RL run's so that a study reads either).
pub(crate) const SIGN_RULE: &str =
    "long/short on the sign of each bar's one-bar forecast (flat at 0), env.cost per unit of position change";

/// The sign-of-forecast strategy on the test split ([`SIGN_RULE`]) beside buy-and-hold,
/// flat and random positions (random from `cfg.seed`, plus the instrument's index in a
/// panel), accounted as the RL backtests are: a position taken at row `r` earns
/// `r → r + 1`, and only returns realised inside the test span count, so one fold's
/// strategy never reads the next span's bars. A panel's: each instrument's on its own
/// rows of the span, and their equal-weight portfolio.
#[derive(Serialize)]
pub struct SignBacktest {
    pub agent: Backtest,
    pub buy_and_hold: Backtest,
    pub flat: Backtest,
    pub random: Backtest,
    /// A panel's instruments, each traded on its own rows of the span.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instruments: Vec<InstrumentReport>,
    /// Panel instruments left out of the run, or without a forecast to trade in the span.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub excluded_instruments: Vec<String>,
    /// The calendar row each step starts at.
    #[serde(skip)]
    pub step_rows: Vec<usize>,
}

fn sign_backtest(task: &impl SeqTask, cfg: &RunConfig, d: &SeqData, span: &Range<usize>) -> Result<SignBacktest> {
    let (len, next) = (task.window_len(), task.next_bar());
    let c = fx_models::Ctx::inference(cfg.precision);
    let device = task.params().device().clone();
    let (mut legs, mut excluded) = (Vec::new(), d.data.excluded.clone());
    for (i, inst) in d.data.instruments.iter().enumerate() {
        let rows = d.instrument_rows(i, span);
        // Window `s` forecasts the return from row `s + next.row` to the row after it.
        let starts: Vec<usize> =
            Spans::from(rows.clone()).window_starts(len).into_iter().filter(|s| s + next.row + 1 < rows.end).collect();
        if starts.is_empty() {
            excluded.push(inst.name.clone());
            continue;
        }
        let mut positions: Vec<i8> = Vec::with_capacity(starts.len());
        for chunk in starts.chunks(cfg.seq.batch_size.max(1)) {
            let batch = task.batch(&d.series, chunk, &device)?;
            let point = task.point(&c, &batch)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
            positions.extend(point.iter().map(|p| match p[next.column] {
                x if x > 0.0 => 1i8,
                x if x < 0.0 => -1,
                _ => 0,
            }));
        }
        // The instrument's own row of the first step.
        let (n, first) = (positions.len(), starts[0] + next.row - d.parts[i].0);
        let close = &inst.store.close()[first..first + n + 1];
        let steps = inst.calendar_rows[first..first + n].iter().map(|&r| r - span.start).collect();
        legs.push(Leg::new(cfg, &d.data, i, steps, &positions, close)?);
    }
    if legs.is_empty() {
        bail!(
            "{}: the split's {} rows leave no one-bar forecast to backtest inside it (a window is {len} rows)",
            d.data.source,
            span.len()
        );
    }
    let b = crate::report::combine_legs(cfg, &d.data, span, legs, excluded)?;
    Ok(SignBacktest {
        agent: b.agent,
        buy_and_hold: b.buy_and_hold,
        flat: b.flat,
        random: b.random,
        instruments: b.instruments,
        excluded_instruments: if d.data.is_panel() { b.excluded } else { Vec::new() },
        step_rows: b.step_rows,
    })
}

/// `forecast.png`: over the report's split, the equity of the report's sign strategy
/// ([`SIGN_RULE`]) against buy-and-hold, dated by the bars each step ends at.
fn forecast_plot(rep: &SeqReport, d: &SeqData, dir: &RunDir) -> Result<()> {
    let b = &rep.backtest;
    let with_start = |e: &[f64]| std::iter::once(1.0).chain(e.iter().copied()).collect::<Vec<f64>>();
    let (strat, hold) = (with_start(&b.agent.equity), with_start(&b.buy_and_hold.equity));
    // Point 0 stands at the first step's row (before its return), point j at the row j
    // bars later (after j returns).
    let ts = &d.data.calendar;
    let first = b.step_rows[0];
    let dates = Some(&ts[first..(first + strat.len()).min(ts.len())]).filter(|d| d.len() == strat.len());
    crate::plots::curves(
        dir,
        "forecast.png",
        dates,
        &format!("{} split: long/short on the sign of the one-bar forecast (with costs)", rep.split),
        &[
            ("sign of forecast", &strat, plotters::style::RGBColor(31, 119, 180)),
            ("buy & hold", &hold, plotters::style::RGBColor(255, 127, 14)),
        ],
    )
}

fn report(task: &impl SeqTask, cfg: &RunConfig, d: &SeqData, trainer: &SeqTrainer) -> Result<SeqReport> {
    let (split, rows) = if cfg.validation_only {
        ("validation", d.data.splits.valid.clone())
    } else {
        ("test", d.data.splits.test.clone())
    };
    let (bs, p) = (cfg.seq.batch_size, cfg.precision);
    let spans = d.spans(&rows);
    let point =
        evaluate(task, &d.series, spans.clone(), bs, p).with_context(|| format!("evaluating on the {split} split"))?;
    let forecast = evaluate_forecasts(task, &d.series, spans, bs, p).context("forecast metrics")?;
    let mut instrument_forecasts = Vec::new();
    for (i, inst) in d.data.instruments.iter().enumerate().filter(|_| d.data.is_panel()) {
        let own = Spans::from(d.instrument_rows(i, &rows));
        if own.window_starts(task.window_len()).is_empty() {
            continue;
        }
        let context = || format!("{} on the {split} split", inst.name);
        let point = evaluate(task, &d.series, own.clone(), bs, p).with_context(context)?;
        instrument_forecasts.push(InstrumentForecast {
            name: inst.name.clone(),
            target_scale: d.parts[i].1,
            beats_naive: point.mse_model < point.mse_zero && point.mse_model < point.mse_last,
            point,
            forecast: evaluate_forecasts(task, &d.series, own, bs, p).with_context(context)?,
        });
    }
    let (best_epoch, best_val_loss) = trainer.best().context("no epoch ran")?;
    let rep = trainer.log();
    Ok(SeqReport {
        model: cfg.model.as_str(),
        data_source: d.data.source.clone(),
        split,
        rows: rows.clone(),
        target_scale: d.target_scale(),
        epochs_done: trainer.epochs_done(),
        steps: trainer.step(),
        skipped_steps: trainer.log().iter().map(|e| e.skipped).sum(),
        best_epoch: best_epoch + 1,
        best_val_loss,
        stopped_early: trainer.is_done() && rep.len() < cfg.seq.epochs,
        beats_naive: point.mse_model < point.mse_zero && point.mse_model < point.mse_last,
        point,
        forecast,
        instrument_forecasts,
        periods_per_year: d.data.periods_per_year,
        strategy: SIGN_RULE,
        backtest: sign_backtest(task, cfg, d, &rows)
            .with_context(|| format!("backtesting the forecasts' signs on the {split} split"))?,
    })
}

fn write_report(dir: &RunDir, name: &str, rep: &SeqReport, profile: Option<&SeqProfile>) -> Result<()> {
    let mut doc = serde_json::to_value(rep)?;
    crate::report::trim_backtests(&mut doc, &rep.backtest.agent);
    doc["profile"] = serde_json::to_value(profile)?;
    write_atomic(&dir.path(name), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    if name == "report.json" {
        crate::report::write_backtest_csv(dir, &rep.backtest.agent, &rep.backtest.step_rows)?;
    }
    Ok(())
}

fn print(rep: &SeqReport, profile: Option<&SeqProfile>, dir: &RunDir) {
    println!(
        "forecasts of {} on the {} split ({} rows {}..{} of {}; after {} epochs, best {} with validation loss {:.4})",
        rep.model,
        rep.split,
        rep.rows.len(),
        rep.rows.start,
        rep.rows.end,
        rep.data_source,
        rep.epochs_done,
        rep.best_epoch,
        rep.best_val_loss
    );
    if rep.instrument_forecasts.is_empty() {
        println!("next-bar log return in units of its training-split std ({:.3e})", rep.target_scale);
    } else {
        println!(
            "next-bar log return in units of each instrument's training-split std; pooled over {} instruments:",
            rep.instrument_forecasts.len()
        );
    }
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
    if !rep.instrument_forecasts.is_empty() {
        let w = rep.instrument_forecasts.iter().map(|f| f.name.len()).max().unwrap_or(0).max(10);
        println!("{:<w$} {:>10} {:>10} {:>10} {:>9}", "instrument", "MSE model", "MSE zero", "MSE last", "direction");
        for f in &rep.instrument_forecasts {
            println!(
                "{:<w$} {:>10.4} {:>10.4} {:>10.4} {:>8.1}%",
                f.name,
                f.point.mse_model,
                f.point.mse_zero,
                f.point.mse_last,
                100.0 * f.forecast.directional_accuracy
            );
        }
    }
    let b = &rep.backtest;
    let what = if b.instruments.is_empty() {
        String::new()
    } else {
        format!(", the equal-weight portfolio of {} instruments", b.instruments.len())
    };
    println!(
        "backtest of the forecasts' signs on the {} split ({} steps, {:.0} bars/year{what}):",
        rep.split, b.agent.stats.steps, rep.periods_per_year
    );
    crate::report::print_table(&[
        ("sign (model)", &b.agent),
        ("buy & hold", &b.buy_and_hold),
        ("flat", &b.flat),
        ("random", &b.random),
    ]);
    let w = b.instruments.iter().map(|i| i.name.len()).max().unwrap_or(0);
    for i in &b.instruments {
        println!(
            "  {:<w$} {:>5} steps: sign Sharpe {:>6.2} (buy & hold {:>6.2})",
            i.name, i.steps, i.agent.sharpe, i.buy_and_hold.sharpe
        );
    }
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
    SeqModel::new(&cfg, &d, &device)?.with(|task| task.eval(&cfg, dir, &c, &d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TFT or MAMBA-2 of width 8 on 600 synthetic bars, resolved as a run resolves it.
    fn tiny(model: ModelChoice) -> RunConfig {
        let mut cfg = RunConfig { model, ..RunConfig::default() };
        cfg.synthetic.bars = 600;
        cfg.env.cost = 3e-4;
        cfg.seq.batch_size = 16;
        cfg.tft = fx_models::TftConfig { d: 8, n_head: 2, l_enc: 8, h: 3, dropout: 0.0, ..cfg.tft };
        cfg.mamba2 =
            fx_models::Mamba2Config { d_model: 8, n_layer: 1, d_state: 4, headdim: 4, chunk_size: 4, ..cfg.mamba2 };
        cfg.mamba2_seq_len = 12;
        cfg.resolve().unwrap()
    }

    /// A panel TFT's instrument count is the data's: a config's `[tft] n_instruments` is
    /// taken when absent (0) or equal, refused in one line when it differs.
    #[test]
    fn a_configured_instrument_count_must_be_the_datas() {
        let mut cfg = tiny(ModelChoice::Tft);
        assert_eq!(panel_tft(&cfg, 3).unwrap().n_instruments, 3);
        assert_eq!(panel_tft(&cfg, 0).unwrap().n_instruments, 0);
        cfg.tft.n_instruments = 3;
        assert_eq!(panel_tft(&cfg, 3).unwrap().n_instruments, 3);
        for (n, want) in [(5, "5 instruments"), (0, "one instrument")] {
            let e = panel_tft(&cfg, n).unwrap_err().to_string();
            assert!(e.contains("n_instruments = 3") && e.contains(want) && !e.contains('\n'), "{e}");
        }
    }

    /// Recomputes the sign strategy step by step: each step's row is a window's forecast
    /// row (its window forecast alone, in f64 accounting), its position the forecast's sign,
    /// its return `p·ln(close[r+1]/close[r]) − cost·|p − p_prev|`; the steps are consecutive
    /// from the first window's forecast row and every return is realised inside the test
    /// span; the baselines are scored on the same steps.
    fn check(task: &impl SeqTask, cfg: &RunConfig, d: &SeqData) {
        let test = d.data.splits.test.clone();
        let b = sign_backtest(task, cfg, d, &test).unwrap();
        let next = task.next_bar();
        let n = b.agent.positions.len();
        assert!(n > 10, "{n}");
        assert_eq!(b.step_rows.len(), n);
        assert_eq!(b.step_rows[0], test.start + next.row);
        let windows = test.len() - task.window_len() + 1;
        assert_eq!(n, windows.min(test.end - 1 - b.step_rows[0]), "every window whose return is inside the span");
        assert!(b.step_rows.windows(2).all(|w| w[1] == w[0] + 1));
        assert!(b.step_rows[n - 1] + 1 < test.end, "the last return ends inside the test span");
        let close = d.data.instruments[0].store.close();
        let c = fx_models::Ctx::inference(cfg.precision);
        let (mut prev, mut checked) = (0i8, 0);
        for (i, &r) in b.step_rows.iter().enumerate() {
            let batch = task.batch(&d.series, &[r - next.row], &Device::Cpu).unwrap();
            let f = task.point(&c, &batch).unwrap().to_vec2::<f32>().unwrap()[0][next.column];
            let p = b.agent.positions[i];
            if f.abs() > 1e-5 {
                assert_eq!(p, if f > 0.0 { 1 } else { -1 }, "step {i}: forecast {f}");
                checked += 1;
            }
            let want = f64::from(p) * (close[r + 1] / close[r]).ln() - cfg.env.cost * f64::from((p - prev).abs());
            assert!((b.agent.returns[i] - want).abs() < 1e-12, "step {i}: {} vs {want}", b.agent.returns[i]);
            prev = p;
        }
        assert!(checked > n / 2, "{checked} of {n} forecasts away from 0");
        for base in [&b.buy_and_hold, &b.flat, &b.random] {
            assert_eq!(base.returns.len(), n);
        }
        assert!(b.buy_and_hold.positions.iter().all(|&p| p == 1));
        let hold: f64 = b.step_rows.iter().map(|&r| (close[r + 1] / close[r]).ln()).sum();
        assert!((b.buy_and_hold.returns.iter().sum::<f64>() - (hold - cfg.env.cost)).abs() < 1e-9);
    }

    #[test]
    fn the_sign_backtest_trades_each_forecast_inside_the_test_span() {
        let cfg = tiny(ModelChoice::Tft);
        let d = seq_data(&cfg, None).unwrap();
        check(&Tft::new(cfg.tft.clone(), &Device::Cpu, cfg.seed).unwrap(), &cfg, &d);
        let cfg = tiny(ModelChoice::Mamba2);
        let d = seq_data(&cfg, None).unwrap();
        let m = Mamba2::new(cfg.mamba2.clone(), &Device::Cpu, cfg.seed).unwrap();
        check(&Mamba2Task { model: &m, seq_len: cfg.mamba2_seq_len }, &cfg, &d);
    }
}
