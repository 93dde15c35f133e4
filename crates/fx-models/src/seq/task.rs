//! What the training loop needs from a model ([`SeqTask`]: windows to batches, loss,
//! forecasts), implemented by the TFT and by MAMBA-2 ([`Mamba2Task`]); under `cuda`,
//! [`FusedSeqStep`], the fused forward + backward the trainer captures as one graph.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};

use super::ops::Ctx;
#[cfg(feature = "cuda")]
use super::ops::DropoutRng;
use super::series::{NextBar, SeqBatch, SeqSeries};
use crate::error::{Context, Error, Result};
use crate::mamba2::Mamba2;
use crate::params::ParamStore;
use crate::tft::Tft;
#[cfg(feature = "cuda")]
use fx_precision::Precision;

/// What the training loop needs from a model.
pub trait SeqTask {
    /// Rows a sample window reaches: its inputs' rows and every row whose price its
    /// targets use (a window drawn from a split stays inside it, targets included).
    fn window_len(&self) -> usize;
    /// Where the one-bar-ahead forecast sits in a window's target (for trading on it and
    /// dating it).
    fn next_bar(&self) -> NextBar;
    /// The batch of windows starting at `starts` (each window inside `series`, and inside
    /// one instrument's rows of a panel's).
    fn batch(&self, series: &SeqSeries, starts: &[usize], device: &Device) -> Result<SeqBatch>;
    /// The training loss of a batch (F32 scalar).
    fn loss(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor>;
    /// The loss and the parameter gradients, optionally recomputing activations (`fx_precision::Recomputed`).
    fn loss_and_grads(&self, c: &Ctx, batch: &SeqBatch, recompute: bool) -> Result<(Tensor, GradStore)>;
    /// The point forecast (TFT: the median quantile), shaped as the target.
    fn point(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor>;
    /// Quantile levels and the quantile forecast `[.., n_levels]` shaped as the target
    /// plus a last axis, for models that forecast quantiles (`None` otherwise).
    fn quantiles(&self, _c: &Ctx, _batch: &SeqBatch) -> Result<Option<(Vec<f64>, Tensor)>> {
        Ok(None)
    }
    /// The parameters.
    fn params(&self) -> &ParamStore;
    /// The model's fused training step for batches of `batch` windows at `precision`
    /// (forward, loss and backward on preallocated device buffers, without candle's
    /// autograd), when it has one for these shapes; `Err` says why not in one line, and the
    /// trainer then captures candle's step instead.
    #[cfg(feature = "cuda")]
    fn fused_step(&self, _batch: usize, _precision: Precision) -> Result<Box<dyn FusedSeqStep>> {
        Err(Error::config("SeqTask::fused_step", "no fused step for this model"))
    }
}

/// A sequence model's training step without candle's autograd (CUDA): queues forward, loss
/// and backward for one batch of the size it was built for, reads nothing back, and returns
/// the loss and one gradient per parameter in `params().vars()` order, in buffers it reuses
/// (so a CUDA graph captures it).
#[cfg(feature = "cuda")]
pub trait FusedSeqStep {
    /// Windows per batch it was built for.
    fn batch_size(&self) -> usize;
    /// Loss and gradients of `inputs` against `target` (a [`SeqBatch`]'s), dropout from `rng`.
    fn loss_and_grads(&self, inputs: &[Tensor], target: &Tensor, rng: &DropoutRng) -> Result<(Tensor, Vec<Tensor>)>;
}

fn tensor(v: Vec<f32>, shape: &[usize], device: &Device) -> Result<Tensor> {
    Tensor::from_vec(v, shape, device).ctx("SeqTask::batch")
}

impl SeqTask for Tft {
    fn window_len(&self) -> usize {
        self.config().window_len()
    }

    /// The first decoder step: the return after the last encoder row (`batch`'s target
    /// starts at row `l_enc - 1`).
    fn next_bar(&self) -> NextBar {
        NextBar { column: 0, row: self.config().l_enc - 1 }
    }

    fn batch(&self, s: &SeqSeries, starts: &[usize], device: &Device) -> Result<SeqBatch> {
        let cfg = self.config();
        let (b, l, h) = (starts.len(), cfg.l_enc, cfg.h);
        if s.n_observed != cfg.n_observed || s.n_known != cfg.n_known || l < 2 {
            return Err(Error::config(
                "Tft batch",
                format!(
                    "series has {}+{} features, model {}+{}; L_enc must be ≥ 2",
                    s.n_observed, s.n_known, cfg.n_observed, cfg.n_known
                ),
            ));
        }
        let observed = SeqSeries::gather(&s.observed, s.n_observed, starts, 0, l);
        let known = SeqSeries::gather(&s.known, s.n_known, starts, 0, l + h);
        // Decoder step i forecasts the return from row L−1+i to L+i of the window.
        let target = SeqSeries::gather(&s.target, 1, starts, l - 1, h);
        let last: Vec<f32> = starts.iter().flat_map(|&st| std::iter::repeat_n(s.target[st + l - 2], h)).collect();
        let mut inputs =
            vec![tensor(observed, &[b, l, s.n_observed], device)?, tensor(known, &[b, l + h, s.n_known], device)?];
        if s.n_instruments != cfg.n_instruments {
            return Err(Error::config(
                "Tft batch",
                format!("series of {} instruments, model built for {}", s.n_instruments, cfg.n_instruments),
            ));
        }
        if s.n_instruments > 0 {
            inputs.push(tensor(s.instrument_one_hot(starts, l + h)?, &[b, s.n_instruments], device)?);
        }
        Ok(SeqBatch { inputs, target: tensor(target, &[b, h], device)?, last_value: tensor(last, &[b, h], device)? })
    }

    fn loss(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor> {
        let q = self.forward_batch(c, batch)?;
        Tft::loss(self, &q, &batch.target)
    }

    fn loss_and_grads(&self, c: &Ctx, batch: &SeqBatch, recompute: bool) -> Result<(Tensor, GradStore)> {
        let i = batch.inputs.get(2);
        Tft::loss_and_grads_with(self, c, &batch.inputs[0], &batch.inputs[1], i, &batch.target, recompute)
    }

    fn quantiles(&self, c: &Ctx, batch: &SeqBatch) -> Result<Option<(Vec<f64>, Tensor)>> {
        let q = self.forward_batch(c, batch)?;
        Ok(Some((self.config().quantiles.clone(), q)))
    }

    fn point(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor> {
        let q = self.forward_batch(c, batch)?;
        crate::tft::point_forecast(&self.config().quantiles, &q)
    }

    fn params(&self) -> &ParamStore {
        Tft::params(self)
    }

    #[cfg(feature = "cuda")]
    fn fused_step(&self, batch: usize, precision: Precision) -> Result<Box<dyn FusedSeqStep>> {
        if self.config().n_instruments > 0 {
            return Err(Error::config("Tft fused step", "a panel model's static context is not in the fused kernels"));
        }
        let k = crate::tft::ops_cuda::CudaTft::new(self.params().device()).ctx("Tft fused step")?;
        Ok(Box::new(crate::tft::fused::TftFused::new(k, self, batch, precision)?))
    }
}

/// A MAMBA-2 trained on windows of `seq_len` steps (the model itself has no fixed
/// length).
#[derive(Debug, Clone, Copy)]
pub struct Mamba2Task<'a> {
    /// The model.
    pub model: &'a Mamba2,
    /// Steps per training window.
    pub seq_len: usize,
}

impl Mamba2Task<'_> {
    /// The rows a window of `seq_len` steps reaches: its steps and the bar after them (the
    /// last step's target is the return to it, so a window of a split must hold that bar
    /// too, else the training split's last window would read the validation split's first
    /// close, and validation the test's).
    pub fn window_len_of(seq_len: usize) -> usize {
        seq_len + 1
    }
}

impl SeqTask for Mamba2Task<'_> {
    fn window_len(&self) -> usize {
        Self::window_len_of(self.seq_len)
    }

    /// The last step: the return after the window's last row.
    fn next_bar(&self) -> NextBar {
        NextBar { column: self.seq_len - 1, row: self.seq_len - 1 }
    }

    /// A panel's windows end each step's features with the instrument's one-hot row, so
    /// that the model's `embed` adds a learned embedding of the instrument to its input
    /// (the model is built with `n_in` = features + instruments).
    fn batch(&self, s: &SeqSeries, starts: &[usize], device: &Device) -> Result<SeqBatch> {
        let (b, l) = (starts.len(), self.seq_len);
        let n_x = s.n_observed + s.n_instruments;
        if n_x != self.model.config().n_in {
            return Err(Error::config(
                "Mamba2 batch",
                format!(
                    "series has {} features and {} instruments, model n_in {}",
                    s.n_observed,
                    s.n_instruments,
                    self.model.config().n_in
                ),
            ));
        }
        let x = if s.n_instruments > 0 {
            // Each step's features, then its window's one-hot row, gathered in one pass.
            let one_hot = s.instrument_one_hot(starts, self.window_len())?;
            let mut x = Vec::with_capacity(b * l * n_x);
            for (&st, hot) in starts.iter().zip(one_hot.chunks(s.n_instruments)) {
                for r in st..st + l {
                    x.extend_from_slice(s.observed_row(r));
                    x.extend_from_slice(hot);
                }
            }
            x
        } else {
            SeqSeries::gather(&s.observed, s.n_observed, starts, 0, l)
        };
        // Step t predicts the return from row t to t+1.
        let target = SeqSeries::gather(&s.target, 1, starts, 0, l);
        let mut last = Vec::with_capacity(b * l);
        for &st in starts {
            last.push(if st > 0 { s.target[st - 1] } else { 0.0 });
            last.extend_from_slice(&s.target[st..st + l - 1]);
        }
        Ok(SeqBatch {
            inputs: vec![tensor(x, &[b, l, n_x], device)?],
            target: tensor(target, &[b, l], device)?,
            last_value: tensor(last, &[b, l], device)?,
        })
    }

    fn loss(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor> {
        let p = self.model.forward(c, &batch.inputs[0])?;
        self.model.loss(&p, &batch.target)
    }

    fn loss_and_grads(&self, c: &Ctx, batch: &SeqBatch, recompute: bool) -> Result<(Tensor, GradStore)> {
        self.model.loss_and_grads(c, &batch.inputs[0], &batch.target, recompute)
    }

    fn point(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor> {
        self.model.forward(c, &batch.inputs[0])
    }

    fn params(&self) -> &ParamStore {
        self.model.params()
    }

    #[cfg(feature = "cuda")]
    fn fused_step(&self, batch: usize, precision: Precision) -> Result<Box<dyn FusedSeqStep>> {
        Ok(Box::new(crate::mamba2::fused::Mamba2Fused::new(self.model, batch, self.seq_len, precision)?))
    }
}

impl Tft {
    /// The quantile forecast of a [`SeqBatch`] (its third input, when there is one, the
    /// windows' instruments).
    fn forward_batch(&self, c: &Ctx, batch: &SeqBatch) -> Result<Tensor> {
        self.forward_with(c, &batch.inputs[0], &batch.inputs[1], batch.inputs.get(2))
    }
}

#[cfg(feature = "cuda")]
impl FusedSeqStep for crate::mamba2::fused::Mamba2Fused {
    fn batch_size(&self) -> usize {
        self.batch()
    }

    fn loss_and_grads(&self, inputs: &[Tensor], target: &Tensor, _rng: &DropoutRng) -> Result<(Tensor, Vec<Tensor>)> {
        // MAMBA-2 has no dropout.
        let [x] = inputs else {
            return Err(Error::config("Mamba2 fused step", format!("{} inputs (x expected)", inputs.len())));
        };
        crate::mamba2::fused::Mamba2Fused::loss_and_grads(self, x, target)
    }
}
