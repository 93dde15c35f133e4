//! Per-feature z-score normalisation, clipped to ±10, fitted on the training
//! rows only (DATA.md: never on validation or test rows) and serialisable so
//! it travels with checkpoints (serde, or a flat `[2, F]` f32 tensor).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::feature_file::FeatureStore;

/// The clip bound on normalised values.
pub const CLIP: f32 = 10.0;

/// Per-feature mean and standard deviation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Normalizer {
    /// Per-feature mean.
    pub mean: Vec<f32>,
    /// Per-feature population standard deviation (1 where the feature was
    /// constant on the training rows, so it maps to 0 instead of dividing by 0).
    pub std: Vec<f32>,
    /// Clip bound (±).
    pub clip: f32,
}

impl Normalizer {
    /// Fits on the market features of `train` rows of `store` only.
    pub fn fit(store: &FeatureStore, train: Range<usize>) -> Result<Self, Error> {
        if train.end > store.rows() {
            return Err(Error::config(
                "normalisation rows",
                format!("{train:?} exceeds the {} rows of {}", store.rows(), store.path().display()),
            ));
        }
        Self::fit_rows(store.market(), store.n_market(), train)
    }

    /// Fits on rows `train` of a row-major `[rows, width]` matrix, in f64 with
    /// two passes (mean, then deviations).
    pub fn fit_rows(data: &[f32], width: usize, train: Range<usize>) -> Result<Self, Error> {
        if width == 0 || !data.len().is_multiple_of(width) || train.end * width > data.len() {
            return Err(Error::config(
                "normalisation rows",
                format!("{train:?} of a [{}, {width}] matrix", data.len() / width.max(1)),
            ));
        }
        if train.is_empty() {
            return Err(Error::config("normalisation rows", "the training range is empty"));
        }
        let rows = &data[train.start * width..train.end * width];
        let n = train.len() as f64;
        let mut mean = vec![0.0f64; width];
        for row in rows.chunks_exact(width) {
            for (m, &x) in mean.iter_mut().zip(row) {
                *m += x as f64;
            }
        }
        mean.iter_mut().for_each(|m| *m /= n);
        let mut var = vec![0.0f64; width];
        for row in rows.chunks_exact(width) {
            for ((v, m), &x) in var.iter_mut().zip(&mean).zip(row) {
                let d = x as f64 - m;
                *v += d * d;
            }
        }
        let std = var
            .iter()
            .map(|v| {
                let s = (v / n).sqrt() as f32;
                if s > 0.0 && s.is_finite() {
                    s
                } else {
                    1.0
                }
            })
            .collect();
        let norm = Normalizer { mean: mean.iter().map(|&m| m as f32).collect(), std, clip: CLIP };
        norm.check()?;
        Ok(norm)
    }

    /// Number of features.
    pub fn width(&self) -> usize {
        self.mean.len()
    }

    /// Normalises one row: `dst[j] = clamp((src[j] − mean[j]) / std[j], ±clip)`.
    pub fn apply_row(&self, src: &[f32], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), self.width());
        for (((d, &x), &m), &s) in dst.iter_mut().zip(src).zip(&self.mean).zip(&self.std) {
            *d = ((x - m) / s).clamp(-self.clip, self.clip);
        }
    }

    /// Normalises a row-major `[rows, width]` slice in place.
    pub fn apply_in_place(&self, data: &mut [f32]) {
        for row in data.chunks_exact_mut(self.width()) {
            for ((x, &m), &s) in row.iter_mut().zip(&self.mean).zip(&self.std) {
                *x = ((*x - m) / s).clamp(-self.clip, self.clip);
            }
        }
    }

    /// The flat checkpoint form: `[2, F]` row-major (means, then stds); the
    /// clip bound is the fixed [`CLIP`].
    pub fn to_flat(&self) -> Vec<f32> {
        let mut v = self.mean.clone();
        v.extend_from_slice(&self.std);
        v
    }

    /// The checkpoint form as a tensor pair `(mean [F], std [F])`.
    pub fn to_pair(&self) -> (Vec<f32>, Vec<f32>) {
        (self.mean.clone(), self.std.clone())
    }

    /// Reads the tensor pair back (validated); the clip bound is [`CLIP`].
    pub fn from_pair(mean: &[f32], std: &[f32]) -> Result<Self, Error> {
        let n = Normalizer { mean: mean.to_vec(), std: std.to_vec(), clip: CLIP };
        n.check()?;
        Ok(n)
    }

    /// Reads the flat `[2, F]` form back (validated).
    pub fn from_flat(flat: &[f32]) -> Result<Self, Error> {
        if flat.is_empty() || !flat.len().is_multiple_of(2) {
            return Err(Error::config("normaliser tensor", format!("{} values, expected [2, F]", flat.len())));
        }
        let f = flat.len() / 2;
        let n = Normalizer { mean: flat[..f].to_vec(), std: flat[f..].to_vec(), clip: CLIP };
        n.check()?;
        Ok(n)
    }

    /// Checks lengths, finiteness and positive stds (e.g. after deserialising).
    pub fn check(&self) -> Result<(), Error> {
        let ok = !self.mean.is_empty()
            && self.mean.len() == self.std.len()
            && self.mean.iter().all(|m| m.is_finite())
            && self.std.iter().all(|s| s.is_finite() && *s > 0.0)
            && self.clip > 0.0;
        if ok {
            Ok(())
        } else {
            Err(Error::config("normaliser", "needs equal-length finite means and positive finite stds".to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use proptest::prelude::*;

    #[test]
    fn fits_train_rows_only() {
        // Train rows ~ N(5, 2); later rows are wildly different and must not leak in.
        let mut rng = Rng::new(1);
        let (w, rows, train) = (3, 2000, 1500);
        let data: Vec<f32> =
            (0..rows * w).map(|i| if i / w < train { (5.0 + 2.0 * rng.normal()) as f32 } else { 1e6 }).collect();
        let n = Normalizer::fit_rows(&data, w, 0..train).unwrap();
        for j in 0..w {
            assert!((n.mean[j] - 5.0).abs() < 0.2 && (n.std[j] - 2.0).abs() < 0.2, "{n:?}");
        }
        let mut out = data.clone();
        n.apply_in_place(&mut out);
        assert!(out[train * w..].iter().all(|&x| x == CLIP), "clipped at +10");
    }

    #[test]
    fn constant_feature_maps_to_zero() {
        let data = vec![3.0f32; 40];
        let n = Normalizer::fit_rows(&data, 4, 0..10).unwrap();
        assert_eq!(n.std, vec![1.0; 4]);
        let mut d = [0.0; 4];
        n.apply_row(&data[..4], &mut d);
        assert_eq!(d, [0.0; 4]);
    }

    #[test]
    fn serialisation_roundtrips() {
        let n = Normalizer { mean: vec![1.0, -2.0], std: vec![0.5, 3.0], clip: CLIP };
        assert_eq!(Normalizer::from_flat(&n.to_flat()).unwrap(), n);
        let (m, s) = n.to_pair();
        assert_eq!(Normalizer::from_pair(&m, &s).unwrap(), n);
        assert!(Normalizer::from_pair(&m, &s[..1]).is_err());
        let json = serde_json::to_string(&n).unwrap();
        assert_eq!(serde_json::from_str::<Normalizer>(&json).unwrap(), n);
        assert!(Normalizer::from_flat(&[1.0, 0.0]).is_err());
        assert!(Normalizer::from_flat(&[1.0, 2.0, 3.0]).is_err());
        assert!(Normalizer::from_flat(&[f32::NAN, 1.0]).is_err());
    }

    proptest! {
        #[test]
        fn matches_f64_reference(seed in 0u64..1000, w in 1usize..6, rows in 2usize..50, scale in 0.001f64..1000.0) {
            let mut rng = Rng::new(seed);
            let data: Vec<f32> = (0..rows * w).map(|_| (scale * rng.normal() + scale) as f32).collect();
            let train = 0..rows / 2 + 1;
            let n = Normalizer::fit_rows(&data, w, train.clone()).unwrap();
            let mut out = data.clone();
            n.apply_in_place(&mut out);
            for j in 0..w {
                let col: Vec<f64> = train.clone().map(|i| data[i * w + j] as f64).collect();
                let m = col.iter().sum::<f64>() / col.len() as f64;
                let s = (col.iter().map(|x| (x - m).powi(2)).sum::<f64>() / col.len() as f64).sqrt();
                let s = if s as f32 > 0.0 { s } else { 1.0 };
                for i in 0..rows {
                    let want = ((data[i * w + j] as f64 - m) / s).clamp(-10.0, 10.0);
                    let got = out[i * w + j] as f64;
                    prop_assert!(got.is_finite());
                    // Mean and std are stored in f32: rounding the mean moves every value by
                    // up to its ulp over std, which dominates when a column's spread is tiny
                    // against its level (seed 978: two nearly equal values ~0.001 apart by
                    // ~1e-7 gave 1.0008 vs 1).
                    let x = data[i * w + j] as f64;
                    let f32_bound = 4.0 * f32::EPSILON as f64 * (x.abs() + m.abs()) / s;
                    let tol = 1e-4 * (1.0 + want.abs()) + f32_bound;
                    prop_assert!((got - want).abs() <= tol, "{} vs {} (tolerance {})", got, want, tol);
                }
            }
        }
    }
}
