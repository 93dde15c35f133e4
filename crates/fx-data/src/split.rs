//! Chronological splits (DATA.md default 70/15/15, never shuffled across time)
//! and walk-forward folds, as ranges of feature-table rows.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Train/validation/test fractions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SplitConfig {
    /// Fraction of rows for training (first in time).
    pub train: f64,
    /// Fraction for validation (after training).
    pub valid: f64,
    /// Fraction for test (last).
    pub test: f64,
}

impl Default for SplitConfig {
    fn default() -> Self {
        SplitConfig { train: 0.70, valid: 0.15, test: 0.15 }
    }
}

/// Row ranges of the three splits; contiguous and in time order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Splits {
    /// Training rows.
    pub train: Range<usize>,
    /// Validation rows.
    pub valid: Range<usize>,
    /// Test rows.
    pub test: Range<usize>,
}

impl SplitConfig {
    /// Splits `rows` rows: `train = [0, ⌊rows·train⌋)`, validation up to
    /// `⌊rows·(train+valid)⌋`, test the rest. Fractions must be ≥ 0, sum to 1,
    /// and every split with a positive fraction must get at least one row.
    pub fn split(&self, rows: usize) -> Result<Splits, Error> {
        let fr = [self.train, self.valid, self.test];
        if fr.iter().any(|f| !(f.is_finite() && *f >= 0.0)) || (fr.iter().sum::<f64>() - 1.0).abs() > 1e-9 {
            return Err(Error::config("split fractions", format!("{fr:?} must be >= 0 and sum to 1")));
        }
        let a = ((rows as f64 * self.train).floor() as usize).min(rows);
        let b = ((rows as f64 * (self.train + self.valid)).floor() as usize).clamp(a, rows);
        let s = Splits { train: 0..a, valid: a..b, test: b..rows };
        for (f, r, name) in
            [(self.train, &s.train, "train"), (self.valid, &s.valid, "valid"), (self.test, &s.test, "test")]
        {
            if f > 0.0 && r.is_empty() {
                return Err(Error::config("split fractions", format!("{rows} rows leave the {name} split empty")));
            }
        }
        Ok(s)
    }
}

/// How a walk-forward fold's training span moves from one fold to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Window {
    /// Every fold trains from the first row (the span grows).
    #[default]
    Expanding,
    /// Every fold trains on as many rows as the first fold (the span slides).
    Rolling,
}

impl std::str::FromStr for Window {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "expanding" => Ok(Window::Expanding),
            "rolling" => Ok(Window::Rolling),
            _ => Err(Error::config("walk-forward window", format!("{s:?} is not expanding or rolling"))),
        }
    }
}

/// Walk-forward settings: `folds` train → validation → test spans in time order.
///
/// The `folds` test spans lie at the end of the rows, one after another, `embargo` rows
/// apart, together `test` of all rows; each fold's validation span (`valid` of all rows)
/// ends `purge` rows before its test span and its training span ends `purge` rows before
/// the validation span. The purge must cover the longest look-back plus the forecast
/// horizon (the caller knows them: [`WalkForwardConfig::folds`] takes that minimum), so
/// no window of a later span reaches back into an earlier one's rows or targets; the
/// embargo keeps each test span's last rows out of the next fold's scored rows. Folds
/// are ranges of one table: a fold is a view, never a copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WalkForwardConfig {
    /// Number of folds.
    pub folds: usize,
    /// Expanding or rolling training span.
    pub window: Window,
    /// Fraction of all rows covered by the test spans together.
    pub test: f64,
    /// Fraction of all rows in each fold's validation span.
    pub valid: f64,
    /// Rows left out between training and validation and between validation and test;
    /// `None` takes the minimum the caller gives.
    pub purge: Option<usize>,
    /// Rows between one fold's test span and the next fold's.
    pub embargo: usize,
}

impl Default for WalkForwardConfig {
    fn default() -> Self {
        WalkForwardConfig { folds: 3, window: Window::Expanding, test: 0.3, valid: 0.1, purge: None, embargo: 0 }
    }
}

/// One walk-forward fold: three spans in time order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fold {
    /// Training rows.
    pub train: Range<usize>,
    /// Validation rows (model selection and early stopping).
    pub valid: Range<usize>,
    /// Test rows (scored once).
    pub test: Range<usize>,
}

impl WalkForwardConfig {
    /// The folds over `rows` rows, with a purge of at least `min_purge` rows (the longest
    /// look-back plus the forecast horizon). An explicit `purge` below that is refused
    /// rather than raised in silence.
    pub fn folds(&self, rows: usize, min_purge: usize) -> Result<Vec<Fold>, Error> {
        let what = "walk-forward";
        if self.folds == 0 {
            return Err(Error::config(what, "folds must be at least 1".to_string()));
        }
        for (name, f) in [("test", self.test), ("valid", self.valid)] {
            if !(f.is_finite() && f > 0.0 && f < 1.0) {
                return Err(Error::config(what, format!("{name} fraction {f} must be in (0, 1)")));
            }
        }
        if self.test + self.valid >= 1.0 {
            return Err(Error::config(
                what,
                format!("test {} + valid {} leave no training rows", self.test, self.valid),
            ));
        }
        let purge = self.purge.unwrap_or(min_purge);
        if purge < min_purge {
            return Err(Error::config(
                what,
                format!("purge {purge} rows is shorter than the {min_purge} the look-back and horizon need"),
            ));
        }
        let k = self.folds;
        let t = (rows as f64 * self.test / k as f64).floor() as usize;
        let v = (rows as f64 * self.valid).floor() as usize;
        let too_few = || {
            Error::config(
                what,
                format!(
                    "{rows} rows are too few for {k} folds of {t} test and {v} validation rows, purge {purge}, embargo {}",
                    self.embargo
                ),
            )
        };
        if t == 0 || v == 0 {
            return Err(too_few());
        }
        // First test span's start; then the first training span's end, which must leave a row.
        let tests =
            k.checked_mul(t).and_then(|x| x.checked_add((k - 1).checked_mul(self.embargo)?)).ok_or_else(too_few)?;
        let s0 = rows.checked_sub(tests).ok_or_else(too_few)?;
        let first_train = s0.checked_sub(2 * purge + v).filter(|&n| n > 0).ok_or_else(too_few)?;
        Ok((0..k)
            .map(|i| {
                let s = s0 + i * (t + self.embargo);
                let valid = s - purge - v..s - purge;
                let end = valid.start - purge;
                let start = match self.window {
                    Window::Expanding => 0,
                    Window::Rolling => end - first_train,
                };
                Fold { train: start..end, valid, test: s..s + t }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_split() {
        let s = SplitConfig::default().split(1000).unwrap();
        assert_eq!(s, Splits { train: 0..700, valid: 700..850, test: 850..1000 });
        assert!(SplitConfig::default().split(3).is_err());
        assert!(SplitConfig { train: 0.8, valid: 0.3, test: 0.0 }.split(100).is_err());
        let s = SplitConfig { train: 0.9, valid: 0.1, test: 0.0 }.split(10).unwrap();
        assert_eq!(s.test, 10..10);
    }

    #[test]
    fn walk_forward_rolling() {
        let cfg = WalkForwardConfig { window: Window::Rolling, purge: Some(2), embargo: 1, ..Default::default() };
        let f = cfg.folds(100, 2).unwrap();
        // 3 test spans of 10 rows, 1 apart, end at row 100; validation 10 rows, purge 2.
        assert_eq!(f[0], Fold { train: 0..54, valid: 56..66, test: 68..78 });
        assert_eq!(f[1], Fold { train: 11..65, valid: 67..77, test: 79..89 });
        assert_eq!(f[2], Fold { train: 22..76, valid: 78..88, test: 90..100 });
        let e = WalkForwardConfig::default().folds(100, 5).unwrap();
        assert_eq!(e[2], Fold { train: 0..70, valid: 75..85, test: 90..100 });
        let short = WalkForwardConfig { purge: Some(1), ..Default::default() }.folds(100, 5).unwrap_err();
        assert!(short.to_string().contains("purge 1 rows is shorter than the 5"), "{short}");
        let few = WalkForwardConfig { folds: 40, ..Default::default() }.folds(100, 5).unwrap_err();
        assert!(few.to_string().contains("100 rows are too few for 40 folds"), "{few}");
        assert!(WalkForwardConfig { test: 0.7, valid: 0.3, ..Default::default() }.folds(1000, 0).is_err());
        assert_eq!("rolling".parse::<Window>().unwrap(), Window::Rolling);
        assert!("sliding".parse::<Window>().is_err());
    }

    proptest! {
        #[test]
        fn splits_tile_in_order(rows in 20usize..100_000, t in 0.1f64..0.8) {
            let v = (1.0 - t) / 2.0;
            let s = SplitConfig { train: t, valid: v, test: 1.0 - t - v }.split(rows).unwrap();
            prop_assert_eq!(s.train.start, 0);
            prop_assert_eq!(s.train.end, s.valid.start);
            prop_assert_eq!(s.valid.end, s.test.start);
            prop_assert_eq!(s.test.end, rows);
        }

        #[test]
        fn folds_never_look_ahead(
            rows in 30usize..20_000,
            k in 1usize..8,
            rolling in any::<bool>(),
            min_purge in 0usize..40,
            extra in 0usize..5,
            embargo in 0usize..20,
            test in 0.05f64..0.6,
            valid in 0.02f64..0.3,
        ) {
            let window = if rolling { Window::Rolling } else { Window::Expanding };
            let purge = min_purge + extra;
            let cfg = WalkForwardConfig { folds: k, window, test, valid, purge: Some(purge), embargo };
            let Ok(folds) = cfg.folds(rows, min_purge) else { return Ok(()) };
            prop_assert_eq!(folds.len(), k);
            for (i, f) in folds.iter().enumerate() {
                prop_assert!(!f.train.is_empty() && !f.valid.is_empty() && !f.test.is_empty());
                // No training row later than the validation start minus the purge; spans apart by it.
                prop_assert_eq!(f.train.end + purge, f.valid.start);
                prop_assert_eq!(f.valid.end + purge, f.test.start);
                prop_assert!(purge >= min_purge);
                if i > 0 {
                    let p = &folds[i - 1];
                    prop_assert_eq!(p.test.end + embargo, f.test.start);
                    prop_assert_eq!(p.test.len(), f.test.len());
                    prop_assert_eq!(p.train.len() <= f.train.len(), true);
                    if rolling { prop_assert_eq!(p.train.len(), f.train.len()); }
                }
                if !rolling { prop_assert_eq!(f.train.start, 0); }
            }
            prop_assert_eq!(folds[k - 1].test.end, rows);
        }

        #[test]
        fn enough_rows_always_give_folds(k in 1usize..6, min_purge in 0usize..30, embargo in 0usize..10) {
            // 0.3 of the rows over k test spans and 0.1 validation: rows big enough always work.
            let rows = 100 * (k + 1) * (min_purge + embargo + 10);
            let cfg = WalkForwardConfig { folds: k, embargo, ..Default::default() };
            prop_assert!(cfg.folds(rows, min_purge).is_ok());
        }
    }
}
