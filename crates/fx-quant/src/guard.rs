//! INT8 decisions checked in F32 on near-ties: [`GuardedPolicy`] decides with the INT8
//! policy, and only where its two best scores are closer than the quantised file's
//! decision margin asks the F32 policy instead.
//!
//! Why: a trained DQN's Q values are close together on many observations (the default
//! run's largest |Q| is 0.027), so the INT8 model's small score errors (mean 1.4e-4 there)
//! flip the greedy action on ~2 % of all decisions, which issue 13's 99 % agreement and its
//! Sharpe within 2 % do not allow. If every pairwise score difference of the INT8 model is
//! within `m` of F32's, an INT8 gap above `m` between the best and the second-best action
//! means F32 picks the same action: the guard is exact wherever the margin holds. The
//! margin ([`decision_margin`]) is the 99th percentile of the calibration rows' largest
//! error, so it holds on most rows, not all; it is stored in the file (`decision_margin`
//! metadata). The worst case would be safer and costs more: on the default run's test
//! split, the 99th percentile (8.4e-4) sends 20 % of decisions to F32 and agrees with F32 on
//! all 884; the largest error (1.5e-3) sends 36 %, twice it 59 %, and the 90th percentile
//! 13 % (99.9 % agreement).

use crate::decide::Decide;
use crate::error::{Error, Result};
use crate::float_net::FloatNet;
use crate::policy::Int8Policy;
use crate::qnet::QuantNet;
use crate::reference::reference_scores;

/// The share of calibration rows whose largest error the margin covers.
pub const MARGIN_QUANTILE: f64 = 0.99;

/// The [`MARGIN_QUANTILE`] quantile, over `obs` rows, of a row's largest
/// `|(s8_i − s8_j) − (s_i − s_j)|` over action pairs, `s8` the quantised scores (the
/// reference's, which every ISA and the GPU equal) and `s` the F32 network's (in f64).
pub fn decision_margin(float: &FloatNet, quant: &QuantNet, obs: &[f32]) -> Result<f32> {
    let d = float.state_dim();
    if d != quant.state_dim() || !obs.len().is_multiple_of(d) || obs.is_empty() {
        return Err(Error::invalid("margin rows", format!("{} values for a {d}-wide network", obs.len())));
    }
    let mut errs = Vec::new();
    for row in obs.chunks_exact(d) {
        let want = float.forward_f64(row, |_, _| {});
        let (got, _) = reference_scores(quant, row)?;
        let mut worst = 0.0f64;
        for i in 0..got.len() {
            for j in i + 1..got.len() {
                let e = ((got[i] as f64 - got[j] as f64) - (want[i] - want[j])).abs();
                worst = worst.max(e);
            }
        }
        errs.push(worst);
    }
    errs.sort_by(f64::total_cmp);
    let at = ((errs.len() - 1) as f64 * MARGIN_QUANTILE).round() as usize;
    Ok(errs[at] as f32)
}

/// The gap between the best and the second-best score.
fn top_gap(scores: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &s in scores {
        if s > a {
            b = a;
            a = s;
        } else if s > b {
            b = s;
        }
    }
    a - b
}

/// INT8 decisions, with the `fallback` (the F32 policy) deciding wherever the INT8 gap
/// between the two best actions is not above the margin. No allocation per call; a
/// checked decision costs an F32 decision more.
pub struct GuardedPolicy<F: Decide> {
    int8: Int8Policy,
    fallback: F,
    margin: f32,
    calls: u64,
    checked: u64,
    /// The last call was decided by the fallback.
    last_checked: bool,
    /// A batch's INT8 scores ([`GuardedPolicy::act_batch`]).
    batch_scores: Vec<f32>,
    /// A batch's checked rows: their indices, observations and the fallback's actions.
    checked_rows: Vec<usize>,
    checked_obs: Vec<f32>,
    checked_actions: Vec<usize>,
}

impl<F: Decide> GuardedPolicy<F> {
    /// Guards `quant` (its file's `decision_margin`; a file without one is an error: run
    /// `fx-train quantize` again) with `fallback`, which must take the same observations and
    /// actions.
    pub fn new(quant: &QuantNet, fallback: F) -> Result<Self> {
        let margin = quant.calibration.decision_margin.ok_or_else(|| {
            Error::invalid("INT8 policy", "no decision margin recorded (quantised before margins: quantize again)")
        })?;
        Self::with_margin(Int8Policy::new(quant)?, fallback, margin)
    }

    /// Guards `int8` with `fallback` at `margin` (finite, ≥ 0).
    pub fn with_margin(int8: Int8Policy, fallback: F, margin: f32) -> Result<Self> {
        if !(margin.is_finite() && margin >= 0.0) {
            return Err(Error::invalid("decision margin", format!("{margin}: must be finite and >= 0")));
        }
        if (int8.state_dim(), int8.n_actions()) != (fallback.state_dim(), fallback.n_actions()) {
            return Err(Error::invalid(
                "fallback policy",
                format!(
                    "{}→{} against the INT8 policy's {}→{}",
                    fallback.state_dim(),
                    fallback.n_actions(),
                    int8.state_dim(),
                    int8.n_actions()
                ),
            ));
        }
        Ok(Self {
            int8,
            fallback,
            margin,
            calls: 0,
            checked: 0,
            last_checked: false,
            batch_scores: Vec::new(),
            checked_rows: Vec::new(),
            checked_obs: Vec::new(),
            checked_actions: Vec::new(),
        })
    }

    /// The margin in use.
    pub fn margin(&self) -> f32 {
        self.margin
    }

    /// Share of the decisions so far that the fallback made (0 before any).
    pub fn checked_share(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.checked as f64 / self.calls as f64
        }
    }

    /// The INT8 policy (its ISA).
    pub fn int8(&self) -> &Int8Policy {
        &self.int8
    }

    /// Guarded decisions for `actions.len()` rows of `obs` (row-major, `rows × state_dim`):
    /// the INT8 policy's batch ([`Int8Policy::act_batch_scores`], every row's scores exactly
    /// its single decision's), then one fallback batch ([`Decide::act_batch`]) of the rows
    /// whose two best INT8 scores are within the margin, so each action is the one
    /// [`Decide::act`] gives for that row. The buffers grow to the largest batch seen and
    /// are reused.
    pub fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        let (d, na) = (self.int8.state_dim(), self.int8.n_actions());
        self.batch_scores.resize(actions.len() * na, 0.0);
        self.last_checked = false;
        self.int8.act_batch_scores(obs, actions, Some(&mut self.batch_scores))?;
        self.checked_rows.clear();
        self.checked_obs.clear();
        for r in 0..actions.len() {
            if top_gap(&self.batch_scores[r * na..(r + 1) * na]) <= self.margin {
                self.checked_rows.push(r);
                self.checked_obs.extend_from_slice(&obs[r * d..(r + 1) * d]);
            }
        }
        let checked = self.checked_rows.len();
        self.checked_actions.resize(checked, 0);
        if checked > 0 {
            self.fallback.act_batch(&self.checked_obs, &mut self.checked_actions)?;
        }
        for (&r, &a) in self.checked_rows.iter().zip(&self.checked_actions) {
            actions[r] = a;
        }
        (self.calls, self.checked) = (self.calls + actions.len() as u64, self.checked + checked as u64);
        Ok(())
    }
}

impl<F: Decide> Decide for GuardedPolicy<F> {
    fn state_dim(&self) -> usize {
        self.int8.state_dim()
    }
    fn n_actions(&self) -> usize {
        self.int8.n_actions()
    }
    fn act(&mut self, obs: &[f32]) -> Result<usize> {
        // After a failed call `scores` is the INT8 policy's, never the fallback's older ones.
        self.last_checked = false;
        let a = self.int8.act(obs)?;
        if top_gap(self.int8.scores()) > self.margin {
            self.calls += 1;
            return Ok(a);
        }
        let a = self.fallback.act(obs)?;
        (self.calls, self.checked, self.last_checked) = (self.calls + 1, self.checked + 1, true);
        Ok(a)
    }
    /// The deciding policy's scores: INT8, or the fallback's on a checked decision.
    fn scores(&self) -> &[f32] {
        if self.last_checked {
            self.fallback.scores()
        } else {
            self.int8.scores()
        }
    }
    fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        GuardedPolicy::act_batch(self, obs, actions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float_net::PolicyKind;
    use crate::policy::first_argmax;
    use crate::reference::agreement;
    use crate::testing::{random_net, uniforms};
    use crate::CalibMethod;

    /// The F32 network in f64 as a `Decide` (the tests' fallback).
    struct Exact {
        net: FloatNet,
        scores: Vec<f32>,
    }

    impl Decide for Exact {
        fn state_dim(&self) -> usize {
            self.net.state_dim()
        }
        fn n_actions(&self) -> usize {
            self.net.n_actions()
        }
        fn act(&mut self, obs: &[f32]) -> Result<usize> {
            self.scores = self.net.forward_f64(obs, |_, _| {}).iter().map(|&v| v as f32).collect();
            Ok(first_argmax(&self.scores))
        }
        fn scores(&self) -> &[f32] {
            &self.scores
        }
    }

    #[test]
    fn top_gap_is_best_minus_second() {
        assert_eq!(top_gap(&[0.1, 0.5, 0.3]), 0.5 - 0.3);
        assert_eq!(top_gap(&[0.5, 0.5, 0.3]), 0.0);
        assert_eq!(top_gap(&[0.2, -1.0]), 1.2);
    }

    /// On random networks with coarse (min-max, clipping) scales: the margin covers the
    /// calibration rows; guarded decisions agree with F32 at least as often as plain INT8
    /// ones, on every row whose gap is above the margin they are the INT8 action, and a
    /// margin of 0 never asks the fallback while an infinite one always does.
    #[test]
    fn guarded_decisions_follow_f32_on_near_ties() {
        for (kind, hidden) in [(PolicyKind::Dqn, vec![64, 64, 32]), (PolicyKind::Ppo, vec![64, 64])] {
            let mut net = random_net(kind, 12, &hidden, 3, 11);
            // A trained policy's near-ties: the action rows of the last layer close together,
            // so the score gaps are small against the INT8 errors.
            let last = net.layers.last_mut().unwrap();
            let (inp, f) = (last.inp, if kind.dueling() { 0.004 } else { 0.03 });
            for j in 1..last.out {
                for k in 0..inp {
                    let base = last.weight[k];
                    last.weight[j * inp + k] = base + f * (last.weight[j * inp + k] - base);
                }
                last.bias[j] = last.bias[0] + f * (last.bias[j] - last.bias[0]);
            }
            let calib: Vec<f32> = uniforms(1, 2, 512 * 12).iter().map(|v| v * 2.0).collect();
            let obs: Vec<f32> = uniforms(3, 4, 600 * 12).iter().map(|v| v * 2.0).collect();
            let q = crate::quantize(&net, &calib, CalibMethod::MinMax, &[]).unwrap();
            let m = decision_margin(&net, &q, &calib).unwrap();
            assert!(m > 0.0 && m.is_finite(), "{kind:?}: {m}");
            let plain = agreement(&net, &q, &obs).unwrap();
            let exact = || Exact { net: net.clone(), scores: Vec::new() };
            let mut g = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), exact(), m).unwrap();
            let mut int8 = Int8Policy::new(&q).unwrap();
            let mut same = 0;
            for row in obs.chunks_exact(12) {
                let a = g.act(row).unwrap();
                let want = first_argmax(&net.forward_f64(row, |_, _| {}).iter().map(|&v| v as f32).collect::<Vec<_>>());
                same += usize::from(a == want);
                let a8 = int8.act(row).unwrap();
                if top_gap(int8.scores()) > m {
                    assert_eq!(a, a8, "{kind:?}");
                    assert_eq!(g.scores(), int8.scores());
                } else {
                    assert_eq!(a, want, "{kind:?}: a checked decision is the fallback's");
                }
            }
            assert!(same >= plain.same_action, "{kind:?}: guarded {same} vs plain {plain:?}");
            // A batch gives every row the single decision's action, and counts the same.
            let mut batch = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), exact(), m).unwrap();
            let mut acts = vec![usize::MAX; obs.len() / 12];
            batch.act_batch(&obs, &mut acts).unwrap();
            let mut one = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), exact(), m).unwrap();
            for (r, row) in obs.chunks_exact(12).enumerate() {
                assert_eq!(acts[r], one.act(row).unwrap(), "{kind:?} row {r}");
            }
            assert_eq!(batch.checked_share(), one.checked_share());
            assert!(batch.act_batch(&obs[..13], &mut acts[..1]).is_err());
            assert!(g.checked_share() > 0.0 && g.checked_share() < 1.0, "{kind:?}: {}", g.checked_share());
            let mut never = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), exact(), 0.0).unwrap();
            let mut always = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), exact(), f32::MAX).unwrap();
            for row in obs.chunks_exact(12).take(50) {
                never.act(row).unwrap();
                always.act(row).unwrap();
            }
            assert_eq!((never.checked_share(), always.checked_share()), (0.0, 1.0));
        }
    }

    #[test]
    fn bad_margins_and_mismatched_fallbacks_are_errors() {
        let net = random_net(PolicyKind::Ppo, 5, &[8, 8], 3, 1);
        let q = crate::quantize(&net, &uniforms(1, 1, 50), CalibMethod::Dynamic, &[]).unwrap();
        let e = GuardedPolicy::new(&q, Exact { net: net.clone(), scores: vec![] }).err().unwrap().to_string();
        assert!(e.contains("quantize again") && !e.contains('\n'), "{e}");
        for m in [f32::NAN, -1.0, f32::INFINITY] {
            let r =
                GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), Exact { net: net.clone(), scores: vec![] }, m);
            assert!(r.is_err(), "{m}");
        }
        let other = random_net(PolicyKind::Ppo, 6, &[8, 8], 3, 1);
        let r = GuardedPolicy::with_margin(Int8Policy::new(&q).unwrap(), Exact { net: other, scores: vec![] }, 0.1);
        assert!(r.err().unwrap().to_string().contains("6→3"));
    }
}
