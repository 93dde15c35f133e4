//! Mixed-precision training machinery for candle, with PyTorch's semantics.
//!
//! candle has no autocast, no GradScaler, no gradient checkpointing, its AdamW keeps the
//! moments in the weights' dtype, and several of its fused ops (softmax, RMSNorm,
//! LayerNorm) silently drop gradients. `fx-precision` fills those gaps for the fx models:
//! differentiable [`ops`], F32-moment [`AdamW`]/[`Adam`] optimisers, global-norm
//! clipping ([`clip_grad_norm`]) and a precision policy ([`Precision`], [`Linear`]).
//! Master weights are always F32 `Var`s; only matmul-heavy ops run in the compute dtype.

mod accumulate;
mod checkpoint_io;
mod clip;
mod error;
mod grad_scaler;
pub mod ops;
mod optim;
mod precision;

pub use accumulate::{Accumulated, GradAccumulator};
pub use checkpoint_io::{load_tensors, save_tensors_atomic, varmap_tensors, NamedTensors};
pub use clip::{clip_grad_norm, grad_norm};
pub use error::{Error, Result};
pub use grad_scaler::{GradScaler, GradScalerConfig, GradScalerState, GRAD_SCALER_METADATA_KEY};
pub use optim::{Adam, AdamConfig, AdamW, AdamWConfig, Optimizer};
pub use precision::{allow_tf32_matmul, to_f32, Linear, Precision, PrecisionExt};
