//! The fused training-step tail (gradient norm, NaN/Inf guard, clipping, loss-scale
//! update, Adam/AdamW, soft target update) on host slices: the reference the CUDA kernels
//! of `kernels/train/optim.cu` are tested against, and the definition of what they compute.
//!
//! It follows `fx_precision::TrainStep` + `AdamW`/`Adam` (PyTorch semantics) rounding for
//! rounding: `fx-precision`'s tests check this reference against that eager step, the
//! device tests check the kernels against this reference.

/// Indices into the control block (`f64 × CTRL_LEN`) that the fused step keeps on the
/// device: the learning rate is written by the host, everything else by the step.
pub mod ctrl {
    /// Learning rate (host-written; read by every step, so schedules work in a graph).
    pub const LR: usize = 0;
    /// Adam step count t (applied steps).
    pub const STEP: usize = 1;
    /// Loss scale (1 without scaling).
    pub const SCALE: usize = 2;
    /// Clean steps since the scale last changed.
    pub const GROWTH: usize = 3;
    /// Steps that reached the optimiser.
    pub const APPLIED: usize = 4;
    /// Steps skipped for a non-finite loss.
    pub const SKIP_LOSS: usize = 5;
    /// Steps skipped for a non-finite gradient.
    pub const SKIP_GRAD: usize = 6;
    /// The last step's unscaled loss.
    pub const LAST_LOSS: usize = 7;
    /// The last step's gradient norm (unscaled, before clipping).
    pub const LAST_NORM: usize = 8;
    /// 1 when the last step was skipped.
    pub const LAST_SKIPPED: usize = 9;
    /// Factor the gradients are multiplied by (1/scale × clip), 0 when skipped.
    pub const COEF: usize = 10;
    /// lr / (1 − β1^t).
    pub const STEP_SIZE: usize = 11;
    /// 1 / sqrt(1 − β2^t).
    pub const INV_BC2_SQRT: usize = 12;
    /// Sum of the applied steps' losses since the host last reset it.
    pub const LOSS_SUM: usize = 13;
    /// Number of losses in `LOSS_SUM`.
    pub const LOSS_COUNT: usize = 14;
    /// Steps whose gradients were clipped.
    pub const CLIPPED: usize = 15;
    /// 1 − lr·wd (AdamW's decoupled decay factor).
    pub const DECAY: usize = 16;
    /// Sum of the applied steps' gradient norms (before clipping) since the host last reset it.
    pub const NORM_SUM: usize = 17;
    /// Last values of the extra scalars (diagnostics), up to [`super::MAX_EXTRA`].
    pub const EXTRA_LAST: usize = 24;
    /// Sums of the applied steps' extra scalars since the host last reset them.
    pub const EXTRA_SUM: usize = 32;
    /// Length of the control block.
    pub const LEN: usize = 40;
}

/// Most extra scalars one step can record.
pub const MAX_EXTRA: usize = 8;

/// Adam/AdamW hyper-parameters of the fused step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConsts {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW's decoupled decay (true) or Adam's L2 term in the gradient (false).
    pub decoupled: bool,
    /// Soft target update rate (used only for tensors that have a target).
    pub tau: f64,
}

/// GradScaler constants (PyTorch's `torch.amp.GradScaler`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerConsts {
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

/// Guard, clipping and scaling constants of the fused step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardConsts {
    /// Clip the global norm to this (None: no clipping).
    pub max_norm: Option<f64>,
    /// Loss scaling (None: scale stays 1).
    pub scaler: Option<ScalerConsts>,
}

/// One tensor of the reference step: parameter, its gradient (of the scaled loss), moments
/// and optional target parameter.
pub struct RefTensor<'a> {
    pub param: &'a mut [f32],
    pub grad: &'a [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub target: Option<&'a mut [f32]>,
}

/// The whole fused step on the host: what `fx_mt_sumsq` → `fx_step_finalize` →
/// `fx_mt_adam` do on the device. `loss` is the unscaled loss, `extras` the diagnostics.
pub fn fused_step_reference(
    tensors: &mut [RefTensor<'_>],
    loss: f32,
    extras: &[f32],
    ctrl_block: &mut [f64; ctrl::LEN],
    adam: &AdamConsts,
    guard: &GuardConsts,
) {
    use ctrl::*;
    let c = ctrl_block;
    let scale = c[SCALE];
    let inv = (1.0 / scale) as f32 as f64;
    // The device sums f32 squares per chunk then in f64; the difference is rounding only.
    let raw: f64 = tensors.iter().flat_map(|t| t.grad.iter()).map(|&g| (g as f64) * (g as f64)).sum();
    let sumsq = raw * inv * inv;
    let norm = sumsq.sqrt();
    let l = loss as f64;
    let skip = if !l.is_finite() {
        1
    } else if !sumsq.is_finite() {
        2
    } else {
        0
    };
    c[LAST_LOSS] = l;
    c[LAST_NORM] = norm;
    c[LAST_SKIPPED] = if skip > 0 { 1.0 } else { 0.0 };
    let mut new_scale = scale;
    if skip > 0 {
        c[if skip == 1 { SKIP_LOSS } else { SKIP_GRAD }] += 1.0;
        c[COEF] = 0.0;
        if let Some(s) = guard.scaler {
            new_scale *= s.backoff_factor;
            c[GROWTH] = 0.0;
        }
    } else {
        let mut coef = inv;
        if let Some(max) = guard.max_norm {
            let clip = max / (norm + 1e-6);
            if clip < 1.0 {
                coef *= clip;
                c[CLIPPED] += 1.0;
            }
        }
        let t = c[STEP] + 1.0;
        let lr = c[LR];
        c[STEP] = t;
        c[APPLIED] += 1.0;
        c[COEF] = coef;
        c[STEP_SIZE] = lr / (1.0 - adam.beta1.powf(t));
        c[INV_BC2_SQRT] = 1.0 / (1.0 - adam.beta2.powf(t)).sqrt();
        c[DECAY] = 1.0 - lr * adam.weight_decay;
        c[LOSS_SUM] += l;
        c[LOSS_COUNT] += 1.0;
        c[NORM_SUM] += norm;
        if let Some(s) = guard.scaler {
            let mut g = c[GROWTH] + 1.0;
            if g >= s.growth_interval as f64 {
                new_scale *= s.growth_factor;
                g = 0.0;
            }
            c[GROWTH] = g;
        }
    }
    c[SCALE] = new_scale;
    for (k, &v) in extras.iter().take(MAX_EXTRA).enumerate() {
        c[EXTRA_LAST + k] = v as f64;
        if skip == 0 {
            c[EXTRA_SUM + k] += v as f64;
        }
    }
    if skip > 0 {
        return;
    }
    let (coef, step_size, inv_bc2, decay) =
        (c[COEF] as f32, c[STEP_SIZE] as f32, c[INV_BC2_SQRT] as f32, c[DECAY] as f32);
    let (b1, b2) = (adam.beta1 as f32, adam.beta2 as f32);
    let (omb1, omb2) = ((1.0 - adam.beta1) as f32, (1.0 - adam.beta2) as f32);
    let (eps, wd, tau) = (adam.eps as f32, adam.weight_decay as f32, adam.tau as f32);
    for t in tensors.iter_mut() {
        for j in 0..t.param.len() {
            let mut g = t.grad[j] * coef;
            let mut p = t.param[j];
            if wd != 0.0 {
                if adam.decoupled {
                    p *= decay;
                } else {
                    g += p * wd;
                }
            }
            let m = t.exp_avg[j] * b1 + g * omb1;
            let v = t.exp_avg_sq[j] * b2 + (g * g) * omb2;
            let denom = v.sqrt().mul_add(inv_bc2, eps);
            p -= (m / denom) * step_size;
            t.param[j] = p;
            t.exp_avg[j] = m;
            t.exp_avg_sq[j] = v;
            if let Some(tg) = t.target.as_deref_mut() {
                tg[j] += (p - tg[j]) * tau;
            }
        }
    }
}

/// A fresh control block: learning rate `lr`, loss scale `scale`, everything else 0.
pub fn new_ctrl(lr: f64, scale: f64) -> [f64; ctrl::LEN] {
    let mut c = [0.0; ctrl::LEN];
    c[ctrl::LR] = lr;
    c[ctrl::SCALE] = scale;
    c
}

/// One stacked tensor of a population step: `[members, per]` row-major, member k's slice
/// at `k·per`.
pub struct PopRefTensor<'a> {
    pub param: &'a mut [f32],
    pub grad: &'a [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub target: Option<&'a mut [f32]>,
}

/// Per-member factors of a population step (`[members]` each; see `fx_pop_adam`).
pub struct PopRefFactors<'a> {
    pub ok: &'a [f32],
    pub coef: &'a [f32],
    pub decay: &'a [f32],
    pub step_size: &'a [f32],
    pub inv_bc2_sqrt: &'a [f32],
    pub tau: &'a [f32],
}

/// Each member's squared gradient norm over `grads` (stacked `[members, per]` each), in
/// f64: what the rows of `fx_pop_sumsq`'s partials sum to, up to F32 rounding.
pub fn pop_sumsq_reference(grads: &[&[f32]], members: usize) -> Vec<f64> {
    let mut out = vec![0.0f64; members];
    for g in grads {
        let per = g.len() / members;
        for (k, o) in out.iter_mut().enumerate() {
            *o += g[k * per..(k + 1) * per].iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
        }
    }
    out
}

/// One member's inputs to `fx_pop_decide`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PopRefMember {
    pub loss: f32,
    pub lr: f64,
    pub max_norm: f64,
    /// Steps applied, skips for a non-finite loss / gradient: read and, unless dry, written.
    pub steps: u32,
    pub skipped_loss: u32,
    pub skipped_grad: u32,
    /// False while the member is not learning yet: it steps nothing and counts no skip.
    pub active: bool,
}

/// One member's outputs of `fx_pop_decide`: its `PopFactors` entries and its last report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PopRefDecision {
    pub ok: f32,
    pub coef: f32,
    pub step_size: f32,
    pub inv_bc2_sqrt: f32,
    /// Loss, gradient norm before clipping, 1 where skipped.
    pub last: [f64; 3],
}

/// `fx_pop_decide` for one member on the host, rounding as the kernel does: its row of
/// partials summed in F32 in order, the guard, clip factor, step count and bias
/// corrections (`bc1`, `bc2`: the tables `1 − βᵗ`). Unless `dry`, `m`'s counters advance.
pub fn pop_decide_reference(
    partials: &[f32],
    m: &mut PopRefMember,
    bc1: &[f64],
    bc2: &[f64],
    dry: bool,
) -> PopRefDecision {
    let sumsq = partials.iter().fold(0.0f32, |a, &x| a + x);
    // The kernel's x - x == 0 is exactly is_finite.
    let (ok_loss, ok_grad) = (m.loss.is_finite(), sumsq.is_finite());
    let ok = m.active && ok_loss && ok_grad;
    let norm = f64::from(sumsq.sqrt());
    let q = m.max_norm / (norm + 1e-6);
    let coef = if q < 1.0 { q as f32 } else { 1.0 };
    let t = m.steps + u32::from(ok);
    let i1 = (t as usize).min(bc1.len() - 1);
    let i2 = (t as usize).min(bc2.len() - 1);
    let d = PopRefDecision {
        ok: if ok { 1.0 } else { 0.0 },
        coef,
        step_size: (m.lr / bc1[i1]) as f32,
        inv_bc2_sqrt: (1.0 / bc2[i2].sqrt()) as f32,
        last: [f64::from(m.loss), norm, if ok { 0.0 } else { 1.0 }],
    };
    if !dry {
        m.steps = t;
        m.skipped_loss += u32::from(m.active && !ok_loss);
        m.skipped_grad += u32::from(m.active && ok_loss && !ok_grad);
    }
    d
}

/// `fx_pop_adam` on the host, rounding as the kernel does (F32, no contraction): member k
/// with `ok[k] == 0` is left as it is.
pub fn pop_adam_reference(
    tensors: &mut [PopRefTensor<'_>],
    members: usize,
    f: &PopRefFactors<'_>,
    betas_eps: (f64, f64, f64),
) {
    let (beta1, beta2, eps) = betas_eps;
    let (b1, b2, e) = (beta1 as f32, beta2 as f32, eps as f32);
    let (omb1, omb2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
    for t in tensors.iter_mut() {
        let per = t.param.len() / members;
        for k in (0..members).filter(|&k| f.ok[k] != 0.0) {
            for j in k * per..(k + 1) * per {
                let g = t.grad[j] * f.coef[k];
                let mut p = t.param[j] * f.decay[k];
                let m = t.exp_avg[j] * b1 + g * omb1;
                let v = t.exp_avg_sq[j] * b2 + (g * g) * omb2;
                let denom = v.sqrt() * f.inv_bc2_sqrt[k] + e;
                p -= (m / denom) * f.step_size[k];
                t.param[j] = p;
                t.exp_avg[j] = m;
                t.exp_avg_sq[j] = v;
                if let Some(tg) = t.target.as_deref_mut() {
                    tg[j] += (p - tg[j]) * f.tau[k];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decisions of one member: the clip, the guard on a NaN loss and on an infinite
    /// norm, the step count and the bias corrections at and past the tables' ends.
    #[test]
    fn pop_decide_reference_clips_guards_and_counts() {
        let bc1: Vec<f64> = (0..4).map(|t| 1.0 - 0.9f64.powi(t)).collect();
        let bc2: Vec<f64> = (0..3).map(|t| 1.0 - 0.999f64.powi(t)).collect();
        let member = |loss: f32| PopRefMember {
            loss,
            lr: 0.01,
            max_norm: 1.0,
            steps: 0,
            skipped_loss: 0,
            skipped_grad: 0,
            active: true,
        };
        // Norm 2 against a clip of 1: factor 1 / (2 + 1e-6); first step's bias corrections.
        let mut m = member(0.5);
        let d = pop_decide_reference(&[3.0, 1.0], &mut m, &bc1, &bc2, false);
        assert_eq!((d.ok, d.coef), (1.0, (1.0 / (2.0 + 1e-6)) as f32));
        assert_eq!((d.step_size, d.inv_bc2_sqrt), ((0.01 / 0.1f64) as f32, (1.0 / 0.001f64.sqrt()) as f32));
        assert_eq!((m.steps, d.last), (1, [0.5, 2.0, 0.0]));
        // A small norm is not clipped; a dry decision leaves the counters.
        let d = pop_decide_reference(&[0.01], &mut m, &bc1, &bc2, true);
        assert_eq!((d.coef, m.steps), (1.0, 1));
        // Past the tables' ends the last entries serve.
        m.steps = 10;
        let d = pop_decide_reference(&[0.01], &mut m, &bc1, &bc2, false);
        assert_eq!((d.step_size, d.inv_bc2_sqrt, m.steps), ((0.01 / bc1[3]) as f32, (1.0 / bc2[2].sqrt()) as f32, 11));
        // A NaN loss skips and counts as a loss skip; an infinite norm as a gradient skip (its
        // factor max_norm / ∞ = 0), a NaN norm too (its factor 1: NaN < 1 is false).
        let mut m = member(f32::NAN);
        let d = pop_decide_reference(&[1.0], &mut m, &bc1, &bc2, false);
        assert_eq!((d.ok, m.steps, m.skipped_loss, m.skipped_grad, d.last[2]), (0.0, 0, 1, 0, 1.0));
        let mut m = member(0.1);
        let d = pop_decide_reference(&[f32::INFINITY, 1.0], &mut m, &bc1, &bc2, false);
        assert_eq!((d.ok, d.coef, m.steps, m.skipped_loss, m.skipped_grad), (0.0, 0.0, 0, 0, 1));
        let d = pop_decide_reference(&[f32::NAN], &mut m, &bc1, &bc2, false);
        assert_eq!((d.ok, d.coef, m.steps, m.skipped_grad), (0.0, 1.0, 0, 2));
        assert!(d.last[1].is_nan());
        // A member not learning yet steps nothing and counts no skip, finite or not.
        for loss in [0.5, f32::NAN] {
            let mut m = PopRefMember { active: false, ..member(loss) };
            let d = pop_decide_reference(&[1.0], &mut m, &bc1, &bc2, false);
            assert_eq!((d.ok, m.steps, m.skipped_loss, m.skipped_grad, d.last[2]), (0.0, 0, 0, 0, 1.0));
        }
    }

    /// Adam's first step moves every weight by about lr against its gradient's sign, and
    /// a NaN loss or gradient changes nothing but the counters.
    #[test]
    fn first_step_and_skips() {
        let adam = AdamConsts { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: true, tau: 0.5 };
        let guard = GuardConsts { max_norm: None, scaler: None };
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = vec![0.3f32, -0.1, 2.0];
        let (mut m, mut v, mut tg) = (vec![0.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        let mut c = new_ctrl(0.01, 1.0);
        let before = p.clone();
        {
            let mut ts =
                [RefTensor { param: &mut p, grad: &g, exp_avg: &mut m, exp_avg_sq: &mut v, target: Some(&mut tg) }];
            fused_step_reference(&mut ts, 1.5, &[2.0], &mut c, &adam, &guard);
        }
        for j in 0..3 {
            let moved = before[j] - p[j];
            assert!((moved - 0.01 * g[j].signum()).abs() < 1e-6, "{moved}");
            assert!((tg[j] - 0.5 * p[j]).abs() < 1e-6);
        }
        assert_eq!((c[ctrl::STEP], c[ctrl::APPLIED], c[ctrl::LOSS_SUM], c[ctrl::EXTRA_SUM]), (1.0, 1.0, 1.5, 2.0));
        let snapshot = (p.clone(), m.clone(), v.clone());
        for (loss, grad) in [(f32::NAN, g.clone()), (1.0, vec![f32::INFINITY, 0.0, 0.0])] {
            let mut ts = [RefTensor { param: &mut p, grad: &grad, exp_avg: &mut m, exp_avg_sq: &mut v, target: None }];
            fused_step_reference(&mut ts, loss, &[], &mut c, &adam, &guard);
        }
        assert_eq!(snapshot, (p, m, v));
        assert_eq!((c[ctrl::SKIP_LOSS], c[ctrl::SKIP_GRAD], c[ctrl::STEP]), (1.0, 1.0, 1.0));
    }
}
