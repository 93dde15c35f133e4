//! Mixed-precision training machinery for candle, with PyTorch's semantics.
//!
//! candle has no autocast, no GradScaler, no gradient checkpointing, its AdamW keeps the
//! moments in the weights' dtype, and several of its fused ops (softmax, RMSNorm,
//! LayerNorm) silently drop gradients. `fx-precision` fills those gaps for the fx models,
//! each piece tested against a PyTorch formula or an f64 reference:
//!
//! - the precision policy: [`Precision`] (from `fx-hw`) with [`PrecisionExt`], the
//!   [`Linear`] layer that applies it and [`to_f32`]. Master weights are always F32
//!   `Var`s; matmuls run in the compute dtype; normalisation, softmax, losses and
//!   reductions in F32;
//! - differentiable [`ops`] (`layer_norm`, `rms_norm`, `softmax_last_dim`,
//!   `log_softmax_last_dim`) to use instead of candle's fused, gradient-dropping ones;
//! - [`AdamW`] / [`Adam`] (`torch.optim` semantics, F32 moments, a skipped step is no
//!   step) behind the [`Optimizer`] trait, and [`clip_grad_norm`] (`clip_grad_norm_`);
//! - [`GradScaler`] (`torch.amp.GradScaler`: 2^16, ×2 per 2000 clean steps, ×0.5 on
//!   overflow; on by default only under F16);
//! - [`TrainStep`]: scaled backward → one device pass + one host read for the NaN/Inf
//!   guard and the gradient norm → unscale + clip → optimiser → scaler update; non-finite
//!   losses or gradients never reach the weights and are counted ([`GuardStats`]);
//! - under the `cuda` feature, `FusedStep` (the same guard → clip → Adam/AdamW → scaler
//!   tail as three device-only launches, state in device memory, optional soft target
//!   update) and `CapturedGraph` (a candle step captured once as a CUDA graph and
//!   replayed with one launch); the kernels' CPU reference is
//!   `crate::fused_ref::fused_step_reference`, checked against [`TrainStep`] here;
//! - [`PopAdamW`]: AdamW for populations (N members stacked `[N, ...]`, each member's
//!   guard, clip, learning rate, weight decay, step count and soft target update its own,
//!   decided on the device; member-batched kernels under `cuda`);
//! - [`GradAccumulator`] (N micro-batches, loss / N, F32 sums) and [`Recomputed`]
//!   (activation recomputation by segment);
//! - [`save_tensors_atomic`] / [`load_tensors`]: crash-safe tensor files with
//!   strict, named errors.
//!
//! Tensor-level functions (`ops`, `Linear`) return `candle_core::Result` so they compose
//! inside model code; the training machinery returns this crate's [`Error`].
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use fx_precision::{AdamW, AdamWConfig, GradScaler, Linear, Precision, TrainStep};
//!
//! let dev = Device::Cpu;
//! let precision: Precision = "bf16".parse().unwrap();
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let layer = Linear::new(4, 1, vb.pp("head"), precision)?;
//! let opt = AdamW::from_varmap(&varmap, AdamWConfig::default())?;
//! let mut step = TrainStep::new(opt, GradScaler::for_precision(precision), Some(1.0))?;
//!
//! let x = Tensor::ones((8, 4), DType::F32, &dev)?;
//! let pred = fx_precision::to_f32(&layer.forward(&x)?)?; // loss in F32
//! let loss = pred.sqr()?.mean_all()?;
//! let report = step.step(&loss)?;
//! assert!(report.skipped.is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod accumulate;
mod clip;
pub mod dropout;
mod error;
#[cfg(feature = "cuda")]
mod fused;
pub mod fused_ref;
mod grad_scaler;
#[cfg(feature = "cuda")]
mod graph;
mod graph_mode;
mod guard;
pub mod ops;
mod optim;
mod pop_adamw;
mod precision;
mod recompute;
mod tensor_file;

pub use accumulate::{Accumulated, GradAccumulator};
pub use clip::{clip_grad_norm, grad_norm};
pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use fused::pop_kernels::{PopAdamKernels, PopDecide, PopEntry, PopFactors};
#[cfg(feature = "cuda")]
pub use fused::{FusedAdamConfig, FusedStats, FusedStep};
pub use grad_scaler::{GradScaler, GradScalerConfig, GradScalerState, GRAD_SCALER_METADATA_KEY};
#[cfg(feature = "cuda")]
pub use graph::CapturedGraph;
pub use graph_mode::GraphMode;
pub use guard::{missing_gradients, GuardStats, SkipReason, StepReport, StepTimes, TrainStep, GUARD_METADATA_KEY};
pub use optim::{Adam, AdamConfig, AdamW, AdamWConfig, Optimizer};
pub use pop_adamw::{check_kept_members, PopAdamW, PopMember, PopStepReport};
pub use precision::{allow_tf32_matmul, to_f32, Linear, Precision, PrecisionExt};
pub use recompute::{RecomputeTape, Recomputed, Segment};
pub use tensor_file::{load_tensors, read_metadata, save_tensors_atomic, varmap_tensors, NamedTensors};
