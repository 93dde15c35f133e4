//! A sweep's search space (TOML: a table of dotted run-config keys, each a choice list or a
//! uniform / log-uniform / integer range) and its samplers (grid, random, Sobol), all
//! deterministic from the sweep's seed.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// One dimension of the space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Dim {
    /// One of these values (any TOML value).
    Choice(Vec<toml::Value>),
    /// Uniform in `[lo, hi]`.
    Uniform([f64; 2]),
    /// Log-uniform in `[lo, hi]` (both > 0).
    LogUniform([f64; 2]),
    /// An integer in `[lo, hi]` (both included).
    Int([i64; 2]),
}

/// How trial points are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// Every combination of the choices and integers, in key order (ranges are refused).
    Grid,
    /// Independent counter-based draws per trial and key.
    #[default]
    Random,
    /// A Sobol sequence (Joe–Kuo direction numbers), its first point (all zeros) skipped.
    Sobol,
    /// The tree-structured Parzen estimator: Sobol points for the first `[tpe] startup`
    /// trials, then rounds of `[tpe] batch` trials proposed from every finished trial's
    /// validation Sharpe (`super::tpe`).
    Tpe,
}

/// Counter-based stream of the random sampler's draws (apart from the env's and the init's).
const SWEEP_STREAM: u64 = 0x5EE9;

impl Dim {
    /// Checks the bounds; `key` names the dimension in the error.
    pub fn validate(&self, key: &str) -> Result<()> {
        match self {
            Dim::Choice(v) if v.is_empty() => bail!("space.{key}: choice needs at least one value"),
            Dim::Uniform([lo, hi]) if !(lo.is_finite() && hi.is_finite() && lo <= hi) => {
                bail!("space.{key}: uniform needs finite lo <= hi, got [{lo}, {hi}]")
            }
            Dim::LogUniform([lo, hi]) if !(lo.is_finite() && hi.is_finite() && *lo > 0.0 && lo <= hi) => {
                bail!("space.{key}: log_uniform needs 0 < lo <= hi, got [{lo}, {hi}]")
            }
            Dim::Int([lo, hi]) if lo > hi => bail!("space.{key}: int needs lo <= hi, got [{lo}, {hi}]"),
            _ => Ok(()),
        }
    }

    /// The value at `u` in [0, 1).
    pub fn at(&self, u: f64) -> toml::Value {
        let u = u.clamp(0.0, 1.0 - f64::EPSILON);
        match self {
            Dim::Choice(v) => v[((u * v.len() as f64) as usize).min(v.len() - 1)].clone(),
            Dim::Uniform([lo, hi]) => toml::Value::Float(lo + u * (hi - lo)),
            Dim::LogUniform([lo, hi]) => toml::Value::Float((lo.ln() + u * (hi.ln() - lo.ln())).exp().clamp(*lo, *hi)),
            Dim::Int([lo, hi]) => {
                let n = (hi - lo + 1) as f64;
                toml::Value::Integer((lo + (u * n) as i64).min(*hi))
            }
        }
    }

    /// The values a grid walks through (None for continuous ranges).
    fn grid_values(&self) -> Option<Vec<toml::Value>> {
        match self {
            Dim::Choice(v) => Some(v.clone()),
            Dim::Int([lo, hi]) => Some((*lo..=*hi).map(toml::Value::Integer).collect()),
            _ => None,
        }
    }
}

/// A trial's point: `(dotted key, value)` per dimension, in the space's key order.
pub type Point = Vec<(String, toml::Value)>;

/// `trials` points of `space` (keys in order) drawn by `sampler` from `seed`. A grid yields
/// its combinations in order, the first `trials` of them (all when `trials` is None).
pub fn sample(space: &[(String, Dim)], sampler: Sampler, trials: Option<usize>, seed: u64) -> Result<Vec<Point>> {
    for (k, d) in space {
        d.validate(k)?;
    }
    match sampler {
        Sampler::Grid => {
            let mut axes = Vec::with_capacity(space.len());
            for (k, d) in space {
                let Some(v) = d.grid_values() else {
                    bail!("space.{k}: a grid needs choice or int dimensions (use random or sobol for ranges)")
                };
                axes.push(v);
            }
            let total: usize = axes.iter().map(Vec::len).product();
            if total > 1_000_000 {
                bail!("the grid has {total} points (over 1,000,000): narrow the space or use random or sobol");
            }
            let n = trials.map_or(total, |t| t.min(total));
            Ok((0..n)
                .map(|mut i| {
                    // The last key varies fastest.
                    let mut idx = vec![0; axes.len()];
                    for j in (0..axes.len()).rev() {
                        idx[j] = i % axes[j].len();
                        i /= axes[j].len();
                    }
                    space.iter().zip(&axes).zip(idx).map(|(((k, _), ax), i)| (k.clone(), ax[i].clone())).collect()
                })
                .collect())
        }
        Sampler::Random | Sampler::Sobol => {
            let Some(n) = trials else { bail!("random and sobol samplers need a trial count (trials = N)") };
            Ok(units(space, sampler, n, seed)?.iter().map(|u| point_at(space, u)).collect())
        }
        Sampler::Tpe => bail!("the tpe sampler proposes its points in rounds, from finished trials"),
    }
}

/// The unit-cube coordinates of `n` random or Sobol points (one `u` in [0, 1) per
/// dimension; [`point_at`] maps them to values). `Tpe` gives its startup points: Sobol's.
pub fn units(space: &[(String, Dim)], sampler: Sampler, n: usize, seed: u64) -> Result<Vec<Vec<f64>>> {
    let sobol = matches!(sampler, Sampler::Sobol | Sampler::Tpe);
    if sobol && space.len() > sobol::MAX_DIMS {
        bail!("sobol covers at most {} dimensions; the space has {}", sobol::MAX_DIMS, space.len());
    }
    Ok((0..n)
        .map(|t| {
            (0..space.len())
                .map(|j| match sobol {
                    true => sobol::point(t as u64 + 1 + seed, j),
                    false => fx_kernels::rng::draw(seed, SWEEP_STREAM, t as u64, j as u64),
                })
                .collect()
        })
        .collect())
}

/// The point at unit-cube coordinates `u` (one per dimension of `space`).
pub fn point_at(space: &[(String, Dim)], u: &[f64]) -> Point {
    space.iter().zip(u).map(|((k, d), &u)| (k.clone(), d.at(u))).collect()
}

/// The Sobol sequence in base 2 (Bratley–Fox / Joe–Kuo construction, gray-code free:
/// point `i` is the XOR of the direction numbers of `i`'s set bits).
pub mod sobol {
    /// Dimensions covered: the first (van der Corput) plus the Joe–Kuo table's rows.
    pub const MAX_DIMS: usize = 1 + JOE_KUO.len();
    const BITS: usize = 32;

    /// `(s, a, m_1..m_s)` for dimensions 2.. of S. Joe and F. Y. Kuo's `new-joe-kuo-6.21201`.
    const JOE_KUO: [(u32, u32, &[u32]); 9] = [
        (1, 0, &[1]),
        (2, 1, &[1, 3]),
        (3, 1, &[1, 3, 1]),
        (3, 2, &[1, 1, 1]),
        (4, 1, &[1, 1, 3, 3]),
        (4, 4, &[1, 3, 5, 13]),
        (5, 2, &[1, 1, 5, 5, 17]),
        (5, 4, &[1, 1, 5, 5, 5]),
        (5, 7, &[1, 1, 7, 11, 19]),
    ];

    /// Direction numbers `v_k · 2^32` (k = 1..32) of dimension `dim` (0-based).
    fn directions(dim: usize) -> [u32; BITS] {
        let mut v = [0u32; BITS];
        if dim == 0 {
            for (k, x) in v.iter_mut().enumerate() {
                *x = 1 << (BITS - 1 - k);
            }
            return v;
        }
        let (s, a, m) = JOE_KUO[dim - 1];
        let s = s as usize;
        for k in 0..s.min(BITS) {
            v[k] = m[k] << (BITS - 1 - k);
        }
        for k in s..BITS {
            let mut x = v[k - s] ^ (v[k - s] >> s);
            for j in 1..s {
                if (a >> (s - 1 - j)) & 1 == 1 {
                    x ^= v[k - j];
                }
            }
            v[k] = x;
        }
        v
    }

    /// Coordinate `dim` of point `i` of the sequence, in [0, 1).
    pub fn point(i: u64, dim: usize) -> f64 {
        let v = directions(dim);
        let mut x = 0u32;
        for (k, d) in v.iter().enumerate() {
            if (i >> k) & 1 == 1 {
                x ^= d;
            }
        }
        x as f64 / (1u64 << BITS) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn space() -> Vec<(String, Dim)> {
        vec![
            ("dqn.optimizer.lr".into(), Dim::LogUniform([1e-5, 1e-3])),
            ("dqn.gamma".into(), Dim::Uniform([0.9, 0.999])),
            ("dqn.tau".into(), Dim::Choice(vec![toml::Value::Float(0.005), toml::Value::Float(0.01)])),
            ("seed".into(), Dim::Int([0, 9])),
        ]
    }

    /// The sequence's first points are the textbook ones (dims 1 and 2: 1/2, then 3/4 and
    /// 1/4, then 1/4 and 3/4), and every dimension's first 2^m points put exactly one point
    /// in each interval [j/2^m, (j+1)/2^m).
    #[test]
    fn sobol_points_are_stratified() {
        assert_eq!((sobol::point(1, 0), sobol::point(1, 1)), (0.5, 0.5));
        assert_eq!((sobol::point(2, 0), sobol::point(2, 1)), (0.25, 0.75));
        assert_eq!((sobol::point(3, 0), sobol::point(3, 1)), (0.75, 0.25));
        for dim in 0..sobol::MAX_DIMS {
            for m in 1..=8u32 {
                let n = 1usize << m;
                let mut seen = vec![false; n];
                for i in 0..n as u64 {
                    let u = sobol::point(i, dim);
                    assert!((0.0..1.0).contains(&u));
                    let j = (u * n as f64) as usize;
                    assert!(!seen[j], "dim {dim}, 2^{m} points: interval {j} twice");
                    seen[j] = true;
                }
            }
        }
    }

    /// Two dimensions jointly: the first 2^(2m) points of dims (0, 1) fill every cell of the
    /// 2^m x 2^m grid once (their t-value is 0).
    #[test]
    fn sobol_first_two_dimensions_fill_the_grid() {
        for m in 1..=4u32 {
            let side = 1usize << m;
            let mut seen = vec![false; side * side];
            for i in 0..(side * side) as u64 {
                let (x, y) = ((sobol::point(i, 0) * side as f64) as usize, (sobol::point(i, 1) * side as f64) as usize);
                assert!(!seen[x * side + y], "m {m}: cell ({x}, {y}) twice");
                seen[x * side + y] = true;
            }
        }
    }

    #[test]
    fn grid_walks_every_combination_in_order() {
        let s = vec![
            ("a".to_string(), Dim::Choice(vec![toml::Value::Integer(1), toml::Value::Integer(2)])),
            ("b".to_string(), Dim::Int([5, 7])),
        ];
        let pts = sample(&s, Sampler::Grid, None, 0).unwrap();
        let flat: Vec<(i64, i64)> =
            pts.iter().map(|p| (p[0].1.as_integer().unwrap(), p[1].1.as_integer().unwrap())).collect();
        assert_eq!(flat, [(1, 5), (1, 6), (1, 7), (2, 5), (2, 6), (2, 7)]);
        assert_eq!(sample(&s, Sampler::Grid, Some(4), 0).unwrap().len(), 4);
        let e = sample(&space(), Sampler::Grid, None, 0).unwrap_err().to_string();
        assert!(e.contains("space.dqn.optimizer.lr"), "{e}");
    }

    #[test]
    fn bad_bounds_name_the_key() {
        for (d, want) in [
            (Dim::LogUniform([0.0, 1.0]), "log_uniform"),
            (Dim::Uniform([2.0, 1.0]), "uniform"),
            (Dim::Int([3, 1]), "int"),
            (Dim::Choice(vec![]), "choice"),
        ] {
            let e = sample(&[("x.y".into(), d)], Sampler::Random, Some(2), 0).unwrap_err().to_string();
            assert!(e.contains("space.x.y") && e.contains(want), "{e}");
        }
    }

    proptest! {
        /// Every sampled value lies in its dimension, the same seed gives the same points and
        /// (for random) another seed other points.
        #[test]
        fn samples_lie_in_the_space(seed in any::<u64>(), sobol in any::<bool>(), n in 1usize..40) {
            let sampler = if sobol { Sampler::Sobol } else { Sampler::Random };
            let seed = seed % 1_000_000;
            let a = sample(&space(), sampler, Some(n), seed).unwrap();
            prop_assert_eq!(&a, &sample(&space(), sampler, Some(n), seed).unwrap());
            for p in &a {
                let lr = p[0].1.as_float().unwrap();
                prop_assert!((1e-5..=1e-3).contains(&lr));
                let g = p[1].1.as_float().unwrap();
                prop_assert!((0.9..=0.999).contains(&g));
                let tau = p[2].1.as_float().unwrap();
                prop_assert!(tau == 0.005 || tau == 0.01);
                let s = p[3].1.as_integer().unwrap();
                prop_assert!((0..=9).contains(&s));
            }
            if !sobol && n > 3 {
                prop_assert_ne!(a, sample(&space(), sampler, Some(n), seed + 1).unwrap());
            }
        }
    }
}
