//! DQN populations: N members of one network shape trained together, each a whole DQN run
//! of its own (its seed, environments, replay buffer, hyperparameters, optimiser state,
//! guard and counters), every step of all members as one batched computation.
//!
//! Layout: the online and target networks are one [`ParamStore`] each whose tensors are
//! stacked `[N, ...]` (member `k`'s slice starts as a solo run with its seed starts); AdamW's
//! moments and step counts are stacked the same way. The forward and backward passes are
//! batched matmuls over the member axis: candle's ops on the CPU, and on CUDA the solo fused
//! update's kernels batched over members (`pop_fused`: strided-batched cuBLAS GEMMs and
//! member-indexed kernels, ~30 launches whatever N), followed by member-batched optimiser
//! kernels. Everything a
//! member may set differently lives in device tensors of length N (`[N]` γ, τ, learning rate,
//! weight decay, clip norm), and every decision of the step is taken on the device: which
//! members' loss or gradients are non-finite (those skip their own step, weights, moments,
//! step count and target untouched), the clip factor, the bias corrections (looked up by each
//! member's own step count in tables computed once with the solo optimiser's arithmetic). So
//! the update reads nothing back and runs unchanged inside a CUDA graph
//! ([`DqnPopulation::capture_update`]).
//!
//! Collection: on CUDA, when every member's env is a [`fx_kernels::GpuTradingEnv`],
//! [`DqnPopulation::step`] observes, steps (ε-greedy on the batched Q forward, each member's ε
//! from its own ramp) and writes every member's replay in one launch each
//! (`fx_kernels::cuda::PopDqnCollect`), and draws all members' minibatches in one launch,
//! straight into the captured update's inputs; a launch per member otherwise. The kernels are
//! the solo ones batched, so the two paths store the same transitions bit for bit.
//!
//! Whole iterations (opt-in, `FX_POP_ITERATION_GRAPH=1`): on that path a step may replay one
//! CUDA graph of the collection, the loop counters' advance and, on steps with an update
//! round, each minibatch's draw for all members followed by the update. The members' rings
//! move in step and their draws share one key (each member's clock in the collector's table
//! makes them its own), so one `DqnLoop` block serves every member (`dqn::iteration`'s
//! `LoopGraphs`, as the solo trainer's iteration). The host mirrors the counters and uploads
//! them only when the two could differ; the graph holds the kernels the stepwise path
//! launches, so both train identically (device test
//! `the_iteration_graph_trains_as_the_stepwise_population`).
//!
//! Member `k` of a population is the solo [`DqnTrainer`](crate::DqnTrainer) run with member
//! `k`'s config: every operation is the solo one, batched over a leading axis, in the same
//! order, so on the CPU the weights, moments, replay contents and statistics are the same
//! values (the tests compare them over 200 updates). What members may differ in is
//! [`DqnPopulation::new`]'s list; shape keys (network, batch, replay, schedule of updates,
//! precision, Adam's betas and eps, Huber δ) must agree.
//!
//! A member may start over as a new run between steps ([`DqnPopulation::replace_member`]: a
//! sweep's freed slot taking the next trial). It keeps its own clocks
//! ([`fx_kernels::MemberClock`]: the env step, ring slot and draw count it began at), so its
//! ε ramp, its window of its replay ring, its draws and its update schedule are the solo
//! run's from its start, and the optimiser leaves it out of the update rounds (its active
//! flag) until its own transitions reach `learning_starts`; members from the start have zero
//! clocks, which is the plain population.

use candle_core::{DType, Device, Tensor, Var, D};
use fx_kernels::{MemberClock, ReplayBuffer, RingWindow, VecEnv};
use fx_precision::{PopAdamW, PopMember, Precision};
use serde::{Deserialize, Serialize};

use crate::dqn::trainer::DqnConfig;
use crate::error::{Context, Error, Result};
use crate::linear::linear_members;
use crate::params::ParamStore;

const CTX: &str = "DqnPopulation";

/// What one population update did, per member (read back on request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PopUpdateStats {
    /// Each member's loss before the step.
    pub loss: Vec<f64>,
    /// Each member's global gradient norm before clipping.
    pub grad_norm: Vec<f64>,
    /// Members whose non-finite loss or gradient made them skip this step.
    pub skipped: Vec<bool>,
}

/// What one population environment step (and any updates it ran) did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PopStepStats {
    /// Environment steps taken so far (every member takes them together).
    pub env_steps: u64,
    /// Each member's ε for this step.
    pub epsilon: Vec<f64>,
    /// Each member's mean reward over its accounts (None: not read back).
    pub mean_reward: Option<Vec<f64>>,
    /// Each member's finished episodes in this step (None: not read back).
    pub episodes_done: Option<Vec<u32>>,
    /// Transitions in each member's replay buffer (the same for all).
    pub replay_len: usize,
    /// The updates of this step whose statistics were read: all of them when reading
    /// stepwise; a whole-iteration graph's round reads its last (the others count as queued).
    pub updates: Vec<PopUpdateStats>,
    /// Updates of this step run without a read.
    pub updates_queued: u32,
}

/// One population minibatch, every tensor stacked over members: `obs [N, B, S]`,
/// `actions [N, B]` (U32), `rewards [N, B]`, `next_obs [N, B, S]`, `dones [N, B]`.
#[derive(Debug, Clone)]
pub struct PopBatch {
    /// States the actions were taken in.
    pub obs: Tensor,
    /// Actions taken.
    pub actions: Tensor,
    /// Rewards received.
    pub rewards: Tensor,
    /// States after the step (pre-reset).
    pub next_obs: Tensor,
    /// 1 where the transition ended its episode.
    pub dones: Tensor,
}

impl PopBatch {
    #[cfg(feature = "cuda")]
    fn tensors(&self) -> [&Tensor; 5] {
        [&self.obs, &self.actions, &self.rewards, &self.next_obs, &self.dones]
    }
}

/// Metadata key and layout version of a population's state file.
const POP_STATE_KEY: &str = "fx.dqn_population";
const POP_STATE_VERSION: u32 = 1;

/// Counters and configs saved with a population's state (JSON in its metadata).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PopCounters {
    version: u32,
    env_steps: u64,
    sampled: u64,
    /// Each member's replay length and ring position.
    replays: Vec<(usize, usize)>,
    members: Vec<DqnConfig>,
    /// Each member's clock, transitions of its own and whether it learns (absent in states
    /// written before members could start over: every member from the start).
    #[serde(default)]
    clocks: Vec<MemberClock>,
    #[serde(default)]
    own: Vec<usize>,
    #[serde(default)]
    learning: Vec<bool>,
}

impl crate::state_meta::Versioned for PopCounters {
    fn version(&self) -> u32 {
        self.version
    }
}

/// N DQN runs trained as one; see the module docs.
pub struct DqnPopulation {
    members: Vec<DqnConfig>,
    online: ParamStore,
    target: ParamStore,
    /// γ per member as F32 `[N, 1]` (a variable: [`Self::set_member`] rewrites it in place,
    /// and a captured update reads the new values).
    gamma: Var,
    /// Each member's AdamW, guard, clip, counters and soft target update.
    opt: PopAdamW,
    replays: Vec<ReplayBuffer>,
    env_steps: u64,
    /// Minibatches drawn (the sampling key; members draw at the same keys with their seeds,
    /// less their clock's draws).
    sampled: u64,
    /// Each member's clock: zero for a member from the start, the population's counters at
    /// its start for one that took a freed slot ([`Self::replace_member`]).
    clocks: Vec<MemberClock>,
    /// Transitions each member wrote since it began (at most the capacity): with its clock's
    /// ring slot, its window of its ring.
    own: Vec<usize>,
    /// Whether each member learns yet (its own transitions reached `learning_starts`); the
    /// optimiser's active flags mirror it.
    learning: Vec<bool>,
    #[cfg(feature = "cuda")]
    graph: Option<CapturedUpdate>,
    /// `step` tried to capture the update already (and, under `graph = auto`, ran eagerly
    /// after a failed capture).
    #[cfg(feature = "cuda")]
    capture_tried: bool,
    /// On a CUDA device, for networks its kernels cover: the member-batched loss and
    /// gradients.
    #[cfg(feature = "cuda")]
    pop_fused: Option<crate::dqn::pop_fused::DqnPopFused>,
    /// On CUDA, when every member's env is a [`fx_kernels::GpuTradingEnv`]: the
    /// member-batched collection (one launch per step for all members, not N), built on the
    /// first such step and rebuilt when the envs or replays change.
    #[cfg(feature = "cuda")]
    collect: Option<BatchedCollect>,
    /// Whether `step` may use the batched collection (tests turn it off to compare it with
    /// the per-member path).
    #[cfg(feature = "cuda")]
    batched: bool,
    /// Whether `step` may run whole iterations as one graph ([`Self::iteration_step`]; off
    /// after a failed `auto` capture). Opt-in (`FX_POP_ITERATION_GRAPH=1`, or
    /// [`Self::set_iteration_graphs`]) until its device test has run on a GPU.
    #[cfg(feature = "cuda")]
    iterations: bool,
    /// Steps this process ran as a whole-iteration graph.
    #[cfg(feature = "cuda")]
    iteration_steps: u64,
}

/// The batched collector and its stacked buffers: observations `[N, E, 56]`, rewards and
/// done flags `[N, E]`.
#[cfg(feature = "cuda")]
struct BatchedCollect {
    col: fx_kernels::cuda::PopDqnCollect,
    obs: Tensor,
    reward: Tensor,
    done: Tensor,
    /// The whole-iteration graphs over this collector's buffers (they go with it).
    iteration: Option<crate::dqn::iteration::LoopGraphs>,
}

/// The update captured as one CUDA graph over fixed input tensors.
#[cfg(feature = "cuda")]
struct CapturedUpdate {
    graph: fx_precision::CapturedGraph,
    inputs: PopBatch,
}

impl std::fmt::Debug for DqnPopulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqnPopulation")
            .field("members", &self.members.len())
            .field("env_steps", &self.env_steps)
            .field("sampled", &self.sampled)
            .finish()
    }
}

/// The keys every member must share: they fix shapes, the update schedule or constants the
/// batched kernels take once.
fn shared_keys(c: &DqnConfig) -> String {
    let o = &c.optimizer;
    format!(
        "net {:?}, precision {}, huber_delta {}, batch_size {}, replay_capacity {}, learning_starts {}, \
         train_every {}, gradient_steps {}, betas ({}, {}), eps {}",
        c.net,
        c.precision,
        c.huber_delta,
        c.batch_size,
        c.replay_capacity,
        c.learning_starts,
        c.train_every,
        c.gradient_steps,
        o.beta1,
        o.beta2,
        o.eps
    )
}

/// What a member's optimiser takes of its config.
fn pop_member(m: &DqnConfig) -> PopMember {
    PopMember { lr: m.optimizer.lr, weight_decay: m.optimizer.weight_decay, max_grad_norm: m.max_grad_norm, tau: m.tau }
}

/// Q values `[N, R, A]` (F32) of states `[N, R, S]` under stacked weights `w`.
fn forward(w: &[Tensor], s: &Tensor, p: Precision) -> candle_core::Result<Tensor> {
    let mut z = s.clone();
    for l in 0..3 {
        z = linear_members(&z, &w[2 * l], &w[2 * l + 1], p)?.relu()?;
    }
    let v = linear_members(&z, &w[6], &w[7], p)?;
    let a = linear_members(&z, &w[8], &w[9], p)?;
    let a_mean = a.mean_keepdim(D::Minus1)?;
    a.broadcast_sub(&a_mean)?.broadcast_add(&v)?.to_dtype(DType::F32)
}

/// Each member's mean double-DQN Huber loss `[N]` (F32) on `batch`: the online weights `w`
/// (taped) score `s`, their detached copy picks `a* = argmax Q(s')`, the target weights `tw`
/// evaluate it; `gamma` is `[N, 1]` F32 (the solo loss's `affine(−γ, γ)`, batched).
fn pop_loss(
    w: &[Tensor],
    tw: &[Tensor],
    batch: &PopBatch,
    gamma: &Tensor,
    delta: f64,
    p: Precision,
) -> candle_core::Result<Tensor> {
    let wd: Vec<Tensor> = w.iter().map(|t| t.detach()).collect();
    let q = forward(w, &batch.obs, p)?;
    let q_sa = q.gather(&batch.actions.unsqueeze(2)?, 2)?.squeeze(2)?;
    let next = batch.next_obs.detach();
    let a_star = forward(&wd, &next, p)?.argmax(D::Minus1)?;
    let q_t = forward(tw, &next, p)?.gather(&a_star.unsqueeze(2)?, 2)?.squeeze(2)?;
    let r = batch.rewards.to_dtype(DType::F32)?;
    let not_done = batch.dones.to_dtype(DType::F32)?.broadcast_mul(&gamma.neg()?)?.broadcast_add(gamma)?;
    let y = r.add(&not_done.mul(&q_t)?)?;
    crate::dqn::huber(&q_sa.broadcast_sub(&y)?, delta)?.mean(1)
}

/// The reference of the fused update's loss and gradients: [`pop_loss`] (`w` must be the
/// tensors of variables) and the gradients of the members' summed losses, in parameter order.
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn loss_and_grads(
    w: &[Tensor],
    tw: &[Tensor],
    batch: &PopBatch,
    gamma: &Tensor,
    delta: f64,
    p: Precision,
) -> Result<(Tensor, Vec<Tensor>)> {
    let loss = pop_loss(w, tw, batch, gamma, delta, p).ctx(CTX)?;
    let grads = loss.sum_all().and_then(|l| l.backward()).ctx(CTX)?;
    let g = w
        .iter()
        .map(|t| grads.get(t).cloned().ok_or_else(|| Error::config(CTX, "a parameter has no gradient")))
        .collect::<Result<_>>()?;
    Ok((loss, g))
}

/// Each member's mean reward over its accounts and its finished episodes (None: not read).
type RewardStats = (Option<Vec<f64>>, Option<Vec<u32>>);

/// [`RewardStats`] from one step's rewards and done flags (`[N, E]`, when read).
fn reward_stats(rewards: Option<Tensor>, dones: Option<Tensor>) -> Result<RewardStats> {
    let (Some(r), Some(d)) = (rewards, dones) else { return Ok((None, None)) };
    let e = r.dim(1).ctx(CTX)?.max(1) as f64;
    let sums: Vec<Vec<f64>> = Tensor::stack(&[r, d], 0)
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.sum(2))
        .and_then(|t| t.to_vec2())
        .ctx(CTX)?;
    Ok((Some(sums[0].iter().map(|s| s / e).collect()), Some(sums[1].iter().map(|&d| d as u32).collect())))
}

/// The captured update's inputs (`N` members' `B` rows) as the flat minibatch the sampling
/// kernel writes.
#[cfg(feature = "cuda")]
fn replay_view(i: &PopBatch, n: usize, b: usize) -> Result<fx_kernels::ReplayBatch> {
    let flat = |t: &Tensor, w: usize| if w == 1 { t.reshape(n * b) } else { t.reshape((n * b, w)) };
    Ok(fx_kernels::ReplayBatch {
        states: flat(&i.obs, fx_kernels::OBS_DIM).ctx(CTX)?,
        actions: flat(&i.actions, 1).ctx(CTX)?,
        rewards: flat(&i.rewards, 1).ctx(CTX)?,
        next_states: flat(&i.next_obs, fx_kernels::OBS_DIM).ctx(CTX)?,
        dones: flat(&i.dones, 1).ctx(CTX)?,
    })
}

impl DqnPopulation {
    /// A population of `members.len()` DQN runs, member `k` configured by `members[k]`.
    /// Members may differ in `seed`, `gamma`, `tau`, `optimizer.lr`,
    /// `optimizer.weight_decay`, `max_grad_norm` and `epsilon`; every other key must be equal
    /// (an error names the first member that differs). F16 compute is refused (its loss scaling
    /// is a per-run host state; use F32 or BF16).
    pub fn new(members: Vec<DqnConfig>, device: &Device) -> Result<Self> {
        let Some(first) = members.first() else {
            return Err(Error::config(CTX, "a population needs at least one member"));
        };
        let shared = shared_keys(first);
        for (k, m) in members.iter().enumerate() {
            m.validate().map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
            if shared_keys(m) != shared {
                return Err(Error::config(
                    CTX,
                    format!("member {k} differs from member 0 in a shared key: {} vs {shared}", shared_keys(m)),
                ));
            }
        }
        if first.precision == Precision::F16 {
            return Err(Error::config(CTX, "populations train in F32 or BF16, not F16"));
        }
        let n = members.len();
        let specs = first.net.param_specs();
        let seeds: Vec<u64> = members.iter().map(|m| m.seed).collect();
        let online = ParamStore::linear_init_population("dqn", specs.clone(), device, &seeds)?;
        let target = ParamStore::linear_init_population("dqn", specs, device, &seeds)?;
        let gamma = Tensor::from_vec(members.iter().map(|m| m.gamma as f32).collect(), (n, 1), device)
            .and_then(|t| Var::from_tensor(&t))
            .ctx(CTX)?;
        let per: Vec<PopMember> = members.iter().map(pop_member).collect();
        let o = &first.optimizer;
        let opt = PopAdamW::new(&online.vars(), &per, (o.beta1, o.beta2), o.eps, true)
            .map_err(|e| Error::config(CTX, e.to_string()))?;
        let replays =
            (0..n).map(|_| ReplayBuffer::new(first.replay_capacity, device).ctx(CTX)).collect::<Result<Vec<_>>>()?;
        #[cfg(feature = "cuda")]
        let pop_fused = if device.is_cuda() && crate::dqn::pop_fused::DqnPopFused::supports(&first.net) {
            let (b, d, p) = (first.batch_size, first.huber_delta, first.precision);
            Some(crate::dqn::pop_fused::DqnPopFused::new(&first.net, n, b, d, p, device)?)
        } else {
            None
        };
        Ok(Self {
            members,
            online,
            target,
            gamma,
            opt,
            replays,
            env_steps: 0,
            sampled: 0,
            clocks: vec![MemberClock::default(); n],
            own: vec![0; n],
            learning: vec![true; n],
            #[cfg(feature = "cuda")]
            graph: None,
            #[cfg(feature = "cuda")]
            capture_tried: false,
            #[cfg(feature = "cuda")]
            pop_fused,
            #[cfg(feature = "cuda")]
            collect: None,
            #[cfg(feature = "cuda")]
            batched: true,
            #[cfg(feature = "cuda")]
            iterations: std::env::var("FX_POP_ITERATION_GRAPH").is_ok_and(|v| v == "1"),
            #[cfg(feature = "cuda")]
            iteration_steps: 0,
        })
    }

    /// What members of one population must share, as text: two configs with equal keys can
    /// train together (a sweep groups its trials by it; shape keys such as `net.hidden` or
    /// `batch_size` split trials into one population per shape).
    pub fn shape_key(member: &DqnConfig) -> String {
        shared_keys(member)
    }

    /// An estimate of one member's device memory in bytes, for sizing populations
    /// (`fx_hw::HardwareBudget::population_size`): seven F32 copies of the parameters
    /// (online, target, gradient, two AdamW moments, the clipped gradient and a compute-dtype
    /// copy), the replay ring (`ReplayBuffer`'s bytes per transition), and per sample of the
    /// batch the inputs plus four F32 values a unit for the taped forward on `s` (pre- and
    /// post-activation and their gradients) and two for the untaped forwards on `s'`, doubled
    /// for candle's temporaries.
    pub fn member_bytes(member: &DqnConfig) -> u64 {
        let net = &member.net;
        let params: usize = net.param_specs().iter().map(|p| p.shape.iter().product::<usize>()).sum();
        let units = 2 * net.hidden + net.hidden / 2 + 1 + net.n_actions;
        let transition = 2 * net.state_dim * 4 + 12;
        let per_sample = transition + 2 * 6 * units * 4;
        (7 * params * 4 + member.replay_capacity * transition + member.batch_size * per_sample) as u64
    }

    /// The members' configs.
    pub fn members(&self) -> &[DqnConfig] {
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

    /// The stacked online networks (`[N, ...]` per parameter).
    pub fn online(&self) -> &ParamStore {
        &self.online
    }

    /// The stacked target networks.
    pub fn target(&self) -> &ParamStore {
        &self.target
    }

    /// Member `k`'s replay buffer.
    pub fn replay(&self, k: usize) -> Option<&ReplayBuffer> {
        self.replays.get(k)
    }

    /// Environment steps taken (by every member).
    pub fn env_steps(&self) -> u64 {
        self.env_steps
    }

    /// Member `k`'s AdamW moments `(exp_avg, exp_avg_sq)` in parameter order (copies).
    pub fn moments(&self, k: usize) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        self.opt.moments(k).map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// Per member: optimiser steps applied and updates skipped (one read).
    pub fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        self.opt.counters().map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// The last update's statistics (one read).
    pub fn last_update(&self) -> Result<PopUpdateStats> {
        let r = self.opt.last_step().map_err(|e| Error::config(CTX, e.to_string()))?;
        Ok(PopUpdateStats { loss: r.loss, grad_norm: r.grad_norm, skipped: r.skipped })
    }

    /// Member `k`'s settings replaced by `cfg` between steps (a PBT explore): γ, τ, learning
    /// rate, weight decay, clip norm and ε schedule, the keys members may differ in, written
    /// in place on the device (a captured update reads them). The seed and every shared key
    /// must stay as they are (an error names them); weights, moments and replay are kept.
    pub fn set_member(&mut self, k: usize, cfg: DqnConfig) -> Result<()> {
        let Some(old) = self.members.get(k) else {
            return Err(Error::config(CTX, format!("no member {k} of {}", self.len())));
        };
        cfg.validate().map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
        if shared_keys(&cfg) != shared_keys(old) || cfg.seed != old.seed {
            return Err(Error::config(
                CTX,
                format!("member {k}: only gamma, tau, optimizer.lr, optimizer.weight_decay, max_grad_norm and epsilon may change"),
            ));
        }
        self.opt.set_member(k, &pop_member(&cfg)).map_err(|e| Error::config(CTX, e.to_string()))?;
        let g = Tensor::new(&[[cfg.gamma as f32]], self.gamma.device()).ctx(CTX)?;
        self.gamma.as_tensor().slice_set(&g, 0, k).ctx(CTX)?;
        self.members[k] = cfg;
        Ok(())
    }

    /// Member `dst` continues from member `src`'s state (a PBT exploit): online and target
    /// weights, AdamW moments and step count copied over `dst`'s on the device, exactly. Its
    /// settings, replay, environments, seed and skip counters stay its own.
    pub fn exploit(&mut self, dst: usize, src: usize) -> Result<()> {
        if dst >= self.len() || src >= self.len() {
            return Err(Error::config(CTX, format!("exploit {src} -> {dst}: {} members", self.len())));
        }
        self.online.copy_member(dst, src)?;
        self.target.copy_member(dst, src)?;
        self.opt.copy_member(dst, src).map_err(|e| Error::config(CTX, e.to_string()))
    }

    /// The population cut down to the members `keep` (strictly increasing), in that order:
    /// member `i` goes on as member `keep[i]` would have (weights, target, moments, counters,
    /// settings and replay, exactly), so it stays its solo run (successive halving stops the
    /// others). The caller drops the stopped members' environments the same way. On CUDA
    /// the member-batched kernels and the captured update are rebuilt for the new size at
    /// the next step.
    pub fn retain_members(&mut self, keep: &[usize]) -> Result<()> {
        fx_precision::check_kept_members(keep, self.len()).map_err(|m| Error::config(CTX, m))?;
        self.online.retain_members(keep)?;
        self.target.retain_members(keep)?;
        self.opt.retain_members(keep).map_err(|e| Error::config(CTX, e.to_string()))?;
        let idx =
            Tensor::from_vec(keep.iter().map(|&k| k as u32).collect(), keep.len(), self.gamma.device()).ctx(CTX)?;
        self.gamma = self.gamma.as_tensor().index_select(&idx, 0).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
        let mut replays = std::mem::take(&mut self.replays).into_iter().map(Some).collect::<Vec<_>>();
        self.replays = keep.iter().filter_map(|&k| replays[k].take()).collect();
        self.members = keep.iter().map(|&k| self.members[k].clone()).collect();
        self.clocks = keep.iter().map(|&k| self.clocks[k]).collect();
        self.own = keep.iter().map(|&k| self.own[k]).collect();
        self.learning = keep.iter().map(|&k| self.learning[k]).collect();
        #[cfg(feature = "cuda")]
        {
            self.graph = None;
            self.capture_tried = false;
            self.collect = None;
            if self.pop_fused.is_some() {
                let first = &self.members[0];
                let (b, d, p) = (first.batch_size, first.huber_delta, first.precision);
                let dev = self.gamma.device().clone();
                self.pop_fused = Some(crate::dqn::pop_fused::DqnPopFused::new(&first.net, keep.len(), b, d, p, &dev)?);
            }
        }
        Ok(())
    }

    /// Everything a resume that goes on as if never stopped needs, copied to host memory:
    /// online and target weights, AdamW moments, step counts and skip counters, every
    /// member's replay transitions and ring position, the members' configs (a PBT explore's
    /// settings included) and the step and sampling counters. Write it with
    /// [`crate::StateSnapshot::write`]; [`Self::load_state`] reads it. Like a trainer's
    /// state, the environments' own state is not in it (the caller owns them).
    pub fn snapshot(&self) -> Result<crate::StateSnapshot> {
        const CTX: &str = "DqnPopulation::snapshot";
        let mut t = fx_precision::varmap_tensors(&self.online.varmap()?, "online.");
        t.extend(fx_precision::varmap_tensors(&self.target.varmap()?, "target."));
        self.opt.save_state(&mut t, "opt.");
        let mut replays = Vec::with_capacity(self.len());
        for (k, r) in self.replays.iter().enumerate() {
            crate::dqn::trainer::replay_tensors(r, &mut t, &format!("replay.{k}.")).ctx(CTX)?;
            replays.push((r.len(), r.position()));
        }
        let c = PopCounters {
            version: POP_STATE_VERSION,
            env_steps: self.env_steps,
            sampled: self.sampled,
            replays,
            members: self.members.clone(),
            clocks: self.clocks.clone(),
            own: self.own.clone(),
            learning: self.learning.clone(),
        };
        let mut meta = std::collections::HashMap::new();
        crate::state_meta::write(&mut meta, POP_STATE_KEY, &c, CTX)?;
        crate::StateSnapshot::new(t, meta, CTX)
    }

    /// A population restored from [`Self::snapshot`]'s file onto `device`: its next step is
    /// the one the saved population would have taken (on the CPU bit for bit; on CUDA the
    /// batched kernels and the captured update are built again at the first step). Missing,
    /// unknown or mis-shaped tensors are errors naming the tensor and file.
    pub fn load_state(path: &std::path::Path, device: &Device) -> Result<Self> {
        const CTX: &str = "DqnPopulation::load_state";
        // Read to the host: each tensor moves to `device` as it is restored, so the device
        // never holds the saved replays beside the rings they refill.
        let mut nt = fx_precision::load_tensors(path, &Device::Cpu).ctx(CTX)?;
        let c: PopCounters =
            crate::state_meta::read(&nt, path, POP_STATE_KEY, "a DQN population state", POP_STATE_VERSION, CTX)?;
        let Some(first) = c.members.first() else {
            return Err(Error::config(CTX, format!("{}: a population state of no member", path.display())));
        };
        if c.replays.len() != c.members.len() {
            return Err(Error::config(
                CTX,
                format!("{}: {} replays for {} members", path.display(), c.replays.len(), c.members.len()),
            ));
        }
        let (cap, n) = (first.replay_capacity, c.members.len());
        let per = (2 * fx_kernels::OBS_DIM as u64 + 3) * 4;
        crate::state_meta::check_buffer(path, &format!("{n} replay buffers of {cap}"), &[n, cap], per, CTX)?;
        let mut me = Self::new(c.members, device)
            .map_err(|e| Error::config(CTX, format!("{}: saved state: {e}", path.display())))?;
        nt.restore_varmap(&me.online.varmap()?, "online.").ctx(CTX)?;
        nt.restore_varmap(&me.target.varmap()?, "target.").ctx(CTX)?;
        me.opt.load_state(&mut nt, "opt.").ctx(CTX)?;
        for (k, (r, &at)) in me.replays.iter_mut().zip(&c.replays).enumerate() {
            crate::dqn::trainer::restore_replay(r, &mut nt, &format!("replay.{k}."), at, path, CTX)?;
        }
        nt.finish().ctx(CTX)?;
        me.env_steps = c.env_steps;
        me.sampled = c.sampled;
        if c.clocks.is_empty() && c.own.is_empty() && c.learning.is_empty() {
            me.own = me.replays.iter().map(ReplayBuffer::len).collect();
        } else if c.clocks.len() != n || c.own.len() != n || c.learning.len() != n {
            return Err(Error::config(
                CTX,
                format!(
                    "{}: {} clocks, {} own counts and {} learning flags for {n} members",
                    path.display(),
                    c.clocks.len(),
                    c.own.len(),
                    c.learning.len()
                ),
            ));
        } else {
            let bad = c.clocks.iter().zip(&c.own).position(|(k, &o)| {
                k.env_step > c.env_steps || k.key > c.sampled || k.ring_start >= cap as u64 || o > cap
            });
            if let Some(k) = bad {
                return Err(Error::config(
                    CTX,
                    format!(
                        "{}: member {k}'s clock {:?} (own transitions {}) lies past the population's env step {}, draw {} or ring of {cap}",
                        path.display(),
                        c.clocks[k],
                        c.own[k],
                        c.env_steps,
                        c.sampled
                    ),
                ));
            }
            (me.clocks, me.own, me.learning) = (c.clocks, c.own, c.learning);
        }
        for (k, &l) in me.learning.iter().enumerate().filter(|(_, &l)| !l) {
            me.opt.set_active(k, l).map_err(|e| Error::config(CTX, e.to_string()))?;
        }
        Ok(me)
    }

    /// Each member's ε for the next environment step (its schedule at its own step).
    pub fn epsilon(&self) -> Vec<f64> {
        self.members.iter().zip(&self.clocks).map(|(m, c)| m.epsilon.value(self.env_steps - c.env_step)).collect()
    }

    /// Members that learn yet (those that started over learn once their own transitions
    /// reach `learning_starts`): the members an update round steps.
    pub fn learning_members(&self) -> usize {
        self.learning.iter().filter(|&&l| l).count()
    }

    /// Environment steps member `k` has taken since it began (the population's for a member
    /// from the start).
    pub fn member_env_steps(&self, k: usize) -> Option<u64> {
        self.clocks.get(k).map(|c| self.env_steps - c.env_step)
    }

    /// Member `k` starts over as a new run of `cfg` between steps (a trial in the slot of
    /// one that successive halving stopped): online and target weights drawn from its seed,
    /// AdamW moments, step count and skip counters zero, its settings, and clocks from this
    /// step, so that from here it is the solo run of `cfg` (its ε ramp, its update schedule,
    /// its draws and its share of the ring count from now; it learns once its own
    /// transitions reach `learning_starts`). The caller hands it a new environment from the
    /// next step on. Every shared key must equal the population's (an error names them), and
    /// the population's steps must be a multiple of `train_every` (so the member's update
    /// schedule is the solo one). The other members do not notice.
    pub fn replace_member(&mut self, k: usize, cfg: DqnConfig) -> Result<()> {
        if k >= self.len() {
            return Err(Error::config(CTX, format!("no member {k} of {}", self.len())));
        }
        cfg.validate().map_err(|e| Error::config(CTX, format!("member {k}: {e}")))?;
        if shared_keys(&cfg) != shared_keys(&self.members[k]) {
            return Err(Error::config(
                CTX,
                format!("member {k}: a new run must share the population's keys ({})", shared_keys(&self.members[k])),
            ));
        }
        let every = self.members[0].train_every;
        if !self.env_steps.is_multiple_of(every) {
            return Err(Error::config(
                CTX,
                format!(
                    "member {k} can start over at env step {}: not a multiple of train_every = {every}",
                    self.env_steps
                ),
            ));
        }
        let fresh =
            ParamStore::linear_init_population("dqn", cfg.net.param_specs(), self.online.device(), &[cfg.seed])?
                .member(0)?;
        self.online.set_member(k, &fresh)?;
        self.target.set_member(k, &fresh)?;
        let opt_err = |e: fx_precision::Error| Error::config(CTX, e.to_string());
        self.opt.reset_member(k, &pop_member(&cfg)).map_err(opt_err)?;
        self.opt.set_active(k, false).map_err(opt_err)?;
        let g = Tensor::new(&[[cfg.gamma as f32]], self.gamma.device()).ctx(CTX)?;
        self.gamma.as_tensor().slice_set(&g, 0, k).ctx(CTX)?;
        self.clocks[k] =
            MemberClock { env_step: self.env_steps, ring_start: self.replays[k].position() as u64, key: self.sampled };
        self.own[k] = 0;
        self.learning[k] = false;
        self.members[k] = cfg;
        // The collector's table holds the member's sampling seed, clocks and env: under
        // iteration graphs the seed and clocks are rewritten in place now (a draw before the
        // next batched step, `sample` or a step the collector cannot take, reads them) and the
        // env's row at the next batched step (`refit_collect`; the graphs over the table
        // stay), else it is built again.
        #[cfg(feature = "cuda")]
        if !self.iterations {
            self.collect = None;
        } else {
            self.put_member_table()?;
        }
        Ok(())
    }

    /// Before an update round: members whose own transitions reached `learning_starts`
    /// begin learning (their first draw is the next one). Whether any member learns.
    fn start_learning(&mut self) -> Result<bool> {
        let starts = self.members[0].learning_starts.max(1);
        let mut began = false;
        for k in 0..self.len() {
            if !self.learning[k] && self.own[k] >= starts {
                self.learning[k] = true;
                self.clocks[k].key = self.sampled;
                self.opt.set_active(k, true).map_err(|e| Error::config(CTX, e.to_string()))?;
                began = true;
            }
        }
        // The collector's table holds the draw keys (this step's draws read the new ones).
        #[cfg(feature = "cuda")]
        if began {
            self.put_member_table()?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = began;
        // Members from the start are marked learning from the outset: their own count decides.
        Ok(self.learning.iter().zip(&self.own).any(|(&l, &o)| l && o >= starts))
    }

    /// One environment step of every member (`envs[k]` is member `k`'s), ε-greedy on its own
    /// Q values with its own ε, stored in its replay, then the update round when due (the
    /// solo trainer's schedule). Statistics are read back when `read`.
    pub fn step(&mut self, envs: &mut [&mut dyn VecEnv], read: bool) -> Result<PopStepStats> {
        if envs.len() != self.len() {
            return Err(Error::config(CTX, format!("{} environments for {} members", envs.len(), self.len())));
        }
        #[cfg(feature = "cuda")]
        if let Some(st) = self.iteration_step(envs, read)? {
            return Ok(st);
        }
        let eps = self.epsilon();
        let (rewards, dones) = self.collect_step(envs, &eps, read)?;
        self.env_steps += 1;
        let cap = self.members[0].replay_capacity;
        for (o, env) in self.own.iter_mut().zip(envs.iter()) {
            *o = (*o + env.num_envs()).min(cap);
        }
        let (mean_reward, episodes_done) = reward_stats(rewards, dones)?;
        let first = &self.members[0];
        let len = self.replays[0].len();
        let (mut updates, mut updates_queued) = (Vec::new(), 0);
        let gradient_steps = first.gradient_steps;
        if self.env_steps.is_multiple_of(first.train_every) && self.start_learning()? {
            for _ in 0..gradient_steps {
                self.sample_and_update()?;
                if read {
                    updates.push(self.last_update()?);
                } else {
                    updates_queued += 1;
                }
            }
        }
        Ok(PopStepStats {
            env_steps: self.env_steps,
            epsilon: eps,
            mean_reward,
            episodes_done,
            replay_len: len,
            updates,
            updates_queued,
        })
    }

    /// Whether whole iterations may run as one graph (off by default, on with
    /// `FX_POP_ITERATION_GRAPH=1`, until the device test comparing it with the stepwise path
    /// has run on a GPU). Off drops the captured iterations.
    #[cfg(feature = "cuda")]
    pub fn set_iteration_graphs(&mut self, on: bool) {
        self.iterations = on;
        if let (false, Some(bc)) = (on, self.collect.as_mut()) {
            bc.iteration = None;
        }
    }

    /// Whether a whole-iteration graph is captured (GPU-env steps then run as one).
    #[cfg(feature = "cuda")]
    pub fn iteration_graph_active(&self) -> bool {
        self.collect.as_ref().is_some_and(|bc| bc.iteration.is_some())
    }

    /// Steps this population ran as a whole-iteration graph since it was built or loaded
    /// (not saved in its state).
    #[cfg(feature = "cuda")]
    pub fn iteration_graph_steps(&self) -> u64 {
        self.iteration_steps
    }

    /// Whether the batched collector exists and fits `genvs`, under iteration graphs after
    /// rewriting the rows of
    /// members whose env is new in place ([`fx_kernels::cuda::PopDqnCollect::refit`]: a trial
    /// in a freed slot keeps the collector and the graphs over it). False: build a new one
    /// (or none).
    #[cfg(feature = "cuda")]
    fn refit_collect(&mut self, genvs: &[&fx_kernels::GpuTradingEnv]) -> Result<bool> {
        let Some(bc) = self.collect.as_mut() else { return Ok(false) };
        // Without iteration graphs (the path the device tests have run) the collector is
        // only kept as built.
        if self.iterations && !bc.col.refit(genvs, &self.replays).ctx(CTX)? {
            return Ok(false);
        }
        Ok(bc.col.fits(genvs, &self.replays))
    }

    /// Puts every member's ε ramp, clocks and sampling seed (its own, as its solo trainer
    /// samples) into the batched collector's table where they changed; nothing without one.
    #[cfg(feature = "cuda")]
    fn put_member_table(&mut self) -> Result<()> {
        let Some(bc) = self.collect.as_mut() else { return Ok(()) };
        let schedules: Vec<fx_kernels::LinearSchedule> = self.members.iter().map(|m| m.epsilon).collect();
        let seeds: Vec<u64> = self.members.iter().map(|m| m.seed).collect();
        bc.col.set_members(&schedules, &self.clocks, &seeds).ctx(CTX)
    }

    /// The counters a whole-iteration graph keeps on the device, as the host has them (the
    /// members' rings move in step: member 0's position and length are everyone's).
    #[cfg(feature = "cuda")]
    fn loop_counters(&self) -> fx_kernels::cuda::DqnLoopCounters {
        fx_kernels::cuda::DqnLoopCounters {
            env_steps: self.env_steps,
            replay_position: self.replays[0].position() as u64,
            replay_len: self.replays[0].len() as u64,
            sample_key: self.sampled,
        }
    }

    /// One `step` as a whole-iteration graph when it can be (see the module docs): CUDA,
    /// GPU envs and the batched collector built on them (the stepwise path's first step builds
    /// it), iterations on, and for a step with an update round the update captured (the
    /// stepwise path's first round captures it). None: take the stepwise path, nothing moved.
    /// The host's counters, flags and clocks move exactly as the stepwise step moves them.
    #[cfg(feature = "cuda")]
    fn iteration_step(&mut self, envs: &[&mut dyn VecEnv], read: bool) -> Result<Option<PopStepStats>> {
        const CTX: &str = "DqnPopulation::step (iteration graph)";
        let mode = self.members[0].graph;
        if !self.iterations || !self.batched || mode == fx_precision::GraphMode::Off || !self.online.device().is_cuda()
        {
            return Ok(None);
        }
        let Some(genvs) = envs.iter().map(|e| e.as_gpu()).collect::<Option<Vec<_>>>() else { return Ok(None) };
        if !self.refit_collect(&genvs)? {
            return Ok(None);
        }
        let first = &self.members[0];
        let (cap, starts, every, g) =
            (first.replay_capacity, first.learning_starts.max(1), first.train_every, first.gradient_steps);
        let e = genvs[0].config().num_envs;
        let own_after: Vec<usize> = self.own.iter().map(|&o| (o + e).min(cap)).collect();
        // The stepwise round's condition (`start_learning`'s answer): a multiple of
        // train_every, and some member's own transitions at learning_starts.
        let round = (self.env_steps + 1).is_multiple_of(every);
        let train = round && own_after.iter().any(|&o| o >= starts);
        if train && self.graph.is_none() {
            return Ok(None);
        }
        self.put_member_table()?;
        let bc = self.collect.as_mut().ok_or_else(|| Error::config(CTX, "no collector"))?;
        if !bc.iteration.as_ref().is_some_and(|it| it.has(train)) {
            let captured = self.capture_iteration(&genvs, train);
            let what = "DQN population iteration";
            if crate::graph_update::settle_capture(mode, what, "stepping kernel by kernel", captured)?.is_none() {
                self.set_iteration_graphs(false);
                return Ok(None);
            }
        }
        let epsilon = self.epsilon();
        let before = self.loop_counters();
        // The host's counters move as the replay will move the device's, and the members
        // that begin learning do so before the round's draws, as in the stepwise step (their
        // flags and draw keys reach the device ahead of the graph; the collection reads neither).
        self.env_steps += 1;
        for r in self.replays.iter_mut() {
            r.advance(e);
        }
        self.own = own_after;
        if round {
            let learns = self.start_learning()?;
            debug_assert_eq!(learns, train, "the iteration's round and start_learning agree");
        }
        if train {
            self.sampled += u64::from(g);
        }
        let after = self.loop_counters();
        let bc = self.collect.as_mut().ok_or_else(|| Error::config(CTX, "no collector"))?;
        let it = bc.iteration.as_mut().ok_or_else(|| Error::config(CTX, "no iteration"))?;
        it.sync(before, &self.replays[0])?;
        it.replay(train, after)?;
        self.iteration_steps += 1;
        let (mean_reward, episodes_done) =
            if read { reward_stats(Some(bc.reward.clone()), Some(bc.done.clone()))? } else { (None, None) };
        let (mut updates, mut updates_queued) = (Vec::new(), if train { g } else { 0 });
        if read && train && g > 0 {
            // The statistics hold the round's last update; the others count as queued.
            updates.push(self.last_update()?);
            updates_queued -= 1;
        }
        Ok(Some(PopStepStats {
            env_steps: self.env_steps,
            epsilon,
            mean_reward,
            episodes_done,
            replay_len: self.replays[0].len(),
            updates,
            updates_queued,
        }))
    }

    /// Captures the whole iteration (with an update round of `gradient_steps` minibatches
    /// when `train`) over the batched collector's buffers on `genvs`. The warm-ups run only
    /// what changes no state (observation, forward, the update dry).
    #[cfg(feature = "cuda")]
    fn capture_iteration(&mut self, genvs: &[&fx_kernels::GpuTradingEnv], train: bool) -> Result<()> {
        const CTX: &str = "DqnPopulation::capture_iteration";
        let mut bc = self.collect.take().ok_or_else(|| Error::config(CTX, "no collector"))?;
        let captured = (|| -> Result<()> {
            let dev = self.online.device().clone();
            if bc.iteration.is_none() {
                bc.iteration = Some(crate::dqn::iteration::LoopGraphs::new(&dev)?);
            }
            let first = &self.members[0];
            let (n, b, p, e) = (self.len(), first.batch_size, first.precision, genvs[0].config().num_envs);
            let update = if train { self.graph.as_ref() } else { None };
            let minibatches = update.map_or(0, |_| first.gradient_steps);
            let w: Vec<Tensor> = self.online.vars().iter().map(|v| v.as_tensor().detach()).collect();
            let (col, obs, reward, done) = (&bc.col, &bc.obs, &bc.reward, &bc.done);
            let lp = &bc.iteration.as_ref().ok_or_else(|| Error::config(CTX, "no iteration"))?.lp;
            let graph = fx_precision::CapturedGraph::capture(&dev, 2, |dry| {
                let run = || -> Result<()> {
                    col.observe(genvs, &self.replays, obs).ctx(CTX)?;
                    let q = forward(&w, obs, p)
                        .and_then(|q| q.to_dtype(DType::F32))
                        .and_then(|q| q.contiguous())
                        .ctx(CTX)?;
                    if !dry {
                        col.collect_looped(genvs, &self.replays, &q, lp, obs, Some(reward), Some(done)).ctx(CTX)?;
                        lp.launch_advance(e, &self.replays[0], minibatches).ctx(CTX)?;
                    }
                    if let Some(u) = update {
                        let view = replay_view(&u.inputs, n, b)?;
                        for m in 0..minibatches {
                            if !dry {
                                col.sample_looped(&self.replays, lp, m, &view).ctx(CTX)?;
                            }
                            self.update_body(&u.inputs, dry)?;
                        }
                    }
                    Ok(())
                };
                run().map_err(crate::graph_update::capture_error(CTX))
            })
            .ctx(CTX)?;
            bc.iteration.as_mut().ok_or_else(|| Error::config(CTX, "no iteration"))?.set(train, graph);
            Ok(())
        })();
        self.collect = Some(bc);
        captured
    }

    /// The collection of one `step`: every member's ε-greedy actions on its own Q values,
    /// stepped into its replay; the rewards and done flags (`[N, E]`) when `read`. On CUDA
    /// with GPU envs, one launch each for all members (observe, experience); otherwise per
    /// member.
    fn collect_step(
        &mut self,
        envs: &mut [&mut dyn VecEnv],
        eps: &[f64],
        read: bool,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if let Some((r, d)) = self.collect_batched(envs, read)? {
            return Ok((r, d));
        }
        let obs: Vec<Tensor> = envs.iter().map(|e| e.observe().ctx(CTX)).collect::<Result<_>>()?;
        let q = self.q_values(&Tensor::stack(&obs, 0).ctx(CTX)?)?;
        let (mut rewards, mut dones) = (Vec::new(), Vec::new());
        for (k, env) in envs.iter_mut().enumerate() {
            let actions = env.epsilon_greedy(&q.get(k).ctx(CTX)?, eps[k]).ctx(CTX)?;
            let st = env.step_into_replay(&actions, &mut self.replays[k]).ctx(CTX)?;
            if read {
                rewards.push(st.reward);
                dones.push(st.done);
            }
        }
        if !read {
            return Ok((None, None));
        }
        Ok((Some(Tensor::stack(&rewards, 0).ctx(CTX)?), Some(Tensor::stack(&dones, 0).ctx(CTX)?)))
    }

    /// [`Self::collect_step`] through [`fx_kernels::cuda::PopDqnCollect`] when every env is a GPU
    /// env on the population's CUDA device (None otherwise, and nothing ran). Member `k`'s ε
    /// is its schedule's value at this step, computed on the device as the solo kernels do.
    #[cfg(feature = "cuda")]
    fn collect_batched(
        &mut self,
        envs: &[&mut dyn VecEnv],
        read: bool,
    ) -> Result<Option<(Option<Tensor>, Option<Tensor>)>> {
        let dev = self.online.device().clone();
        if !self.batched || !dev.is_cuda() {
            return Ok(None);
        }
        let Some(genvs) = envs.iter().map(|e| e.as_gpu()).collect::<Option<Vec<_>>>() else { return Ok(None) };
        if genvs.iter().any(|g| !VecEnv::device(*g).same_device(&dev)) {
            return Ok(None);
        }
        if !self.refit_collect(&genvs)? {
            let e = genvs[0].config().num_envs;
            let n = self.len();
            let schedules: Vec<fx_kernels::LinearSchedule> = self.members.iter().map(|m| m.epsilon).collect();
            // Each member samples with its own seed, as its solo trainer does (not its env's).
            let seeds: Vec<u64> = self.members.iter().map(|m| m.seed).collect();
            let col = fx_kernels::cuda::PopDqnCollect::new(&genvs, &self.replays, &schedules, &seeds).ctx(CTX)?;
            let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).ctx(CTX);
            self.collect = Some(BatchedCollect {
                col,
                obs: z(&[n, e, fx_kernels::OBS_DIM])?,
                reward: z(&[n, e])?,
                done: z(&[n, e])?,
                iteration: None,
            });
        }
        self.put_member_table()?;
        let Some(bc) = self.collect.as_mut() else { return Ok(None) };
        bc.col.observe(&genvs, &self.replays, &bc.obs).ctx(CTX)?;
        let w: Vec<Tensor> = self.online.vars().iter().map(|v| v.as_tensor().detach()).collect();
        let q = forward(&w, &bc.obs, self.members[0].precision)
            .and_then(|q| q.to_dtype(DType::F32))
            .and_then(|q| q.contiguous())
            .ctx(CTX)?;
        bc.col
            .collect(&genvs, &mut self.replays, &q, self.env_steps, &bc.obs, Some(&bc.reward), Some(&bc.done))
            .ctx(CTX)?;
        if !read {
            return Ok(Some((None, None)));
        }
        // Copies: the buffers are rewritten by the next step.
        Ok(Some((Some(bc.reward.copy().ctx(CTX)?), Some(bc.done.copy().ctx(CTX)?))))
    }

    /// One minibatch per member and the update on it. On CUDA with the batched collection
    /// and a captured update, the minibatch is drawn straight into the graph's inputs (one
    /// launch for all members) before the replay.
    fn sample_and_update(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Some(bc), Some(g)) = (&self.collect, &self.graph) {
            let view = replay_view(&g.inputs, self.len(), self.members[0].batch_size)?;
            bc.col.sample(&self.replays, self.env_steps, self.sampled, &view).ctx(CTX)?;
            self.sampled += 1;
            return g.graph.replay().ctx(CTX);
        }
        let batch = self.sample()?;
        #[cfg(feature = "cuda")]
        self.capture_for_steps(&batch)?;
        self.update(&batch)
    }

    /// Q values `[N, R, A]` of stacked states `[N, R, S]` (no graph).
    pub fn q_values(&self, s: &Tensor) -> Result<Tensor> {
        let w: Vec<Tensor> = self.online.vars().iter().map(|v| v.as_tensor().detach()).collect();
        forward(&w, &s.detach(), self.members[0].precision).ctx(CTX)
    }

    /// One minibatch per member from its replay (keyed by its seed and the draw count, as the
    /// solo trainer draws), stacked.
    pub fn sample(&mut self) -> Result<PopBatch> {
        let b = self.members[0].batch_size;
        #[cfg(feature = "cuda")]
        if let Some(bc) = &self.collect {
            let (n, s) = (self.len(), self.members[0].net.state_dim);
            let out = fx_kernels::ReplayBatch::alloc(n * b, self.online.device(), CTX).ctx(CTX)?;
            bc.col.sample(&self.replays, self.env_steps, self.sampled, &out).ctx(CTX)?;
            self.sampled += 1;
            return Ok(PopBatch {
                obs: out.states.reshape((n, b, s)).ctx(CTX)?,
                actions: out.actions.reshape((n, b)).ctx(CTX)?,
                rewards: out.rewards.reshape((n, b)).ctx(CTX)?,
                next_obs: out.next_states.reshape((n, b, s)).ctx(CTX)?,
                dones: out.dones.reshape((n, b)).ctx(CTX)?,
            });
        }
        let mut parts: [Vec<Tensor>; 5] = Default::default();
        for (k, (m, replay)) in self.members.iter().zip(&self.replays).enumerate() {
            // Each member draws from its window at its own key, as `fx_pop_replay_sample`
            // does; one not learning yet (its update masked) may own no transition, and then
            // draws its window's first slot, as the kernel's clamp does.
            let c = &self.clocks[k];
            let w = RingWindow { start: c.ring_start as usize, len: self.own[k].max(1) };
            let s = replay.sample_keyed_window(b, m.seed, self.sampled - c.key, w).ctx(CTX)?;
            for (p, t) in parts.iter_mut().zip([s.states, s.actions, s.rewards, s.next_states, s.dones]) {
                p.push(t);
            }
        }
        self.sampled += 1;
        let [obs, actions, rewards, next_obs, dones] = parts.map(|p| Tensor::stack(&p, 0).ctx(CTX));
        Ok(PopBatch {
            obs: obs?,
            actions: actions?.to_dtype(DType::U32).ctx(CTX)?,
            rewards: rewards?,
            next_obs: next_obs?,
            dones: dones?,
        })
    }

    /// One optimiser step of every member on `batch` (see the module docs). Reads nothing
    /// back; [`Self::last_update`] and [`Self::counters`] read the outcome. On CUDA, once
    /// [`Self::capture_update`] has run, the captured graph replays instead.
    pub fn update(&mut self, batch: &PopBatch) -> Result<()> {
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

    fn check_batch(&self, batch: &PopBatch) -> Result<()> {
        let (n, b, s) = (self.len(), self.members[0].batch_size, self.members[0].net.state_dim);
        for (what, t, want) in [
            ("obs", &batch.obs, vec![n, b, s]),
            ("actions", &batch.actions, vec![n, b]),
            ("rewards", &batch.rewards, vec![n, b]),
            ("next_obs", &batch.next_obs, vec![n, b, s]),
            ("dones", &batch.dones, vec![n, b]),
        ] {
            if t.dims() != want.as_slice() {
                return Err(Error::shape(what, CTX, format!("{want:?}"), format!("{:?}", t.dims())));
            }
        }
        Ok(())
    }

    /// On a CUDA device, the first update `step` runs captures the update as one graph
    /// (`graph = auto` or `on` in the members' config; `off` keeps it eager), so the rest
    /// replay it; under `auto` a failed capture is said once and the updates stay eager.
    #[cfg(feature = "cuda")]
    fn capture_for_steps(&mut self, example: &PopBatch) -> Result<()> {
        use fx_precision::GraphMode;
        let mode = self.members[0].graph;
        if self.capture_tried || self.graph.is_some() || mode == GraphMode::Off || !self.online.device().is_cuda() {
            return Ok(());
        }
        self.capture_tried = true;
        match self.capture_update(example) {
            Ok(()) => Ok(()),
            Err(e) if mode == GraphMode::Auto => {
                eprintln!("warning: the population update could not be captured ({e}); running it eagerly");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Captures [`Self::update`] as one CUDA graph at the configured batch size (CUDA only);
    /// later updates copy their batch into the graph's inputs and replay it.
    #[cfg(feature = "cuda")]
    pub fn capture_update(&mut self, example: &PopBatch) -> Result<()> {
        self.check_batch(example)?;
        self.graph = None;
        // Captured iterations hold the old update's inputs.
        if let Some(bc) = self.collect.as_mut() {
            bc.iteration = None;
        }
        let inputs = PopBatch {
            obs: example.obs.copy().ctx(CTX)?,
            actions: example.actions.to_dtype(DType::U32).and_then(|t| t.copy()).ctx(CTX)?,
            rewards: example.rewards.copy().ctx(CTX)?,
            next_obs: example.next_obs.copy().ctx(CTX)?,
            dones: example.dones.copy().ctx(CTX)?,
        };
        let dev = self.online.device().clone();
        let graph = fx_precision::CapturedGraph::capture(&dev, 2, |dry| {
            self.update_body(&inputs, dry)
                .map_err(|e| fx_precision::Error::Config { what: "DqnPopulation update", message: e.to_string() })
        })
        .ctx(CTX)?;
        self.graph = Some(CapturedUpdate { graph, inputs });
        Ok(())
    }

    /// Whether updates replay a captured graph.
    #[cfg(feature = "cuda")]
    pub fn update_captured(&self) -> bool {
        self.graph.is_some()
    }

    /// Launches per captured update (graph nodes); None before [`Self::capture_update`].
    #[cfg(feature = "cuda")]
    pub fn graph_nodes(&self) -> Result<Option<usize>> {
        self.graph.as_ref().map(|g| g.graph.node_count().ctx(CTX)).transpose()
    }

    /// The update; a `dry` run computes everything and writes nothing (graph warm-up). On
    /// CUDA the loss and gradients come from the member-batched fused kernels
    /// ([`crate::dqn::pop_fused`]) where they cover the network, else from candle's ops;
    /// then each member's guard, clip, AdamW and soft target update ([`PopAdamW`]).
    fn update_body(&self, batch: &PopBatch, dry: bool) -> Result<()> {
        let cfg = &self.members[0];
        let vars = self.online.vars();
        let tvars = self.target.vars();
        let w: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let tw: Vec<Tensor> = tvars.iter().map(|v| v.as_tensor().detach()).collect();
        let opt_err = |e: fx_precision::Error| Error::config(CTX, e.to_string());
        #[cfg(feature = "cuda")]
        if let Some(engine) = &self.pop_fused {
            engine.run(&w, &tw, &self.gamma.as_tensor().detach(), batch)?;
            return self.opt.step(&vars, &tvars, engine.loss(), engine.grads(), dry).map_err(opt_err);
        }
        let loss =
            pop_loss(&w, &tw, batch, &self.gamma.as_tensor().detach(), cfg.huber_delta, cfg.precision).ctx(CTX)?;
        let grads = loss.sum_all().and_then(|l| l.backward()).ctx(CTX)?;
        let g: Vec<Tensor> = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).cloned().ok_or_else(|| Error::config(CTX, "a parameter has no gradient")))
            .collect::<Result<_>>()?;
        self.opt.step(&vars, &tvars, &loss, &g, dry).map_err(opt_err)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dqn::trainer::DqnTrainer;
    use crate::synthetic::ar1_env;
    use crate::{DqnNetConfig, LinearSchedule};

    fn tiny(k: usize) -> DqnConfig {
        let k64 = k as u64;
        DqnConfig {
            net: DqnNetConfig { hidden: 16, ..Default::default() },
            batch_size: 16,
            replay_capacity: 50, // wraps during the test
            learning_starts: 20,
            seed: 11 + 7 * k64,
            gamma: 0.95 + 0.007 * k as f64,
            tau: 0.005 * (1 + k) as f64,
            optimizer: fx_precision::AdamWConfig {
                lr: 1e-3 * (1.0 + 0.5 * k as f64),
                weight_decay: 0.01 * k as f64,
                ..DqnConfig::default().optimizer
            },
            // Member 3 clips at 0.02 (most of its steps are clipped); member 0 has no weight decay.
            max_grad_norm: if k == 3 { 0.02 } else { 10.0 },
            epsilon: LinearSchedule { start: 1.0, end: 0.05 * k as f64, steps: 20 + 5 * k64 },
            ..Default::default()
        }
    }

    /// One step of `p` on `envs` (member `k`'s is `envs[k]`).
    fn step_on<E: VecEnv>(p: &mut DqnPopulation, envs: &mut [E], read: bool) -> PopStepStats {
        let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
        p.step(&mut refs, read).unwrap()
    }

    /// Exact equality of two tensors' values (IEEE `==`: ±0 are one value, NaN never passes).
    fn same(a: &Tensor, b: &Tensor, what: &str) {
        let f = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let (x, y) = (f(a), f(b));
        assert_eq!(x.len(), y.len(), "{what}: lengths");
        if let Some(i) = (0..x.len()).find(|&i| x[i] != y[i]) {
            panic!("{what}: element {i} differs: {} vs {}", x[i], y[i]);
        }
    }

    /// Members 0, 3 and 6 of a population of 7 (seeds, γ, τ, learning rates, weight decay,
    /// clip norms and ε schedules all different) are their solo runs, over 200 updates: the
    /// same weights, target weights, AdamW moments and step counts, replay contents, rewards,
    /// episode counts, losses and gradient norms, on the CPU.
    #[test]
    fn members_are_their_solo_runs_on_cpu() {
        let n = 7;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut pop = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut envs: Vec<_> = (0..n).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        let watched = [0usize, 3, 6];
        let mut solos: Vec<DqnTrainer> =
            watched.iter().map(|&k| DqnTrainer::new(cfgs[k].clone(), &Device::Cpu).unwrap()).collect();
        let mut solo_envs: Vec<_> = watched.iter().map(|&k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        let (mut updates, mut clipped) = (0, 0);
        while updates < 200 {
            let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
            let p = pop.step(&mut refs, true).unwrap();
            updates += p.updates.len();
            clipped += p.updates.iter().filter(|u| u.grad_norm[3] > 0.02).count();
            for (j, &k) in watched.iter().enumerate() {
                let s = solos[j].step(&mut solo_envs[j]).unwrap();
                assert_eq!(s.epsilon, p.epsilon[k], "member {k} ε");
                assert_eq!(s.mean_reward.unwrap(), p.mean_reward.as_ref().unwrap()[k], "member {k} reward");
                assert_eq!(s.episodes_done.unwrap(), p.episodes_done.as_ref().unwrap()[k]);
                assert_eq!(s.updates.len(), p.updates.len());
                for (su, pu) in s.updates.iter().zip(&p.updates) {
                    assert_eq!(su.loss, pu.loss[k], "member {k} loss at update {updates}");
                    assert_eq!(su.grad_norm, pu.grad_norm[k], "member {k} grad norm at update {updates}");
                    assert_eq!(su.skipped, pu.skipped[k]);
                }
            }
        }
        for (j, &k) in watched.iter().enumerate() {
            assert_member_is_solo(&pop, k, &solos[j]);
        }
        let applied = pop.counters().unwrap().0;
        assert!(applied.iter().all(|&a| a >= 200), "every member trained: {applied:?}");
        assert!(clipped > 100, "member 3 must be clipped on most steps, was on {clipped}");
    }

    /// Member `k`'s weights, target, moments, counters and replay (its window of the ring)
    /// are the solo trainer's, bit for bit.
    fn assert_member_is_solo(pop: &DqnPopulation, k: usize, solo: &DqnTrainer) {
        let (applied, skipped) = pop.counters().unwrap();
        assert_eq!((applied[k], skipped[k]), (solo.updates(), solo.skipped_updates()), "member {k} counters");
        let (on, tg) = (pop.online().member(k).unwrap(), pop.target().member(k).unwrap());
        for (spec, (a, b)) in on.specs().iter().zip(on.vars().iter().zip(solo.online().params().vars())) {
            same(a.as_tensor(), b.as_tensor(), &format!("member {k} online {}", spec.name));
        }
        for (spec, (a, b)) in tg.specs().iter().zip(tg.vars().iter().zip(solo.target().params().vars())) {
            same(a.as_tensor(), b.as_tensor(), &format!("member {k} target {}", spec.name));
        }
        let opt = solo.optimizer_state();
        let (m, v) = pop.moments(k).unwrap();
        for (i, spec) in on.specs().iter().enumerate() {
            same(&m[i], &opt[&format!("{}.exp_avg", spec.name)], &format!("member {k} exp_avg {}", spec.name));
            same(&v[i], &opt[&format!("{}.exp_avg_sq", spec.name)], &format!("member {k} exp_avg_sq {}", spec.name));
        }
        let ring = pop.replay(k).unwrap();
        let (start, own) = (pop.clocks[k].ring_start as usize, pop.own[k]);
        let slots: Vec<u32> = (0..own).map(|i| ((start + i) % ring.capacity()) as u32).collect();
        let a = ring.gather(&Tensor::from_vec(slots, own, &Device::Cpu).unwrap()).unwrap();
        same_replay(&a, &solo.replay().stored().unwrap(), &format!("member {k} replay"));
    }

    /// Exact equality of two replays' transitions, field by field.
    fn same_replay(a: &fx_kernels::ReplayBatch, b: &fx_kernels::ReplayBatch, what: &str) {
        for (field, x, y) in [
            ("states", &a.states, &b.states),
            ("actions", &a.actions, &b.actions),
            ("rewards", &a.rewards, &b.rewards),
            ("next_states", &a.next_states, &b.next_states),
            ("dones", &a.dones, &b.dones),
        ] {
            same(x, y, &format!("{what} {field}"));
        }
    }

    /// A member that starts over mid-run (a new trial in a freed slot, after the ring has
    /// wrapped, with another seed, γ, τ, learning rate, clip and ε ramp) is from then on the
    /// solo run of its config, bit for bit on the CPU over 120 env steps: its ε, rewards,
    /// losses and gradient norms step by step, no update before its own `learning_starts`,
    /// then its weights, target, moments, counters and replay; the other members are the
    /// population's that never replaced one. A replacement off the `train_every` grid or
    /// with another shape is refused.
    #[test]
    fn a_member_that_starts_over_is_the_solo_run_of_its_config() {
        let n = 3;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut a = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut b = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mk = || (0..n).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect::<Vec<_>>();
        let (mut ea, mut eb) = (mk(), mk());
        let step = |p: &mut DqnPopulation, e: &mut [fx_kernels::CpuTradingEnv]| step_on(p, e, true);
        for _ in 0..37 {
            assert_eq!(step(&mut a, &mut ea), step(&mut b, &mut eb));
        }
        assert!(a.replay(1).unwrap().position() > 0 && a.counters().unwrap().0[1] > 0, "mid-run, ring wrapped");
        let new = DqnConfig { seed: 1234, ..tiny(4) };
        assert!(a.replace_member(1, DqnConfig { batch_size: 8, ..new.clone() }).is_err(), "a shared key");
        assert!(a.replace_member(3, new.clone()).is_err());
        let mut every =
            DqnPopulation::new(cfgs.iter().map(|c| DqnConfig { train_every: 2, ..c.clone() }).collect(), &Device::Cpu)
                .unwrap();
        let mut e2 = mk();
        step(&mut every, &mut e2);
        let err = every.replace_member(0, DqnConfig { train_every: 2, ..new.clone() }).unwrap_err().to_string();
        assert!(err.contains("train_every"), "{err}");
        a.replace_member(1, new.clone()).unwrap();
        assert_eq!(a.member_env_steps(1), Some(0));
        ea[1] = ar1_env(4, 32, 400, 77);
        let mut solo = DqnTrainer::new(new.clone(), &Device::Cpu).unwrap();
        let mut solo_env = ar1_env(4, 32, 400, 77);
        let (mut solo_updates, mut masked) = (0, 0);
        for t in 0..120 {
            let (p, q) = (step(&mut a, &mut ea), step(&mut b, &mut eb));
            let s = solo.step(&mut solo_env).unwrap();
            assert_eq!(s.epsilon, p.epsilon[1], "ε at its step {t}");
            assert_eq!(s.mean_reward.unwrap(), p.mean_reward.as_ref().unwrap()[1], "reward at its step {t}");
            assert_eq!(s.episodes_done.unwrap(), p.episodes_done.as_ref().unwrap()[1]);
            if s.updates.is_empty() {
                // Rounds of the others: it takes no step there and counts no skip.
                masked += p.updates.len();
                assert!(p.updates.iter().all(|u| u.skipped[1]), "it steps nothing before learning_starts");
            } else {
                assert_eq!(s.updates.len(), p.updates.len());
                solo_updates += s.updates.len();
                for (su, pu) in s.updates.iter().zip(&p.updates) {
                    assert_eq!(
                        (su.loss, su.grad_norm, su.skipped),
                        (pu.loss[1], pu.grad_norm[1], pu.skipped[1]),
                        "{t}"
                    );
                }
            }
            for k in [0, 2] {
                assert_eq!(
                    (p.epsilon[k], &p.mean_reward.as_ref().unwrap()[k]),
                    (q.epsilon[k], &q.mean_reward.as_ref().unwrap()[k])
                );
                for (x, y) in p.updates.iter().zip(&q.updates) {
                    assert_eq!((x.loss[k], x.grad_norm[k], x.skipped[k]), (y.loss[k], y.grad_norm[k], y.skipped[k]));
                }
            }
        }
        assert!(masked >= 4 && solo_updates > 90, "masked rounds {masked}, its updates {solo_updates}");
        assert_member_is_solo(&a, 1, &solo);
        for k in [0, 2] {
            for (x, y) in a.online().member(k).unwrap().vars().iter().zip(b.online().member(k).unwrap().vars()) {
                same(x.as_tensor(), y.as_tensor(), &format!("member {k} online"));
            }
        }
        let (ca, cb) = (a.counters().unwrap(), b.counters().unwrap());
        assert_eq!((ca.0[0], ca.0[2], ca.1[0], ca.1[2]), (cb.0[0], cb.0[2], cb.1[0], cb.1[2]));
        // Its clock travels with a saved state.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        let c = DqnPopulation::load_state(&path, &Device::Cpu).unwrap();
        assert_eq!(
            (c.clocks.clone(), c.own.clone(), c.learning.clone()),
            (a.clocks.clone(), a.own.clone(), a.learning.clone())
        );
    }

    /// A population saved mid-run (replays wrapped, a PBT explore applied) and restored with its environments' states goes on as the one that
    /// never stopped, bit for bit on the CPU: every step's statistics, then the weights,
    /// moments, counters and replays. A solo trainer's file is refused as not a population's.
    #[test]
    fn a_restored_population_goes_on_as_the_uninterrupted_one() {
        let dir = tempfile::tempdir().unwrap();
        let n = 3;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut a = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut envs: Vec<_> = (0..n).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        let step = |p: &mut DqnPopulation, e: &mut [fx_kernels::CpuTradingEnv]| step_on(p, e, true);
        for t in 0..30 {
            if t == 10 {
                a.set_member(1, DqnConfig { gamma: 0.9, ..cfgs[1].clone() }).unwrap();
            }
            step(&mut a, &mut envs);
        }
        assert!(a.replay(0).unwrap().len() == 50 && a.replay(0).unwrap().position() > 0, "the replay wrapped");
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        let mut b = DqnPopulation::load_state(&path, &Device::Cpu).unwrap();
        assert_eq!(b.members()[1].gamma, 0.9, "the explored settings travel");
        let mut envs_b: Vec<_> = (0..n).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        for (eb, ea) in envs_b.iter_mut().zip(&envs) {
            eb.restore(&ea.state()).unwrap();
        }
        for _ in 0..30 {
            assert_eq!(step(&mut a, &mut envs), step(&mut b, &mut envs_b));
        }
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for k in 0..n {
            for (x, y) in a.online().member(k).unwrap().vars().iter().zip(b.online().member(k).unwrap().vars()) {
                same(x.as_tensor(), y.as_tensor(), &format!("member {k} online"));
            }
            for (x, y) in a.target().member(k).unwrap().vars().iter().zip(b.target().member(k).unwrap().vars()) {
                same(x.as_tensor(), y.as_tensor(), &format!("member {k} target"));
            }
            let ((ma, va), (mb, vb)) = (a.moments(k).unwrap(), b.moments(k).unwrap());
            for (x, y) in ma.iter().chain(&va).zip(mb.iter().chain(&vb)) {
                same(x, y, &format!("member {k} moments"));
            }
            let (ra, rb) = (a.replay(k).unwrap().stored().unwrap(), b.replay(k).unwrap().stored().unwrap());
            same(&ra.states, &rb.states, &format!("member {k} replay"));
            same(&ra.dones, &rb.dones, &format!("member {k} replay dones"));
            assert_eq!(a.replay(k).unwrap().position(), b.replay(k).unwrap().position());
        }
        let solo = dir.path().join("solo.safetensors");
        DqnTrainer::new(cfgs[0].clone(), &Device::Cpu).unwrap().save_state(&solo).unwrap();
        let e = DqnPopulation::load_state(&solo, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("solo.safetensors") && e.contains("not a DQN population state"), "{e}");
    }

    /// PBT's two moves on the CPU: `set_member` before training gives the population made
    /// with those settings, bit for bit over 100 env steps of updates; `exploit` gives the
    /// destination the source's online and target weights, moments and step count exactly
    /// and leaves the other members as they were.
    #[test]
    fn set_member_and_exploit_move_one_member() {
        let n = 3;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut other = cfgs.clone();
        other[1] = DqnConfig {
            gamma: 0.5,
            tau: 0.3,
            max_grad_norm: 1.0,
            optimizer: fx_precision::AdamWConfig { lr: 0.05, weight_decay: 0.2, ..cfgs[1].optimizer },
            epsilon: LinearSchedule { start: 0.5, end: 0.5, steps: 1 },
            ..cfgs[1].clone()
        };
        let mut a = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut b = DqnPopulation::new(other, &Device::Cpu).unwrap();
        b.set_member(1, cfgs[1].clone()).unwrap();
        assert!(b.set_member(1, DqnConfig { seed: 99, ..cfgs[1].clone() }).is_err(), "the seed is the member's");
        assert!(b.set_member(1, DqnConfig { batch_size: 8, ..cfgs[1].clone() }).is_err(), "a shared key");
        assert!(b.set_member(3, cfgs[0].clone()).is_err());
        let run = |pop: &mut DqnPopulation, steps: usize| {
            let mut envs: Vec<_> = (0..n).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
            for _ in 0..steps {
                let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
                pop.step(&mut refs, false).unwrap();
            }
        };
        run(&mut a, 100);
        run(&mut b, 100);
        assert!(a.counters().unwrap().0.iter().all(|&u| u > 50));
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for (x, y) in
            a.online().vars().iter().chain(&a.target().vars()).zip(b.online().vars().iter().chain(&b.target().vars()))
        {
            same(x.as_tensor(), y.as_tensor(), "set_member before training: weights");
        }
        let before1 = a.online().member(1).unwrap();
        a.exploit(0, 2).unwrap();
        assert!(a.exploit(0, 3).is_err());
        for (store, what) in [(a.online(), "online"), (a.target(), "target")] {
            let (m0, m2) = (store.member(0).unwrap(), store.member(2).unwrap());
            for (x, y) in m0.vars().iter().zip(m2.vars()) {
                same(x.as_tensor(), y.as_tensor(), &format!("exploit: {what} weights"));
            }
        }
        for (x, y) in a.online().member(1).unwrap().vars().iter().zip(before1.vars()) {
            same(x.as_tensor(), y.as_tensor(), "exploit leaves member 1");
        }
        let ((m0, v0), (m2, v2)) = (a.moments(0).unwrap(), a.moments(2).unwrap());
        for (x, y) in m0.iter().chain(&v0).zip(m2.iter().chain(&v2)) {
            same(x, y, "exploit: moments");
        }
        let applied = a.counters().unwrap().0;
        assert_eq!(applied[0], applied[2]);
        assert_eq!(a.members()[0].seed, cfgs[0].seed, "settings stay the destination's");
        run(&mut a, 5);
    }

    /// Successive halving's cut: members 1, 3 and 4 of a population of 5, kept after 60 env
    /// steps and trained 60 more, are bit for bit the population of those three trained for
    /// 120 (weights, targets, moments, counters, replays, the last update's figures), which
    /// is their solo runs (above). Bad cuts are refused and change nothing.
    #[test]
    fn retained_members_go_on_as_their_own_population() {
        let run = |pop: &mut DqnPopulation, envs: &mut [fx_kernels::CpuTradingEnv], steps: usize| {
            let mut last = None;
            for _ in 0..steps {
                let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
                last = Some(pop.step(&mut refs, true).unwrap());
            }
            last.unwrap()
        };
        let keep = [1usize, 3, 4];
        let mut a = DqnPopulation::new((0..5).map(tiny).collect(), &Device::Cpu).unwrap();
        let mut a_envs: Vec<_> = (0..5).map(|k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        run(&mut a, &mut a_envs, 60);
        for bad in [&[][..], &[3, 1], &[1, 1], &[0, 5]] {
            assert!(a.retain_members(bad).is_err(), "{bad:?}");
        }
        assert_eq!(a.len(), 5, "a refused cut changes nothing");
        a.retain_members(&keep).unwrap();
        let mut a_envs: Vec<_> =
            a_envs.into_iter().enumerate().filter(|(k, _)| keep.contains(k)).map(|(_, e)| e).collect();
        let la = run(&mut a, &mut a_envs, 60);
        let mut b = DqnPopulation::new(keep.iter().map(|&k| tiny(k)).collect(), &Device::Cpu).unwrap();
        let mut b_envs: Vec<_> = keep.iter().map(|&k| ar1_env(4, 32, 400, 3 + k as u64)).collect();
        let lb = run(&mut b, &mut b_envs, 120);
        assert_eq!(la.epsilon, lb.epsilon);
        assert_eq!(la.mean_reward, lb.mean_reward);
        assert_eq!(a.last_update().unwrap(), b.last_update().unwrap());
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        assert!(a.counters().unwrap().0.iter().all(|&u| u > 50), "trained past the cut");
        assert_eq!(a.members(), b.members());
        for (x, y) in
            a.online().vars().iter().chain(&a.target().vars()).zip(b.online().vars().iter().chain(&b.target().vars()))
        {
            same(x.as_tensor(), y.as_tensor(), "weights after the cut");
        }
        for k in 0..keep.len() {
            let ((ma, va), (mb, vb)) = (a.moments(k).unwrap(), b.moments(k).unwrap());
            for (x, y) in ma.iter().chain(&va).zip(mb.iter().chain(&vb)) {
                same(x, y, &format!("member {k} moments"));
            }
            let (ra, rb) = (a.replay(k).unwrap().stored().unwrap(), b.replay(k).unwrap().stored().unwrap());
            same(&ra.states, &rb.states, "replay states");
            same(&ra.rewards, &rb.rewards, "replay rewards");
            let names = |p: &DqnPopulation| p.online().member(k).unwrap().specs().to_vec();
            assert_eq!(names(&a), names(&b), "member {k}'s spec names");
        }
    }

    fn random_batch(n: usize, b: usize, seed: u64) -> PopBatch {
        random_batch_of(n, b, 3, seed)
    }

    /// A CPU batch of uniform values for `n` members of `b` transitions over `na` actions.
    pub(crate) fn random_batch_of(n: usize, b: usize, na: usize, seed: u64) -> PopBatch {
        let v = |len: usize, stream: u64| -> Vec<f32> {
            (0..len as u64).map(|i| (fx_kernels::rng::draw(seed, stream, 0, i) * 2.0 - 1.0) as f32).collect()
        };
        let t = |x: Vec<f32>, shape: &[usize]| Tensor::from_vec(x, shape, &Device::Cpu).unwrap();
        let half = na as f32 / 2.0;
        let actions: Vec<u32> = v(n * b, 3).iter().map(|u| ((u + 1.0) * half) as u32 % na as u32).collect();
        let dones = v(n * b, 5).iter().map(|&u| if u > 0.8 { 1.0 } else { 0.0 }).collect();
        PopBatch {
            obs: t(v(n * b * 56, 1), &[n, b, 56]),
            actions: Tensor::from_vec(actions, (n, b), &Device::Cpu).unwrap(),
            rewards: t(v(n * b, 2), &[n, b]),
            next_obs: t(v(n * b * 56, 4), &[n, b, 56]),
            dones: t(dones, &[n, b]),
        }
    }

    /// A NaN in one member's data at one update (its loss and gradient non-finite): that member
    /// skips that step (its counter says so, its weights, moments and target stay as they
    /// were) and every other member is bit-identical to a population without the injection.
    #[test]
    fn a_nan_skips_only_its_member() {
        let n = 3;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let clean = &mut DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let hit = &mut DqnPopulation::new(cfgs, &Device::Cpu).unwrap();
        for step in 0..12u64 {
            let batch = random_batch(n, 16, 100 + step);
            clean.update(&batch).unwrap();
            if step == 5 {
                let before = hit.online().member(1).unwrap();
                let target_before = hit.target().member(1).unwrap();
                let moments_before = hit.moments(1).unwrap();
                let mut r: Vec<Vec<f32>> = batch.rewards.to_vec2().unwrap();
                r[1][7] = f32::NAN;
                let bad = PopBatch { rewards: Tensor::new(r, &Device::Cpu).unwrap(), ..batch.clone() };
                hit.update(&bad).unwrap();
                let st = hit.last_update().unwrap();
                assert_eq!(st.skipped, vec![false, true, false]);
                assert!(st.loss[1].is_nan() && st.loss[0].is_finite());
                let after = hit.online().member(1).unwrap();
                for (a, b) in after.vars().iter().zip(before.vars()) {
                    same(a.as_tensor(), b.as_tensor(), "skipped member's weights");
                }
                for (a, b) in hit.target().member(1).unwrap().vars().iter().zip(target_before.vars()) {
                    same(a.as_tensor(), b.as_tensor(), "skipped member's target");
                }
                let m = hit.moments(1).unwrap();
                for (a, b) in m.0.iter().chain(&m.1).zip(moments_before.0.iter().chain(&moments_before.1)) {
                    same(a, b, "skipped member's moments");
                }
            } else {
                hit.update(&batch).unwrap();
            }
        }
        let (applied, skipped) = hit.counters().unwrap();
        assert_eq!((applied, skipped), (vec![12, 11, 12], vec![0, 1, 0]));
        for k in [0, 2] {
            for (a, b) in hit.online().vars().iter().zip(clean.online().vars()) {
                same(&a.as_tensor().get(k).unwrap(), &b.as_tensor().get(k).unwrap(), &format!("member {k}"));
            }
        }
        // Member 1 went on training from where it was: one step behind, so not equal.
        let (a, b) = (hit.online().member(1).unwrap(), clean.online().member(1).unwrap());
        assert_ne!(
            a.vars()[0].as_tensor().to_vec2::<f32>().unwrap(),
            b.vars()[0].as_tensor().to_vec2::<f32>().unwrap()
        );
    }

    /// Shape keys must agree across members; the error names the member.
    #[test]
    fn members_must_share_shape_keys() {
        let mut cfgs: Vec<DqnConfig> = (0..3).map(tiny).collect();
        cfgs[2].batch_size = 32;
        let e = DqnPopulation::new(cfgs, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("member 2") && e.contains("batch_size"), "{e}");
        let f16 = DqnConfig { precision: Precision::F16, ..tiny(0) };
        assert!(DqnPopulation::new(vec![f16], &Device::Cpu).is_err());
        assert!(DqnPopulation::new(vec![], &Device::Cpu).is_err());
        let bad_batch = random_batch(2, 8, 1);
        let mut pop = DqnPopulation::new(vec![tiny(0), tiny(1)], &Device::Cpu).unwrap();
        let e = pop.update(&bad_batch).unwrap_err().to_string();
        assert!(e.contains("obs") && e.contains("[2, 16, 56]"), "{e}");
    }

    /// The shape key separates what cannot train together and nothing else; the memory
    /// estimate grows by the replay ring's bytes exactly and is in the tens of MiB for the
    /// spec's default member.
    #[test]
    fn shape_key_and_member_bytes() {
        let a = DqnConfig::default();
        let b = DqnConfig { seed: 9, gamma: 0.9, tau: 0.01, max_grad_norm: 3.0, ..a.clone() };
        assert_eq!(DqnPopulation::shape_key(&a), DqnPopulation::shape_key(&b));
        let wide = DqnConfig { net: DqnNetConfig { hidden: 512, ..a.net }, ..a.clone() };
        assert_ne!(DqnPopulation::shape_key(&a), DqnPopulation::shape_key(&wide));
        let bytes = DqnPopulation::member_bytes(&a);
        assert!((10 << 20..200 << 20).contains(&bytes), "{bytes}");
        let bigger = DqnConfig { replay_capacity: a.replay_capacity + 1000, ..a.clone() };
        assert_eq!(DqnPopulation::member_bytes(&bigger) - bytes, 1000 * 460);
        assert!(DqnPopulation::member_bytes(&wide) > bytes);
    }

    /// A member taken out and put back is unchanged; put into another slot it is that slot's
    /// values exactly, the others untouched.
    #[test]
    fn members_move_in_and_out_of_the_store() {
        let pop = DqnPopulation::new((0..3).map(tiny).collect(), &Device::Cpu).unwrap();
        let solo = crate::DuelingDqn::new(tiny(1).net, &Device::Cpu, tiny(1).seed).unwrap();
        let m1 = pop.online().member(1).unwrap();
        for (a, b) in m1.vars().iter().zip(solo.params().vars()) {
            same(a.as_tensor(), b.as_tensor(), "member 1 starts as its solo network");
        }
        let m0 = pop.online().member(0).unwrap();
        pop.online().set_member(2, &m1).unwrap();
        for (a, b) in pop.online().member(2).unwrap().vars().iter().zip(m1.vars()) {
            same(a.as_tensor(), b.as_tensor(), "slot 2 now holds member 1");
        }
        for (a, b) in pop.online().member(0).unwrap().vars().iter().zip(m0.vars()) {
            same(a.as_tensor(), b.as_tensor(), "slot 0 untouched");
        }
        assert!(pop.online().member(3).is_err());
        assert!(solo.params().member(0).is_err(), "a solo store has no members");
    }

    /// `b` copied to `dev` (the GPU tests' batches are drawn on the CPU).
    #[cfg(feature = "cuda")]
    fn batch_on(b: &PopBatch, dev: &Device) -> PopBatch {
        PopBatch {
            obs: b.obs.to_device(dev).unwrap(),
            actions: b.actions.to_device(dev).unwrap(),
            rewards: b.rewards.to_device(dev).unwrap(),
            next_obs: b.next_obs.to_device(dev).unwrap(),
            dones: b.dones.to_device(dev).unwrap(),
        }
    }

    /// ‖a − b‖ / ‖b‖ in f64; a non-finite value of `a` fails the test.
    #[cfg(feature = "cuda")]
    fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let f = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let (a, b) = (f(a), f(b));
        assert!(a.iter().all(|x| x.is_finite()), "non-finite values");
        let d: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
        d / b.iter().map(|y| y * y).sum::<f64>().sqrt().max(1e-30)
    }

    /// On CUDA: the population (eager, and its captured graph) trains as the CPU population
    /// does, a NaN in one member's data included: the same skips and counters, weights and
    /// moments within 1e-5 relative of the CPU's after 30 updates (F32 without TF32; GPU
    /// reductions sum in another order), and the captured graph within 1e-6 of eager.
    #[cfg(feature = "cuda")]
    #[test]
    fn gpu_population_trains_as_the_cpu_one() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::gpu_population_trains_as_the_cpu_one") else { return };
        let seed = fx_hw::test_seed("gpu_population_trains_as_the_cpu_one");
        let n = 5;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut cpu = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut eager = DqnPopulation::new(cfgs.clone(), &dev).unwrap();
        let mut graph = DqnPopulation::new(cfgs, &dev).unwrap();
        let to = |b: &PopBatch| batch_on(b, &dev);
        graph.capture_update(&to(&random_batch(n, 16, seed))).unwrap();
        assert!(graph.update_captured() && graph.graph_nodes().unwrap().unwrap() > 0);
        for step in 0..30u64 {
            let mut batch = random_batch(n, 16, seed.wrapping_add(step + 1));
            if step == 7 {
                let mut r: Vec<Vec<f32>> = batch.rewards.to_vec2().unwrap();
                r[2][3] = f32::NAN;
                batch.rewards = Tensor::new(r, &Device::Cpu).unwrap();
            }
            cpu.update(&batch).unwrap();
            eager.update(&to(&batch)).unwrap();
            graph.update(&to(&batch)).unwrap();
        }
        let want = cpu.counters().unwrap();
        assert_eq!(want, (vec![30, 30, 29, 30, 30], vec![0, 0, 1, 0, 0]));
        assert_eq!(eager.counters().unwrap(), want);
        assert_eq!(graph.counters().unwrap(), want);
        for (what, pop, tol) in [("eager", &eager, 1e-5), ("graph", &graph, 1e-5)] {
            for (k, (a, b)) in pop.online().vars().iter().zip(cpu.online().vars()).enumerate() {
                let e = rel_err(a.as_tensor(), b.as_tensor());
                eprintln!("{what} online {k}: rel err {e:.2e}");
                assert!(e <= tol, "{what} online tensor {k}: rel err {e} (seed {seed})");
            }
            for (k, (a, b)) in pop.target().vars().iter().zip(cpu.target().vars()).enumerate() {
                let e = rel_err(a.as_tensor(), b.as_tensor());
                assert!(e <= tol, "{what} target tensor {k}: rel err {e} (seed {seed})");
            }
            for m in 0..n {
                let (gm, gv) = pop.moments(m).unwrap();
                let (cm, cv) = cpu.moments(m).unwrap();
                for (i, (a, b)) in gm.iter().chain(&gv).zip(cm.iter().chain(&cv)).enumerate() {
                    let e = rel_err(a, b);
                    assert!(e <= 1e-4, "{what} member {m} moment {i}: rel err {e} (seed {seed})");
                }
            }
        }
        for (k, (a, b)) in graph.online().vars().iter().zip(eager.online().vars()).enumerate() {
            let e = rel_err(a.as_tensor(), b.as_tensor());
            assert!(e <= 1e-6, "graph vs eager tensor {k}: rel err {e} (seed {seed})");
        }
    }

    /// On CUDA: PBT's moves between captured updates reach the graph. A captured population
    /// and a CPU one take 10 updates, then member 1 gets new settings (`set_member`) and
    /// member 3 continues from member 0 (`exploit`) on both, then 20 more updates: the same
    /// counters, and every member's network within 1e-5 relative of the CPU's (as one
    /// vector: see below); member 1 ends far from where its old
    /// settings take it, so a graph that kept the captured values would fail.
    #[cfg(feature = "cuda")]
    #[test]
    fn pbt_moves_reach_the_captured_update() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::pbt_moves_reach_the_captured_update") else { return };
        let seed = fx_hw::test_seed("pbt_moves_reach_the_captured_update");
        let n = 4;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let mut cpu = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut unmoved = DqnPopulation::new(cfgs.clone(), &Device::Cpu).unwrap();
        let mut graph = DqnPopulation::new(cfgs.clone(), &dev).unwrap();
        let to = |b: &PopBatch| batch_on(b, &dev);
        graph.capture_update(&to(&random_batch(n, 16, seed))).unwrap();
        let moved = DqnConfig {
            gamma: 0.5,
            tau: 0.3,
            max_grad_norm: 1.0,
            optimizer: fx_precision::AdamWConfig { lr: 0.05, weight_decay: 0.2, ..cfgs[1].optimizer },
            ..cfgs[1].clone()
        };
        for step in 0..30u64 {
            if step == 10 {
                for pop in [&mut cpu, &mut graph] {
                    pop.set_member(1, moved.clone()).unwrap();
                    pop.exploit(3, 0).unwrap();
                }
            }
            let batch = random_batch(n, 16, seed.wrapping_add(step + 1));
            cpu.update(&batch).unwrap();
            unmoved.update(&batch).unwrap();
            graph.update(&to(&batch)).unwrap();
        }
        assert!(graph.update_captured());
        assert_eq!(graph.counters().unwrap(), cpu.counters().unwrap());
        assert_eq!(cpu.counters().unwrap().0, [30, 30, 30, 30], "member 3 took member 0's step count");
        // Each member's network as one vector: the value head's bias (tensor 7) is one number,
        // a sum of terms that cancel, which Adam moves by about its learning rate whatever the
        // gradient's size; relative to its own small value its drift reached 3.6e-5 on some
        // seeds, while the network it belongs to stays within F32 rounding of the CPU's.
        let flat = |store: &crate::params::ParamStore| -> Tensor {
            let parts: Vec<Tensor> = store.vars().iter().map(|v| v.as_tensor().flatten_all().unwrap()).collect();
            Tensor::cat(&parts, 0).unwrap()
        };
        for k in 0..n {
            for (store, want, what) in
                [(graph.online(), cpu.online(), "online"), (graph.target(), cpu.target(), "target")]
            {
                let (a, b) = (store.member(k).unwrap(), want.member(k).unwrap());
                let e = rel_err(&flat(&a), &flat(&b));
                let worst = a
                    .vars()
                    .iter()
                    .zip(b.vars())
                    .map(|(x, y)| rel_err(x.as_tensor(), y.as_tensor()))
                    .fold(0.0, f64::max);
                eprintln!("member {k} {what}: rel err {e:.2e} (worst tensor {worst:.2e})");
                assert!(e <= 1e-5, "member {k} {what}: rel err {e} (seed {seed})");
            }
        }
        let far = graph
            .online()
            .member(1)
            .unwrap()
            .vars()
            .iter()
            .zip(unmoved.online().member(1).unwrap().vars())
            .map(|(a, b)| rel_err(a.as_tensor(), b.as_tensor()))
            .fold(0.0, f64::max);
        assert!(far > 1e-3, "member 1's new settings change its training: {far:.2e} (seed {seed})");
    }

    /// Two populations trained alike on the GPU: the same counters, env states and replays
    /// bit for bit, and online weights within 1e-6 relative (the same kernels on the same
    /// minibatches; the bound only allows for a reduction that sums in another order).
    #[cfg(feature = "cuda")]
    fn trained_alike(
        (a, a_envs): (&DqnPopulation, &[fx_kernels::GpuTradingEnv]),
        (b, b_envs): (&DqnPopulation, &[fx_kernels::GpuTradingEnv]),
        what: &str,
    ) {
        assert_eq!(a.counters().unwrap(), b.counters().unwrap(), "{what}: counters");
        for k in 0..a.len() {
            assert_eq!(a_envs[k].state().unwrap(), b_envs[k].state().unwrap(), "{what}: member {k} env state");
            let (x, y) = (a.replay(k).unwrap().stored().unwrap(), b.replay(k).unwrap().stored().unwrap());
            same_replay(&x, &y, &format!("{what}: member {k} replay"));
        }
        for (i, (x, y)) in a.online().vars().iter().zip(b.online().vars()).enumerate() {
            let e = rel_err(x.as_tensor(), y.as_tensor());
            eprintln!("{what} online {i}: rel err {e:.2e}");
            assert!(e <= 1e-6, "{what}: online tensor {i}: rel err {e}");
        }
    }

    /// Two populations of `n` [`tiny`] members on GPU envs of their own: one taking the
    /// member-batched collection, one the per-member path.
    #[cfg(feature = "cuda")]
    fn batched_and_per_member(
        n: usize,
        dev: &Device,
    ) -> (DqnPopulation, Vec<fx_kernels::GpuTradingEnv>, DqnPopulation, Vec<fx_kernels::GpuTradingEnv>) {
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let gpu_envs = || -> Vec<fx_kernels::GpuTradingEnv> {
            (0..n).map(|k| crate::synthetic::ar1_gpu_env(4, 32, 400, 3 + k as u64, dev)).collect()
        };
        let fast = DqnPopulation::new(cfgs.clone(), dev).unwrap();
        let mut slow = DqnPopulation::new(cfgs, dev).unwrap();
        slow.batched = false;
        (fast, gpu_envs(), slow, gpu_envs())
    }

    /// On CUDA with GPU envs: the member-batched collection and sampling (one launch per
    /// step for all members, minibatches drawn into the captured update's inputs) train the
    /// population the per-member path trains over 150 env steps: bit-identical env states,
    /// replay contents, per-step rewards and episode counts, the same counters, and weights
    /// within 1e-6 relative (the update kernels are the same on the same minibatches; the
    /// bound only allows for a reduction that sums in another order between runs).
    #[cfg(feature = "cuda")]
    #[test]
    fn batched_collection_trains_as_the_per_member_path() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::batched_collection_trains_as_the_per_member_path") else {
            return;
        };
        let n = 5;
        let (mut fast, mut fast_envs, mut slow, mut slow_envs) = batched_and_per_member(n, &dev);
        let mut updates = 0;
        for step in 0..150 {
            let read = step % 10 == 0;
            let f = step_on(&mut fast, &mut fast_envs, read);
            let s = step_on(&mut slow, &mut slow_envs, read);
            assert!(fast.collect.is_some() && slow.collect.is_none(), "step {step}: the paths taken");
            assert_eq!(f.mean_reward, s.mean_reward, "step {step}: rewards");
            assert_eq!(f.episodes_done, s.episodes_done, "step {step}: episodes");
            assert_eq!((f.replay_len, f.updates_queued), (s.replay_len, s.updates_queued), "step {step}");
            for (a, b) in f.updates.iter().zip(&s.updates) {
                assert_eq!(a.skipped, b.skipped, "step {step}: skips");
            }
            updates += f.updates.len() + f.updates_queued as usize;
        }
        assert!(updates > 100, "{updates} updates");
        assert!(fast.update_captured() && slow.update_captured());
        trained_alike((&fast, &fast_envs), (&slow, &slow_envs), "batched vs per-member");
    }

    /// On CUDA with GPU envs: whole iterations as one graph each (`iteration_step`: the
    /// collection, the loop counters' advance, two minibatch draws and updates a round every
    /// second step) train the population exactly as the same steps launched kernel by kernel
    /// on the batched path, over 160 env steps with the rings wrapping, ε ramping, member 1
    /// starting over at env step 40 (its clock, its masked rounds until its own transitions
    /// reach `learning_starts`) and reads every 10th step: the same ε, rewards, episodes,
    /// replay lengths and update counts at every step, bit-identical env states and replays,
    /// the same counters, host clocks and draw count, and weights within 1e-6 relative (the
    /// bound of the other GPU-path comparisons here: the same kernels on the same minibatches;
    /// it only allows for a reduction that sums in another order between runs). Both kinds of
    /// iteration graph (collection only, and with a round) must have been captured. Should
    /// only the env states differ, suspect the collection's Q forward (candle's cuBLAS
    /// matmuls, captured on one side and eager on the other) before the loop counters.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_iteration_graph_trains_as_the_stepwise_population() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::the_iteration_graph_trains_as_the_stepwise_population")
        else {
            return;
        };
        let n = 3;
        let cfg =
            |k: usize| DqnConfig { train_every: 2, gradient_steps: 2, graph: fx_precision::GraphMode::On, ..tiny(k) };
        let cfgs: Vec<DqnConfig> = (0..n).map(cfg).collect();
        let new = DqnConfig { seed: 4321, ..cfg(5) };
        let gpu_envs = || -> Vec<fx_kernels::GpuTradingEnv> {
            (0..n).map(|k| crate::synthetic::ar1_gpu_env(4, 32, 400, 3 + k as u64, &dev)).collect()
        };
        let (mut graph, mut graph_envs) = (DqnPopulation::new(cfgs.clone(), &dev).unwrap(), gpu_envs());
        let (mut stepwise, mut stepwise_envs) = (DqnPopulation::new(cfgs, &dev).unwrap(), gpu_envs());
        graph.set_iteration_graphs(true);
        stepwise.set_iteration_graphs(false);
        let mut updates = 0;
        for step in 0..160u64 {
            if step == 40 {
                for (pop, envs) in [(&mut graph, &mut graph_envs), (&mut stepwise, &mut stepwise_envs)] {
                    pop.replace_member(1, new.clone()).unwrap();
                    envs[1] = crate::synthetic::ar1_gpu_env(4, 32, 400, 77, &dev);
                }
                // A draw before the next step: the kept collector's table already holds the
                // new member's seed and clocks (the other population draws per member).
                let (a, b) = (graph.sample().unwrap(), stepwise.sample().unwrap());
                for (x, y, what) in [(&a.obs, &b.obs, "obs"), (&a.rewards, &b.rewards, "rewards")] {
                    same(x, y, &format!("a draw right after the replacement: {what}"));
                }
            }
            let read = step % 10 == 0;
            let g = step_on(&mut graph, &mut graph_envs, read);
            let s = step_on(&mut stepwise, &mut stepwise_envs, read);
            assert_eq!(g.epsilon, s.epsilon, "step {step}: ε");
            assert_eq!((&g.mean_reward, &g.episodes_done), (&s.mean_reward, &s.episodes_done), "step {step}");
            assert_eq!(g.replay_len, s.replay_len, "step {step}: replay length");
            let count = |x: &PopStepStats| x.updates.len() + x.updates_queued as usize;
            assert_eq!(count(&g), count(&s), "step {step}: updates");
            if let (Some(a), Some(b)) = (g.updates.last(), s.updates.last()) {
                assert_eq!(a.skipped, b.skipped, "step {step}: the round's last update's skips");
            }
            updates += count(&g);
        }
        assert!(graph.iteration_graph_active() && !stepwise.iteration_graph_active());
        assert!(graph.iteration_graph_steps() > 150 && stepwise.iteration_graph_steps() == 0);
        let it = graph.collect.as_ref().and_then(|bc| bc.iteration.as_ref());
        assert!(it.is_some_and(|it| it.has(true) && it.has(false)), "both iteration graphs captured");
        assert!(updates > 100, "{updates} updates");
        let host = |p: &DqnPopulation| (p.env_steps, p.sampled, p.clocks.clone(), p.own.clone(), p.learning.clone());
        assert_eq!(host(&graph), host(&stepwise), "host counters, clocks and flags");
        let applied = graph.counters().unwrap().0;
        assert!(applied[1] > 20 && applied[0] > applied[1], "the new member learns later: {applied:?}");
        trained_alike((&graph, &graph_envs), (&stepwise, &stepwise_envs), "iteration graph vs stepwise");
    }

    /// On CUDA with GPU envs, a member that starts over mid-run (a new trial in a freed
    /// slot): the batched collection and sampling (its clock in the collector's table, its
    /// masked rounds in the captured update) train the population as the per-member path
    /// (its window drawn on the host) does over 120 more env steps: bit-identical env
    /// states, replays, rewards and skips, the same counters, weights within 1e-6 relative;
    /// and the new member took as many optimiser steps as its solo trainer.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_member_that_starts_over_trains_alike_on_both_gpu_paths() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::a_member_that_starts_over_trains_alike_on_both_gpu_paths")
        else {
            return;
        };
        let n = 3;
        let (mut fast, mut fast_envs, mut slow, mut slow_envs) = batched_and_per_member(n, &dev);
        let new = DqnConfig { seed: 1234, ..tiny(4) };
        let mut solo = DqnTrainer::new(new.clone(), &dev).unwrap();
        let mut solo_env = crate::synthetic::ar1_gpu_env(4, 32, 400, 77, &dev);
        for step in 0..157 {
            if step == 37 {
                for (pop, envs) in [(&mut fast, &mut fast_envs), (&mut slow, &mut slow_envs)] {
                    pop.replace_member(1, new.clone()).unwrap();
                    envs[1] = crate::synthetic::ar1_gpu_env(4, 32, 400, 77, &dev);
                }
            }
            let read = step % 10 == 0;
            let f = step_on(&mut fast, &mut fast_envs, read);
            let s = step_on(&mut slow, &mut slow_envs, read);
            if step >= 37 {
                let t = solo.step_with(&mut solo_env, read).unwrap();
                assert_eq!(t.epsilon, f.epsilon[1], "step {step}: the new member's ε");
            }
            assert!(fast.collect.is_some() && slow.collect.is_none(), "step {step}: the paths taken");
            assert_eq!((&f.mean_reward, &f.episodes_done), (&s.mean_reward, &s.episodes_done), "step {step}");
            for (a, b) in f.updates.iter().zip(&s.updates) {
                assert_eq!(a.skipped, b.skipped, "step {step}: skips");
            }
        }
        assert!(fast.update_captured() && slow.update_captured());
        solo.sync_counters().unwrap();
        let applied = fast.counters().unwrap().0;
        assert_eq!(applied[1], solo.updates(), "the new member's optimiser steps");
        assert!(applied[1] > 50 && applied[0] > applied[1], "{applied:?}");
        trained_alike((&fast, &fast_envs), (&slow, &slow_envs), "start over, batched vs per-member");
    }

    /// On CUDA (GPU envs, the batched collection, the captured update), a population saved
    /// mid-run and restored with its environments' states goes on as the one that never
    /// stopped: the same rewards, episodes, replays and counters at every step, and weights
    /// within 1e-6 relative (the restored one captures its update again: the same kernels on
    /// the same minibatches; the bound only allows for a reduction that sums in another order).
    #[cfg(feature = "cuda")]
    #[test]
    fn a_restored_population_goes_on_on_the_gpu() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::a_restored_population_goes_on_on_the_gpu") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let n = 4;
        let cfgs: Vec<DqnConfig> = (0..n).map(tiny).collect();
        let gpu_envs = || -> Vec<fx_kernels::GpuTradingEnv> {
            (0..n).map(|k| crate::synthetic::ar1_gpu_env(4, 32, 400, 3 + k as u64, &dev)).collect()
        };
        let mut a_envs = gpu_envs();
        let mut a = DqnPopulation::new(cfgs, &dev).unwrap();
        for t in 0..60 {
            step_on(&mut a, &mut a_envs, t % 10 == 0);
        }
        assert!(a.update_captured() && a.collect.is_some(), "the fast paths ran before the save");
        let path = dir.path().join("pop.safetensors");
        a.snapshot().unwrap().write(&path).unwrap();
        let mut b = DqnPopulation::load_state(&path, &dev).unwrap();
        let mut b_envs = gpu_envs();
        for (eb, ea) in b_envs.iter_mut().zip(&a_envs) {
            eb.restore(&ea.state().unwrap()).unwrap();
        }
        for t in 0..60 {
            let (x, y) = (step_on(&mut a, &mut a_envs, true), step_on(&mut b, &mut b_envs, true));
            assert_eq!(x.mean_reward, y.mean_reward, "step {t}: rewards");
            assert_eq!(x.episodes_done, y.episodes_done, "step {t}: episodes");
            assert_eq!(x.replay_len, y.replay_len);
            for (u, v) in x.updates.iter().zip(&y.updates) {
                assert_eq!(u.skipped, v.skipped, "step {t}: skips");
            }
        }
        assert!(b.update_captured() && b.collect.is_some(), "the restored one takes the fast paths");
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for k in 0..n {
            assert_eq!(a_envs[k].state().unwrap(), b_envs[k].state().unwrap(), "member {k} env state");
            let (x, y) = (a.replay(k).unwrap().stored().unwrap(), b.replay(k).unwrap().stored().unwrap());
            same(&x.states, &y.states, &format!("member {k} replay states"));
            same(&x.actions, &y.actions, &format!("member {k} replay actions"));
        }
        for (i, (x, y)) in a.online().vars().iter().zip(b.online().vars()).enumerate() {
            let e = rel_err(x.as_tensor(), y.as_tensor());
            eprintln!("restored vs uninterrupted online {i}: rel err {e:.2e}");
            assert!(e <= 1e-6, "online tensor {i}: rel err {e}");
        }
    }

    /// On CUDA, successive halving's cut through the captured update and the batched
    /// collection. Updates on fixed random batches: members 1 and 3 of 4, kept after 20
    /// captured updates and updated 20 more (captured again at the new size), track the
    /// population of those two updated on the same batches (the same kernels at another size:
    /// within the fused kernels' F32 tolerance). Whole steps on GPU envs: after the cut the
    /// batched collection and the captured update are rebuilt and the counters go on.
    #[cfg(feature = "cuda")]
    #[test]
    fn retained_members_go_on_through_the_captured_update() {
        let Some(dev) = fx_hw::test_gpu("dqn::population::retained_members_go_on_through_the_captured_update") else {
            return;
        };
        let seed = fx_hw::test_seed("retained_members_go_on_through_the_captured_update");
        let keep = [1usize, 3];
        let idx = Tensor::new(&[1u32, 3], &Device::Cpu).unwrap();
        let pick = |b: &PopBatch| {
            let f = |t: &Tensor| t.index_select(&idx, 0).unwrap();
            PopBatch {
                obs: f(&b.obs),
                actions: f(&b.actions),
                rewards: f(&b.rewards),
                next_obs: f(&b.next_obs),
                dones: f(&b.dones),
            }
        };
        let to = |b: &PopBatch| batch_on(b, &dev);
        let mut a = DqnPopulation::new((0..4).map(tiny).collect(), &dev).unwrap();
        let mut b = DqnPopulation::new(keep.iter().map(|&k| tiny(k)).collect(), &dev).unwrap();
        a.capture_update(&to(&random_batch(4, 16, seed))).unwrap();
        b.capture_update(&to(&pick(&random_batch(4, 16, seed)))).unwrap();
        for step in 0..40u64 {
            if step == 20 {
                a.retain_members(&keep).unwrap();
                assert!(!a.update_captured(), "a cut drops the old capture");
                a.capture_update(&to(&pick(&random_batch(4, 16, seed)))).unwrap();
            }
            let batch = random_batch(4, 16, seed.wrapping_add(step + 1));
            a.update(&to(&if step < 20 { batch.clone() } else { pick(&batch) })).unwrap();
            b.update(&to(&pick(&batch))).unwrap();
        }
        assert_eq!(a.counters().unwrap(), b.counters().unwrap());
        for (i, (x, y)) in a
            .online()
            .vars()
            .iter()
            .chain(&a.target().vars())
            .zip(b.online().vars().iter().chain(&b.target().vars()))
            .enumerate()
        {
            let e = rel_err(x.as_tensor(), y.as_tensor());
            eprintln!("cut vs fresh tensor {i}: rel err {e:.2e}");
            assert!(e <= 1e-5, "tensor {i}: rel err {e} (seed {seed})");
        }
        // Whole steps: the fast paths before and after a cut.
        let env = |k: usize| crate::synthetic::ar1_gpu_env(4, 32, 400, 3 + k as u64, &dev);
        let run = |pop: &mut DqnPopulation, envs: &mut [fx_kernels::GpuTradingEnv], steps: usize| {
            for _ in 0..steps {
                let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e as &mut dyn VecEnv).collect();
                pop.step(&mut refs, false).unwrap();
            }
        };
        let mut c = DqnPopulation::new((0..4).map(tiny).collect(), &dev).unwrap();
        let mut envs: Vec<_> = (0..4).map(env).collect();
        run(&mut c, &mut envs, 60);
        assert!(c.update_captured() && c.collect.is_some(), "the fast paths ran before the cut");
        let before = c.counters().unwrap().0;
        c.retain_members(&keep).unwrap();
        assert!(!c.update_captured() && c.collect.is_none(), "rebuilt for the new size");
        let mut envs: Vec<_> = envs.into_iter().enumerate().filter(|(k, _)| keep.contains(k)).map(|(_, e)| e).collect();
        run(&mut c, &mut envs, 60);
        assert!(c.update_captured() && c.collect.is_some(), "captured again after the cut");
        let after = c.counters().unwrap().0;
        assert!(after.len() == 2 && after[0] > before[1] && after[1] > before[3], "{before:?} -> {after:?}");
    }
}
