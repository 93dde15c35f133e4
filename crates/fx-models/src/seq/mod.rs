//! Supervised training of the sequence models on windows of a feature series: seeded
//! window batches from `fx_data::Sampler`, AdamW (F32 moments) with linear warm-up and
//! cosine decay, global-norm clipping, validation each epoch, early stopping that
//! restores the best weights, and point-forecast metrics against the zero and
//! last-value forecasts.
//!
//! The folder: [`series`] (a feature series and its seeded window batches), [`task`] (what
//! the loop needs from a model: [`SeqTask`] for the TFT and MAMBA-2, and under `cuda` the
//! fused step it captures), [`metrics`] (held-out loss and forecast metrics), [`trainer`]
//! ([`SeqTrainer`], [`train`]: the loop, schedule, early stopping, resume), and [`ops`] (the
//! differentiable blocks both models share and the forward context); their parameters live
//! in [`crate::params::ParamStore`], as every model's do.

pub mod metrics;
pub mod ops;
pub mod series;
pub mod task;
pub mod trainer;

#[cfg(test)]
mod fuzz_tests;

pub use metrics::{
    evaluate, evaluate_forecasts, evaluate_forecasts_with, forecast_metrics, EvalReport, ForecastMetrics, Forecasts,
};
pub use series::{NextBar, SeqBatch, SeqSeries, Spans};
#[cfg(feature = "cuda")]
pub use task::FusedSeqStep;
pub use task::{Mamba2Task, SeqTask};
pub use trainer::{lr_at, train, EpochLog, SeqTrainConfig, SeqTrainer, TrainReport};
