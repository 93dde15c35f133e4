//! The fused MLP shared by the DQN and PPO agents: its CPU/f64 reference ([`reference`]),
//! the greedy decision paths (CPU: [`cpu`]; CUDA: `cuda`, the one-launch policy and the
//! persistent `MlpServer`, F32 and the INT8 image of [`int8`]) and, under `cuda`, the fused
//! training step's kernels (`train_cuda`) and tape-free forwards (`forward_cuda`).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod forward_cuda;
pub mod int8;
pub mod reference;
#[cfg(feature = "cuda")]
pub mod train_cuda;

#[cfg(feature = "cuda")]
pub use forward_cuda::{DqnQForward, PpoForward};
