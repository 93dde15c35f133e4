//! The batch size of a run: `batch = "auto"` (the default) takes the hardware budget's batch
//! for the device the run actually uses, bounded by the data; a number, `FX_BATCH_SIZE`,
//! `--batch-size`, or the model's own key in a config file (`dqn.batch_size`,
//! `ppo.minibatch_size`, `seq.batch_size`) set it instead. The value and its source are
//! printed, written to `config.toml` (as a number, so a resumed run keeps it) and to the
//! first metrics line.
//!
//! The rules of `auto`, each a bound on the budget's batch (`fx_hw::batch_size`: free
//! device memory over the model's cost per sample, 64..8192 for the RL agents):
//! - on the CPU the model key's value stands (source `cpu default`): the budget is sized by
//!   device memory, which a CPU run does not fill, so CPU runs stay as they were configured;
//! - DQN: at most `dqn.learning_starts` (the first update draws from that many transitions)
//!   and `dqn.replay_capacity`;
//! - PPO: at most a quarter of the rollout (`ppo.num_steps × env.num_envs`), so an epoch is
//!   still at least four minibatch updates;
//! - TFT / MAMBA-2: at most the training windows / 64, so an epoch is still at least 64
//!   optimiser steps.
//!
//! Out of memory at start-up, a budget batch is retried once a tier down ([`smaller_tier`],
//! driven by `lifecycle`); a batch the user set is not.
//!
//! The learning rate and the updates per environment step are kept: AdamW's step size does
//! not scale with the batch, a larger batch only averages more samples per update (checked
//! on the H200: the default DQN run at its auto batch still beats flat and random on the
//! test split, `docs/PERFORMANCE.md`).

use std::fmt;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::config::{ModelChoice, RunConfig};

/// The `batch` key: `"auto"` or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchSize {
    /// From the hardware budget (see the module docs).
    #[default]
    Auto,
    /// This many samples per optimiser step.
    Fixed(usize),
}

impl Serialize for BatchSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            BatchSize::Auto => s.serialize_str("auto"),
            BatchSize::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = BatchSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or a positive integer")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BatchSize, E> {
                v.parse().map_err(|e: String| E::custom(e))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<BatchSize, E> {
                match usize::try_from(v) {
                    Ok(n) if n > 0 => Ok(BatchSize::Fixed(n)),
                    _ => Err(E::custom(format!("batch must be \"auto\" or a positive integer, got {v}"))),
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<BatchSize, E> {
                self.visit_i64(i64::try_from(v).unwrap_or(-1))
            }
        }
        d.deserialize_any(V)
    }
}

impl std::str::FromStr for BatchSize {
    type Err = String;
    /// `auto` or a positive integer (the `--batch-size` flag).
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(BatchSize::Auto);
        }
        match s.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(BatchSize::Fixed(n)),
            _ => Err(format!("batch must be \"auto\" or a positive integer, got {s:?}")),
        }
    }
}

impl fmt::Display for BatchSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchSize::Auto => f.write_str("auto"),
            BatchSize::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// Where a fixed `batch` came from (set by whoever set it; `auto` resolves to `Budget`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchSource {
    /// `batch = N` in a config file (or a saved run's config.toml).
    #[default]
    Config,
    /// The model's own key in a config file.
    ModelKey,
    /// `FX_BATCH_SIZE`.
    Env,
    /// `--batch-size`.
    Flag,
    /// `auto` on a GPU: the hardware budget.
    Budget,
    /// `auto` on the CPU: the model key's value.
    CpuDefault,
}

impl BatchSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchSource::Config => "config",
            BatchSource::ModelKey => "config (model key)",
            BatchSource::Env => "FX_BATCH_SIZE",
            BatchSource::Flag => "flag",
            BatchSource::Budget => "budget",
            BatchSource::CpuDefault => "cpu default",
        }
    }
}

/// What [`resolve`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchChoice {
    pub value: usize,
    pub source: BatchSource,
    /// How `auto` got there (the budget's batch and the bound that applied); empty otherwise.
    pub detail: String,
}

impl BatchChoice {
    /// One line for the start of a run.
    pub fn describe(&self, model: ModelChoice) -> String {
        let key = model_key_name(model);
        let detail = if self.detail.is_empty() { String::new() } else { format!("; {}", self.detail) };
        format!("batch {} ({key}, source {}{detail})", self.value, self.source.as_str())
    }
}

/// The config key holding the batch of `model`.
pub fn model_key_name(model: ModelChoice) -> &'static str {
    match model {
        ModelChoice::Dqn => "dqn.batch_size",
        ModelChoice::Ppo => "ppo.minibatch_size",
        ModelChoice::Tft | ModelChoice::Mamba2 => "seq.batch_size",
    }
}

/// The hardware budget's name for `model`.
pub fn model_kind(model: ModelChoice) -> fx_hw::ModelKind {
    match model {
        ModelChoice::Dqn => fx_hw::ModelKind::Dqn,
        ModelChoice::Ppo => fx_hw::ModelKind::Ppo,
        ModelChoice::Tft => fx_hw::ModelKind::Tft,
        ModelChoice::Mamba2 => fx_hw::ModelKind::Mamba2,
    }
}

/// The data's bound on an `auto` batch (see the module docs) and what it is called.
fn data_bound(cfg: &RunConfig, train_windows: Option<usize>) -> (usize, String) {
    match cfg.model {
        ModelChoice::Dqn => {
            let b = cfg.dqn.learning_starts.min(cfg.dqn.replay_capacity).max(1);
            (b, format!("dqn.learning_starts / replay_capacity {b}"))
        }
        ModelChoice::Ppo => {
            let rollout = cfg.ppo.num_steps.saturating_mul(cfg.env.num_envs);
            // PPO needs at least two rows a minibatch (advantage normalisation).
            let b = (rollout / 4).max(rollout.min(2)).max(1);
            (b, format!("a quarter of the {rollout}-row rollout"))
        }
        ModelChoice::Tft | ModelChoice::Mamba2 => {
            let w = train_windows.unwrap_or(usize::MAX);
            let b = (w / 64).max(1);
            (b, format!("{w} training windows / 64"))
        }
    }
}

/// Settles the run's batch for `device` and writes it into `cfg` (the model key, and
/// `batch` as a number, so config.toml records it). `train_windows`: the sequence models'
/// training windows (their data bound); `budget_batch`: the budget's batch on a GPU
/// (`None` on the CPU; [`budget_batch`] computes it), asked for only when `auto` needs it.
pub fn resolve(
    cfg: &mut RunConfig,
    budget_batch: impl FnOnce(&RunConfig) -> Option<usize>,
    train_windows: Option<usize>,
) -> BatchChoice {
    let auto = cfg.batch == BatchSize::Auto && !cfg.model_key_given();
    let budget = if auto { budget_batch(cfg) } else { None };
    let choice = match (cfg.batch, budget) {
        (BatchSize::Fixed(n), _) => BatchChoice { value: n, source: cfg.batch_source, detail: String::new() },
        (BatchSize::Auto, _) if cfg.model_key_given() => {
            BatchChoice { value: cfg.batch_key_value(), source: BatchSource::ModelKey, detail: String::new() }
        }
        (BatchSize::Auto, None) => BatchChoice {
            value: cfg.batch_key_value(),
            source: BatchSource::CpuDefault,
            detail: "the CPU keeps the config's batch".into(),
        },
        (BatchSize::Auto, Some(budget)) => {
            let (bound, why) = data_bound(cfg, train_windows);
            let value = budget.min(bound);
            let detail =
                if value == budget { format!("budget {budget}") } else { format!("budget {budget}, bounded by {why}") };
            BatchChoice { value, source: BatchSource::Budget, detail }
        }
    };
    cfg.set_batch_key(choice.value);
    cfg.batch = BatchSize::Fixed(choice.value);
    choice
}

/// The hardware budget's batch for `cfg.model` on `device` (free memory over the model's
/// estimated cost), or `None` on the CPU.
pub fn budget_batch(cfg: &RunConfig, device: &Device) -> Option<usize> {
    // The unit tests stand in a GPU's budget on the CPU (`lifecycle::test_hooks`).
    #[cfg(test)]
    if let Some(b) = crate::lifecycle::test_hooks::budget_batch() {
        return Some(b);
    }
    let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() else { return None };
    let overrides = fx_hw::Overrides::default().with_device(&format!("cuda:{gpu_id}"));
    Some(fx_hw::HardwareBudget::detect_with(&overrides).batch_size(model_kind(cfg.model)).value)
}

/// The batch an `auto` run retries at once after the device ran out of memory at start-up
/// (`lifecycle`): the next smaller tier of the budget, whose batches are powers of two
/// from 256 up (the tier table's 8192 / 4096 / 2048 / ...: half the activation memory a
/// tier down), i.e. the largest power of two below the batch, not below the model's
/// smallest budget batch (`fx_hw::ModelKind::batch_bounds`). `None` for a batch the user
/// set (config, model key, `FX_BATCH_SIZE`, flag, the CPU's config value: the user gets the
/// out-of-memory hint instead) or one already at the smallest tier.
pub fn smaller_tier(choice: &BatchChoice, model: ModelChoice) -> Option<BatchChoice> {
    if choice.source != BatchSource::Budget || choice.value < 2 {
        return None;
    }
    let below = 1usize << (usize::BITS - 1 - (choice.value - 1).leading_zeros());
    let (lo, _) = model_kind(model).batch_bounds();
    (below >= lo).then(|| BatchChoice {
        value: below,
        source: BatchSource::Budget,
        detail: format!("{}; retried a tier down after running out of memory at batch {}", choice.detail, choice.value),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(model: ModelChoice) -> RunConfig {
        RunConfig { model, ..RunConfig::default() }
    }

    #[test]
    fn parses_auto_and_positive_numbers_only() {
        assert_eq!("auto".parse::<BatchSize>().unwrap(), BatchSize::Auto);
        assert_eq!("AUTO".parse::<BatchSize>().unwrap(), BatchSize::Auto);
        assert_eq!("512".parse::<BatchSize>().unwrap(), BatchSize::Fixed(512));
        for bad in ["0", "-3", "big", "", "1.5"] {
            assert!(bad.parse::<BatchSize>().is_err(), "{bad}");
        }
        #[derive(Deserialize)]
        struct T {
            batch: BatchSize,
        }
        assert_eq!(toml::from_str::<T>("batch = \"auto\"").unwrap().batch, BatchSize::Auto);
        assert_eq!(toml::from_str::<T>("batch = 96").unwrap().batch, BatchSize::Fixed(96));
        for bad in ["batch = 0", "batch = -1", "batch = \"many\"", "batch = 1.5"] {
            assert!(toml::from_str::<T>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn auto_on_the_cpu_keeps_the_model_key() {
        let mut c = cfg(ModelChoice::Dqn);
        let ch = resolve(&mut c, |_| None, None);
        assert_eq!((ch.value, ch.source), (256, BatchSource::CpuDefault));
        assert_eq!((c.dqn.batch_size, c.batch), (256, BatchSize::Fixed(256)));
    }

    #[test]
    fn auto_on_a_gpu_takes_the_budget_within_the_data_bounds() {
        // DQN: the default learns from 2048 transitions, so an H200's 8192 is bounded to it.
        let mut c = cfg(ModelChoice::Dqn);
        let ch = resolve(&mut c, |_| Some(8192), None);
        assert_eq!((ch.value, ch.source, c.dqn.batch_size), (2048, BatchSource::Budget, 2048));
        assert!(ch.detail.contains("learning_starts"), "{}", ch.detail);
        // A 4 GB card's 230 is within the bound (and below the config's 256: memory first).
        let mut c = cfg(ModelChoice::Dqn);
        let ch = resolve(&mut c, |_| Some(230), None);
        assert_eq!((ch.value, ch.detail.as_str()), (230, "budget 230"));
        // PPO: a quarter of the 64 × 32 rollout.
        let mut c = cfg(ModelChoice::Ppo);
        assert_eq!(resolve(&mut c, |_| Some(2048), None).value, 512);
        // Resolved once, the batch is a number: a second call keeps it.
        assert_eq!(
            (c.batch, resolve(&mut c, |_| Some(8192), None).source),
            (BatchSize::Fixed(512), BatchSource::Config)
        );
        let base = cfg(ModelChoice::Ppo);
        let mut c = RunConfig { env: fx_kernels::EnvConfig { num_envs: 256, ..base.env.clone() }, ..base };
        assert_eq!(resolve(&mut c, |_| Some(2048), None).value, 2048);
        assert_eq!(c.ppo.minibatch_size, 2048);
        // Sequence models: 64 steps per epoch at least.
        let mut c = cfg(ModelChoice::Tft);
        assert_eq!(resolve(&mut c, |_| Some(4096), Some(100_000)).value, 1562);
        let mut c = cfg(ModelChoice::Mamba2);
        assert_eq!(resolve(&mut c, |_| Some(4096), Some(1000)).value, 15);
        assert_eq!(resolve(&mut cfg(ModelChoice::Mamba2), |_| Some(4096), Some(10)).value, 1);
    }

    #[test]
    fn a_fixed_batch_or_an_explicit_model_key_wins_over_the_budget() {
        for source in [BatchSource::Config, BatchSource::Env, BatchSource::Flag] {
            let mut c = RunConfig { batch: BatchSize::Fixed(96), batch_source: source, ..cfg(ModelChoice::Ppo) };
            let ch = resolve(&mut c, |_| unreachable!("a set batch never asks the hardware"), None);
            assert_eq!((ch.value, ch.source, c.ppo.minibatch_size), (96, source, 96));
        }
        let mut c = cfg(ModelChoice::Tft);
        c.seq.batch_size = 48;
        c.batch_keys_given.seq = true;
        let ch = resolve(&mut c, |_| unreachable!("a set batch never asks the hardware"), Some(1_000_000));
        assert_eq!((ch.value, ch.source), (48, BatchSource::ModelKey));
        assert!(ch.describe(ModelChoice::Tft).contains("seq.batch_size"));
    }

    #[test]
    fn a_budget_batch_steps_down_one_power_of_two_and_a_set_batch_never() {
        let budget = |value| BatchChoice { value, source: BatchSource::Budget, detail: format!("budget {value}") };
        let tier = |value, model| smaller_tier(&budget(value), model).map(|c| c.value);
        assert_eq!(tier(8192, ModelChoice::Dqn), Some(4096));
        assert_eq!(tier(2048, ModelChoice::Ppo), Some(1024));
        // A data-bounded or sub-256 budget batch goes to the power of two below it.
        assert_eq!(tier(1562, ModelChoice::Tft), Some(1024));
        assert_eq!(tier(230, ModelChoice::Dqn), Some(128));
        // Not below the model's smallest budget batch (RL 64, sequence models 8).
        assert_eq!(tier(64, ModelChoice::Dqn), None);
        assert_eq!(tier(100, ModelChoice::Dqn), Some(64));
        assert_eq!(tier(15, ModelChoice::Mamba2), Some(8));
        assert_eq!(tier(8, ModelChoice::Mamba2), None);
        let c = smaller_tier(&budget(2048), ModelChoice::Dqn).unwrap();
        assert_eq!(c.source, BatchSource::Budget);
        assert!(c.detail.contains("out of memory at batch 2048"), "{}", c.detail);
        for source in
            [BatchSource::Config, BatchSource::ModelKey, BatchSource::Env, BatchSource::Flag, BatchSource::CpuDefault]
        {
            let set = BatchChoice { value: 4096, source, detail: String::new() };
            assert_eq!(smaller_tier(&set, ModelChoice::Dqn), None, "{source:?}");
        }
    }
}
