//! A seeded synthetic market for the embedded default run (no user data):
//! Markov regime switching of drift, volatility scale and return
//! autocorrelation, GARCH(1,1) volatility clustering, valid OHLC bars and a
//! volume that rises with volatility. The AR(1) term is deliberate: it gives a
//! simple RL agent an edge to learn (a momentum rule beats flat and random),
//! so "training works" is observable on the default.

use serde::{Deserialize, Serialize};

use crate::bars::Bars;
use crate::error::Error;
use crate::feature_file::FeatureTable;
use crate::rng::Rng;

/// Bar spacing of the synthetic series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Interval {
    /// One bar per hour, around the clock (FX-like).
    Hourly,
    /// One bar per weekday at midnight UTC (equity-like; weekends skipped).
    Daily,
}

/// One market regime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Regime {
    /// Mean log return per bar.
    pub drift: f64,
    /// Multiplier on the GARCH volatility.
    pub vol_scale: f64,
    /// AR(1) coefficient of returns (the exploitable signal).
    pub ar: f64,
    /// Mean time in the regime, in bars (geometric durations).
    pub mean_duration: f64,
}

/// Synthetic market settings; the defaults are the embedded default market.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyntheticConfig {
    /// PRNG seed; the same seed gives the same bars.
    pub seed: u64,
    /// Number of bars.
    pub bars: usize,
    /// Bar spacing.
    pub interval: Interval,
    /// Unix seconds of the first bar.
    pub start_timestamp: i64,
    /// First open price.
    pub start_price: f64,
    /// Long-run per-bar volatility of log returns (before regime scaling).
    pub base_vol: f64,
    /// GARCH(1,1) reaction to the last squared shock.
    pub garch_alpha: f64,
    /// GARCH(1,1) persistence (`alpha + beta < 1`).
    pub garch_beta: f64,
    /// Mean volume per bar in calm markets.
    pub base_volume: f64,
    /// Volume elasticity to volatility (`volume ∝ (σ/base_vol)^k`).
    pub volume_vol_elasticity: f64,
    /// The regimes; the chain starts in the first.
    pub regimes: Vec<Regime>,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            seed: 7,
            bars: 20_000,
            interval: Interval::Hourly,
            start_timestamp: 1_577_836_800, // 2020-01-01 00:00 UTC
            start_price: 100.0,
            base_vol: 0.004,
            garch_alpha: 0.08,
            garch_beta: 0.90,
            base_volume: 1_000.0,
            volume_vol_elasticity: 1.0,
            regimes: vec![
                Regime { drift: 2e-4, vol_scale: 0.8, ar: 0.15, mean_duration: 600.0 },
                Regime { drift: -2e-4, vol_scale: 1.3, ar: 0.20, mean_duration: 300.0 },
                Regime { drift: 0.0, vol_scale: 0.7, ar: 0.10, mean_duration: 500.0 },
            ],
        }
    }
}

impl SyntheticConfig {
    /// Checks the settings (finite, positive where needed, a stationary GARCH).
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |msg: &str| Err(Error::config("synthetic market", msg.to_string()));
        if self.bars == 0 {
            return bad("bars must be > 0");
        }
        if !(self.start_price.is_finite() && self.start_price > 0.0) {
            return bad("start_price must be finite and positive");
        }
        if !(self.base_vol.is_finite() && self.base_vol > 0.0 && self.base_vol < 0.5) {
            return bad("base_vol must be in (0, 0.5)");
        }
        let (a, b) = (self.garch_alpha, self.garch_beta);
        if !(a >= 0.0 && b >= 0.0 && a + b < 1.0) {
            return bad("garch_alpha, garch_beta must be >= 0 with alpha + beta < 1");
        }
        if !(self.base_volume.is_finite() && self.base_volume >= 0.0 && self.volume_vol_elasticity.is_finite()) {
            return bad("base_volume must be finite and >= 0, volume_vol_elasticity finite");
        }
        if self.regimes.is_empty() {
            return bad("at least one regime is needed");
        }
        for r in &self.regimes {
            let ok = r.drift.is_finite()
                && r.drift.abs() < 0.1
                && r.vol_scale.is_finite()
                && r.vol_scale > 0.0
                && r.ar.abs() < 1.0
                && r.mean_duration >= 1.0;
            if !ok {
                return bad("each regime needs |drift| < 0.1, vol_scale > 0, |ar| < 1, mean_duration >= 1");
            }
        }
        Ok(())
    }
}

/// Generates the bars of `cfg`; deterministic per seed. Returns also the
/// regime index of every bar (for tests and diagnostics).
pub fn generate_with_regimes(cfg: &SyntheticConfig) -> Result<(Bars, Vec<usize>), Error> {
    cfg.validate()?;
    let mut rng = Rng::new(cfg.seed);
    let n = cfg.bars;
    let mut bars = Bars::default();
    let mut regimes = Vec::with_capacity(n);
    let omega = cfg.base_vol * cfg.base_vol * (1.0 - cfg.garch_alpha - cfg.garch_beta);
    let mut var = cfg.base_vol * cfg.base_vol;
    let mut shock = 0.0f64;
    let mut r_prev = 0.0f64;
    let mut regime = 0usize;
    let mut prev_close = cfg.start_price;
    let mut ts = cfg.start_timestamp;
    for i in 0..n {
        // Regime switch with probability 1/mean_duration, to a different regime.
        let k = cfg.regimes.len();
        if i > 0 && k > 1 && rng.uniform() < 1.0 / cfg.regimes[regime].mean_duration {
            let step = 1 + rng.below(k as u64 - 1) as usize;
            regime = (regime + step) % k;
        }
        let reg = &cfg.regimes[regime];
        var = omega + cfg.garch_alpha * shock * shock + cfg.garch_beta * var;
        let sigma = var.sqrt();
        shock = sigma * rng.normal();
        let r = reg.drift + reg.ar * (r_prev - reg.drift) + reg.vol_scale * shock;
        r_prev = r;
        let bar_vol = reg.vol_scale * sigma;
        // Small opening gap, then the bar's return is carried open -> close so
        // close-to-close log return stays exactly r.
        let open = prev_close * (0.05 * bar_vol * rng.normal()).exp();
        let close = prev_close * r.exp();
        let high = open.max(close) * (0.5 * bar_vol * rng.normal().abs()).exp();
        let low = open.min(close) * (-0.5 * bar_vol * rng.normal().abs()).exp();
        let seasonal = match cfg.interval {
            // More volume in the European/US session hours.
            Interval::Hourly => {
                let hour = ts.rem_euclid(86_400) as f64 / 3600.0;
                1.0 + 0.5 * (std::f64::consts::TAU * (hour - 9.0) / 24.0).cos()
            }
            Interval::Daily => 1.0,
        };
        let volume = (cfg.base_volume
            * seasonal
            * (bar_vol / cfg.base_vol).powf(cfg.volume_vol_elasticity)
            * (0.3 * rng.normal() - 0.045).exp())
        .round();
        bars.timestamp.push(ts);
        bars.open.push(open);
        bars.high.push(high);
        bars.low.push(low);
        bars.close.push(close);
        bars.volume.push(volume);
        regimes.push(regime);
        prev_close = close;
        ts = next_timestamp(ts, cfg.interval);
    }
    bars.validate(std::path::Path::new("<synthetic market>"))?;
    Ok((bars, regimes))
}

/// Generates the bars of `cfg`; deterministic per seed.
pub fn generate(cfg: &SyntheticConfig) -> Result<Bars, Error> {
    generate_with_regimes(cfg).map(|(b, _)| b)
}

/// The feature table of the synthetic market of `cfg` (the embedded default
/// when `cfg` is `SyntheticConfig::default()`).
pub fn feature_table(cfg: &SyntheticConfig) -> Result<FeatureTable, Error> {
    let bars = generate(cfg)?;
    FeatureTable::from_bars(&bars, &format!("synthetic(seed={})", cfg.seed))
}

fn next_timestamp(ts: i64, interval: Interval) -> i64 {
    match interval {
        Interval::Hourly => ts + 3600,
        Interval::Daily => {
            let mut t = ts + 86_400;
            // day_of_week with Monday = 0 (DATA.md); skip Saturday (5) and Sunday (6).
            while (t.div_euclid(86_400) + 3).rem_euclid(7) >= 5 {
                t += 86_400;
            }
            t
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> SyntheticConfig {
        SyntheticConfig { seed, bars: 5_000, ..Default::default() }
    }

    fn returns(b: &Bars) -> Vec<f64> {
        b.close.windows(2).map(|w| (w[1] / w[0]).ln()).collect()
    }

    fn autocorr(x: &[f64]) -> f64 {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        let v: f64 = x.iter().map(|a| (a - m).powi(2)).sum();
        let c: f64 = x.windows(2).map(|w| (w[0] - m) * (w[1] - m)).sum();
        c / v
    }

    #[test]
    fn deterministic_per_seed() {
        assert_eq!(generate(&small(1)).unwrap(), generate(&small(1)).unwrap());
        assert_ne!(generate(&small(1)).unwrap().close, generate(&small(2)).unwrap().close);
    }

    #[test]
    fn stylised_facts() {
        let (bars, regimes) = generate_with_regimes(&small(11)).unwrap();
        let r = returns(&bars);
        // Autocorrelation of returns is positive (the exploitable signal)...
        let ac = autocorr(&r);
        assert!(ac > 0.05 && ac < 0.3, "return autocorrelation {ac}");
        // ...volatility clusters: |r| is clearly autocorrelated...
        let abs: Vec<f64> = r.iter().map(|x| x.abs()).collect();
        assert!(autocorr(&abs) > 0.1, "abs-return autocorrelation {}", autocorr(&abs));
        // ...fat tails (excess kurtosis > 0)...
        let m = r.iter().sum::<f64>() / r.len() as f64;
        let m2 = r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / r.len() as f64;
        let m4 = r.iter().map(|x| (x - m).powi(4)).sum::<f64>() / r.len() as f64;
        assert!(m4 / (m2 * m2) - 3.0 > 0.2, "kurtosis {}", m4 / (m2 * m2) - 3.0);
        // ...several regimes are visited, and volume rises with the range.
        let mut seen = regimes.clone();
        seen.sort();
        seen.dedup();
        assert!(seen.len() >= 2, "{seen:?}");
        let hl: Vec<f64> = (0..bars.len()).map(|i| (bars.high[i] / bars.low[i]).ln()).collect();
        let corr = pearson(&hl, &bars.volume);
        assert!(corr > 0.1, "volume/range correlation {corr}");
    }

    fn pearson(x: &[f64], y: &[f64]) -> f64 {
        let n = x.len() as f64;
        let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
        let c: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
        let vx: f64 = x.iter().map(|a| (a - mx).powi(2)).sum();
        let vy: f64 = y.iter().map(|b| (b - my).powi(2)).sum();
        c / (vx * vy).sqrt()
    }

    #[test]
    fn momentum_beats_flat_and_random() {
        // What an agent can learn: position = sign(last return).
        let bars = generate(&small(5)).unwrap();
        let r = returns(&bars);
        let momentum: f64 = r.windows(2).map(|w| w[0].signum() * w[1]).sum();
        let mut rng = Rng::new(99);
        let random: f64 = r.iter().map(|x| if rng.uniform() < 0.5 { *x } else { -*x }).sum();
        assert!(momentum > 0.0 && momentum > random + 0.5, "momentum {momentum} random {random}");
    }

    #[test]
    fn daily_skips_weekends_and_features_are_finite() {
        let cfg = SyntheticConfig { interval: Interval::Daily, bars: 300, ..small(3) };
        let bars = generate(&cfg).unwrap();
        for &t in &bars.timestamp {
            assert!((t.div_euclid(86_400) + 3).rem_euclid(7) < 5);
            assert_eq!(t.rem_euclid(86_400), 0);
        }
        let table = feature_table(&cfg).unwrap();
        assert_eq!(table.rows(), 200);
    }

    #[test]
    fn config_serde_defaults_and_validation() {
        let cfg: SyntheticConfig = serde_json::from_str(r#"{"seed": 9, "interval": "daily"}"#).unwrap();
        assert_eq!(cfg.seed, 9);
        assert_eq!(cfg.interval, Interval::Daily);
        assert_eq!(cfg.regimes, SyntheticConfig::default().regimes);
        let bad = SyntheticConfig { garch_alpha: 0.5, garch_beta: 0.6, ..Default::default() };
        assert!(matches!(generate(&bad), Err(Error::Config { .. })));
    }
}
