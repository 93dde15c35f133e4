//! PPO populations: N actor-critics of one shape trained together, each member with its own
//! seed (initial weights, shuffles), loss coefficients (clip range, value and entropy
//! weights), GAE γ and λ, learning rate, gradient clip, Adam state, guard, counters,
//! environments and rollout: [`PpoPopulation::iterate`] runs every member's iteration (one
//! batched forward a collection step, then all members' minibatch updates as one step each,
//! [`PpoPopulation::update_minibatch`]).
//!
//! Layout: the N actor-critics are one [`ParamStore`] whose tensors are stacked `[N, ...]`
//! (member k's slice starts as a solo [`ActorCritic`](crate::ActorCritic) with its seed
//! starts); the optimiser is [`fx_precision::PopAdamW`] (Adam without weight decay is its
//! arithmetic with a decay factor of 1). What members set differently lives in `[N]` device
//! tensors read by the step, and nothing is read back, so the update runs unchanged inside a
//! CUDA graph ([`PpoPopulation::capture_update`]).
//!
//! Member k of a population is member k's solo [`PpoTrainer::update_minibatch`](crate::PpoTrainer)
//! on member k's minibatches: every operation is the solo loss's, batched over a leading axis
//! in the same order (per-member scalars become `[N]` tensors with the same F32 values), so
//! on the CPU the weights, moments, counters and minibatch statistics are the same values
//! (the tests compare them). On CUDA the loss and gradients are the solo fused update
//! batched over members (`pop_fused`; BF16 compute as the DQN's fused update takes it).
//! Whole iterations are member k's solo `PpoTrainer::iterate` too (tested on the CPU); the
//! collection still steps each member's environments in launches of their own.
//!
//! A member may start over as a new learner between iterations
//! ([`PpoPopulation::replace_member`]: a sweep's freed slot taking the next trial); its
//! shuffling key and counters count from the population's counters at its start.

use candle_core::{DType, Device, Tensor, Var, D};
use fx_kernels::{Rollout, VecEnv};
use fx_precision::{PopAdamW, PopMember, Precision};

use crate::error::{Context, Error, Result};
use crate::linear::linear_members;
use crate::params::ParamStore;
use crate::ppo::trainer::{explained_variance_of, permutation, PpoConfig, PpoIterStats, PpoMinibatchStats};

const CTX: &str = "PpoPopulation";

/// One minibatch per member, stacked: `obs [N, B, S]`, `actions [N, B]` (U32),
/// `logp_old`, `advantages` (raw) and `returns` `[N, B]`.
#[derive(Debug, Clone)]
pub struct PpoPopBatch {
    /// States.
    pub obs: Tensor,
    /// Actions taken.
    pub actions: Tensor,
    /// Log-probabilities of the actions under the rollout policy.
    pub logp_old: Tensor,
    /// GAE advantages (unnormalised).
    pub advantages: Tensor,
    /// Return targets.
    pub returns: Tensor,
}

impl PpoPopBatch {
    #[cfg(feature = "cuda")]
    fn tensors(&self) -> [&Tensor; 5] {
        [&self.obs, &self.actions, &self.logp_old, &self.advantages, &self.returns]
    }
}

/// Per-member loss coefficients in device memory.
struct Coefs {
    /// `1 − clip`, `1 + clip` and `clip` as F32 `[N, 1]`.
    lo: Tensor,
    hi: Tensor,
    clip: Tensor,
    /// Value and entropy weights as F32 `[N]`.
    vf: Tensor,
    ent: Tensor,
}

impl Coefs {
    /// The members' loss coefficients as the batched loss reads them.
    fn of(members: &[PpoConfig], device: &Device) -> Result<Self> {
        let n = members.len();
        let col = |f: &dyn Fn(&PpoConfig) -> f64| {
            Tensor::from_vec(members.iter().map(|m| f(m) as f32).collect::<Vec<f32>>(), (n, 1), device).ctx(CTX)
        };
        let row = |f: &dyn Fn(&PpoConfig) -> f64| {
            Tensor::from_vec(members.iter().map(|m| f(m) as f32).collect::<Vec<f32>>(), n, device).ctx(CTX)
        };
        Ok(Self {
            lo: col(&|m| 1.0 - m.loss.clip)?,
            hi: col(&|m| 1.0 + m.loss.clip)?,
            clip: col(&|m| m.loss.clip)?,
            vf: row(&|m| m.loss.vf_coef)?,
            ent: row(&|m| m.loss.ent_coef)?,
        })
    }
}

/// On a CUDA device, for networks its kernels cover: the member-batched loss and gradients
/// of `members` (their coefficients on the device).
#[cfg(feature = "cuda")]
fn fused_for(members: &[PpoConfig], device: &Device) -> Result<Option<crate::ppo::pop_fused::PpoPopFused>> {
    let first = &members[0];
    if !device.is_cuda() || !crate::ppo::pop_fused::PpoPopFused::supports(&first.net) {
        return Ok(None);
    }
    let c: Vec<[f32; 3]> =
        members.iter().map(|m| [m.loss.clip as f32, m.loss.vf_coef as f32, m.loss.ent_coef as f32]).collect();
    let (b, eps, p) = (first.minibatch_size, first.loss.adv_eps, first.precision);
    Ok(Some(crate::ppo::pop_fused::PpoPopFused::new(&first.net, &c, b, eps, p, device)?))
}

/// Metadata key and layout version of a population's state file.
const POP_STATE_KEY: &str = "fx.ppo_population";
const POP_STATE_VERSION: u32 = 1;

/// Counters and configs saved with a population's state (JSON in its metadata).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct PopCounters {
    version: u32,
    num_envs: usize,
    env_steps: u64,
    epochs_done: u64,
    iterations: u64,
    members: Vec<PpoConfig>,
    /// Each member's clock (absent in states written before members could start over).
    #[serde(default)]
    clocks: Vec<PpoClock>,
}

/// The population's counters when a member began (zero for a member from the start;
/// [`PpoPopulation::replace_member`]): its own env steps, epochs (its shuffling key) and
/// iterations count from there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct PpoClock {
    env_steps: u64,
    epochs: u64,
    iterations: u64,
}

impl crate::state_meta::Versioned for PopCounters {
    fn version(&self) -> u32 {
        self.version
    }
}

/// N PPO learners updated as one; see the module docs.
pub struct PpoPopulation {
    members: Vec<PpoConfig>,
    num_envs: usize,
    params: ParamStore,
    coefs: Coefs,
    opt: PopAdamW,
    /// The last minibatch's l_clip, l_v, entropy, approx_kl and clip_frac per member (F32 `[5, N]`).
    diag: Var,
    /// Each member's rollout storage (`num_steps × num_envs`).
    rollouts: Vec<Rollout>,
    /// Environment steps, epochs and iterations done (by every member together).
    env_steps: u64,
    epochs_done: u64,
    iterations: u64,
    /// Each member's clock (see [`PpoClock`]).
    clocks: Vec<PpoClock>,
    #[cfg(feature = "cuda")]
    graph: Option<CapturedUpdate>,
    /// On a CUDA device, for networks its kernels cover: the member-batched loss and
    /// gradients at the configured minibatch size.
    #[cfg(feature = "cuda")]
    fused: Option<crate::ppo::pop_fused::PpoPopFused>,
}

#[cfg(feature = "cuda")]
struct CapturedUpdate {
    graph: fx_precision::CapturedGraph,
    inputs: PpoPopBatch,
}

impl std::fmt::Debug for PpoPopulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PpoPopulation").field("members", &self.members.len()).finish()
    }
}

/// The keys every member must share: they fix shapes, the update schedule or constants the
/// step takes once.
fn shared_keys(c: &PpoConfig) -> String {
    let o = &c.optimizer;
    format!(
        "net {:?}, precision {}, num_steps {}, epochs {}, minibatch_size {}, adv_eps {}, betas ({}, {}), eps {}",
        c.net, c.precision, c.num_steps, c.epochs, c.minibatch_size, c.loss.adv_eps, o.beta1, o.beta2, o.eps
    )
}

/// `(logits [N, R, A], value [N, R])` (F32) of states `[N, R, S]` under stacked weights `w`
/// (the solo two tanh MLPs, batched).
fn forward(w: &[Tensor], s: &Tensor, p: Precision) -> candle_core::Result<(Tensor, Tensor)> {
    let mlp = |o: usize| -> candle_core::Result<Tensor> {
        let x = linear_members(s, &w[o], &w[o + 1], p)?.tanh()?;
        let x = linear_members(&x, &w[o + 2], &w[o + 3], p)?.tanh()?;
        linear_members(&x, &w[o + 4], &w[o + 5], p)?.to_dtype(DType::F32)
    };
    Ok((mlp(0)?, mlp(6)?.squeeze(2)?))
}

/// Each member's PPO loss `[N]` and its diagnostics `[5, N]` (l_clip, l_v, entropy,
/// approx_kl, clip_frac; no graph): [`crate::ppo_loss`] with a leading member axis.
fn pop_loss(
    w: &[Tensor],
    batch: &PpoPopBatch,
    c: &Coefs,
    adv_eps: f64,
    p: Precision,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (logits, value) = forward(w, &batch.obs, p)?;
    loss_of_outputs(&logits, &value, batch, c, adv_eps)
}

/// The forward of the fused update's BF16 compute, in F32 on any device: every GEMM's
/// inputs (states or hidden activations, weights) rounded to BF16, products, biases and
/// activations in F32, as `pop_fused` computes them. The gradients flow through the
/// roundings unchanged (a cast's backward), so only the backward GEMMs' BF16 inputs and the
/// order of sums differ from the fused update's. With `split`, the hidden layers' products
/// are rounded to BF16 before their bias, as the split forward's GEMMs write them (its tanh
/// backward, from BF16 activations, is not modelled: candle's takes the F32 ones).
#[cfg(all(test, feature = "cuda"))]
fn forward_bf16_inputs(w: &[Tensor], s: &Tensor, split: bool) -> candle_core::Result<(Tensor, Tensor)> {
    let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let lin = |x: &Tensor, o: usize, hidden: bool| -> candle_core::Result<Tensor> {
        let p = round(x)?.matmul(&round(&w[o])?.transpose(1, 2)?)?;
        let p = if split && hidden { round(&p)? } else { p };
        p.broadcast_add(&w[o + 1].unsqueeze(1)?)
    };
    let mlp = |o: usize| -> candle_core::Result<Tensor> {
        let x = lin(s, o, true)?.tanh()?;
        let x = lin(&x, o + 2, true)?.tanh()?;
        lin(&x, o + 4, false)
    };
    Ok((mlp(0)?, mlp(6)?.squeeze(2)?))
}

/// [`pop_loss`] from the networks' outputs (`logits [N, B, A]`, `value [N, B]`, F32).
fn loss_of_outputs(
    logits: &Tensor,
    value: &Tensor,
    batch: &PpoPopBatch,
    c: &Coefs,
    adv_eps: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let b = batch.obs.dim(1)?;
    let logp_all = crate::ppo::log_softmax(logits)?;
    let logp = logp_all.gather(&batch.actions.unsqueeze(2)?, 2)?.squeeze(2)?;
    let entropy = logp_all.exp()?.mul(&logp_all)?.sum(D::Minus1)?.neg()?;
    let adv = batch.advantages.to_dtype(DType::F32)?.detach();
    let mean = adv.mean_keepdim(1)?;
    let centred = adv.broadcast_sub(&mean)?;
    let var = (centred.sqr()?.sum_keepdim(1)? / (b as f64 - 1.0))?;
    let std = var.sqrt()?;
    let adv_n = centred.broadcast_div(&(std + adv_eps)?)?;
    let logratio = logp.sub(&batch.logp_old.to_dtype(DType::F32)?)?;
    let ratio = logratio.exp()?;
    let pg1 = ratio.mul(&adv_n)?;
    let r_det = ratio.detach();
    let inside = r_det.broadcast_ge(&c.lo)?.mul(&r_det.broadcast_le(&c.hi)?)?;
    let bound = r_det.broadcast_maximum(&c.lo)?.broadcast_minimum(&c.hi)?;
    let clipped = inside.where_cond(&ratio, &bound)?;
    let pg2 = clipped.mul(&adv_n)?;
    let take1 = pg1.detach().le(&pg2.detach())?;
    let l_clip = take1.where_cond(&pg1, &pg2)?.mean(1)?.neg()?;
    let l_v = (value.sub(&batch.returns.to_dtype(DType::F32)?)?.sqr()?.mean(1)? * 0.5)?;
    let entropy_mean = entropy.mean(1)?;
    let loss = ((&l_clip + l_v.mul(&c.vf)?)? - entropy_mean.mul(&c.ent)?)?;
    let approx_kl = ((&r_det - 1.0)? - logratio.detach())?.mean(1)?;
    let clip_frac = (&r_det - 1.0)?.abs()?.broadcast_gt(&c.clip)?.to_dtype(DType::F32)?.mean(1)?;
    let diag = Tensor::stack(&[l_clip.detach(), l_v.detach(), entropy_mean.detach(), approx_kl, clip_frac], 0)?;
    Ok((loss, diag))
}

/// The reference of the fused update: each member's loss `[N]`, diagnostics `[5, N]` and
/// the gradients of the summed losses in parameter order, with candle's ops; with
/// `bf16_inputs` its forward rounds every GEMM's inputs to BF16 as the fused BF16 update
/// does ([`forward_bf16_inputs`], `split` as there; the population's own precision
/// otherwise).
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn reference_loss_and_grads(
    pop: &PpoPopulation,
    batch: &PpoPopBatch,
    bf16_inputs: bool,
    split: bool,
) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
    let cfg = &pop.members[0];
    let vars = pop.params.vars();
    let w: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let eps = cfg.loss.adv_eps;
    let (loss, diag) = if bf16_inputs {
        forward_bf16_inputs(&w, &batch.obs, split).and_then(|(l, v)| loss_of_outputs(&l, &v, batch, &pop.coefs, eps))
    } else {
        pop_loss(&w, batch, &pop.coefs, eps, cfg.precision)
    }
    .ctx(CTX)?;
    let grads = loss.sum_all().and_then(|l| l.backward()).ctx(CTX)?;
    let g = w
        .iter()
        .map(|t| grads.get(t).cloned().ok_or_else(|| Error::config(CTX, "a parameter has no gradient")))
        .collect::<Result<_>>()?;
    Ok((loss, diag, g))
}

impl PpoPopulation {
    /// A population of `members.len()` PPO learners for rollouts of `num_envs` environments,
    /// member `k` configured by `members[k]`. Members may differ in `seed`,
    /// `optimizer.lr`, `max_grad_norm`, `loss.clip`, `loss.vf_coef`, `loss.ent_coef` and
    /// `gae`; every other key must be equal (an error names the first member that differs).
    /// F16 compute and Adam's L2 weight decay are refused.
    pub fn new(members: Vec<PpoConfig>, num_envs: usize, device: &Device) -> Result<Self> {
        let Some(first) = members.first() else {
            return Err(Error::config(CTX, "a population needs at least one member"));
        };
        let shared = shared_keys(first);
        for (k, m) in members.iter().enumerate() {
            m.validate(num_envs).map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
            if shared_keys(m) != shared {
                return Err(Error::config(
                    CTX,
                    format!("member {k} differs from member 0 in a shared key: {} vs {shared}", shared_keys(m)),
                ));
            }
            if m.optimizer.weight_decay != 0.0 {
                return Err(Error::config(
                    CTX,
                    format!(
                        "member {k}: optimizer.weight_decay {} (populations take Adam without it)",
                        m.optimizer.weight_decay
                    ),
                ));
            }
        }
        if first.precision == Precision::F16 {
            return Err(Error::config(CTX, "populations train in F32 or BF16, not F16"));
        }
        let n = members.len();
        let seeds: Vec<u64> = members.iter().map(|m| m.seed).collect();
        let params = ParamStore::linear_init_population("ppo", first.net.param_specs(), device, &seeds)?;
        let coefs = Coefs::of(&members, device)?;
        let per: Vec<PopMember> = members
            .iter()
            .map(|m| PopMember { lr: m.optimizer.lr, weight_decay: 0.0, max_grad_norm: m.max_grad_norm, tau: 0.0 })
            .collect();
        let o = &first.optimizer;
        let opt = PopAdamW::new(&params.vars(), &per, (o.beta1, o.beta2), o.eps, false)
            .map_err(|e| Error::config(CTX, e.to_string()))?;
        let diag = Tensor::zeros((5, n), DType::F32, device).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
        #[cfg(feature = "cuda")]
        let fused = fused_for(&members, device)?;
        let rollouts =
            (0..n).map(|_| Rollout::new(first.num_steps, num_envs, device).ctx(CTX)).collect::<Result<Vec<_>>>()?;
        Ok(Self {
            members,
            num_envs,
            params,
            coefs,
            opt,
            diag,
            rollouts,
            env_steps: 0,
            epochs_done: 0,
            iterations: 0,
            clocks: vec![PpoClock::default(); n],
            #[cfg(feature = "cuda")]
            graph: None,
            #[cfg(feature = "cuda")]
            fused,
        })
    }

    /// What members of one population must share, as text (a sweep groups trials by it).
    pub fn shape_key(member: &PpoConfig) -> String {
        shared_keys(member)
    }

    /// An estimate of one member's device memory in bytes for rollouts of `num_envs`
    /// environments, for sizing populations: seven F32 copies of the parameters (weights,
    /// gradient, two Adam moments, the clipped gradient, a compute-dtype copy and the
    /// optimiser's scratch), the rollout (`num_steps × num_envs` states and six values each),
    /// the minibatch gathered from it, and per row of the minibatch four F32 values a unit of
    /// both networks (activations and their gradients), doubled for temporaries.
    pub fn member_bytes(member: &PpoConfig, num_envs: usize) -> u64 {
        let net = &member.net;
        let params: usize = net.param_specs().iter().map(|p| p.shape.iter().product::<usize>()).sum();
        let row = (net.state_dim + 6) * 4;
        let rollout = member.num_steps.saturating_mul(num_envs).saturating_mul(row);
        let units = 2 * (2 * net.hidden + net.n_actions + 1);
        let batch = member.minibatch_size.saturating_mul(row + 2 * 4 * units * 4);
        (7 * params * 4).saturating_add(rollout).saturating_add(batch) as u64
    }

    /// The members' configs.
    pub fn members(&self) -> &[PpoConfig] {
        &self.members
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the population has no member (never: [`Self::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `k`'s settings replaced by `cfg` between updates (a PBT explore): learning
    /// rate, gradient clip, clip range, value and entropy weights and GAE γ, λ, the keys
    /// members may differ in, written in place on the device (a captured update reads them;
    /// GAE is computed per member each iteration). The seed and every shared key must stay
    /// as they are (an error names them); weights, moments and rollout are kept.
    pub fn set_member(&mut self, k: usize, cfg: PpoConfig) -> Result<()> {
        let Some(old) = self.members.get(k) else {
            return Err(Error::config(CTX, format!("no member {k} of {}", self.len())));
        };
        cfg.validate(self.num_envs).map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
        if shared_keys(&cfg) != shared_keys(old) || cfg.seed != old.seed || cfg.optimizer.weight_decay != 0.0 {
            return Err(Error::config(
                CTX,
                format!(
                    "member {k}: only optimizer.lr, max_grad_norm, loss.clip, loss.vf_coef, loss.ent_coef and gae may change"
                ),
            ));
        }
        let member = PopMember { lr: cfg.optimizer.lr, weight_decay: 0.0, max_grad_norm: cfg.max_grad_norm, tau: 0.0 };
        self.opt.set_member(k, &member).map_err(|e| Error::config(CTX, e.to_string()))?;
        self.write_coefs(k, cfg)
    }

    /// Member `k`'s loss weights and clip range written in place (a captured update reads
    /// them), and its config recorded.
    fn write_coefs(&mut self, k: usize, cfg: PpoConfig) -> Result<()> {
        let c = &self.coefs;
        let l = &cfg.loss;
        let put = |t: &Tensor, v: f64, col: bool| -> Result<()> {
            let x = if col { Tensor::new(&[[v as f32]], t.device()) } else { Tensor::new(&[v as f32], t.device()) };
            x.and_then(|x| t.slice_set(&x, 0, k)).ctx(CTX)
        };
        put(&c.lo, 1.0 - l.clip, true)?;
        put(&c.hi, 1.0 + l.clip, true)?;
        put(&c.clip, l.clip, true)?;
        put(&c.vf, l.vf_coef, false)?;
        put(&c.ent, l.ent_coef, false)?;
        #[cfg(feature = "cuda")]
        if let Some(f) = &self.fused {
            f.set_member(k, [l.clip as f32, l.vf_coef as f32, l.ent_coef as f32])?;
        }
        self.members[k] = cfg;
        Ok(())
    }

    /// Member `k` starts over as a new learner of `cfg` between iterations (a trial in the
    /// slot of one that successive halving stopped): actor-critic weights drawn from its
    /// seed, Adam moments, step count and skip counters zero, its settings, and clocks from
    /// this iteration, so that from here it is the solo learner of `cfg` (its shuffling and
    /// its counters count from now). The caller hands it new environments for the next
    /// iteration. Every shared key must equal the population's (an error names them).
    pub fn replace_member(&mut self, k: usize, cfg: PpoConfig) -> Result<()> {
        if k >= self.len() {
            return Err(Error::config(CTX, format!("no member {k} of {}", self.len())));
        }
        cfg.validate(self.num_envs).map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
        if shared_keys(&cfg) != shared_keys(&self.members[k]) || cfg.optimizer.weight_decay != 0.0 {
            return Err(Error::config(
                CTX,
                format!(
                    "member {k}: a new learner must share the population's keys ({}) and take no weight decay",
                    shared_keys(&self.members[k])
                ),
            ));
        }
        let fresh =
            ParamStore::linear_init_population("ppo", cfg.net.param_specs(), self.params.device(), &[cfg.seed])?
                .member(0)?;
        self.params.set_member(k, &fresh)?;
        let member = PopMember { lr: cfg.optimizer.lr, weight_decay: 0.0, max_grad_norm: cfg.max_grad_norm, tau: 0.0 };
        self.opt.reset_member(k, &member).map_err(|e| Error::config(CTX, e.to_string()))?;
        self.clocks[k] = PpoClock { env_steps: self.env_steps, epochs: self.epochs_done, iterations: self.iterations };
        self.write_coefs(k, cfg)
    }

    /// Environment steps the population has taken (its members' from the start).
    pub fn env_steps(&self) -> u64 {
        self.env_steps
    }

    /// Environment steps member `k` has taken since it began.
    pub fn member_env_steps(&self, k: usize) -> Option<u64> {
        self.clocks.get(k).map(|c| self.env_steps - c.env_steps)
    }

    /// Member `dst` continues from member `src`'s state (a PBT exploit): actor-critic weights,
    /// Adam moments and step count copied over `dst`'s on the device, exactly. Its settings,
    /// seed, rollout, environments and skip counters stay its own.
    pub fn exploit(&mut self, dst: usize, src: usize) -> Result<()> {
        if dst >= self.len() || src >= self.len() {
            return Err(Error::config(CTX, format!("exploit {src} -> {dst}: {} members", self.len())));
        }
        self.params.copy_member(dst, src)?;
        self.opt.copy_member(dst, src).map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// The population cut down to the members `keep` (strictly increasing), in that order:
    /// member `i` goes on as member `keep[i]` would have (weights, moments, counters,
    /// settings and rollout storage, exactly), so it stays its solo run (successive halving
    /// stops the others). The caller drops the stopped members' environments the same way.
    /// On CUDA the member-batched loss and the captured update are rebuilt for the new size.
    pub fn retain_members(&mut self, keep: &[usize]) -> Result<()> {
        fx_precision::check_kept_members(keep, self.len()).map_err(|m| Error::config(CTX, m))?;
        let device = self.params.device().clone();
        self.params.retain_members(keep)?;
        self.opt.retain_members(keep).map_err(|e| Error::config(CTX, e.to_string()))?;
        let idx = Tensor::from_vec(keep.iter().map(|&k| k as u32).collect(), keep.len(), &device).ctx(CTX)?;
        self.diag = self.diag.as_tensor().index_select(&idx, 1).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
        let mut rollouts = std::mem::take(&mut self.rollouts).into_iter().map(Some).collect::<Vec<_>>();
        self.rollouts = keep.iter().filter_map(|&k| rollouts[k].take()).collect();
        self.members = keep.iter().map(|&k| self.members[k].clone()).collect();
        self.clocks = keep.iter().map(|&k| self.clocks[k]).collect();
        self.coefs = Coefs::of(&self.members, &device)?;
        #[cfg(feature = "cuda")]
        {
            self.graph = None;
            self.fused = fused_for(&self.members, &device)?;
        }
        Ok(())
    }

    /// Everything a resume that goes on as if never stopped needs, between iterations,
    /// copied to host memory: the stacked weights, Adam moments, step counts and skip
    /// counters, the members' configs (a PBT explore's settings included), the accounts per
    /// member and the env-step, epoch and iteration counters (the rollouts are empty then).
    /// [`Self::load_state`] reads it; the environments' own state is the caller's.
    pub fn snapshot(&self) -> Result<crate::StateSnapshot> {
        const CTX: &str = "PpoPopulation::snapshot";
        let mut t = fx_precision::varmap_tensors(&self.params.varmap()?, "params.");
        self.opt.save_state(&mut t, "opt.");
        let c = PopCounters {
            version: POP_STATE_VERSION,
            num_envs: self.num_envs,
            env_steps: self.env_steps,
            epochs_done: self.epochs_done,
            iterations: self.iterations,
            members: self.members.clone(),
            clocks: self.clocks.clone(),
        };
        let mut meta = std::collections::HashMap::new();
        crate::state_meta::write(&mut meta, POP_STATE_KEY, &c, CTX)?;
        crate::StateSnapshot::new(t, meta, CTX)
    }

    /// A population restored from [`Self::snapshot`]'s file onto `device`: its next
    /// iteration is the one the saved population would have run (on the CPU bit for bit).
    /// Missing, unknown or mis-shaped tensors are errors naming the tensor and file.
    pub fn load_state(path: &std::path::Path, device: &Device) -> Result<Self> {
        const CTX: &str = "PpoPopulation::load_state";
        // Read to the host; each tensor moves to `device` as it is restored.
        let mut nt = fx_precision::load_tensors(path, &Device::Cpu).ctx(CTX)?;
        let c: PopCounters =
            crate::state_meta::read(&nt, path, POP_STATE_KEY, "a PPO population state", POP_STATE_VERSION, CTX)?;
        let Some(first) = c.members.first() else {
            return Err(Error::config(CTX, format!("{}: a population state of no member", path.display())));
        };
        let (t, e, n) = (first.num_steps, c.num_envs, c.members.len());
        let per = (fx_kernels::OBS_DIM as u64 + 5) * 4;
        crate::state_meta::check_buffer(path, &format!("{n} rollouts of {t} x {e}"), &[n, t, e], per, CTX)?;
        let mut me = Self::new(c.members, c.num_envs, device)
            .map_err(|e| Error::config(CTX, format!("{}: saved state: {e}", path.display())))?;
        nt.restore_varmap(&me.params.varmap()?, "params.").ctx(CTX)?;
        me.opt.load_state(&mut nt, "opt.").ctx(CTX)?;
        nt.finish().ctx(CTX)?;
        me.env_steps = c.env_steps;
        me.epochs_done = c.epochs_done;
        me.iterations = c.iterations;
        if !c.clocks.is_empty() {
            if c.clocks.len() != n {
                return Err(Error::config(
                    CTX,
                    format!("{}: {} clocks for {n} members", path.display(), c.clocks.len()),
                ));
            }
            if let Some(k) = c
                .clocks
                .iter()
                .position(|k| k.env_steps > c.env_steps || k.epochs > c.epochs_done || k.iterations > c.iterations)
            {
                return Err(Error::config(
                    CTX,
                    format!(
                        "{}: member {k}'s clock {:?} lies past the population's counters",
                        path.display(),
                        c.clocks[k]
                    ),
                ));
            }
            me.clocks = c.clocks;
        }
        Ok(me)
    }

    /// The stacked actor-critics (`[N, ...]` per parameter, actor then critic).
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Member `k`'s Adam moments `(exp_avg, exp_avg_sq)` in parameter order (copies).
    pub fn moments(&self, k: usize) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        self.opt.moments(k).map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// Per member: optimiser steps applied and skipped (one read).
    pub fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        self.opt.counters().map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// Each member's statistics of the last minibatch update (two reads).
    pub fn last_minibatch(&self) -> Result<Vec<PpoMinibatchStats>> {
        let last = self.opt.last_step_tensor().map_err(|e| Error::config(CTX, e.to_string()))?;
        self.stats_of(&last, &self.diag.as_tensor().copy().ctx(CTX)?)
    }

    /// Per-member statistics from a step's optimiser outcome `[3, N]` and diagnostics `[5, N]`.
    fn stats_of(&self, last: &Tensor, diag: &Tensor) -> Result<Vec<PpoMinibatchStats>> {
        let r = PopAdamW::report_of(last).map_err(|e| Error::config(CTX, e.to_string()))?;
        let d: Vec<Vec<f32>> = diag.to_vec2().ctx(CTX)?;
        Ok((0..self.len())
            .map(|k| PpoMinibatchStats {
                loss: r.loss[k],
                l_clip: f64::from(d[0][k]),
                l_v: f64::from(d[1][k]),
                entropy: f64::from(d[2][k]),
                approx_kl: f64::from(d[3][k]),
                clip_frac: f64::from(d[4][k]),
                grad_norm: r.grad_norm[k],
                skipped: r.skipped[k],
            })
            .collect())
    }

    /// One minibatch update of every member (see the module docs). Reads nothing back;
    /// [`Self::last_minibatch`] and [`Self::counters`] read the outcome. On CUDA, once
    /// [`Self::capture_update`] has run, the captured graph replays instead.
    pub fn update_minibatch(&mut self, batch: &PpoPopBatch) -> Result<()> {
        self.check_batch(batch)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.graph {
            for (dst, src) in g.inputs.tensors().into_iter().zip(batch.tensors()) {
                dst.slice_set(&src.to_dtype(dst.dtype()).ctx(CTX)?, 0, 0).ctx(CTX)?;
            }
            return g.graph.replay().ctx(CTX);
        }
        self.update_body(batch, false)
    }

    /// `(logits [N, E, A], values [N, E])` of every member on its environments' current
    /// states (no graph), as each solo learner's collection forward.
    fn act_forward(&self, envs: &[&mut dyn VecEnv]) -> Result<(Tensor, Tensor)> {
        let obs: Vec<Tensor> = envs.iter().map(|e| e.observe().ctx(CTX)).collect::<Result<_>>()?;
        let w: Vec<Tensor> = self.params.vars().iter().map(|v| v.as_tensor().detach()).collect();
        forward(&w, &Tensor::stack(&obs, 0).ctx(CTX)?, self.members[0].precision).ctx(CTX)
    }

    /// One iteration of every member, as [`crate::PpoTrainer::iterate`] runs it for one
    /// learner (`envs[k]` is member k's `num_envs` environments): a rollout of `num_steps`
    /// steps (one batched forward a step, each member's actions drawn by its environments
    /// and stored in its own rollout), each member's GAE with its own γ and λ, then
    /// `epochs` epochs of minibatch updates of all members together, member k's rows
    /// shuffled by member k's seed. Member k's weights, moments and statistics are its solo
    /// learner's on the CPU.
    pub fn iterate(&mut self, envs: &mut [&mut dyn VecEnv]) -> Result<Vec<PpoIterStats>> {
        let n_members = self.len();
        if envs.len() != n_members || envs.iter().any(|e| e.num_envs() != self.num_envs) {
            return Err(Error::config(
                CTX,
                format!("needs {n_members} environments of {} accounts, one per member", self.num_envs),
            ));
        }
        let first = self.members[0].clone();
        while !self.rollouts[0].is_full() {
            let (logits, values) = self.act_forward(envs)?;
            for (k, env) in envs.iter_mut().enumerate() {
                let (l, v) = (logits.get(k).ctx(CTX)?, values.get(k).ctx(CTX)?);
                env.step_into_rollout(&l, &v, &mut self.rollouts[k]).ctx(CTX)?;
            }
            self.env_steps += 1;
        }
        let (_, last_values) = self.act_forward(envs)?;
        let n = first.num_steps * self.num_envs;
        let flat = |t: &Tensor| t.flatten_to(1).ctx(CTX);
        let mut rows: Vec<[Tensor; 5]> = Vec::with_capacity(n_members);
        let mut rets = Vec::with_capacity(n_members);
        for (k, (m, r)) in self.members.iter().zip(&self.rollouts).enumerate() {
            let (adv, ret) = r.advantages(&last_values.get(k).ctx(CTX)?, m.gae).ctx(CTX)?;
            let obs = r.states().reshape((n, first.net.state_dim)).ctx(CTX)?;
            rows.push([obs, flat(r.actions())?, flat(r.log_probs())?, flat(&adv)?, flat(&ret)?]);
            rets.push(flat(&ret)?);
        }
        let mb = first.minibatch_size;
        let mut sums = vec![PpoMinibatchStats::default(); n_members];
        let mut counts = vec![0u32; n_members];
        let mut skipped = vec![0u32; n_members];
        let mut outcomes: Vec<(Tensor, Tensor)> = Vec::new();
        for _ in 0..first.epochs {
            let perms: Vec<Tensor> = self
                .members
                .iter()
                .zip(&self.clocks)
                .map(|(m, c)| {
                    let key = self.epochs_done - c.epochs;
                    Tensor::from_vec(permutation(n, m.seed, key), n, self.params.device()).ctx(CTX)
                })
                .collect::<Result<_>>()?;
            self.epochs_done += 1;
            for start in (0..n).step_by(mb) {
                let len = mb.min(n - start);
                if len < 2 {
                    continue;
                }
                let mut parts: [Vec<Tensor>; 5] = Default::default();
                for (k, fields) in rows.iter().enumerate() {
                    let idx = perms[k].narrow(0, start, len).ctx(CTX)?;
                    for (p, t) in parts.iter_mut().zip(fields) {
                        p.push(t.index_select(&idx, 0).ctx(CTX)?);
                    }
                }
                let [obs, actions, logp, adv, ret] = parts.map(|p| Tensor::stack(&p, 0).ctx(CTX));
                let batch = PpoPopBatch {
                    obs: obs?,
                    actions: actions?.to_dtype(DType::U32).ctx(CTX)?,
                    logp_old: logp?,
                    advantages: adv?,
                    returns: ret?,
                };
                self.update_minibatch(&batch)?;
                // Device copies, read once after the epochs: no host wait per minibatch.
                let last = self.opt.last_step_tensor().map_err(|e| Error::config(CTX, e.to_string()))?;
                outcomes.push((last, self.diag.as_tensor().copy().ctx(CTX)?));
            }
        }
        for (last, diag) in &outcomes {
            for (k, st) in self.stats_of(last, diag)?.into_iter().enumerate() {
                if st.skipped {
                    skipped[k] += 1;
                } else {
                    sums[k].add(&st);
                    counts[k] += 1;
                }
            }
        }
        self.iterations += 1;
        let mut out = Vec::with_capacity(n_members);
        for (k, r) in self.rollouts.iter_mut().enumerate() {
            let sums_dev = Tensor::stack(&[r.rewards(), r.dones()], 0)
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.flatten_from(1))
                .and_then(|t| t.sum(1))
                .and_then(|t| t.to_vec1::<f64>())
                .ctx(CTX)?;
            let vec =
                |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>());
            let ev = explained_variance_of(&vec(r.values()).ctx(CTX)?, &vec(&rets[k]).ctx(CTX)?);
            let c = &self.clocks[k];
            out.push(PpoIterStats {
                iteration: self.iterations - c.iterations,
                env_steps: self.env_steps - c.env_steps,
                mean_reward: sums_dev[0] / n as f64,
                episodes_done: sums_dev[1] as u32,
                mean: sums[k].scaled(1.0 / counts[k].max(1) as f64),
                skipped: skipped[k],
                explained_variance: ev,
            });
            r.clear();
        }
        Ok(out)
    }

    fn check_batch(&self, batch: &PpoPopBatch) -> Result<()> {
        let (n, s) = (self.len(), self.members[0].net.state_dim);
        let b = batch.obs.dims().get(1).copied().unwrap_or(0);
        if b < 2 {
            return Err(Error::shape("obs", CTX, "[N, B >= 2, S]", format!("{:?}", batch.obs.dims())));
        }
        for (what, t, want) in [
            ("obs", &batch.obs, vec![n, b, s]),
            ("actions", &batch.actions, vec![n, b]),
            ("logp_old", &batch.logp_old, vec![n, b]),
            ("advantages", &batch.advantages, vec![n, b]),
            ("returns", &batch.returns, vec![n, b]),
        ] {
            if t.dims() != want.as_slice() {
                return Err(Error::shape(what, CTX, format!("{want:?}"), format!("{:?}", t.dims())));
            }
        }
        if batch.actions.dtype() != DType::U32 {
            return Err(Error::config(CTX, format!("actions must be U32, got {:?}", batch.actions.dtype())));
        }
        Ok(())
    }

    /// The update; a `dry` run computes everything and writes nothing (graph warm-up). On
    /// CUDA at the configured minibatch size the loss and gradients come from the
    /// member-batched fused kernels ([`crate::ppo::pop_fused`]), else from candle's ops.
    fn update_body(&self, batch: &PpoPopBatch, dry: bool) -> Result<()> {
        let cfg = &self.members[0];
        let vars = self.params.vars();
        let w: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        #[cfg(feature = "cuda")]
        if let Some(engine) = self.fused.as_ref().filter(|e| batch.obs.dims().get(1) == Some(&e.batch())) {
            engine.run(&w, batch)?;
            // Both reads run in a dry step too: a captured graph may only use the ops its
            // warm-up ran.
            let (loss, diag) = (engine.loss()?, engine.diagnostics()?);
            self.opt.step(&vars, &[], &loss, engine.grads(), dry).map_err(|e| Error::config(CTX, e.to_string()))?;
            if !dry {
                self.diag.set(&diag).ctx(CTX)?;
            }
            return Ok(());
        }
        let (loss, diag) = pop_loss(&w, batch, &self.coefs, cfg.loss.adv_eps, cfg.precision).ctx(CTX)?;
        let grads = loss.sum_all().and_then(|l| l.backward()).ctx(CTX)?;
        let g: Vec<Tensor> = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).cloned().ok_or_else(|| Error::config(CTX, "a parameter has no gradient")))
            .collect::<Result<_>>()?;
        self.opt.step(&vars, &[], &loss, &g, dry).map_err(|e| Error::config(CTX, e.to_string()))?;
        if !dry {
            self.diag.set(&diag).ctx(CTX)?;
        }
        Ok(())
    }

    /// Captures [`Self::update_minibatch`] as one CUDA graph at `example`'s minibatch size
    /// (CUDA only); later updates copy their minibatch into the graph's inputs and replay it.
    #[cfg(feature = "cuda")]
    pub fn capture_update(&mut self, example: &PpoPopBatch) -> Result<()> {
        self.check_batch(example)?;
        self.graph = None;
        let copy = |t: &Tensor| t.copy().ctx(CTX);
        let inputs = PpoPopBatch {
            obs: copy(&example.obs)?,
            actions: copy(&example.actions)?,
            logp_old: copy(&example.logp_old)?,
            advantages: copy(&example.advantages)?,
            returns: copy(&example.returns)?,
        };
        let dev = self.params.device().clone();
        let graph = fx_precision::CapturedGraph::capture(&dev, 2, |dry| {
            self.update_body(&inputs, dry)
                .map_err(|e| fx_precision::Error::Config { what: "PpoPopulation update", message: e.to_string() })
        })
        .ctx(CTX)?;
        self.graph = Some(CapturedUpdate { graph, inputs });
        Ok(())
    }

    /// Launches per captured update (graph nodes); None before [`Self::capture_update`].
    #[cfg(feature = "cuda")]
    pub fn graph_nodes(&self) -> Result<Option<usize>> {
        self.graph.as_ref().map(|g| g.graph.node_count().ctx(CTX)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ppo::trainer::PpoTrainer;
    use crate::ppo::PpoBatch;

    fn member(k: usize) -> PpoConfig {
        let mut c = PpoConfig { seed: 5 + 11 * k as u64, minibatch_size: 32, num_steps: 16, ..Default::default() };
        c.net.hidden = 24;
        c.optimizer.lr = 3e-4 * (1.0 + k as f64);
        c.loss.clip = 0.1 + 0.05 * k as f64;
        c.loss.vf_coef = 0.25 + 0.25 * k as f64;
        c.loss.ent_coef = 0.01 * k as f64;
        // Member 2 clips hard (most of its steps are clipped).
        c.max_grad_norm = if k == 2 { 0.01 } else { 0.5 };
        c
    }

    /// Minibatch `step` of member k: uniform states, actions, old log-probabilities near
    /// ln(1/3), advantages and returns (one stream per member and field).
    fn batch(n: usize, b: usize, step: u64) -> PpoPopBatch {
        let v = |len: usize, field: u64| -> Vec<f32> {
            (0..len as u64).map(|i| (fx_kernels::rng::draw(77 + field, step, 0, i) * 2.0 - 1.0) as f32).collect()
        };
        let t = |x: Vec<f32>, shape: &[usize]| Tensor::from_vec(x, shape, &Device::Cpu).unwrap();
        let actions: Vec<u32> = v(n * b, 1).iter().map(|u| ((u + 1.0) * 1.5) as u32 % 3).collect();
        let logp: Vec<f32> = v(n * b, 2).iter().map(|u| (1.0f32 / 3.0).ln() + 0.3 * u).collect();
        PpoPopBatch {
            obs: t(v(n * b * 56, 0), &[n, b, 56]),
            actions: Tensor::from_vec(actions, (n, b), &Device::Cpu).unwrap(),
            logp_old: t(logp, &[n, b]),
            advantages: t(v(n * b, 3).iter().map(|u| 2.0 * u).collect(), &[n, b]),
            returns: t(v(n * b, 4), &[n, b]),
        }
    }

    /// Members 0, 2 and 4 of a population of 5 (seeds, learning rates, clip ranges, value and
    /// entropy weights and clip norms all different) are their solo learners over 40
    /// minibatch updates on the CPU: the same weights, Adam moments, step counts and
    /// minibatch statistics, bit for bit. A NaN in member 1's advantages at update 7 skips
    /// that member's step and no other's.
    #[test]
    fn members_are_their_solo_learners_on_cpu() {
        let n = 5;
        let cfgs: Vec<PpoConfig> = (0..n).map(member).collect();
        let mut pop = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let watched = [0usize, 2, 4];
        let mut solos: Vec<PpoTrainer> =
            watched.iter().map(|&k| PpoTrainer::new(cfgs[k].clone(), 4, &Device::Cpu).unwrap()).collect();
        for (j, &k) in watched.iter().enumerate() {
            for (a, b) in solos[j].model().params().vars().iter().zip(pop.params().vars()) {
                assert_eq!(
                    a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    b.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "member {k}'s initial weights"
                );
            }
        }
        let mut clipped = 0;
        for step in 0..40u64 {
            let mut bt = batch(n, 32, step);
            if step == 7 {
                let mut a: Vec<Vec<f32>> = bt.advantages.to_vec2().unwrap();
                a[1][5] = f32::NAN;
                bt.advantages = Tensor::new(a, &Device::Cpu).unwrap();
            }
            pop.update_minibatch(&bt).unwrap();
            let stats = pop.last_minibatch().unwrap();
            assert_eq!(stats[1].skipped, step == 7, "member 1 skips update 7 only");
            clipped += usize::from(stats[2].grad_norm > 0.01);
            for (j, &k) in watched.iter().enumerate() {
                let g = |t: &Tensor| t.get(k).unwrap();
                let (obs, actions, logp, adv, ret) =
                    (g(&bt.obs), g(&bt.actions), g(&bt.logp_old), g(&bt.advantages), g(&bt.returns));
                let solo = solos[j]
                    .update_minibatch(PpoBatch {
                        obs: &obs,
                        actions: &actions,
                        logp_old: &logp,
                        advantages: &adv,
                        returns: &ret,
                    })
                    .unwrap();
                let p = stats[k];
                assert_eq!(
                    (solo.loss, solo.grad_norm, solo.skipped),
                    (p.loss, p.grad_norm, p.skipped),
                    "member {k} update {step}: loss, gradient norm, skip"
                );
                assert_eq!(
                    [solo.l_clip, solo.l_v, solo.entropy, solo.approx_kl, solo.clip_frac],
                    [p.l_clip, p.l_v, p.entropy, p.approx_kl, p.clip_frac],
                    "member {k} update {step}: diagnostics"
                );
            }
        }
        assert!(clipped > 30, "member 2 must be clipped on most updates, was on {clipped}");
        let (applied, skipped) = pop.counters().unwrap();
        assert_eq!(applied, vec![40, 39, 40, 40, 40]);
        assert_eq!(skipped, vec![0, 1, 0, 0, 0]);
        for (j, &k) in watched.iter().enumerate() {
            for (i, (a, b)) in solos[j].model().params().vars().iter().zip(pop.params().vars()).enumerate() {
                assert_eq!(
                    a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    b.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "member {k} tensor {i} after 40 updates"
                );
            }
        }
    }

    /// Successive halving's cut: members 0 and 2 of a population of 3, kept after 2
    /// iterations and trained 2 more, are bit for bit the population of those two trained
    /// for 4 (iteration statistics, weights, moments, counters), which is their solo
    /// learners (below). A bad cut is refused.
    #[test]
    fn retained_members_go_on_as_their_own_population() {
        let cfgs: Vec<PpoConfig> = (0..3)
            .map(|k| {
                let mut c = member(k);
                (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 12);
                c.gae.gamma = 0.9 + 0.04 * k as f64;
                c
            })
            .collect();
        let env = |k: usize| crate::synthetic::ar1_env(4, 16, 300, 30 + k as u64);
        let run = |pop: &mut PpoPopulation, envs: &mut [fx_kernels::CpuTradingEnv], iterations: usize| {
            let mut last = Vec::new();
            for _ in 0..iterations {
                let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
                last = pop.iterate(&mut refs).unwrap();
            }
            last
        };
        let keep = [0usize, 2];
        let mut a = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let mut a_envs: Vec<_> = (0..3).map(env).collect();
        run(&mut a, &mut a_envs, 2);
        assert!(a.retain_members(&[2, 0]).is_err());
        a.retain_members(&keep).unwrap();
        let mut a_envs: Vec<_> =
            a_envs.into_iter().enumerate().filter(|(k, _)| keep.contains(k)).map(|(_, e)| e).collect();
        let sa = run(&mut a, &mut a_envs, 2);
        let mut b = PpoPopulation::new(keep.iter().map(|&k| cfgs[k].clone()).collect(), 4, &Device::Cpu).unwrap();
        let mut b_envs: Vec<_> = keep.iter().map(|&k| env(k)).collect();
        let sb = run(&mut b, &mut b_envs, 4);
        assert_eq!(sa, sb, "the last iteration's statistics");
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for (i, (x, y)) in a.params().vars().iter().zip(b.params().vars()).enumerate() {
            assert_eq!(
                x.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "tensor {i}"
            );
        }
        for k in 0..2 {
            let ((ma, va), (mb, vb)) = (a.moments(k).unwrap(), b.moments(k).unwrap());
            for (x, y) in ma.iter().chain(&va).zip(mb.iter().chain(&vb)) {
                assert_eq!(
                    x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "member {k} moments"
                );
            }
        }
    }

    /// A population saved between iterations (a PBT explore applied) and restored with its
    /// environments' states goes on as the one that never stopped, bit for bit on the CPU:
    /// iteration statistics, weights, moments and counters. A solo learner's file is refused.
    #[test]
    fn a_restored_population_goes_on_as_the_uninterrupted_one() {
        let dir = tempfile::tempdir().unwrap();
        let cfgs: Vec<PpoConfig> = (0..3)
            .map(|k| {
                let mut c = member(k);
                (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 12);
                c
            })
            .collect();
        let env = |k: usize| crate::synthetic::ar1_env(4, 16, 300, 30 + k as u64);
        let run = |pop: &mut PpoPopulation, envs: &mut [fx_kernels::CpuTradingEnv]| {
            let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            pop.iterate(&mut refs).unwrap()
        };
        let mut a = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let mut a_envs: Vec<_> = (0..3).map(env).collect();
        run(&mut a, &mut a_envs);
        let mut explored = cfgs[2].clone();
        explored.loss.ent_coef = 0.05;
        a.set_member(2, explored).unwrap();
        run(&mut a, &mut a_envs);
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        let mut b = PpoPopulation::load_state(&path, &Device::Cpu).unwrap();
        assert_eq!(b.members()[2].loss.ent_coef, 0.05, "the explored settings travel");
        let mut b_envs: Vec<_> = (0..3).map(env).collect();
        for (eb, ea) in b_envs.iter_mut().zip(&a_envs) {
            eb.restore(&ea.state()).unwrap();
        }
        for _ in 0..2 {
            assert_eq!(run(&mut a, &mut a_envs), run(&mut b, &mut b_envs));
        }
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.params().vars().iter().zip(b.params().vars()) {
            assert_eq!(flat(x.as_tensor()), flat(y.as_tensor()));
        }
        for k in 0..3 {
            let ((ma, va), (mb, vb)) = (a.moments(k).unwrap(), b.moments(k).unwrap());
            for (x, y) in ma.iter().chain(&va).zip(mb.iter().chain(&vb)) {
                assert_eq!(flat(x), flat(y), "member {k} moments");
            }
        }
        let solo = dir.path().join("solo.safetensors");
        PpoTrainer::new(cfgs[0].clone(), 4, &Device::Cpu).unwrap().save_state(&solo).unwrap();
        let e = PpoPopulation::load_state(&solo, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("solo.safetensors") && e.contains("not a PPO population state"), "{e}");
    }

    /// On CUDA with GPU envs, a member that starts over after 2 iterations (new settings,
    /// seed and environments): its counters count from its start and it takes as many steps
    /// as its solo learner on the GPU, its weights within 1e-4 relative of that learner's
    /// after 3 iterations (population and solo kernels batch differently); the other members
    /// are the population's that never replaced one (the same rewards, weights within 1e-6).
    #[cfg(feature = "cuda")]
    #[test]
    fn a_member_that_starts_over_trains_as_its_solo_learner_on_the_gpu() {
        let Some(dev) =
            fx_hw::test_gpu("ppo::population::a_member_that_starts_over_trains_as_its_solo_learner_on_the_gpu")
        else {
            return;
        };
        let cfg = |k: usize| {
            let mut c = member(k);
            (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 16);
            c
        };
        let cfgs: Vec<PpoConfig> = (0..3).map(cfg).collect();
        let envs = || -> Vec<fx_kernels::GpuTradingEnv> {
            (0..3).map(|k| crate::synthetic::ar1_gpu_env(4, 16, 300, 30 + k as u64, &dev)).collect()
        };
        let run = |pop: &mut PpoPopulation, envs: &mut [fx_kernels::GpuTradingEnv]| {
            let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            pop.iterate(&mut refs).unwrap()
        };
        let (mut a, mut b) =
            (PpoPopulation::new(cfgs.clone(), 4, &dev).unwrap(), PpoPopulation::new(cfgs, 4, &dev).unwrap());
        let (mut ea, mut eb) = (envs(), envs());
        for _ in 0..2 {
            run(&mut a, &mut ea);
            run(&mut b, &mut eb);
        }
        let new = PpoConfig { seed: 4321, ..cfg(5) };
        a.replace_member(1, new.clone()).unwrap();
        ea[1] = crate::synthetic::ar1_gpu_env(4, 16, 300, 99, &dev);
        let mut solo = PpoTrainer::new(new, 4, &dev).unwrap();
        let mut solo_env = crate::synthetic::ar1_gpu_env(4, 16, 300, 99, &dev);
        for i in 0..3 {
            let (x, y) = (run(&mut a, &mut ea), run(&mut b, &mut eb));
            let s = solo.iterate(&mut solo_env).unwrap();
            assert_eq!((x[1].iteration, x[1].env_steps, x[1].skipped), (s.iteration, s.env_steps, s.skipped), "{i}");
            for k in [0, 2] {
                assert_eq!((x[k].mean_reward, x[k].episodes_done), (y[k].mean_reward, y[k].episodes_done), "{i} {k}");
            }
        }
        // Its optimiser steps are 3 iterations' worth, the unreplaced member's 5.
        let (na, nb) = (a.counters().unwrap().0[1], b.counters().unwrap().0[1]);
        assert!(na > 0 && 5 * na == 3 * nb, "{na} steps against {nb}");
        let rel = |x: &Tensor, y: &Tensor| -> f64 {
            let d = (x - y).unwrap().sqr().unwrap().sum_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
            let n = y.sqr().unwrap().sum_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
            f64::from(d) / f64::from(n).max(1e-30)
        };
        for (i, (p, s)) in a.params().vars().iter().zip(solo.model().params().vars()).enumerate() {
            let e = rel(&p.as_tensor().get(1).unwrap(), s.as_tensor());
            eprintln!("started over vs solo tensor {i}: rel err {e:.2e}");
            assert!(e <= 1e-4, "the new member's tensor {i}: rel err {e}");
        }
        for k in [0, 2] {
            for (i, (x, y)) in a.params().vars().iter().zip(b.params().vars()).enumerate() {
                let e = rel(&x.as_tensor().get(k).unwrap(), &y.as_tensor().get(k).unwrap());
                assert!(e <= 1e-6, "member {k} tensor {i}: rel err {e}");
            }
        }
    }

    /// On CUDA with GPU envs, a population saved between iterations and restored with its
    /// environments' states goes on as the one that never stopped: the same iteration
    /// rewards, episodes and skips, counters and env states, and weights within 1e-6
    /// relative (the same kernels; the bound allows for a reduction in another order).
    #[cfg(feature = "cuda")]
    #[test]
    fn a_restored_population_goes_on_on_the_gpu() {
        let Some(dev) = fx_hw::test_gpu("ppo::population::a_restored_population_goes_on_on_the_gpu") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let cfgs: Vec<PpoConfig> = (0..3)
            .map(|k| {
                let mut c = member(k);
                (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 16);
                c
            })
            .collect();
        let envs = || -> Vec<fx_kernels::GpuTradingEnv> {
            (0..3).map(|k| crate::synthetic::ar1_gpu_env(4, 16, 300, 30 + k as u64, &dev)).collect()
        };
        let run = |pop: &mut PpoPopulation, envs: &mut [fx_kernels::GpuTradingEnv]| {
            let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            pop.iterate(&mut refs).unwrap()
        };
        let mut a = PpoPopulation::new(cfgs, 4, &dev).unwrap();
        let mut a_envs = envs();
        for _ in 0..3 {
            run(&mut a, &mut a_envs);
        }
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        let mut b = PpoPopulation::load_state(&path, &dev).unwrap();
        let mut b_envs = envs();
        for (eb, ea) in b_envs.iter_mut().zip(&a_envs) {
            eb.restore(&ea.state().unwrap()).unwrap();
        }
        for i in 0..3 {
            let (x, y) = (run(&mut a, &mut a_envs), run(&mut b, &mut b_envs));
            for (k, (u, v)) in x.iter().zip(&y).enumerate() {
                assert_eq!((u.env_steps, u.iteration, u.skipped), (v.env_steps, v.iteration, v.skipped));
                assert_eq!(
                    (u.mean_reward, u.episodes_done),
                    (v.mean_reward, v.episodes_done),
                    "iteration {i} member {k}"
                );
            }
        }
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for k in 0..3 {
            assert_eq!(a_envs[k].state().unwrap(), b_envs[k].state().unwrap(), "member {k} env state");
        }
        for (i, (x, y)) in a.params().vars().iter().zip(b.params().vars()).enumerate() {
            let d = (x.as_tensor() - y.as_tensor()).unwrap().sqr().unwrap().sum_all().unwrap().sqrt().unwrap();
            let n = x.as_tensor().sqr().unwrap().sum_all().unwrap().sqrt().unwrap();
            let e = d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap().max(1e-30);
            eprintln!("restored vs uninterrupted tensor {i}: rel err {e:.2e}");
            assert!(e <= 1e-6, "tensor {i}: rel err {e}");
        }
    }

    /// Whole iterations: members 0 and 2 of a population of 3 (seeds, learning rates, clip
    /// ranges, loss weights, GAE γ and λ all different) are their solo learners'
    /// `iterate` over 3 iterations on the CPU: the same weights after each, the same
    /// iteration statistics (rewards, episodes, minibatch means, explained variance).
    #[test]
    fn whole_iterations_are_the_solo_learners_on_cpu() {
        let n = 3;
        let cfgs: Vec<PpoConfig> = (0..n)
            .map(|k| {
                let mut c = member(k);
                (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 12);
                c.gae.gamma = 0.9 + 0.04 * k as f64;
                c.gae.lambda = 0.8 + 0.07 * k as f64;
                c
            })
            .collect();
        let mut pop = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let mut envs: Vec<_> = (0..n).map(|k| crate::synthetic::ar1_env(4, 16, 300, 30 + k as u64)).collect();
        let watched = [0usize, 2];
        let mut solos: Vec<PpoTrainer> =
            watched.iter().map(|&k| PpoTrainer::new(cfgs[k].clone(), 4, &Device::Cpu).unwrap()).collect();
        let mut solo_envs: Vec<_> =
            watched.iter().map(|&k| crate::synthetic::ar1_env(4, 16, 300, 30 + k as u64)).collect();
        for it in 0..3 {
            let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            let stats = pop.iterate(&mut refs).unwrap();
            for (j, &k) in watched.iter().enumerate() {
                let solo = solos[j].iterate(&mut solo_envs[j]).unwrap();
                assert_eq!(stats[k], solo, "member {k} iteration {it}");
                for (i, (a, b)) in solos[j].model().params().vars().iter().zip(pop.params().vars()).enumerate() {
                    assert_eq!(
                        a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        b.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "member {k} tensor {i} after iteration {it}"
                    );
                }
            }
        }
    }

    /// A member that starts over after 2 iterations (a new trial in a freed slot: another
    /// seed, learning rate, clip, loss weights and GAE) is from then on the solo learner of
    /// its config, bit for bit on the CPU over 3 iterations: the same statistics (its own
    /// iteration and env-step counts), weights and moments; the others are the population's
    /// that never replaced one; its clock travels with a saved state; a changed shared key
    /// is refused.
    #[test]
    fn a_member_that_starts_over_is_the_solo_learner_of_its_config() {
        let n = 3;
        let cfg = |k: usize| {
            let mut c = member(k);
            (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 12);
            c.gae.gamma = 0.9 + 0.015 * k as f64;
            c
        };
        let cfgs: Vec<PpoConfig> = (0..n).map(cfg).collect();
        let envs = || (0..n).map(|k| crate::synthetic::ar1_env(4, 16, 300, 30 + k as u64)).collect::<Vec<_>>();
        let mut a = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let mut b = PpoPopulation::new(cfgs.clone(), 4, &Device::Cpu).unwrap();
        let (mut ea, mut eb) = (envs(), envs());
        let it = |p: &mut PpoPopulation, e: &mut [fx_kernels::CpuTradingEnv]| {
            let mut refs: Vec<&mut dyn VecEnv> = e.iter_mut().map(|x| x as &mut dyn VecEnv).collect();
            p.iterate(&mut refs).unwrap()
        };
        for _ in 0..2 {
            assert_eq!(it(&mut a, &mut ea), it(&mut b, &mut eb));
        }
        let new = PpoConfig { seed: 4321, ..cfg(5) };
        assert!(a.replace_member(1, PpoConfig { epochs: 3, ..new.clone() }).is_err(), "a shared key");
        a.replace_member(1, new.clone()).unwrap();
        assert_eq!(a.member_env_steps(1), Some(0));
        ea[1] = crate::synthetic::ar1_env(4, 16, 300, 99);
        let mut solo = PpoTrainer::new(new, 4, &Device::Cpu).unwrap();
        let mut solo_env = crate::synthetic::ar1_env(4, 16, 300, 99);
        for i in 0..3 {
            let (x, y) = (it(&mut a, &mut ea), it(&mut b, &mut eb));
            assert_eq!(x[1], solo.iterate(&mut solo_env).unwrap(), "the new member at its iteration {i}");
            assert_eq!((&x[0], &x[2]), (&y[0], &y[2]), "the others at iteration {i}");
        }
        for (i, (s, p)) in solo.model().params().vars().iter().zip(a.params().vars()).enumerate() {
            assert_eq!(
                s.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                p.as_tensor().get(1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "the new member's tensor {i}"
            );
        }
        for k in [0, 2] {
            for (x, y) in a.params().vars().iter().zip(b.params().vars()) {
                assert_eq!(
                    x.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    y.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "member {k}"
                );
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        assert_eq!(PpoPopulation::load_state(&path, &Device::Cpu).unwrap().clocks, a.clocks);
    }

    /// PBT's moves: `set_member` before training gives the population that was built with
    /// the new settings (every per-member value is written: learning rate, clip norm, clip
    /// range, loss weights, GAE), bit for bit over 2 iterations; `exploit` copies weights,
    /// moments and step count exactly and training goes on; a changed shared key or seed is
    /// refused.
    #[test]
    fn set_member_and_exploit_move_one_member() {
        let base: Vec<PpoConfig> = (0..3)
            .map(|k| {
                let mut c = member(k);
                (c.num_steps, c.epochs, c.minibatch_size) = (8, 2, 12);
                c
            })
            .collect();
        let mut moved = base[1].clone();
        moved.optimizer.lr *= 3.0;
        moved.max_grad_norm = 0.2;
        (moved.loss.clip, moved.loss.vf_coef, moved.loss.ent_coef) = (0.3, 0.9, 0.05);
        (moved.gae.gamma, moved.gae.lambda) = (0.93, 0.7);
        let mut want_cfgs = base.clone();
        want_cfgs[1] = moved.clone();
        let envs = || (0..3).map(|k| crate::synthetic::ar1_env(4, 16, 300, 40 + k as u64)).collect::<Vec<_>>();
        let (mut a, mut b) = (
            PpoPopulation::new(base.clone(), 4, &Device::Cpu).unwrap(),
            PpoPopulation::new(want_cfgs, 4, &Device::Cpu).unwrap(),
        );
        a.set_member(1, moved.clone()).unwrap();
        let (mut ea, mut eb) = (envs(), envs());
        let flat = |p: &PpoPopulation, k: usize| -> Vec<Vec<f32>> {
            p.params()
                .vars()
                .iter()
                .map(|v| v.as_tensor().get(k).unwrap().flatten_all().unwrap().to_vec1().unwrap())
                .collect()
        };
        for _ in 0..2 {
            let mut ra: Vec<&mut dyn VecEnv> = ea.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            let mut rb: Vec<&mut dyn VecEnv> = eb.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            assert_eq!(a.iterate(&mut ra).unwrap(), b.iterate(&mut rb).unwrap());
        }
        assert_eq!(flat(&a, 1), flat(&b, 1));
        a.exploit(2, 0).unwrap();
        assert_eq!(flat(&a, 2), flat(&a, 0));
        let (m0, m2) = (a.moments(0).unwrap(), a.moments(2).unwrap());
        for (x, y) in m0.0.iter().chain(&m0.1).zip(m2.0.iter().chain(&m2.1)) {
            assert_eq!(
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
        let mut ra: Vec<&mut dyn VecEnv> = ea.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
        a.iterate(&mut ra).unwrap();
        assert_ne!(flat(&a, 2), flat(&a, 0), "members 0 and 2 train on their own rollouts after the copy");
        let e = a.set_member(0, PpoConfig { epochs: 3, ..base[0].clone() }).unwrap_err().to_string();
        assert!(e.contains("only optimizer.lr"), "{e}");
        assert!(a.set_member(0, PpoConfig { seed: 999, ..base[0].clone() }).is_err());
        assert!(a.exploit(3, 0).is_err());
    }

    /// Shape keys must agree, weight decay and F16 are refused, each with a named error.
    #[test]
    fn members_must_share_shape_keys() {
        let a = member(0);
        let e = PpoPopulation::new(vec![a.clone(), PpoConfig { epochs: 2, ..a.clone() }], 4, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("member 1 differs"), "{e}");
        let mut wd = a.clone();
        wd.optimizer.weight_decay = 0.1;
        let e = PpoPopulation::new(vec![a.clone(), wd], 4, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("weight_decay"), "{e}");
        let f16 = PpoConfig { precision: Precision::F16, ..a };
        let e = PpoPopulation::new(vec![f16], 4, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("F16"), "{e}");
        assert!(PpoPopulation::new(Vec::new(), 4, &Device::Cpu).is_err());
    }
}
