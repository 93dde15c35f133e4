//! Backtests: a policy replayed over a held-out series as one account, and the trading
//! statistics of the resulting positions beside buy-and-hold, flat and random.
//!
//! Accounting follows the environment (MODELS.md): the position chosen at row `i` is held
//! from `close[i]` to `close[i+1]`; the step's log return is
//! `p_i · ln(close[i+1]/close[i]) − cost · |p_i − p_{i−1}|` with `p_{−1} = 0`. The policy
//! sees the environment's own observation ([`fx_kernels::write_observation`]); the time in
//! position is capped at `episode_len`, the longest a training episode lets it grow.

use fx_kernels::{write_observation, EnvData, OBS_DIM};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub mod significance;

/// Trading statistics of one position sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BacktestStats {
    /// Steps (bars held).
    pub steps: usize,
    /// `exp(Σ log returns) − 1`.
    pub total_return: f64,
    /// `exp(mean log return · periods_per_year) − 1`.
    pub annualised_return: f64,
    /// Mean over standard deviation of the per-step log returns, × √periods_per_year
    /// (0 when the returns do not vary).
    pub sharpe: f64,
    /// Mean over downside deviation (root mean square of the negative returns),
    /// × √periods_per_year (0 when nothing was lost).
    pub sortino: f64,
    /// Largest fall of the equity curve from its running peak, as a fraction.
    pub max_drawdown: f64,
    /// Fraction of the steps in the market (position ≠ 0) that made money.
    pub hit_rate: f64,
    /// Mean |position change| per step.
    pub turnover: f64,
    /// Sum of the transaction costs, in log-return units.
    pub cost_paid: f64,
}

/// A backtest's positions, equity curve and statistics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Backtest {
    /// Position held over each step (−1, 0, +1).
    pub positions: Vec<i8>,
    /// Log return of each step, costs included.
    pub returns: Vec<f64>,
    /// Equity after each step, starting from 1 before the first.
    pub equity: Vec<f64>,
    /// The statistics.
    pub stats: BacktestStats,
}

/// Evaluates `positions` (one per step, `positions.len() + 1 == close.len()`).
pub fn evaluate_positions(positions: &[i8], close: &[f64], cost: f64, periods_per_year: f64) -> Result<Backtest> {
    if close.len() != positions.len() + 1 {
        return Err(Error::config(
            "backtest",
            format!("{} positions need {} prices, got {}", positions.len(), positions.len() + 1, close.len()),
        ));
    }
    if positions.is_empty() {
        return Err(Error::config("backtest", "nothing to backtest: the series has fewer than 2 rows"));
    }
    if !(periods_per_year.is_finite() && periods_per_year > 0.0) {
        return Err(Error::config("backtest", format!("periods_per_year must be positive, got {periods_per_year}")));
    }
    let n = positions.len();
    let mut rets = Vec::with_capacity(n);
    let (mut prev, mut cost_paid, mut changes, mut in_market, mut wins) = (0i8, 0.0, 0.0, 0usize, 0usize);
    for (i, &p) in positions.iter().enumerate() {
        let step_cost = cost * f64::from((p - prev).abs());
        let r = f64::from(p) * (close[i + 1] / close[i]).ln() - step_cost;
        cost_paid += step_cost;
        changes += f64::from((p - prev).abs());
        if p != 0 {
            in_market += 1;
            wins += usize::from(r > 0.0);
        }
        rets.push(r);
        prev = p;
    }
    let hit_rate = if in_market > 0 { wins as f64 / in_market as f64 } else { 0.0 };
    let (equity, stats) = summarise(&rets, periods_per_year, hit_rate, changes / n as f64, cost_paid);
    Ok(Backtest { positions: positions.to_vec(), returns: rets, equity, stats })
}

/// The equity curve and statistics of per-step log returns `rets` (non-empty).
fn summarise(
    rets: &[f64],
    periods_per_year: f64,
    hit_rate: f64,
    turnover: f64,
    cost_paid: f64,
) -> (Vec<f64>, BacktestStats) {
    let n = rets.len();
    let mean = rets.iter().sum::<f64>() / n as f64;
    let var = rets.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n as f64;
    let downside = (rets.iter().map(|r| r.min(0.0).powi(2)).sum::<f64>() / n as f64).sqrt();
    let ann = periods_per_year.sqrt();
    let mut equity = Vec::with_capacity(n);
    let (mut log_eq, mut peak, mut max_dd) = (0.0f64, 1.0f64, 0.0f64);
    for r in rets {
        log_eq += r;
        let e = log_eq.exp();
        peak = peak.max(e);
        max_dd = max_dd.max(1.0 - e / peak);
        equity.push(e);
    }
    let stats = BacktestStats {
        steps: n,
        total_return: log_eq.exp() - 1.0,
        annualised_return: (mean * periods_per_year).exp() - 1.0,
        sharpe: if var > 0.0 { mean / var.sqrt() * ann } else { 0.0 },
        sortino: if downside > 0.0 { mean / downside * ann } else { 0.0 },
        max_drawdown: max_dd,
        hit_rate,
        turnover,
        cost_paid,
    };
    (equity, stats)
}

/// The equal-weight portfolio of several instruments' backtests, rebalanced every step:
/// `parts[k] = (steps, backtest)` where `steps[j]` is the portfolio step (a calendar row's
/// index in the span) at which the instrument's step `j` starts. At a step the instruments
/// that trade there share the capital equally: the portfolio's simple return is the mean of
/// theirs, `ln(mean(exp(r_i)))` as a log return (exactly `r_i` where one instrument
/// trades alone). Steps where none trades are left out. `positions` is empty (a portfolio
/// holds no single position); hit rate is pooled over the instrument-steps in the market,
/// turnover and costs (`cost_per_unit` per unit of position change, as the backtests
/// paid) are the trading instruments' means per step.
pub fn equal_weight(parts: &[(&[usize], &Backtest)], cost_per_unit: f64, periods_per_year: f64) -> Result<Backtest> {
    let ctx = "equal-weight portfolio";
    if let Some((k, _)) = parts.iter().enumerate().find(|(_, (steps, b))| steps.len() != b.returns.len()) {
        return Err(Error::config(ctx, format!("instrument {k}: step indices and returns differ in length")));
    }
    let n = parts.iter().flat_map(|(steps, _)| steps.iter().map(|&s| s + 1)).max().unwrap_or(0);
    // Per portfolio step: the sum of simple returns, of costs, of |position changes|, the
    // instruments trading, and the first one's log return (for the one-instrument case).
    let (mut simple, mut cost, mut change) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
    let (mut count, mut first) = (vec![0usize; n], vec![0f64; n]);
    let (mut in_market, mut wins) = (0usize, 0usize);
    for (steps, b) in parts {
        let mut prev = 0i8;
        for (j, (&s, &r)) in steps.iter().zip(&b.returns).enumerate() {
            let p = b.positions.get(j).copied().unwrap_or(0);
            if count[s] == 0 {
                first[s] = r;
            }
            count[s] += 1;
            simple[s] += r.exp_m1();
            change[s] += f64::from((p - prev).abs());
            cost[s] += cost_per_unit * f64::from((p - prev).abs());
            if p != 0 {
                in_market += 1;
                wins += usize::from(r > 0.0);
            }
            prev = p;
        }
    }
    let live: Vec<usize> = (0..n).filter(|&s| count[s] > 0).collect();
    if live.is_empty() {
        return Err(Error::config(ctx, "no instrument has a step to backtest"));
    }
    if !(periods_per_year.is_finite() && periods_per_year > 0.0) {
        return Err(Error::config(ctx, format!("periods_per_year must be positive, got {periods_per_year}")));
    }
    let rets: Vec<f64> =
        live.iter().map(|&s| if count[s] == 1 { first[s] } else { (simple[s] / count[s] as f64).ln_1p() }).collect();
    let turnover = live.iter().map(|&s| change[s] / count[s] as f64).sum::<f64>() / live.len() as f64;
    let cost_paid = live.iter().map(|&s| cost[s] / count[s] as f64).sum::<f64>();
    let hit_rate = if in_market > 0 { wins as f64 / in_market as f64 } else { 0.0 };
    let (equity, stats) = summarise(&rets, periods_per_year, hit_rate, turnover, cost_paid);
    Ok(Backtest { positions: Vec::new(), returns: rets, equity, stats })
}

/// Replays `policy` over every row of `data` but the last, as one account starting flat:
/// at each row the policy gets the observation (`[56]` f32) and returns an action
/// (0 short, 1 flat, 2 long). Returns the positions held.
pub fn replay_policy(
    data: &EnvData,
    episode_len: usize,
    mut policy: impl FnMut(&[f32]) -> Result<u32>,
) -> Result<Vec<i8>> {
    let close = data.close();
    let mut obs = vec![0f32; OBS_DIM];
    let (mut pos, mut entry, mut sip) = (0i8, close[0], 0u64);
    let mut positions = Vec::with_capacity(data.len().saturating_sub(1));
    for (t, &price) in close.iter().enumerate().take(data.len().saturating_sub(1)) {
        write_observation(data, episode_len, t, pos, entry, sip.min(episode_len as u64), &mut obs);
        let a = policy(&obs)?;
        if a > 2 {
            return Err(Error::config(
                "backtest",
                format!("policy returned action {a} at row {t} (expected 0, 1 or 2)"),
            ));
        }
        let p = a as i8 - 1;
        if p != pos {
            entry = price;
            sip = 0;
        } else {
            sip += 1;
        }
        pos = p;
        positions.push(p);
    }
    Ok(positions)
}

/// Uniformly random positions from the counter-based draws (stream 2, account `u64::MAX`),
/// the "random policy" baseline.
pub fn random_positions(steps: usize, seed: u64) -> Vec<i8> {
    (0..steps as u64)
        .map(|i| {
            (fx_kernels::rng::draw(seed, fx_kernels::rng::STREAM_RANDOM_ACTION, u64::MAX, i) * 3.0).floor().min(2.0)
                as i8
                - 1
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_weight_of_one_instrument_is_that_instrument() {
        let close: Vec<f64> = (0..40).map(|i| 100.0 * (1.0 + 0.01 * (i as f64 * 0.7).sin())).collect();
        let pos: Vec<i8> = (0..39).map(|i| [1, 0, -1][i % 3]).collect();
        let b = evaluate_positions(&pos, &close, 1e-4, 252.0).unwrap();
        let steps: Vec<usize> = (0..39).collect();
        let p = equal_weight(&[(&steps, &b)], 1e-4, 252.0).unwrap();
        assert_eq!(p.returns, b.returns);
        assert_eq!(p.stats.sharpe.to_bits(), b.stats.sharpe.to_bits());
        assert!((p.stats.cost_paid - b.stats.cost_paid).abs() < 1e-15);
        assert!((p.stats.turnover - b.stats.turnover).abs() < 1e-15);
        // Two instruments: half the capital in each; a step one of them misses is the other's.
        let flat = evaluate_positions(&[0; 20], &close[..21], 1e-4, 252.0).unwrap();
        let late: Vec<usize> = (10..30).collect();
        let q = equal_weight(&[(&steps, &b), (&late, &flat)], 1e-4, 252.0).unwrap();
        assert_eq!(q.returns.len(), 39);
        for s in 0..39 {
            let want = if late.contains(&s) { (b.returns[s].exp_m1() / 2.0).ln_1p() } else { b.returns[s] };
            assert!((q.returns[s] - want).abs() < 1e-15, "step {s}");
        }
        assert!(equal_weight(&[(&steps[..3], &b)], 1e-4, 252.0).is_err());
        assert!(equal_weight(&[], 1e-4, 252.0).is_err());
    }

    fn f64_reference(positions: &[i8], close: &[f64], cost: f64) -> (f64, f64) {
        let mut total = 0.0f64;
        let mut prev = 0i8;
        let mut cost_paid = 0.0;
        for (i, &p) in positions.iter().enumerate() {
            let c = cost * (p as f64 - prev as f64).abs();
            total += p as f64 * (close[i + 1].ln() - close[i].ln()) - c;
            cost_paid += c;
            prev = p;
        }
        (total.exp() - 1.0, cost_paid)
    }

    #[test]
    fn matches_a_scalar_reference_on_random_paths() {
        for case in 0..20usize {
            let seed = case as u64 + 1;
            let n = 50 + case * 7;
            let mut close = vec![100.0];
            for i in 0..n {
                let u = fx_kernels::rng::draw(seed, 9, case as u64, i as u64);
                close.push(close[i] * (1.0 + (u - 0.5) * 0.04));
            }
            let pos = random_positions(n, seed);
            let bt = evaluate_positions(&pos, &close, 1e-4, 252.0).unwrap();
            let (total, cost) = f64_reference(&pos, &close, 1e-4);
            assert!((bt.stats.total_return - total).abs() < 1e-12, "{case}");
            assert!((bt.stats.cost_paid - cost).abs() < 1e-15);
            assert!((bt.equity.last().unwrap() - (1.0 + total)).abs() < 1e-12);
            assert!(bt.stats.max_drawdown >= 0.0 && bt.stats.max_drawdown < 1.0);
            assert!(bt.stats.sharpe.is_finite() && bt.stats.sortino.is_finite());
        }
    }

    #[test]
    fn buy_and_hold_and_flat() {
        let close = [100.0, 110.0, 99.0, 121.0];
        let hold = evaluate_positions(&[1, 1, 1], &close, 1e-4, 252.0).unwrap();
        assert!((hold.stats.total_return - (1.21 * (-1e-4f64).exp() - 1.0)).abs() < 1e-12);
        assert!((hold.stats.turnover - 1.0 / 3.0).abs() < 1e-15);
        assert!((hold.stats.max_drawdown - 0.1).abs() < 1e-12);
        assert!((hold.stats.hit_rate - 2.0 / 3.0).abs() < 1e-15);
        let flat = evaluate_positions(&[0, 0, 0], &close, 1e-4, 252.0).unwrap();
        assert_eq!(flat.stats.total_return, 0.0);
        assert_eq!(flat.stats.sharpe, 0.0);
        assert_eq!(flat.stats.cost_paid, 0.0);
    }

    #[test]
    fn refuses_mismatched_lengths() {
        assert!(evaluate_positions(&[1, 0], &[1.0, 2.0], 1e-4, 252.0).is_err());
        assert!(evaluate_positions(&[], &[1.0], 1e-4, 252.0).is_err());
    }

    #[test]
    fn replay_feeds_env_observations_and_follows_actions() {
        let t_len = 40;
        let close: Vec<f64> = (0..t_len).map(|i| 100.0 + i as f64).collect();
        let market: Vec<f32> = (0..t_len * fx_kernels::N_MARKET).map(|i| (i % 13) as f32).collect();
        let data = EnvData::new(market, close.clone()).unwrap();
        let mut seen = Vec::new();
        // Long on even rows, flat on odd rows.
        let pos = replay_policy(&data, 16, |obs| {
            seen.push((obs[fx_kernels::N_MARKET], obs[fx_kernels::N_MARKET + 1]));
            Ok(if seen.len() % 2 == 1 { 2 } else { 1 })
        })
        .unwrap();
        assert_eq!(pos.len(), t_len - 1);
        assert_eq!(&pos[..4], &[1, 0, 1, 0]);
        // Row 1 is observed while long since row 0 (entry 100, price 101).
        assert_eq!(seen[1].0, 1.0);
        assert!((seen[1].1 as f64 - (101.0f64 / 100.0).ln()).abs() < 1e-6);
        assert!(replay_policy(&data, 16, |_| Ok(3)).is_err());
    }
}
