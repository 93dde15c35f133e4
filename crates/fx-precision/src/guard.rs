//! The guarded training step: loss scaling, unscaling, clipping, the NaN/Inf guard and
//! the optimiser, composed once so that models do not re-assemble them.
//!
//! Order per step, as PyTorch AMP prescribes: backward of the scaled loss → one
//! device-side pass over all gradients that yields both "is anything non-finite" and the
//! unscaled global norm, read together with the loss in a single device-to-host transfer →
//! if the loss or any gradient is non-finite, skip (nothing reaches the weights; the
//! scaler backs off; the skip is counted and reported) → otherwise unscale and clip in one
//! multiply per gradient → optimiser step → scaler update.

use std::collections::HashMap;
use std::fmt;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::clip::{accum_dtype, flat_grads, scale_grads};
use crate::error::{Context, Error, Result};
use crate::grad_scaler::GradScaler;
use crate::optim::Optimizer;
use crate::tensor_file::NamedTensors;

/// Why a step was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SkipReason {
    /// The loss was NaN or ±inf.
    NonFiniteLoss,
    /// A gradient (or the gradient norm) was NaN or ±inf. Under F16 loss scaling this is
    /// the expected occasional overflow that makes the scaler back off.
    NonFiniteGrad,
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The (unscaled) loss as read back from the device.
    pub loss: f64,
    /// Global L2 norm of the unscaled gradients before clipping (non-finite if skipped
    /// for that reason).
    pub grad_norm: f64,
    /// Whether clipping scaled the gradients down.
    pub clipped: bool,
    /// `Some` when the optimiser did not step.
    pub skipped: Option<SkipReason>,
    /// The loss scale used for this step (1 without scaling).
    pub loss_scale: f64,
}

/// Running counts of the guard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuardStats {
    /// Steps attempted.
    pub steps: u64,
    /// Steps that reached the optimiser.
    pub applied: u64,
    /// Steps skipped for a non-finite loss.
    pub nonfinite_loss: u64,
    /// Steps skipped for a non-finite gradient.
    pub nonfinite_grad: u64,
}

impl GuardStats {
    /// Steps skipped for either reason.
    pub fn skipped(&self) -> u64 {
        self.nonfinite_loss + self.nonfinite_grad
    }
}

impl fmt::Display for GuardStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} steps, {} applied, {} skipped (non-finite loss {}, non-finite gradient {})",
            self.steps,
            self.applied,
            self.skipped(),
            self.nonfinite_loss,
            self.nonfinite_grad
        )
    }
}

/// Names of the variables of `varmap` that received no gradient in `grads`, sorted.
///
/// A parameter the loss depends on can still end up without a gradient in candle when a
/// forward-only fused kernel sits on its path (`candle_nn::ops::softmax_last_dim`,
/// `rms_norm`, `LayerNorm`, ...). Models assert this is empty in their tests.
pub fn missing_gradients(varmap: &candle_nn::VarMap, grads: &GradStore) -> Vec<String> {
    crate::optim::sorted_vars(varmap)
        .into_iter()
        .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
        .map(|(n, _)| n)
        .collect()
}

/// Metadata key of the guard's counts in a checkpoint.
pub const GUARD_METADATA_KEY: &str = "fx.guard_stats";

/// Optimiser + scaler + clipping + guard; see the module docs.
pub struct TrainStep<O: Optimizer> {
    optimizer: O,
    scaler: GradScaler,
    max_grad_norm: Option<f64>,
    vars: Vec<Var>,
    stats: GuardStats,
    times: StepTimes,
}

/// Host wall-clock seconds spent in the phases of [`TrainStep`], summed over its steps
/// (for run profiles; not saved with checkpoints).
///
/// On a GPU the device runs asynchronously: `backward` is the time to record the backward
/// pass, `device_wait` the one read per step, which waits until the device has finished
/// the queued forward and backward work, and `optimizer` the time to queue the unscale,
/// clip and optimiser kernels (their device time shows up in the next step's wait). On
/// the CPU every phase is compute time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    pub backward: f64,
    pub device_wait: f64,
    pub optimizer: f64,
}

impl<O: Optimizer> TrainStep<O> {
    /// Composes `optimizer` (whose parameters are the ones stepped and clipped), `scaler`
    /// (use [`GradScaler::for_precision`]) and optional clipping at `max_grad_norm`.
    pub fn new(optimizer: O, scaler: GradScaler, max_grad_norm: Option<f64>) -> Result<Self> {
        if let Some(m) = max_grad_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(Error::Config {
                    what: "TrainStep",
                    message: format!("max_grad_norm {m} must be finite and > 0"),
                });
            }
        }
        let vars = optimizer.vars();
        Ok(TrainStep {
            optimizer,
            scaler,
            max_grad_norm,
            vars,
            stats: GuardStats::default(),
            times: StepTimes::default(),
        })
    }

    /// One full step on a scalar `loss` (F32 per the precision policy): scaled backward,
    /// then [`TrainStep::apply`].
    pub fn step(&mut self, loss: &Tensor) -> Result<StepReport> {
        Ok(self.step_reading(loss, &[])?.0)
    }

    /// [`TrainStep::step`] that also returns the values of the scalar tensors `extra`
    /// (a model's diagnostics), read in the step's one device-to-host transfer instead of
    /// a second synchronising read.
    pub fn step_reading(&mut self, loss: &Tensor, extra: &[&Tensor]) -> Result<(StepReport, Vec<f64>)> {
        let started = std::time::Instant::now();
        let grads = self.scaler.scale(loss).and_then(|l| l.backward().ctx("TrainStep backward"))?;
        self.times.backward += started.elapsed().as_secs_f64();
        self.apply_reading(loss, grads, extra)
    }

    /// Seconds spent per phase so far (see [`StepTimes`]).
    pub fn times(&self) -> StepTimes {
        self.times
    }

    /// The step after backward, for callers that produced the gradients themselves
    /// (accumulation, checkpointing): `grads` are gradients of `scale_loss(loss)`, and
    /// `loss` is the unscaled scalar loss (only its value is read).
    pub fn apply(&mut self, loss: &Tensor, grads: GradStore) -> Result<StepReport> {
        Ok(self.apply_reading(loss, grads, &[])?.0)
    }

    fn apply_reading(
        &mut self,
        loss: &Tensor,
        mut grads: GradStore,
        extra: &[&Tensor],
    ) -> Result<(StepReport, Vec<f64>)> {
        let ctx = "TrainStep::apply";
        if let Some(bad) = extra.iter().find(|t| t.elem_count() != 1) {
            return Err(Error::Config {
                what: "TrainStep extra reads",
                message: format!("must be scalars, got shape {:?}", bad.dims()),
            });
        }
        if loss.elem_count() != 1 {
            return Err(Error::Config {
                what: "TrainStep loss",
                message: format!("must be a scalar, got shape {:?}", loss.dims()),
            });
        }
        self.stats.steps += 1;
        let loss_scale = self.scaler.scale_factor();
        // PyTorch: inv_scale = float(1 / double(scale)).
        let inv = (1.0 / loss_scale) as f32 as f64;
        let acc = accum_dtype(loss.device());
        let loss_v = loss.detach().to_dtype(acc).and_then(|l| l.reshape(1)).ctx(ctx)?;
        // One reduction: sum(g*0 + (g*inv)^2) is NaN iff some g is non-finite (each term is
        // >= 0 or NaN), and the unscaled squared norm otherwise.
        let probe = match flat_grads(&self.vars, &grads)? {
            Some(flat) => {
                let f = flat.to_dtype(acc).ctx(ctx)?;
                let nan_if_bad = f.affine(0.0, 0.0).ctx(ctx)?;
                let sq = f.affine(inv, 0.0).and_then(|u| u.sqr()).ctx(ctx)?;
                (nan_if_bad + sq).and_then(|t| t.sum_all()).and_then(|t| t.reshape(1)).ctx(ctx)?
            }
            None => Tensor::zeros(1, acc, loss.device()).ctx(ctx)?,
        };
        let started = std::time::Instant::now();
        let mut parts = vec![probe, loss_v];
        for t in extra {
            parts.push(t.detach().to_dtype(acc).and_then(|t| t.reshape(1)).ctx(ctx)?);
        }
        let read: Vec<f64> =
            Tensor::cat(&parts, 0).and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1()).ctx(ctx)?;
        self.times.device_wait += started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        let (sumsq, loss_value) = (read[0], read[1]);
        let grad_norm = sumsq.sqrt();
        let skipped = if !loss_value.is_finite() {
            Some(SkipReason::NonFiniteLoss)
        } else if !sumsq.is_finite() {
            Some(SkipReason::NonFiniteGrad)
        } else {
            None
        };
        let mut report = StepReport { loss: loss_value, grad_norm, clipped: false, skipped, loss_scale };
        match skipped {
            Some(SkipReason::NonFiniteLoss) => self.stats.nonfinite_loss += 1,
            Some(SkipReason::NonFiniteGrad) => self.stats.nonfinite_grad += 1,
            None => {
                let mut factor = inv;
                if let Some(max) = self.max_grad_norm {
                    let coef = max / (grad_norm + 1e-6);
                    if coef < 1.0 {
                        factor *= coef;
                        report.clipped = true;
                    }
                }
                if factor != 1.0 {
                    scale_grads(&self.vars, &mut grads, factor)?;
                }
                self.optimizer.step(&grads)?;
                self.stats.applied += 1;
            }
        }
        // A non-finite scaled loss is an overflow too: back off as for a gradient.
        self.scaler.update(skipped.is_some());
        self.times.optimizer += started.elapsed().as_secs_f64();
        Ok((report, read[2..].to_vec()))
    }

    /// The factor the loss is multiplied by before backward (1 without scaling); pass it
    /// to [`crate::GradAccumulator::backward_scaled`].
    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale_factor()
    }

    /// `loss * scale`, for callers doing their own backward (e.g. checkpointing).
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        self.scaler.scale(loss)
    }

    /// The guard's counts so far.
    pub fn stats(&self) -> GuardStats {
        self.stats
    }

    /// The optimiser (e.g. to change the learning rate).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// The optimiser.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The scaler.
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// Writes optimiser state (tensors under `{prefix}`), scaler state and guard counts
    /// (metadata) for a checkpoint.
    pub fn save_state(
        &self,
        tensors: &mut HashMap<String, Tensor>,
        metadata: &mut HashMap<String, String>,
        prefix: &str,
    ) -> Result<()> {
        self.optimizer.save_state(tensors, prefix)?;
        self.scaler.save_metadata(metadata)?;
        let json = serde_json::to_string(&self.stats)
            .map_err(|e| Error::Metadata { what: "guard stats".into(), message: e.to_string() })?;
        metadata.insert(GUARD_METADATA_KEY.into(), json);
        Ok(())
    }

    /// Restores what [`TrainStep::save_state`] wrote.
    pub fn load_state(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()> {
        let meta = from.metadata().clone();
        let bad = |message: String| Error::Metadata { what: format!("guard stats ({GUARD_METADATA_KEY})"), message };
        let json = meta.get(GUARD_METADATA_KEY).ok_or_else(|| bad("key missing".into()))?;
        let stats: GuardStats = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
        let mut scaler = self.scaler.clone();
        scaler.load_metadata(&meta)?;
        self.optimizer.load_state(from, prefix)?;
        self.scaler = scaler;
        self.stats = stats;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grad_scaler::GradScalerConfig;
    use crate::ops::tests::Rng;
    use crate::optim::{AdamW, AdamWConfig};
    use crate::precision::Precision;
    use candle_core::Device;
    use proptest::prelude::*;

    fn var(rng: &mut Rng, n: usize) -> Var {
        let v: Vec<f32> = rng.vec(n, -1.0, 1.0).iter().map(|&x| x as f32).collect();
        Var::from_tensor(&Tensor::from_vec(v, n, &Device::Cpu).unwrap()).unwrap()
    }

    /// Loss `sum(c * w^2) * k` where `k` may be NaN/inf (poisoning the loss, the
    /// gradient or both) — built so each failure mode is reachable.
    fn loss_of(w: &Var, c: &Tensor, poison: u8) -> Tensor {
        let base = (w.as_tensor().sqr().unwrap() * c).unwrap().sum_all().unwrap();
        match poison {
            0 => base,
            // Non-finite loss with finite gradients: + a constant inf that has no gradient.
            1 => (base + Tensor::new(f32::INFINITY, w.device()).unwrap()).unwrap(),
            // NaN in loss and gradient.
            2 => (base * f64::NAN).unwrap(),
            // Finite loss, infinite gradient: sqrt at 0 has an infinite slope.
            _ => (base + (w.as_tensor() - w.as_tensor().detach()).unwrap().sqrt().unwrap().sum_all().unwrap()).unwrap(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

        /// Whatever sequence of clean and poisoned steps: poisoned steps never change the
        /// weights, they are counted by reason, and clean steps equal a manual
        /// unscale → clip → AdamW on a twin.
        #[test]
        fn nothing_non_finite_reaches_the_weights(
            seed in any::<u64>(),
            poisons in proptest::collection::vec(prop_oneof![3 => Just(0u8), 1 => 1u8..4], 1..12),
            f16 in any::<bool>(),
        ) {
            let mut rng = Rng::new(seed);
            let w = var(&mut rng, 6);
            let twin = Var::from_tensor(&w.as_tensor().copy().unwrap()).unwrap();
            let c = Tensor::from_vec(rng.vec(6, 0.5, 3.0).iter().map(|&x| x as f32).collect::<Vec<_>>(), 6, &Device::Cpu).unwrap();
            let cfg = AdamWConfig { lr: 0.05, ..Default::default() };
            let opt = AdamW::new([("w".to_string(), w.clone())], cfg).unwrap();
            let mut twin_opt = AdamW::new([("w".to_string(), twin.clone())], cfg).unwrap();
            let precision = if f16 { Precision::F16 } else { Precision::Bf16 };
            let mut ts = TrainStep::new(opt, GradScaler::for_precision(precision), Some(0.5)).unwrap();
            let mut want = GuardStats::default();
            for &p in &poisons {
                let before: Vec<f32> = w.as_tensor().to_vec1().unwrap();
                let r = ts.step(&loss_of(&w, &c, p)).unwrap();
                want.steps += 1;
                match p {
                    0 => {
                        want.applied += 1;
                        prop_assert_eq!(r.skipped, None);
                        let mut g = loss_of(&twin, &c, 0).backward().unwrap();
                        let norm = crate::clip_grad_norm(std::slice::from_ref(&twin), &mut g, 0.5).unwrap();
                        prop_assert!((norm - r.grad_norm).abs() <= 1e-4 * norm, "{} vs {}", norm, r.grad_norm);
                        twin_opt.step(&g).unwrap();
                        let a: Vec<f32> = w.as_tensor().to_vec1().unwrap();
                        let b: Vec<f32> = twin.as_tensor().to_vec1().unwrap();
                        for (x, y) in a.iter().zip(&b) {
                            prop_assert!((x - y).abs() <= 1e-5, "{} vs {}", x, y);
                        }
                    }
                    1 | 2 => {
                        want.nonfinite_loss += 1;
                        prop_assert_eq!(r.skipped, Some(SkipReason::NonFiniteLoss));
                    }
                    _ => {
                        want.nonfinite_grad += 1;
                        prop_assert_eq!(r.skipped, Some(SkipReason::NonFiniteGrad));
                    }
                }
                let after: Vec<f32> = w.as_tensor().to_vec1().unwrap();
                prop_assert!(after.iter().all(|v| v.is_finite()));
                if p != 0 {
                    prop_assert_eq!(before, after);
                }
            }
            prop_assert_eq!(ts.stats(), want);
            // Scale backs off once per skip under F16 and never moves under BF16.
            let skips = (want.nonfinite_loss + want.nonfinite_grad) as i32;
            let expect_scale = if f16 { 65536.0 * 0.5f64.powi(skips) } else { 1.0 };
            prop_assert_eq!(ts.scaler().scale_factor(), expect_scale);
        }
    }

    /// On the GPU: the one-reduction guard detects NaN/+inf/-inf the same way, and clean
    /// steps (F16 scaling, clipping, AdamW) match the CPU's. Skips without a device.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_guard_matches_cpu() {
        let Some(gpu) = fx_hw::test_gpu("cuda_guard_matches_cpu") else { return };
        let mut rng = Rng::new(77);
        let w_cpu = var(&mut rng, 6);
        let c_cpu =
            Tensor::from_vec(rng.vec(6, 0.5, 3.0).iter().map(|&x| x as f32).collect::<Vec<_>>(), 6, &Device::Cpu)
                .unwrap();
        let w_gpu = Var::from_tensor(&w_cpu.as_tensor().to_device(&gpu).unwrap()).unwrap();
        let c_gpu = c_cpu.to_device(&gpu).unwrap();
        let make = |w: &Var| {
            let opt =
                AdamW::new([("w".to_string(), w.clone())], AdamWConfig { lr: 0.05, ..Default::default() }).unwrap();
            TrainStep::new(opt, GradScaler::for_precision(Precision::F16), Some(0.5)).unwrap()
        };
        let (mut a, mut b) = (make(&w_cpu), make(&w_gpu));
        for p in [0u8, 1, 0, 2, 3, 0, 0] {
            let ra = a.step(&loss_of(&w_cpu, &c_cpu, p)).unwrap();
            let rb = b.step(&loss_of(&w_gpu, &c_gpu, p)).unwrap();
            assert_eq!(ra.skipped, rb.skipped, "poison {p}");
            assert_eq!(ra.loss_scale, rb.loss_scale);
            let x: Vec<f32> = w_cpu.as_tensor().to_vec1().unwrap();
            let y: Vec<f32> = w_gpu.as_tensor().to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
            for (u, v) in x.iter().zip(&y) {
                assert!((u - v).abs() <= 1e-5, "poison {p}: {u} vs {v}");
            }
        }
        assert_eq!(a.stats(), b.stats());
    }

    /// Accumulation through `TrainStep::apply` under F16 loss scaling takes the same step
    /// as one full-batch `TrainStep::step`.
    #[test]
    fn accumulated_step_equals_full_batch_step() {
        let mut rng = Rng::new(4);
        let dev = Device::Cpu;
        let xs: Vec<f32> = rng.vec(8 * 6, -1.0, 1.0).iter().map(|&x| x as f32).collect();
        let xs = Tensor::from_vec(xs, (8, 6), &dev).unwrap();
        let w = var(&mut rng, 6);
        let w2 = Var::from_tensor(&w.as_tensor().copy().unwrap()).unwrap();
        let loss_on = |w: &Var, x: &Tensor| {
            x.broadcast_mul(w.as_tensor()).unwrap().tanh().unwrap().sqr().unwrap().mean_all().unwrap()
        };
        let make = |w: &Var| {
            let opt = AdamW::new([("w".to_string(), w.clone())], AdamWConfig::default()).unwrap();
            TrainStep::new(opt, GradScaler::for_precision(Precision::F16), Some(0.05)).unwrap()
        };
        let (mut full, mut acc_ts) = (make(&w), make(&w2));
        let r_full = full.step(&loss_on(&w, &xs)).unwrap();
        let mut acc = crate::GradAccumulator::new(vec![w2.clone()], 4).unwrap();
        for k in 0..4 {
            let l = loss_on(&w2, &xs.narrow(0, 2 * k, 2).unwrap());
            acc.backward_scaled(&l, acc_ts.loss_scale()).unwrap();
        }
        let out = acc.take().unwrap();
        let r_acc = acc_ts.apply(&out.mean_loss, out.grads).unwrap();
        assert!((r_full.loss - r_acc.loss).abs() <= 1e-6, "{} vs {}", r_full.loss, r_acc.loss);
        assert!((r_full.grad_norm - r_acc.grad_norm).abs() <= 1e-5 * r_full.grad_norm);
        assert!(r_full.clipped && r_acc.clipped);
        let a: Vec<f32> = w.as_tensor().to_vec1().unwrap();
        let b: Vec<f32> = w2.as_tensor().to_vec1().unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6, "{x} vs {y}");
        }
    }

    /// The fused kernels' CPU reference (`crate::fused_ref`) takes the same steps as
    /// the eager `TrainStep` + AdamW/Adam on fresh random tensors: clean steps with and
    /// without clipping, skipped steps (NaN loss, infinite gradient), F16 loss scaling and
    /// a learning-rate change, within f32 rounding.
    #[test]
    fn fused_reference_matches_train_step() {
        use crate::fused_ref::{ctrl, new_ctrl, AdamConsts, GuardConsts, ScalerConsts};
        for (seed, decoupled, f16) in [(11u64, true, false), (12, false, true), (13, true, true)] {
            let mut rng = Rng::new(seed);
            let dims = [7usize, 3];
            let vars: Vec<Var> = dims.iter().map(|&n| var(&mut rng, n)).collect();
            let cs: Vec<Tensor> = dims
                .iter()
                .map(|&n| {
                    Tensor::from_vec(
                        rng.vec(n, 0.5, 3.0).iter().map(|&x| x as f32).collect::<Vec<_>>(),
                        n,
                        &Device::Cpu,
                    )
                    .unwrap()
                })
                .collect();
            let named = vars.iter().enumerate().map(|(i, v)| (format!("p{i}"), v.clone()));
            let (lr, wd) = (0.05, 0.1);
            let precision = if f16 { Precision::F16 } else { Precision::Bf16 };
            let scaler =
                GradScaler::new(GradScalerConfig { growth_interval: 3, ..GradScalerConfig::for_precision(precision) })
                    .unwrap();
            let max_norm = 1.5;
            let mut host: Vec<Vec<f32>> = vars.iter().map(|v| v.as_tensor().to_vec1().unwrap()).collect();
            let mut ms: Vec<Vec<f32>> = dims.iter().map(|&n| vec![0.0; n]).collect();
            let mut vs = ms.clone();
            let mut block = new_ctrl(lr, scaler.scale_factor());
            let adam = AdamConsts { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd, decoupled, tau: 0.0 };
            let guard = GuardConsts {
                max_norm: Some(max_norm),
                scaler: f16.then_some(ScalerConsts { growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 3 }),
            };
            let st = if decoupled {
                let opt = AdamW::new(named, AdamWConfig { lr, weight_decay: wd, ..Default::default() }).unwrap();
                reference_run(
                    TrainStep::new(opt, scaler, Some(max_norm)).unwrap(),
                    &vars,
                    &cs,
                    &mut host,
                    &mut ms,
                    &mut vs,
                    &mut block,
                    &adam,
                    &guard,
                    seed,
                )
            } else {
                let opt =
                    crate::Adam::new(named, crate::AdamConfig { lr, weight_decay: wd, ..Default::default() }).unwrap();
                reference_run(
                    TrainStep::new(opt, scaler, Some(max_norm)).unwrap(),
                    &vars,
                    &cs,
                    &mut host,
                    &mut ms,
                    &mut vs,
                    &mut block,
                    &adam,
                    &guard,
                    seed,
                )
            };
            assert_eq!(
                (block[ctrl::APPLIED] as u64, block[ctrl::SKIP_LOSS] as u64, block[ctrl::SKIP_GRAD] as u64),
                (st.applied, st.nonfinite_loss, st.nonfinite_grad)
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reference_run<O: Optimizer>(
        mut ts: TrainStep<O>,
        vars: &[Var],
        cs: &[Tensor],
        host: &mut [Vec<f32>],
        ms: &mut [Vec<f32>],
        vs: &mut [Vec<f32>],
        block: &mut [f64; crate::fused_ref::ctrl::LEN],
        adam: &crate::fused_ref::AdamConsts,
        guard: &crate::fused_ref::GuardConsts,
        seed: u64,
    ) -> GuardStats {
        use crate::fused_ref::{ctrl, fused_step_reference, RefTensor};
        for (k, poison) in [0u8, 0, 2, 0, 3, 0, 0, 0, 0].into_iter().enumerate() {
            if k == 5 {
                ts.optimizer_mut().set_learning_rate(0.02);
                block[ctrl::LR] = 0.02;
            }
            // The scaled loss's gradients, as the device would see them.
            let scale = ts.loss_scale();
            let loss: Tensor =
                vars.iter().zip(cs.iter()).map(|(w, c)| loss_of(w, c, poison)).reduce(|a, b| (a + b).unwrap()).unwrap();
            let grads = (&loss * scale).unwrap().backward().unwrap();
            let g_host: Vec<Vec<f32>> =
                vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().to_vec1().unwrap()).collect();
            let loss_v = loss.to_scalar::<f32>().unwrap();
            ts.apply(&loss, grads).unwrap();
            let mut tensors: Vec<RefTensor<'_>> = Vec::new();
            for ((p, g), (m, v)) in host.iter_mut().zip(&g_host).zip(ms.iter_mut().zip(vs.iter_mut())) {
                tensors.push(RefTensor { param: p, grad: g, exp_avg: m, exp_avg_sq: v, target: None });
            }
            fused_step_reference(&mut tensors, loss_v, &[], block, adam, guard);
            for (v, h) in vars.iter().zip(host.iter()) {
                let got: Vec<f32> = v.as_tensor().to_vec1().unwrap();
                for (a, b) in got.iter().zip(h) {
                    assert!(
                        (a - b).abs() <= 2e-6 * a.abs().max(1.0),
                        "seed {seed} step {k}: eager {a} vs reference {b}"
                    );
                }
            }
            assert_eq!(block[ctrl::SCALE], ts.loss_scale(), "seed {seed} step {k}");
        }
        ts.stats()
    }

    #[test]
    fn missing_gradients_names_dropped_parameters() {
        let dev = Device::Cpu;
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let a = vb.get_with_hints(3, "a", candle_nn::Init::Const(0.5)).unwrap();
        let b = vb.get_with_hints(3, "b", candle_nn::Init::Const(0.5)).unwrap();
        let _unused = vb.get_with_hints(3, "c", candle_nn::Init::Const(0.5)).unwrap();
        // `b` goes through candle's fused softmax: the loss depends on it, the gradient is lost.
        let y = (crate::ops::softmax_last_dim(&a).unwrap() + candle_nn::ops::softmax_last_dim(&b).unwrap()).unwrap();
        let w = Tensor::new(&[1f32, 2., 3.], &dev).unwrap();
        let g = (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(missing_gradients(&vm, &g), ["b", "c"]);
    }

    #[test]
    fn state_round_trip_and_report() {
        let mut rng = Rng::new(9);
        let w = var(&mut rng, 4);
        let c = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let opt = AdamW::new([("w".to_string(), w.clone())], AdamWConfig::default()).unwrap();
        let scaler = GradScaler::new(GradScalerConfig { growth_interval: 2, ..Default::default() }).unwrap();
        let mut ts = TrainStep::new(opt, scaler, None).unwrap();
        ts.step(&loss_of(&w, &c, 0)).unwrap();
        ts.step(&loss_of(&w, &c, 2)).unwrap();
        ts.step(&loss_of(&w, &c, 0)).unwrap();
        let (mut t, mut m) = (HashMap::new(), HashMap::new());
        ts.save_state(&mut t, &mut m, "optim.").unwrap();
        let w2 = Var::from_tensor(&w.as_tensor().copy().unwrap()).unwrap();
        let opt2 = AdamW::new([("w".to_string(), w2.clone())], AdamWConfig::default()).unwrap();
        let mut ts2 = TrainStep::new(opt2, GradScaler::for_precision(Precision::F16), None).unwrap();
        let mut src = NamedTensors::new("mem", t);
        // NamedTensors::new carries no metadata: the guard refuses to half-restore.
        assert!(ts2.load_state(&mut src, "optim.").is_err());
        let mut src = NamedTensors::with_metadata("mem", src.into_tensors(), m);
        ts2.load_state(&mut src, "optim.").unwrap();
        src.finish().unwrap();
        assert_eq!(ts2.stats(), ts.stats());
        assert_eq!(ts2.scaler().state(), ts.scaler().state());
        let a = ts.step(&loss_of(&w, &c, 0)).unwrap();
        let b = ts2.step(&loss_of(&w2, &c, 0)).unwrap();
        assert_eq!(a, b);
        assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), w2.as_tensor().to_vec1::<f32>().unwrap());
        assert!(ts.stats().to_string().contains("1 skipped"));
        assert!(TrainStep::new(
            AdamW::new([], AdamWConfig::default()).unwrap(),
            GradScaler::for_precision(Precision::F32),
            Some(f64::NAN)
        )
        .is_err());
    }

    #[test]
    fn step_reading_returns_extras_from_the_same_read() {
        let dev = Device::Cpu;
        let w = Var::from_vec(vec![0.5f32, -1.5, 2.0], 3, &dev).unwrap();
        let c = Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap();
        let opt = AdamW::new([("w".to_string(), w.clone())], AdamWConfig::default()).unwrap();
        let mut ts = TrainStep::new(opt, GradScaler::for_precision(Precision::F32), None).unwrap();
        let loss = loss_of(&w, &c, 0);
        let a = Tensor::new(0.25f32, &dev).unwrap();
        let b = w.as_tensor().sum_all().unwrap();
        let before = w.as_tensor().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
        let (report, extra) = ts.step_reading(&loss, &[&a, &b]).unwrap();
        assert_eq!(extra.len(), 2);
        assert_eq!(extra[0], 0.25);
        // Read before the optimiser moved the weights.
        assert!((extra[1] - before).abs() < 1e-6, "{extra:?} vs {before}");
        assert!(report.skipped.is_none() && report.loss.is_finite());
        let not_scalar = Tensor::new(&[1f32, 2.0], &dev).unwrap();
        assert!(ts.step_reading(&loss_of(&w, &c, 0), &[&not_scalar]).is_err());
    }
}
