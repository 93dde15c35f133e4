//! The PPO algorithm: rollouts of `E` environments × `T` steps (actions sampled with the
//! env's counter-based draws), GAE (γ 0.99, λ 0.95), then `K` epochs of shuffled
//! minibatches with Adam and global-norm clipping, reporting approx KL, clip fraction
//! and explained variance. One [`PpoTrainer::iterate`] is one collect + update, so a CLI
//! can log and checkpoint between iterations.
//!
//! The minibatch shuffle is a Fisher–Yates permutation from counter-based draws keyed by
//! the epoch count, so runs and resumes are bit-identical on the CPU.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use fx_kernels::{GaeConfig, Rollout, VecEnv};
use fx_precision::{Adam, AdamConfig, GradScaler, GraphMode, Precision, TrainStep};
use serde::{Deserialize, Serialize};

use crate::error::{Context, Error, Result};
use crate::ppo::{ppo_loss, ActorCritic, PpoBatch, PpoLossConfig, PpoNetConfig};

/// Stream of the counter-based draws of the minibatch shuffle.
const SHUFFLE_STREAM: u64 = 0x5348;
/// Metadata key of the trainer state in a state file.
const STATE_KEY: &str = "fx.ppo_trainer";
/// Version of the state file layout.
const STATE_VERSION: u32 = 1;

/// Everything a PPO run is configured by (defaults: MODELS.md where it speaks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoConfig {
    /// Network dimensions.
    pub net: PpoNetConfig,
    /// Compute precision of forward/backward (weights and optimiser stay F32).
    pub precision: Precision,
    /// Loss coefficients (clip 0.2, value 0.5, entropy 0.01, advantage eps 1e-8).
    pub loss: PpoLossConfig,
    /// GAE γ 0.99, λ 0.95.
    pub gae: GaeConfig,
    /// Adam (lr 3e-4, eps 1e-5, no weight decay).
    pub optimizer: AdamConfig,
    /// Global gradient-norm clip over actor and critic (0.5).
    pub max_grad_norm: f64,
    /// Rollout length `T` (steps per environment per iteration).
    pub num_steps: usize,
    /// Epochs `K` over each rollout.
    pub epochs: usize,
    /// Minibatch size (the last, smaller minibatch of an epoch is kept if it has ≥ 2 rows).
    pub minibatch_size: usize,
    /// Seed of the weight initialisation and the shuffles.
    pub seed: u64,
    /// On CUDA: each minibatch update (loss, backward, guard, clip, Adam) as one replayed
    /// CUDA graph (`auto`: fall back to eager with a warning if capture fails).
    pub graph: GraphMode,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            net: PpoNetConfig::default(),
            precision: Precision::F32,
            loss: PpoLossConfig::default(),
            gae: GaeConfig::default(),
            optimizer: AdamConfig { lr: 3e-4, beta1: 0.9, beta2: 0.999, eps: 1e-5, weight_decay: 0.0 },
            max_grad_norm: 0.5,
            num_steps: 128,
            epochs: 4,
            minibatch_size: 2048,
            seed: 0,
            graph: GraphMode::Auto,
        }
    }
}

impl PpoConfig {
    /// Refuses a configuration that cannot train with `num_envs` accounts (or trains
    /// nothing), naming the key (as in a run config's `[ppo]` section), its value and the
    /// rule; checked by the trainer, the population and a run config before anything is
    /// written.
    pub fn validate(&self, num_envs: usize) -> Result<()> {
        let bad = |m: String| Err(Error::config("ppo", m));
        if self.num_steps == 0 || self.epochs == 0 || self.minibatch_size < 2 || num_envs == 0 {
            return bad(format!(
                "num_steps ({}), epochs ({}) and num_envs ({num_envs}) must be positive and minibatch_size ({}) >= 2",
                self.num_steps, self.epochs, self.minibatch_size
            ));
        }
        if self.net.state_dim != fx_kernels::OBS_DIM {
            return bad(format!(
                "net.state_dim {} differs from the environment's {}",
                self.net.state_dim,
                fx_kernels::OBS_DIM
            ));
        }
        if self.max_grad_norm.is_nan() || self.max_grad_norm <= 0.0 {
            return bad(format!("max_grad_norm ({}) must be positive", self.max_grad_norm));
        }
        let lr = self.optimizer.lr;
        if !(lr.is_finite() && lr > 0.0) {
            return bad(format!("optimizer.lr ({lr}) must be finite and positive: nothing would train"));
        }
        let (g, l) = (self.gae.gamma, self.gae.lambda);
        if !((0.0..=1.0).contains(&g) && (0.0..=1.0).contains(&l)) {
            return bad(format!("gae.gamma ({g}) and gae.lambda ({l}) must be in [0, 1]"));
        }
        let c = &self.loss;
        if !(c.clip.is_finite() && c.clip > 0.0 && c.adv_eps.is_finite() && c.adv_eps > 0.0) {
            return bad(format!("loss.clip ({}) and loss.adv_eps ({}) must be finite and positive", c.clip, c.adv_eps));
        }
        if !(c.vf_coef.is_finite() && c.vf_coef >= 0.0 && c.ent_coef.is_finite() && c.ent_coef >= 0.0) {
            return bad(format!(
                "loss.vf_coef ({}) and loss.ent_coef ({}) must be finite and >= 0",
                c.vf_coef, c.ent_coef
            ));
        }
        Ok(())
    }
}

/// What one minibatch optimiser step did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PpoMinibatchStats {
    /// Total loss before the step.
    pub loss: f64,
    /// Clipped surrogate loss.
    pub l_clip: f64,
    /// Value loss `0.5 mean((V − R)²)`.
    pub l_v: f64,
    /// Mean entropy.
    pub entropy: f64,
    /// Approximate KL `mean((r − 1) − ln r)`.
    pub approx_kl: f64,
    /// Fraction of ratios outside `[1 − clip, 1 + clip]`.
    pub clip_frac: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// True when a non-finite loss or gradient made the trainer skip the step.
    pub skipped: bool,
}

/// What one iteration (collect + update) did: rollout statistics and the means of the
/// minibatch statistics over all epochs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PpoIterStats {
    /// Iterations completed (after this one).
    pub iteration: u64,
    /// Environment steps taken so far (each of all `E` accounts).
    pub env_steps: u64,
    /// Mean reward per account and step of the rollout.
    pub mean_reward: f64,
    /// Episodes that ended during the rollout.
    pub episodes_done: u32,
    /// Mean of the minibatch statistics.
    pub mean: PpoMinibatchStats,
    /// Minibatch steps skipped for non-finite values.
    pub skipped: u32,
    /// `1 − Var(R − V) / Var(R)` over the rollout (values at collection time).
    pub explained_variance: f64,
}

/// Host seconds of [`PpoTrainer::update`]'s phases, summed over iterations (for profiles:
/// on a GPU, the device idles in whatever part of `prepare`, `launch` and `finish` it has
/// no queued work for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct UpdatePhases {
    /// The critic's value of the last states, GAE, the minibatch permutations.
    pub prepare: f64,
    /// Queueing the epochs' updates (one graph replay, or the minibatch steps).
    pub launch: f64,
    /// Waiting for the device to finish them (the statistics' read).
    pub device_wait: f64,
    /// The rollout's statistics (explained variance, rewards, episodes) read back.
    pub finish: f64,
}

/// Counters saved with the state (JSON in the state file's metadata).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PpoCounters {
    version: u32,
    iterations: u64,
    env_steps: u64,
    epochs_done: u64,
    updates: u64,
    skipped_updates: u64,
    num_envs: usize,
    config: PpoConfig,
}

impl crate::state_meta::Versioned for PpoCounters {
    fn version(&self) -> u32 {
        self.version
    }
}

/// The PPO learner: actor-critic, Adam, rollout storage and counters.
pub struct PpoTrainer {
    cfg: PpoConfig,
    model: ActorCritic,
    step: TrainStep<Adam>,
    rollout: Rollout,
    num_envs: usize,
    iterations: u64,
    env_steps: u64,
    epochs_done: u64,
    updates: u64,
    skipped_updates: u64,
    /// Host seconds building the loss (forward), for profiles.
    forward_seconds: f64,
    /// Host seconds of the update's phases, for profiles.
    phases: UpdatePhases,
    /// Everything the trainer does differently on CUDA (fused update and forward, captured
    /// update, rollout and epochs); empty until the first step on a CUDA device.
    #[cfg(feature = "cuda")]
    accel: PpoAccel,
}

/// The PPO trainer's CUDA acceleration, in one place: each part is built lazily at the first
/// step or update that can use it and dropped (or refused for the trainer's life) as the
/// module docs say.
#[cfg(feature = "cuda")]
struct PpoAccel {
    /// The captured minibatch update (CUDA, `graph` not off), built at the first update.
    graph: crate::graph_update::GraphSlot,
    /// The fused F32 update the graph captures (None: the candle update is captured).
    engine: Option<crate::ppo::fused::PpoFused>,
    /// The fused rollout forward (CUDA), built at the first collection step for the env's
    /// number of accounts; None: candle's forward.
    rollout_forward: Option<crate::mlp::PpoForward>,
    /// The whole rollout as one graph (GPU env, fused forward, `graph` not off), built at
    /// the first rollout; None before, or off.
    rollout_graph: Option<crate::ppo::rollout::RolloutGraph>,
    /// Whether whole-rollout graphs may be used (on by default; a failed `auto` capture
    /// turns them off for the trainer's life).
    rollout_graphs: bool,
    /// An iteration's epochs × minibatch updates as one graph (built at the first update
    /// with a captured minibatch update); None before, or off.
    epochs_graph: Option<crate::ppo::epochs::EpochsGraph>,
    /// Whether epochs graphs may be used (as `rollout_graphs`).
    epochs_graphs: bool,
}

#[cfg(feature = "cuda")]
impl Default for PpoAccel {
    fn default() -> Self {
        Self {
            graph: Default::default(),
            engine: None,
            rollout_forward: None,
            rollout_graph: None,
            rollout_graphs: true,
            epochs_graph: None,
            epochs_graphs: true,
        }
    }
}

impl std::fmt::Debug for PpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PpoTrainer")
            .field("iterations", &self.iterations)
            .field("env_steps", &self.env_steps)
            .field("updates", &self.updates)
            .finish()
    }
}

impl PpoTrainer {
    /// A fresh learner for `num_envs` environments on `device`.
    pub fn new(cfg: PpoConfig, num_envs: usize, device: &Device) -> Result<Self> {
        const CTX: &str = "PpoTrainer::new";
        cfg.validate(num_envs)?;
        let mut model = ActorCritic::new(cfg.net, device, cfg.seed)?;
        model.set_precision(cfg.precision);
        let named = model.params().named_vars();
        let opt = Adam::new(named, cfg.optimizer).ctx(CTX)?;
        // Loss scaling (F16 only), clipping, the NaN/Inf guard and Adam in one place.
        let step = TrainStep::new(opt, GradScaler::for_precision(cfg.precision), Some(cfg.max_grad_norm)).ctx(CTX)?;
        let rollout = Rollout::new(cfg.num_steps, num_envs, device).ctx(CTX)?;
        Ok(Self {
            cfg,
            model,
            step,
            rollout,
            num_envs,
            iterations: 0,
            env_steps: 0,
            epochs_done: 0,
            updates: 0,
            skipped_updates: 0,
            forward_seconds: 0.0,
            phases: UpdatePhases::default(),
            #[cfg(feature = "cuda")]
            accel: PpoAccel::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PpoConfig {
        &self.cfg
    }

    /// The actor-critic.
    pub fn model(&self) -> &ActorCritic {
        &self.model
    }

    /// Iterations completed.
    pub fn iterations(&self) -> u64 {
        self.iterations
    }

    /// Environment steps taken.
    pub fn env_steps(&self) -> u64 {
        self.env_steps
    }

    /// Minibatch optimiser steps taken (skipped ones not counted).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Minibatch steps skipped for a non-finite loss or gradient.
    pub fn skipped_updates(&self) -> u64 {
        self.skipped_updates
    }

    /// Host seconds of the minibatch updates so far: loss forward, then the backward /
    /// device-wait / optimiser split of `TrainStep` (see [`fx_precision::StepTimes`]).
    /// Not saved in checkpoints.
    pub fn update_times(&self) -> (f64, fx_precision::StepTimes) {
        (self.forward_seconds, self.step.times())
    }

    /// Host seconds of the updates' phases so far (see [`UpdatePhases`]).
    pub fn update_phases(&self) -> UpdatePhases {
        self.phases
    }

    /// Actions sampled from the policy (`[E]` u32) with the env's stream-3 draws.
    pub fn act(&self, env: &dyn VecEnv) -> Result<Tensor> {
        let probs = self.model.probs_inference(&env.observe().ctx("PpoTrainer::act")?)?;
        env.sample_from_probs(&probs).ctx("PpoTrainer::act")
    }

    /// One iteration: a rollout of `T` steps from `env` ([`PpoTrainer::collect_step`]
    /// until full), then [`PpoTrainer::update`].
    pub fn iterate(&mut self, env: &mut dyn VecEnv) -> Result<PpoIterStats> {
        self.collect_rollout(env)?;
        self.update(env)
    }

    /// Fills the rollout: as one replayed graph on the GPU env when it can (see
    /// `ppo::rollout`), else [`PpoTrainer::collect_step`] until full.
    pub fn collect_rollout(&mut self, env: &mut dyn VecEnv) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.rollout.is_empty() && self.rollout_by_graph(env)? {
            return Ok(());
        }
        while !self.collect_step(env)? {}
        Ok(())
    }

    /// Allows or forbids whole-rollout graphs (on by default; see `ppo::rollout`). Off, a
    /// CUDA rollout launches its steps one by one: the same kernels, for comparisons.
    #[cfg(feature = "cuda")]
    pub fn set_rollout_graphs(&mut self, on: bool) {
        self.accel.rollout_graphs = on;
        if !on {
            self.accel.rollout_graph = None;
        }
    }

    /// Whether a whole-rollout graph is captured (GPU-env rollouts then run as one).
    #[cfg(feature = "cuda")]
    pub fn rollout_graph_active(&self) -> bool {
        self.accel.rollout_graph.is_some()
    }

    /// Collects a whole rollout as one replayed graph when it can (CUDA, the GPU env, the
    /// fused forward, `graph` not off, rollout graphs on); false: take the stepwise path.
    /// A failed capture under `graph = auto` warns once and turns rollout graphs off.
    #[cfg(feature = "cuda")]
    fn rollout_by_graph(&mut self, env: &mut dyn VecEnv) -> Result<bool> {
        const CTX: &str = "PpoTrainer::iterate (rollout graph)";
        let Some(genv) = env.as_gpu() else { return Ok(false) };
        let on_cuda = self.model.params().device().is_cuda();
        if !self.accel.rollout_graphs || self.cfg.graph == GraphMode::Off || !on_cuda {
            return Ok(false);
        }
        if !crate::ppo::fused::PpoFused::supports(&self.model) || genv.num_envs() != self.num_envs {
            return Ok(false);
        }
        if self.accel.rollout_graph.as_ref().is_some_and(|g| !g.fits(genv)) {
            self.accel.rollout_graph = None;
        }
        if self.accel.rollout_graph.is_none() {
            self.ensure_rollout_forward(self.num_envs)?;
            let forward = self.accel.rollout_forward.as_ref().ok_or_else(|| Error::config(CTX, "no fused forward"))?;
            let captured = crate::ppo::rollout::RolloutGraph::capture(genv, forward, &self.model, &self.rollout);
            match crate::graph_update::settle_capture(
                self.cfg.graph,
                "PPO rollout",
                "collecting step by step",
                captured,
            )? {
                Some(g) => self.accel.rollout_graph = Some(g),
                None => {
                    self.accel.rollout_graphs = false;
                    return Ok(false);
                }
            }
        }
        let g = self.accel.rollout_graph.as_ref().ok_or_else(|| Error::config(CTX, "no rollout graph"))?;
        g.replay()?;
        let t = self.rollout.horizon();
        self.rollout.record_rows(t);
        self.env_steps += t as u64;
        Ok(true)
    }

    /// Steps in the current rollout (0 between iterations).
    pub fn rollout_len(&self) -> usize {
        self.rollout.len()
    }

    /// One collection step: the policy's actions (stream-3 draws) for all `E`
    /// environments, stored in the rollout. Returns true when the rollout is full and
    /// [`PpoTrainer::update`] is due. Rewards and dones are summed on the device and read
    /// once per iteration.
    pub fn collect_step(&mut self, env: &mut dyn VecEnv) -> Result<bool> {
        const CTX: &str = "PpoTrainer::collect_step";
        if env.num_envs() != self.num_envs {
            return Err(Error::shape("env", CTX, format!("{} environments", self.num_envs), env.num_envs()));
        }
        if self.rollout.is_full() {
            return Ok(true);
        }
        let obs = env.observe().ctx(CTX)?;
        let (logits, values) = self.rollout_forward(&obs)?;
        env.step_into_rollout(&logits, &values, &mut self.rollout).ctx(CTX)?;
        self.env_steps += 1;
        Ok(self.rollout.is_full())
    }

    /// Builds the fused rollout forward for `rows` accounts unless it has them (CUDA).
    #[cfg(feature = "cuda")]
    fn ensure_rollout_forward(&mut self, rows: usize) -> Result<()> {
        if self.accel.rollout_forward.as_ref().is_none_or(|f| f.rows() != rows) {
            // A captured rollout reads the old forward's buffers: it goes first.
            self.accel.rollout_graph = None;
            self.accel.rollout_forward = Some(crate::mlp::PpoForward::new(&self.model, rows)?);
        }
        Ok(())
    }

    /// Logits and values of `obs` for the rollout: the fused forward on CUDA when the network
    /// is one it covers (built once for this many rows), candle's otherwise. The fused
    /// results are its buffers, overwritten by the next call: both callers consume them at
    /// once (stream-ordered), the env step copying them into the rollout.
    fn rollout_forward(&mut self, obs: &Tensor) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if obs.device().is_cuda() && crate::ppo::fused::PpoFused::supports(&self.model) {
            self.ensure_rollout_forward(obs.dim(0).ctx("PpoTrainer::rollout_forward")?)?;
            if let Some(f) = &self.accel.rollout_forward {
                return f.forward(&self.model, obs);
            }
        }
        self.model.forward_inference(obs)
    }

    /// The update after a full rollout: GAE from the critic's value of `env`'s current
    /// states, then `K` epochs of shuffled minibatch steps; clears the rollout.
    pub fn update(&mut self, env: &dyn VecEnv) -> Result<PpoIterStats> {
        const CTX: &str = "PpoTrainer::update";
        if !self.rollout.is_full() {
            return Err(Error::config(
                CTX,
                format!("the rollout holds {} of {} steps", self.rollout.len(), self.cfg.num_steps),
            ));
        }
        let started = std::time::Instant::now();
        let (_, last_value) = self.rollout_forward(&env.observe().ctx(CTX)?)?;
        let (adv, ret) = self.rollout.advantages(&last_value, self.cfg.gae).ctx(CTX)?;
        let n = self.cfg.num_steps * self.num_envs;
        let flat = |t: &Tensor| t.flatten_to(1).ctx(CTX);
        let obs = self.rollout.states().reshape((n, self.cfg.net.state_dim)).ctx(CTX)?;
        let actions = flat(self.rollout.actions())?;
        let logp = flat(self.rollout.log_probs())?;
        let values = flat(self.rollout.values())?;
        let (adv, ret) = (flat(&adv)?, flat(&ret)?);
        let mut sum = PpoMinibatchStats::default();
        let (mut count, mut skipped) = (0u32, 0u32);
        // Captured updates are only queued: the device sums their statistics, read once
        // after the last one, so the host never waits for the GPU mid-iteration.
        #[cfg(feature = "cuda")]
        let mut queued = false;
        #[cfg(feature = "cuda")]
        let skipped_before = self.skipped_updates;
        let mb = self.cfg.minibatch_size;
        #[cfg(feature = "cuda")]
        let whole = self.epochs_graph_ready(&obs, &actions, &logp)?;
        #[cfg(not(feature = "cuda"))]
        let whole = false;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut launched = std::time::Instant::now();
        #[cfg(feature = "cuda")]
        if whole {
            // The whole update phase in one replay: the epochs' permutations and this
            // iteration's advantages and returns go into the graph's buffers.
            let mut perms = Vec::with_capacity(self.cfg.epochs * n);
            for e in 0..self.cfg.epochs as u64 {
                perms.extend(permutation(n, self.cfg.seed, self.epochs_done + e));
            }
            launched = std::time::Instant::now();
            self.accel.graph.reset_sums()?;
            let eg = self.accel.epochs_graph.as_ref().ok_or_else(|| Error::config(CTX, "no epochs graph"))?;
            eg.run(&perms, &adv, &ret, [&obs, &actions, &logp])?;
            // Counted once the epochs are queued, so a failed replay leaves the counter as it was.
            self.epochs_done += self.cfg.epochs as u64;
            queued = true;
        }
        for _ in 0..if whole { 0 } else { self.cfg.epochs } {
            let perm = permutation(n, self.cfg.seed, self.epochs_done);
            self.epochs_done += 1;
            // One upload per epoch; each minibatch is a view of it.
            let perm_t = Tensor::from_slice(&perm, n, obs.device()).ctx(CTX)?;
            for (k, chunk) in perm.chunks(mb).enumerate() {
                if chunk.len() < 2 {
                    continue;
                }
                let idx = perm_t.narrow(0, k * mb, chunk.len()).ctx(CTX)?;
                let pick = |t: &Tensor| t.index_select(&idx, 0).ctx(CTX);
                let (o, a, lp, ad, r) = (pick(&obs)?, pick(&actions)?, pick(&logp)?, pick(&adv)?, pick(&ret)?);
                let batch = PpoBatch { obs: &o, actions: &a, logp_old: &lp, advantages: &ad, returns: &r };
                #[cfg(feature = "cuda")]
                {
                    if !queued && self.graph_ready(batch)? {
                        queued = true;
                        self.accel.graph.reset_sums()?;
                    }
                    if queued {
                        self.update_queued(batch)?;
                        continue;
                    }
                }
                let st = self.update_minibatch(batch)?;
                if st.skipped {
                    skipped += 1;
                    continue;
                }
                sum.add(&st);
                count += 1;
            }
        }
        // Rewards and episode ends over the rollout, summed on the device and read below
        // with the values and returns, after the statistics: one read, no GPU idle between.
        let sums_dev = Tensor::stack(&[self.rollout.rewards(), self.rollout.dones()], 0)
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.flatten_from(1))
            .and_then(|t| t.sum(1))
            .ctx(CTX)?;
        let waited = std::time::Instant::now();
        self.phases.prepare += (launched - started).as_secs_f64();
        self.phases.launch += (waited - launched).as_secs_f64();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut mean = sum.scaled(1.0 / count.max(1) as f64);
        #[cfg(feature = "cuda")]
        if queued {
            let st = self.accel.graph.stats()?.ok_or_else(|| Error::config(CTX, "no captured graph"))?;
            (self.updates, self.skipped_updates) = (st.guard.applied, st.guard.skipped());
            skipped = (self.skipped_updates - skipped_before) as u32;
            // The device's sums cover the applied steps, `loss_count` of them.
            let (c, x) = (st.loss_count as f64, &st.extra_sum);
            mean = if st.loss_count == 0 {
                PpoMinibatchStats::default()
            } else {
                PpoMinibatchStats {
                    loss: st.mean_loss,
                    l_clip: x[0] / c,
                    l_v: x[1] / c,
                    entropy: x[2] / c,
                    approx_kl: x[3] / c,
                    clip_frac: x[4] / c,
                    grad_norm: st.mean_grad_norm,
                    skipped: false,
                }
            };
        }
        let finishing = std::time::Instant::now();
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).ctx(CTX);
        let host = fx_kernels::readback::to_host(&[f32s(&values)?, f32s(&ret)?, sums_dev]).ctx(CTX)?;
        let vec = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).ctx(CTX);
        let explained_variance = explained_variance_of(&vec(&host[0])?, &vec(&host[1])?);
        let sums: Vec<f64> = host[2].to_vec1().ctx(CTX)?;
        let (reward_sum, episodes) = (sums[0], sums[1]);
        self.phases.device_wait += (finishing - waited).as_secs_f64();
        self.phases.finish += finishing.elapsed().as_secs_f64();
        self.rollout.clear();
        self.iterations += 1;
        Ok(PpoIterStats {
            iteration: self.iterations,
            env_steps: self.env_steps,
            mean_reward: reward_sum / n as f64,
            episodes_done: episodes as u32,
            mean,
            skipped,
            explained_variance,
        })
    }

    /// One optimiser step on a minibatch: PPO loss, (scaled) backward, clip to
    /// `max_grad_norm`, Adam, through fx-precision's [`TrainStep`]. A non-finite loss or
    /// gradient skips the step (nothing changes) and is reported in the stats.
    pub fn update_minibatch(&mut self, batch: PpoBatch<'_>) -> Result<PpoMinibatchStats> {
        const CTX: &str = "PpoTrainer::update_minibatch";
        #[cfg(feature = "cuda")]
        if self.graph_ready(batch)? {
            self.update_queued(batch)?;
            let st = self.accel.graph.stats()?.ok_or_else(|| Error::config(CTX, "no captured graph"))?;
            self.updates = st.guard.applied;
            self.skipped_updates = st.guard.skipped();
            let d = st.extra_last;
            return Ok(PpoMinibatchStats {
                loss: st.last_loss,
                l_clip: d[0],
                l_v: d[1],
                entropy: d[2],
                approx_kl: d[3],
                clip_frac: d[4],
                grad_norm: st.last_grad_norm,
                skipped: st.last_skipped,
            });
        }
        let started = std::time::Instant::now();
        let p = ppo_loss(&self.model, batch, &self.cfg.loss)?;
        self.forward_seconds += started.elapsed().as_secs_f64();
        // The diagnostics travel in the step's one device-to-host read.
        let (report, d) = self
            .step
            .step_reading(&p.loss, &[&p.l_clip, &p.l_v, &p.entropy_mean, &p.approx_kl, &p.clip_frac])
            .ctx(CTX)?;
        let skipped = report.skipped.is_some();
        if skipped {
            self.skipped_updates += 1;
        } else {
            self.updates += 1;
        }
        Ok(PpoMinibatchStats {
            loss: report.loss,
            l_clip: d[0],
            l_v: d[1],
            entropy: d[2],
            approx_kl: d[3],
            clip_frac: d[4],
            grad_norm: report.grad_norm,
            skipped,
        })
    }

    /// Whether an iteration's updates run as one epochs graph: captures it at the first
    /// call (after the minibatch update's own capture) on CUDA unless graphs are off; `auto`
    /// falls back to replaying the update per minibatch with a one-line warning.
    #[cfg(feature = "cuda")]
    fn epochs_graph_ready(&mut self, obs: &Tensor, actions: &Tensor, logp: &Tensor) -> Result<bool> {
        const CTX: &str = "PpoTrainer::epochs_graph_ready";
        if self.accel.epochs_graph.is_some() {
            return Ok(true);
        }
        let (n, mb) = (obs.dim(0).ctx(CTX)?, self.cfg.minibatch_size);
        if !self.accel.epochs_graphs || mb.min(n) < 2 {
            return Ok(false);
        }
        // The minibatch update graph first (any minibatch's shapes do as its example).
        let rows = |t: &Tensor| t.narrow(0, 0, mb.min(n)).ctx(CTX);
        let (o, a, lp) = (rows(obs)?, rows(actions)?, rows(logp)?);
        let ex = PpoBatch { obs: &o, actions: &a, logp_old: &lp, advantages: &lp, returns: &lp };
        if !self.graph_ready(ex)? {
            self.accel.epochs_graphs = false;
            return Ok(false);
        }
        let captured = {
            let g = self.accel.graph.get(CTX)?;
            let mut body = self.graph_body();
            crate::ppo::epochs::EpochsGraph::capture(g.fused(), &mut body, obs, actions, logp, self.cfg.epochs, mb)
        };
        let what = "PPO epochs";
        match crate::graph_update::settle_capture(self.cfg.graph, what, "replaying the update per minibatch", captured)?
        {
            Some(g) => {
                self.accel.epochs_graph = Some(g);
                Ok(true)
            }
            None => {
                self.accel.epochs_graphs = false;
                Ok(false)
            }
        }
    }

    /// Allows (the default) or forbids capturing an iteration's updates as one graph
    /// (tests compare it with the per-minibatch replays); forbidding drops a captured one.
    #[cfg(feature = "cuda")]
    pub fn set_epoch_graphs(&mut self, on: bool) {
        self.accel.epochs_graphs = on;
        if !on {
            self.accel.epochs_graph = None;
        }
    }

    /// Whether the last update ran as one epochs graph.
    #[cfg(feature = "cuda")]
    pub fn epochs_graph_active(&self) -> bool {
        self.accel.epochs_graph.is_some()
    }

    /// Sets `graph` (e.g. after [`Self::load_state`], whose config is the saved one).
    /// A graph already captured stays in use.
    pub fn set_graph_mode(&mut self, mode: GraphMode) {
        self.cfg.graph = mode;
    }

    /// Whether minibatch updates run as the captured graph: builds it at the first call on
    /// CUDA unless `graph = off` (or `auto` and an earlier capture failed). The graph
    /// takes over the optimiser, scaler and guard state from the eager `TrainStep`.
    #[cfg(feature = "cuda")]
    pub fn graph_ready(&mut self, example: PpoBatch<'_>) -> Result<bool> {
        if let Some(ready) = self.accel.graph.decided(self.cfg.graph, self.model.params().device().is_cuda()) {
            return Ok(ready);
        }
        let captured = self.capture_graph(example);
        let ready = self.accel.graph.settle(self.cfg.graph, "PPO", captured)?;
        if !ready {
            self.accel.engine = None;
        }
        Ok(ready)
    }

    #[cfg(feature = "cuda")]
    fn capture_graph(&mut self, ex: PpoBatch<'_>) -> Result<crate::graph_update::GraphUpdate> {
        const CTX: &str = "PpoTrainer::capture_graph";
        let p = self.model.params();
        let mut fused = fx_precision::FusedStep::new(
            p.named_vars(),
            &self.cfg.optimizer,
            self.step.scaler(),
            Some(self.cfg.max_grad_norm),
        )
        .ctx(CTX)?;
        fused.load_from(&self.step).ctx(CTX)?;
        // F32 with U32 actions: the fused update (~40 launches); otherwise candle's update, captured.
        self.accel.engine = None;
        if self.cfg.precision == Precision::F32
            && ex.actions.dtype() == DType::U32
            && crate::ppo::fused::PpoFused::supports(&self.model)
        {
            let b = ex.obs.dim(0).ctx(CTX)?;
            self.accel.engine = Some(crate::ppo::fused::PpoFused::new(&self.model, b, self.cfg.loss)?);
        }
        let mut body = self.graph_body();
        crate::graph_update::GraphUpdate::capture(
            fused,
            &[ex.obs, ex.actions, ex.logp_old, ex.advantages, ex.returns],
            &mut body,
        )
    }

    #[cfg(feature = "cuda")]
    fn graph_body(&self) -> Box<crate::graph_update::Body<'_>> {
        let engine = self.accel.engine.as_ref();
        Box::new(move |fused, t, dry| {
            const CTX: &str = "PpoTrainer graph body";
            // Minibatches of another size (an epoch's last chunk) take candle's update,
            // through the same fused optimiser state.
            if let Some(e) = engine.filter(|e| t[0].dims().first() == Some(&e.batch()) && t[1].dtype() == DType::U32) {
                return e.step(fused, t, dry);
            }
            let batch = PpoBatch { obs: &t[0], actions: &t[1], logp_old: &t[2], advantages: &t[3], returns: &t[4] };
            let p = ppo_loss(&self.model, batch, &self.cfg.loss)?;
            let grads = fused.scale_loss(&p.loss).ctx(CTX)?.backward().ctx(CTX)?;
            fused.step(&p.loss, &grads, &[&p.l_clip, &p.l_v, &p.entropy_mean, &p.approx_kl, &p.clip_frac], dry).ctx(CTX)
        })
    }

    /// Queues one captured minibatch update without reading anything back (benchmarks;
    /// [`PpoTrainer::update_minibatch`] reads the statistics). Needs [`PpoTrainer::graph_ready`].
    #[cfg(feature = "cuda")]
    pub fn update_queued(&self, batch: PpoBatch<'_>) -> Result<()> {
        let g = self.accel.graph.get("PpoTrainer::update_queued")?;
        let mut body = self.graph_body();
        g.run(&[batch.obs, batch.actions, batch.logp_old, batch.advantages, batch.returns], &mut body)
    }

    /// Nodes (launches) of the captured update, if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_nodes(&self) -> Result<Option<usize>> {
        self.accel.graph.node_count()
    }

    /// The captured update's device-side statistics (one read), if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_stats(&self) -> Result<Option<fx_precision::FusedStats>> {
        self.accel.graph.stats()
    }

    /// Writes weights, Adam state, loss-scaler and guard state, counters and config
    /// atomically to one safetensors file. Only between iterations (an empty rollout);
    /// the environment's own state is not part of it.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        self.snapshot()?.write(path)
    }

    /// The state [`Self::save_state`] writes, copied to host memory (write it with
    /// [`crate::StateSnapshot::write`], from another thread if need be).
    pub fn snapshot(&self) -> Result<crate::StateSnapshot> {
        const CTX: &str = "PpoTrainer::snapshot";
        if !self.rollout.is_empty() {
            return Err(Error::config(CTX, "save between iterations: the rollout is partly collected"));
        }
        let mut t: HashMap<String, Tensor> = self.model.params().to_tensors("model.")?;
        let mut meta = HashMap::new();
        #[cfg(feature = "cuda")]
        let saved = self.accel.graph.save_state(&mut t, &mut meta, "opt.")?;
        #[cfg(not(feature = "cuda"))]
        let saved = false;
        if !saved {
            self.step.save_state(&mut t, &mut meta, "opt.").ctx(CTX)?;
        }
        let c = PpoCounters {
            version: STATE_VERSION,
            iterations: self.iterations,
            env_steps: self.env_steps,
            epochs_done: self.epochs_done,
            updates: self.updates,
            skipped_updates: self.skipped_updates,
            num_envs: self.num_envs,
            config: self.cfg.clone(),
        };
        crate::state_meta::write(&mut meta, STATE_KEY, &c, CTX)?;
        crate::StateSnapshot::new(t, meta, CTX)
    }

    /// Restores a learner from [`PpoTrainer::save_state`]'s file onto `device`.
    pub fn load_state(path: &Path, device: &Device) -> Result<Self> {
        const CTX: &str = "PpoTrainer::load_state";
        let mut nt = fx_precision::load_tensors(path, device).ctx(CTX)?;
        let c: PpoCounters = crate::state_meta::read(&nt, path, STATE_KEY, "a PPO trainer state", STATE_VERSION, CTX)?;
        // The saved config sizes what is allocated: check it against the file (network)
        // and the machine (rollout buffer) first.
        crate::state_meta::check_network(&nt, path, "model.", &c.config.net.param_specs(), CTX)?;
        let (t, e) = (c.config.num_steps, c.num_envs);
        let per = (fx_kernels::OBS_DIM as u64 + 5) * 4;
        crate::state_meta::check_buffer(path, &format!("rollout (num_steps {t} x num_envs {e})"), &[t, e], per, CTX)?;
        let mut me = Self::new(c.config, c.num_envs, device)
            .map_err(|e| Error::config(CTX, format!("{}: saved state: {e}", path.display())))?;
        nt.restore_varmap(&me.model.params().varmap()?, "model.").ctx(CTX)?;
        me.step.load_state(&mut nt, "opt.").ctx(CTX)?;
        nt.finish().ctx(CTX)?;
        me.iterations = c.iterations;
        me.env_steps = c.env_steps;
        me.epochs_done = c.epochs_done;
        me.updates = c.updates;
        me.skipped_updates = c.skipped_updates;
        Ok(me)
    }

    /// A warm start: the actor-critic's weights from another PPO trainer state file (e.g.
    /// the previous walk-forward fold's last checkpoint) replace this fresh trainer's; its
    /// optimiser moments, rollout and counters stay fresh. Only before the first iteration
    /// (nothing captured or fused has copied the weights yet); the file's network must be this
    /// trainer's (an error names the tensor otherwise).
    pub fn warm_start(&mut self, path: &Path) -> Result<()> {
        const CTX: &str = "PpoTrainer::warm_start";
        if self.iterations > 0 || self.env_steps > 0 {
            return Err(Error::config(CTX, "a warm start is for a trainer that has not stepped"));
        }
        let mut nt = fx_precision::load_tensors(path, self.model.params().device()).ctx(CTX)?;
        let _: PpoCounters = crate::state_meta::read(&nt, path, STATE_KEY, "a PPO trainer state", STATE_VERSION, CTX)?;
        crate::state_meta::check_network(&nt, path, "model.", &self.cfg.net.param_specs(), CTX)?;
        nt.restore_varmap(&self.model.params().varmap()?, "model.").ctx(CTX)
    }
}

impl Default for PpoMinibatchStats {
    fn default() -> Self {
        Self {
            loss: 0.0,
            l_clip: 0.0,
            l_v: 0.0,
            entropy: 0.0,
            approx_kl: 0.0,
            clip_frac: 0.0,
            grad_norm: 0.0,
            skipped: false,
        }
    }
}

impl PpoMinibatchStats {
    pub(crate) fn add(&mut self, o: &Self) {
        self.loss += o.loss;
        self.l_clip += o.l_clip;
        self.l_v += o.l_v;
        self.entropy += o.entropy;
        self.approx_kl += o.approx_kl;
        self.clip_frac += o.clip_frac;
        self.grad_norm += o.grad_norm;
    }

    pub(crate) fn scaled(self, k: f64) -> Self {
        Self {
            loss: self.loss * k,
            l_clip: self.l_clip * k,
            l_v: self.l_v * k,
            entropy: self.entropy * k,
            approx_kl: self.approx_kl * k,
            clip_frac: self.clip_frac * k,
            grad_norm: self.grad_norm * k,
            skipped: false,
        }
    }
}

/// A permutation of `0..n` (Fisher–Yates with counter-based draws keyed by `epoch`).
pub(crate) fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let u = fx_kernels::rng::draw(seed, SHUFFLE_STREAM, epoch, i as u64);
        let j = ((u * (i + 1) as f64) as usize).min(i);
        p.swap(i, j);
    }
    p
}

/// `1 − Var(R − V) / Var(R)` of the values and returns, in f64 (NaN when the returns
/// have no variance, as in CleanRL / SB3).
pub(crate) fn explained_variance_of(v: &[f32], r: &[f32]) -> f64 {
    let var = |x: &mut dyn Iterator<Item = f64>| {
        let xs: Vec<f64> = x.collect();
        let m = xs.iter().sum::<f64>() / xs.len() as f64;
        xs.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / xs.len() as f64
    };
    let var_r = var(&mut r.iter().map(|&a| a as f64));
    let var_d = var(&mut r.iter().zip(v).map(|(&a, &b)| a as f64 - b as f64));
    if var_r == 0.0 {
        f64::NAN
    } else {
        1.0 - var_d / var_r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{rel_err, Fixture};
    use crate::synthetic::{ar1_env, evaluate, Policy};

    /// Values that cannot train (or train nothing) are refused with the key and the value.
    #[test]
    fn configs_that_cannot_train_are_refused() {
        assert!(PpoConfig::default().validate(8).is_ok());
        type Case = (fn(&mut PpoConfig), &'static str);
        let cases: [Case; 8] = [
            (|c| c.optimizer.lr = 0.0, "optimizer.lr (0)"),
            (|c| c.gae.gamma = f64::NAN, "gae.gamma (NaN)"),
            (|c| c.gae.lambda = 2.0, "gae.lambda (2)"),
            (|c| c.loss.clip = 0.0, "loss.clip (0)"),
            (|c| c.loss.adv_eps = f64::INFINITY, "loss.adv_eps (inf)"),
            (|c| c.loss.vf_coef = -1.0, "loss.vf_coef (-1)"),
            (|c| c.loss.ent_coef = f64::NAN, "loss.ent_coef (NaN)"),
            (|c| c.max_grad_norm = f64::NAN, "max_grad_norm (NaN)"),
        ];
        for (change, want) in cases {
            let mut c = PpoConfig::default();
            change(&mut c);
            let e = c.validate(8).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    /// `train.*`: two Adam steps (clip 0.5) on the fixture minibatch; deltas agree to
    /// ≤ 4.9e-6 relative, checked against the 1e-3 bound explained in the DQN trainer's
    /// test.
    #[test]
    fn two_updates_match_fixture_deltas() {
        let fx = Fixture::load("ppo.safetensors");
        let cfg = PpoConfig { net: PpoNetConfig { hidden: 64, ..Default::default() }, ..Default::default() };
        let mut tr = PpoTrainer::new(cfg, 1, &Device::Cpu).unwrap();
        tr.model.params().assign_from(&fx.map, &fx.path, "", false).unwrap();
        let batch = crate::ppo::tests::fixture_batch(&fx);
        let want_loss: Vec<f32> = fx.get("train.loss").to_vec1().unwrap();
        let want_norm: Vec<f32> = fx.get("train.grad_norm").to_vec1().unwrap();
        for k in 0..2 {
            let st = tr.update_minibatch(batch).unwrap();
            assert!(!st.skipped);
            assert!(
                (st.loss - want_loss[k] as f64).abs() <= 1e-5 * (want_loss[k].abs() as f64).max(1e-3),
                "loss {k}: {} vs {}",
                st.loss,
                want_loss[k]
            );
            assert!(
                (st.grad_norm - want_norm[k] as f64).abs() <= 1e-5 * want_norm[k] as f64,
                "norm {k}: {} vs {}",
                st.grad_norm,
                want_norm[k]
            );
        }
        for spec in tr.model.params().specs() {
            let now = tr.model.params().get(&spec.name).unwrap().as_tensor();
            let delta = (now - fx.get(&spec.name)).unwrap();
            let e = rel_err(&delta, fx.get(&format!("train.delta.{}", spec.name)));
            assert!(e <= 1e-3, "train.delta.{}: rel err {e:e}", spec.name);
        }
    }

    #[test]
    fn sampling_uses_the_env_draws() {
        let env = ar1_env(8, 16, 300, 4);
        let tr = PpoTrainer::new(tiny_cfg(), 8, &Device::Cpu).unwrap();
        let probs = tr.model.probs_inference(&env.observe().unwrap()).unwrap();
        let p: Vec<f32> = probs.flatten_all().unwrap().to_vec1().unwrap();
        let want = fx_kernels::sample_from_probs(&p, 3, env.seed(), &env.env_ids(), env.step_counters()).unwrap();
        let got: Vec<u32> = tr.act(&env).unwrap().to_vec1().unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn config_serde_defaults() {
        let c: PpoConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, PpoConfig::default());
        assert_eq!(
            (c.gae.gamma, c.gae.lambda, c.max_grad_norm, c.optimizer.lr, c.optimizer.eps),
            (0.99, 0.95, 0.5, 3e-4, 1e-5)
        );
        assert_eq!((c.loss.clip, c.loss.vf_coef, c.loss.ent_coef, c.loss.adv_eps), (0.2, 0.5, 0.01, 1e-8));
        assert!(serde_json::from_str::<PpoConfig>(r#"{"epoch": 3}"#).is_err());
    }

    #[test]
    fn permutation_is_a_permutation_and_depends_on_epoch() {
        for n in [1usize, 2, 7, 100] {
            let mut p = permutation(n, 3, 0);
            p.sort_unstable();
            assert_eq!(p, (0..n as u32).collect::<Vec<_>>());
        }
        assert_ne!(permutation(100, 3, 0), permutation(100, 3, 1));
        assert_eq!(permutation(100, 3, 5), permutation(100, 3, 5));
    }

    #[test]
    fn explained_variance_matches_definition() {
        let r = [1.0f32, 2.0, 3.0, 4.0];
        assert!((explained_variance_of(&r, &r) - 1.0).abs() < 1e-12);
        assert!(explained_variance_of(&[2.5; 4], &r).abs() < 1e-12);
        // R - V = [-0.5, -0.5, 0.5, 0.5]: var 0.25; var R = 1.25.
        assert!((explained_variance_of(&[1.5, 2.5, 2.5, 3.5], &r) - 0.8).abs() < 1e-6);
        assert!(explained_variance_of(&r, &[2.0; 4]).is_nan());
    }

    fn tiny_cfg() -> PpoConfig {
        PpoConfig {
            net: PpoNetConfig { hidden: 16, ..Default::default() },
            num_steps: 8,
            epochs: 2,
            minibatch_size: 12,
            seed: 9,
            ..Default::default()
        }
    }

    /// A warm start takes the saved actor-critic exactly and nothing else; a DQN state file
    /// and a trainer that has iterated are refused.
    #[test]
    fn warm_start_takes_the_weights_only() {
        let mut env = ar1_env(4, 16, 300, 4);
        let mut a = PpoTrainer::new(tiny_cfg(), 4, &Device::Cpu).unwrap();
        a.iterate(&mut env).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ppo_state.safetensors");
        a.save_state(&path).unwrap();
        let mut b = PpoTrainer::new(PpoConfig { seed: 99, ..tiny_cfg() }, 4, &Device::Cpu).unwrap();
        b.warm_start(&path).unwrap();
        crate::fixtures::assert_same_params(a.model.params(), b.model.params(), "not taken");
        assert_eq!((b.iterations, b.env_steps, b.updates, b.cfg.seed), (0, 0, 0, 99));
        let mut env_b = ar1_env(4, 16, 300, 5);
        b.iterate(&mut env_b).unwrap();
        let e = b.warm_start(&path).unwrap_err().to_string();
        assert!(e.contains("has not stepped"), "{e}");
        let dqn = dir.path().join("dqn_state.safetensors");
        crate::DqnTrainer::new(Default::default(), &Device::Cpu).unwrap().save_state(&dqn).unwrap();
        let e = PpoTrainer::new(tiny_cfg(), 4, &Device::Cpu).unwrap().warm_start(&dqn).unwrap_err().to_string();
        assert!(e.contains("dqn_state.safetensors"), "{e}");
    }

    #[test]
    fn resume_is_bit_identical_on_cpu() {
        let mut env = ar1_env(4, 16, 300, 4);
        let mut a = PpoTrainer::new(tiny_cfg(), 4, &Device::Cpu).unwrap();
        for _ in 0..2 {
            a.iterate(&mut env).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ppo_state.safetensors");
        a.save_state(&path).unwrap();
        let mut env_b = env.clone();
        let mut b = PpoTrainer::load_state(&path, &Device::Cpu).unwrap();
        for _ in 0..2 {
            let (sa, sb) = (a.iterate(&mut env).unwrap(), b.iterate(&mut env_b).unwrap());
            assert_eq!(sa, sb);
        }
        crate::fixtures::assert_same_params(a.model.params(), b.model.params(), "differs after resume");
    }

    #[test]
    fn iteration_reports_metrics() {
        let mut env = ar1_env(4, 16, 300, 4);
        let mut tr = PpoTrainer::new(tiny_cfg(), 4, &Device::Cpu).unwrap();
        let st = tr.iterate(&mut env).unwrap();
        // 32 samples, minibatches of 12: 12 + 12 + 8 per epoch, 2 epochs.
        assert_eq!(tr.updates(), 6);
        assert_eq!(st.env_steps, 8);
        assert!(st.mean.approx_kl >= 0.0 && st.mean.approx_kl.is_finite());
        assert!((0.0..=1.0).contains(&st.mean.clip_frac));
        assert!(st.explained_variance.is_finite() && st.explained_variance <= 1.0);
        assert!(st.mean.entropy > 0.0 && st.mean.entropy <= (3f64).ln() + 1e-6);
        let mut wrong = ar1_env(3, 16, 300, 4);
        assert!(tr.iterate(&mut wrong).unwrap_err().to_string().contains("4 environments"));
        // Mid-rollout: no update, no save.
        assert!(!tr.collect_step(&mut env).unwrap());
        assert_eq!(tr.rollout_len(), 1);
        assert!(tr.update(&env).unwrap_err().to_string().contains("1 of 8"));
        let dir = tempfile::tempdir().unwrap();
        assert!(tr.save_state(&dir.path().join("x.safetensors")).is_err());
    }

    /// Learning check on the AR(1) series (see `synthetic`): the greedy policy (argmax
    /// of the logits) beats flat and random on held-out data by a clear margin.
    #[test]
    fn greedy_policy_beats_flat_and_random_on_held_out_data() {
        let cfg = PpoConfig {
            net: PpoNetConfig { hidden: 32, ..Default::default() },
            gae: GaeConfig { gamma: 0.5, lambda: 0.95 },
            optimizer: AdamConfig { lr: 3e-3, ..PpoConfig::default().optimizer },
            num_steps: 32,
            epochs: 4,
            minibatch_size: 128,
            seed: 7,
            ..Default::default()
        };
        let mut tr = PpoTrainer::new(cfg, 16, &Device::Cpu).unwrap();
        let held_out = || ar1_env(16, 64, 2_000, 2);
        // The untrained policy does not pass the bar (the test can fail).
        let untrained = evaluate(&mut held_out(), 256, Policy::Ppo(tr.model())).unwrap();
        assert!(untrained < 2e-3, "untrained policy already earns {untrained:e}");
        let mut env = ar1_env(16, 64, 3_000, 1);
        for _ in 0..12 {
            tr.iterate(&mut env).unwrap();
        }
        let greedy = evaluate(&mut held_out(), 256, Policy::Ppo(tr.model())).unwrap();
        let flat = evaluate(&mut held_out(), 256, Policy::Flat).unwrap();
        let random = evaluate(&mut held_out(), 256, Policy::Random).unwrap();
        eprintln!("ppo per-step reward: greedy {greedy:e} flat {flat:e} random {random:e}");
        assert!(greedy > flat + 2e-3, "greedy {greedy:e} vs flat {flat:e}");
        assert!(greedy > random + 2e-3, "greedy {greedy:e} vs random {random:e}");
    }
}
