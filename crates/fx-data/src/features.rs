//! The 51 market features, the 4 calendar ("known") features and
//! `logret_next` of DATA.md, computed in f64 exactly as its "Exact readings"
//! say: rolling statistics are recomputed per window with two passes (so a
//! window of identical values gives exactly zero spread), recursive averages
//! are seeded like pandas `ewm(adjust=False)`.

use std::path::Path;

use crate::bars::Bars;
use crate::error::Error;
use crate::feature_file::FeatureTable;

/// Bars consumed by the longest look-back; they are dropped from the output.
pub const WARMUP: usize = 100;
/// Number of market features.
pub const N_MARKET: usize = 51;
/// Number of calendar features.
pub const N_KNOWN: usize = 4;

/// The market feature names, in storage order.
pub const MARKET_FEATURE_NAMES: [&str; N_MARKET] = [
    "ret_1",
    "ret_2",
    "ret_3",
    "ret_5",
    "ret_10",
    "ret_20",
    "ret_40",
    "ret_60",
    "vol_5",
    "vol_10",
    "vol_20",
    "vol_60",
    "park_10",
    "park_20",
    "hl_range",
    "body",
    "upper_wick",
    "lower_wick",
    "oc_ret",
    "sma_dev_5",
    "sma_dev_10",
    "sma_dev_20",
    "sma_dev_50",
    "sma_dev_100",
    "ema_dev_12",
    "ema_dev_26",
    "ema_dev_50",
    "rsi_14",
    "rsi_6",
    "macd",
    "macd_signal",
    "macd_hist",
    "stoch_k",
    "stoch_d",
    "williams_r",
    "cci",
    "atr",
    "bb_pctb",
    "bb_width",
    "ret_z",
    "vol_ratio",
    "vol_z",
    "signed_vol",
    "vwap_dev",
    "mfi",
    "pos_20",
    "pos_60",
    "skew_20",
    "kurt_20",
    "autocorr_20",
    "range_z",
];

const EPS: f64 = 1e-12;

/// The features of one series in f64, row-major, before the cast to f32 for
/// storage. Rows are the bars from index [`WARMUP`] on.
#[derive(Debug, Clone, PartialEq)]
pub struct FeaturesF64 {
    /// `[rows, 51]` row-major.
    pub market: Vec<f64>,
    /// `[rows, 4]` row-major.
    pub known: Vec<f64>,
    /// `ln(c_{t+1}/c_t)`, 0 for the last row.
    pub logret_next: Vec<f64>,
    /// Close of each row's bar.
    pub close: Vec<f64>,
    /// Timestamp of each row's bar.
    pub timestamp: Vec<i64>,
}

impl FeaturesF64 {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.close.len()
    }
}

/// Computes all features of `bars` in f64. `what` names the source in errors.
/// The bars must be valid (see [`Bars::validate`]) and longer than the warm-up.
pub fn compute_f64(bars: &Bars, what: &Path) -> Result<FeaturesF64, Error> {
    let n = bars.len();
    if n <= WARMUP {
        return Err(Error::TooFewBars { path: what.to_path_buf(), bars: n, warmup: WARMUP });
    }
    let (o, h, l, c, v) = (&bars.open, &bars.high, &bars.low, &bars.close, &bars.volume);
    if [o.len(), h.len(), l.len(), v.len(), bars.timestamp.len()].iter().any(|&x| x != n) {
        return Err(Error::format(what, "bar columns have different lengths"));
    }

    // Per-bar series. r[0] does not exist; windows never reach it after warm-up.
    let mut r = vec![f64::NAN; n];
    for t in 1..n {
        r[t] = (c[t] / c[t - 1]).ln();
    }
    let hl: Vec<f64> = (0..n).map(|t| (h[t] / l[t]).ln()).collect();
    let hl2: Vec<f64> = hl.iter().map(|x| x * x).collect();
    let tp: Vec<f64> = (0..n).map(|t| (h[t] + l[t] + c[t]) / 3.0).collect();
    let tpv: Vec<f64> = (0..n).map(|t| tp[t] * v[t]).collect();

    // Recursive averages over the full series (pandas ewm adjust=False).
    let ema12 = ewm(c, 2.0 / 13.0);
    let ema26 = ewm(c, 2.0 / 27.0);
    let ema50 = ewm(c, 2.0 / 51.0);
    let macd: Vec<f64> = (0..n).map(|t| (ema12[t] - ema26[t]) / c[t]).collect();
    let macd_signal = ewm(&macd, 2.0 / 10.0);
    let gain: Vec<f64> = (1..n).map(|t| (c[t] - c[t - 1]).max(0.0)).collect();
    let loss: Vec<f64> = (1..n).map(|t| (c[t - 1] - c[t]).max(0.0)).collect();
    // Indexed from bar 1: value for bar t is at t - 1.
    let rsi = |k: f64| -> Vec<f64> {
        let wg = ewm(&gain, 1.0 / k);
        let wl = ewm(&loss, 1.0 / k);
        wg.iter()
            .zip(&wl)
            .map(|(g, l)| {
                let rsi = 100.0 - 100.0 / (1.0 + g / (l + EPS));
                rsi / 100.0 - 0.5
            })
            .collect()
    };
    let rsi14 = rsi(14.0);
    let rsi6 = rsi(6.0);
    let tr: Vec<f64> =
        (0..n)
            .map(|t| {
                if t == 0 {
                    h[0] - l[0]
                } else {
                    (h[t] - l[t]).max((h[t] - c[t - 1]).abs()).max((l[t] - c[t - 1]).abs())
                }
            })
            .collect();
    let atr = ewm(&tr, 1.0 / 14.0);
    // MFI flows: the first bar and unchanged tp are neither.
    let mut pos = vec![0.0; n];
    let mut neg = vec![0.0; n];
    for t in 1..n {
        if tp[t] > tp[t - 1] {
            pos[t] = tpv[t];
        } else if tp[t] < tp[t - 1] {
            neg[t] = tpv[t];
        }
    }
    // stoch_k is needed at t-2..t for stoch_d, so compute it for every bar with a full window.
    let stoch_k = |t: usize| -> f64 {
        let lo = min(win(l, t, 14));
        let hi = max(win(h, t, 14));
        (c[t] - lo) / (hi - lo + EPS) - 0.5
    };

    let rows = n - WARMUP;
    let mut market = Vec::with_capacity(rows * N_MARKET);
    let mut known = Vec::with_capacity(rows * N_KNOWN);
    let mut f = [0.0f64; N_MARKET];
    for t in WARMUP..n {
        for (j, k) in [1usize, 2, 3, 5, 10, 20, 40, 60].iter().enumerate() {
            f[j] = (c[t] / c[t - k]).ln();
        }
        for (j, k) in [5usize, 10, 20, 60].iter().enumerate() {
            f[8 + j] = mean_std(win(&r, t, *k)).1;
        }
        for (j, k) in [10usize, 20].iter().enumerate() {
            f[12 + j] = (mean(win(&hl2, t, *k)) / (4.0 * std::f64::consts::LN_2)).sqrt();
        }
        let range = h[t] - l[t] + EPS;
        f[14] = hl[t];
        f[15] = (c[t] - o[t]) / range;
        f[16] = (h[t] - o[t].max(c[t])) / range;
        f[17] = (o[t].min(c[t]) - l[t]) / range;
        f[18] = (c[t] / o[t]).ln();
        for (j, k) in [5usize, 10, 20, 50, 100].iter().enumerate() {
            f[19 + j] = (c[t] / mean(win(c, t, *k))).ln();
        }
        f[24] = (c[t] / ema12[t]).ln();
        f[25] = (c[t] / ema26[t]).ln();
        f[26] = (c[t] / ema50[t]).ln();
        f[27] = rsi14[t - 1];
        f[28] = rsi6[t - 1];
        f[29] = macd[t];
        f[30] = macd_signal[t];
        f[31] = macd[t] - macd_signal[t];
        let sk = [stoch_k(t - 2), stoch_k(t - 1), stoch_k(t)];
        f[32] = sk[2];
        f[33] = mean(&sk);
        {
            let lo = min(win(l, t, 14));
            let hi = max(win(h, t, 14));
            f[34] = (hi - c[t]) / (hi - lo + EPS) - 0.5;
        }
        {
            let w = win(&tp, t, 20);
            let m = mean(w);
            let mad = w.iter().map(|x| (x - m).abs()).sum::<f64>() / w.len() as f64;
            f[35] = (tp[t] - m) / (0.015 * mad + EPS) / 100.0;
        }
        f[36] = atr[t] / c[t];
        {
            let (m, s) = mean_std(win(c, t, 20));
            f[37] = (c[t] - (m - 2.0 * s)) / (4.0 * s + EPS) - 0.5;
            f[38] = 4.0 * s / (m + EPS);
        }
        f[39] = r[t] / (f[10] + EPS);
        {
            let (mv, sv) = mean_std(win(v, t, 20));
            f[40] = ((v[t] + 1.0) / (mv + 1.0)).ln();
            f[41] = (v[t] - mv) / (sv + EPS);
            f[42] = sign(r[t]) * (1.0 + v[t] / (mv + EPS)).ln();
        }
        {
            let sv = sum(win(v, t, 20));
            f[43] = if sv == 0.0 { 0.0 } else { (c[t] / (sum(win(&tpv, t, 20)) / (sv + EPS))).ln() };
        }
        {
            let sp = sum(win(&pos, t, 14));
            let sn = sum(win(&neg, t, 14));
            let mfi = 100.0 - 100.0 / (1.0 + sp / (sn + EPS));
            f[44] = mfi / 100.0 - 0.5;
        }
        for (j, k) in [20usize, 60].iter().enumerate() {
            let lo = min(win(l, t, *k));
            let hi = max(win(h, t, *k));
            f[45 + j] = (c[t] - lo) / (hi - lo + EPS);
        }
        {
            let (skew, kurt) = skew_kurt(win(&r, t, 20));
            f[47] = skew;
            f[48] = kurt;
        }
        f[49] = pearson(win(&r, t, 20), win(&r, t - 1, 20));
        {
            let (m, s) = mean_std(win(&hl, t, 20));
            f[50] = (hl[t] - m) / (s + EPS);
        }
        market.extend_from_slice(&f);
        known.extend_from_slice(&calendar(bars.timestamp[t]));
    }
    let logret_next = (WARMUP..n).map(|t| if t + 1 < n { (c[t + 1] / c[t]).ln() } else { 0.0 }).collect();
    Ok(FeaturesF64 {
        market,
        known,
        logret_next,
        close: c[WARMUP..].to_vec(),
        timestamp: bars.timestamp[WARMUP..].to_vec(),
    })
}

/// Computes the features of `bars` and casts them to the stored f32 table.
/// Refuses non-finite results (which valid bars never produce) rather than
/// storing them.
pub fn compute(bars: &Bars, source: &str) -> Result<FeatureTable, Error> {
    let what = Path::new(source);
    let f = compute_f64(bars, what)?;
    let table = FeatureTable {
        market: f.market.iter().map(|&x| x as f32).collect(),
        known: f.known.iter().map(|&x| x as f32).collect(),
        logret_next: f.logret_next.iter().map(|&x| x as f32).collect(),
        close: f.close,
        timestamp: f.timestamp,
        feature_names: MARKET_FEATURE_NAMES.iter().map(|s| s.to_string()).collect(),
        source: source.to_string(),
    };
    table.validate(what)?;
    Ok(table)
}

/// `[sin, cos](2π·seconds_of_day/86400)`, `[sin, cos](2π·day_of_week/7)`, Monday = 0.
pub fn calendar(ts: i64) -> [f64; N_KNOWN] {
    let sod = ts.rem_euclid(86_400) as f64;
    let dow = (ts.div_euclid(86_400) + 3).rem_euclid(7) as f64;
    let a = std::f64::consts::TAU * sod / 86_400.0;
    let b = std::f64::consts::TAU * dow / 7.0;
    [a.sin(), a.cos(), b.sin(), b.cos()]
}

/// Pandas `ewm(alpha, adjust=False)` seeded with the first input.
fn ewm(x: &[f64], alpha: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    let mut s = match x.first() {
        Some(&v) => v,
        None => return out,
    };
    out.push(s);
    for &v in &x[1..] {
        s = alpha * v + (1.0 - alpha) * s;
        out.push(s);
    }
    out
}

/// The window of length `k` ending at (and including) `t`.
fn win(x: &[f64], t: usize, k: usize) -> &[f64] {
    &x[t + 1 - k..=t]
}

fn sum(w: &[f64]) -> f64 {
    w.iter().sum()
}

fn mean(w: &[f64]) -> f64 {
    sum(w) / w.len() as f64
}

fn min(w: &[f64]) -> f64 {
    w.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(w: &[f64]) -> f64 {
    w.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// Two-pass mean and population standard deviation.
fn mean_std(w: &[f64]) -> (f64, f64) {
    let m = mean(w);
    let var = w.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / w.len() as f64;
    (m, var.sqrt())
}

/// Population skewness and excess kurtosis; both 0 when the spread is 0.
fn skew_kurt(w: &[f64]) -> (f64, f64) {
    let m = mean(w);
    let nf = w.len() as f64;
    let (mut m2, mut m3, mut m4) = (0.0, 0.0, 0.0);
    for x in w {
        let d = x - m;
        let d2 = d * d;
        m2 += d2;
        m3 += d2 * d;
        m4 += d2 * d2;
    }
    let (m2, m3, m4) = (m2 / nf, m3 / nf, m4 / nf);
    if m2 == 0.0 {
        return (0.0, 0.0);
    }
    (m3 / m2.powf(1.5), m4 / (m2 * m2) - 3.0)
}

/// Pearson correlation with population moments; 0 when either spread is 0.
fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let (mx, sx) = mean_std(x);
    let (my, sy) = mean_std(y);
    if sx == 0.0 || sy == 0.0 {
        return 0.0;
    }
    let cov = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum::<f64>() / x.len() as f64;
    cov / (sx * sy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feature_file::FeatureStore;
    use std::path::PathBuf;

    fn shared(p: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")).join(p)
    }

    #[test]
    fn reproduces_fixture() {
        let bars = Bars::from_csv_path(&shared("fixtures/features_small.csv")).unwrap();
        let ours = compute(&bars, "features_small.csv").unwrap();
        let want = FeatureStore::open(&shared("fixtures/features_small.safetensors")).unwrap();
        assert_eq!(ours.rows(), want.rows());
        assert_eq!(ours.feature_names, want.feature_names());
        assert_eq!(ours.timestamp, want.timestamps());
        assert_eq!(ours.close, want.close());
        let rows = ours.rows();
        let check = |name: &str, a: &[f32], b: &[f32], width: usize| {
            let mut worst = Vec::new();
            for j in 0..width {
                let col = |x: &[f32]| (0..rows).map(|i| x[i * width + j] as f64).collect::<Vec<_>>();
                let (ca, cb) = (col(a), col(b));
                let scale = cb.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
                let err = ca.iter().zip(&cb).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
                worst.push((err, j));
            }
            let bad: Vec<_> = worst.iter().filter(|(e, _)| *e > 1e-5).collect();
            assert!(bad.is_empty(), "{name}: columns over 1e-5 relative error: {bad:?}");
        };
        check("market", &ours.market, want.market(), N_MARKET);
        check("known", &ours.known, want.known(), N_KNOWN);
        check("logret_next", &ours.logret_next, want.logret_next(), 1);
    }

    #[test]
    fn real_data_gives_finite_features() {
        for name in ["aapl", "ibm", "msft"] {
            let p = shared(&format!("data/{name}_daily_2000_2013.csv"));
            let bars = Bars::from_csv_path(&p).unwrap();
            let t = compute(&bars, name).unwrap(); // validates finiteness
            assert_eq!(t.rows(), 3270 - WARMUP);
            assert_eq!(t.logret_next[t.rows() - 1], 0.0);
        }
    }

    fn flat_bars(n: usize) -> Bars {
        Bars {
            timestamp: (0..n as i64).map(|i| i * 3600).collect(),
            open: vec![1.5; n],
            high: vec![1.5; n],
            low: vec![1.5; n],
            close: vec![1.5; n],
            volume: vec![0.0; n],
        }
    }

    #[test]
    fn flat_market_gives_exact_zeros() {
        // Identical windows must give exactly zero spread (two-pass, no residue).
        let f = compute_f64(&flat_bars(150), Path::new("flat")).unwrap();
        for row in f.market.chunks(N_MARKET) {
            for (j, &x) in row.iter().enumerate() {
                let expect = match MARKET_FEATURE_NAMES[j] {
                    // (c - min)/(range + eps) - 0.5 with c = min
                    "stoch_k" | "stoch_d" | "williams_r" | "bb_pctb" | "rsi_14" | "rsi_6" | "mfi" => -0.5,
                    _ => 0.0,
                };
                assert_eq!(x, expect, "{}", MARKET_FEATURE_NAMES[j]);
            }
        }
    }

    #[test]
    fn calendar_reference_points() {
        // 1970-01-01 was a Thursday (day 3 with Monday = 0); 2024-01-01 a Monday.
        let k = calendar(0);
        assert_eq!(k[0], 0.0);
        assert_eq!(k[1], 1.0);
        assert!((k[2] - (std::f64::consts::TAU * 3.0 / 7.0).sin()).abs() < 1e-15);
        let k = calendar(1704067200 + 6 * 3600);
        assert!((k[0] - 1.0).abs() < 1e-15 && k[1].abs() < 1e-15);
        assert_eq!((k[2], k[3]), (0.0, 1.0));
        let k = calendar(-86400); // Wednesday
        assert!((k[2] - (std::f64::consts::TAU * 2.0 / 7.0).sin()).abs() < 1e-15);
    }

    #[test]
    fn ewm_matches_definition() {
        let x = [3.0, 1.0, 4.0, 1.0, 5.0];
        let e = ewm(&x, 0.25);
        let mut s = 3.0;
        assert_eq!(e[0], 3.0);
        for i in 1..5 {
            s = 0.25 * x[i] + 0.75 * s;
            assert_eq!(e[i], s);
        }
    }
}
