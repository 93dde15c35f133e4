//! The training loop of the sequence models: [`SeqTrainer`] (epoch by epoch, resumable)
//! and [`train`]: AdamW (F32 moments) with linear warm-up and cosine decay ([`lr_at`]),
//! global-norm clipping, validation each epoch and early stopping that restores the best
//! weights.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::Tensor;
use fx_precision::{clip_grad_norm, AdamW, AdamWConfig, GraphMode, Optimizer, Precision};
use serde::{Deserialize, Serialize};

use super::metrics::{evaluate, scalar};
use super::ops::{Ctx, DropoutRng};
use super::series::{sampler, SeqBatch, SeqSeries, Spans};
#[cfg(feature = "cuda")]
use super::task::FusedSeqStep;
use super::task::SeqTask;
use crate::error::{Context, Error, Result};

/// Hyper-parameters of [`train`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SeqTrainConfig {
    /// Maximum number of epochs.
    pub epochs: usize,
    /// Windows per batch.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Fraction of all steps spent in linear warm-up.
    pub warmup_frac: f64,
    /// Final learning rate of the cosine decay, as a fraction of `lr`.
    pub min_lr_frac: f64,
    /// Global gradient-norm clip.
    pub clip_norm: f64,
    /// Epochs without a validation improvement before stopping.
    pub patience: usize,
    /// Sampler seed.
    pub seed: u64,
    /// Matmul precision.
    pub precision: Precision,
    /// Activation recomputation (per TFT stage / MAMBA-2 layer: only segment inputs are kept
    /// and the backward recomputes the rest). `checkpoint`, its former name, still reads.
    #[serde(alias = "checkpoint")]
    pub recompute: bool,
    /// CUDA graph capture of the training step: auto (capture, warn and run eagerly if it
    /// fails), on (fail instead), off. Ignored on the CPU.
    pub graph: GraphMode,
}

impl Default for SeqTrainConfig {
    fn default() -> Self {
        // lr and clipping as the reference benchmark trains these models.
        Self {
            epochs: 30,
            batch_size: 64,
            lr: 1e-3,
            weight_decay: 0.01,
            warmup_frac: 0.05,
            min_lr_frac: 0.1,
            clip_norm: 1.0,
            patience: 5,
            seed: 0,
            precision: Precision::F32,
            recompute: false,
            graph: GraphMode::Auto,
        }
    }
}

/// Learning rate at optimiser step `step` (0-based) of `total`: linear warm-up from
/// `lr/warmup` to `lr` over `warmup` steps, then cosine decay to `min_lr` at the last
/// step.
pub fn lr_at(step: usize, total: usize, warmup: usize, lr: f64, min_lr: f64) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let t = ((step - warmup) as f64 / span as f64).min(1.0);
    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
}

/// One epoch of [`train`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochLog {
    /// Epoch number (0-based).
    pub epoch: usize,
    /// Mean training loss over the epoch's batches.
    pub train_loss: f64,
    /// Validation loss after the epoch.
    pub val_loss: f64,
    /// Learning rate of the epoch's last step.
    pub lr: f64,
    /// The epoch's steps skipped by the non-finite guard (a state written before this
    /// count existed reads 0).
    #[serde(default)]
    pub skipped: usize,
}

/// Outcome of [`train`]; the model holds the weights of `best_epoch`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainReport {
    /// Per-epoch log.
    pub epochs: Vec<EpochLog>,
    /// The epoch with the lowest validation loss.
    pub best_epoch: usize,
    /// Its validation loss.
    pub best_val_loss: f64,
    /// Whether patience ran out before `epochs`.
    pub stopped_early: bool,
}

/// Layout version of [`SeqTrainer::save_state`]'s file.
const SEQ_STATE_VERSION: u32 = 1;
/// Metadata key of the trainer's counters in its state file.
const SEQ_STATE_KEY: &str = "fx.seq_trainer";

/// The counters of a [`SeqTrainer`] state file (JSON metadata).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SeqCounters {
    version: u32,
    model: String,
    config: SeqTrainConfig,
    /// From the first training row to the last.
    train_rows: Range<usize>,
    /// A panel's training spans, one per instrument (absent for one span).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    train_spans: Vec<Range<usize>>,
    epochs_done: usize,
    step: usize,
    log: Vec<EpochLog>,
    best: Option<(usize, f64)>,
    patience_out: bool,
}

/// [`train`] driven epoch by epoch: holds the optimiser (AdamW, F32 moments), the step
/// counter, the learning-rate schedule, the best-validation snapshot and the patience
/// counter, so that a caller can log, checkpoint ([`SeqTrainer::save_state`]) and stop
/// between epochs, and resume ([`SeqTrainer::load_state`]) to the same weights as an
/// uninterrupted run (bit-identical on the CPU when the model has no dropout: candle's
/// dropout draws from the thread RNG).
///
/// The trainer does not own the model: every call takes the same `task` it was built
/// with.
pub struct SeqTrainer {
    cfg: SeqTrainConfig,
    opt: AdamW,
    vars: Vec<candle_core::Var>,
    smp: fx_data::Sampler,
    train_rows: Spans,
    total: usize,
    warmup: usize,
    step: usize,
    epochs_done: usize,
    log: Vec<EpochLog>,
    best: Option<(usize, f64, HashMap<String, Tensor>)>,
    /// Patience ran out (no further epoch runs).
    patience_out: bool,
    /// Set when an epoch was abandoned half-way: the weights are then between two epoch
    /// boundaries and must not be saved.
    dirty: bool,
    /// Dropout masks from the counter-based generator, its counter = optimiser steps.
    rng: DropoutRng,
    /// Host seconds spent building and uploading training batches (not saved: a resumed
    /// run counts from zero), see [`Self::batch_seconds`].
    batch_seconds: f64,
    /// The captured training step (CUDA, `graph` not off), built at the first step; it
    /// takes over the optimiser state from `opt` and holds it until the state is saved.
    #[cfg(feature = "cuda")]
    graph: crate::graph_update::GraphSlot,
    /// The model's fused step the captured graph runs (its buffers live as long as the
    /// graph); None when the graph captures candle's step.
    #[cfg(feature = "cuda")]
    fused_seq: Option<Box<dyn FusedSeqStep>>,
}

/// Stream mixed into the seed of the dropout generator (distinct from the sampler's).
const DROPOUT_SEED_MIX: u64 = 0xD50_0D50;

impl SeqTrainConfig {
    /// The keys `SeqTrainer::new` does not check by use: each refused with key, value and
    /// rule (a NaN or out-of-range value would otherwise train on in silence).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config("SeqTrainConfig", m));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("seq.lr ({}) must be finite and positive", self.lr));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!("seq.weight_decay ({}) must be finite and >= 0", self.weight_decay));
        }
        for (k, v) in [("seq.warmup_frac", self.warmup_frac), ("seq.min_lr_frac", self.min_lr_frac)] {
            if !(0.0..=1.0).contains(&v) {
                return bad(format!("{k} ({v}) must be in [0, 1]"));
            }
        }
        if self.clip_norm.is_nan() || self.clip_norm <= 0.0 {
            return bad(format!("seq.clip_norm ({}) must be positive", self.clip_norm));
        }
        Ok(())
    }
}

impl SeqTrainer {
    /// A trainer for `task` on windows inside `train_rows` (one range, or a panel's spans).
    pub fn new(task: &impl SeqTask, train_rows: impl Into<Spans>, cfg: &SeqTrainConfig) -> Result<Self> {
        let train_rows = train_rows.into();
        if cfg.epochs == 0 || cfg.batch_size == 0 || cfg.lr.is_nan() || cfg.lr <= 0.0 {
            return Err(Error::config("SeqTrainer::new", format!("need epochs, batch_size and lr > 0; got {cfg:?}")));
        }
        cfg.validate()?;
        let params = task.params();
        let opt = AdamW::new(
            params.named_vars(),
            AdamWConfig { lr: cfg.lr, weight_decay: cfg.weight_decay, ..AdamWConfig::default() },
        )
        .ctx("SeqTrainer::new")?;
        let smp = sampler(&train_rows, task.window_len(), cfg.batch_size, cfg.seed)?;
        let total = cfg.epochs * smp.batches_per_epoch();
        let warmup = ((total as f64 * cfg.warmup_frac).ceil() as usize).max(1);
        Ok(Self {
            cfg: cfg.clone(),
            opt,
            vars: params.vars(),
            smp,
            train_rows,
            total,
            warmup,
            step: 0,
            epochs_done: 0,
            log: Vec::new(),
            best: None,
            patience_out: false,
            dirty: false,
            rng: DropoutRng::new(cfg.seed ^ DROPOUT_SEED_MIX, params.device()).ctx("SeqTrainer::new")?,
            batch_seconds: 0.0,
            #[cfg(feature = "cuda")]
            graph: Default::default(),
            #[cfg(feature = "cuda")]
            fused_seq: None,
        })
    }

    /// One optimiser step on `batch` at the scheduled learning rate: forward with
    /// dropout, loss, backward, global-norm clip, AdamW. On CUDA (unless `graph = off`)
    /// the whole step is captured as a CUDA graph at the first call and replayed after
    /// (the clip and AdamW then run as fx-precision's `FusedStep`, which also skips
    /// non-finite steps). Returns the batch loss when it was read back: always eagerly,
    /// and with `read_loss` from a replay (one synchronisation; benchmarks leave it off).
    pub fn train_step(&mut self, task: &impl SeqTask, batch: &SeqBatch, read_loss: bool) -> Result<Option<f64>> {
        const CTX: &str = "SeqTrainer::train_step";
        let lr = lr_at(self.step, self.total, self.warmup, self.cfg.lr, self.cfg.lr * self.cfg.min_lr_frac);
        #[cfg(feature = "cuda")]
        if self.graph_ready(task, batch)? {
            let g = self.graph.get(CTX)?;
            g.fused().set_learning_rate(lr).ctx(CTX)?;
            let mut body = graph_body(task, &self.rng, &self.cfg, self.fused_seq.as_deref());
            g.run(&graph_inputs(batch), &mut body)?;
            self.step += 1;
            if !read_loss {
                return Ok(None);
            }
            let st = self.graph.stats()?.ok_or_else(|| Error::config(CTX, "no captured graph"))?;
            return Ok(Some(if st.last_skipped { f64::NAN } else { st.last_loss }));
        }
        let _ = read_loss; // an eager step reads its loss anyway
        self.opt.set_learning_rate(lr);
        self.rng.restart_calls();
        let c = Ctx::train(self.cfg.precision).with_rng(&self.rng);
        let (loss, mut grads) = task.loss_and_grads(&c, batch, self.cfg.recompute)?;
        let l = scalar(&loss, CTX)?;
        let norm = clip_grad_norm(&self.vars, &mut grads, self.cfg.clip_norm).ctx(CTX)?;
        // The eager step refuses a non-finite loss (above) or gradient norm before AdamW
        // would write NaN into the weights; the captured step's device guard skips instead.
        if !norm.is_finite() {
            return Err(Error::NonFinite { what: "gradient norm", context: CTX });
        }
        self.opt.step(&grads).ctx(CTX)?;
        self.rng.advance().ctx(CTX)?;
        self.step += 1;
        Ok(Some(l))
    }

    /// Whether steps run as the captured graph: captures it at the first call on CUDA
    /// unless `graph = off` (or `auto` and an earlier capture failed).
    #[cfg(feature = "cuda")]
    pub fn graph_ready(&mut self, task: &impl SeqTask, example: &SeqBatch) -> Result<bool> {
        if let Some(ready) = self.graph.decided(self.cfg.graph, task.params().device().is_cuda()) {
            return Ok(ready);
        }
        if self.fused_seq.is_none() {
            let name = task.params().model_name();
            let made = if self.cfg.recompute {
                Err(Error::config("SeqTrainer", "activation recomputation is on (it needs candle's segments)"))
            } else {
                example
                    .target
                    .dim(0)
                    .ctx("SeqTrainer::graph_ready")
                    .and_then(|b| task.fused_step(b, self.cfg.precision))
            };
            match made {
                Ok(f) => self.fused_seq = Some(f),
                Err(e) => eprintln!("note: the {name} step is captured from candle's autograd (no fused step: {e})"),
            }
        }
        let mut captured = self.capture_graph(task, example);
        if let Err(e) = &captured {
            // Under `auto` a fused step that will not capture gives way to candle's step,
            // captured, before falling back to eager steps (`on` reports the error).
            if self.fused_seq.is_some() && self.cfg.graph != GraphMode::On {
                let name = task.params().model_name();
                eprintln!("warning: the {name} fused step was not captured ({e}); capturing candle's step instead");
                self.fused_seq = None;
                captured = self.capture_graph(task, example);
            }
        }
        let ready = self.graph.settle(self.cfg.graph, task.params().model_name(), captured)?;
        if !ready {
            // Eager steps run candle's autograd: free the fused step's buffers.
            self.fused_seq = None;
        }
        Ok(ready)
    }

    #[cfg(feature = "cuda")]
    fn capture_graph(&self, task: &impl SeqTask, example: &SeqBatch) -> Result<crate::graph_update::GraphUpdate> {
        const CTX: &str = "SeqTrainer::capture_graph";
        let adamw = AdamWConfig { lr: self.cfg.lr, weight_decay: self.cfg.weight_decay, ..AdamWConfig::default() };
        // No loss scaling, as in the eager step (F32 and BF16 need none).
        let scaler = fx_precision::GradScaler::for_precision(Precision::F32);
        let mut fused =
            fx_precision::FusedStep::new(task.params().named_vars(), &adamw, &scaler, Some(self.cfg.clip_norm))
                .ctx(CTX)?;
        fused.load_optimizer(&self.opt).ctx(CTX)?;
        let mut body = graph_body(task, &self.rng, &self.cfg, self.fused_seq.as_deref());
        let inputs = graph_inputs(example);
        crate::graph_update::GraphUpdate::capture(fused, &inputs, &mut body)
    }

    /// Nodes (launches) of the captured step, if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_nodes(&self) -> Result<Option<usize>> {
        self.graph.node_count()
    }

    /// The captured step's device-side statistics (one read), if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_stats(&self) -> Result<Option<fx_precision::FusedStats>> {
        self.graph.stats()
    }

    /// The training config.
    pub fn config(&self) -> &SeqTrainConfig {
        &self.cfg
    }

    /// Optimiser steps per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.smp.batches_per_epoch()
    }

    /// Epochs completed.
    pub fn epochs_done(&self) -> usize {
        self.epochs_done
    }

    /// Optimiser steps taken.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The per-epoch log so far.
    pub fn log(&self) -> &[EpochLog] {
        &self.log
    }

    /// The best epoch so far and its validation loss.
    pub fn best(&self) -> Option<(usize, f64)> {
        self.best.as_ref().map(|(e, v, _)| (*e, *v))
    }

    /// Host seconds this trainer spent building training batches from the series and
    /// uploading them, over its life (not saved in checkpoints). The loop does nothing else
    /// meanwhile (no prefetch), so over an epoch's time it is the share of the epoch the
    /// optimiser waited for data: an upper bound on the GPU's data stall (work queued before
    /// may still run while the host builds).
    pub fn batch_seconds(&self) -> f64 {
        self.batch_seconds
    }

    /// Whether training is over: every epoch ran, or patience ran out.
    pub fn is_done(&self) -> bool {
        self.epochs_done >= self.cfg.epochs || self.patience_out
    }

    /// One epoch and its validation; `None` when `on_batch` (called after every optimiser
    /// step with the steps done this epoch and the batch loss) asked to stop half-way, in
    /// which case the trainer refuses to save (resume from the previous epoch's state).
    pub fn train_epoch_with(
        &mut self,
        task: &impl SeqTask,
        series: &SeqSeries,
        val_rows: impl Into<Spans>,
        mut on_batch: impl FnMut(usize, f64) -> std::ops::ControlFlow<()>,
    ) -> Result<Option<EpochLog>> {
        const CTX: &str = "SeqTrainer::train_epoch";
        if self.dirty || self.is_done() {
            return Err(Error::config(CTX, "training is over (or an epoch was abandoned half-way)"));
        }
        let params = task.params();
        let dev = params.device().clone();
        let epoch = self.epochs_done;
        let (mut sum, mut nb, mut skipped) = (0.0, 0usize, 0usize);
        let mut lr = self.cfg.lr;
        for bi in self.smp.epoch_batches(epoch as u64) {
            lr = lr_at(self.step, self.total, self.warmup, self.cfg.lr, self.cfg.lr * self.cfg.min_lr_frac);
            let t_batch = std::time::Instant::now();
            let batch = task.batch(series, &bi.starts, &dev)?;
            self.batch_seconds += t_batch.elapsed().as_secs_f64();
            let l = self.train_step(task, &batch, true)?.unwrap_or(f64::NAN);
            // A replayed step skipped by the device-side NaN/Inf guard reads as NaN.
            if l.is_finite() {
                sum += l;
            } else {
                skipped += 1;
            }
            nb += 1;
            if on_batch(nb, l).is_break() {
                self.dirty = true;
                return Ok(None);
            }
        }
        let val = evaluate(task, series, val_rows, self.cfg.batch_size, self.cfg.precision)?.loss;
        let entry = EpochLog { epoch, train_loss: sum / (nb - skipped).max(1) as f64, val_loss: val, lr, skipped };
        self.log.push(entry.clone());
        self.epochs_done += 1;
        if self.best.as_ref().is_none_or(|(_, b, _)| val < *b) {
            self.best = Some((epoch, val, params.to_map()?.into_iter().collect()));
        } else if self.best.as_ref().is_some_and(|(e, _, _)| epoch - e >= self.cfg.patience) {
            self.patience_out = true;
        }
        Ok(Some(entry))
    }

    /// The training spans when there are several (what a state file records beside their
    /// hull).
    fn spans_if_several(&self) -> Vec<Range<usize>> {
        match self.train_rows.ranges() {
            [_] | [] => Vec::new(),
            r => r.to_vec(),
        }
    }

    /// One full epoch and its validation.
    pub fn train_epoch(
        &mut self,
        task: &impl SeqTask,
        series: &SeqSeries,
        val_rows: impl Into<Spans>,
    ) -> Result<EpochLog> {
        let log = self.train_epoch_with(task, series, val_rows, |_, _| std::ops::ControlFlow::Continue(()))?;
        log.ok_or_else(|| Error::config("SeqTrainer::train_epoch", "epoch stopped"))
    }

    /// Loads the best validation weights into the model and reports the run so far.
    pub fn finish(&self, task: &impl SeqTask) -> Result<TrainReport> {
        let Some((best_epoch, best_val_loss, weights)) = &self.best else {
            return Err(Error::config("SeqTrainer::finish", "no epoch ran"));
        };
        task.params().load_map(weights, "best-epoch snapshot")?;
        Ok(TrainReport {
            epochs: self.log.clone(),
            best_epoch: *best_epoch,
            best_val_loss: *best_val_loss,
            stopped_early: self.patience_out && self.epochs_done < self.cfg.epochs,
        })
    }

    /// Writes the model's current weights (`model.*`), the best-epoch snapshot
    /// (`best.*`), the optimiser state (`opt.*`) and the counters, atomically to one
    /// safetensors file.
    pub fn save_state(&self, task: &impl SeqTask, path: &std::path::Path) -> Result<()> {
        const CTX: &str = "SeqTrainer::save_state";
        if self.dirty {
            return Err(Error::config(
                CTX,
                "an epoch was abandoned half-way; the weights are not at an epoch boundary",
            ));
        }
        let params = task.params();
        let mut t: HashMap<String, Tensor> =
            params.to_map()?.into_iter().map(|(n, v)| (format!("model.{n}"), v)).collect();
        if let Some((_, _, w)) = &self.best {
            t.extend(w.iter().map(|(n, v)| (format!("best.{n}"), v.clone())));
        }
        let mut meta = HashMap::new();
        #[cfg(feature = "cuda")]
        let saved = self.graph.save_state(&mut t, &mut meta, "opt.")?;
        #[cfg(not(feature = "cuda"))]
        let saved = false;
        if !saved {
            self.opt.save_state(&mut t, "opt.").ctx(CTX)?;
        }
        let counters = SeqCounters {
            version: SEQ_STATE_VERSION,
            model: params.model_name().to_string(),
            config: self.cfg.clone(),
            train_rows: self.train_rows.hull(),
            train_spans: self.spans_if_several(),
            epochs_done: self.epochs_done,
            step: self.step,
            log: self.log.clone(),
            best: self.best(),
            patience_out: self.patience_out,
        };
        let json = serde_json::to_string(&counters).map_err(|source| Error::Json { context: CTX, source })?;
        meta.insert(SEQ_STATE_KEY.to_string(), json);
        fx_precision::save_tensors_atomic(path, &t, &meta).ctx(CTX)
    }

    /// Restores [`SeqTrainer::save_state`]'s file into this trainer and `task`'s model.
    /// The file must come from the same model, training config and training rows.
    /// Every error names `path`.
    pub fn load_state(&mut self, task: &impl SeqTask, path: &std::path::Path) -> Result<()> {
        const CTX: &str = "SeqTrainer::load_state";
        let shown = path.display().to_string();
        self.load_state_from(task, path).map_err(|e| {
            let msg = e.to_string();
            if msg.contains(&shown) {
                e
            } else {
                Error::config(CTX, format!("{shown}: {msg}"))
            }
        })
    }

    /// Starts this trainer, before its first step, from the weights another run's state
    /// file ([`SeqTrainer::save_state`]) ended with: its best-validation snapshot (what that
    /// run evaluated), or its latest weights when it has none. The optimiser, schedule,
    /// counters and dropout stream stay fresh (a walk-forward fold warm-started from the
    /// previous fold). The file must hold this model's parameters, shape for shape; every
    /// error names `path`.
    pub fn warm_start(&mut self, task: &impl SeqTask, path: &std::path::Path) -> Result<()> {
        const CTX: &str = "SeqTrainer::warm_start";
        if self.step > 0 || self.epochs_done > 0 {
            return Err(Error::config(CTX, "a warm start is for a trainer that has not stepped"));
        }
        let shown = path.display().to_string();
        let named = |e: Error| {
            let msg = e.to_string();
            if msg.contains(&shown) {
                e
            } else {
                Error::config(CTX, format!("{shown}: {msg}"))
            }
        };
        let params = task.params();
        let mut nt = fx_precision::load_tensors(path, params.device()).ctx(CTX).map_err(named)?;
        let c = read_counters(&nt, path, params.model_name(), CTX).map_err(named)?;
        let prefix = if c.best.is_some() { "best." } else { "model." };
        let weights = params
            .names_and_shapes()
            .iter()
            .map(|(n, shape)| Ok((n.clone(), nt.take(&format!("{prefix}{n}"), shape).ctx(CTX)?)))
            .collect::<Result<HashMap<String, Tensor>>>()
            .map_err(named)?;
        params.load_map(&weights, &shown)?;
        // A captured step would hold the weights it was captured with.
        #[cfg(feature = "cuda")]
        self.graph.reset();
        Ok(())
    }

    fn load_state_from(&mut self, task: &impl SeqTask, path: &std::path::Path) -> Result<()> {
        const CTX: &str = "SeqTrainer::load_state";
        let params = task.params();
        let mut nt = fx_precision::load_tensors(path, params.device()).ctx(CTX)?;
        let bad = |m: String| Error::config(CTX, format!("{}: {m}", path.display()));
        let c = read_counters(&nt, path, params.model_name(), CTX)?;
        // The graph mode is how a step runs, not what it computes: a run may resume either way.
        let saved_cfg = SeqTrainConfig { graph: self.cfg.graph, ..c.config.clone() };
        if saved_cfg != self.cfg || c.train_rows != self.train_rows.hull() || c.train_spans != self.spans_if_several() {
            return Err(bad(format!(
                "trained with {:?} on rows {:?} {:?}; this trainer has {:?} on rows {:?}",
                c.config,
                c.train_rows,
                c.train_spans,
                self.cfg,
                self.train_rows.ranges()
            )));
        }
        let shapes = params.names_and_shapes();
        let mut take = |prefix: &str| -> Result<HashMap<String, Tensor>> {
            shapes.iter().map(|(n, s)| Ok((n.clone(), nt.take(&format!("{prefix}{n}"), s).ctx(CTX)?))).collect()
        };
        let weights = take("model.")?;
        let best = match c.best {
            Some((e, v)) => Some((e, v, take("best.")?)),
            None => None,
        };
        self.opt.load_state(&mut nt, "opt.").ctx(CTX)?;
        nt.finish().ctx(CTX)?;
        params.load_map(&weights, &path.display().to_string())?;
        // Fresh copies, independent of the file's buffers.
        self.best = match best {
            Some((e, v, w)) => Some((
                e,
                v,
                w.into_iter().map(|(n, t)| Ok((n, t.copy().ctx(CTX)?))).collect::<Result<HashMap<_, _>>>()?,
            )),
            None => None,
        };
        self.step = c.step;
        self.rng.set_step(c.step as u64).ctx(CTX)?;
        // A captured step holds the optimiser state it took over: capture again from `opt`.
        #[cfg(feature = "cuda")]
        self.graph.reset();
        self.epochs_done = c.epochs_done;
        self.log = c.log;
        self.patience_out = c.patience_out;
        self.dirty = false;
        Ok(())
    }
}

/// The counters of a [`SeqTrainer::save_state`] file, checked to be of this version and of
/// model `model`.
fn read_counters(
    nt: &fx_precision::NamedTensors,
    path: &std::path::Path,
    model: &str,
    ctx: &'static str,
) -> Result<SeqCounters> {
    let bad = |m: String| Error::config(ctx, format!("{}: {m}", path.display()));
    let json = nt
        .metadata()
        .get(SEQ_STATE_KEY)
        .ok_or_else(|| bad(format!("no `{SEQ_STATE_KEY}` metadata (not a sequence-model trainer state)")))?;
    let c: SeqCounters = serde_json::from_str(json).map_err(|source| Error::Json { context: ctx, source })?;
    if c.version != SEQ_STATE_VERSION {
        return Err(bad(format!("state version {} (expected {SEQ_STATE_VERSION})", c.version)));
    }
    if c.model != model {
        return Err(bad(format!("state of a {} model, this is a {model}", c.model)));
    }
    Ok(c)
}

/// The static inputs of a captured step: the model inputs, then the target.
#[cfg(feature = "cuda")]
fn graph_inputs(batch: &SeqBatch) -> Vec<&Tensor> {
    batch.inputs.iter().chain(std::iter::once(&batch.target)).collect()
}

/// The captured step: forward with counter-based dropout, loss, backward, the fused
/// clip + AdamW, and the dropout counter's advance (skipped by dry warm-ups, which must
/// leave every state as it was).
#[cfg(feature = "cuda")]
fn graph_body<'a>(
    task: &'a impl SeqTask,
    rng: &'a DropoutRng,
    cfg: &'a SeqTrainConfig,
    fused_seq: Option<&'a dyn FusedSeqStep>,
) -> Box<crate::graph_update::Body<'a>> {
    Box::new(move |fused, t, dry| {
        const CTX: &str = "SeqTrainer graph body";
        let (target, inputs) = t.split_last().ok_or_else(|| Error::config(CTX, "no inputs"))?;
        rng.restart_calls();
        match fused_seq {
            // A short last batch (not the fused step's size) runs candle's step.
            Some(f) if target.dim(0).ok() == Some(f.batch_size()) => {
                let (loss, grads) = f.loss_and_grads(inputs, target, rng)?;
                let grads: Vec<&Tensor> = grads.iter().collect();
                fused.step_with(&loss, &grads, &[], dry).ctx(CTX)?;
            }
            _ => {
                let batch = SeqBatch { inputs: inputs.to_vec(), target: target.clone(), last_value: target.clone() };
                let c = Ctx::train(cfg.precision).with_rng(rng);
                let (loss, grads) = task.loss_and_grads(&c, &batch, cfg.recompute)?;
                fused.step(&loss, &grads, &[], dry).ctx(CTX)?;
            }
        }
        if dry {
            rng.restart_calls();
            Ok(())
        } else {
            rng.advance().ctx(CTX)
        }
    })
}

/// Trains `task` on windows inside `train_rows`, validating on windows inside
/// `val_rows` after each epoch; stops after `patience` epochs without improvement and
/// leaves the model with its best validation weights.
pub fn train(
    task: &impl SeqTask,
    series: &SeqSeries,
    train_rows: impl Into<Spans>,
    val_rows: impl Into<Spans>,
    cfg: &SeqTrainConfig,
) -> Result<TrainReport> {
    let val_rows = val_rows.into();
    let mut t = SeqTrainer::new(task, train_rows, cfg)?;
    while !t.is_done() {
        t.train_epoch(task, series, val_rows.clone())?;
    }
    t.finish(task)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::mamba2::{Mamba2, Mamba2Config};
    use crate::params::ParamStore;
    use crate::seq::*;
    use crate::tft::{Tft, TftConfig};

    /// Values that cannot train are refused with the key and the value.
    #[test]
    fn seq_configs_that_cannot_train_are_refused() {
        assert!(SeqTrainConfig::default().validate().is_ok());
        type Case = (fn(&mut SeqTrainConfig), &'static str);
        let cases: [Case; 6] = [
            (|c| c.lr = f64::INFINITY, "seq.lr (inf)"),
            (|c| c.weight_decay = -0.1, "seq.weight_decay (-0.1)"),
            (|c| c.warmup_frac = 1.5, "seq.warmup_frac (1.5)"),
            (|c| c.min_lr_frac = f64::NAN, "seq.min_lr_frac (NaN)"),
            (|c| c.clip_norm = 0.0, "seq.clip_norm (0)"),
            (|c| c.clip_norm = f64::NAN, "seq.clip_norm (NaN)"),
        ];
        for (change, want) in cases {
            let mut c = SeqTrainConfig::default();
            change(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn config_reads_the_former_name_of_recompute() {
        // Run folders written before the rename hold `checkpoint`; a resume must still read them.
        let old: SeqTrainConfig = serde_json::from_str(r#"{"checkpoint": true, "epochs": 3}"#).unwrap();
        assert!(old.recompute && old.epochs == 3);
        let new: SeqTrainConfig = serde_json::from_str(r#"{"recompute": true}"#).unwrap();
        assert!(new.recompute);
        assert!(serde_json::from_str::<SeqTrainConfig>(r#"{"recompte": true}"#).is_err());
    }

    #[test]
    fn lr_schedule_warms_up_then_decays() {
        let (lr, min) = (1e-3, 1e-4);
        assert!((lr_at(0, 100, 10, lr, min) - 1e-4).abs() < 1e-12);
        assert!((lr_at(9, 100, 10, lr, min) - lr).abs() < 1e-12);
        assert!((lr_at(10, 100, 10, lr, min) - lr).abs() < 1e-12);
        assert!((lr_at(100, 100, 10, lr, min) - min).abs() < 1e-12);
        let mut prev = f64::INFINITY;
        for s in 10..=100 {
            let v = lr_at(s, 100, 10, lr, min);
            assert!(v <= prev + 1e-15 && v >= min - 1e-15);
            prev = v;
        }
    }

    /// A series with learnable structure: the next return is a linear function of two
    /// observed features of this row plus an hour-of-day seasonal term visible through
    /// the known calendar features, with small noise.
    fn synthetic(rows: usize, n_obs: usize) -> SeqSeries {
        let mut state = 0x2545F4914F6CDD1Du64;
        let mut unif = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut gauss = move || {
            let (u1, u2) = (unif().max(1e-12), unif());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        };
        let (mut obs, mut known, mut target) = (Vec::new(), Vec::new(), Vec::new());
        let mut ar = 0.0;
        for t in 0..rows {
            ar = 0.8 * ar + 0.6 * gauss();
            let f: Vec<f64> = (0..n_obs).map(|k| if k == 0 { ar } else { gauss() }).collect();
            let hour = 2.0 * std::f64::consts::PI * (t % 24) as f64 / 24.0;
            let day = 2.0 * std::f64::consts::PI * ((t / 24) % 7) as f64 / 7.0;
            let season = (hour + 2.0 * std::f64::consts::PI / 24.0).sin();
            let y = 0.5 * f[0] + 0.3 * f[1] + 0.4 * season + 0.1 * gauss();
            obs.extend(f.iter().map(|&v| v as f32));
            known.extend([hour.sin(), hour.cos(), day.sin(), day.cos()].map(|v| v as f32));
            target.push(y as f32);
        }
        SeqSeries::new(obs, n_obs, known, 4, target).unwrap()
    }

    /// An eager step on a batch with a non-finite target is refused with a one-line error
    /// naming the loss, the weights untouched; the next finite step trains again.
    #[test]
    fn eager_step_refuses_non_finite_batches() {
        let series = synthetic(200, 3);
        let cfg = Mamba2Config {
            n_in: 3,
            d_model: 8,
            n_layer: 1,
            expand: 2,
            d_state: 4,
            headdim: 4,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 8,
            norm_eps: 1e-5,
        };
        let model = Mamba2::new(cfg, &Device::Cpu, 3).unwrap();
        let task = Mamba2Task { model: &model, seq_len: 16 };
        let tc = SeqTrainConfig { epochs: 1, batch_size: 4, ..Default::default() };
        let mut tr = SeqTrainer::new(&task, 0..150, &tc).unwrap();
        let good = task.batch(&series, &[0, 10, 20, 30], &Device::Cpu).unwrap();
        let mut bad = good.clone();
        let mut t: Vec<f32> = bad.target.flatten_all().unwrap().to_vec1().unwrap();
        t[5] = f32::INFINITY;
        bad.target = Tensor::from_vec(t, bad.target.dims(), &Device::Cpu).unwrap();
        let snap = |m: &Mamba2| -> Vec<Vec<f32>> {
            m.params().vars().iter().map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect()
        };
        let before = snap(&model);
        let e = tr.train_step(&task, &bad, true).unwrap_err().to_string();
        assert!(e.contains("loss") && !e.contains('\n'), "{e}");
        assert_eq!(snap(&model), before, "a non-finite batch changed the weights");
        let l = tr.train_step(&task, &good, true).unwrap().unwrap();
        assert!(l.is_finite());
        assert_ne!(snap(&model), before, "a finite batch must train");
    }

    #[test]
    fn mamba2_learns_and_beats_naive_forecasts() {
        let series = synthetic(700, 3);
        let cfg = Mamba2Config {
            n_in: 3,
            d_model: 16,
            n_layer: 1,
            expand: 2,
            d_state: 8,
            headdim: 8,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 8,
            norm_eps: 1e-5,
        };
        let model = Mamba2::new(cfg, &Device::Cpu, 1).unwrap();
        let task = Mamba2Task { model: &model, seq_len: 24 };
        let tc = SeqTrainConfig { epochs: 12, batch_size: 16, lr: 1e-2, patience: 4, ..Default::default() };
        let before = evaluate(&task, &series, 600..700, 32, Precision::F32).unwrap();
        let rep = train(&task, &series, 0..500, 500..600, &tc).unwrap();
        let after = evaluate(&task, &series, 600..700, 32, Precision::F32).unwrap();
        assert!(rep.best_val_loss.is_finite());
        assert!(after.mse_model < before.mse_model, "{before:?} -> {after:?}");
        assert!(after.mse_model < 0.7 * after.mse_zero, "{after:?}");
        assert!(after.mse_model < 0.7 * after.mse_last, "{after:?}");
    }

    /// A panel of two instruments whose next return follows the same feature with opposite
    /// signs: alone the feature predicts nothing (its pooled slope is zero); with the
    /// instrument's embedding added to its input MAMBA-2 learns both. Windows are drawn
    /// per instrument, and a window across the boundary is refused.
    #[test]
    fn mamba2_on_a_panel_learns_each_instruments_sign() {
        let (one, rows) = (synthetic(400, 3), 400);
        let (mut obs, mut known, mut target, mut inst) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..2u32 {
            let sign = if i == 0 { 1.0 } else { -1.0 };
            for r in 0..rows {
                let f = one.observed_row(r);
                obs.extend_from_slice(f);
                known.extend_from_slice(&one.known[r * 4..r * 4 + 4]);
                target.push(sign * 0.6 * f[0]);
                inst.push(i);
            }
        }
        let series = SeqSeries::new(obs, 3, known, 4, target).unwrap().with_instruments(inst, 2).unwrap();
        let spans = |a: usize, b: usize| Spans::new(vec![a..b, rows + a..rows + b]);
        let cfg = Mamba2Config {
            n_in: 3 + 2,
            d_model: 16,
            n_layer: 1,
            expand: 2,
            d_state: 8,
            headdim: 8,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 8,
            norm_eps: 1e-5,
        };
        let model = Mamba2::new(cfg, &Device::Cpu, 2).unwrap();
        let task = Mamba2Task { model: &model, seq_len: 24 };
        let e = task.batch(&series, &[rows - 10], &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("crosses from one instrument"), "{e}");
        let b = task.batch(&series, &[0, rows], &Device::Cpu).unwrap();
        let x = b.inputs[0].to_vec3::<f32>().unwrap();
        assert_eq!((&x[0][5][3..], &x[1][5][3..]), (&[1.0, 0.0][..], &[0.0, 1.0][..]));
        let tc = SeqTrainConfig { epochs: 12, batch_size: 16, lr: 1e-2, patience: 4, ..Default::default() };
        train(&task, &series, spans(0, 280), spans(280, 340), &tc).unwrap();
        let after = evaluate(&task, &series, spans(340, 400), 32, Precision::F32).unwrap();
        assert!(after.mse_model < 0.5 * after.mse_zero, "{after:?}");
        let single = Mamba2::new(Mamba2Config { n_in: 3, ..model.config().clone() }, &Device::Cpu, 2).unwrap();
        let e = Mamba2Task { model: &single, seq_len: 24 }.batch(&series, &[0], &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("2 instruments"), "{e}");
    }

    #[test]
    fn spans_list_window_starts_inside_each_range() {
        let s = Spans::new(vec![0..5, 5..5, 10..13]);
        assert_eq!(s.ranges(), &[0..5, 10..13]);
        assert_eq!(s.window_starts(3), vec![0, 1, 2, 10]);
        assert_eq!(s.window_starts(4), vec![0, 1]);
        assert_eq!((s.rows(), s.hull()), (8, 0..13));
        let bad = synthetic(10, 3).with_instruments(vec![0; 9], 1).unwrap_err().to_string();
        assert!(bad.contains("instrument"), "{bad}");
        assert!(synthetic(10, 3).with_instruments(vec![2; 10], 2).is_err());
    }

    /// `next_bar` names the target entry each model's batch holds for the bar after the
    /// window's last observed row: `target[col]` of window `s` is `series.target[s + row]`.
    #[test]
    fn next_bar_points_at_the_target_after_the_window() {
        let series = synthetic(120, 3);
        let tft = Tft::new(
            TftConfig { n_observed: 3, d: 8, n_head: 2, l_enc: 6, h: 3, ..TftConfig::default() },
            &Device::Cpu,
            1,
        )
        .unwrap();
        let mcfg = Mamba2Config {
            n_in: 3,
            d_model: 8,
            n_layer: 1,
            d_state: 4,
            headdim: 4,
            chunk_size: 8,
            ..Mamba2Config::default()
        };
        let mamba = Mamba2::new(mcfg, &Device::Cpu, 1).unwrap();
        let mtask = Mamba2Task { model: &mamba, seq_len: 16 };
        let starts = [0usize, 7, 40, 100];
        let check = |task: &dyn Fn(&[usize]) -> (SeqBatch, NextBar)| {
            let (batch, nb) = task(&starts);
            let target = batch.target.to_vec2::<f32>().unwrap();
            for (row, &st) in target.iter().zip(&starts) {
                assert_eq!(row[nb.column].to_bits(), series.target[st + nb.row].to_bits(), "start {st}: {nb:?}");
            }
        };
        check(&|st| (tft.batch(&series, st, &Device::Cpu).unwrap(), tft.next_bar()));
        check(&|st| (mtask.batch(&series, st, &Device::Cpu).unwrap(), mtask.next_bar()));
        assert_eq!(tft.next_bar(), NextBar { column: 0, row: 5 });
        assert_eq!(mtask.next_bar(), NextBar { column: 15, row: 15 });
    }

    /// A window drawn from a split keeps its targets inside it: with target `r` at row
    /// `r` (the return from row `r` to `r + 1`), no window of rows `10..60` has a target
    /// above 58, for the TFT (targets inside its window) and MAMBA-2 (whose last step's
    /// return ends one row after its steps: its window counts that row).
    #[test]
    fn windows_of_a_split_keep_their_targets_inside_it() {
        let rows = 80;
        let mut series = synthetic(rows, 3);
        series.target = (0..rows).map(|r| r as f32).collect();
        let tft = Tft::new(
            TftConfig { n_observed: 3, d: 8, n_head: 2, l_enc: 6, h: 3, ..TftConfig::default() },
            &Device::Cpu,
            1,
        )
        .unwrap();
        let mcfg = Mamba2Config {
            n_in: 3,
            d_model: 8,
            n_layer: 1,
            d_state: 4,
            headdim: 4,
            chunk_size: 8,
            ..Mamba2Config::default()
        };
        let mamba = Mamba2::new(mcfg, &Device::Cpu, 1).unwrap();
        let mtask = Mamba2Task { model: &mamba, seq_len: 16 };
        let highest = |task: &dyn Fn(&[usize]) -> SeqBatch, len: usize| {
            let smp = sampler(&Spans::from(10..60), len, 4, 3).unwrap();
            let mut top = 0.0f32;
            for bi in smp.epoch_batches(0) {
                let t = task(&bi.starts).target.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                top = t.into_iter().fold(top, f32::max);
            }
            top
        };
        assert_eq!(highest(&|st| tft.batch(&series, st, &Device::Cpu).unwrap(), SeqTask::window_len(&tft)), 58.0);
        assert_eq!(highest(&|st| mtask.batch(&series, st, &Device::Cpu).unwrap(), mtask.window_len()), 58.0);
    }

    #[test]
    fn tft_learns_and_beats_naive_forecasts() {
        let series = synthetic(460, 3);
        let cfg = TftConfig { n_observed: 3, d: 16, n_head: 2, l_enc: 6, h: 2, dropout: 0.0, ..TftConfig::default() };
        // Passes for seeds 1–6 with ≥ 30% margin (checked when the test was written).
        let model = Tft::new(cfg, &Device::Cpu, 1).unwrap();
        let tc = SeqTrainConfig { epochs: 8, batch_size: 16, lr: 5e-3, patience: 3, ..Default::default() };
        let before = evaluate(&model, &series, 380..460, 64, Precision::F32).unwrap();
        let rep = train(&model, &series, 0..300, 300..380, &tc).unwrap();
        let after = evaluate(&model, &series, 380..460, 64, Precision::F32).unwrap();
        assert!(rep.epochs.len() >= 2);
        assert!(after.loss < before.loss, "{before:?} -> {after:?}");
        assert!(after.mse_model < 0.8 * after.mse_zero, "{after:?}");
        assert!(after.mse_model < 0.8 * after.mse_last, "{after:?}");
        let fm = evaluate_forecasts(&model, &series, 380..460, 64, Precision::F32).unwrap();
        assert_eq!(fm.pinball.len(), 3);
        assert!(fm.interval_coverage.unwrap() > 0.5, "{fm:?}");
        assert!(fm.directional_accuracy > 0.6 && fm.rank_correlation > 0.5, "{fm:?}");
    }

    fn same_weights(a: &ParamStore, b: &ParamStore) {
        let (a, b) = (a.to_map().unwrap(), b.to_map().unwrap());
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            let (va, vb) = (
                ta.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                tb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(va == vb, "{na} differs");
        }
    }

    #[test]
    fn resume_after_k_epochs_gives_the_uninterrupted_weights() {
        let series = synthetic(300, 3);
        let dir = tempfile::tempdir().unwrap();
        let tc = SeqTrainConfig { epochs: 4, batch_size: 16, lr: 5e-3, patience: 10, ..Default::default() };
        // TFT with dropout (counter-based: a resumed run drops the same units) and MAMBA-2.
        let tcfg = TftConfig { n_observed: 3, d: 8, n_head: 2, l_enc: 6, h: 2, dropout: 0.1, ..TftConfig::default() };
        let straight = Tft::new(tcfg.clone(), &Device::Cpu, 3).unwrap();
        let rep = train(&straight, &series, 0..200, 200..250, &tc).unwrap();
        assert_eq!(rep.epochs.len(), 4);
        let first = Tft::new(tcfg.clone(), &Device::Cpu, 3).unwrap();
        let mut t = SeqTrainer::new(&first, 0..200, &tc).unwrap();
        t.train_epoch(&first, &series, 200..250).unwrap();
        t.train_epoch(&first, &series, 200..250).unwrap();
        let path = dir.path().join("tft.safetensors");
        t.save_state(&first, &path).unwrap();
        // A fresh process: another seed's weights, overwritten by the state file.
        let resumed = Tft::new(tcfg, &Device::Cpu, 99).unwrap();
        let mut t = SeqTrainer::new(&resumed, 0..200, &tc).unwrap();
        t.load_state(&resumed, &path).unwrap();
        assert_eq!((t.epochs_done(), t.log().len()), (2, 2));
        while !t.is_done() {
            t.train_epoch(&resumed, &series, 200..250).unwrap();
        }
        let rep2 = t.finish(&resumed).unwrap();
        assert_eq!(rep, rep2);
        same_weights(straight.params(), resumed.params());

        let mcfg = Mamba2Config {
            n_in: 3,
            d_model: 8,
            n_layer: 1,
            expand: 2,
            d_state: 4,
            headdim: 4,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 4,
            norm_eps: 1e-5,
        };
        let m1 = Mamba2::new(mcfg.clone(), &Device::Cpu, 1).unwrap();
        train(&Mamba2Task { model: &m1, seq_len: 12 }, &series, 0..200, 200..250, &tc).unwrap();
        let m2 = Mamba2::new(mcfg.clone(), &Device::Cpu, 1).unwrap();
        let task2 = Mamba2Task { model: &m2, seq_len: 12 };
        let mut t = SeqTrainer::new(&task2, 0..200, &tc).unwrap();
        t.train_epoch(&task2, &series, 200..250).unwrap();
        let path = dir.path().join("m.safetensors");
        t.save_state(&task2, &path).unwrap();
        let m3 = Mamba2::new(mcfg, &Device::Cpu, 5).unwrap();
        let task3 = Mamba2Task { model: &m3, seq_len: 12 };
        // An epoch abandoned half-way cannot be saved (m3's weights are overwritten below).
        let mut probe = SeqTrainer::new(&task3, 0..200, &tc).unwrap();
        let stopped =
            probe.train_epoch_with(&task3, &series, 200..250, |_, _| std::ops::ControlFlow::Break(())).unwrap();
        assert!(stopped.is_none() && probe.save_state(&task3, &dir.path().join("x")).is_err());
        let mut t = SeqTrainer::new(&task3, 0..200, &tc).unwrap();
        t.load_state(&task3, &path).unwrap();
        while !t.is_done() {
            t.train_epoch(&task3, &series, 200..250).unwrap();
        }
        t.finish(&task3).unwrap();
        same_weights(m1.params(), m3.params());
        // A TFT state is refused by a MAMBA-2 trainer, naming the file.
        let mut t = SeqTrainer::new(&task3, 0..200, &tc).unwrap();
        let e = t.load_state(&task3, &dir.path().join("tft.safetensors")).unwrap_err().to_string();
        assert!(e.contains("tft.safetensors") && e.contains("tft"), "{e}");
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(SeqSeries::new(vec![0.0; 5], 2, vec![0.0; 12], 4, vec![0.0; 3]).is_err());
        assert!(SeqSeries::new(vec![f32::NAN; 6], 2, vec![0.0; 12], 4, vec![0.0; 3]).is_err());
        let series = synthetic(50, 3);
        let model = Tft::new(
            TftConfig { n_observed: 5, d: 8, n_head: 2, l_enc: 4, h: 2, ..TftConfig::default() },
            &Device::Cpu,
            1,
        )
        .unwrap();
        assert!(train(&model, &series, 0..30, 30..50, &SeqTrainConfig::default()).is_err());
    }
}
