//! A feature series ([`SeqSeries`]) and the batches drawn from it: [`SeqBatch`], the
//! next-bar column of a window ([`NextBar`]) and the seeded window sampler.

use std::ops::Range;

use candle_core::Tensor;

use crate::error::{Error, Result};

/// A feature series: per row `n_observed` market features, `n_known` calendar
/// features and the target, the log-return from this row to the next.
#[derive(Debug, Clone)]
pub struct SeqSeries {
    pub(super) observed: Vec<f32>,
    pub(super) known: Vec<f32>,
    pub(super) target: Vec<f32>,
    pub(super) n_observed: usize,
    pub(super) n_known: usize,
}

impl SeqSeries {
    /// Row-major `observed [rows, n_observed]`, `known [rows, n_known]`, `target [rows]`.
    pub fn new(
        observed: Vec<f32>,
        n_observed: usize,
        known: Vec<f32>,
        n_known: usize,
        target: Vec<f32>,
    ) -> Result<Self> {
        let rows = target.len();
        if observed.len() != rows * n_observed || known.len() != rows * n_known {
            return Err(Error::shape(
                "observed/known",
                "SeqSeries::new",
                format!("{rows}×{n_observed} and {rows}×{n_known} values"),
                format!("{} and {}", observed.len(), known.len()),
            ));
        }
        if observed.iter().chain(&known).chain(&target).any(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "series value", context: "SeqSeries::new" });
        }
        Ok(Self { observed, known, target, n_observed, n_known })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.target.len()
    }

    /// Row `r`'s observed features (`n_observed` values).
    pub fn observed_row(&self, r: usize) -> &[f32] {
        &self.observed[r * self.n_observed..(r + 1) * self.n_observed]
    }

    /// Every row's target (the return from that row to the next).
    pub fn targets(&self) -> &[f32] {
        &self.target
    }

    pub(super) fn gather(src: &[f32], width: usize, starts: &[usize], offset: usize, len: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(starts.len() * len * width);
        for &s in starts {
            let a = (s + offset) * width;
            out.extend_from_slice(&src[a..a + len * width]);
        }
        out
    }
}

/// One batch of a [`SeqTask`]: model inputs, the target, and the last-value forecast
/// (the most recent realised return at prediction time) with the target's shape.
#[derive(Debug, Clone)]
pub struct SeqBatch {
    /// Model inputs (TFT: observed, known; MAMBA-2: x).
    pub inputs: Vec<Tensor>,
    /// TFT `[B, H]`, MAMBA-2 `[B, L]`.
    pub target: Tensor,
    /// The naive "last value" forecast, shaped as `target`.
    pub last_value: Tensor,
}

/// Where a window's forecast of the bar right after its last observed row sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextBar {
    /// The column of a batch row's `target` (and point forecast) holding it.
    pub column: usize,
    /// The series row, counted from the window's start, whose next-bar return that target
    /// is (the return from this row's bar to the next bar's).
    pub row: usize,
}

/// A seeded sampler of `len`-row windows starting in `range`, `batch` at a time.
pub(super) fn sampler(range: &Range<usize>, len: usize, batch: usize, seed: u64) -> Result<fx_data::Sampler> {
    fx_data::Sampler::windows(std::slice::from_ref(range), len, batch, seed)
        .map_err(|e| Error::config("window sampler", e.to_string()))
}
