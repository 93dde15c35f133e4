//! How much luck is in a Sharpe ratio.
//!
//! - [`probabilistic_sharpe`]: the probability that the true Sharpe ratio exceeds a
//!   benchmark, given the sample's length, skewness and kurtosis (Bailey & López de
//!   Prado 2012, "The Sharpe ratio efficient frontier").
//! - [`deflated_sharpe`]: the same against the Sharpe ratio the best of `trials`
//!   unskilled trials would show ([`expected_max_sharpe`]; Bailey & López de Prado 2014,
//!   "The deflated Sharpe ratio"). `trials` is the number actually tried, a sweep's
//!   included: fewer understates the luck.
//! - [`bootstrap_mean_interval`]: a percentile-bootstrap interval of a mean over runs
//!   (seeds × folds).
//! - [`probability_of_overfitting`]: the probability of backtest overfitting by
//!   combinatorially symmetric cross-validation (Bailey, Borwein, López de Prado & Zhu
//!   2015): how often the in-sample best of a set of strategies ranks below the
//!   out-of-sample median.
//!
//! Sharpe ratios here are per period, not annualised: the formulas count periods.
//! Moments are the population ones (divided by n), as in [`super::evaluate_positions`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Euler–Mascheroni constant, in the expected maximum of normal draws.
const EULER_GAMMA: f64 = 0.577_215_664_901_532_9;

/// The moments of a return series that the Sharpe-ratio statistics use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReturnMoments {
    /// Number of returns.
    pub periods: usize,
    /// Mean over standard deviation, per period.
    pub sharpe: f64,
    /// Third standardised moment.
    pub skewness: f64,
    /// Fourth standardised moment (3 for a normal distribution; not the excess).
    pub kurtosis: f64,
}

/// `who` prefixes the message (e.g. "strategy 3: "), empty for a lone series.
fn finite_in(what: &'static str, who: &str, xs: &[f64]) -> Result<()> {
    match xs.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::config(what, format!("{who}value {i} is {} (every value must be finite)", xs[i]))),
        None => Ok(()),
    }
}

fn finite(what: &'static str, xs: &[f64]) -> Result<()> {
    finite_in(what, "", xs)
}

/// The Sharpe ratio, skewness and kurtosis of `returns` (at least 2, finite, not all
/// equal).
pub fn moments(returns: &[f64]) -> Result<ReturnMoments> {
    let what = "return moments";
    finite(what, returns)?;
    if returns.len() < 2 {
        return Err(Error::config(what, format!("{} returns are too few (at least 2)", returns.len())));
    }
    let n = returns.len() as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let central = |p: i32| returns.iter().map(|r| (r - mean).powi(p)).sum::<f64>() / n;
    let var = central(2);
    if var <= 0.0 {
        return Err(Error::config(what, "the returns do not vary: their Sharpe ratio is undefined"));
    }
    let sd = var.sqrt();
    Ok(ReturnMoments {
        periods: returns.len(),
        sharpe: mean / sd,
        skewness: central(3) / (var * sd),
        kurtosis: central(4) / (var * var),
    })
}

/// Standard normal cumulative distribution function.
pub fn normal_cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// Inverse of [`normal_cdf`] on (0, 1): Acklam's rational approximation, refined by one
/// Halley step against `erfc` (relative error near machine precision).
pub fn normal_quantile(p: f64) -> Result<f64> {
    if !(p > 0.0 && p < 1.0) {
        return Err(Error::config("normal quantile", format!("probability {p} must be in (0, 1)")));
    }
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    let low = 0.024_25;
    let x = if p < low {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - low {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    };
    // One Halley step: e = Φ(x) − p, u = e·√(2π)·exp(x²/2).
    let e = normal_cdf(x) - p;
    let u = e * (2.0 * std::f64::consts::PI).sqrt() * (x * x / 2.0).exp();
    Ok(x - u / (1.0 + x * u / 2.0))
}

/// Probability that the true per-period Sharpe ratio exceeds `benchmark`, given the
/// sample's moments: `Φ((SR − SR*)·√(n−1) / √(1 − γ₃·SR + (γ₄−1)/4·SR²))`.
pub fn probabilistic_sharpe(m: &ReturnMoments, benchmark: f64) -> Result<f64> {
    let what = "probabilistic Sharpe ratio";
    finite(what, &[m.sharpe, m.skewness, m.kurtosis, benchmark])?;
    if m.periods < 2 {
        return Err(Error::config(what, format!("{} periods are too few (at least 2)", m.periods)));
    }
    let sr = m.sharpe;
    let var = 1.0 - m.skewness * sr + (m.kurtosis - 1.0) / 4.0 * sr * sr;
    if var.is_nan() || var <= 0.0 {
        return Err(Error::config(
            what,
            format!("skewness {} and kurtosis {} give no positive variance", m.skewness, m.kurtosis),
        ));
    }
    Ok(normal_cdf((sr - benchmark) * ((m.periods - 1) as f64).sqrt() / var.sqrt()))
}

/// The per-period Sharpe ratio the best of `trials` independent unskilled trials is
/// expected to show, when the trials' Sharpe ratios vary with variance
/// `sharpe_variance` (per period, across trials):
/// `√V · ((1−γ)·Φ⁻¹(1 − 1/N) + γ·Φ⁻¹(1 − 1/(N·e)))`; 0 for one trial.
pub fn expected_max_sharpe(trials: usize, sharpe_variance: f64) -> Result<f64> {
    let what = "expected maximum Sharpe ratio";
    if trials == 0 {
        return Err(Error::config(what, "trials must be at least 1"));
    }
    if !(sharpe_variance.is_finite() && sharpe_variance >= 0.0) {
        return Err(Error::config(what, format!("variance {sharpe_variance} must be finite and >= 0")));
    }
    if trials == 1 {
        return Ok(0.0);
    }
    let n = trials as f64;
    let z1 = normal_quantile(1.0 - 1.0 / n)?;
    let z2 = normal_quantile(1.0 - 1.0 / (n * std::f64::consts::E))?;
    Ok(sharpe_variance.sqrt() * ((1.0 - EULER_GAMMA) * z1 + EULER_GAMMA * z2))
}

/// The deflated Sharpe ratio: [`probabilistic_sharpe`] against
/// [`expected_max_sharpe`]`(trials, sharpe_variance)`. Near 1: the Sharpe ratio is
/// unlikely to be the luck of picking the best of `trials`.
pub fn deflated_sharpe(m: &ReturnMoments, trials: usize, sharpe_variance: f64) -> Result<f64> {
    probabilistic_sharpe(m, expected_max_sharpe(trials, sharpe_variance)?)
}

/// A two-sided interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// Lower end.
    pub lo: f64,
    /// Upper end.
    pub hi: f64,
}

/// Percentile-bootstrap interval of the mean of `xs` at `level` (e.g. 0.95) from
/// `resamples` resamples drawn with `seed`: the same inputs give the same interval.
pub fn bootstrap_mean_interval(xs: &[f64], level: f64, resamples: usize, seed: u64) -> Result<Interval> {
    let what = "bootstrap interval";
    finite(what, xs)?;
    if xs.is_empty() || resamples == 0 {
        return Err(Error::config(what, "needs at least one value and one resample"));
    }
    if !(level > 0.0 && level < 1.0) {
        return Err(Error::config(what, format!("level {level} must be in (0, 1)")));
    }
    let mut rng = fx_data::rng::Rng::new(seed);
    let n = xs.len() as u64;
    let mut means: Vec<f64> =
        (0..resamples).map(|_| (0..n).map(|_| xs[rng.below(n) as usize]).sum::<f64>() / n as f64).collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| {
        // Linear interpolation between order statistics, as numpy's default percentile.
        let h = q * (resamples - 1) as f64;
        let (i, f) = (h.floor() as usize, h - h.floor());
        means[i] + f * (means[(i + 1).min(resamples - 1)] - means[i])
    };
    let tail = (1.0 - level) / 2.0;
    Ok(Interval { lo: at(tail), hi: at(1.0 - tail) })
}

/// Result of [`probability_of_overfitting`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Overfitting {
    /// Share of the splits whose in-sample best strategy ranks at or below the
    /// out-of-sample median (logit ≤ 0).
    pub pbo: f64,
    /// Splits evaluated: C(blocks, blocks/2).
    pub splits: usize,
    /// Blocks the periods were cut into.
    pub blocks: usize,
    /// Strategies compared.
    pub strategies: usize,
    /// Mean out-of-sample Sharpe ratio (per period) of the in-sample best.
    pub mean_oos_sharpe_of_best: f64,
    /// Share of the splits where the in-sample best loses money out of sample.
    pub prob_oos_loss: f64,
}

/// Per-block sums of one strategy: count, Σr, Σr².
#[derive(Clone, Copy, Default)]
struct Sums {
    n: f64,
    s: f64,
    s2: f64,
}

impl Sums {
    fn add(&mut self, o: Sums) {
        self.n += o.n;
        self.s += o.s;
        self.s2 += o.s2;
    }
    fn sharpe(&self) -> f64 {
        let mean = self.s / self.n;
        let var = (self.s2 / self.n - mean * mean).max(0.0);
        if var > 0.0 {
            mean / var.sqrt()
        } else {
            0.0
        }
    }
}

/// Probability of backtest overfitting by combinatorially symmetric cross-validation.
///
/// `returns[j]` is strategy j's per-period returns, all over the same periods. The
/// periods are cut into `blocks` contiguous blocks (even, at least 2; their lengths
/// differ by at most one); for every choice of half the blocks as the in-sample set
/// (the rest out of sample, in time order inside each), the strategy with the best
/// in-sample Sharpe ratio is ranked among all strategies out of sample, `ω` its relative
/// rank `rank/(N+1)` (ties share the mean rank), and the split counts as overfit when
/// `logit ω = ln(ω/(1−ω)) ≤ 0`. In-sample ties go to the first strategy.
pub fn probability_of_overfitting(returns: &[Vec<f64>], blocks: usize) -> Result<Overfitting> {
    let what = "probability of backtest overfitting";
    let n = returns.len();
    if n < 2 {
        return Err(Error::config(what, format!("{n} strategies: at least 2 are needed to overfit by choosing")));
    }
    let t = returns[0].len();
    if let Some(j) = returns.iter().position(|r| r.len() != t) {
        return Err(Error::config(what, format!("strategy {j} has {} returns, strategy 0 has {t}", returns[j].len())));
    }
    for (j, r) in returns.iter().enumerate() {
        finite_in(what, &format!("strategy {j}: "), r)?;
    }
    if blocks < 2 || !blocks.is_multiple_of(2) || blocks > 24 {
        return Err(Error::config(what, format!("blocks {blocks} must be even, in 2..=24")));
    }
    if t < 2 * blocks {
        return Err(Error::config(what, format!("{t} periods are too few for {blocks} blocks of 2 or more")));
    }
    // Block b covers [b·t/S, (b+1)·t/S).
    let sums: Vec<Vec<Sums>> = returns
        .iter()
        .map(|r| {
            (0..blocks)
                .map(|b| {
                    let block = &r[b * t / blocks..(b + 1) * t / blocks];
                    let s = block.iter().sum();
                    let s2 = block.iter().map(|x| x * x).sum();
                    Sums { n: block.len() as f64, s, s2 }
                })
                .collect()
        })
        .collect();
    let (mut overfit, mut splits, mut oos_best_sum, mut losses) = (0usize, 0usize, 0.0f64, 0usize);
    let (mut is, mut oos) = (vec![0.0; n], vec![0.0; n]);
    for mask in 0u32..(1u32 << blocks) {
        // Each split once: half the blocks in sample.
        if mask.count_ones() as usize != blocks / 2 {
            continue;
        }
        for j in 0..n {
            let (mut a, mut b) = (Sums::default(), Sums::default());
            for (k, s) in sums[j].iter().enumerate() {
                if mask >> k & 1 == 1 {
                    a.add(*s);
                } else {
                    b.add(*s);
                }
            }
            is[j] = a.sharpe();
            oos[j] = b.sharpe();
        }
        let best = (0..n).fold(0, |b, j| if is[j] > is[b] { j } else { b });
        let below = oos.iter().filter(|&&x| x < oos[best]).count() as f64;
        let ties = oos.iter().filter(|&&x| x == oos[best]).count() as f64;
        let rank = below + (ties + 1.0) / 2.0;
        let w = rank / (n as f64 + 1.0);
        if (w / (1.0 - w)).ln() <= 0.0 {
            overfit += 1;
        }
        oos_best_sum += oos[best];
        losses += usize::from(oos[best] < 0.0);
        splits += 1;
    }
    Ok(Overfitting {
        pbo: overfit as f64 / splits as f64,
        splits,
        blocks,
        strategies: n,
        mean_oos_sharpe_of_best: oos_best_sum / splits as f64,
        prob_oos_loss: losses as f64 / splits as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fx_data::rng::Rng;
    use proptest::prelude::*;

    fn noise(rng: &mut Rng, n: usize, mean: f64, sd: f64) -> Vec<f64> {
        (0..n).map(|_| mean + sd * rng.normal()).collect()
    }

    #[test]
    fn normal_quantiles_match_tables() {
        for (p, z) in
            [(0.975, 1.959_963_984_540_054), (0.99, 2.326_347_874_040_841), (0.5, 0.0), (0.001, -3.090_232_306_167_813)]
        {
            let q = normal_quantile(p).unwrap();
            assert!((q - z).abs() < 1e-12, "Φ⁻¹({p}) = {q}, table {z}");
        }
        assert!((normal_cdf(1.959_963_984_540_054) - 0.975).abs() < 1e-14);
        assert!(normal_quantile(0.0).is_err() && normal_quantile(1.0).is_err() && normal_quantile(f64::NAN).is_err());
    }

    #[test]
    fn deflated_sharpe_matches_the_papers_example() {
        // Bailey & López de Prado (2014), section 5: 100 trials whose annualised Sharpe
        // ratios vary with variance 1/2, the best at an annualised 2.5 over 5 years of
        // daily returns (T = 1250, 250 a year), skewness −3, kurtosis 10: DSR ≈ 0.9004.
        let per_year = 250.0f64;
        let m = ReturnMoments { periods: 1250, sharpe: 2.5 / per_year.sqrt(), skewness: -3.0, kurtosis: 10.0 };
        let sr0 = expected_max_sharpe(100, 0.5 / per_year).unwrap();
        assert!((sr0 * per_year.sqrt() - 1.7897).abs() < 1e-3, "annualised SR0 {}", sr0 * per_year.sqrt());
        let dsr = deflated_sharpe(&m, 100, 0.5 / per_year).unwrap();
        assert!((dsr - 0.9004).abs() < 5e-4, "DSR {dsr}");
        // One trial: nothing to deflate, the PSR against 0.
        assert_eq!(deflated_sharpe(&m, 1, 0.5).unwrap(), probabilistic_sharpe(&m, 0.0).unwrap());
    }

    #[test]
    fn probabilistic_sharpe_of_normal_returns_has_its_closed_form() {
        let mut rng = Rng::new(7);
        let r = noise(&mut rng, 5000, 0.02, 1.0);
        let m = moments(&r).unwrap();
        assert!(m.skewness.abs() < 0.15 && (m.kurtosis - 3.0).abs() < 0.3, "{m:?}");
        let gauss = ReturnMoments { skewness: 0.0, kurtosis: 3.0, ..m };
        let closed = normal_cdf(m.sharpe * 4999f64.sqrt() / (1.0 + m.sharpe * m.sharpe / 2.0).sqrt());
        assert!((probabilistic_sharpe(&gauss, 0.0).unwrap() - closed).abs() < 1e-12);
        // Against its own Sharpe ratio the probability is one half.
        assert!((probabilistic_sharpe(&m, m.sharpe).unwrap() - 0.5).abs() < 1e-15);
        assert!(moments(&[1.0, 1.0, 1.0]).is_err());
        assert!(moments(&[1.0, f64::NAN]).unwrap_err().to_string().contains("value 1 is NaN"));
    }

    #[test]
    fn the_best_of_unskilled_trials_is_not_significant_once_deflated() {
        // 50 trials of zero true Sharpe, 500 periods each; the best's PSR against 0 looks
        // significant, its DSR with the 50 trials counted does not (repeated over 200
        // studies). A calibrated test would call at most 5 % significant; the deflated
        // one is conservative (the best of 50 rarely beats their expected best by 1.645
        // standard errors), and 10 % leaves room for the draws.
        let mut rng = Rng::new(11);
        let (mut psr_hits, mut dsr_hits) = (0, 0);
        for _ in 0..200 {
            let ms: Vec<ReturnMoments> = (0..50).map(|_| moments(&noise(&mut rng, 500, 0.0, 1.0)).unwrap()).collect();
            let srs: Vec<f64> = ms.iter().map(|m| m.sharpe).collect();
            let mean = srs.iter().sum::<f64>() / 50.0;
            let var = srs.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / 49.0;
            let best = ms.iter().max_by(|a, b| a.sharpe.total_cmp(&b.sharpe)).unwrap();
            psr_hits += usize::from(probabilistic_sharpe(best, 0.0).unwrap() > 0.95);
            dsr_hits += usize::from(deflated_sharpe(best, 50, var).unwrap() > 0.95);
        }
        assert!(psr_hits >= 150, "the undeflated best looks skilled in most studies: {psr_hits}/200");
        assert!(dsr_hits <= 20, "deflated, at most 10 % of studies: {dsr_hits}/200");
    }

    #[test]
    fn bootstrap_interval_of_a_mean_has_the_normal_width() {
        let mut rng = Rng::new(3);
        let xs = noise(&mut rng, 400, 1.0, 2.0);
        let mean = xs.iter().sum::<f64>() / 400.0;
        let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 400.0).sqrt();
        let ci = bootstrap_mean_interval(&xs, 0.95, 4000, 1).unwrap();
        let half = 1.96 * sd / 20.0;
        assert!((ci.lo - (mean - half)).abs() < 0.15 * half && (ci.hi - (mean + half)).abs() < 0.15 * half, "{ci:?}");
        assert_eq!(ci, bootstrap_mean_interval(&xs, 0.95, 4000, 1).unwrap());
        assert!(bootstrap_mean_interval(&[1.0, f64::INFINITY], 0.95, 10, 1).is_err());
        assert_eq!(bootstrap_mean_interval(&[2.5], 0.9, 10, 1).unwrap(), Interval { lo: 2.5, hi: 2.5 });
    }

    #[test]
    fn pbo_is_one_half_without_skill_and_zero_with_it() {
        let mut rng = Rng::new(5);
        let mut strategies: Vec<Vec<f64>> = (0..20).map(|_| noise(&mut rng, 1200, 0.0, 1.0)).collect();
        // Unskilled strategies: the in-sample best's out-of-sample rank is uniform, so PBO
        // is 0.5 in expectation. One panel's PBO varies a lot (its splits share the data; sd
        // about 0.17 here), so the mean over 30 panels is compared: its standard error is
        // about 0.03, and 0.1 is three of them.
        let pbos: Vec<f64> = (0..30)
            .map(|_| {
                let s: Vec<Vec<f64>> = (0..10).map(|_| noise(&mut rng, 600, 0.0, 1.0)).collect();
                let o = probability_of_overfitting(&s, 10).unwrap();
                assert_eq!(o.splits, 252);
                o.pbo
            })
            .collect();
        let mean = pbos.iter().sum::<f64>() / 30.0;
        let sd = (pbos.iter().map(|p| (p - mean).powi(2)).sum::<f64>() / 29.0).sqrt();
        eprintln!("PBO without skill: mean {mean:.3}, sd {sd:.3} over 30 panels");
        assert!((mean - 0.5).abs() < 0.1, "mean PBO without skill {mean} (sd {sd})");
        // One strategy with a real edge (Sharpe 0.2 a period) is chosen and stays on top.
        strategies[7] = noise(&mut rng, 1200, 0.2, 1.0);
        let o = probability_of_overfitting(&strategies, 12).unwrap();
        assert!(o.pbo < 0.02 && o.prob_oos_loss == 0.0 && o.mean_oos_sharpe_of_best > 0.1, "{o:?}");
    }

    #[test]
    fn pbo_rejects_what_it_cannot_compute() {
        let ok = vec![vec![0.1, -0.2, 0.3, 0.0]; 2];
        assert!(probability_of_overfitting(&ok[..1], 2).is_err());
        assert!(probability_of_overfitting(&ok, 3).is_err());
        assert!(probability_of_overfitting(&ok, 4).unwrap_err().to_string().contains("4 periods are too few"));
        let ragged = vec![vec![0.0; 8], vec![0.0; 7]];
        assert!(probability_of_overfitting(&ragged, 2).unwrap_err().to_string().contains("strategy 1 has 7"));
        let nan = vec![vec![0.0; 8], vec![f64::NAN; 8]];
        assert!(probability_of_overfitting(&nan, 2).unwrap_err().to_string().contains("strategy 1"));
    }

    proptest! {
        #[test]
        fn pbo_is_a_share_and_ignores_positive_scaling(seed in any::<u64>(), scale in 0.01f64..100.0, n in 2usize..8) {
            let mut rng = Rng::new(seed);
            let s: Vec<Vec<f64>> = (0..n).map(|_| noise(&mut rng, 64, 0.01, 1.0)).collect();
            let a = probability_of_overfitting(&s, 4).unwrap();
            prop_assert!((0.0..=1.0).contains(&a.pbo) && a.splits == 6);
            // A Sharpe ratio does not change when a strategy's returns are scaled.
            let mut t = s.clone();
            for x in &mut t[0] { *x *= scale; }
            let b = probability_of_overfitting(&t, 4).unwrap();
            prop_assert!((a.pbo - b.pbo).abs() < 1e-12, "{} vs {}", a.pbo, b.pbo);
        }

        #[test]
        fn quantile_inverts_the_cdf(p in 1e-12f64..(1.0 - 1e-12)) {
            let x = normal_quantile(p).unwrap();
            prop_assert!((normal_cdf(x) - p).abs() <= 1e-12 * p.min(1.0 - p) + 1e-15, "p {} x {}", p, x);
        }
    }
}
