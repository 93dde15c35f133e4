//! Population-based training (Jaderberg et al., 2017) inside a DQN or PPO sweep population:
//! every `every` env steps (a PPO population: at the first iteration boundary after each
//! multiple) each member's greedy policy is scored on the validation split; each member in
//! the bottom `quantile` of that ranking continues from a member drawn from the top
//! `quantile` (exploit: weights (a DQN's online and target), Adam moments and step count
//! copied on the device, [`fx_models::DqnPopulation::exploit`],
//! [`fx_models::PpoPopulation::exploit`]) with the source's hyperparameters perturbed
//! (explore: a range key multiplied by one of `factors` and kept in its bounds, a choice moved
//! to a neighbour), written in place (`set_member`), so a captured update goes on serving. Every decision is a counter-based draw of the sweep's seed: one
//! sweep file and one wave gives one schedule.

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::space::{Dim, Point};

/// Counter-based stream of PBT's draws (apart from the sampler's, the env's and the init's);
/// key `d`'s explore draws use stream `PBT_STREAM + 1 + d`.
const PBT_STREAM: u64 = 0xB7_0000;

/// The run-config keys PBT perturbs in a DQN population: the settings members may differ in
/// without a new shape (γ, τ, learning rate, weight decay, clip norm). Other keys of the
/// space stay each trial's own.
pub const PERTURBABLE: [&str; 5] =
    ["dqn.gamma", "dqn.tau", "dqn.optimizer.lr", "dqn.optimizer.weight_decay", "dqn.max_grad_norm"];

/// The keys PBT perturbs in a PPO population (learning rate, clip norm, clip range, loss
/// weights, GAE γ and λ).
pub const PERTURBABLE_PPO: [&str; 7] = [
    "ppo.optimizer.lr",
    "ppo.max_grad_norm",
    "ppo.loss.clip",
    "ppo.loss.vf_coef",
    "ppo.loss.ent_coef",
    "ppo.gae.gamma",
    "ppo.gae.lambda",
];

/// The sweep file's `[pbt]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PbtConfig {
    /// Env steps between two rounds of exploit and explore.
    pub every: u64,
    /// The fraction of the members that copies (the bottom) and is copied from (the top):
    /// in (0, 0.5]; at least one member each where there are two or more.
    #[serde(default = "quarter")]
    pub quantile: f64,
    /// Explore's factors for range keys, one drawn per key and round.
    #[serde(default = "factors")]
    pub factors: Vec<f64>,
}

fn quarter() -> f64 {
    0.25
}

fn factors() -> Vec<f64> {
    vec![0.8, 1.25]
}

impl PbtConfig {
    /// Checks the section against the space of a sweep whose members perturb `perturbable`
    /// ([`PERTURBABLE`], [`PERTURBABLE_PPO`]) and returns the indices of the space's
    /// dimensions PBT perturbs (at least one).
    pub fn check(&self, space: &[(String, Dim)], perturbable: &[&str]) -> Result<Vec<usize>> {
        if self.every == 0 {
            bail!("sweep file: pbt.every must be at least 1 env step");
        }
        if !(self.quantile > 0.0 && self.quantile <= 0.5) {
            bail!("sweep file: pbt.quantile must be in (0, 0.5], got {}", self.quantile);
        }
        if self.factors.is_empty() || self.factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
            bail!("sweep file: pbt.factors must be one or more finite numbers > 0, got {:?}", self.factors);
        }
        let keys: Vec<usize> =
            space.iter().enumerate().filter(|(_, (k, _))| perturbable.contains(&k.as_str())).map(|(i, _)| i).collect();
        if keys.is_empty() {
            bail!("sweep file: pbt perturbs {} and the [space] has none of them", perturbable.join(", "));
        }
        Ok(keys)
    }
}

/// One exploit of a round: member `dst` continues from member `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exploit {
    pub dst: usize,
    pub src: usize,
}

/// The exploits of round `round` given the members' scores (higher is better; NaN ranks
/// last, ties go to the lower index): each of the bottom `m = max(1, ⌊n·quantile⌋)` members
/// copies one of the top `m`, drawn uniformly. None with fewer than two members.
pub fn exploits(scores: &[f64], quantile: f64, seed: u64, round: u64) -> Vec<Exploit> {
    let n = scores.len();
    if n < 2 {
        return Vec::new();
    }
    let m = ((n as f64 * quantile).floor() as usize).clamp(1, n / 2);
    let key = |k: usize| if scores[k].is_nan() { f64::NEG_INFINITY } else { scores[k] };
    let mut rank: Vec<usize> = (0..n).collect();
    rank.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    rank[n - m..]
        .iter()
        .map(|&dst| {
            let u = fx_kernels::rng::draw(seed, PBT_STREAM, round, dst as u64);
            Exploit { dst, src: rank[((u * m as f64) as usize).min(m - 1)] }
        })
        .collect()
}

/// Member `dst`'s point after copying `src` in round `round`: `dst`'s own point with each
/// perturbed key (`keys`, indices into `space`) set to `src`'s value perturbed.
#[allow(clippy::too_many_arguments)]
pub fn explore(
    dst: &Point,
    src: &Point,
    space: &[(String, Dim)],
    keys: &[usize],
    factors: &[f64],
    seed: u64,
    round: u64,
    member: usize,
) -> Point {
    let mut out = dst.clone();
    for &d in keys {
        let u = fx_kernels::rng::draw(seed, PBT_STREAM + 1 + d as u64, round, member as u64);
        out[d].1 = perturb(&src[d].1, &space[d].1, factors, u);
    }
    out
}

/// `v` perturbed within `dim` by the draw `u` in [0, 1): a range value times the factor `u`
/// picks, kept in the range; a choice moved one place down (`u` < 0.5) or up, kept in the
/// list (a value not in the list stays as it is).
fn perturb(v: &toml::Value, dim: &Dim, factors: &[f64], u: f64) -> toml::Value {
    let f = factors[((u * factors.len() as f64) as usize).min(factors.len() - 1)];
    let x = v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
    match (dim, x) {
        (Dim::Uniform([lo, hi]) | Dim::LogUniform([lo, hi]), Some(x)) => toml::Value::Float((x * f).clamp(*lo, *hi)),
        (Dim::Int([lo, hi]), Some(x)) => toml::Value::Integer(((x * f).round() as i64).clamp(*lo, *hi)),
        (Dim::Choice(list), _) => match list.iter().position(|c| c == v) {
            Some(i) if u < 0.5 => list[i.saturating_sub(1)].clone(),
            Some(i) => list[(i + 1).min(list.len() - 1)].clone(),
            None => v.clone(),
        },
        _ => v.clone(),
    }
}

/// One exploit and explore of a trial, for its row of `trials.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PbtEvent {
    pub round: u64,
    pub env_step: u64,
    /// The trial whose state this trial continued from.
    pub copied_from: usize,
    /// This trial's validation Sharpe at the round (why it copied).
    #[serde(with = "super::nan_as_null")]
    pub val_sharpe: f64,
    /// The perturbed keys' new values.
    pub params: BTreeMap<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Vec<(String, Dim)> {
        vec![
            (
                "dqn.gamma".into(),
                Dim::Choice(vec![toml::Value::Float(0.9), toml::Value::Float(0.95), toml::Value::Float(0.99)]),
            ),
            ("dqn.optimizer.lr".into(), Dim::LogUniform([1e-4, 1e-2])),
            ("seed".into(), Dim::Int([0, 99])),
        ]
    }

    #[test]
    fn the_bottom_quantile_copies_the_top_one() {
        // Ranking: 3 (2.0), 0 (1.0), 1 (0.5), 4 (0.5), 5 (-1), 2 (NaN): ties to the lower index.
        let scores = [1.0, 0.5, f64::NAN, 2.0, 0.5, -1.0];
        for round in 0..20 {
            let e = exploits(&scores, 0.34, 7, round);
            // m = ⌊6 · 0.34⌋ = 2: the bottom two (5 and 2) copy one of the top two (3, 0).
            assert_eq!(e.iter().map(|x| x.dst).collect::<Vec<_>>(), [5, 2]);
            assert!(e.iter().all(|x| x.src == 3 || x.src == 0), "{e:?}");
            assert_eq!(e, exploits(&scores, 0.34, 7, round), "deterministic");
        }
        // Over rounds both sources are drawn.
        let srcs: std::collections::BTreeSet<usize> =
            (0..40).flat_map(|r| exploits(&scores, 0.34, 7, r)).map(|x| x.src).collect();
        assert_eq!(srcs.into_iter().collect::<Vec<_>>(), [0, 3]);
        // A small quantile still moves one member; one member alone has nobody to copy.
        assert_eq!(exploits(&[0.0, 1.0, 2.0], 0.01, 1, 0), [Exploit { dst: 0, src: 2 }]);
        assert!(exploits(&[1.0], 0.5, 1, 0).is_empty());
        assert_eq!(exploits(&[0.0, 1.0], 0.5, 1, 0), [Exploit { dst: 0, src: 1 }]);
    }

    #[test]
    fn explore_perturbs_the_source_keys_within_bounds_and_keeps_the_rest() {
        let space = dims();
        let src: Point = vec![
            ("dqn.gamma".into(), toml::Value::Float(0.99)),
            ("dqn.optimizer.lr".into(), toml::Value::Float(9e-3)),
            ("seed".into(), toml::Value::Integer(5)),
        ];
        let dst: Point = vec![
            ("dqn.gamma".into(), toml::Value::Float(0.9)),
            ("dqn.optimizer.lr".into(), toml::Value::Float(1e-4)),
            ("seed".into(), toml::Value::Integer(42)),
        ];
        let keys = PbtConfig { every: 1, quantile: 0.25, factors: factors() }.check(&space, &PERTURBABLE).unwrap();
        assert_eq!(keys, [0, 1], "the seed is not perturbed");
        let mut lrs = std::collections::BTreeSet::new();
        for round in 0..40 {
            let p = explore(&dst, &src, &space, &keys, &factors(), 3, round, 1);
            assert_eq!(p[2].1, toml::Value::Integer(42), "dst keeps its own seed");
            let g = p[0].1.as_float().unwrap();
            assert!(g == 0.95 || g == 0.99, "gamma moves down one choice or stays at the top: {g}");
            let lr = p[1].1.as_float().unwrap();
            assert!(lr == 9e-3 * 0.8 || lr == 1e-2, "lr is 9e-3 × 0.8, or × 1.25 clamped to 1e-2: {lr}");
            lrs.insert(lr.to_bits());
        }
        assert_eq!(lrs.len(), 2, "both factors are drawn");
        assert_eq!(perturb(&toml::Value::Integer(10), &Dim::Int([0, 11]), &[1.25], 0.0), toml::Value::Integer(11));
        assert_eq!(perturb(&toml::Value::Float(0.9), &space[0].1, &[1.0], 0.1), toml::Value::Float(0.9));
    }

    #[test]
    fn bad_sections_are_refused_with_the_key() {
        let space = dims();
        let ok = PbtConfig { every: 10, quantile: 0.25, factors: factors() };
        for (bad, word) in [
            (PbtConfig { every: 0, ..ok.clone() }, "every"),
            (PbtConfig { quantile: 0.6, ..ok.clone() }, "quantile"),
            (PbtConfig { quantile: f64::NAN, ..ok.clone() }, "quantile"),
            (PbtConfig { factors: vec![], ..ok.clone() }, "factors"),
            (PbtConfig { factors: vec![1.2, -1.0], ..ok.clone() }, "factors"),
        ] {
            let e = bad.check(&space, &PERTURBABLE).unwrap_err().to_string();
            assert!(e.contains(word) && !e.contains('\n'), "{e}");
        }
        let e = ok.check(&space[2..], &PERTURBABLE).unwrap_err().to_string();
        assert!(e.contains("dqn.optimizer.lr") && e.contains("[space]"), "{e}");
        let parsed: PbtConfig = toml::from_str("every = 50").unwrap();
        assert_eq!(parsed, PbtConfig { every: 50, ..ok });
        assert!(toml::from_str::<PbtConfig>("every = 5\nquantil = 0.2").is_err());
    }
}
