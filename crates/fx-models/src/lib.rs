//! The models of MODELS.md — the RL agents (dueling double DQN, the PPO actor-critic) and
//! the forecasters (TFT, MAMBA-2) — on candle, with the spec's parameter names so weights
//! move both ways between fx and the PyTorch reference, and each model's kernels beside it:
//! a model's folder holds its network, loss, fused step over one backend trait, CPU/f64
//! references, CUDA launch wrappers (PTX in `ptx/`, sources in `kernels/<model>/`) and its
//! F32 decision path (`mlp/` for the two agents' shared MLP, `tft/`, `mamba2/`).
//!
//! `fx-models` holds the networks, their losses (double-DQN Huber against a soft-updated
//! target network; PPO clipped surrogate + value + entropy), tape-free inference and
//! action selection, and the training algorithms around them (DQN with a replay buffer,
//! PPO with E×T rollouts and GAE). The algorithms only see the `fx_kernels::VecEnv`
//! trait, so the CPU environment and the GPU experience kernels plug in the same way;
//! optimisers, clipping, loss scaling, the NaN/Inf guard and the precision policy come
//! from `fx-precision`. The sequence models (TFT, MAMBA-2) live beside these in their own
//! modules, with [`seq`] (series, task, metrics, trainer); on CUDA their training step is a fused forward + backward
//! (`tft::fused`, `mamba2::fused`) that the trainer captures as one graph, candle's autograd
//! staying the CPU path and the reference those steps are tested against.
//!
//! Map:
//! - [`mlp`]: the agents' fused MLP — [`mlp::reference`] (CPU/f64), [`mlp::cpu`]
//!   (`CpuPolicy`, µs greedy decisions), [`mlp::int8`] (the INT8 weight image), under `cuda`
//!   `mlp::cuda` (`MlpPolicy`, `MlpServer`) and the fused training step's kernels;
//! - [`tft`] and [`mamba2`]: model, fused step (`ops`/`ops_cuda`; MAMBA-2 also `ssd_*`),
//!   one-bar decode (`mamba2::decode_*`) and the TFT's INT8 variable selection (`tft::int8*`);
//! - [`dqn`]: [`DuelingDqn`] (`forward`, `forward_inference`, `greedy_actions`,
//!   `save`/`load`), [`dqn_loss`], [`soft_update`];
//! - [`ppo`]: [`ActorCritic`] (`forward`, `forward_inference`, `probs_inference`,
//!   `greedy_actions`, `save`/`load`), [`ppo_loss`] with approx KL and clip fraction;
//! - [`dqn::trainer`]: [`DqnTrainer`] — `step(env)` (ε-greedy collection + updates),
//!   `update(batch)`, `save_state`/`load_state` (bit-identical resume on the CPU);
//! - [`ppo::trainer`]: [`PpoTrainer`] — `collect_step(env)` / `update(env)` or
//!   `iterate(env)`, `update_minibatch(batch)`, `save_state`/`load_state`;
//! - [`params`]: [`ParamStore`], every model's named F32 parameters (spec names outside,
//!   stacked tensors inside) with strict safetensors load/save; [`LinearSchedule`] (ε, from
//!   fx-kernels, whose captured collection kernel computes it on the device);
//! - [`backtest`]: a policy replayed over held-out rows, with trading statistics, and
//!   [`significance`] (how much luck is in a Sharpe ratio: PSR, DSR, bootstrap, PBO).

// The CPU references and decision paths index loops over rows, heads and channels to mirror
// their CUDA kernels line by line (one thread per index); iterator chains over several
// parallel arrays would hide that correspondence.
#![allow(clippy::needless_range_loop)]

pub mod backtest;
mod cpu_dot;
pub mod dqn;
mod error;
#[cfg(feature = "cuda")]
mod graph_update;
mod linear;
pub mod mamba2;
pub mod mlp;
pub mod params;
pub mod ppo;
pub mod seq;
mod state_meta;
mod state_snapshot;
pub mod tft;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod reference_f64;
#[cfg(test)]
mod seq_testing;
#[cfg(test)]
mod synthetic;

pub use backtest::significance;
pub use backtest::{equal_weight, evaluate_positions, random_positions, replay_policy, Backtest, BacktestStats};
pub use dqn::population::{DqnPopulation, PopBatch, PopStepStats, PopUpdateStats};
pub use dqn::trainer::{DqnConfig, DqnStepStats, DqnTrainer, DqnUpdateStats};
pub use dqn::{dqn_loss, soft_update, DqnBatch, DqnLossParts, DqnNetConfig, DuelingDqn};
pub use error::{Error, Result};
pub use mamba2::{Mamba2, Mamba2Config, Mamba2State};
#[cfg(feature = "cuda")]
pub use mlp::{DqnQForward, PpoForward};
pub use params::{ParamSpec, ParamStore};
pub use ppo::population::{PpoPopBatch, PpoPopulation};
pub use ppo::{ppo_loss, ActorCritic, PpoBatch, PpoLossConfig, PpoLossParts, PpoNetConfig};

pub use fx_kernels::LinearSchedule;
pub use ppo::trainer::{PpoConfig, PpoIterStats, PpoMinibatchStats, PpoTrainer, UpdatePhases};
pub use seq::ops::{Ctx, DropoutRng};
pub use state_snapshot::StateSnapshot;
pub use tft::{quantile_loss, Tft, TftConfig};
