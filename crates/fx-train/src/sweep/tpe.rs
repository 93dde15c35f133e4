//! The tree-structured Parzen estimator (Bergstra et al. 2011, "Algorithms for
//! Hyper-Parameter Optimization"), univariate, as Optuna's default `TPESampler` builds it:
//! the finished trials are split into a good quarter (at most 25) and the rest; each
//! dimension gets two densities on the unit interval the sampler's points live in (`u`, mapped
//! to values by [`Dim::at`]), `l` from the good trials and `g` from the rest, each a
//! mixture of truncated normals (one per trial, bandwidth from its neighbours' distance, as
//! Optuna's "magic clip") plus a wide prior component; choice dimensions get smoothed
//! category frequencies instead. A suggestion is the best of 24 candidates drawn from `l` by
//! `Σ log l − log g`. Everything is drawn from the sweep's seed, so a sweep (and its resume)
//! suggests the same points from the same finished trials.
//!
//! Suggestions of one round come from the same history, each from its own candidates (no
//! "constant liar"): a round is a population's worth of trials trained together. A share of
//! each round (`explore`, default 0.2) is drawn uniformly instead, as SMAC interleaves random
//! configurations: a univariate TPE that fills its good set with one choice early stops
//! proposing the others for good, which on the tests' known optimum happened on 4 of 30 seeds
//! without it.

use serde::{Deserialize, Serialize};

use super::space::Dim;

/// The sweep file's `[tpe]` section (`sampler = "tpe"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TpeConfig {
    /// Trials drawn from the Sobol sequence before the estimator has anything to go on.
    pub startup: usize,
    /// Trials proposed per round (trained together, in as many waves as the device needs);
    /// none: `startup`.
    pub batch: Option<usize>,
    /// Share of each round's trials drawn uniformly instead of from the estimator (rounded to
    /// the nearest trial), in [0, 1].
    pub explore: f64,
}

impl Default for TpeConfig {
    fn default() -> Self {
        Self { startup: 16, batch: None, explore: 0.2 }
    }
}

impl TpeConfig {
    /// The trial index ranges of the rounds of a sweep of `total` trials: the startup round,
    /// then `batch` trials each (the last may be shorter).
    pub fn rounds(&self, total: usize) -> Vec<std::ops::Range<usize>> {
        let startup = self.startup.clamp(1, total.max(1)).min(total);
        let batch = self.batch.unwrap_or(self.startup).max(1);
        let mut out = Vec::with_capacity(1 + (total - startup).div_ceil(batch));
        out.push(0..startup);
        let mut s = startup;
        while s < total {
            let e = (s + batch).min(total);
            out.push(s..e);
            s = e;
        }
        out
    }
}

/// Counter-based stream of the TPE's draws (apart from the random sampler's).
const TPE_STREAM: u64 = 0x79E5;
/// Candidates drawn from `l` per suggestion (Optuna's `n_ei_candidates`).
const CANDIDATES: usize = 24;
/// The good set: this fraction of the finished trials, rounded up, at most `MAX_GOOD`.
const GOOD_FRACTION: f64 = 0.25;
const MAX_GOOD: usize = 25;

/// A finished trial: its point in the unit cube (one `u` per dimension) and its objective
/// (higher is better; a non-finite one counts as worse than every finite one).
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub u: Vec<f64>,
    pub objective: f64,
}

/// Deterministic draws in [0, 1): `fx_kernels::rng::draw` at a key and a running counter.
struct Draws {
    seed: u64,
    key: u64,
    counter: u64,
}

impl Draws {
    fn next(&mut self) -> f64 {
        self.counter += 1;
        fx_kernels::rng::draw(self.seed, TPE_STREAM, self.key, self.counter)
    }

    /// A standard normal draw (Box–Muller on two draws).
    fn normal(&mut self) -> f64 {
        let u1 = self.next().max(1e-300);
        let u2 = self.next();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Φ, the standard normal CDF, from erfc (W. J. Cody's rational approximation via
/// Numerical Recipes' erfcc: relative error below 1.2e-7 everywhere, ample for density
/// ratios).
fn norm_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// A mixture of normals truncated to [0, 1], equal weights.
#[derive(Debug, Clone)]
struct Parzen {
    mu: Vec<f64>,
    sigma: Vec<f64>,
    /// Each component's mass inside [0, 1].
    mass: Vec<f64>,
}

impl Parzen {
    /// One component per observation plus the prior (centre 0.5, σ 1); each observation's σ
    /// is the larger distance to its sorted neighbours (the interval's ends count as
    /// neighbours), clipped to [1 / min(100, n + 1), 1].
    fn new(obs: &[f64]) -> Self {
        let mut mu: Vec<f64> = obs.iter().map(|u| u.clamp(0.0, 1.0)).collect();
        mu.sort_by(f64::total_cmp);
        let n = mu.len();
        let lo = 1.0 / (n + 1).min(100) as f64;
        let mut sigma = Vec::with_capacity(n + 1);
        for i in 0..n {
            let left = if i == 0 { mu[0] } else { mu[i] - mu[i - 1] };
            let right = if i + 1 == n { 1.0 - mu[i] } else { mu[i + 1] - mu[i] };
            sigma.push(left.max(right).clamp(lo, 1.0));
        }
        mu.push(0.5);
        sigma.push(1.0);
        let mass = mu.iter().zip(&sigma).map(|(&m, &s)| norm_cdf((1.0 - m) / s) - norm_cdf(-m / s)).collect();
        Self { mu, sigma, mass }
    }

    fn log_pdf(&self, x: f64) -> f64 {
        let k = self.mu.len() as f64;
        let p: f64 = (0..self.mu.len())
            .map(|i| {
                let z = (x - self.mu[i]) / self.sigma[i];
                (-0.5 * z * z).exp() / (self.sigma[i] * (2.0 * std::f64::consts::PI).sqrt() * self.mass[i])
            })
            .sum::<f64>()
            / k;
        p.max(1e-300).ln()
    }

    /// A draw: a component chosen uniformly, then its normal until it lands in [0, 1)
    /// (a component keeps at least ~1/3 of its mass inside, so this ends fast; after 64 misses
    /// the last draw is clamped).
    fn sample(&self, d: &mut Draws) -> f64 {
        let i = ((d.next() * self.mu.len() as f64) as usize).min(self.mu.len() - 1);
        let mut x = 0.5;
        for _ in 0..64 {
            x = self.mu[i] + self.sigma[i] * d.normal();
            if (0.0..1.0).contains(&x) {
                return x;
            }
        }
        x.clamp(0.0, 1.0 - f64::EPSILON)
    }
}

/// Smoothed category frequencies of a choice dimension: (count + 1/k) / (n + 1).
fn categorical(obs: &[f64], k: usize) -> Vec<f64> {
    let mut w = vec![1.0 / k as f64; k];
    for &u in obs {
        w[((u.clamp(0.0, 1.0) * k as f64) as usize).min(k - 1)] += 1.0;
    }
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// One dimension's `l` and `g`.
enum Model {
    Continuous { l: Parzen, g: Parzen },
    Choice { l: Vec<f64>, g: Vec<f64> },
}

impl Model {
    fn sample(&self, d: &mut Draws) -> f64 {
        match self {
            Model::Continuous { l, .. } => l.sample(d),
            Model::Choice { l, .. } => {
                let r = d.next();
                let mut acc = 0.0;
                let k = l.len();
                for (c, p) in l.iter().enumerate() {
                    acc += p;
                    if r < acc {
                        return (c as f64 + 0.5) / k as f64;
                    }
                }
                (k as f64 - 0.5) / k as f64
            }
        }
    }

    fn score(&self, u: f64) -> f64 {
        match self {
            Model::Continuous { l, g } => l.log_pdf(u) - g.log_pdf(u),
            Model::Choice { l, g } => {
                let c = ((u * l.len() as f64) as usize).min(l.len() - 1);
                l[c].ln() - g[c].ln()
            }
        }
    }
}

/// `n` suggestions (unit-cube points, one `u` per dimension of `space`) from the finished
/// trials `history`, drawn at key `round` from `seed` (distinct rounds draw independently):
/// the last `round(explore × n)` uniformly, the others from the estimator. With no history
/// every suggestion is the prior's (uniform for choices).
pub fn suggest(space: &[Dim], history: &[Observed], n: usize, explore: f64, seed: u64, round: u64) -> Vec<Vec<f64>> {
    let mut order: Vec<usize> = (0..history.len()).collect();
    // Best first; non-finite objectives last (in trial order among themselves).
    order.sort_by(|&a, &b| {
        let (x, y) = (history[a].objective, history[b].objective);
        match (x.is_finite(), y.is_finite()) {
            (true, true) => y.total_cmp(&x),
            (true, false) => std::cmp::Ordering::Less,
            (false, true) => std::cmp::Ordering::Greater,
            (false, false) => a.cmp(&b),
        }
    });
    let n_good = ((GOOD_FRACTION * history.len() as f64).ceil() as usize).min(MAX_GOOD);
    let (good, bad) = order.split_at(n_good);
    let models: Vec<Model> = space
        .iter()
        .enumerate()
        .map(|(j, dim)| {
            let col = |set: &[usize]| set.iter().map(|&t| history[t].u[j]).collect::<Vec<f64>>();
            match dim {
                Dim::Choice(v) => {
                    Model::Choice { l: categorical(&col(good), v.len()), g: categorical(&col(bad), v.len()) }
                }
                _ => Model::Continuous { l: Parzen::new(&col(good)), g: Parzen::new(&col(bad)) },
            }
        })
        .collect();
    let mut d = Draws { seed, key: round, counter: 0 };
    let uniform = ((explore.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
    (0..n)
        .map(|i| {
            if i >= n - uniform {
                return space.iter().map(|_| d.next()).collect();
            }
            let mut best: Option<(f64, Vec<f64>)> = None;
            for _ in 0..CANDIDATES {
                let u: Vec<f64> = models.iter().map(|m| m.sample(&mut d)).collect();
                let s: f64 = models.iter().zip(&u).map(|(m, &x)| m.score(x)).sum();
                if best.as_ref().is_none_or(|(b, _)| s > *b) {
                    best = Some((s, u));
                }
            }
            best.map(|(_, u)| u).unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn space() -> Vec<Dim> {
        vec![
            Dim::Uniform([0.0, 1.0]),
            Dim::Uniform([0.0, 1.0]),
            Dim::Choice(vec![toml::Value::Integer(0), toml::Value::Integer(1), toml::Value::Integer(2)]),
        ]
    }

    /// Maximum 0.3 at x = 0.3, y = 0.8, choice 1.
    fn objective(u: &[f64]) -> f64 {
        let c = ((u[2] * 3.0) as usize).min(2);
        let bonus = if c == 1 { 0.3 } else { 0.0 };
        bonus - (u[0] - 0.3).powi(2) - (u[1] - 0.8).powi(2)
    }

    /// 8 random trials, then rounds of 4 TPE suggestions, 64 trials in all; the best value.
    fn tpe_best(seed: u64) -> (f64, Vec<f64>) {
        let mut hist: Vec<Observed> = (0..8)
            .map(|t| {
                let u: Vec<f64> = (0..3).map(|j| fx_kernels::rng::draw(seed, 7, t, j)).collect();
                Observed { objective: objective(&u), u }
            })
            .collect();
        for round in 0..14 {
            for u in suggest(&space(), &hist, 4, 0.25, seed, round) {
                hist.push(Observed { objective: objective(&u), u });
            }
        }
        assert_eq!(hist.len(), 64);
        let b = hist.iter().max_by(|a, b| a.objective.total_cmp(&b.objective)).unwrap();
        (b.objective, b.u.clone())
    }

    fn random_best(seed: u64) -> f64 {
        (0..64)
            .map(|t| objective(&(0..3).map(|j| fx_kernels::rng::draw(seed, 7, t, j)).collect::<Vec<_>>()))
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// On a known optimum, TPE (a quarter of each round uniform) finds the right choice on
    /// every seed, ends within a regret of 0.05 of the optimum, and beats random search of the
    /// same budget on most seeds with a mean regret under half of random search's. Fixed
    /// seeds: the draws are deterministic, so this cannot flake.
    #[test]
    fn tpe_finds_a_known_optimum_and_beats_random_search() {
        let (mut wins, mut tpe_regret, mut rnd_regret) = (0, 0.0, 0.0);
        for seed in 1..=20u64 {
            let (best, u) = tpe_best(seed);
            let rnd = random_best(seed);
            assert_eq!(((u[2] * 3.0) as usize).min(2), 1, "seed {seed}: best choice at {u:?}");
            assert!(0.3 - best < 0.05, "seed {seed}: best {best} at {u:?}");
            wins += usize::from(best > rnd);
            tpe_regret += 0.3 - best;
            rnd_regret += 0.3 - rnd;
        }
        assert!(wins >= 15, "TPE beat random search on {wins} of 20 seeds");
        assert!(tpe_regret < 0.5 * rnd_regret, "mean regret: TPE {tpe_regret:.2e}, random {rnd_regret:.2e}");
    }

    #[test]
    fn suggestions_are_deterministic_and_rounds_differ() {
        let hist: Vec<Observed> =
            (0..10).map(|t| Observed { u: vec![t as f64 / 10.0, 0.5, 0.2], objective: t as f64 }).collect();
        let a = suggest(&space(), &hist, 3, 0.0, 9, 1);
        assert_eq!(a, suggest(&space(), &hist, 3, 0.0, 9, 1));
        assert_ne!(a, suggest(&space(), &hist, 3, 0.0, 9, 2));
        assert_ne!(a[0], a[1], "each suggestion draws its own candidates");
    }

    #[test]
    fn rounds_cover_every_trial_once() {
        let c = TpeConfig { startup: 4, batch: Some(3), ..TpeConfig::default() };
        assert_eq!(c.rounds(11), vec![0..4, 4..7, 7..10, 10..11]);
        assert_eq!(c.rounds(3), vec![0..3]);
        assert_eq!(TpeConfig::default().rounds(40), vec![0..16, 16..32, 32..40]);
    }

    #[test]
    fn normal_cdf_matches_known_values() {
        for (x, want) in [(0.0, 0.5), (1.0, 0.841_344_746), (-1.96, 0.024_997_895), (3.0, 0.998_650_102)] {
            assert!((norm_cdf(x) - want).abs() < 2e-7, "Φ({x}) = {} vs {want}", norm_cdf(x));
        }
    }

    proptest! {
        #[test]
        fn suggestions_lie_in_the_unit_cube(
            objs in proptest::collection::vec(prop_oneof![any::<f64>(), Just(f64::NAN), -1e3f64..1e3], 0..30),
            seed in any::<u64>(),
        ) {
            let hist: Vec<Observed> = objs
                .iter()
                .enumerate()
                .map(|(t, &o)| Observed { u: (0..3).map(|j| fx_kernels::rng::draw(seed, 3, t as u64, j)).collect(), objective: o })
                .collect();
            for u in suggest(&space(), &hist, 3, 0.5, seed, 0) {
                prop_assert_eq!(u.len(), 3);
                prop_assert!(u.iter().all(|x| (0.0..1.0).contains(x)), "{:?}", u);
            }
        }
    }
}
