//! The RL agents of MODELS.md (dueling double DQN and the PPO actor-critic) on candle,
//! with the spec's parameter names so weights move both ways between fx and the
//! PyTorch reference.
//!
//! `fx-models` holds the networks, their losses (double-DQN Huber against a soft-updated
//! target network; PPO clipped surrogate + value + entropy), tape-free inference and
//! action selection, and the training algorithms around them (DQN with a replay buffer,
//! PPO with E×T rollouts and GAE). The algorithms only see the `fx_kernels::VecEnv`
//! trait, so the CPU environment and the GPU experience kernels plug in the same way;
//! optimisers, clipping, loss scaling, the NaN/Inf guard and the precision policy come
//! from `fx-precision`. The sequence models (TFT, MAMBA-2) live beside these in their own
//! modules, with [`seq_train`]; on CUDA their training step is a fused forward + backward
//! (`tft::fused`, `mamba2::fused`) that the trainer captures as one graph, candle's autograd
//! staying the CPU path and the reference those steps are tested against.
//!
//! Map:
//! - [`dqn`]: [`DuelingDqn`] (`forward`, `forward_inference`, `greedy_actions`,
//!   `save`/`load`), [`dqn_loss`], [`soft_update`];
//! - [`ppo`]: [`ActorCritic`] (`forward`, `forward_inference`, `probs_inference`,
//!   `greedy_actions`, `save`/`load`), [`ppo_loss`] with approx KL and clip fraction;
//! - [`dqn_trainer`]: [`DqnTrainer`] — `step(env)` (ε-greedy collection + updates),
//!   `update(batch)`, `save_state`/`load_state` (bit-identical resume on the CPU);
//! - [`ppo_trainer`]: [`PpoTrainer`] — `collect_step(env)` / `update(env)` or
//!   `iterate(env)`, `update_minibatch(batch)`, `save_state`/`load_state`;
//! - [`param_io`]: [`ParamSet`], the named F32 variables (a candle `VarMap`) with strict
//!   safetensors load/save; [`LinearSchedule`] (ε, from fx-kernels, whose captured
//!   collection kernel computes it on the device);
//! - [`backtest`]: a policy replayed over held-out rows, with trading statistics.

pub mod backtest;
pub mod dqn;
#[cfg(feature = "cuda")]
mod dqn_fused;
#[cfg(feature = "cuda")]
mod dqn_iteration;
pub mod dqn_trainer;
mod error;
#[cfg(feature = "cuda")]
mod fused_forward;
#[cfg(feature = "cuda")]
mod graph_update;
mod linear;
pub mod mamba2;
pub mod param_io;
pub mod ppo;
#[cfg(feature = "cuda")]
mod ppo_epochs;
#[cfg(feature = "cuda")]
mod ppo_fused;
#[cfg(feature = "cuda")]
mod ppo_rollout;
pub mod ppo_trainer;
pub mod seq_ops;
pub mod seq_params;
pub mod seq_train;
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

pub use backtest::{evaluate_positions, random_positions, replay_policy, Backtest, BacktestStats};
pub use dqn::{dqn_loss, soft_update, DqnBatch, DqnLossParts, DqnNetConfig, DuelingDqn};
pub use dqn_trainer::{DqnConfig, DqnStepStats, DqnTrainer, DqnUpdateStats};
pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use fused_forward::{DqnQForward, PpoForward};
pub use mamba2::{Mamba2, Mamba2Config, Mamba2State};
pub use param_io::{ParamSet, ParamSpec};
pub use ppo::{ppo_loss, ActorCritic, PpoBatch, PpoLossConfig, PpoLossParts, PpoNetConfig};

pub use fx_kernels::LinearSchedule;
pub use ppo_trainer::{PpoConfig, PpoIterStats, PpoMinibatchStats, PpoTrainer, UpdatePhases};
pub use seq_ops::{Ctx, DropoutRng};
pub use state_snapshot::StateSnapshot;
pub use tft::{quantile_loss, Tft, TftConfig};
