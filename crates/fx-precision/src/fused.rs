//! [`FusedStep`]: the tail of [`crate::TrainStep`] (NaN/Inf guard, unscale + clip, Adam or
//! AdamW with F32 moments, GradScaler update) plus an optional soft target update, as
//! three kernel launches that read and write only device memory (`crate::fused::kernels`).
//! Nothing goes to the host per step, so a CUDA graph can capture it ([`crate::CapturedGraph`]):
//! the learning rate, step count, bias corrections, loss scale and the guard's counters
//! live in a device control block, read back only when asked ([`FusedStep::stats`]).
//!
//! The state it saves and loads is [`crate::TrainStep`]'s, name for name, so a checkpoint
//! written by either resumes with either.

#[cfg(test)]
mod kernel_tests;
mod kernels;
#[cfg(test)]
mod pop_kernel_tests;
pub mod pop_kernels;

use std::collections::HashMap;

use crate::fused_ref::{ctrl, AdamConsts, GuardConsts, ScalerConsts, MAX_EXTRA};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use fx_kernels::cuda::address;
use kernels::{FusedStepKernels, MtEntry, StepBuffers};

use crate::error::{Context, Error, Result};
use crate::grad_scaler::{GradScaler, GradScalerState};
use crate::guard::{GuardStats, GUARD_METADATA_KEY};
use crate::optim::{AdamConfig, AdamWConfig};
use crate::tensor_file::NamedTensors;

/// Adam-family hyper-parameters the fused kernels take.
pub trait FusedAdamConfig {
    /// The kernels' constants (τ is set by [`FusedStep::with_targets`]).
    fn consts(&self) -> AdamConsts;
    /// The initial learning rate.
    fn lr(&self) -> f64;
}

impl FusedAdamConfig for AdamWConfig {
    fn consts(&self) -> AdamConsts {
        AdamConsts {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decoupled: true,
            tau: 0.0,
        }
    }
    fn lr(&self) -> f64 {
        self.lr
    }
}

impl FusedAdamConfig for AdamConfig {
    fn consts(&self) -> AdamConsts {
        AdamConsts {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decoupled: false,
            tau: 0.0,
        }
    }
    fn lr(&self) -> f64 {
        self.lr
    }
}

/// What the device-side step has counted and last seen (one read of the control block).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedStats {
    /// The guard's counts (steps, applied, skipped by reason).
    pub guard: GuardStats,
    /// The last step's unscaled loss.
    pub last_loss: f64,
    /// The last step's gradient norm before clipping.
    pub last_grad_norm: f64,
    /// Whether the last step was skipped.
    pub last_skipped: bool,
    /// The current loss scale.
    pub loss_scale: f64,
    /// Mean loss of the applied steps since the last [`FusedStep::reset_sums`] (NaN if none).
    pub mean_loss: f64,
    /// Number of applied steps in `mean_loss`.
    pub loss_count: u64,
    /// Steps whose gradients were clipped.
    pub clipped: u64,
    /// Last values of the extra scalars.
    pub extra_last: [f64; MAX_EXTRA],
    /// Sums of the applied steps' extra scalars since the last reset (divide by
    /// `loss_count` for their means).
    pub extra_sum: [f64; MAX_EXTRA],
    /// Mean gradient norm (before clipping) of the applied steps since the last reset (NaN
    /// if none).
    pub mean_grad_norm: f64,
}

/// The device-resident training-step tail; see the module docs.
pub struct FusedStep {
    names: Vec<String>,
    vars: Vec<Var>,
    /// Moments: one contiguous F32 buffer each, one view per parameter.
    exp_avg_flat: Tensor,
    exp_avg_sq_flat: Tensor,
    offsets: Vec<usize>,
    targets: Option<Vec<Var>>,
    ctrl: Tensor,
    scale32: Tensor,
    partials: Tensor,
    adam: AdamConsts,
    guard: GuardConsts,
    kernels: FusedStepKernels,
}

impl FusedStep {
    /// A fused step over named F32 parameters on a CUDA device, with `config`'s Adam
    /// variant, `scaler`'s scaling (state included) and optional clipping. Moments start at
    /// zero; load a [`crate::TrainStep`]'s state with [`FusedStep::load_state`].
    pub fn new(
        params: Vec<(String, Var)>,
        config: &impl FusedAdamConfig,
        scaler: &GradScaler,
        max_grad_norm: Option<f64>,
    ) -> Result<Self> {
        const CTX: &str = "FusedStep::new";
        let bad = |message: String| Error::Config { what: "FusedStep", message };
        let Some((_, first)) = params.first() else {
            return Err(bad("no parameters".into()));
        };
        let device = first.device().clone();
        if !device.is_cuda() {
            return Err(bad("the fused step runs on a CUDA device only".into()));
        }
        let mut offsets = Vec::with_capacity(params.len());
        let mut total = 0usize;
        for (name, v) in &params {
            if v.dtype() != DType::F32 || !v.device().same_device(&device) {
                return Err(bad(format!("parameter {name:?} must be F32 on {device:?}, got {:?}", v.dtype())));
            }
            offsets.push(total);
            total += v.elem_count();
        }
        let zeros = |n: usize| Tensor::zeros(n, DType::F32, &device).ctx(CTX);
        let sc = scaler.config();
        let scaler_consts = sc.enabled.then_some(ScalerConsts {
            growth_factor: sc.growth_factor,
            backoff_factor: sc.backoff_factor,
            growth_interval: sc.growth_interval,
        });
        let lens: Vec<usize> = params.iter().map(|(_, v)| v.elem_count()).collect();
        let block = crate::fused_ref::new_ctrl(config.lr(), scaler.scale_factor());
        let me = Self {
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            vars: params.into_iter().map(|(_, v)| v).collect(),
            exp_avg_flat: zeros(total)?,
            exp_avg_sq_flat: zeros(total)?,
            offsets,
            targets: None,
            ctrl: Tensor::from_slice(&block, ctrl::LEN, &device).ctx(CTX)?,
            scale32: Tensor::new(&[scaler.scale_factor() as f32], &device).ctx(CTX)?,
            partials: zeros(FusedStepKernels::partials_len(&lens))?,
            adam: config.consts(),
            guard: GuardConsts { max_norm: max_grad_norm, scaler: scaler_consts },
            kernels: FusedStepKernels::load(&device).map_err(|e| kernel_err(CTX, e))?,
        };
        let st = scaler.state();
        me.write_ctrl(ctrl::GROWTH, st.growth_tracker as f64)?;
        Ok(me)
    }

    /// Adds a soft target update `target += tau (param - target)` after every applied step
    /// (DQN's target network); `targets` pair with the parameters in order.
    pub fn with_targets(mut self, targets: Vec<Var>, tau: f64) -> Result<Self> {
        if targets.len() != self.vars.len()
            || targets.iter().zip(&self.vars).any(|(t, v)| t.dims() != v.dims() || t.dtype() != DType::F32)
        {
            return Err(Error::Config {
                what: "FusedStep targets",
                message: "must pair with the parameters: same count, shapes, F32".into(),
            });
        }
        self.targets = Some(targets);
        self.adam.tau = tau;
        Ok(self)
    }

    /// The device the step runs on.
    pub fn device(&self) -> &Device {
        self.ctrl.device()
    }

    /// The loss to differentiate: `loss × scale` with the device-resident scale when
    /// scaling is on (so a replayed graph follows the scaler), else `loss` itself.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        if self.guard.scaler.is_none() {
            return Ok(loss.clone());
        }
        let s = self.scale32.to_dtype(loss.dtype()).and_then(|s| s.reshape(())).ctx("FusedStep::scale_loss")?;
        loss.broadcast_mul(&s).ctx("FusedStep::scale_loss")
    }

    /// Queues the step for `grads` (of [`FusedStep::scale_loss`]`(loss)`): every parameter
    /// needs an F32 gradient. `extras` are F32 scalars recorded in the control block.
    /// `dry` queues the same launches without touching any state (graph warm-up).
    pub fn step(&self, loss: &Tensor, grads: &GradStore, extras: &[&Tensor], dry: bool) -> Result<()> {
        let mut gs = Vec::with_capacity(self.vars.len());
        for (k, v) in self.vars.iter().enumerate() {
            gs.push(grads.get(v.as_tensor()).ok_or_else(|| Error::Config {
                what: "FusedStep",
                message: format!("parameter {:?} has no gradient", self.names[k]),
            })?);
        }
        self.step_with(loss, &gs, extras, dry)
    }

    /// [`FusedStep::step`] with the gradients given in parameter order (callers that compute
    /// them without candle's autograd, e.g. into one flat buffer).
    pub fn step_with(&self, loss: &Tensor, grads: &[&Tensor], extras: &[&Tensor], dry: bool) -> Result<()> {
        const CTX: &str = "FusedStep::step";
        let addr = |t: &Tensor, what: &'static str| address::<f32>(t, what).map_err(|e| kernel_err(CTX, e));
        if grads.len() != self.vars.len() {
            return Err(Error::Config {
                what: "FusedStep",
                message: format!("{} gradients for {} parameters", grads.len(), self.vars.len()),
            });
        }
        let mut keep = Vec::with_capacity(self.vars.len() + extras.len() + 1);
        let mut entries = Vec::with_capacity(self.vars.len());
        for (k, (v, g)) in self.vars.iter().zip(grads).enumerate() {
            if g.elem_count() != v.elem_count() {
                return Err(Error::Config {
                    what: "FusedStep",
                    message: format!(
                        "gradient of {:?} has shape {:?}, the parameter {:?}",
                        self.names[k],
                        g.dims(),
                        v.dims()
                    ),
                });
            }
            let g = g.to_dtype(DType::F32).and_then(|g| g.contiguous()).ctx(CTX)?;
            let n = v.elem_count();
            let m = self.exp_avg_flat.narrow(0, self.offsets[k], n).ctx(CTX)?;
            let s = self.exp_avg_sq_flat.narrow(0, self.offsets[k], n).ctx(CTX)?;
            let target = match &self.targets {
                Some(t) => addr(t[k].as_tensor(), "target")?,
                None => 0,
            };
            entries.push(MtEntry {
                param: addr(v.as_tensor(), "param")?,
                grad: addr(&g, "grad")?,
                exp_avg: addr(&m, "exp_avg")?,
                exp_avg_sq: addr(&s, "exp_avg_sq")?,
                target,
                len: n,
            });
            keep.push(g);
        }
        let loss32 = loss.to_dtype(DType::F32).and_then(|l| l.flatten_all()).ctx(CTX)?;
        if loss32.elem_count() != 1 {
            return Err(Error::Config {
                what: "FusedStep loss",
                message: format!("must be a scalar, got {:?}", loss.dims()),
            });
        }
        let mut extra_addr = Vec::with_capacity(extras.len());
        for t in extras {
            let t = t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).ctx(CTX)?;
            if t.elem_count() != 1 {
                return Err(Error::Config {
                    what: "FusedStep extras",
                    message: format!("must be scalars, got {:?}", t.dims()),
                });
            }
            extra_addr.push(addr(&t, "extra")?);
            keep.push(t);
        }
        let bufs = StepBuffers {
            loss: addr(&loss32, "loss")?,
            ctrl: address::<f64>(&self.ctrl, "ctrl").map_err(|e| kernel_err(CTX, e))?,
            scale32: addr(&self.scale32, "scale32")?,
            partials: addr(&self.partials, "partials")?,
        };
        // SAFETY: every address belongs to a tensor alive until after the launches are
        // queued (`keep`, `loss32`, `self`); candle frees stream-ordered, so the kernels run
        // before any of them is released. Inside a capture the graph owns those allocations.
        unsafe { self.kernels.launch(&entries, &bufs, &extra_addr, &self.adam, &self.guard, dry) }
            .map_err(|e| kernel_err(CTX, e))?;
        drop(keep);
        Ok(())
    }

    fn write_ctrl(&self, index: usize, value: f64) -> Result<()> {
        let v = Tensor::new(&[value], self.device()).ctx("FusedStep control block")?;
        self.ctrl.slice_set(&v, 0, index).ctx("FusedStep control block")
    }

    /// One read of the control block (synchronises with the device).
    pub fn stats(&self) -> Result<FusedStats> {
        let c: Vec<f64> = self.ctrl.to_vec1().ctx("FusedStep::stats")?;
        Ok(Self::stats_of(&c))
    }

    /// The statistics in a control block read back from the device.
    fn stats_of(c: &[f64]) -> FusedStats {
        let count = c[ctrl::LOSS_COUNT];
        let (skip_loss, skip_grad, applied) =
            (c[ctrl::SKIP_LOSS] as u64, c[ctrl::SKIP_GRAD] as u64, c[ctrl::APPLIED] as u64);
        let mut extra_last = [0.0; MAX_EXTRA];
        let mut extra_sum = [0.0; MAX_EXTRA];
        extra_last.copy_from_slice(&c[ctrl::EXTRA_LAST..ctrl::EXTRA_LAST + MAX_EXTRA]);
        extra_sum.copy_from_slice(&c[ctrl::EXTRA_SUM..ctrl::EXTRA_SUM + MAX_EXTRA]);
        FusedStats {
            guard: GuardStats {
                steps: applied + skip_loss + skip_grad,
                applied,
                nonfinite_loss: skip_loss,
                nonfinite_grad: skip_grad,
            },
            last_loss: c[ctrl::LAST_LOSS],
            last_grad_norm: c[ctrl::LAST_NORM],
            last_skipped: c[ctrl::LAST_SKIPPED] != 0.0,
            loss_scale: c[ctrl::SCALE],
            mean_loss: if count > 0.0 { c[ctrl::LOSS_SUM] / count } else { f64::NAN },
            loss_count: count as u64,
            clipped: c[ctrl::CLIPPED] as u64,
            extra_last,
            extra_sum,
            mean_grad_norm: if count > 0.0 { c[ctrl::NORM_SUM] / count } else { f64::NAN },
        }
    }

    /// Zeroes the loss, gradient-norm and extra sums (e.g. at each logging interval).
    pub fn reset_sums(&self) -> Result<()> {
        self.write_ctrl(ctrl::LOSS_SUM, 0.0)?;
        self.write_ctrl(ctrl::LOSS_COUNT, 0.0)?;
        self.write_ctrl(ctrl::NORM_SUM, 0.0)?;
        let z = Tensor::zeros(MAX_EXTRA, DType::F64, self.device()).ctx("FusedStep::reset_sums")?;
        self.ctrl.slice_set(&z, 0, ctrl::EXTRA_SUM).ctx("FusedStep::reset_sums")
    }

    /// Sets the learning rate read by every later step (replays included).
    pub fn set_learning_rate(&self, lr: f64) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::Config {
                what: "FusedStep",
                message: format!("learning rate {lr} must be finite and >= 0"),
            });
        }
        self.write_ctrl(ctrl::LR, lr)
    }

    /// Writes the state as [`crate::TrainStep::save_state`] does (same names and metadata).
    pub fn save_state(
        &self,
        tensors: &mut HashMap<String, Tensor>,
        metadata: &mut HashMap<String, String>,
        prefix: &str,
    ) -> Result<()> {
        const CTX: &str = "FusedStep::save_state";
        // One read of the control block for the counters and the guard's statistics.
        let c: Vec<f64> = self.ctrl.to_vec1().ctx(CTX)?;
        let st = Self::stats_of(&c);
        let step = Tensor::new(c[ctrl::STEP] as i64, self.device()).ctx(CTX)?;
        for (k, (name, v)) in self.names.iter().zip(&self.vars).enumerate() {
            let n = v.elem_count();
            let view =
                |t: &Tensor| t.narrow(0, self.offsets[k], n).and_then(|t| t.reshape(v.dims())).and_then(|t| t.copy());
            tensors.insert(format!("{prefix}{name}.exp_avg"), view(&self.exp_avg_flat).ctx(CTX)?);
            tensors.insert(format!("{prefix}{name}.exp_avg_sq"), view(&self.exp_avg_sq_flat).ctx(CTX)?);
            tensors.insert(format!("{prefix}{name}.step"), step.clone());
        }
        let state = GradScalerState { scale: c[ctrl::SCALE] as f32, growth_tracker: c[ctrl::GROWTH] as u32 };
        let json = serde_json::to_string(&state)
            .map_err(|e| Error::Metadata { what: "GradScaler state".into(), message: e.to_string() })?;
        metadata.insert(crate::GRAD_SCALER_METADATA_KEY.into(), json);
        let json = serde_json::to_string(&st.guard)
            .map_err(|e| Error::Metadata { what: "guard stats".into(), message: e.to_string() })?;
        metadata.insert(GUARD_METADATA_KEY.into(), json);
        Ok(())
    }

    /// Restores what [`FusedStep::save_state`] or [`crate::TrainStep::save_state`] wrote.
    pub fn load_state(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()> {
        const CTX: &str = "FusedStep::load_state";
        let meta = from.metadata().clone();
        let bad = |what: &str, message: String| Error::Metadata { what: what.into(), message };
        let guard: GuardStats = meta
            .get(GUARD_METADATA_KEY)
            .ok_or_else(|| bad("guard stats", "key missing".into()))
            .and_then(|j| serde_json::from_str(j).map_err(|e| bad("guard stats", e.to_string())))?;
        let scaler: GradScalerState = meta
            .get(crate::GRAD_SCALER_METADATA_KEY)
            .ok_or_else(|| bad("GradScaler state", "key missing".into()))
            .and_then(|j| serde_json::from_str(j).map_err(|e| bad("GradScaler state", e.to_string())))?;
        self.load_moments(from, prefix)?;
        self.write_ctrl(ctrl::APPLIED, guard.applied as f64)?;
        self.write_ctrl(ctrl::SKIP_LOSS, guard.nonfinite_loss as f64)?;
        self.write_ctrl(ctrl::SKIP_GRAD, guard.nonfinite_grad as f64)?;
        // A disabled scaler keeps its (unused) initial scale in its state; its factor is 1.
        let scale = if self.guard.scaler.is_some() { scaler.scale } else { 1.0 };
        self.write_ctrl(ctrl::SCALE, scale as f64)?;
        self.write_ctrl(ctrl::GROWTH, scaler.growth_tracker as f64)?;
        let s32 = Tensor::new(&[scale], self.device()).ctx(CTX)?;
        self.scale32.slice_set(&s32, 0, 0).ctx(CTX)?;
        Ok(())
    }

    /// The moments and step count an [`crate::Optimizer`] of the Adam family saved under
    /// `prefix` (`{name}.exp_avg`, `.exp_avg_sq`, `.step`), written in place.
    fn load_moments(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()> {
        const CTX: &str = "FusedStep::load_state";
        let mut ms = Vec::with_capacity(self.vars.len());
        let mut vs = Vec::with_capacity(self.vars.len());
        let mut step = 0i64;
        for (name, v) in self.names.iter().zip(&self.vars) {
            let dims = v.dims().to_vec();
            let flat =
                |t: Tensor| t.to_dtype(DType::F32).and_then(|t| t.to_device(v.device())).and_then(|t| t.flatten_all());
            ms.push(flat(from.take(&format!("{prefix}{name}.exp_avg"), &dims)?).ctx(CTX)?);
            vs.push(flat(from.take(&format!("{prefix}{name}.exp_avg_sq"), &dims)?).ctx(CTX)?);
            let s = from.take(&format!("{prefix}{name}.step"), &[])?;
            step = step.max(s.to_dtype(DType::I64).and_then(|s| s.to_scalar::<i64>()).ctx(CTX)?);
        }
        let m = Tensor::cat(&ms, 0).ctx(CTX)?;
        let v = Tensor::cat(&vs, 0).ctx(CTX)?;
        // In place: a captured graph keeps the buffers' addresses.
        self.exp_avg_flat.slice_set(&m, 0, 0).ctx(CTX)?;
        self.exp_avg_sq_flat.slice_set(&v, 0, 0).ctx(CTX)?;
        self.write_ctrl(ctrl::STEP, step.max(0) as f64)
    }

    /// Takes over a bare Adam/AdamW optimiser's moments, step count and learning rate (in
    /// memory; a loop that clips and steps without [`crate::TrainStep`]). The guard's
    /// counters and the scale stay as they are.
    pub fn load_optimizer<O: crate::Optimizer>(&mut self, opt: &O) -> Result<()> {
        let mut t = HashMap::new();
        opt.save_state(&mut t, "opt.")?;
        self.set_learning_rate(opt.learning_rate())?;
        self.load_moments(&mut NamedTensors::with_metadata("optimizer state", t, HashMap::new()), "opt.")
    }

    /// Takes over a [`crate::TrainStep`]'s optimiser, scaler and guard state (in memory).
    pub fn load_from<O: crate::Optimizer>(&mut self, step: &crate::TrainStep<O>) -> Result<()> {
        let (mut t, mut m) = (HashMap::new(), HashMap::new());
        step.save_state(&mut t, &mut m, "opt.")?;
        self.set_learning_rate(step.optimizer().learning_rate())?;
        self.load_state(&mut NamedTensors::with_metadata("train step state", t, m), "opt.")
    }
}

fn kernel_err(context: &'static str, e: fx_kernels::Error) -> Error {
    Error::Cuda { context, message: e.to_string() }
}
