//! The one interface agents and trainers use to collect experience, whatever the backend.
//!
//! A [`VecEnv`] steps `E` trading accounts at once. Everything goes in and out as candle
//! [`Tensor`]s on the env's [`device`](VecEnv::device) (CPU for [`CpuTradingEnv`],
//! the GPU for `GpuTradingEnv`), so an agent's network output feeds straight into
//! [`step`](VecEnv::step) without host copies on the GPU backend:
//!
//! - states: `[E, 56]` f32 ([`OBS_DIM`]); actions: `[E]` u32 in `{0, 1, 2}`;
//!   rewards and dones: `[E]` f32 (dones are 0/1);
//! - action selection ([`epsilon_greedy`](VecEnv::epsilon_greedy),
//!   [`sample_from_probs`](VecEnv::sample_from_probs)) uses the env's seed, global
//!   account ids and step counters, so it is reproducible and identical across backends;
//! - the fused collection steps ([`step_into_replay`](VecEnv::step_into_replay) for DQN,
//!   [`step_into_rollout`](VecEnv::step_into_rollout) for PPO) write experience into the
//!   [`ReplayBuffer`] / [`Rollout`]; the defaults compose the basic methods, the GPU
//!   backend replaces them with single kernel launches.
//!
//! A typical DQN collection loop:
//! ```
//! # use std::sync::Arc;
//! # use fx_kernels::{CpuTradingEnv, EnvConfig, EnvData, ReplayBuffer, VecEnv};
//! # let t_len = 300;
//! # let close: Vec<f64> = (0..t_len).map(|i| 1.0 + 0.001 * (i as f64).sin()).collect();
//! # let data = Arc::new(EnvData::new(vec![0.0; t_len * 51], close)?);
//! let mut env = CpuTradingEnv::new(data, EnvConfig { num_envs: 4, episode_len: 16, ..Default::default() })?;
//! let mut replay = ReplayBuffer::new(1000, env.device())?;
//! for _ in 0..3 {
//!     let obs = env.observe()?;                          // [E, 56]: the Q-net input
//!     let q = obs.narrow(1, 0, 3)?;                      // stand-in for Q(obs): [E, 3]
//!     let actions = env.epsilon_greedy(&q, 0.1)?;        // [E] u32
//!     let step = env.step_into_replay(&actions, &mut replay)?;
//!     assert_eq!(step.reward.dims(), &[4]);
//! }
//! assert_eq!(replay.len(), 12);
//! # Ok::<(), fx_kernels::Error>(())
//! ```
//!
//! [`CpuTradingEnv`]: crate::CpuTradingEnv
//! [`OBS_DIM`]: crate::OBS_DIM

use candle_core::{DType, Device, Tensor};

use crate::env::N_ACTIONS;
use crate::error::{CandleContext, Error, Result};
use crate::replay::ReplayBuffer;
use crate::rng;
use crate::rollout::Rollout;

/// What one step returns, all on the env's device.
#[derive(Clone, Debug)]
pub struct Step {
    /// `[E, 56]` f32: the state after the step, before any auto-reset (the `s'` of the
    /// transition).
    pub next_obs: Tensor,
    /// `[E]` f32 rewards.
    pub reward: Tensor,
    /// `[E]` f32, 1.0 where the episode ended at this step (the account was reset).
    pub done: Tensor,
    /// `[E, 56]` f32: the state the agent acts on next (after auto-reset); equal to
    /// [`VecEnv::observe`] after the step.
    pub obs: Tensor,
}

/// A batch of `E` trading accounts stepped together (see the module docs).
pub trait VecEnv {
    /// Number of accounts `E`.
    fn num_envs(&self) -> usize;

    /// The device every tensor in and out lives on.
    fn device(&self) -> &Device;

    /// Seed of the counter-based draws.
    fn seed(&self) -> u64;

    /// Global index of account 0 (the draws use `env_offset + e`).
    fn env_offset(&self) -> u64;

    /// The current states, `[E, 56]` f32.
    fn observe(&self) -> Result<Tensor>;

    /// Steps every account with `actions` (`[E]` u32, each < 3) and auto-resets finished
    /// episodes. Invalid actions give an error and leave the env unchanged.
    fn step(&mut self, actions: &Tensor) -> Result<Step>;

    /// Each account's step counter (steps since creation; the RNG `step` of the next
    /// action draw), copied to the host. For diagnostics and tests; the selection
    /// methods below use the counters without copying them.
    fn counters(&self) -> Result<Vec<u64>>;

    /// ε-greedy actions (`[E]` u32) from Q-values `q` (`[E, 3]`, f32): streams 1 and 2 of
    /// the draws with this env's seed, account ids and counters; argmax ties go to the
    /// lowest action.
    fn epsilon_greedy(&self, q: &Tensor, eps: f64) -> Result<Tensor>;

    /// Policy sampling (`[E]` u32) from probabilities `probs` (`[E, 3]`): stream 3, the
    /// first action whose f64 cumulative probability exceeds the draw.
    fn sample_from_probs(&self, probs: &Tensor) -> Result<Tensor>;

    /// This env as the CUDA backend, for callers that capture its kernels in a CUDA graph
    /// (the DQN trainer's whole-iteration graph); None for every other backend.
    #[cfg(feature = "cuda")]
    fn as_gpu(&self) -> Option<&crate::GpuTradingEnv> {
        None
    }

    /// DQN collection: steps with `actions` and pushes `(s, a, r, s', done)` for every
    /// account into `replay` (`s` the state the actions were chosen from, `s'` the
    /// pre-reset next state). The buffer must live on this env's device.
    fn step_into_replay(&mut self, actions: &Tensor, replay: &mut ReplayBuffer) -> Result<Step> {
        let s = self.observe()?;
        let step = self.step(actions)?;
        replay.push_batch(&s, actions, &step.reward, &step.next_obs, &step.done)?;
        Ok(step)
    }

    /// PPO collection: samples actions from `logits` (`[E, 3]` f32; softmax in f64, then
    /// the stream-3 draw as [`sample_from_probs`](VecEnv::sample_from_probs)), steps, and
    /// appends `(s, a, log π(a|s), value, r, done)` as the next row of `rollout`
    /// (`values`: `[E]` f32 critic outputs for `s`). Returns the step; the chosen actions
    /// are in the rollout.
    fn step_into_rollout(&mut self, logits: &Tensor, values: &Tensor, rollout: &mut Rollout) -> Result<Step> {
        let ctx = "VecEnv::step_into_rollout";
        let e = self.num_envs();
        if logits.dims() != [e, N_ACTIONS] {
            return Err(Error::shape("logits", ctx, format!("[{e}, {N_ACTIONS}]"), format!("{:?}", logits.dims())));
        }
        crate::checks::expect_tensor(values, "values", ctx, &[e], DType::F32, self.device())?;
        if rollout.is_full() {
            return Err(Error::Full { what: "rollout", capacity: rollout.horizon(), context: ctx });
        }
        let l = logits.to_dtype(DType::F32).and_then(|x| x.flatten_all()).and_then(|x| x.to_vec1::<f32>()).ctx(ctx)?;
        if let Some((index, v)) = l.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::NonFinite { what: "logits", index, value: *v as f64, context: ctx });
        }
        let counters = self.counters()?;
        let (seed, off) = (self.seed(), self.env_offset());
        let mut actions = Vec::with_capacity(e);
        let mut logp = Vec::with_capacity(e);
        for i in 0..e {
            let u = rng::draw(seed, rng::STREAM_POLICY, off + i as u64, counters[i]);
            let (a, lp) = crate::select::sample_from_logits(&l[i * N_ACTIONS..(i + 1) * N_ACTIONS], u);
            actions.push(a as u32);
            logp.push(lp as f32);
        }
        let dev = self.device().clone();
        let actions = Tensor::from_vec(actions, e, &dev).ctx(ctx)?;
        let logp = Tensor::from_vec(logp, e, &dev).ctx(ctx)?;
        let s = self.observe()?;
        let step = self.step(&actions)?;
        rollout.push(&s, &actions, &logp, values, &step.reward, &step.done)?;
        Ok(step)
    }
}
