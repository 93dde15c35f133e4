//! AdamW and Adam with PyTorch semantics and F32 moments.
//!
//! `candle_nn::AdamW` keeps its moments in the weights' dtype and reads a missing gradient
//! as a step. These follow `torch.optim.AdamW` / `torch.optim.Adam` (single tensor,
//! non-AMSGrad path) exactly:
//!
//! ```text
//! t += 1                                  (per parameter, only when it has a gradient)
//! AdamW: p -= lr * wd * p                 (decoupled decay, before the Adam update)
//! Adam:  g += wd * p                      (L2 penalty folded into the gradient)
//! m = b1 m + (1 - b1) g
//! v = b2 v + (1 - b2) g^2
//! p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! Moments are F32 whatever the parameters' dtype; the update is computed in F32 and
//! cast to the parameter's dtype. A step that is skipped (e.g. by the GradScaler) is
//! simply not a call to [`Optimizer::step`]: no moment moves and no count advances.

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::error::{Context, Error, Result};
use crate::tensor_file::NamedTensors;

/// What every fx optimiser offers to the training-step helpers.
pub trait Optimizer {
    /// One update from `grads`. Parameters without a gradient in `grads` are left alone
    /// and their step count does not advance (as in PyTorch).
    fn step(&mut self, grads: &GradStore) -> Result<()>;
    /// Number of calls to [`Optimizer::step`] that updated at least one parameter.
    fn step_count(&self) -> u64;
    /// The current learning rate.
    fn learning_rate(&self) -> f64;
    /// Changes the learning rate (schedules).
    fn set_learning_rate(&mut self, lr: f64);
    /// The optimised parameters, in the optimiser's (name-sorted or given) order.
    fn vars(&self) -> Vec<Var>;
    /// Writes the optimiser state into `out` under `prefix`: for parameter `name`,
    /// `{prefix}{name}.exp_avg`, `{prefix}{name}.exp_avg_sq` (F32) and `{prefix}{name}.step`
    /// (I64 scalar).
    fn save_state(&self, out: &mut HashMap<String, Tensor>, prefix: &str) -> Result<()>;
    /// Restores the state written by [`Optimizer::save_state`], taking its tensors out of
    /// `from` (so that leftovers can be reported as unknown by [`NamedTensors::finish`]).
    fn load_state(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()>;
}

/// Hyper-parameters of [`AdamW`]; defaults are `torch.optim.AdamW`'s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

/// Hyper-parameters of [`Adam`]; defaults are `torch.optim.Adam`'s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f64,
    /// L2 penalty added to the gradient (PyTorch's coupled `weight_decay`).
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

struct Param {
    name: String,
    var: Var,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

/// The shared Adam machinery; `decoupled` selects AdamW's weight decay.
struct AdamCore {
    params: Vec<Param>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    steps: u64,
    what: &'static str,
}

impl AdamCore {
    #[allow(clippy::too_many_arguments)]
    fn new(
        what: &'static str,
        params: Vec<(String, Var)>,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
    ) -> Result<Self> {
        let bad = |message: String| Error::Config { what, message };
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(bad(format!("learning rate {lr} must be finite and >= 0")));
        }
        for (n, b) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(bad(format!("{n} = {b} must lie in [0, 1)")));
            }
        }
        if !(eps.is_finite() && eps >= 0.0 && weight_decay.is_finite() && weight_decay >= 0.0) {
            return Err(bad(format!("eps {eps} and weight_decay {weight_decay} must be finite and >= 0")));
        }
        let mut seen = HashSet::new();
        let mut out = Vec::with_capacity(params.len());
        for (name, var) in params {
            if !seen.insert(name.clone()) {
                return Err(bad(format!("parameter name {name:?} appears twice")));
            }
            if !var.dtype().is_float() {
                return Err(bad(format!("parameter {name:?} has non-float dtype {:?}", var.dtype())));
            }
            let zeros = Tensor::zeros(var.shape(), DType::F32, var.device()).ctx(what)?;
            out.push(Param { name, var, exp_avg: zeros.clone(), exp_avg_sq: zeros, step: 0 });
        }
        Ok(AdamCore { params: out, lr, beta1, beta2, eps, weight_decay, decoupled, steps: 0, what })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let ctx = self.what;
        let mut any = false;
        for p in &mut self.params {
            let Some(g) = grads.get(p.var.as_tensor()) else {
                continue;
            };
            any = true;
            let t = p.step + 1;
            let g = g.detach().to_dtype(DType::F32).ctx(ctx)?;
            let mut w = p.var.as_tensor().detach().to_dtype(DType::F32).ctx(ctx)?;
            let g = if !self.decoupled && self.weight_decay != 0.0 {
                (&g + w.affine(self.weight_decay, 0.0).ctx(ctx)?).ctx(ctx)?
            } else {
                g
            };
            if self.decoupled && self.weight_decay != 0.0 {
                w = w.affine(1.0 - self.lr * self.weight_decay, 0.0).ctx(ctx)?;
            }
            let m =
                (p.exp_avg.affine(self.beta1, 0.0).ctx(ctx)? + g.affine(1.0 - self.beta1, 0.0).ctx(ctx)?).ctx(ctx)?;
            let v = (p.exp_avg_sq.affine(self.beta2, 0.0).ctx(ctx)?
                + g.sqr().ctx(ctx)?.affine(1.0 - self.beta2, 0.0).ctx(ctx)?)
            .ctx(ctx)?;
            let bc1 = 1.0 - self.beta1.powf(t as f64);
            let bc2 = 1.0 - self.beta2.powf(t as f64);
            let denom = v.sqrt().ctx(ctx)?.affine(1.0 / bc2.sqrt(), self.eps).ctx(ctx)?;
            let upd = (&m / &denom).ctx(ctx)?.affine(self.lr / bc1, 0.0).ctx(ctx)?;
            let w = (w - upd).ctx(ctx)?;
            p.var.set(&w.to_dtype(p.var.dtype()).ctx(ctx)?).ctx(ctx)?;
            p.exp_avg = m;
            p.exp_avg_sq = v;
            p.step = t;
        }
        if any {
            self.steps += 1;
        }
        Ok(())
    }

    fn save_state(&self, out: &mut HashMap<String, Tensor>, prefix: &str) -> Result<()> {
        for p in &self.params {
            out.insert(format!("{prefix}{}.exp_avg", p.name), p.exp_avg.clone());
            out.insert(format!("{prefix}{}.exp_avg_sq", p.name), p.exp_avg_sq.clone());
            let step = Tensor::new(p.step as i64, p.var.device()).ctx(self.what)?;
            out.insert(format!("{prefix}{}.step", p.name), step);
        }
        Ok(())
    }

    fn load_state(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()> {
        // Take everything first so that a failure leaves the optimiser untouched.
        let mut staged = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let dims = p.var.dims().to_vec();
            let m = from.take(&format!("{prefix}{}.exp_avg", p.name), &dims)?;
            let v = from.take(&format!("{prefix}{}.exp_avg_sq", p.name), &dims)?;
            let s = from.take(&format!("{prefix}{}.step", p.name), &[])?;
            let s = s.to_dtype(DType::I64).and_then(|s| s.to_scalar::<i64>()).ctx(self.what)?;
            let dev = p.var.device();
            let m = m.to_dtype(DType::F32).and_then(|t| t.to_device(dev)).ctx(self.what)?;
            let v = v.to_dtype(DType::F32).and_then(|t| t.to_device(dev)).ctx(self.what)?;
            staged.push((m, v, s.max(0) as u64));
        }
        for (p, (m, v, s)) in self.params.iter_mut().zip(staged) {
            p.exp_avg = m;
            p.exp_avg_sq = v;
            p.step = s;
        }
        self.steps = self.params.iter().map(|p| p.step).max().unwrap_or(0);
        Ok(())
    }
}

/// Sorted `(name, var)` pairs of a `VarMap`, so that the order (and thus everything
/// derived from it) does not depend on `HashMap` iteration.
pub(crate) fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

macro_rules! adam_variant {
    ($(#[$doc:meta])* $name:ident, $cfg:ident, $decoupled:expr) => {
        $(#[$doc])*
        pub struct $name {
            core: AdamCore,
            config: $cfg,
        }

        impl $name {
            /// An optimiser over named parameters (names key the saved state).
            pub fn new(params: impl IntoIterator<Item = (String, Var)>, config: $cfg) -> Result<Self> {
                let core = AdamCore::new(
                    stringify!($name),
                    params.into_iter().collect(),
                    config.lr,
                    config.beta1,
                    config.beta2,
                    config.eps,
                    config.weight_decay,
                    $decoupled,
                )?;
                Ok($name { core, config })
            }

            /// An optimiser over every variable of `varmap`, named as in the map.
            pub fn from_varmap(varmap: &VarMap, config: $cfg) -> Result<Self> {
                Self::new(sorted_vars(varmap), config)
            }

            /// The configuration (with the current learning rate).
            pub fn config(&self) -> $cfg {
                $cfg { lr: self.core.lr, ..self.config }
            }
        }

        impl Optimizer for $name {
            fn step(&mut self, grads: &GradStore) -> Result<()> {
                self.core.step(grads)
            }
            fn step_count(&self) -> u64 {
                self.core.steps
            }
            fn learning_rate(&self) -> f64 {
                self.core.lr
            }
            fn set_learning_rate(&mut self, lr: f64) {
                self.core.lr = lr;
            }
            fn vars(&self) -> Vec<Var> {
                self.core.params.iter().map(|p| p.var.clone()).collect()
            }
            fn save_state(&self, out: &mut HashMap<String, Tensor>, prefix: &str) -> Result<()> {
                self.core.save_state(out, prefix)
            }
            fn load_state(&mut self, from: &mut NamedTensors, prefix: &str) -> Result<()> {
                self.core.load_state(from, prefix)
            }
        }
    };
}

adam_variant!(
    /// `torch.optim.AdamW` with F32 moments (decoupled weight decay on every parameter).
    AdamW,
    AdamWConfig,
    true
);
adam_variant!(
    /// `torch.optim.Adam` with F32 moments (`weight_decay` is an L2 term in the gradient).
    Adam,
    AdamConfig,
    false
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::Rng;
    use candle_core::Device;
    use proptest::prelude::*;

    /// PyTorch's update in f64 for one parameter, written straight from the docs.
    #[allow(clippy::too_many_arguments)]
    fn torch_adam_f64(
        p: &mut [f64],
        m: &mut [f64],
        v: &mut [f64],
        g: &[f64],
        t: u64,
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
        decoupled: bool,
    ) {
        for i in 0..p.len() {
            let mut gi = g[i];
            if decoupled {
                p[i] *= 1.0 - lr * wd;
            } else {
                gi += wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let bc1 = 1.0 - b1.powi(t as i32);
            let bc2 = 1.0 - b2.powi(t as i32);
            let denom = v[i].sqrt() / bc2.sqrt() + eps;
            p[i] -= lr / bc1 * m[i] / denom;
        }
    }

    fn tensor(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Runs `steps` steps on two parameters (the second one sometimes without a
    /// gradient) and compares with the f64 reference after each step.
    fn run_against_reference(seed: u64, decoupled: bool, wd: f64, weight_dtype: DType) {
        let mut rng = Rng::new(seed);
        let shapes = [vec![3, 4], vec![5]];
        let init: Vec<Vec<f64>> = shapes.iter().map(|s| rng.vec(s.iter().product(), -1.0, 1.0)).collect();
        let vars: Vec<Var> = init
            .iter()
            .zip(&shapes)
            .map(|(v, s)| Var::from_tensor(&tensor(v, s).to_dtype(weight_dtype).unwrap()).unwrap())
            .collect();
        // The reference starts from the same (possibly bf16-rounded) weights.
        let mut p: Vec<Vec<f64>> = vars.iter().map(|v| flat(v.as_tensor())).collect();
        let mut m: Vec<Vec<f64>> = p.iter().map(|x| vec![0.0; x.len()]).collect();
        let mut v = m.clone();
        let mut t = [0u64; 2];
        let (lr, b1, b2, eps) = (rng.uniform(1e-3, 5e-2), 0.9, 0.999, 1e-8);
        let named = vec![("a".to_string(), vars[0].clone()), ("b".to_string(), vars[1].clone())];
        let mut opt: Box<dyn Optimizer> = if decoupled {
            Box::new(AdamW::new(named, AdamWConfig { lr, beta1: b1, beta2: b2, eps, weight_decay: wd }).unwrap())
        } else {
            Box::new(Adam::new(named, AdamConfig { lr, beta1: b1, beta2: b2, eps, weight_decay: wd }).unwrap())
        };
        for step in 0..6 {
            let mut grads = GradStore::default();
            for (k, var) in vars.iter().enumerate() {
                if k == 1 && step % 3 == 1 {
                    continue; // no gradient: PyTorch leaves this parameter alone
                }
                // Gradients spanning magnitudes, so that eps and bias correction matter.
                let scale = 10f64.powf(rng.uniform(-4.0, 1.0));
                let g = rng.vec(p[k].len(), -scale, scale);
                grads.insert(var.as_tensor(), tensor(&g, &shapes[k]).to_dtype(weight_dtype).unwrap());
                let g: Vec<f64> = flat(grads.get(var.as_tensor()).unwrap());
                t[k] += 1;
                torch_adam_f64(&mut p[k], &mut m[k], &mut v[k], &g, t[k], lr, b1, b2, eps, wd, decoupled);
            }
            opt.step(&grads).unwrap();
            for (k, var) in vars.iter().enumerate() {
                let got = flat(var.as_tensor());
                let tol = if weight_dtype == DType::F32 { 2e-6 } else { 1e-2 };
                for (a, b) in got.iter().zip(&p[k]) {
                    assert!((a - b).abs() <= tol * (1.0 + b.abs()), "step {step} param {k}: {a} vs {b}");
                }
                if weight_dtype != DType::F32 {
                    // bf16 weights drift from the f64 path by rounding; re-sync them.
                    p[k] = got;
                }
            }
        }
        assert_eq!(opt.step_count(), 6);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

        #[test]
        fn adamw_matches_torch_formula(seed in any::<u64>(), wd in 0.0f64..0.5) {
            run_against_reference(seed, true, wd, DType::F32);
        }

        #[test]
        fn adam_matches_torch_formula(seed in any::<u64>(), wd in 0.0f64..0.5) {
            run_against_reference(seed, false, wd, DType::F32);
        }
    }

    #[test]
    fn moments_stay_f32_for_bf16_weights() {
        run_against_reference(3, true, 0.01, DType::BF16);
        let var = Var::zeros(4, DType::BF16, &Device::Cpu).unwrap();
        let opt = AdamW::new([("w".to_string(), var)], AdamWConfig::default()).unwrap();
        let mut st = HashMap::new();
        opt.save_state(&mut st, "").unwrap();
        assert_eq!(st["w.exp_avg"].dtype(), DType::F32);
        assert_eq!(st["w.exp_avg_sq"].dtype(), DType::F32);
    }

    #[test]
    fn no_gradient_is_no_step_and_state_round_trips() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&tensor(&[0.5, -0.25, 1.0], &[3])).unwrap();
        let mut opt = AdamW::new([("w".to_string(), w.clone())], AdamWConfig::default()).unwrap();
        let before = flat(w.as_tensor());
        opt.step(&GradStore::default()).unwrap();
        assert_eq!(opt.step_count(), 0);
        assert_eq!(flat(w.as_tensor()), before);

        let mut g = GradStore::default();
        g.insert(w.as_tensor(), tensor(&[0.1, 0.2, -0.3], &[3]));
        opt.step(&g).unwrap();
        let mut st = HashMap::new();
        opt.save_state(&mut st, "opt.").unwrap();
        // A twin restored from the state takes the same next step.
        let w2 = Var::from_tensor(&w.as_tensor().copy().unwrap()).unwrap();
        let mut twin = AdamW::new([("w".to_string(), w2.clone())], AdamWConfig::default()).unwrap();
        let mut src = NamedTensors::new("test state", st.clone());
        twin.load_state(&mut src, "opt.").unwrap();
        src.finish().unwrap();
        assert_eq!(twin.step_count(), 1);
        let mut g2 = GradStore::default();
        g2.insert(w.as_tensor(), tensor(&[-0.2, 0.05, 0.3], &[3]));
        let mut g2b = GradStore::default();
        g2b.insert(w2.as_tensor(), tensor(&[-0.2, 0.05, 0.3], &[3]));
        opt.step(&g2).unwrap();
        twin.step(&g2b).unwrap();
        assert_eq!(flat(w.as_tensor()), flat(w2.as_tensor()));

        // Wrong shape and missing entries are reported by name.
        let mut bad = st.clone();
        bad.insert("opt.w.exp_avg".into(), Tensor::zeros(4, DType::F32, &dev).unwrap());
        let err = twin.load_state(&mut NamedTensors::new("test state", bad), "opt.").err().unwrap();
        assert!(err.to_string().contains("opt.w.exp_avg"), "{err}");
        let mut missing = st;
        missing.remove("opt.w.step");
        let err = twin.load_state(&mut NamedTensors::new("test state", missing), "opt.").err().unwrap();
        assert!(err.to_string().contains("missing tensor \"opt.w.step\""), "{err}");
    }

    #[test]
    fn rejects_bad_config() {
        let var = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let cfg = AdamWConfig { beta1: 1.0, ..Default::default() };
        assert!(AdamW::new([("w".to_string(), var.clone())], cfg).is_err());
        let dup = [("w".to_string(), var.clone()), ("w".to_string(), var)];
        assert!(AdamW::new(dup, AdamWConfig::default()).is_err());
    }
}
