//! AdamW for populations ([`PopAdamW`]): N members of one architecture whose parameters are
//! stacked `[N, ...]`, each member optimised as a solo [`crate::TrainStep`] with
//! [`crate::AdamW`] (or [`crate::Adam`] without weight decay, the same arithmetic) would be:
//! its own guard (a non-finite loss or gradient skips that member's step and no other's, and
//! is counted), its own global-norm clip, learning rate, weight decay, step count and bias
//! corrections, and optionally its own soft target update (`target += τ (p − target)`).
//!
//! Every decision is taken on the device from `[N]` tensors (the bias corrections are looked
//! up by each member's step count in tables computed once with the solo optimiser's `powf`),
//! so a step reads nothing back and runs unchanged inside a CUDA graph. On the CPU the
//! arithmetic is the solo optimiser's, batched over the leading axis, so member k's weights,
//! moments and counters are the solo run's values bit for bit (the model crates test that
//! over whole runs); on CUDA the guard's sums of squares and AdamW with the target update are
//! two member-batched kernels per table of tensors (`PopAdamKernels`, tested against
//! [`crate::fused_ref::pop_adam_reference`]).

use candle_core::{DType, Tensor, Var};

use crate::error::{Context, Error, Result};

const CTX: &str = "PopAdamW";

/// Bias-correction tables stop where `1 − βᵗ` is exactly 1.0 in f64 for both betas (the
/// solo optimiser's value from then on); a beta so close to 1 that this takes more steps is
/// refused.
const MAX_TABLE: usize = 1 << 20;

/// What one member may set differently from the others.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PopMember {
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay (0 for Adam).
    pub weight_decay: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Soft target update rate (read only when the optimiser has targets).
    pub tau: f64,
}

/// The last step's outcome per member (read back on request).
#[derive(Debug, Clone, PartialEq)]
pub struct PopStepReport {
    /// Each member's loss before the step.
    pub loss: Vec<f64>,
    /// Each member's global gradient norm before clipping.
    pub grad_norm: Vec<f64>,
    /// Members that skipped the step: a non-finite loss or gradient, or not learning yet
    /// ([`PopAdamW::set_active`]).
    pub skipped: Vec<bool>,
}

/// What one step decided per member (`[N]` each).
struct Decisions {
    /// 1 where the member's loss and gradient are finite (U8).
    ok: Tensor,
    /// Gradient clip factor (F32).
    factor: Tensor,
    /// Step counts after the step (U32).
    steps: Tensor,
    /// `lr / (1 − β₁ᵗ)` and `1 / √(1 − β₂ᵗ)` (F32).
    step_size: Tensor,
    inv_bc2_sqrt: Tensor,
    /// Loss, gradient norm and skip flag (F64 `[3, N]`).
    last: Tensor,
    /// 1 where the member skips for its loss / for its gradient (U32).
    bad_loss: Tensor,
    bad_grad: Tensor,
}

/// AdamW over stacked parameters, one optimiser per member; see the module docs.
pub struct PopAdamW {
    members: usize,
    betas: (f64, f64),
    eps: f64,
    /// Learning rate (F64 `[N]`), decoupled decay factor `1 − lr·wd` (F32 `[N]`), clip norm
    /// (F64 `[N]`), τ (F32 `[N]`; None without targets). Variables, so that
    /// [`Self::set_member`] rewrites them in place and a captured step, which holds their
    /// addresses, reads the new values.
    lr: Var,
    decay: Var,
    max_norm: Var,
    tau: Option<Var>,
    /// `1 − β₁ᵗ` and `1 − β₂ᵗ` for t = 0..len (F64) and their last index as U32 `[N]`.
    bc1: Tensor,
    bc2: Tensor,
    bc1_last: Tensor,
    bc2_last: Tensor,
    exp_avg: Vec<Var>,
    exp_avg_sq: Vec<Var>,
    /// Optimiser steps applied per member (U32 `[N]`).
    steps: Var,
    /// Skips per member for a non-finite loss / gradient (U32 `[N]` each).
    skipped_loss: Var,
    skipped_grad: Var,
    /// The last step's loss, gradient norm and skip flag per member (F64 `[3, N]`).
    last: Var,
    /// 1 where a member learns, 0 where it does not yet (F32 `[N]`; [`Self::set_active`]):
    /// such a member steps nothing and counts no skip, as a solo run before its first update.
    active: Var,
    /// On a CUDA device: the member-batched kernels and their buffers.
    #[cfg(feature = "cuda")]
    fused: Option<Fused>,
}

/// The kernels of the CUDA path and what they pass each other.
#[cfg(feature = "cuda")]
struct Fused {
    kernels: crate::PopAdamKernels,
    /// `[N, cols]` F32 partial sums of squares.
    partials: Tensor,
    /// The decisions: ok, clip factor, step size and `1 / √(1 − β₂ᵗ)` (F32 `[N]` each).
    factors: [Tensor; 4],
}

#[cfg(feature = "cuda")]
impl Fused {
    fn new(
        kernels: crate::PopAdamKernels,
        n: usize,
        cols: usize,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        let z = || Tensor::zeros(n, DType::F32, dev);
        Ok(Self { kernels, partials: Tensor::zeros((n, cols), DType::F32, dev)?, factors: [z()?, z()?, z()?, z()?] })
    }
}

impl std::fmt::Debug for PopAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PopAdamW").field("members", &self.members).field("tensors", &self.exp_avg.len()).finish()
    }
}

/// Checks one member's settings (`targets`: τ is read).
fn check_member(k: usize, m: &PopMember, targets: bool) -> Result<()> {
    let ok = m.lr.is_finite()
        && m.lr > 0.0
        && m.weight_decay.is_finite()
        && m.weight_decay >= 0.0
        && m.max_grad_norm > 0.0
        && (!targets || (m.tau.is_finite() && (0.0..=1.0).contains(&m.tau)));
    if ok {
        return Ok(());
    }
    Err(Error::Config {
        what: "PopAdamW",
        message: format!("member {k}: {m:?} (lr > 0, weight_decay >= 0, max_grad_norm > 0, tau in [0, 1])"),
    })
}

/// The decoupled decay factor `1 − lr·wd` as the solo AdamW rounds it.
fn decay_factor(m: &PopMember) -> f32 {
    (1.0 - m.lr * m.weight_decay) as f32
}

/// Row `src` of the stacked tensor `t` written over row `dst`, in place (device to device).
fn copy_row(t: &Tensor, dst: usize, src: usize) -> candle_core::Result<()> {
    if dst != src {
        t.slice_set(&t.narrow(0, src, 1)?.copy()?, 0, dst)?;
    }
    Ok(())
}

/// Checks that `keep` names members of a population of `n` in strictly increasing order
/// and is not empty (what a population may be cut down to, [`PopAdamW::retain_members`]);
/// the message says what is wrong.
pub fn check_kept_members(keep: &[usize], n: usize) -> std::result::Result<(), String> {
    if keep.is_empty() {
        return Err(format!("keeping no member of {n}: a population needs at least one"));
    }
    if keep.windows(2).any(|w| w[0] >= w[1]) || keep.iter().any(|&k| k >= n) {
        return Err(format!("members to keep {keep:?} must be increasing indices below {n}"));
    }
    Ok(())
}

/// `1 − βᵗ` for t = 0.. until it is exactly 1.0 (f64, `powf` as the solo optimiser).
fn bias_table(beta: f64) -> Result<Vec<f64>> {
    let mut v = Vec::new();
    for t in 0..MAX_TABLE {
        let x = 1.0 - beta.powf(t as f64);
        v.push(x);
        if x == 1.0 {
            return Ok(v);
        }
    }
    Err(Error::Config {
        what: "PopAdamW betas",
        message: format!("beta {beta} is too close to 1 for a population (1 - beta^t < 1 after {MAX_TABLE} steps)"),
    })
}

/// Where `x` is finite (U8): `x − x` is 0 exactly for finite values and NaN otherwise.
/// (Comparisons with tensors made on the device, not host scalars: a captured graph may not
/// upload.)
fn finite(x: &Tensor) -> candle_core::Result<Tensor> {
    x.sub(x)?.eq(&x.zeros_like()?)
}

/// `t` `[N]` reshaped to broadcast over a stacked `[N, ...]` tensor of rank `rank`.
fn per_member(t: &Tensor, rank: usize) -> candle_core::Result<Tensor> {
    let mut shape = vec![t.dim(0)?];
    shape.resize(rank, 1);
    t.reshape(shape)
}

/// `where(mask[N], a, b)` over stacked tensors.
fn select(mask: &Tensor, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    per_member(mask, a.rank())?.broadcast_as(a.shape())?.where_cond(a, b)
}

impl PopAdamW {
    /// An optimiser for the stacked `params` (`[N, ...]` F32 each, N = `members.len()`),
    /// with shared `betas` and `eps`; `targets` says whether [`Self::step`] also moves
    /// target copies.
    pub fn new(params: &[Var], members: &[PopMember], betas: (f64, f64), eps: f64, targets: bool) -> Result<Self> {
        let n = members.len();
        let bad = |message: String| Error::Config { what: "PopAdamW", message };
        if n == 0 || params.is_empty() {
            return Err(bad(format!("{n} members and {} tensors: need at least one of each", params.len())));
        }
        if let Some(p) = params.iter().find(|p| p.dtype() != DType::F32 || p.rank() < 2 || p.dim(0).ok() != Some(n)) {
            return Err(bad(format!("parameters must be stacked F32 [{n}, ...], got {:?} {:?}", p.dtype(), p.dims())));
        }
        for (k, m) in members.iter().enumerate() {
            check_member(k, m, targets)?;
        }
        let dev = params[0].device();
        let (b1, b2) = betas;
        let (bc1, bc2) = (bias_table(b1)?, bias_table(b2)?);
        let f32s = |v: Vec<f32>| Tensor::from_vec(v, n, dev).and_then(|t| Var::from_tensor(&t)).ctx(CTX);
        let f64s = |v: Vec<f64>| Tensor::from_vec(v, n, dev).and_then(|t| Var::from_tensor(&t)).ctx(CTX);
        let zeros_like = |v: &Var| Tensor::zeros(v.shape(), DType::F32, dev).and_then(|t| Var::from_tensor(&t));
        let u32_zeros = || Tensor::zeros(n, DType::U32, dev).and_then(|t| Var::from_tensor(&t)).ctx(CTX);
        #[cfg(feature = "cuda")]
        let fused = if dev.is_cuda() {
            let pers: Vec<usize> = params.iter().map(|v| v.elem_count() / n).collect();
            let cols = crate::PopAdamKernels::partial_cols(&pers);
            let kernels = crate::PopAdamKernels::load(dev)
                .map_err(|e| Error::Cuda { context: "PopAdamW::new", message: e.to_string() })?;
            Some(Fused::new(kernels, n, cols, dev).ctx(CTX)?)
        } else {
            None
        };
        Ok(Self {
            members: n,
            betas,
            eps,
            lr: f64s(members.iter().map(|m| m.lr).collect())?,
            decay: f32s(members.iter().map(decay_factor).collect())?,
            max_norm: f64s(members.iter().map(|m| m.max_grad_norm).collect())?,
            tau: if targets { Some(f32s(members.iter().map(|m| m.tau as f32).collect())?) } else { None },
            bc1_last: Tensor::from_vec(vec![(bc1.len() - 1) as u32; n], n, dev).ctx(CTX)?,
            bc2_last: Tensor::from_vec(vec![(bc2.len() - 1) as u32; n], n, dev).ctx(CTX)?,
            bc1: Tensor::new(bc1, dev).ctx(CTX)?,
            bc2: Tensor::new(bc2, dev).ctx(CTX)?,
            exp_avg: params.iter().map(zeros_like).collect::<candle_core::Result<_>>().ctx(CTX)?,
            exp_avg_sq: params.iter().map(zeros_like).collect::<candle_core::Result<_>>().ctx(CTX)?,
            steps: u32_zeros()?,
            skipped_loss: u32_zeros()?,
            skipped_grad: u32_zeros()?,
            last: Tensor::zeros((3, n), DType::F64, dev).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?,
            active: f32s(vec![1.0; n])?,
            #[cfg(feature = "cuda")]
            fused,
        })
    }

    /// Number of members.
    pub fn members(&self) -> usize {
        self.members
    }

    /// Replaces member `k`'s learning rate, weight decay, clip norm and τ, in place: the
    /// tensors a captured step reads keep their addresses (a PBT explore). Its moments and
    /// step count stay as they are.
    pub fn set_member(&self, k: usize, m: &PopMember) -> Result<()> {
        if k >= self.members {
            return Err(Error::Config {
                what: "PopAdamW::set_member",
                message: format!("no member {k} of {}", self.members),
            });
        }
        check_member(k, m, self.tau.is_some())?;
        let dev = self.lr.device();
        let put = |v: &Var, x: Tensor| v.as_tensor().slice_set(&x, 0, k);
        (|| -> candle_core::Result<()> {
            put(&self.lr, Tensor::new(&[m.lr], dev)?)?;
            put(&self.decay, Tensor::new(&[decay_factor(m)], dev)?)?;
            put(&self.max_norm, Tensor::new(&[m.max_grad_norm], dev)?)?;
            if let Some(tau) = &self.tau {
                put(tau, Tensor::new(&[m.tau as f32], dev)?)?;
            }
            Ok(())
        })()
        .ctx(CTX)
    }

    /// Whether member `k` learns (the default) or not yet, in place (a captured step reads
    /// the flag): a member that does not steps nothing, its moments, step count, skip
    /// counters and target untouched, as a solo run before its first update.
    pub fn set_active(&self, k: usize, active: bool) -> Result<()> {
        if k >= self.members {
            return Err(Error::Config {
                what: "PopAdamW::set_active",
                message: format!("no member {k} of {}", self.members),
            });
        }
        let flag = Tensor::new(&[f32::from(u8::from(active))], self.lr.device()).ctx(CTX)?;
        self.active.as_tensor().slice_set(&flag, 0, k).ctx(CTX)
    }

    /// Member `k` starts over as a new optimiser with the settings `m`, in place: both
    /// moments of every tensor zero, step count and skip counters zero (a new trial in a
    /// freed slot). Whether it learns is [`Self::set_active`]'s.
    pub fn reset_member(&self, k: usize, m: &PopMember) -> Result<()> {
        self.set_member(k, m)?;
        (|| -> candle_core::Result<()> {
            for v in self.exp_avg.iter().chain(&self.exp_avg_sq) {
                let t = v.as_tensor();
                t.slice_set(&t.narrow(0, k, 1)?.zeros_like()?, 0, k)?;
            }
            for v in [&self.steps, &self.skipped_loss, &self.skipped_grad] {
                let t = v.as_tensor();
                t.slice_set(&t.narrow(0, k, 1)?.zeros_like()?, 0, k)?;
            }
            Ok(())
        })()
        .ctx(CTX)
    }

    /// Member `dst` takes member `src`'s optimiser state, in place on the device: both
    /// moments of every tensor and the step count (which the bias corrections follow), as a
    /// PBT exploit copies a better member. Hyperparameters and skip counters stay `dst`'s.
    pub fn copy_member(&self, dst: usize, src: usize) -> Result<()> {
        if dst >= self.members || src >= self.members {
            return Err(Error::Config {
                what: "PopAdamW::copy_member",
                message: format!("members {src} -> {dst} of {}", self.members),
            });
        }
        (|| -> candle_core::Result<()> {
            for v in self.exp_avg.iter().chain(&self.exp_avg_sq) {
                copy_row(v.as_tensor(), dst, src)?;
            }
            copy_row(self.steps.as_tensor(), dst, src)
        })()
        .ctx(CTX)
    }

    /// The optimiser cut down to the members `keep` (strictly increasing), in that order:
    /// their moments, step counts, skip counters, hyperparameters and last report copied
    /// exactly, for the stacked parameters cut down the same way (successive halving). The
    /// state is new tensors: a step captured over the old ones must be captured again.
    pub fn retain_members(&mut self, keep: &[usize]) -> Result<()> {
        check_kept_members(keep, self.members)
            .map_err(|message| Error::Config { what: "PopAdamW::retain_members", message })?;
        let dev = self.lr.device().clone();
        let n = keep.len();
        let idx = Tensor::from_vec(keep.iter().map(|&k| k as u32).collect(), n, &dev).ctx(CTX)?;
        let pick = |t: &Tensor, dim: usize| t.index_select(&idx, dim);
        let var = |t: &Tensor, dim: usize| pick(t, dim).and_then(|t| Var::from_tensor(&t));
        (|| -> candle_core::Result<()> {
            self.lr = var(self.lr.as_tensor(), 0)?;
            self.decay = var(self.decay.as_tensor(), 0)?;
            self.max_norm = var(self.max_norm.as_tensor(), 0)?;
            if let Some(tau) = &self.tau {
                self.tau = Some(var(tau.as_tensor(), 0)?);
            }
            self.bc1_last = pick(&self.bc1_last, 0)?;
            self.bc2_last = pick(&self.bc2_last, 0)?;
            for v in self.exp_avg.iter_mut().chain(self.exp_avg_sq.iter_mut()) {
                *v = var(v.as_tensor(), 0)?;
            }
            self.steps = var(self.steps.as_tensor(), 0)?;
            self.skipped_loss = var(self.skipped_loss.as_tensor(), 0)?;
            self.skipped_grad = var(self.skipped_grad.as_tensor(), 0)?;
            self.last = var(self.last.as_tensor(), 1)?;
            self.active = var(self.active.as_tensor(), 0)?;
            #[cfg(feature = "cuda")]
            if let Some(f) = &mut self.fused {
                *f = Fused::new(f.kernels.clone(), n, f.partials.dim(1)?, &dev)?;
            }
            Ok(())
        })()
        .ctx(CTX)?;
        self.members = n;
        Ok(())
    }

    /// Adds the optimiser's state to `out` under `prefix`: both moments of every tensor
    /// (`exp_avg.{i}`, `exp_avg_sq.{i}`, `[N, ...]` in parameter order), each member's
    /// step count and skip counters (U32 `[N]`). The hyperparameters are not in it: they
    /// come from the members' configs when the optimiser is built again; nor is the last
    /// step's report (a skipped member's loss there may be NaN, which a state file refuses).
    pub fn save_state(&self, out: &mut std::collections::HashMap<String, Tensor>, prefix: &str) {
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            out.insert(format!("{prefix}exp_avg.{i}"), m.as_tensor().clone());
            out.insert(format!("{prefix}exp_avg_sq.{i}"), v.as_tensor().clone());
        }
        out.insert(format!("{prefix}steps"), self.steps.as_tensor().clone());
        out.insert(format!("{prefix}skipped_loss"), self.skipped_loss.as_tensor().clone());
        out.insert(format!("{prefix}skipped_grad"), self.skipped_grad.as_tensor().clone());
    }

    /// Restores [`Self::save_state`]'s tensors from `from` in place (the variables keep
    /// their addresses), taking them out of it; a missing or mis-shaped tensor is an error
    /// naming it, and then nothing has changed.
    pub fn load_state(&self, from: &mut crate::NamedTensors, prefix: &str) -> Result<()> {
        let dev = self.lr.device();
        let mut wanted: Vec<(String, &Var, DType)> = Vec::with_capacity(2 * self.exp_avg.len() + 3);
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            wanted.push((format!("{prefix}exp_avg.{i}"), m, DType::F32));
            wanted.push((format!("{prefix}exp_avg_sq.{i}"), v, DType::F32));
        }
        for (name, var) in
            [("steps", &self.steps), ("skipped_loss", &self.skipped_loss), ("skipped_grad", &self.skipped_grad)]
        {
            wanted.push((format!("{prefix}{name}"), var, DType::U32));
        }
        let mut staged = Vec::with_capacity(wanted.len());
        for (name, var, dtype) in wanted {
            let t = from.take(&name, var.dims())?;
            staged.push((var, t.to_dtype(dtype).and_then(|t| t.to_device(dev)).ctx(CTX)?));
        }
        for (var, t) in staged {
            var.set(&t).ctx(CTX)?;
        }
        Ok(())
    }

    /// Member `k`'s moments `(exp_avg, exp_avg_sq)` in parameter order (copies).
    pub fn moments(&self, k: usize) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let take = |vs: &[Var]| -> Result<Vec<Tensor>> {
            vs.iter().map(|v| v.as_tensor().get(k).and_then(|t| t.copy()).ctx(CTX)).collect()
        };
        Ok((take(&self.exp_avg)?, take(&self.exp_avg_sq)?))
    }

    /// Per member: steps applied and steps skipped (one read).
    pub fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        let t =
            Tensor::stack(&[self.steps.as_tensor(), self.skipped_loss.as_tensor(), self.skipped_grad.as_tensor()], 0)
                .and_then(|t| t.to_vec2::<u32>())
                .ctx(CTX)?;
        let applied = t[0].iter().map(|&x| u64::from(x)).collect();
        let skipped = t[1].iter().zip(&t[2]).map(|(&a, &b)| u64::from(a) + u64::from(b)).collect();
        Ok((applied, skipped))
    }

    /// The last step's loss, gradient norm and skips (one read).
    pub fn last_step(&self) -> Result<PopStepReport> {
        Self::report_of(&self.last.as_tensor().copy().ctx(CTX)?)
    }

    /// A device copy of the last step's loss, gradient norm and skip flag (F64 `[3, N]`),
    /// for callers that gather many steps' outcomes and read them once
    /// ([`Self::report_of`]).
    pub fn last_step_tensor(&self) -> Result<Tensor> {
        self.last.as_tensor().copy().ctx(CTX)
    }

    /// The report of a [`Self::last_step_tensor`] (one read).
    pub fn report_of(last: &Tensor) -> Result<PopStepReport> {
        let t: Vec<Vec<f64>> = last.to_vec2().ctx(CTX)?;
        Ok(PopStepReport {
            loss: t[0].clone(),
            grad_norm: t[1].clone(),
            skipped: t[2].iter().map(|&s| s != 0.0).collect(),
        })
    }

    /// One step of every member: `loss` `[N]` (each member's loss, for the guard and the
    /// report), `grads` the gradients of `params` in their order (`[N, ...]`), `targets`
    /// the target copies (empty without). A `dry` step computes everything and writes
    /// nothing (a CUDA graph's warm-up). Reads nothing back.
    pub fn step(&self, params: &[Var], targets: &[Var], loss: &Tensor, grads: &[Tensor], dry: bool) -> Result<()> {
        let n = self.members;
        let bad = |message: String| Error::Config { what: "PopAdamW::step", message };
        if params.len() != self.exp_avg.len() || grads.len() != params.len() {
            return Err(bad(format!(
                "{} parameters and {} gradients for {} tensors",
                params.len(),
                grads.len(),
                self.exp_avg.len()
            )));
        }
        let has_targets = !targets.is_empty();
        if self.tau.is_some() != has_targets || (has_targets && targets.len() != params.len()) {
            return Err(bad(format!(
                "{} targets for {} parameters (made with targets: {})",
                targets.len(),
                params.len(),
                self.tau.is_some()
            )));
        }
        for (i, p) in params.iter().enumerate() {
            if p.dims() != self.exp_avg[i].dims() || grads[i].dims() != p.dims() {
                return Err(bad(format!(
                    "tensor {i}: parameter {:?}, gradient {:?}, state {:?}",
                    p.dims(),
                    grads[i].dims(),
                    self.exp_avg[i].dims()
                )));
            }
        }
        if loss.elem_count() != n {
            return Err(bad(format!("loss has {} values for {n} members", loss.elem_count())));
        }
        #[cfg(feature = "cuda")]
        if let Some(fused) = &self.fused {
            return self.step_fused(fused, params, targets, loss, grads, dry);
        }
        self.step_candle(params, targets, loss, grads, dry)
    }

    /// Each member's decisions from its loss and squared gradient norm (`[N]` each, in the
    /// accumulation dtype): the guard, the clip factor, the step count and the bias
    /// corrections, as the solo optimiser takes them.
    fn decide(&self, loss_v: &Tensor, sumsq: &Tensor) -> candle_core::Result<Decisions> {
        let active = self.active.as_tensor().ne(&self.active.as_tensor().zeros_like()?)?;
        let ok_loss = finite(loss_v)?;
        let ok_grad = finite(sumsq)?;
        let ok = ok_loss.mul(&ok_grad)?.mul(&active)?;
        let norm = sumsq.sqrt()?.to_dtype(DType::F64)?;
        let coef = self.max_norm.div(&norm.affine(1.0, 1e-6)?)?;
        let one = coef.ones_like()?;
        let factor = coef.lt(&one)?.where_cond(&coef, &one)?.to_dtype(DType::F32)?;
        let steps = self.steps.as_tensor().add(&ok.to_dtype(DType::U32)?)?;
        let i1 = steps.minimum(&self.bc1_last)?;
        let i2 = steps.minimum(&self.bc2_last)?;
        let step_size = self.lr.div(&self.bc1.index_select(&i1, 0)?)?.to_dtype(DType::F32)?;
        let inv_bc2_sqrt = self.bc2.index_select(&i2, 0)?.sqrt()?.recip()?.to_dtype(DType::F32)?;
        let last =
            Tensor::stack(&[loss_v.to_dtype(DType::F64)?, norm, ok.ones_like()?.sub(&ok)?.to_dtype(DType::F64)?], 0)?;
        let bad_loss = active.mul(&ok_loss.ones_like()?.sub(&ok_loss)?)?.to_dtype(DType::U32)?;
        let bad_grad = active.mul(&ok_loss)?.mul(&ok_grad.ones_like()?.sub(&ok_grad)?)?.to_dtype(DType::U32)?;
        Ok(Decisions { ok, factor, steps, step_size, inv_bc2_sqrt, last, bad_loss, bad_grad })
    }

    /// The counters after a step that `d` decided.
    fn record(&self, d: &Decisions) -> candle_core::Result<()> {
        self.steps.set(&d.steps)?;
        self.skipped_loss.set(&self.skipped_loss.as_tensor().add(&d.bad_loss)?)?;
        self.skipped_grad.set(&self.skipped_grad.as_tensor().add(&d.bad_grad)?)?;
        self.last.set(&d.last)
    }

    /// The step with candle's ops (the CPU path: the solo optimiser's arithmetic, batched).
    fn step_candle(&self, params: &[Var], targets: &[Var], loss: &Tensor, g: &[Tensor], dry: bool) -> Result<()> {
        let acc = if params[0].device().is_cpu() { DType::F64 } else { DType::F32 };
        (|| -> candle_core::Result<()> {
            // The solo guard's one reduction, per member: sum(g·0 + g²) is NaN iff some g is
            // non-finite.
            let flat = Tensor::cat(
                &g.iter().map(|g| g.flatten_from(1)?.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>()?,
                1,
            )?
            .to_dtype(acc)?;
            let sumsq = (flat.affine(0.0, 0.0)? + flat.affine(1.0, 0.0)?.sqr()?)?.sum(1)?;
            let d = self.decide(&loss.detach().flatten_all()?.to_dtype(acc)?, &sumsq)?;
            let (b1, b2) = self.betas;
            let mut new_w = Vec::with_capacity(params.len());
            let mut new_m = Vec::with_capacity(params.len());
            let mut new_v = Vec::with_capacity(params.len());
            for (i, var) in params.iter().enumerate() {
                let r = var.rank();
                let gi = g[i].detach().to_dtype(DType::F32)?.broadcast_mul(&per_member(&d.factor, r)?)?;
                let w0 = var.as_tensor().detach();
                let w = w0.broadcast_mul(&per_member(&self.decay, r)?)?;
                let m0 = self.exp_avg[i].as_tensor();
                let v0 = self.exp_avg_sq[i].as_tensor();
                let m = (m0.affine(b1, 0.0)? + gi.affine(1.0 - b1, 0.0)?)?;
                let v = (v0.affine(b2, 0.0)? + gi.sqr()?.affine(1.0 - b2, 0.0)?)?;
                let denom = v.sqrt()?.broadcast_mul(&per_member(&d.inv_bc2_sqrt, r)?)?.affine(1.0, self.eps)?;
                let upd = (&m / &denom)?.broadcast_mul(&per_member(&d.step_size, r)?)?;
                new_w.push(select(&d.ok, &(w - upd)?, &w0)?);
                new_m.push(select(&d.ok, &m, m0)?);
                new_v.push(select(&d.ok, &v, v0)?);
            }
            if dry {
                return Ok(());
            }
            for (i, var) in params.iter().enumerate() {
                var.set(&new_w[i])?;
                self.exp_avg[i].set(&new_m[i])?;
                self.exp_avg_sq[i].set(&new_v[i])?;
                if let (Some(tau), Some(t)) = (&self.tau, targets.get(i)) {
                    let tt = t.as_tensor().detach();
                    let moved = (&tt + new_w[i].sub(&tt)?.broadcast_mul(&per_member(tau, tt.rank())?)?)?;
                    t.set(&select(&d.ok, &moved, &tt)?)?;
                }
            }
            self.record(&d)
        })()
        .ctx(CTX)
    }

    /// The step on a CUDA device: the per-member sums of squares, the decisions (guard,
    /// clip factor, step count, bias corrections, counters) and AdamW with the soft target
    /// update as member-batched kernels over the stacked tensors: a launch per table, one,
    /// then a launch per table. They round as the candle path does on the device; only the
    /// sums of squares add in another order.
    #[cfg(feature = "cuda")]
    fn step_fused(
        &self,
        fused: &Fused,
        params: &[Var],
        targets: &[Var],
        loss: &Tensor,
        g: &[Tensor],
        dry: bool,
    ) -> Result<()> {
        use fx_kernels::cuda::address;
        let n = self.members;
        let launch = |e: fx_kernels::Error| Error::Cuda { context: "PopAdamW::step", message: e.to_string() };
        let addr = |t: &Tensor, what: &'static str| address::<f32>(t, what).map_err(launch);
        let addr64 = |t: &Tensor, what: &'static str| address::<f64>(t, what).map_err(launch);
        let addr32 = |t: &Tensor, what: &'static str| address::<u32>(t, what).map_err(launch);
        let g: Vec<Tensor> =
            g.iter().map(|g| g.to_dtype(DType::F32)?.contiguous()).collect::<candle_core::Result<_>>().ctx(CTX)?;
        let entries: Vec<crate::PopEntry> = params
            .iter()
            .enumerate()
            .map(|(i, v)| {
                Ok(crate::PopEntry {
                    param: addr(v.as_tensor(), "parameter")?,
                    grad: addr(&g[i], "gradient")?,
                    exp_avg: addr(self.exp_avg[i].as_tensor(), "exp_avg")?,
                    exp_avg_sq: addr(self.exp_avg_sq[i].as_tensor(), "exp_avg_sq")?,
                    target: match targets.get(i) {
                        Some(t) => addr(t.as_tensor(), "target")?,
                        None => 0,
                    },
                    per: v.elem_count() / n,
                })
            })
            .collect::<Result<_>>()?;
        let (kernels, partials) = (&fused.kernels, &fused.partials);
        // SAFETY: every address is of a live contiguous F32 tensor of `n × per` elements on
        // this device (the partials `[n, cols]`), all kept alive past the launches.
        unsafe { kernels.sumsq(&entries, n, addr(partials, "partials")?) }.map_err(launch)?;
        let loss = loss.detach().flatten_all().and_then(|l| l.to_dtype(DType::F32)?.contiguous()).ctx(CTX)?;
        let [ok, coef, step_size, inv_bc2_sqrt] = &fused.factors;
        let d = crate::PopDecide {
            partials: addr(partials, "partials")?,
            loss: addr(&loss, "loss")?,
            lr: addr64(self.lr.as_tensor(), "lr")?,
            max_norm: addr64(self.max_norm.as_tensor(), "max_norm")?,
            bc1: addr64(&self.bc1, "bias table")?,
            bc2: addr64(&self.bc2, "bias table")?,
            steps: addr32(self.steps.as_tensor(), "steps")?,
            skipped_loss: addr32(self.skipped_loss.as_tensor(), "skips")?,
            skipped_grad: addr32(self.skipped_grad.as_tensor(), "skips")?,
            last: addr64(self.last.as_tensor(), "last step")?,
            active: addr(self.active.as_tensor(), "active")?,
            ok: addr(ok, "ok")?,
            coef: addr(coef, "clip factor")?,
            step_size: addr(step_size, "step size")?,
            inv_bc2_sqrt: addr(inv_bc2_sqrt, "bias correction")?,
            bc1_last: (self.bc1.elem_count() - 1) as u32,
            bc2_last: (self.bc2.elem_count() - 1) as u32,
            members: n as u32,
            cols: partials.dim(1).ctx(CTX)? as u32,
        };
        // SAFETY: each address is of a live contiguous tensor of the dtype and length its
        // field states (the tables of their own lengths), kept alive past the launch.
        unsafe { kernels.decide(&d, dry) }.map_err(launch)?;
        // Without targets the kernels never read τ; any `[N]` F32 tensor's address serves.
        let tau = self.tau.as_ref().unwrap_or(&self.decay);
        let f = crate::PopFactors {
            ok: d.ok,
            coef: d.coef,
            decay: addr(&self.decay, "decay")?,
            step_size: d.step_size,
            inv_bc2_sqrt: d.inv_bc2_sqrt,
            tau: addr(tau, "tau")?,
        };
        let (b1, b2) = self.betas;
        // SAFETY: as above; the factor arrays are `[n]` F32 tensors alive past the launch.
        unsafe { kernels.adam(&entries, n, &f, (b1, b2, self.eps), dry) }.map_err(launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AdamW, AdamWConfig, GradScaler, TrainStep};
    use candle_core::Device;

    /// Member k of a PopAdamW over stacked tensors is a solo AdamW TrainStep with member k's
    /// learning rate, weight decay and clip norm, bit for bit on the CPU, over 40 steps of
    /// fresh random gradients, a NaN in one member's gradient at one step included (that
    /// member skips that step; the others do not notice).
    #[test]
    fn members_are_solo_adamw_steps_on_cpu() {
        let dev = Device::Cpu;
        let n = 4;
        let shapes: [&[usize]; 2] = [&[3, 5], &[3]];
        let members: Vec<PopMember> = (0..n)
            .map(|k| PopMember {
                lr: 1e-2 * (1.0 + k as f64),
                weight_decay: 0.01 * k as f64,
                max_grad_norm: if k == 2 { 0.05 } else { 10.0 },
                tau: 0.0,
            })
            .collect();
        let seed = fx_hw::test_seed("members_are_solo_adamw_steps_on_cpu");
        let draw = |len: usize, stream: u64, step: u64| -> Vec<f32> {
            (0..len as u64).map(|i| (fx_kernels::rng::draw(seed, stream, step, i) * 2.0 - 1.0) as f32).collect()
        };
        let stacked: Vec<Var> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let per: usize = s.iter().product();
                let t = Tensor::from_vec(draw(n * per, 100 + i as u64, 0), [&[n][..], s].concat(), &dev).unwrap();
                Var::from_tensor(&t).unwrap()
            })
            .collect();
        let opt = PopAdamW::new(&stacked, &members, (0.9, 0.999), 1e-8, false).unwrap();
        let mut solos: Vec<(Vec<Var>, TrainStep<AdamW>)> = (0..n)
            .map(|k| {
                let vars: Vec<Var> = stacked
                    .iter()
                    .map(|v| Var::from_tensor(&v.as_tensor().get(k).unwrap().copy().unwrap()).unwrap())
                    .collect();
                let named: Vec<(String, Var)> =
                    vars.iter().enumerate().map(|(i, v)| (format!("p{i}"), v.clone())).collect();
                let cfg =
                    AdamWConfig { lr: members[k].lr, weight_decay: members[k].weight_decay, ..Default::default() };
                let step = TrainStep::new(
                    AdamW::new(named, cfg).unwrap(),
                    GradScaler::for_precision(crate::Precision::F32),
                    Some(members[k].max_grad_norm),
                )
                .unwrap();
                (vars, step)
            })
            .collect();
        for step in 1..=40u64 {
            // loss_k = Σ g_k · p_k, so member k's gradient is g_k.
            let mut grads: Vec<Vec<f32>> =
                shapes.iter().enumerate().map(|(i, s)| draw(n * s.iter().product::<usize>(), i as u64, step)).collect();
            if step == 9 {
                grads[0][15 + 2] = f32::NAN; // member 1's first tensor
            }
            let g: Vec<Tensor> = grads
                .iter()
                .zip(&shapes)
                .map(|(v, s)| Tensor::from_vec(v.clone(), [&[n][..], s].concat(), &dev).unwrap())
                .collect();
            let loss = Tensor::from_vec(vec![step as f32; n], n, &dev).unwrap();
            opt.step(&stacked, &[], &loss, &g, false).unwrap();
            for (k, (vars, ts)) in solos.iter_mut().enumerate() {
                let terms: Vec<Tensor> = vars
                    .iter()
                    .zip(&g)
                    .map(|(v, g)| (v.as_tensor() * g.get(k).unwrap()).unwrap().sum_all().unwrap())
                    .collect();
                let l = Tensor::stack(&terms, 0).unwrap().sum_all().unwrap();
                ts.step(&l).unwrap();
            }
        }
        let (applied, skipped) = opt.counters().unwrap();
        assert_eq!(applied, vec![40, 39, 40, 40]);
        assert_eq!(skipped, vec![0, 1, 0, 0]);
        for (k, (vars, _)) in solos.iter().enumerate() {
            for (i, v) in vars.iter().enumerate() {
                let a: Vec<f32> = stacked[i].as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let b: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                assert_eq!(a, b, "member {k} tensor {i}");
            }
        }
    }

    /// `set_member` gives the optimiser of a population made with those settings (bit for
    /// bit over 30 steps), and `copy_member` gives the destination the source's moments and
    /// step count exactly, touching no other member.
    #[test]
    fn set_member_and_copy_member_rewrite_one_member_in_place() {
        let dev = Device::Cpu;
        let n = 3;
        let member = |k: usize| PopMember {
            lr: 1e-2 * (1.0 + k as f64),
            weight_decay: 0.02 * k as f64,
            max_grad_norm: 0.5 + k as f64,
            tau: 0.01 * (1.0 + k as f64),
        };
        let want: Vec<PopMember> = (0..n).map(member).collect();
        let mut other = want.clone();
        other[1] = PopMember { lr: 0.3, weight_decay: 0.0, max_grad_norm: 9.0, tau: 0.5 };
        let seed = 17;
        let draw = |len: usize, stream: u64, step: u64| -> Vec<f32> {
            (0..len as u64).map(|i| (fx_kernels::rng::draw(seed, stream, step, i) * 2.0 - 1.0) as f32).collect()
        };
        let vars = || -> Vec<Var> {
            [(4usize, 0u64), (2, 1)]
                .iter()
                .map(|&(per, s)| {
                    Var::from_tensor(&Tensor::from_vec(draw(n * per, s, 0), (n, per), &dev).unwrap()).unwrap()
                })
                .collect()
        };
        let (pa, ta, pb, tb) = (vars(), vars(), vars(), vars());
        let a = PopAdamW::new(&pa, &want, (0.9, 0.999), 1e-8, true).unwrap();
        let b = PopAdamW::new(&pb, &other, (0.9, 0.999), 1e-8, true).unwrap();
        b.set_member(1, &want[1]).unwrap();
        assert!(b.set_member(1, &PopMember { lr: 0.0, ..want[1] }).is_err(), "a refused setting changes nothing");
        assert!(b.set_member(3, &want[0]).is_err());
        for step in 1..=30u64 {
            let mut g: Vec<Vec<f32>> =
                [(4usize, 10u64), (2, 11)].iter().map(|&(per, s)| draw(n * per, s, step)).collect();
            if step == 5 {
                g[0][2 * 4] = f32::NAN; // member 2 skips a step: its count differs from member 0's
            }
            let g: Vec<Tensor> = g
                .into_iter()
                .map(|v| {
                    let per = v.len() / n;
                    Tensor::from_vec(v, (n, per), &dev).unwrap()
                })
                .collect();
            let loss = Tensor::from_vec(vec![1f32; n], n, &dev).unwrap();
            a.step(&pa, &ta, &loss, &g, false).unwrap();
            b.step(&pb, &tb, &loss, &g, false).unwrap();
        }
        let rows = |v: &[Var]| -> Vec<Vec<Vec<f32>>> { v.iter().map(|t| t.as_tensor().to_vec2().unwrap()).collect() };
        assert_eq!(rows(&pa), rows(&pb));
        assert_eq!(rows(&ta), rows(&tb));
        assert_eq!(
            a.moments(1).unwrap().0[0].to_vec1::<f32>().unwrap(),
            b.moments(1).unwrap().0[0].to_vec1::<f32>().unwrap()
        );

        assert_eq!(a.counters().unwrap(), (vec![30, 30, 29], vec![0, 0, 1]));
        let before: Vec<_> = (0..n).map(|k| a.moments(k).unwrap()).collect();
        let flat = |m: &(Vec<Tensor>, Vec<Tensor>)| -> Vec<Vec<f32>> {
            m.0.iter().chain(&m.1).map(|t| t.to_vec1().unwrap()).collect()
        };
        a.copy_member(0, 2).unwrap();
        assert_eq!(flat(&a.moments(0).unwrap()), flat(&before[2]));
        assert_eq!(flat(&a.moments(1).unwrap()), flat(&before[1]));
        assert_eq!(flat(&a.moments(2).unwrap()), flat(&before[2]));
        assert_ne!(flat(&before[0]), flat(&before[2]));
        assert!(a.copy_member(0, 3).is_err());
        assert_eq!(a.counters().unwrap(), (vec![29, 30, 29], vec![0, 0, 1]), "the step count moves, skips stay");
    }

    /// A saved and restored optimiser goes on as the one that never stopped, bit for bit:
    /// moments, step counts (member 1 skipped a step) and skip counters all travel; a
    /// missing tensor is refused by name and changes nothing.
    #[test]
    fn saved_state_resumes_bit_for_bit() {
        let dev = Device::Cpu;
        let n = 3;
        let members: Vec<PopMember> = (0..n)
            .map(|k| PopMember { lr: 1e-2 * (1.0 + k as f64), weight_decay: 0.01, max_grad_norm: 1.0, tau: 0.1 })
            .collect();
        let seed = fx_hw::test_seed("saved_state_resumes_bit_for_bit");
        let draw = |len: usize, stream: u64, step: u64| -> Vec<f32> {
            (0..len as u64).map(|i| (fx_kernels::rng::draw(seed, stream, step, i) * 2.0 - 1.0) as f32).collect()
        };
        let vars = |v: Vec<f32>| Var::from_tensor(&Tensor::from_vec(v, (n, 4), &dev).unwrap()).unwrap();
        let (p, t) = (vec![vars(draw(n * 4, 0, 0))], vec![vars(draw(n * 4, 1, 0))]);
        let a = PopAdamW::new(&p, &members, (0.9, 0.999), 1e-8, true).unwrap();
        let step = |o: &PopAdamW, p: &[Var], t: &[Var], k: u64| {
            let mut g = draw(n * 4, 2, k);
            if k == 3 {
                g[4] = f32::NAN;
            }
            let loss = Tensor::from_vec(vec![1f32; n], n, &dev).unwrap();
            o.step(p, t, &loss, &[Tensor::from_vec(g, (n, 4), &dev).unwrap()], false).unwrap();
        };
        for k in 1..=5 {
            step(&a, &p, &t, k);
        }
        let mut saved = std::collections::HashMap::new();
        a.save_state(&mut saved, "opt.");
        let copy = |v: &[Var]| vec![vars(v[0].as_tensor().flatten_all().unwrap().to_vec1().unwrap())];
        let (pb, tb) = (copy(&p), copy(&t));
        let b = PopAdamW::new(&pb, &members, (0.9, 0.999), 1e-8, true).unwrap();
        let mut partial = crate::NamedTensors::new("test", saved.clone());
        partial.take("opt.steps", &[n]).unwrap();
        assert!(b.load_state(&mut partial, "opt.").unwrap_err().to_string().contains("opt.steps"));
        assert_eq!(b.counters().unwrap(), (vec![0; n], vec![0; n]), "a refused state changes nothing");
        let mut file = crate::NamedTensors::new("test", saved);
        b.load_state(&mut file, "opt.").unwrap();
        file.finish().unwrap();
        assert_eq!(b.counters().unwrap(), (vec![5, 4, 5], vec![0, 1, 0]));
        for k in 6..=9 {
            step(&a, &p, &t, k);
            step(&b, &pb, &tb, k);
        }
        let rows = |v: &[Var]| -> Vec<Vec<f32>> { v[0].as_tensor().to_vec2().unwrap() };
        assert_eq!(rows(&p), rows(&pb));
        assert_eq!(rows(&t), rows(&tb));
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
    }
}
