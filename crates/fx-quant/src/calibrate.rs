//! Calibration: each layer's input scale from the F32 network run over observations.
//!
//! Inputs are quantised per tensor and symmetrically, `q = clamp(round(x / s), −127, 127)`
//! with `s = bound / 127`, so one number per layer is needed: the bound.
//! - `minmax`: the largest `|x|` seen (nothing clips on the calibration rows);
//! - `percentile`: the `p`-th percentile of `|x|` (default 99.99): a few outliers clip, the
//!   rest get a finer step;
//! - `dynamic`: each decision takes the bound from its own input, `max |x|` of that layer's
//!   input vector (as PyTorch's dynamic quantisation does), so nothing ever clips and small
//!   inputs keep their resolution; the calibrated min-max scales are still recorded.

use std::fmt;

use crate::error::{first_non_finite, Error, Result};
use crate::float_net::FloatNet;

/// The `calibration_method` of dynamic input scales.
pub(crate) const DYNAMIC: &str = "dynamic";

/// How a layer's input bound is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CalibMethod {
    /// The largest absolute input.
    MinMax,
    /// This percentile (in `(0, 100]`) of the absolute inputs.
    Percentile(f64),
    /// Each call's own largest absolute input, per layer (min-max scales recorded).
    Dynamic,
}

impl CalibMethod {
    /// The default percentile.
    pub const DEFAULT_PERCENTILE: f64 = 99.99;

    /// `minmax` or `percentile` (the checkpoint's `calibration_method` metadata).
    pub fn name(self) -> &'static str {
        match self {
            CalibMethod::MinMax => "minmax",
            CalibMethod::Percentile(_) => "percentile",
            CalibMethod::Dynamic => DYNAMIC,
        }
    }

    pub(crate) fn check(self) -> Result<()> {
        match self {
            CalibMethod::Percentile(p) if !(p > 0.0 && p <= 100.0) => {
                Err(Error::invalid("calibration percentile", format!("{p} is not in (0, 100]")))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for CalibMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalibMethod::MinMax => write!(f, "minmax"),
            CalibMethod::Percentile(p) => write!(f, "percentile({p})"),
            CalibMethod::Dynamic => write!(f, "dynamic"),
        }
    }
}

/// The input scale of every layer of `net` (in layer order) from `obs`, `rows × state_dim`
/// values (at least one row, all finite).
pub fn input_scales(net: &FloatNet, obs: &[f32], method: CalibMethod) -> Result<Vec<f32>> {
    method.check()?;
    let d = net.state_dim();
    if obs.is_empty() || !obs.len().is_multiple_of(d) {
        return Err(Error::Length {
            what: "calibration observations",
            expected: d.max(1) * (obs.len() / d.max(1)).max(1),
            got: obs.len(),
            context: "calibrate::input_scales",
        });
    }
    if let Some((index, value)) = first_non_finite(obs) {
        return Err(Error::NonFinite {
            what: "calibration observations".into(),
            index,
            value: value as f64,
            context: "calibrate::input_scales",
        });
    }
    let mut stats: Vec<InputStats> = net.layers.iter().map(|_| InputStats::new(method, None)).collect();
    for row in obs.chunks_exact(d) {
        net.forward_f64(row, |layer, x| stats[layer].observe_row(x));
    }
    stats.iter_mut().map(|s| s.scale(method)).collect()
}

/// The running record of one layer's inputs that its input scale comes from: the largest
/// `|x|`, and for percentiles the `|x|` values themselves: all of them, or with a cap a sample
/// of whole input rows (every row until the cap, then every second row, and so on:
/// deterministic, and every feature of a row is sampled alike, which thinning single values
/// of a row-major stream would not do).
#[derive(Debug, Clone)]
pub(crate) struct InputStats {
    absmax: f64,
    kept: Option<Vec<f32>>,
    cap: Option<usize>,
    every: u64,
    rows_seen: u64,
}

impl InputStats {
    /// A record for `method`, keeping at most about `cap` values for a percentile (None: all).
    pub(crate) fn new(method: CalibMethod, cap: Option<usize>) -> Self {
        let kept = matches!(method, CalibMethod::Percentile(_)).then(Vec::new);
        Self { absmax: 0.0, kept, cap, every: 1, rows_seen: 0 }
    }

    /// Adds one input row.
    pub(crate) fn observe_row<T: Copy + Into<f64>>(&mut self, row: &[T]) {
        for &v in row {
            self.absmax = self.absmax.max(v.into().abs());
        }
        let Some(kept) = self.kept.as_mut() else { return };
        if self.rows_seen.is_multiple_of(self.every) {
            kept.extend(row.iter().map(|&v| v.into().abs() as f32));
            if !row.is_empty() && self.cap.is_some_and(|c| kept.len() >= c.max(2 * row.len())) {
                // Keep every second kept row, from now on every second row of `every`.
                let w = row.len();
                let rows = kept.len() / w;
                for r in 1..rows.div_ceil(2) {
                    kept.copy_within(2 * r * w..(2 * r + 1) * w, r * w);
                }
                kept.truncate(rows.div_ceil(2) * w);
                self.every *= 2;
            }
        }
        self.rows_seen += 1;
    }

    /// The input scale, `bound / 127`: the bound is the largest `|x|` (`minmax`, `dynamic`)
    /// or the percentile of the kept values. A layer that only ever saw zeros (a dead ReLU
    /// layer) gets step 1: any positive scale quantises zeros exactly, and the file must hold
    /// a positive scale. A non-finite bound (an overflowing activation) is an error.
    pub(crate) fn scale(&mut self, method: CalibMethod) -> Result<f32> {
        let bound = match (method, self.kept.as_mut()) {
            (CalibMethod::Percentile(p), Some(v)) if !v.is_empty() => {
                // The smallest value with at least p % of the values at or below it.
                let k = ((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
                let (_, nth, _) = v.select_nth_unstable_by(k, f32::total_cmp);
                f64::from(*nth)
            }
            _ => self.absmax,
        };
        if !bound.is_finite() || !((bound / 127.0) as f32).is_finite() {
            return Err(Error::invalid("calibration", format!("an input of magnitude {bound} (not finite in F32)")));
        }
        Ok(if bound > 0.0 { (bound / 127.0) as f32 } else { 1.0 })
    }
}

/// `obs` rows (`rows × width`) reduced to at most `n` rows spread evenly over them (in
/// order), for a calibration set of a chosen size.
pub fn spread_rows(obs: &[f32], width: usize, n: usize) -> Vec<f32> {
    let rows = obs.len() / width.max(1);
    if rows <= n {
        return obs[..rows * width].to_vec();
    }
    (0..n).flat_map(|k| obs[(k * rows / n) * width..(k * rows / n + 1) * width].iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float_net::{FloatLayer, PolicyKind};

    fn tiny_ppo() -> FloatNet {
        let l = |name: &str, out: usize, inp: usize, v: f32| FloatLayer {
            name: name.into(),
            out,
            inp,
            weight: (0..out * inp).map(|i| v * if i % 3 == 0 { -1.0 } else { 0.5 }).collect(),
            bias: vec![0.0; out],
        };
        FloatNet {
            kind: PolicyKind::Ppo,
            layers: vec![l("actor.0", 4, 2, 1.0), l("actor.1", 4, 4, 0.3), l("actor.head", 3, 4, 0.2)],
        }
    }

    #[test]
    fn minmax_is_the_largest_input_and_percentile_clips_outliers() {
        let net = tiny_ppo();
        let mut obs: Vec<f32> = (0..1000).flat_map(|i| [(i % 10) as f32 * 0.1, -0.5]).collect();
        obs[0] = 50.0; // one outlier in the first layer's input
        let mm = input_scales(&net, &obs, CalibMethod::MinMax).unwrap();
        assert_eq!(mm[0], (50.0f64 / 127.0) as f32);
        // Hidden tanh outputs are within 1.
        assert!(mm[1] <= 1.0 / 127.0 + 1e-9 && mm[2] <= 1.0 / 127.0 + 1e-9);
        let pc = input_scales(&net, &obs, CalibMethod::Percentile(99.0)).unwrap();
        assert!((pc[0] - 0.9 / 127.0).abs() < 1e-6, "{}", pc[0]);
        assert!(pc.iter().zip(&mm).all(|(p, m)| p <= m && *p > 0.0));
        assert_eq!(input_scales(&net, &obs, CalibMethod::Percentile(100.0)).unwrap(), mm);
    }

    #[test]
    fn bad_calibration_inputs_are_one_line_errors() {
        let net = tiny_ppo();
        for (obs, method, want) in [
            (vec![], CalibMethod::MinMax, "calibration observations"),
            (vec![1.0, 2.0, 3.0], CalibMethod::MinMax, "expected"),
            (vec![1.0, f32::NAN], CalibMethod::MinMax, "non-finite"),
            (vec![1.0, 2.0], CalibMethod::Percentile(0.0), "percentile"),
            (vec![1.0, 2.0], CalibMethod::Percentile(f64::NAN), "percentile"),
        ] {
            let e = input_scales(&net, &obs, method).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{e}");
        }
        let zeros = input_scales(&net, &[0.0; 8], CalibMethod::MinMax).unwrap();
        assert!(zeros.iter().all(|&s| s == 1.0), "{zeros:?}");
    }

    #[test]
    fn spread_rows_takes_evenly_spaced_rows() {
        let obs: Vec<f32> = (0..20).map(|i| i as f32).collect();
        assert_eq!(spread_rows(&obs, 2, 5), vec![0.0, 1.0, 4.0, 5.0, 8.0, 9.0, 12.0, 13.0, 16.0, 17.0]);
        assert_eq!(spread_rows(&obs, 2, 50).len(), 20);
    }

    /// A capped record keeps whole rows: every column of a row-major stream is sampled (a
    /// column-dependent input gives the same percentile as the full record's, to the
    /// thinning's resolution), the maximum is exact, and the kept values stay under the cap.
    #[test]
    fn capped_percentile_samples_whole_rows() {
        let (width, rows) = (128usize, 4000usize);
        // Column c holds values up to c + 1: the 99th percentile is set by the wide columns.
        let value = |r: usize, c: usize| ((r * 7919 + c * 104729) % 1000) as f32 / 1000.0 * (c + 1) as f32;
        let method = CalibMethod::Percentile(99.0);
        let (mut full, mut capped) = (InputStats::new(method, None), InputStats::new(method, Some(1 << 14)));
        for r in 0..rows {
            let row: Vec<f32> = (0..width).map(|c| value(r, c)).collect();
            full.observe_row(&row);
            capped.observe_row(&row);
        }
        assert!(capped.kept.as_ref().unwrap().len() <= 1 << 14);
        assert_eq!(capped.absmax, full.absmax);
        let (f, c) = (full.scale(method).unwrap(), capped.scale(method).unwrap());
        assert!((f - c).abs() <= 0.02 * f, "full {f}, capped {c}");
        let mut inf = InputStats::new(CalibMethod::MinMax, None);
        inf.observe_row(&[1.0f64, f64::INFINITY]);
        assert!(inf.scale(CalibMethod::MinMax).unwrap_err().to_string().contains("not finite"));
    }
}
