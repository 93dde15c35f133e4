use serde::{Deserialize, Serialize};

/// Smallest batch the RL budget hands out.
pub const BATCH_MIN: usize = 64;
/// Largest batch the RL budget hands out.
pub const BATCH_MAX: usize = 8192;

/// The model families fx trains; each has its own memory cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Dqn,
    Ppo,
    Tft,
    Mamba2,
}

impl ModelKind {
    pub const ALL: [ModelKind; 4] = [ModelKind::Dqn, ModelKind::Ppo, ModelKind::Tft, ModelKind::Mamba2];

    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Dqn => "dqn",
            ModelKind::Ppo => "ppo",
            ModelKind::Tft => "tft",
            ModelKind::Mamba2 => "mamba2",
        }
    }

    /// The batch range handed out for this model: `[64, 8192]` transitions for the RL
    /// agents, `[8, 1024]` windows for the sequence models (a window is 72–256 steps).
    pub fn batch_bounds(self) -> (usize, usize) {
        match self {
            ModelKind::Dqn | ModelKind::Ppo => (BATCH_MIN, BATCH_MAX),
            ModelKind::Tft | ModelKind::Mamba2 => (8, 1024),
        }
    }
}

const MIB: u64 = 1 << 20;

/// Memory cost of one training run: a fixed overhead plus a cost per sample of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Bytes that do not scale with the batch (CUDA context, library workspaces,
    /// weights, optimiser state, replay/rollout storage).
    pub overhead_bytes: u64,
    /// Bytes per sample of the batch (activations, gradients of activations, inputs).
    pub bytes_per_sample: u64,
}

impl CostModel {
    /// The documented planning estimate for `model` at the spec's default sizes.
    ///
    /// The RL costs are the design's planning numbers: deliberately conservative (they
    /// leave room for the replay buffer, rollout storage and the environment on the same
    /// card), chosen so that the formula reproduces the design's tier table
    /// (4 GB → DQN 230 / PPO 64, 24 GB → 2048 / 512, 48 GB → 4096 / 1024,
    /// 80 GB → 8192 / 2048). The sequence-model costs are the peak memory per sample of the
    /// PyTorch reference on an H200 (`../shared/reference/results`: TFT 5231 MiB at batch
    /// 256, Mamba2 1689 MiB at batch 32, F32). A probe on the GPU replaces them
    /// with measurements.
    pub fn estimate(model: ModelKind) -> Self {
        let (overhead_mib, per_sample_kib) = match model {
            ModelKind::Dqn => (1700, 8806),      // 8.6 MiB
            ModelKind::Ppo => (1700, 32 * 1024), // 32 MiB
            ModelKind::Tft => (512, 20 * 1024 + 448),
            ModelKind::Mamba2 => (512, 52 * 1024 + 800),
        };
        CostModel { overhead_bytes: overhead_mib * MIB, bytes_per_sample: per_sample_kib * 1024 }
    }
}

/// The batch size for `model` given `free_bytes` of device memory:
/// `(free − overhead) / bytes_per_sample`, rounded down to a power of two from 256 up (so
/// large batches split evenly into tiles), and clamped to the model's
/// [`ModelKind::batch_bounds`].
///
/// ```
/// use fx_hw::{batch_size, CostModel, ModelKind};
/// let free = 4096u64 * 9 / 10 << 20; // a 4 GB laptop GPU with 10 % in use elsewhere
/// assert_eq!(batch_size(ModelKind::Dqn, free, CostModel::estimate(ModelKind::Dqn)), 230);
/// ```
pub fn batch_size(model: ModelKind, free_bytes: u64, cost: CostModel) -> usize {
    let (lo, hi) = model.batch_bounds();
    let per = cost.bytes_per_sample.max(1);
    let raw = free_bytes.saturating_sub(cost.overhead_bytes) / per;
    let raw = usize::try_from(raw).unwrap_or(usize::MAX);
    let shaped = if raw >= 256 { prev_power_of_two(raw) } else { raw };
    shaped.clamp(lo, hi)
}

/// How many members of a population fit in `free_bytes`: `(free − overhead) / member_bytes`,
/// at least 1 (a lone member is an ordinary run) and at most `max` (the trials there are).
///
/// `member_bytes` is one member's whole footprint (weights, gradients, optimiser moments,
/// target network, replay or rollout storage, its batch's activations): the model crate
/// estimates it from the member's config.
///
/// ```
/// // an H200 with 140 GB free, 1.7 GiB of fixed overhead, 40 MiB a member, 256 trials
/// assert_eq!(fx_hw::population_size(140 << 30, 1700 << 20, 40 << 20, 256), 256);
/// // a 4 GB laptop GPU holds 59 such members: a 256-trial sweep runs in 5 waves there
/// assert_eq!(fx_hw::population_size(4096 * 9 / 10 << 20, 1300 << 20, 40 << 20, 256), 59);
/// ```
pub fn population_size(free_bytes: u64, overhead_bytes: u64, member_bytes: u64, max: usize) -> usize {
    let raw = free_bytes.saturating_sub(overhead_bytes) / member_bytes.max(1);
    usize::try_from(raw).unwrap_or(usize::MAX).clamp(1, max.max(1))
}

fn prev_power_of_two(n: usize) -> usize {
    debug_assert!(n > 0);
    1 << (usize::BITS - 1 - n.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Free memory assumed for a card: 90 % of its memory (the rest is held by the
    /// driver, a display or other processes).
    fn free_of(card_mib: u64) -> u64 {
        card_mib * MIB * 9 / 10
    }

    #[test]
    fn reproduces_the_design_tier_table() {
        // (card, memory in MiB as the driver reports it, DQN batch, PPO batch)
        let tiers = [
            ("RTX 3050 Ti 4 GB", 4096, 230, 64),
            ("L4 24 GB", 23034, 2048, 512),
            ("L40S 48 GB", 46068, 4096, 1024),
            ("A100 80 GB", 81920, 8192, 2048),
            ("H100 80 GB", 81559, 8192, 2048),
        ];
        for (card, mib, dqn, ppo) in tiers {
            let free = free_of(mib);
            assert_eq!(batch_size(ModelKind::Dqn, free, CostModel::estimate(ModelKind::Dqn)), dqn, "{card} DQN");
            assert_eq!(batch_size(ModelKind::Ppo, free, CostModel::estimate(ModelKind::Ppo)), ppo, "{card} PPO");
        }
    }

    #[test]
    fn no_memory_still_gives_the_minimum() {
        assert_eq!(batch_size(ModelKind::Dqn, 0, CostModel::estimate(ModelKind::Dqn)), BATCH_MIN);
    }

    #[test]
    fn population_fills_the_free_memory_and_never_exceeds_the_trials() {
        let mib = MIB;
        // 10 GiB free, 2 GiB overhead, 100 MiB a member: 81 fit
        assert_eq!(population_size(10 << 30, 2 << 30, 100 * mib, 1000), 81);
        assert_eq!(population_size(10 << 30, 2 << 30, 100 * mib, 7), 7);
        // nothing free still trains one member (the run then fails or fits like a solo run)
        assert_eq!(population_size(0, 2 << 30, 100 * mib, 7), 1);
        assert_eq!(population_size(10 << 30, 0, 0, 5), 5);
    }

    proptest! {
        #[test]
        fn population_is_clamped(free in 0u64..(1 << 44), overhead in 0u64..(1 << 34), per in 0u64..(1 << 30), max in 0usize..5000) {
            let n = population_size(free, overhead, per, max);
            prop_assert!(n >= 1 && n <= max.max(1));
            // n members fit unless only the one forced member is there
            prop_assert!(n == 1 || overhead + n as u64 * per.max(1) <= free);
        }

        #[test]
        fn batch_is_clamped(free in 0u64..(1 << 44), overhead in 0u64..(1 << 34), per in 1u64..(1 << 30), m in 0usize..4) {
            let model = ModelKind::ALL[m];
            let (lo, hi) = model.batch_bounds();
            let b = batch_size(model, free, CostModel { overhead_bytes: overhead, bytes_per_sample: per });
            prop_assert!(b >= lo && b <= hi);
        }

        #[test]
        fn batch_is_monotone_in_free_memory(a in 0u64..(1 << 42), extra in 0u64..(1 << 40), per in 1u64..(1 << 26)) {
            let cost = CostModel { overhead_bytes: 1 << 30, bytes_per_sample: per };
            prop_assert!(batch_size(ModelKind::Dqn, a, cost) <= batch_size(ModelKind::Dqn, a + extra, cost));
        }

        #[test]
        fn batch_is_antitone_in_cost(free in 0u64..(1 << 42), per in 1u64..(1 << 26), extra in 0u64..(1 << 26)) {
            let cheap = CostModel { overhead_bytes: 0, bytes_per_sample: per };
            let dear = CostModel { overhead_bytes: 0, bytes_per_sample: per + extra };
            prop_assert!(batch_size(ModelKind::Ppo, free, dear) <= batch_size(ModelKind::Ppo, free, cheap));
        }

        #[test]
        fn batch_fits_in_memory_when_above_minimum(free in 0u64..(1 << 42), per in 1u64..(1 << 26)) {
            let cost = CostModel { overhead_bytes: 1 << 28, bytes_per_sample: per };
            let b = batch_size(ModelKind::Dqn, free, cost);
            if b > BATCH_MIN {
                prop_assert!(cost.overhead_bytes + b as u64 * per <= free);
            }
        }
    }
}
