//! The DQN algorithm: ε-greedy collection into a replay buffer, double-DQN updates with
//! AdamW, global-norm clipping and soft target updates, driven one environment step at
//! a time so a CLI can log, checkpoint and show progress between steps.
//!
//! Randomness: actions use the env's counter-based draws (streams 1/2); minibatch
//! indices are counter-based draws keyed by the number of minibatches drawn
//! ([`ReplayBuffer::sample_keyed`], one kernel on CUDA), so a run — and a run resumed from
//! [`DqnTrainer::save_state`] — samples the same rows on either device.
//!
//! On CUDA with the GPU environment and a captured update, each step is one replayed graph
//! (collection, sampling and the update round: `dqn::iteration`); the host only counts.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use fx_kernels::{ReplayBuffer, VecEnv};
use fx_precision::{AdamW, AdamWConfig, GradScaler, GraphMode, Precision, TrainStep};
use serde::{Deserialize, Serialize};

use crate::dqn::{dqn_loss, soft_update, DqnBatch, DqnNetConfig, DuelingDqn};
use crate::error::{Context, Error, Result};
use crate::LinearSchedule;

/// Metadata key of the trainer state in a state file.
const STATE_KEY: &str = "fx.dqn_trainer";
/// Version of the state file layout.
const STATE_VERSION: u32 = 1;

/// Everything a DQN run is configured by; defaults follow MODELS.md where it speaks
/// (γ, Huber δ, AdamW, clipping, τ) and common DQN practice elsewhere.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DqnConfig {
    /// Network dimensions.
    pub net: DqnNetConfig,
    /// Compute precision of forward/backward (weights and optimiser stay F32).
    pub precision: Precision,
    /// Discount γ (0.99).
    pub gamma: f64,
    /// Huber δ (1.0).
    pub huber_delta: f64,
    /// AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01).
    pub optimizer: AdamWConfig,
    /// Global gradient-norm clip (10).
    pub max_grad_norm: f64,
    /// Soft target update rate τ after every optimiser step (0.005).
    pub tau: f64,
    /// Transitions per minibatch.
    pub batch_size: usize,
    /// Replay capacity in transitions.
    pub replay_capacity: usize,
    /// Transitions in the buffer before the first update.
    pub learning_starts: usize,
    /// Environment steps (of all `E` accounts at once) between update rounds.
    pub train_every: u64,
    /// Optimiser steps per update round.
    pub gradient_steps: u32,
    /// ε as a function of the environment step count.
    pub epsilon: LinearSchedule,
    /// Seed of the weight initialisation and the replay index draws.
    pub seed: u64,
    /// On CUDA: each update (loss, backward, guard, clip, AdamW, target update) as one
    /// replayed CUDA graph (`auto`: fall back to eager with a warning if capture fails).
    pub graph: GraphMode,
}

impl Default for DqnConfig {
    fn default() -> Self {
        Self {
            net: DqnNetConfig::default(),
            precision: Precision::F32,
            gamma: 0.99,
            huber_delta: 1.0,
            optimizer: AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
            max_grad_norm: 10.0,
            tau: 0.005,
            batch_size: 256,
            replay_capacity: 100_000,
            learning_starts: 10_000,
            train_every: 1,
            gradient_steps: 1,
            epsilon: LinearSchedule::default(),
            seed: 0,
            graph: GraphMode::Auto,
        }
    }
}

impl DqnConfig {
    /// Refuses a configuration that cannot train (or trains nothing), naming the key (as in
    /// a run config's `[dqn]` section), its value and the rule; the trainer and the
    /// population check it again, and a run config checks it before anything is written.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config("dqn", m));
        if self.batch_size == 0 || self.replay_capacity == 0 || self.train_every == 0 {
            return bad(format!(
                "batch_size ({}), replay_capacity ({}) and train_every ({}) must be positive",
                self.batch_size, self.replay_capacity, self.train_every
            ));
        }
        if !(0.0..=1.0).contains(&self.tau) || !(0.0..=1.0).contains(&self.gamma) {
            return bad(format!("tau ({}) and gamma ({}) must be in [0, 1]", self.tau, self.gamma));
        }
        if self.net.state_dim != fx_kernels::OBS_DIM {
            return bad(format!(
                "net.state_dim {} differs from the environment's {}",
                self.net.state_dim,
                fx_kernels::OBS_DIM
            ));
        }
        if !(self.max_grad_norm > 0.0 && self.huber_delta > 0.0) {
            return bad(format!(
                "max_grad_norm ({}) and huber_delta ({}) must be positive",
                self.max_grad_norm, self.huber_delta
            ));
        }
        let lr = self.optimizer.lr;
        if !(lr.is_finite() && lr > 0.0) {
            return bad(format!("optimizer.lr ({lr}) must be finite and positive: nothing would train"));
        }
        let e = &self.epsilon;
        if !((0.0..=1.0).contains(&e.start) && (0.0..=1.0).contains(&e.end)) {
            return bad(format!("epsilon.start ({}) and epsilon.end ({}) must be in [0, 1]", e.start, e.end));
        }
        if self.gradient_steps == 0 {
            return bad("gradient_steps must be at least 1: nothing would train".into());
        }
        if self.learning_starts > self.replay_capacity {
            return bad(format!(
                "learning_starts ({}) exceeds replay_capacity ({}): the replay never holds enough, nothing would train",
                self.learning_starts, self.replay_capacity
            ));
        }
        Ok(())
    }
}

/// What one optimiser step did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DqnUpdateStats {
    /// Loss before the step.
    pub loss: f64,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// True when a non-finite loss or gradient made the trainer skip the step (weights,
    /// moments and target untouched).
    pub skipped: bool,
    /// Loss scale of the step (1 unless F16 loss scaling is on).
    pub loss_scale: f64,
}

/// What one environment step (and any updates it triggered) did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DqnStepStats {
    /// Environment steps taken so far (after this one).
    pub env_steps: u64,
    /// ε used for this step's actions.
    pub epsilon: f64,
    /// Mean reward over the `E` accounts (None: a step that read nothing back, see
    /// [`DqnTrainer::step_with`]).
    pub mean_reward: Option<f64>,
    /// Accounts whose episode ended in this step (None: not read back).
    pub episodes_done: Option<u32>,
    /// Transitions held by the replay buffer.
    pub replay_len: usize,
    /// The optimiser steps of this call whose statistics were read (empty before
    /// `learning_starts`).
    pub updates: Vec<DqnUpdateStats>,
    /// Optimiser steps of this call queued on the device without a read (captured-graph
    /// updates of a step that reads nothing back); their outcome shows in the counters at
    /// the next read.
    pub updates_queued: u32,
    /// Host seconds spent choosing actions, stepping the env and storing the transitions
    /// (the step's statistics read synchronises the device, so this includes device time).
    pub collect_seconds: f64,
    /// Host seconds spent in the optimiser steps (forward, backward, clip, AdamW, target update).
    pub update_seconds: f64,
}

/// A step's mean reward per account and its finished episodes, from its `[E]` rewards and
/// done flags, in one read.
fn reward_and_episodes(reward: &Tensor, done: &Tensor, ctx: &'static str) -> Result<(f64, u32)> {
    let e = reward.elem_count().max(1);
    let sums: Vec<f64> = Tensor::stack(&[reward, done], 0)
        .and_then(|t| t.to_dtype(candle_core::DType::F64))
        .and_then(|t| t.sum(1))
        .and_then(|t| t.to_vec1())
        .ctx(ctx)?;
    Ok((sums[0] / e as f64, sums[1] as u32))
}

/// Counters saved with the state (JSON in the state file's metadata).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct DqnCounters {
    version: u32,
    env_steps: u64,
    updates: u64,
    skipped_updates: u64,
    /// Minibatches drawn (the next sampling key); absent in files written before it was
    /// saved, where it equals updates + skipped updates for runs driven by `step`.
    #[serde(default)]
    sampled: Option<u64>,
    replay_len: usize,
    replay_position: usize,
    config: DqnConfig,
}

impl crate::state_meta::Versioned for DqnCounters {
    fn version(&self) -> u32 {
        self.version
    }
}

/// The DQN learner: online and target networks, AdamW, replay buffer and counters.
pub struct DqnTrainer {
    cfg: DqnConfig,
    online: DuelingDqn,
    target: DuelingDqn,
    step: TrainStep<AdamW>,
    replay: ReplayBuffer,
    env_steps: u64,
    updates: u64,
    skipped_updates: u64,
    /// Minibatches drawn: the key of the next draw (applied + skipped updates once the
    /// device's counters are read; ahead of them while captured updates are queued).
    sampled: u64,
    /// Host seconds building the loss (online and target forwards), for profiles.
    forward_seconds: f64,
    /// Everything the trainer does differently on CUDA (fused update and forward, captured
    /// update and iteration); empty until the first step on a CUDA device.
    #[cfg(feature = "cuda")]
    accel: DqnAccel,
}

/// The DQN trainer's CUDA acceleration, in one place: each part is built lazily at the first
/// step or update that can use it and dropped (or refused for the trainer's life) as the
/// module docs say.
#[cfg(feature = "cuda")]
struct DqnAccel {
    /// The captured update (CUDA, `graph` not off), built at the first update.
    graph: crate::graph_update::GraphSlot,
    /// The fused F32 update the graph captures (None: the candle update is captured).
    engine: Option<crate::dqn::fused::DqnFused>,
    /// The fused collection forward (CUDA, supported networks), built at the first step for
    /// the env's number of accounts; None: candle's forward.
    q_forward: Option<crate::mlp::DqnQForward>,
    /// Whole iterations as one graph (see `dqn::iteration`): built on the GPU env once the
    /// update is captured; None before, off, or after a failed `auto` capture.
    iteration: Option<crate::dqn::iteration::DqnIteration>,
    /// Whether whole-iteration graphs may be used (on by default; a failed `auto` capture
    /// turns them off for the trainer's life).
    iterations: bool,
}

#[cfg(feature = "cuda")]
impl Default for DqnAccel {
    fn default() -> Self {
        Self { graph: Default::default(), engine: None, q_forward: None, iteration: None, iterations: true }
    }
}

impl std::fmt::Debug for DqnTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqnTrainer")
            .field("env_steps", &self.env_steps)
            .field("updates", &self.updates)
            .field("replay_len", &self.replay.len())
            .finish()
    }
}

impl DqnTrainer {
    /// A fresh learner on `device`: online net initialised from `cfg.seed`, target a copy.
    pub fn new(cfg: DqnConfig, device: &Device) -> Result<Self> {
        const CTX: &str = "DqnTrainer::new";
        cfg.validate()?;
        let mut online = DuelingDqn::new(cfg.net, device, cfg.seed)?;
        let mut target = DuelingDqn::new(cfg.net, device, cfg.seed)?;
        target.params().copy_from(online.params())?;
        online.set_precision(cfg.precision);
        target.set_precision(cfg.precision);
        let named = online.params().named_vars();
        let opt = AdamW::new(named, cfg.optimizer).ctx(CTX)?;
        // Loss scaling (F16 only), clipping, the NaN/Inf guard and AdamW in one place.
        let step = TrainStep::new(opt, GradScaler::for_precision(cfg.precision), Some(cfg.max_grad_norm)).ctx(CTX)?;
        let replay = ReplayBuffer::new(cfg.replay_capacity, device).ctx(CTX)?;
        Ok(Self {
            cfg,
            online,
            target,
            step,
            replay,
            env_steps: 0,
            updates: 0,
            skipped_updates: 0,
            sampled: 0,
            forward_seconds: 0.0,
            #[cfg(feature = "cuda")]
            accel: DqnAccel::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DqnConfig {
        &self.cfg
    }

    /// The online network (the policy).
    pub fn online(&self) -> &DuelingDqn {
        &self.online
    }

    /// The target network.
    pub fn target(&self) -> &DuelingDqn {
        &self.target
    }

    /// The replay buffer.
    pub fn replay(&self) -> &ReplayBuffer {
        &self.replay
    }

    /// Environment steps taken.
    pub fn env_steps(&self) -> u64 {
        self.env_steps
    }

    /// Optimiser steps taken (skipped ones not counted), as of the last reading step or
    /// [`Self::sync_counters`] (see [`Self::step_with`]).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Updates skipped for non-finite loss or gradients (as [`Self::updates`], as of the
    /// last read).
    pub fn skipped_updates(&self) -> u64 {
        self.skipped_updates
    }

    /// Host seconds of the updates so far: loss forward, then the backward / device-wait /
    /// optimiser split of [`TrainStep`] (see [`fx_precision::StepTimes`]). Not saved in
    /// checkpoints.
    pub fn update_times(&self) -> (f64, fx_precision::StepTimes) {
        (self.forward_seconds, self.step.times())
    }

    /// The AdamW state under `{name}.exp_avg` / `.exp_avg_sq` / `.step` (population tests).
    #[cfg(test)]
    pub(crate) fn optimizer_state(&self) -> HashMap<String, Tensor> {
        use fx_precision::Optimizer;
        let mut out = HashMap::new();
        self.step.optimizer().save_state(&mut out, "").unwrap();
        out
    }

    /// ε for the next environment step.
    pub fn epsilon(&self) -> f64 {
        self.cfg.epsilon.value(self.env_steps)
    }

    /// ε-greedy actions (`[E]` u32) for the env's current states, with the env's
    /// counter-based draws.
    pub fn act(&self, env: &dyn VecEnv, eps: f64) -> Result<Tensor> {
        let obs = env.observe().ctx("DqnTrainer::act")?;
        #[cfg(feature = "cuda")]
        if let Some(f) = self.accel.q_forward.as_ref().filter(|f| f.rows() == env.num_envs()) {
            return env.epsilon_greedy(&f.forward(&self.online, &obs)?, eps).ctx("DqnTrainer::act");
        }
        let q = self.online.forward_inference(&obs)?;
        env.epsilon_greedy(&q, eps).ctx("DqnTrainer::act")
    }

    /// Builds the fused collection forward for `rows` accounts on CUDA when the network is
    /// one the fused kernels cover (otherwise collection keeps candle's forward).
    #[cfg(feature = "cuda")]
    fn ensure_q_forward(&mut self, rows: usize) -> Result<()> {
        let fits = self.accel.q_forward.as_ref().is_some_and(|f| f.rows() == rows);
        if !fits && self.online.params().device().is_cuda() && crate::dqn::fused::DqnFused::supports(&self.online) {
            // A captured iteration reads the old forward's buffers: it goes first.
            self.accel.iteration = None;
            self.accel.q_forward = Some(crate::mlp::DqnQForward::new(&self.online, rows)?);
        }
        Ok(())
    }

    /// Whether the step that brings the counts to `replay_len` transitions and `env_steps`
    /// steps ends with an update round.
    fn update_round_due(&self, replay_len: usize, env_steps: u64) -> bool {
        replay_len >= self.cfg.learning_starts.max(1) && env_steps.is_multiple_of(self.cfg.train_every)
    }

    /// Allows or forbids whole-iteration graphs (on by default; see the module docs). Off,
    /// a CUDA step launches collection, sampling and the captured update one by one: the
    /// same kernels, for comparisons and debugging.
    #[cfg(feature = "cuda")]
    pub fn set_iteration_graphs(&mut self, on: bool) {
        self.accel.iterations = on;
        if !on {
            self.accel.iteration = None;
        }
    }

    /// Whether a whole-iteration graph is captured (GPU-env steps then run as one).
    #[cfg(feature = "cuda")]
    pub fn iteration_graph_active(&self) -> bool {
        self.accel.iteration.is_some()
    }

    /// The counters a whole-iteration graph keeps on the device, as the host has them.
    #[cfg(feature = "cuda")]
    fn loop_counters(&self) -> fx_kernels::cuda::DqnLoopCounters {
        fx_kernels::cuda::DqnLoopCounters {
            env_steps: self.env_steps,
            replay_position: self.replay.position() as u64,
            replay_len: self.replay.len() as u64,
            sample_key: self.sampled,
        }
    }

    /// One step as a whole-iteration graph when it can be (CUDA, the GPU env, the fused
    /// collection forward, the update captured, iterations on); None: take the stepwise path.
    /// A failed capture under `graph = auto` warns once and turns iterations off; under
    /// `on` it is an error.
    #[cfg(feature = "cuda")]
    fn iteration_step(&mut self, env: &mut dyn VecEnv, read: bool) -> Result<Option<DqnStepStats>> {
        const CTX: &str = "DqnTrainer::step (iteration graph)";
        let Some(genv) = env.as_gpu() else { return Ok(None) };
        let on_cuda = self.online.params().device().is_cuda();
        if !self.accel.iterations || self.accel.graph.decided(self.cfg.graph, on_cuda) != Some(true) {
            return Ok(None);
        }
        let e = genv.num_envs();
        if self.accel.iteration.as_ref().is_some_and(|it| !it.fits(genv)) {
            self.accel.iteration = None;
        }
        self.ensure_q_forward(e)?;
        if self.accel.q_forward.as_ref().is_none_or(|f| f.rows() != e) {
            return Ok(None);
        }
        let len_after = (self.replay.len() + e).min(self.replay.capacity());
        let train = self.update_round_due(len_after, self.env_steps + 1);
        let started = std::time::Instant::now();
        if !self.accel.iteration.as_ref().is_some_and(|it| it.graphs.has(train)) {
            let captured = self.capture_iteration(genv, train);
            let mode = self.cfg.graph;
            if crate::graph_update::settle_capture(mode, "DQN iteration", "stepping kernel by kernel", captured)?
                .is_none()
            {
                self.set_iteration_graphs(false);
                return Ok(None);
            }
        }
        let eps = self.epsilon();
        let g = self.cfg.gradient_steps;
        let before = self.loop_counters();
        self.accel
            .iteration
            .as_mut()
            .ok_or_else(|| Error::config(CTX, "no iteration"))?
            .graphs
            .sync(before, &self.replay)?;
        // The host's counters move as the replay will move the device's.
        self.env_steps += 1;
        self.replay.advance(e);
        if train {
            self.sampled += u64::from(g);
        }
        let after = self.loop_counters();
        self.accel.iteration.as_mut().ok_or_else(|| Error::config(CTX, "no iteration"))?.graphs.replay(train, after)?;
        let (mut mean_reward, mut episodes_done) = (None, None);
        let (mut updates, mut updates_queued) = (Vec::new(), if train { g } else { 0 });
        if read {
            let (r, d) = self
                .accel
                .iteration
                .as_ref()
                .map(|it| it.rewards_and_dones())
                .ok_or_else(|| Error::config(CTX, "no iteration"))?;
            let (m, n) = reward_and_episodes(r, d, CTX)?;
            (mean_reward, episodes_done) = (Some(m), Some(n));
            if train && g > 0 {
                // The control block holds the round's last update; the others count as queued.
                updates.push(self.graph_update_stats()?);
                updates_queued -= 1;
            } else {
                self.sync_counters()?;
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let (collect_seconds, update_seconds) = if train { (0.0, seconds) } else { (seconds, 0.0) };
        Ok(Some(DqnStepStats {
            env_steps: self.env_steps,
            epsilon: eps,
            mean_reward,
            episodes_done,
            replay_len: self.replay.len(),
            updates,
            updates_queued,
            collect_seconds,
            update_seconds,
        }))
    }

    /// Captures the whole iteration (with an update round when `train`) on `env`.
    #[cfg(feature = "cuda")]
    fn capture_iteration(&mut self, env: &fx_kernels::GpuTradingEnv, train: bool) -> Result<()> {
        const CTX: &str = "DqnTrainer::capture_iteration";
        let mut it = match self.accel.iteration.take() {
            Some(it) => it,
            None => crate::dqn::iteration::DqnIteration::new(env, self.cfg.batch_size)?,
        };
        let captured = {
            let q_forward = self.accel.q_forward.as_ref().ok_or_else(|| Error::config(CTX, "no fused forward"))?;
            let g = self.accel.graph.get(CTX)?;
            let mut body = self.graph_body();
            let parts = crate::dqn::iteration::IterationParts {
                env,
                q_forward,
                online: &self.online,
                replay: &self.replay,
                epsilon: self.cfg.epsilon,
                seed: self.cfg.seed,
                update: train.then_some((self.cfg.gradient_steps, g.fused(), &mut *body)),
            };
            it.capture(parts)
        };
        captured?;
        self.accel.iteration = Some(it);
        Ok(())
    }

    /// One environment step with ε-greedy actions, stored in the replay buffer, then
    /// `gradient_steps` updates when the buffer holds `learning_starts` transitions and
    /// the step count is a multiple of `train_every`; its statistics are read back.
    pub fn step(&mut self, env: &mut dyn VecEnv) -> Result<DqnStepStats> {
        self.step_with(env, true)
    }

    /// [`Self::step`], reading nothing back from the device unless `read`: no reward and
    /// episode sums, and captured-graph updates only queued (their loss, skips and the
    /// update counters are read at the next reading step or [`Self::sync_counters`]). The
    /// work is the same either way; a loop that reads only the steps it logs lets the host
    /// run ahead of the GPU instead of waiting for it twice per step. On the CPU, and for
    /// eager updates, the optimiser's guard reads anyway.
    pub fn step_with(&mut self, env: &mut dyn VecEnv, read: bool) -> Result<DqnStepStats> {
        const CTX: &str = "DqnTrainer::step";
        #[cfg(feature = "cuda")]
        if let Some(stats) = self.iteration_step(env, read)? {
            return Ok(stats);
        }
        let started = std::time::Instant::now();
        let eps = self.epsilon();
        #[cfg(feature = "cuda")]
        self.ensure_q_forward(env.num_envs())?;
        let actions = self.act(env, eps)?;
        let step = env.step_into_replay(&actions, &mut self.replay).ctx(CTX)?;
        self.env_steps += 1;
        let (mut mean_reward, mut episodes_done) = (None, None);
        if read {
            let (m, n) = reward_and_episodes(&step.reward, &step.done, CTX)?;
            (mean_reward, episodes_done) = (Some(m), Some(n));
        }
        let collect_seconds = started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        let (mut updates, mut updates_queued) = (Vec::new(), 0u32);
        if self.update_round_due(self.replay.len(), self.env_steps) {
            for _ in 0..self.cfg.gradient_steps {
                match self.train_on_replay_with(read)? {
                    Some(u) => updates.push(u),
                    None => updates_queued += 1,
                }
            }
        }
        // A reading step's counters are the device's: its last update read them already,
        // else (no update this step, earlier ones only queued) one read brings them up.
        if read && updates.is_empty() {
            self.sync_counters()?;
        }
        Ok(DqnStepStats {
            env_steps: self.env_steps,
            epsilon: eps,
            mean_reward,
            episodes_done,
            replay_len: self.replay.len(),
            updates,
            updates_queued,
            collect_seconds,
            update_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Brings the update counters up to the device's (one read of the captured update's
    /// control block; nothing to do for eager updates, whose counters are always current).
    pub fn sync_counters(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(st) = self.accel.graph.stats()? {
            self.take_counters(&st);
        }
        Ok(())
    }

    /// The update counters as the captured update's control block has them.
    #[cfg(feature = "cuda")]
    fn take_counters(&mut self, st: &fx_precision::FusedStats) {
        (self.updates, self.skipped_updates) = (st.guard.applied, st.guard.skipped());
    }

    /// One update on a minibatch sampled from the replay buffer.
    pub fn train_on_replay(&mut self) -> Result<DqnUpdateStats> {
        self.train_on_replay_with(true)?.ok_or_else(|| Error::config("DqnTrainer::train_on_replay", "no statistics"))
    }

    /// [`Self::train_on_replay`]; a captured-graph update is only queued unless `read`
    /// (then `None`).
    fn train_on_replay_with(&mut self, read: bool) -> Result<Option<DqnUpdateStats>> {
        const CTX: &str = "DqnTrainer::train_on_replay";
        // Keyed by (seed, minibatches drawn, row): reproducible and resumable.
        let batch = self.replay.sample_keyed(self.cfg.batch_size, self.cfg.seed, self.sampled).ctx(CTX)?;
        self.sampled += 1;
        let batch = DqnBatch {
            obs: &batch.states,
            actions: &batch.actions,
            rewards: &batch.rewards,
            next_obs: &batch.next_states,
            dones: &batch.dones,
        };
        #[cfg(feature = "cuda")]
        if !read && self.graph_ready(batch)? {
            self.update_queued(batch)?;
            return Ok(None);
        }
        let _ = read;
        self.update(batch).map(Some)
    }

    /// One full optimiser step on `batch`: double-DQN loss, (scaled) backward, clip to
    /// `max_grad_norm`, AdamW, soft target update — through fx-precision's
    /// [`TrainStep`], which reads loss and gradient norm back in one transfer. A
    /// non-finite loss or gradient skips the step (weights, moments and target
    /// untouched) and is reported in the stats.
    pub fn update(&mut self, batch: DqnBatch<'_>) -> Result<DqnUpdateStats> {
        const CTX: &str = "DqnTrainer::update";
        #[cfg(feature = "cuda")]
        if self.graph_ready(batch)? {
            self.update_queued(batch)?;
            return self.graph_update_stats();
        }
        let started = std::time::Instant::now();
        let parts = dqn_loss(&self.online, &self.target, batch, self.cfg.gamma, self.cfg.huber_delta)?;
        self.forward_seconds += started.elapsed().as_secs_f64();
        let report = self.step.step(&parts.loss).ctx(CTX)?;
        let skipped = report.skipped.is_some();
        if skipped {
            self.skipped_updates += 1;
        } else {
            soft_update(&self.target, &self.online, self.cfg.tau)?;
            self.updates += 1;
        }
        Ok(DqnUpdateStats { loss: report.loss, grad_norm: report.grad_norm, skipped, loss_scale: report.loss_scale })
    }

    /// Sets `graph` (e.g. after [`Self::load_state`], whose config is the saved one).
    /// A graph already captured stays in use.
    pub fn set_graph_mode(&mut self, mode: GraphMode) {
        self.cfg.graph = mode;
    }

    /// Whether updates run as the captured graph: builds it at the first call on CUDA
    /// unless `graph = off` (or `auto` and an earlier capture failed). The graph takes
    /// over the optimiser, scaler and guard state from the eager `TrainStep`.
    #[cfg(feature = "cuda")]
    pub fn graph_ready(&mut self, example: DqnBatch<'_>) -> Result<bool> {
        if let Some(ready) = self.accel.graph.decided(self.cfg.graph, self.online.params().device().is_cuda()) {
            return Ok(ready);
        }
        let captured = self.capture_graph(example);
        let ready = self.accel.graph.settle(self.cfg.graph, "DQN", captured)?;
        if !ready {
            self.accel.engine = None;
        }
        Ok(ready)
    }

    #[cfg(feature = "cuda")]
    fn capture_graph(&mut self, ex: DqnBatch<'_>) -> Result<crate::graph_update::GraphUpdate> {
        const CTX: &str = "DqnTrainer::capture_graph";
        let mut fused = fx_precision::FusedStep::new(
            self.online.params().named_vars(),
            &self.cfg.optimizer,
            self.step.scaler(),
            Some(self.cfg.max_grad_norm),
        )
        .and_then(|f| f.with_targets(self.target.params().vars().to_vec(), self.cfg.tau))
        .ctx(CTX)?;
        fused.load_from(&self.step).ctx(CTX)?;
        // F32 / BF16: the fused update (~30 launches); F16: candle's update, captured.
        self.accel.engine = None;
        if self.cfg.precision != Precision::F16 && crate::dqn::fused::DqnFused::supports(&self.online) {
            let b = ex.obs.dim(0).ctx(CTX)?;
            let (g, d, p) = (self.cfg.gamma, self.cfg.huber_delta, self.cfg.precision);
            self.accel.engine = Some(crate::dqn::fused::DqnFused::new(&self.online, &self.target, b, g, d, p)?);
        }
        let mut body = self.graph_body();
        crate::graph_update::GraphUpdate::capture(
            fused,
            &[ex.obs, ex.actions, ex.rewards, ex.next_obs, ex.dones],
            &mut body,
        )
    }

    #[cfg(feature = "cuda")]
    fn graph_body(&self) -> Box<crate::graph_update::Body<'_>> {
        if let Some(engine) = &self.accel.engine {
            return Box::new(move |fused, t, dry| {
                if t[0].dim(0).ctx("DqnTrainer graph body")? != engine.batch() {
                    return Err(Error::config(
                        "DqnTrainer graph body",
                        "the fused update needs the configured batch size",
                    ));
                }
                engine.step(fused, t, dry)
            });
        }
        Box::new(move |fused, t, dry| {
            const CTX: &str = "DqnTrainer graph body";
            let batch = DqnBatch { obs: &t[0], actions: &t[1], rewards: &t[2], next_obs: &t[3], dones: &t[4] };
            let parts = dqn_loss(&self.online, &self.target, batch, self.cfg.gamma, self.cfg.huber_delta)?;
            let grads = fused.scale_loss(&parts.loss).ctx(CTX)?.backward().ctx(CTX)?;
            fused.step(&parts.loss, &grads, &[], dry).ctx(CTX)
        })
    }

    /// Queues one captured update on `batch` without reading anything back (benchmarks;
    /// [`DqnTrainer::update`] reads the step's statistics). Needs [`DqnTrainer::graph_ready`].
    #[cfg(feature = "cuda")]
    pub fn update_queued(&self, batch: DqnBatch<'_>) -> Result<()> {
        let g = self.accel.graph.get("DqnTrainer::update_queued")?;
        let mut body = self.graph_body();
        g.run(&[batch.obs, batch.actions, batch.rewards, batch.next_obs, batch.dones], &mut body)
    }

    /// Nodes (launches) of the captured update, if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_nodes(&self) -> Result<Option<usize>> {
        self.accel.graph.node_count()
    }

    /// The last graph update's statistics (one read of the device control block); the
    /// trainer's counters follow the device's.
    #[cfg(feature = "cuda")]
    fn graph_update_stats(&mut self) -> Result<DqnUpdateStats> {
        const CTX: &str = "DqnTrainer::graph_update_stats";
        let st = self.accel.graph.stats()?.ok_or_else(|| Error::config(CTX, "no captured graph"))?;
        self.take_counters(&st);
        Ok(DqnUpdateStats {
            loss: st.last_loss,
            grad_norm: st.last_grad_norm,
            skipped: st.last_skipped,
            loss_scale: st.loss_scale,
        })
    }

    /// [`DqnTrainer::update`] through the captured update's body run directly instead of
    /// the replayed graph (same kernels, same device state): what a replay must reproduce.
    /// For tests and debugging; needs [`DqnTrainer::graph_ready`].
    #[cfg(feature = "cuda")]
    pub fn update_uncaptured(&mut self, batch: DqnBatch<'_>) -> Result<DqnUpdateStats> {
        let g = self.accel.graph.get("DqnTrainer::update_uncaptured")?;
        {
            let mut body = self.graph_body();
            g.run_uncaptured(&[batch.obs, batch.actions, batch.rewards, batch.next_obs, batch.dones], &mut body)?;
        }
        self.graph_update_stats()
    }

    /// The captured update's device-side statistics (one read), if a graph is in use.
    #[cfg(feature = "cuda")]
    pub fn graph_stats(&self) -> Result<Option<fx_precision::FusedStats>> {
        self.accel.graph.stats()
    }

    /// Writes everything a bit-identical resume needs (CPU): online and target weights,
    /// AdamW moments and step counts, loss-scaler and guard state, the replay buffer's transitions and ring position,
    /// the step counters and the config, atomically to one safetensors file. The
    /// environment's own state is not part of it (the `VecEnv` owns it).
    pub fn save_state(&self, path: &Path) -> Result<()> {
        self.snapshot()?.write(path)
    }

    /// The state [`Self::save_state`] writes, copied to host memory (write it with
    /// [`StateSnapshot::write`], from another thread if need be).
    pub fn snapshot(&self) -> Result<crate::StateSnapshot> {
        const CTX: &str = "DqnTrainer::snapshot";
        let mut t: HashMap<String, Tensor> = self.online.params().to_tensors("online.")?;
        t.extend(self.target.params().to_tensors("target.")?);
        let mut meta = HashMap::new();
        #[cfg(feature = "cuda")]
        let saved = self.accel.graph.save_state(&mut t, &mut meta, "opt.")?;
        #[cfg(not(feature = "cuda"))]
        let saved = false;
        if !saved {
            self.step.save_state(&mut t, &mut meta, "opt.").ctx(CTX)?;
        }
        let n = self.replay.len();
        replay_tensors(&self.replay, &mut t, "replay.").ctx(CTX)?;
        // The captured update's counters live on the device (quiet steps leave the host's
        // copies behind): save the device's.
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let (mut updates, mut skipped_updates) = (self.updates, self.skipped_updates);
        #[cfg(feature = "cuda")]
        if let Some(st) = self.accel.graph.stats()? {
            (updates, skipped_updates) = (st.guard.applied, st.guard.skipped());
        }
        let counters = DqnCounters {
            version: STATE_VERSION,
            env_steps: self.env_steps,
            updates,
            skipped_updates,
            sampled: Some(self.sampled),
            replay_len: n,
            replay_position: self.replay.position(),
            config: self.cfg.clone(),
        };
        crate::state_meta::write(&mut meta, STATE_KEY, &counters, CTX)?;
        crate::StateSnapshot::new(t, meta, CTX)
    }

    /// Restores a learner from [`DqnTrainer::save_state`]'s file onto `device`. Missing,
    /// unknown or mis-shaped tensors are errors naming the tensor and file.
    pub fn load_state(path: &Path, device: &Device) -> Result<Self> {
        const CTX: &str = "DqnTrainer::load_state";
        let mut nt = fx_precision::load_tensors(path, device).ctx(CTX)?;
        let c: DqnCounters = crate::state_meta::read(&nt, path, STATE_KEY, "a DQN trainer state", STATE_VERSION, CTX)?;
        // The saved config sizes what is allocated: check it against the file (network)
        // and the machine (replay buffer) first.
        for prefix in ["online.", "target."] {
            crate::state_meta::check_network(&nt, path, prefix, &c.config.net.param_specs(), CTX)?;
        }
        let cap = c.config.replay_capacity;
        let per = (2 * fx_kernels::OBS_DIM as u64 + 3) * 4;
        crate::state_meta::check_buffer(path, &format!("replay buffer (replay_capacity {cap})"), &[cap], per, CTX)?;
        let mut me = Self::new(c.config, device)
            .map_err(|e| Error::config(CTX, format!("{}: saved state: {e}", path.display())))?;
        nt.restore_varmap(&me.online.params().varmap()?, "online.").ctx(CTX)?;
        nt.restore_varmap(&me.target.params().varmap()?, "target.").ctx(CTX)?;
        me.step.load_state(&mut nt, "opt.").ctx(CTX)?;
        restore_replay(&mut me.replay, &mut nt, "replay.", (c.replay_len, c.replay_position), path, CTX)?;
        nt.finish().ctx(CTX)?;
        me.env_steps = c.env_steps;
        me.updates = c.updates;
        me.skipped_updates = c.skipped_updates;
        me.sampled = c.sampled.unwrap_or(c.updates + c.skipped_updates);
        Ok(me)
    }

    /// A warm start: the online and target networks' weights from another DQN trainer state
    /// file (e.g. the previous walk-forward fold's last checkpoint) replace this fresh
    /// trainer's; its optimiser moments, replay, ε schedule and counters stay fresh. Only
    /// before the first step (nothing captured or fused has copied the weights yet); the
    /// file's network must be this trainer's (an error names the tensor otherwise).
    pub fn warm_start(&mut self, path: &Path) -> Result<()> {
        const CTX: &str = "DqnTrainer::warm_start";
        if self.env_steps > 0 || self.updates + self.skipped_updates > 0 {
            return Err(Error::config(CTX, "a warm start is for a trainer that has not stepped"));
        }
        let mut nt = fx_precision::load_tensors(path, self.online.params().device()).ctx(CTX)?;
        let _: DqnCounters = crate::state_meta::read(&nt, path, STATE_KEY, "a DQN trainer state", STATE_VERSION, CTX)?;
        for prefix in ["online.", "target."] {
            crate::state_meta::check_network(&nt, path, prefix, &self.cfg.net.param_specs(), CTX)?;
        }
        nt.restore_varmap(&self.online.params().varmap()?, "online.").ctx(CTX)?;
        nt.restore_varmap(&self.target.params().varmap()?, "target.").ctx(CTX)
    }
}

/// Adds `replay`'s stored transitions to `out` under `prefix` (`states`, `actions`,
/// `rewards`, `next_states`, `dones`, rows in physical order; nothing when it is empty).
pub(crate) fn replay_tensors(
    replay: &ReplayBuffer,
    out: &mut HashMap<String, Tensor>,
    prefix: &str,
) -> fx_kernels::Result<()> {
    if !replay.is_empty() {
        // Views of the stored rows in physical order (a snapshot copies them to the host at
        // once, so no device copy is needed first).
        let rows = replay.stored()?;
        out.insert(format!("{prefix}states"), rows.states);
        out.insert(format!("{prefix}actions"), rows.actions);
        out.insert(format!("{prefix}rewards"), rows.rewards);
        out.insert(format!("{prefix}next_states"), rows.next_states);
        out.insert(format!("{prefix}dones"), rows.dones);
    }
    Ok(())
}

/// Refills an empty `replay` from [`replay_tensors`]' rows in `nt`, `(len, position)` as
/// saved: the same rows in the same slots, the ring at the same position. A length or
/// position that does not fit is refused, naming `path`.
pub(crate) fn restore_replay(
    replay: &mut ReplayBuffer,
    nt: &mut fx_precision::NamedTensors,
    prefix: &str,
    (n, position): (usize, usize),
    path: &Path,
    ctx: &'static str,
) -> Result<()> {
    if n > replay.capacity() || position >= replay.capacity() {
        return Err(Error::config(ctx, format!("{}: {prefix} length/position out of range", path.display())));
    }
    if n == 0 {
        return Ok(());
    }
    let obs_dim = fx_kernels::OBS_DIM;
    // The rows go to the replay's device here (a population's file is read to the host, so
    // a GPU does not hold every member's saved rows beside the rings they fill).
    let dev = replay.device().clone();
    let mut take = |name: &str, dims: &[usize]| -> Result<Tensor> {
        nt.take(&format!("{prefix}{name}"), dims).ctx(ctx)?.to_device(&dev).ctx(ctx)
    };
    let s = take("states", &[n, obs_dim])?;
    let a = take("actions", &[n])?;
    let r = take("rewards", &[n])?;
    let s2 = take("next_states", &[n, obs_dim])?;
    let d = take("dones", &[n])?;
    // Rows are stored in physical order; pushing them from position 0 rebuilds the same
    // layout. A full ring whose position is not 0 is then advanced by re-pushing its first
    // `position` rows (same values, same slots).
    replay.push_batch(&s, &a, &r, &s2, &d).ctx(ctx)?;
    if n == replay.capacity() && position > 0 {
        let head = |t: &Tensor| t.narrow(0, 0, position).ctx(ctx);
        replay.push_batch(&head(&s)?, &head(&a)?, &head(&r)?, &head(&s2)?, &head(&d)?).ctx(ctx)?;
    }
    if replay.position() != position {
        return Err(Error::config(
            ctx,
            format!("{}: {prefix} position {position} with length {n} is inconsistent", path.display()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{rel_err, Fixture};
    use crate::synthetic::{ar1_env, evaluate, Policy};

    fn small_cfg() -> DqnConfig {
        DqnConfig { net: DqnNetConfig { hidden: 64, ..Default::default() }, ..Default::default() }
    }

    /// Values that cannot train (or train nothing) are refused with the key and the value.
    #[test]
    fn configs_that_cannot_train_are_refused() {
        assert!(DqnConfig::default().validate().is_ok());
        type Case = (fn(&mut DqnConfig), &'static str);
        let cases: [Case; 8] = [
            (|c| c.optimizer.lr = 0.0, "optimizer.lr (0)"),
            (|c| c.optimizer.lr = f64::NAN, "optimizer.lr (NaN)"),
            (|c| c.max_grad_norm = f64::NAN, "max_grad_norm (NaN)"),
            (|c| c.huber_delta = 0.0, "huber_delta (0)"),
            (|c| c.epsilon.start = 1.5, "epsilon.start (1.5)"),
            (|c| c.gradient_steps = 0, "gradient_steps"),
            (|c| c.learning_starts = c.replay_capacity + 1, "exceeds replay_capacity"),
            (|c| c.gamma = f64::NAN, "gamma (NaN)"),
        ];
        for (change, want) in cases {
            let mut c = DqnConfig::default();
            change(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    /// `train.*`: two full updates (loss, backward, clip 10, AdamW, soft update) on the
    /// fixture batch. The deltas are ~1e-4 of the weights; in F32 they agree to ≤ 3.7e-5
    /// relative (target deltas ≤ 2.8e-6) (Adam's first steps divide by |g|, amplifying the last bits of tiny
    /// gradient components), so the bound is 1e-3; a wrong sign, missing decay, a missing
    /// bias correction or a target update from stale weights is off by 1e-1 or more.
    #[test]
    fn two_updates_match_fixture_deltas() {
        let fx = Fixture::load("dqn.safetensors");
        let mut tr = DqnTrainer::new(small_cfg(), &Device::Cpu).unwrap();
        tr.online.params().assign_from(&fx.map, &fx.path, "", false).unwrap();
        tr.target.params().assign_from(&fx.map, &fx.path, "target.", false).unwrap();
        let batch = crate::dqn::tests::fixture_batch(&fx);
        let want_loss: Vec<f32> = fx.get("train.loss").to_vec1().unwrap();
        let want_norm: Vec<f32> = fx.get("train.grad_norm").to_vec1().unwrap();
        for k in 0..2 {
            let st = tr.update(batch).unwrap();
            assert!(!st.skipped);
            assert!(
                (st.loss - want_loss[k] as f64).abs() <= 1e-5 * want_loss[k].abs() as f64,
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
        assert_eq!(tr.updates(), 2);
        for (net, prefix, key) in [(&tr.online, "", "train.delta."), (&tr.target, "target.", "train.delta_target.")] {
            for spec in net.params().specs() {
                let now = net.params().get(&spec.name).unwrap().as_tensor();
                let delta = (now - fx.get(&format!("{prefix}{}", spec.name))).unwrap();
                let e = rel_err(&delta, fx.get(&format!("{key}{}", spec.name)));
                assert!(e <= 1e-3, "{key}{}: rel err {e:e}", spec.name);
            }
        }
    }

    #[test]
    fn action_selection_uses_the_env_draws() {
        let env = ar1_env(8, 32, 400, 3);
        let tr = DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap();
        let obs = env.observe().unwrap();
        let greedy: Vec<u32> = tr.online().greedy_actions(&obs).unwrap().to_vec1().unwrap();
        let a0: Vec<u32> = tr.act(&env, 0.0).unwrap().to_vec1().unwrap();
        assert_eq!(a0, greedy);
        // ε = 0.5: the host reference of the counter-based ε-greedy on the same Q values.
        let q: Vec<f32> = tr.online().forward_inference(&obs).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want = fx_kernels::epsilon_greedy(&q, 3, 0.5, env.seed(), &env.env_ids(), env.step_counters()).unwrap();
        let got: Vec<u32> = tr.act(&env, 0.5).unwrap().to_vec1().unwrap();
        assert_eq!(got, want);
        assert_ne!(got, greedy, "ε = 0.5 over 8 envs should explore somewhere with this seed");
    }

    /// Steps that read nothing back train exactly as reading ones (same weights, same
    /// counters once synced) and leave the statistics out.
    #[test]
    fn quiet_steps_train_the_same() {
        let mut loud = DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap();
        let q = &mut DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap();
        let mut env_a = ar1_env(4, 32, 400, 3);
        let mut env_b = ar1_env(4, 32, 400, 3);
        let mut queued_or_read = 0usize;
        for i in 0..40 {
            let a = loud.step(&mut env_a).unwrap();
            let b = q.step_with(&mut env_b, i % 10 == 9).unwrap();
            assert!(a.mean_reward.is_some() && a.episodes_done.is_some());
            assert_eq!(b.mean_reward.is_some(), i % 10 == 9);
            assert_eq!(b.mean_reward, if i % 10 == 9 { a.mean_reward } else { None });
            queued_or_read += b.updates.len() + b.updates_queued as usize;
            assert_eq!(a.updates.len(), b.updates.len() + b.updates_queued as usize);
        }
        q.sync_counters().unwrap();
        assert!(queued_or_read > 0, "the test must run updates");
        assert_eq!((loud.updates(), loud.skipped_updates()), (q.updates(), q.skipped_updates()));
        for (x, y) in loud.online().params().vars().iter().zip(q.online().params().vars()) {
            assert_eq!(rel_err(x.as_tensor(), y.as_tensor()), 0.0);
        }
    }

    #[test]
    fn config_serde_defaults_and_unknown_fields() {
        let c: DqnConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, DqnConfig::default());
        assert_eq!(
            (c.gamma, c.tau, c.max_grad_norm, c.optimizer.lr, c.optimizer.weight_decay),
            (0.99, 0.005, 10.0, 1e-4, 0.01)
        );
        assert_eq!(c.net, DqnNetConfig { state_dim: 56, hidden: 256, n_actions: 3 });
        let c2: DqnConfig = serde_json::from_str(r#"{"net": {"hidden": 64}, "precision": "bf16"}"#).unwrap();
        assert_eq!((c2.net.hidden, c2.net.state_dim, c2.precision), (64, 56, Precision::Bf16));
        let back: DqnConfig = serde_json::from_str(&serde_json::to_string(&c2).unwrap()).unwrap();
        assert_eq!(back, c2);
        let err = serde_json::from_str::<DqnConfig>(r#"{"gama": 0.9}"#).unwrap_err().to_string();
        assert!(err.contains("gama"), "{err}");
    }

    /// F16 compute runs with loss scaling and stays close to the F32 loss.
    #[test]
    fn f16_update_uses_loss_scaling() {
        let fx = Fixture::load("dqn.safetensors");
        let cfg = DqnConfig { precision: Precision::F16, ..small_cfg() };
        let mut tr = DqnTrainer::new(cfg, &Device::Cpu).unwrap();
        tr.online.params().assign_from(&fx.map, &fx.path, "", false).unwrap();
        tr.target.params().assign_from(&fx.map, &fx.path, "target.", false).unwrap();
        let st = tr.update(crate::dqn::tests::fixture_batch(&fx)).unwrap();
        assert!(!st.skipped && st.loss_scale > 1.0, "{st:?}");
        let want = fx.get("loss").to_scalar::<f32>().unwrap() as f64;
        assert!((st.loss - want).abs() <= 2e-2 * want.abs(), "{} vs {want}", st.loss);
    }

    #[test]
    fn non_finite_batch_skips_the_update() {
        let fx = Fixture::load("dqn.safetensors");
        let mut tr = DqnTrainer::new(small_cfg(), &Device::Cpu).unwrap();
        let before = tr.online.params().to_tensors("").unwrap();
        let mut r: Vec<f32> = fx.get("in.rewards").to_vec1().unwrap();
        r[3] = f32::NAN;
        let r = Tensor::new(r, &Device::Cpu).unwrap();
        let mut batch = crate::dqn::tests::fixture_batch(&fx);
        batch.rewards = &r;
        let st = tr.update(batch).unwrap();
        assert!(st.skipped && tr.updates() == 0 && tr.skipped_updates() == 1);
        for (k, v) in tr.online.params().to_tensors("").unwrap() {
            assert_eq!(rel_err(&v, &before[&k]), 0.0, "{k} moved");
        }
    }

    fn tiny_cfg() -> DqnConfig {
        DqnConfig {
            net: DqnNetConfig { hidden: 16, ..Default::default() },
            batch_size: 16,
            replay_capacity: 50, // wraps during the test
            learning_starts: 20,
            epsilon: LinearSchedule { start: 1.0, end: 0.1, steps: 20 },
            seed: 11,
            ..Default::default()
        }
    }

    #[test]
    fn resume_is_bit_identical_on_cpu() {
        let mut env = ar1_env(4, 32, 400, 3);
        let mut a = DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap();
        for _ in 0..17 {
            a.step(&mut env).unwrap();
        }
        assert!(a.updates() > 0 && a.replay().len() == 50 && a.replay().position() != 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dqn_state.safetensors");
        a.save_state(&path).unwrap();
        let mut env_b = env.clone();
        let mut b = DqnTrainer::load_state(&path, &Device::Cpu).unwrap();
        // Wall-clock timings differ between any two runs; everything else must not.
        let untimed = |s: DqnStepStats| DqnStepStats { collect_seconds: 0.0, update_seconds: 0.0, ..s };
        for _ in 0..9 {
            let sa = a.step(&mut env).unwrap();
            let sb = b.step(&mut env_b).unwrap();
            assert_eq!(untimed(sa), untimed(sb));
        }
        for (net_a, net_b) in [(&a.online, &b.online), (&a.target, &b.target)] {
            crate::fixtures::assert_same_params(net_a.params(), net_b.params(), "differs after resume");
        }
    }

    /// A warm start takes the saved trainer's online and target weights exactly and nothing
    /// else (fresh counters, empty replay, its own seed); another network, a weights-only
    /// file and a trainer that has stepped are refused.
    #[test]
    fn warm_start_takes_the_weights_only() {
        let mut env = ar1_env(4, 32, 400, 3);
        let mut a = DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap();
        for _ in 0..17 {
            a.step(&mut env).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dqn_state.safetensors");
        a.save_state(&path).unwrap();
        let mut b = DqnTrainer::new(DqnConfig { seed: 99, ..tiny_cfg() }, &Device::Cpu).unwrap();
        let before: Vec<f32> = b.online.params().t(0).flatten_all().unwrap().to_vec1().unwrap();
        b.warm_start(&path).unwrap();
        for (net_a, net_b) in [(&a.online, &b.online), (&a.target, &b.target)] {
            crate::fixtures::assert_same_params(net_a.params(), net_b.params(), "not taken");
        }
        let after: Vec<f32> = b.online.params().t(0).flatten_all().unwrap().to_vec1().unwrap();
        assert_ne!(before, after);
        assert_eq!((b.env_steps(), b.updates(), b.replay().len(), b.config().seed), (0, 0, 0, 99));
        // It trains on from there like any fresh trainer.
        let mut env_b = ar1_env(4, 32, 400, 5);
        for _ in 0..25 {
            b.step(&mut env_b).unwrap();
        }
        assert!(b.updates() > 0);
        let e = b.warm_start(&path).unwrap_err().to_string();
        assert!(e.contains("has not stepped"), "{e}");
        let wide = DqnConfig { net: DqnNetConfig { hidden: 32, ..Default::default() }, ..tiny_cfg() };
        let e = DqnTrainer::new(wide, &Device::Cpu).unwrap().warm_start(&path).unwrap_err().to_string();
        assert!(e.contains("dqn_state.safetensors"), "{e}");
        let weights = dir.path().join("weights_only.safetensors");
        a.online.save(&weights).unwrap();
        let e = DqnTrainer::new(tiny_cfg(), &Device::Cpu).unwrap().warm_start(&weights).unwrap_err().to_string();
        assert!(e.contains("weights_only.safetensors") && e.contains(STATE_KEY), "{e}");
    }

    #[test]
    fn state_file_errors_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let net = DuelingDqn::new(DqnNetConfig::default(), &Device::Cpu, 0).unwrap();
        let path = dir.path().join("weights_only.safetensors");
        net.save(&path).unwrap();
        let msg = DqnTrainer::load_state(&path, &Device::Cpu).unwrap_err().to_string();
        assert!(msg.contains("weights_only.safetensors") && msg.contains(STATE_KEY), "{msg}");
    }

    /// Learning check: on an AR(1) return series (φ = 0.8) the greedy policy after a few
    /// thousand transitions beats flat and random on held-out data by a clear margin.
    #[test]
    fn greedy_policy_beats_flat_and_random_on_held_out_data() {
        let cfg = DqnConfig {
            net: DqnNetConfig { hidden: 32, ..Default::default() },
            gamma: 0.5,
            optimizer: AdamWConfig { lr: 2e-3, ..DqnConfig::default().optimizer },
            batch_size: 64,
            replay_capacity: 5_000,
            learning_starts: 256,
            train_every: 1,
            gradient_steps: 1,
            tau: 0.02,
            epsilon: LinearSchedule { start: 1.0, end: 0.05, steps: 150 },
            seed: 5,
            ..Default::default()
        };
        let mut tr = DqnTrainer::new(cfg, &Device::Cpu).unwrap();
        let held_out = || ar1_env(16, 64, 2_000, 2);
        // The untrained network does not pass the bar (the test can fail).
        let untrained = evaluate(&mut held_out(), 256, Policy::Dqn(tr.online())).unwrap();
        assert!(untrained < 2e-3, "untrained policy already earns {untrained:e}");
        let mut env = ar1_env(16, 64, 3_000, 1);
        for _ in 0..400 {
            tr.step(&mut env).unwrap();
        }
        let greedy = evaluate(&mut held_out(), 256, Policy::Dqn(tr.online())).unwrap();
        let flat = evaluate(&mut held_out(), 256, Policy::Flat).unwrap();
        let random = evaluate(&mut held_out(), 256, Policy::Random).unwrap();
        eprintln!("dqn per-step reward: greedy {greedy:e} flat {flat:e} random {random:e}");
        // The oracle (sign of the last return) earns about 0.8 · E|r| ≈ 6e-3 per step.
        assert!(greedy > flat + 2e-3, "greedy {greedy:e} vs flat {flat:e}");
        assert!(greedy > random + 2e-3, "greedy {greedy:e} vs random {random:e}");
    }
}
