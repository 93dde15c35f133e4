//! The PPO actor-critic of MODELS.md and its clipped-surrogate loss.
//!
//! Two separate tanh MLPs: `actor.0` (56→h), `actor.1` (h→h), `actor.head` (h→3,
//! logits) and `critic.0`, `critic.1`, `critic.head` (h→1, value). The loss follows the
//! reference (CleanRL-style): advantages normalised per minibatch with the unbiased
//! standard deviation plus 1e-8, `L = L_clip + 0.5·L_v − 0.01·H` with
//! `L_v = 0.5·mean((V − R)²)`, log-probabilities from a differentiable log-softmax.
//!
//! The folder: this file (network, loss), [`trainer`] (`PpoTrainer`: rollouts, GAE,
//! minibatch epochs, resume), and under `cuda` `fused` (the fused update over the shared
//! `mlp` training kernels), `rollout` (a whole rollout as one captured graph) and `epochs`
//! (all of an update's minibatch epochs as one graph); [`population`] (N learners' minibatch
//! updates as one batched step).

#[cfg(feature = "cuda")]
mod epochs;
#[cfg(feature = "cuda")]
pub(crate) mod fused;
#[cfg(feature = "cuda")]
mod pop_fused;
pub mod population;
#[cfg(feature = "cuda")]
mod rollout;
pub mod trainer;

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use fx_precision::Precision;
use serde::{Deserialize, Serialize};

use crate::dqn::check_states;
use crate::error::{Context, Error, Result};
use crate::linear::linear;
use crate::params::{linear_specs, ParamSpec, ParamStore};

/// Network dimensions of the actor-critic (defaults: MODELS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoNetConfig {
    /// Input width (56).
    pub state_dim: usize,
    /// Hidden width h of both networks (256).
    pub hidden: usize,
    /// Number of discrete actions (3).
    pub n_actions: usize,
}

impl Default for PpoNetConfig {
    fn default() -> Self {
        Self { state_dim: 56, hidden: 256, n_actions: 3 }
    }
}

impl PpoNetConfig {
    /// The parameter names and shapes, in the spec's order.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let (s, h, a) = (self.state_dim, self.hidden, self.n_actions);
        let mut v = Vec::with_capacity(12);
        v.extend(linear_specs("actor.0", s, h));
        v.extend(linear_specs("actor.1", h, h));
        v.extend(linear_specs("actor.head", h, a));
        v.extend(linear_specs("critic.0", s, h));
        v.extend(linear_specs("critic.1", h, h));
        v.extend(linear_specs("critic.head", h, 1));
        v
    }

    fn validate(&self) -> Result<()> {
        if self.state_dim == 0 || self.hidden == 0 || self.n_actions < 2 {
            return Err(Error::config(
                "PpoNetConfig",
                format!("need state_dim, hidden > 0 and n_actions >= 2, got {self:?}"),
            ));
        }
        Ok(())
    }
}

/// Loss hyper-parameters of PPO (defaults: MODELS.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoLossConfig {
    /// Ratio clip ε (0.2).
    pub clip: f64,
    /// Weight of the value loss (0.5).
    pub vf_coef: f64,
    /// Weight of the entropy bonus (0.01).
    pub ent_coef: f64,
    /// Added to the advantage standard deviation (1e-8).
    pub adv_eps: f64,
}

impl Default for PpoLossConfig {
    fn default() -> Self {
        Self { clip: 0.2, vf_coef: 0.5, ent_coef: 0.01, adv_eps: 1e-8 }
    }
}

/// The actor-critic (F32 master weights, forward in a configurable compute dtype).
#[derive(Debug)]
pub struct ActorCritic {
    cfg: PpoNetConfig,
    params: ParamStore,
    precision: Precision,
}

impl ActorCritic {
    /// A freshly initialised actor-critic (PyTorch `Linear` init from the counter-based
    /// generator with `seed`).
    pub fn new(cfg: PpoNetConfig, device: &Device, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let params = ParamStore::linear_init("ppo", cfg.param_specs(), device, seed)?;
        Ok(Self { cfg, params, precision: Precision::F32 })
    }

    /// The network dimensions.
    pub fn config(&self) -> &PpoNetConfig {
        &self.cfg
    }

    /// The trainable parameters (actor then critic).
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// The precision policy of the forward pass (weights stay F32).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Sets the precision policy (F32, BF16 or F16 compute).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Loads weights from a safetensors file (strict names and shapes).
    pub fn load(&self, path: &Path) -> Result<()> {
        self.params.load(path)
    }

    /// Saves the weights (F32, spec names) to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.params.save(path)
    }

    /// `(logits [B, A], value [B])`, both F32, recording the graph.
    pub fn forward(&self, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let w: Vec<&Tensor> = (0..12).map(|i| self.params.t(i)).collect();
        self.forward_with(s, &w)
    }

    /// `(logits, value)` without a gradient tape (detached weights, nothing recorded).
    pub fn forward_inference(&self, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let w: Vec<Tensor> = (0..12).map(|i| self.params.t(i).detach()).collect();
        let w: Vec<&Tensor> = w.iter().collect();
        self.forward_with(&s.detach(), &w)
    }

    /// Action probabilities `[B, A]` (F32, no graph): `exp(log_softmax(logits))`.
    pub fn probs_inference(&self, s: &Tensor) -> Result<Tensor> {
        let (logits, _) = self.forward_inference(s)?;
        log_softmax(&logits).and_then(|l| l.exp()).ctx("ActorCritic::probs_inference")
    }

    /// Greedy actions `argmax_a logits` as U32 `[B]` (no graph; ties to the lowest
    /// index on the CPU).
    pub fn greedy_actions(&self, s: &Tensor) -> Result<Tensor> {
        let (logits, _) = self.forward_inference(s)?;
        logits.argmax(D::Minus1).ctx("ActorCritic::greedy_actions")
    }

    /// The actor's greedy policy as one fused CUDA kernel over this network's own weights,
    /// in F32 whatever the precision policy, seeing their in-place updates (see
    /// `crate::mlp::cuda`). Dimensions beyond the kernel's limits are
    /// `fx_kernels::Error::Unsupported` inside [`Error::Kernels`]: use
    /// [`Self::greedy_actions`] then.
    #[cfg(feature = "cuda")]
    pub fn fused_policy(&self) -> Result<crate::mlp::cuda::MlpPolicy> {
        self.with_greedy_mlp(|net| crate::mlp::cuda::MlpPolicy::new(net).ctx("ActorCritic::fused_policy"))
    }

    /// The actor's greedy policy for decisions on the CPU, one observation at a time, with
    /// no thread pool and no allocation per call (`crate::mlp::cpu::CpuPolicy`; F32, a
    /// snapshot of the current weights).
    pub fn cpu_policy(&self) -> Result<crate::mlp::cpu::CpuPolicy> {
        self.with_greedy_mlp(|net| crate::mlp::cpu::CpuPolicy::new(net).ctx("ActorCritic::cpu_policy"))
    }

    /// The actor as a `GreedyMlp` description (tanh layers, logits head).
    fn with_greedy_mlp<R>(&self, f: impl FnOnce(&crate::mlp::reference::GreedyMlp<'_>) -> R) -> R {
        use crate::mlp::reference::{Activation, GreedyMlp, Head, Linear};
        let lin = |l: usize| Linear { weight: self.params.t(2 * l), bias: self.params.t(2 * l + 1) };
        let hidden = [(lin(0), Activation::Tanh), (lin(1), Activation::Tanh)];
        f(&GreedyMlp { hidden: &hidden, head: Head::Logits(lin(2)) })
    }

    fn forward_with(&self, s: &Tensor, w: &[&Tensor]) -> Result<(Tensor, Tensor)> {
        const CTX: &str = "ActorCritic::forward";
        check_states(s, self.cfg.state_dim, CTX)?;
        let c = self.precision;
        let mlp = |o: usize| -> candle_core::Result<Tensor> {
            let x = linear(s, w[o], w[o + 1], c)?.tanh()?;
            let x = linear(&x, w[o + 2], w[o + 3], c)?.tanh()?;
            linear(&x, w[o + 4], w[o + 5], c)?.to_dtype(DType::F32)
        };
        let logits = mlp(0).ctx(CTX)?;
        let value = mlp(6).and_then(|v| v.squeeze(1)).ctx(CTX)?;
        Ok((logits, value))
    }
}

/// Log-softmax over the last dimension with gradients (fx-precision's composition of
/// basic ops; candle's fused softmax has no backward).
pub(crate) fn log_softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    fx_precision::ops::log_softmax_last_dim(x)
}

/// One PPO minibatch: `obs [B, S]`, `actions [B]` (integer), `logp_old [B]`,
/// `advantages [B]` (raw; the loss normalises them), `returns [B]`.
#[derive(Debug, Clone, Copy)]
pub struct PpoBatch<'a> {
    /// States.
    pub obs: &'a Tensor,
    /// Actions taken (U8, U32 or I64).
    pub actions: &'a Tensor,
    /// Log-probabilities of the actions under the rollout policy.
    pub logp_old: &'a Tensor,
    /// GAE advantages (unnormalised).
    pub advantages: &'a Tensor,
    /// Return targets `A + V`.
    pub returns: &'a Tensor,
}

/// The PPO loss, its parts, and the diagnostics of one minibatch.
#[derive(Debug, Clone)]
pub struct PpoLossParts {
    /// Scalar loss (with graph).
    pub loss: Tensor,
    /// Logits `[B, A]`.
    pub logits: Tensor,
    /// Values `[B]`.
    pub value: Tensor,
    /// `log π(a|s)` `[B]`.
    pub logp: Tensor,
    /// Entropy per state `[B]`.
    pub entropy: Tensor,
    /// `exp(logp − logp_old)` `[B]`.
    pub ratio: Tensor,
    /// Normalised advantages `[B]`.
    pub adv_norm: Tensor,
    /// Clipped surrogate loss (scalar).
    pub l_clip: Tensor,
    /// Value loss `0.5 mean((V − R)²)` (scalar).
    pub l_v: Tensor,
    /// Mean entropy (scalar).
    pub entropy_mean: Tensor,
    /// Approximate KL `mean((ratio − 1) − log ratio)` (scalar, no graph).
    pub approx_kl: Tensor,
    /// Fraction of `|ratio − 1| > clip` (scalar, no graph).
    pub clip_frac: Tensor,
}

/// The PPO loss of MODELS.md on one minibatch (see the module docs).
pub fn ppo_loss(model: &ActorCritic, batch: PpoBatch<'_>, cfg: &PpoLossConfig) -> Result<PpoLossParts> {
    const CTX: &str = "ppo_loss";
    let b = batch.obs.dim(0).ctx(CTX)?;
    if b < 2 {
        return Err(Error::shape(
            "obs",
            CTX,
            "a minibatch of at least 2 (unbiased std)",
            format!("{:?}", batch.obs.dims()),
        ));
    }
    for (what, t) in [
        ("actions", batch.actions),
        ("logp_old", batch.logp_old),
        ("advantages", batch.advantages),
        ("returns", batch.returns),
    ] {
        if t.dims() != [b] {
            return Err(Error::shape(what, CTX, format!("[{b}]"), format!("{:?}", t.dims())));
        }
    }
    let (logits, value) = model.forward(batch.obs)?;
    let parts = (|| {
        let logp_all = log_softmax(&logits)?;
        let logp = logp_all.gather(&batch.actions.unsqueeze(1)?, 1)?.squeeze(1)?;
        let entropy = logp_all.exp()?.mul(&logp_all)?.sum(D::Minus1)?.neg()?;
        // Advantage normalisation: the inputs carry no graph, so this is data only.
        let adv = batch.advantages.to_dtype(DType::F32)?.detach();
        let mean = adv.mean_all()?;
        let centred = adv.broadcast_sub(&mean)?;
        let var = (centred.sqr()?.sum_all()? / (b as f64 - 1.0))?;
        let std = var.sqrt()?;
        let adv_n = centred.broadcast_div(&(std + cfg.adv_eps)?)?;
        let logratio = logp.sub(&batch.logp_old.to_dtype(DType::F32)?)?;
        let ratio = logratio.exp()?;
        let pg1 = ratio.mul(&adv_n)?;
        // clamp with PyTorch's gradient (1 inside [lo, hi] inclusive, 0 outside).
        let (lo, hi) = (1.0 - cfg.clip, 1.0 + cfg.clip);
        let r_det = ratio.detach();
        let inside = r_det.ge(lo)?.mul(&r_det.le(hi)?)?;
        let bound = r_det.clamp(lo, hi)?;
        let clipped = inside.where_cond(&ratio, &bound)?;
        let pg2 = clipped.mul(&adv_n)?;
        let take1 = pg1.detach().le(&pg2.detach())?;
        let l_clip = take1.where_cond(&pg1, &pg2)?.mean_all()?.neg()?;
        let l_v = (value.sub(&batch.returns.to_dtype(DType::F32)?)?.sqr()?.mean_all()? * 0.5)?;
        let entropy_mean = entropy.mean_all()?;
        let loss = ((&l_clip + (&l_v * cfg.vf_coef)?)? - (&entropy_mean * cfg.ent_coef)?)?;
        let approx_kl = ((&r_det - 1.0)? - logratio.detach())?.mean_all()?;
        let clip_frac = (&r_det - 1.0)?.abs()?.gt(cfg.clip)?.to_dtype(DType::F32)?.mean_all()?;
        Ok::<_, candle_core::Error>(PpoLossParts {
            loss,
            logits: logits.clone(),
            value: value.clone(),
            logp,
            entropy,
            ratio,
            adv_norm: adv_n,
            l_clip,
            l_v,
            entropy_mean,
            approx_kl,
            clip_frac,
        })
    })()
    .ctx(CTX)?;
    Ok(parts)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fixtures::{rel_err, Fixture};

    /// The fused kernel's actions are candle's, except on near-ties; off CUDA it is refused.
    #[cfg(feature = "cuda")]
    #[test]
    fn fused_policy_matches_greedy_actions() {
        assert!(ActorCritic::new(PpoNetConfig::default(), &Device::Cpu, 0).unwrap().fused_policy().is_err());
        let Some(dev) = fx_hw::test_gpu("ppo::fused_policy_matches_greedy_actions") else { return };
        let net = ActorCritic::new(PpoNetConfig { hidden: 64, n_actions: 5, ..Default::default() }, &dev, 5).unwrap();
        let s = Tensor::randn(0f32, 1.0, (512, 56), &dev).unwrap();
        let got: Vec<u32> = net.fused_policy().unwrap().greedy(&s).unwrap().to_vec1().unwrap();
        let want: Vec<u32> = net.greedy_actions(&s).unwrap().to_vec1().unwrap();
        let q: Vec<Vec<f32>> = net.forward_inference(&s).unwrap().0.to_vec2().unwrap();
        for (r, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let (qg, qw) = (q[r][g as usize], q[r][w as usize]);
            assert!(g == w || (qg - qw).abs() <= 1e-5 * (1.0 + qw.abs()), "row {r}: fused {g}, candle {w}: {:?}", q[r]);
        }
    }

    pub(crate) fn fixture_model(fx: &Fixture, compute: Precision) -> ActorCritic {
        let cfg = PpoNetConfig { hidden: 64, ..Default::default() };
        let mut m = ActorCritic::new(cfg, &Device::Cpu, 5).unwrap();
        m.params().assign_from(&fx.map, &fx.path, "", false).unwrap();
        m.set_precision(compute);
        m
    }

    pub(crate) fn fixture_batch(fx: &Fixture) -> PpoBatch<'_> {
        PpoBatch {
            obs: fx.get("in.obs"),
            actions: fx.get("in.actions"),
            logp_old: fx.get("in.logp_old"),
            advantages: fx.get("in.advantages"),
            returns: fx.get("in.returns"),
        }
    }

    fn check_parity(compute: Precision, tol: f64) {
        let fx = Fixture::load("ppo.safetensors");
        let model = fixture_model(&fx, compute);
        let p = ppo_loss(&model, fixture_batch(&fx), &PpoLossConfig::default()).unwrap();
        for (key, got) in [
            ("out.logits", &p.logits),
            ("out.value", &p.value),
            ("out.logp", &p.logp),
            ("out.entropy", &p.entropy),
            ("out.ratio", &p.ratio),
            ("out.adv_norm", &p.adv_norm),
            ("out.l_clip", &p.l_clip),
            ("out.l_v", &p.l_v),
            ("out.entropy_mean", &p.entropy_mean),
            ("loss", &p.loss),
        ] {
            let e = rel_err(got, fx.get(key));
            assert!(e <= tol, "{key}: rel err {e:e} > {tol:e} ({compute:?})");
        }
        let grads = p.loss.backward().unwrap();
        for (spec, var) in model.params().specs().iter().zip(model.params().vars()) {
            let g = grads.get(var.as_tensor()).expect("gradient recorded");
            let e = rel_err(g, fx.get(&format!("grad.{}", spec.name)));
            assert!(e <= tol, "grad.{}: rel err {e:e} > {tol:e} ({compute:?})", spec.name);
        }
    }

    #[test]
    fn parity_f32() {
        check_parity(Precision::F32, 1e-4);
    }

    /// PyTorch's own bf16 autocast is within 6.1e-3 of this fixture on every tensor
    /// (`tools/bf16_torch_check.py`); the spec's bound is 2e-2.
    #[test]
    fn parity_bf16() {
        check_parity(Precision::Bf16, 2e-2);
    }

    #[test]
    fn fixture_exercises_the_clip_branch_and_metrics() {
        let fx = Fixture::load("ppo.safetensors");
        let model = fixture_model(&fx, Precision::F32);
        let p = ppo_loss(&model, fixture_batch(&fx), &PpoLossConfig::default()).unwrap();
        let ratio: Vec<f32> = p.ratio.to_vec1().unwrap();
        let outside = ratio.iter().filter(|r| (**r - 1.0).abs() > 0.2).count();
        assert_eq!(outside, 8);
        let cf = p.clip_frac.to_scalar::<f32>().unwrap();
        assert!((cf - 8.0 / 32.0).abs() < 1e-6);
        // approx KL by hand: mean((r - 1) - ln r) >= 0.
        let kl: f64 = ratio.iter().map(|&r| (r as f64 - 1.0) - (r as f64).ln()).sum::<f64>() / 32.0;
        let got = p.approx_kl.to_scalar::<f32>().unwrap() as f64;
        assert!((got - kl).abs() < 1e-6 * (1.0 + kl), "{got} vs {kl}");
        // Normalised advantages: mean 0, unbiased std 1 (up to eps).
        let a: Vec<f32> = p.adv_norm.to_vec1().unwrap();
        let m = a.iter().map(|&x| x as f64).sum::<f64>() / 32.0;
        let v = a.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / 31.0;
        assert!(m.abs() < 1e-6 && (v.sqrt() - 1.0).abs() < 1e-5);
    }

    #[test]
    fn param_count_matches_reference() {
        let m = ActorCritic::new(PpoNetConfig::default(), &Device::Cpu, 0).unwrap();
        assert_eq!(m.params().param_count(), 161_796);
    }

    #[test]
    fn forward_inference_records_no_graph() {
        let fx = Fixture::load("ppo.safetensors");
        let m = fixture_model(&fx, Precision::F32);
        let s = fx.get("in.obs");
        let (l, v) = m.forward(s).unwrap();
        let (li, vi) = m.forward_inference(s).unwrap();
        assert!(l.track_op() && v.track_op());
        assert!(!li.track_op() && !vi.track_op());
        assert_eq!(rel_err(&li, &l), 0.0);
        assert_eq!(rel_err(&vi, &v), 0.0);
        let probs = m.probs_inference(s).unwrap();
        assert!(!probs.track_op());
        let sums: Vec<f32> = probs.sum(1).unwrap().to_vec1().unwrap();
        assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-6));
    }

    #[test]
    fn save_load_round_trip() {
        let fx = Fixture::load("ppo.safetensors");
        let m = fixture_model(&fx, Precision::F32);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ppo.safetensors");
        m.save(&path).unwrap();
        let other = ActorCritic::new(*m.config(), &Device::Cpu, 77).unwrap();
        other.load(&path).unwrap();
        for spec in m.params().specs() {
            let a = other.params().get(&spec.name).unwrap().as_tensor();
            assert_eq!(rel_err(a, fx.get(&spec.name)), 0.0, "{}", spec.name);
        }
        // A DQN file is refused with the first offending name.
        let dqn = crate::dqn::DuelingDqn::new(Default::default(), &Device::Cpu, 0).unwrap();
        let p2 = dir.path().join("dqn.safetensors");
        dqn.save(&p2).unwrap();
        let msg = other.load(&p2).unwrap_err().to_string();
        assert!(msg.contains("unknown tensor `advantage.bias`") && msg.contains("dqn.safetensors"), "{msg}");
    }

    #[test]
    fn minibatch_of_one_is_refused() {
        let m = ActorCritic::new(PpoNetConfig { hidden: 4, ..Default::default() }, &Device::Cpu, 0).unwrap();
        let dev = Device::Cpu;
        let obs = Tensor::zeros((1, 56), DType::F32, &dev).unwrap();
        let one = Tensor::zeros(1, DType::F32, &dev).unwrap();
        let act = Tensor::zeros(1, DType::U32, &dev).unwrap();
        let b = PpoBatch { obs: &obs, actions: &act, logp_old: &one, advantages: &one, returns: &one };
        let msg = ppo_loss(&m, b, &PpoLossConfig::default()).unwrap_err().to_string();
        assert!(msg.contains("at least 2"), "{msg}");
    }
}
