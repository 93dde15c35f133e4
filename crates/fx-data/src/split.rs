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

/// Walk-forward evaluation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WalkForwardConfig {
    /// Number of folds.
    pub folds: usize,
    /// Fraction of rows in the first fold's training window.
    pub initial_train: f64,
    /// Expanding training window (true) or rolling of fixed length (false).
    pub expanding: bool,
    /// Rows skipped between a fold's training and test ranges (purging, so
    /// look-back windows of the test rows do not overlap training targets).
    pub gap: usize,
}

impl Default for WalkForwardConfig {
    fn default() -> Self {
        WalkForwardConfig { folds: 5, initial_train: 0.5, expanding: true, gap: 0 }
    }
}

/// One walk-forward fold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fold {
    /// Training rows (all before `test`).
    pub train: Range<usize>,
    /// Test rows; the test ranges of successive folds tile the rows after
    /// the initial training window (minus the gaps).
    pub test: Range<usize>,
}

impl WalkForwardConfig {
    /// The folds over `rows` rows.
    pub fn folds(&self, rows: usize) -> Result<Vec<Fold>, Error> {
        if self.folds == 0 || !(self.initial_train > 0.0 && self.initial_train < 1.0) {
            return Err(Error::config("walk-forward", "folds must be > 0 and initial_train in (0, 1)".to_string()));
        }
        let first = (rows as f64 * self.initial_train).floor() as usize;
        let rest = rows - first;
        let step = rest / self.folds;
        if first == 0 || step <= self.gap {
            return Err(Error::config(
                "walk-forward",
                format!("{rows} rows are too few for {} folds (gap {})", self.folds, self.gap),
            ));
        }
        Ok((0..self.folds)
            .map(|i| {
                let train_end = first + i * step;
                let test_end = if i + 1 == self.folds { rows } else { train_end + step };
                let train_start = if self.expanding { 0 } else { train_end - first };
                Fold { train: train_start..train_end, test: train_end + self.gap..test_end }
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
        let f = WalkForwardConfig { folds: 3, initial_train: 0.4, expanding: false, gap: 2 }.folds(100).unwrap();
        assert_eq!(f[0], Fold { train: 0..40, test: 42..60 });
        assert_eq!(f[1], Fold { train: 20..60, test: 62..80 });
        assert_eq!(f[2], Fold { train: 40..80, test: 82..100 });
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
        fn folds_never_look_ahead(rows in 50usize..10_000, k in 1usize..6, exp in any::<bool>(), gap in 0usize..3) {
            let folds = WalkForwardConfig { folds: k, initial_train: 0.5, expanding: exp, gap }.folds(rows).unwrap();
            prop_assert_eq!(folds.len(), k);
            for (i, f) in folds.iter().enumerate() {
                prop_assert!(!f.train.is_empty() && !f.test.is_empty());
                prop_assert!(f.train.end + gap == f.test.start);
                if i > 0 { prop_assert_eq!(folds[i - 1].test.end, f.train.end); }
            }
            prop_assert_eq!(folds[k - 1].test.end, rows);
        }
    }
}
