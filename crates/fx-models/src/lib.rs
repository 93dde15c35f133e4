//! fx-models: the model zoo of `shared/spec/MODELS.md` on candle — DQN, PPO, the
//! temporal fusion transformer (quantile forecasts) and the MAMBA-2 (SSD) regressor —
//! with the spec's parameter names and shapes (safetensors interchangeable with the
//! PyTorch reference), their losses, and the helpers that train them.

pub mod error;
pub mod mamba2;
pub mod seq_ops;
pub mod seq_params;
pub mod tft;

#[cfg(test)]
mod seq_testing;

pub use error::{Error, Result};
