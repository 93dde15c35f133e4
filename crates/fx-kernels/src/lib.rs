//! The experience kernels: the vectorised trading environment of MODELS.md and the storage
//! RL agents fill from it, plus the GPU plumbing every crate above launches its kernels with.
//!
//! `fx-kernels` steps `E` independent trading accounts over one normalised feature series
//! (position change, 1 bp cost per unit of change, unrealised PnL, time in position,
//! auto-reset, the 56-wide padded state) with randomness from the counter-based
//! SplitMix64 draws of [`rng`], so every backend produces the same trajectories for the
//! same seed. [`CpuTradingEnv`] is the reference (it reproduces the PyTorch fixtures
//! exactly); under the `cuda` feature `GpuTradingEnv` runs the same step as one CUDA
//! thread per account and writes experience straight into device-resident storage.
//! Agents and trainers only see the [`VecEnv`] trait and the tensor-backed
//! [`ReplayBuffer`] (DQN) and [`Rollout`] (PPO, with [`gae()`]), so they never know which
//! backend they run on.
//!
//! CUDA (feature `cuda`): the kernels live in `kernels/<domain>/*.cu` at the workspace root
//! (`common/fx_rng.cuh` holds the device twin of [`rng`], `env/fx_env.cuh` those of the env
//! step and the selection rules); their PTX is committed under `crates/fx-kernels/ptx/` and
//! embedded with `include_str!`. Rebuild it after editing a kernel with `cargo xtask
//! build-kernels`, or by hand: `nvcc -ptx -arch=compute_80 -I kernels/common -o
//! crates/fx-kernels/ptx/NAME.ptx kernels/DOMAIN/NAME.cu` (CUDA ≤ 13.0, see `../shared/gpu`). The kernels use explicit round-to-nearest intrinsics where
//! the CPU reference rounds, so trajectories agree with [`CpuTradingEnv`] (integers and
//! positions exactly, floats within 1e-6; device tests in `cuda/tests.rs`). Beyond
//! [`VecEnv`], `cuda::GpuTradingEnv::collect_dqn` fuses ε-greedy selection, the step and the
//! replay write in one launch, `cuda::gae_device` runs GAE, and `cuda::bench_env_steps`
//! measures env steps per second. `cuda::DqnLoop` keeps a DQN loop's counters (step count,
//! replay ring position and length, minibatch key) on the device, so that collection
//! (ε from [`LinearSchedule`] computed there), replay sampling
//! ([`ReplayBuffer::sample_keyed`], the CPU's counter-based indices) and the update can be
//! one CUDA graph.
//!
//! GPU plumbing for the crates above, which launch their own kernels with it (each model's
//! kernels live in its folder of `fx-models`, the optimiser tail and dropout masks in
//! `fx-precision`): [`gemm::Gemm`] (a row-major GEMM on raw addresses, run by cuBLAS in
//! `cuda::blas` and by [`gemm::gemm_ref`] on the CPU), the address, allocation and launch
//! helpers of `cuda`, [`readback`] (pinned device-to-host reads), the tensor checks of
//! [`checks`] and this crate's [`Error`] with [`CandleContext`], which those kernels'
//! wrappers return.

// Index loops over accounts mirror the one-thread-per-account CUDA kernels line by line;
// iterator chains over several parallel arrays would hide that correspondence.
#![allow(clippy::needless_range_loop)]

pub mod checks;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod env;
mod error;
pub mod gae;
pub mod gemm;
pub mod readback;
pub mod replay;
pub mod rng;
pub mod rollout;
pub mod schedule;
pub mod select;
pub mod vec_env;

#[cfg(test)]
mod fixtures;

#[cfg(feature = "cuda")]
pub use cuda::{GpuEnvOptions, GpuTradingEnv};
pub use env::{
    write_observation, CpuTradingEnv, EnvConfig, EnvData, EnvState, SegmentNorms, SeriesRows, N_ACTIONS, N_MARKET,
    OBS_DIM,
};
pub use error::{CandleContext, Error, Result};
pub use gae::{gae, GaeConfig};
pub use replay::{MemberClock, ReplayBatch, ReplayBuffer, RingWindow};
pub use rollout::Rollout;
pub use schedule::LinearSchedule;
pub use select::{epsilon_greedy, sample_from_probs};
pub use vec_env::{Step, VecEnv};
