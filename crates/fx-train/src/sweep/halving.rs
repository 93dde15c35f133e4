//! Successive halving (`[halving]`): every trial trains to the first rung; the best `1/eta`
//! of them by the validation metric go on to `eta` times as long, and so on, until the run's
//! length; the others stop where they are. This module holds the rungs and the ranking;
//! the population's schedule is `PopHalving` (in the sweep), the forecasters' `halve`.
//!
//! - Forecasters (TFT, MAMBA-2): rungs of epochs from `min_epochs` (default 1), ranked by
//!   the best validation loss so far; each trial keeps the run's full schedule (its learning
//!   rate decays over `seq.epochs`): stopping at a rung pauses it, it is not a shorter run.
//!   Synchronous: trials run one after another, so there is no idle worker for ASHA's
//!   asynchrony to fill.
//! - DQN and PPO: rungs of env steps from `min_steps` (default the run's steps / eta², at
//!   least 1), ranked by each member's greedy validation Sharpe at the rung, by ASHA's rule
//!   (Li et al., 2020): the trials that reach a rung together go on if they are among the
//!   best `1/eta` of every trial that has reached it so far. A population's freed slot
//!   takes the next waiting trial at step 0 (`replace_member`: DQN at any step on the
//!   `train_every` grid, PPO between iterations), so the population stays full while trials
//!   wait; members that start together meet each rung together (the synchronous case). A
//!   kept member goes on exactly as it was, so a
//!   member that reaches the end is its solo run. Deterministic: a rung's decision depends
//!   on the scores recorded at it, taken in a fixed order, so a restarted sweep decides the
//!   same.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// `[halving]` of a sweep file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HalvingConfig {
    /// Epochs of a forecaster sweep's first rung (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_epochs: Option<usize>,
    /// Env steps of a DQN / PPO sweep's first rung (default the run's steps / eta², at
    /// least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_steps: Option<u64>,
    /// Each rung keeps the best `1/eta` (rounded up) of the trials that reached it and
    /// trains them to `eta` times as long.
    #[serde(default = "three")]
    pub eta: usize,
}

fn three() -> usize {
    3
}

impl Default for HalvingConfig {
    fn default() -> Self {
        Self { min_epochs: None, min_steps: None, eta: three() }
    }
}

impl HalvingConfig {
    /// A forecaster sweep's rungs, in epochs, of trials of `epochs` epochs: `min_epochs`,
    /// `min_epochs·eta`, … while below `epochs`, then `epochs`. Refused in one line when it
    /// cannot halve or `min_steps` (a DQN / PPO key) is set.
    pub fn rungs(&self, epochs: usize) -> Result<Vec<usize>> {
        if let Some(s) = self.min_steps {
            bail!("[halving] min_steps = {s} is for DQN and PPO sweeps; a forecaster sweep's rungs are min_epochs");
        }
        let min = self.min_epochs.unwrap_or(1);
        if min == 0 || min >= epochs {
            bail!("[halving] min_epochs = {min} must be at least 1 and below seq.epochs = {epochs}");
        }
        Ok(rungs_from(min as u64, self.check_eta()?, epochs as u64).into_iter().map(|r| r as usize).collect())
    }

    /// A DQN / PPO sweep's rungs, in env steps, of runs of `steps` env steps: `min_steps`
    /// (default `steps / eta²`, at least 1), `min_steps·eta`, … while below `steps`, then
    /// `steps`. Refused in one line when it cannot halve or `min_epochs` is set.
    pub fn step_rungs(&self, steps: u64) -> Result<Vec<u64>> {
        if let Some(e) = self.min_epochs {
            bail!("[halving] min_epochs = {e} is for forecaster sweeps; a DQN / PPO sweep's rungs are min_steps");
        }
        let eta = self.check_eta()?;
        let min = self.min_steps.unwrap_or_else(|| (steps / (eta as u64).saturating_mul(eta as u64)).max(1));
        if min == 0 || min >= steps {
            bail!("[halving] min_steps = {min} must be at least 1 and below the run's steps = {steps}");
        }
        Ok(rungs_from(min, eta, steps))
    }

    fn check_eta(&self) -> Result<usize> {
        if self.eta < 2 {
            bail!("[halving] eta = {} must be at least 2", self.eta);
        }
        Ok(self.eta)
    }
}

/// `min`, `min·eta`, … while below `end`, then `end`.
fn rungs_from(min: u64, eta: usize, end: u64) -> Vec<u64> {
    let mut rungs = Vec::new();
    let mut r = min;
    while r < end {
        rungs.push(r);
        r = r.saturating_mul(eta as u64);
    }
    rungs.push(end);
    rungs
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
        let h = |min_epochs, eta| HalvingConfig { min_epochs: Some(min_epochs), min_steps: None, eta };
        assert_eq!(h(1, 3).rungs(20).unwrap(), [1, 3, 9, 20]);
        assert_eq!(h(2, 2).rungs(8).unwrap(), [2, 4, 8]);
        assert_eq!(h(1, 2).rungs(5).unwrap(), [1, 2, 4, 5]);
        assert_eq!(h(3, 10).rungs(4).unwrap(), [3, 4]);
        for (bad, epochs) in [(h(1, 1), 9), (h(0, 3), 9), (h(9, 3), 9), (h(12, 3), 9)] {
            let e = bad.rungs(epochs).unwrap_err().to_string();
            assert!(e.starts_with("[halving]") && !e.contains('\n'), "{e}");
        }
        assert_eq!(HalvingConfig::default().rungs(4).unwrap(), [1, 3, 4], "min_epochs defaults to 1");
        let steps = |min_steps, eta| HalvingConfig { min_epochs: None, min_steps, eta };
        assert_eq!(steps(Some(100), 3).step_rungs(2000).unwrap(), [100, 300, 900, 2000]);
        assert_eq!(steps(None, 3).step_rungs(2000).unwrap(), [222, 666, 1998, 2000], "steps / eta² first");
        assert_eq!(steps(None, 4).step_rungs(10).unwrap(), [1, 4, 10], "at least 1");
        for (bad, n) in [(steps(Some(0), 3), 10), (steps(Some(10), 3), 10), (steps(None, 1), 10), (steps(None, 3), 1)] {
            let e = bad.step_rungs(n).unwrap_err().to_string();
            assert!(e.starts_with("[halving]") && !e.contains('\n'), "{e}");
        }
        let e = HalvingConfig { min_epochs: Some(2), ..Default::default() }.step_rungs(100).unwrap_err().to_string();
        assert!(e.contains("min_epochs") && e.contains("forecaster"), "{e}");
        let e = steps(Some(5), 3).rungs(9).unwrap_err().to_string();
        assert!(e.contains("min_steps") && e.contains("DQN"), "{e}");
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
