//! Successive halving for forecaster sweeps (`[halving]`): every trial trains to the first
//! rung's epochs; the best `1/eta` of them by validation loss (the best epoch's so far)
//! go on to `eta` times as many epochs, and so on, until the run's `seq.epochs`; the others
//! stop where they are. This is the synchronous form of ASHA (Li et al., 2020): its
//! asynchrony keeps parallel workers busy, and forecaster trials run one after another,
//! so there is no idle worker to fill and the synchronous rule's decisions (each rung
//! ranks every trial that reached it) are the ones kept. Deterministic: a rung's decision
//! depends on the trials' losses at that rung alone, so a restarted sweep makes the same
//! decisions from its trials' folders.
//!
//! Each trial keeps the run's full schedule (its learning rate decays over `seq.epochs`):
//! stopping at a rung pauses it, it is not a shorter run.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// `[halving]` of a sweep file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HalvingConfig {
    /// Epochs of the first rung.
    #[serde(default = "one")]
    pub min_epochs: usize,
    /// Each rung keeps the best `1/eta` (rounded up) of the trials that reached it and
    /// trains them to `eta` times the epochs.
    #[serde(default = "three")]
    pub eta: usize,
}

fn one() -> usize {
    1
}

fn three() -> usize {
    3
}

impl Default for HalvingConfig {
    fn default() -> Self {
        Self { min_epochs: one(), eta: three() }
    }
}

impl HalvingConfig {
    /// The rungs, in epochs, of trials of `epochs` epochs: `min_epochs`, `min_epochs·eta`,
    /// … while below `epochs`, then `epochs`. Refused in one line when it cannot halve.
    pub fn rungs(&self, epochs: usize) -> Result<Vec<usize>> {
        if self.eta < 2 {
            bail!("[halving] eta = {} must be at least 2", self.eta);
        }
        if self.min_epochs == 0 || self.min_epochs >= epochs {
            bail!("[halving] min_epochs = {} must be at least 1 and below seq.epochs = {epochs}", self.min_epochs);
        }
        let mut rungs = Vec::new();
        let mut r = self.min_epochs;
        while r < epochs {
            rungs.push(r);
            r = r.saturating_mul(self.eta);
        }
        rungs.push(epochs);
        Ok(rungs)
    }
}

/// The trials that go on from a rung: of `trials` with their losses at the rung, the best
/// `ceil(n / eta)` (lowest loss first, a non-finite loss last, ties by trial index), in
/// trial order.
pub fn keep(trials: &[usize], loss: &[f64], eta: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..trials.len()).collect();
    let key = |i: usize| if loss[i].is_finite() { loss[i] } else { f64::INFINITY };
    order.sort_by(|&a, &b| key(a).total_cmp(&key(b)).then(trials[a].cmp(&trials[b])));
    let n = trials.len().div_ceil(eta.max(1));
    let mut kept: Vec<usize> = order[..n].iter().map(|&i| trials[i]).collect();
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rungs_multiply_by_eta_and_end_at_the_run_length() {
        let h = |min_epochs, eta| HalvingConfig { min_epochs, eta };
        assert_eq!(h(1, 3).rungs(20).unwrap(), [1, 3, 9, 20]);
        assert_eq!(h(2, 2).rungs(8).unwrap(), [2, 4, 8]);
        assert_eq!(h(1, 2).rungs(5).unwrap(), [1, 2, 4, 5]);
        assert_eq!(h(3, 10).rungs(4).unwrap(), [3, 4]);
        for (bad, epochs) in [(h(1, 1), 9), (h(0, 3), 9), (h(9, 3), 9), (h(12, 3), 9)] {
            let e = bad.rungs(epochs).unwrap_err().to_string();
            assert!(e.starts_with("[halving]") && !e.contains('\n'), "{e}");
        }
    }

    /// Hand-computed: 7 trials, eta 3 → the best ceil(7/3) = 3, NaN last, ties by index.
    #[test]
    fn keep_takes_the_best_share_by_loss() {
        let trials = [0, 1, 2, 3, 4, 5, 6];
        let loss = [0.9, f64::NAN, 0.5, 0.7, 0.5, 1.2, 0.8];
        assert_eq!(keep(&trials, &loss, 3), [2, 3, 4]);
        // Trial indices, not positions, break ties and order the result.
        assert_eq!(keep(&[8, 3, 5], &[0.4, 0.4, 0.1], 2), [3, 5]);
        assert_eq!(keep(&[4], &[f64::NAN], 3), [4], "one trial always goes on");
        assert_eq!(keep(&[1, 2, 3, 4], &[0.3, 0.2, 0.1, 0.4], 2), [2, 3]);
    }
}
