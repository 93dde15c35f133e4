//! A feature series ([`SeqSeries`]), the spans windows are drawn from ([`Spans`]), and the
//! batches drawn from it: [`SeqBatch`], the next-bar column of a window ([`NextBar`]) and
//! the seeded window sampler.
//!
//! A panel of instruments is one series of their rows one instrument after another, each
//! row tagged with its instrument; a split is then one span per instrument, so no window
//! crosses from one instrument into the next.

use std::ops::Range;

use candle_core::Tensor;

use crate::error::{Error, Result};

/// A feature series: per row `n_observed` market features, `n_known` calendar
/// features and the target, the log-return from this row to the next; for a panel, also
/// each row's instrument ([`SeqSeries::with_instruments`]).
#[derive(Debug, Clone)]
pub struct SeqSeries {
    pub(super) observed: Vec<f32>,
    pub(super) known: Vec<f32>,
    pub(super) target: Vec<f32>,
    pub(super) n_observed: usize,
    pub(super) n_known: usize,
    /// Each row's instrument, of `n_instruments` (empty and 0 for one instrument).
    pub(super) instrument: Vec<u32>,
    pub(super) n_instruments: usize,
}

/// The rows windows are drawn from: one range of a series, or for a panel one per
/// instrument (ranges that do not overlap; a window stays inside one of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spans(Vec<Range<usize>>);

impl Spans {
    /// The ranges, empty ones dropped.
    pub fn new(ranges: Vec<Range<usize>>) -> Self {
        Self(ranges.into_iter().filter(|r| !r.is_empty()).collect())
    }

    /// The ranges.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.0
    }

    /// Rows in all the ranges.
    pub fn rows(&self) -> usize {
        self.0.iter().map(|r| r.len()).sum()
    }

    /// Window starts of `len` rows, in row order.
    pub fn window_starts(&self, len: usize) -> Vec<usize> {
        self.0.iter().flat_map(|r| r.start..(r.end + 1).saturating_sub(len).max(r.start)).collect()
    }

    /// From the first range's start to the last one's end.
    pub fn hull(&self) -> Range<usize> {
        match (self.0.first(), self.0.last()) {
            (Some(a), Some(b)) => a.start..b.end,
            _ => 0..0,
        }
    }
}

impl From<Range<usize>> for Spans {
    fn from(r: Range<usize>) -> Self {
        Self::new(vec![r])
    }
}

impl From<&Range<usize>> for Spans {
    fn from(r: &Range<usize>) -> Self {
        Self::new(vec![r.clone()])
    }
}

impl From<Vec<Range<usize>>> for Spans {
    fn from(r: Vec<Range<usize>>) -> Self {
        Self::new(r)
    }
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
        Ok(Self { observed, known, target, n_observed, n_known, instrument: Vec::new(), n_instruments: 0 })
    }

    /// The same series as a panel's: row `r` belongs to instrument `instrument[r]` of
    /// `n_instruments` (the models then see it: the TFT as its static covariate, MAMBA-2
    /// as an embedding added to its input).
    pub fn with_instruments(mut self, instrument: Vec<u32>, n_instruments: usize) -> Result<Self> {
        if instrument.len() != self.rows() || n_instruments == 0 {
            return Err(Error::shape(
                "instrument",
                "SeqSeries::with_instruments",
                format!("{} rows' instruments of at least one", self.rows()),
                format!("{} of {n_instruments}", instrument.len()),
            ));
        }
        if let Some(bad) = instrument.iter().find(|&&i| i as usize >= n_instruments) {
            return Err(Error::config(
                "SeqSeries::with_instruments",
                format!("instrument {bad} of a panel of {n_instruments}"),
            ));
        }
        self.instrument = instrument;
        self.n_instruments = n_instruments;
        Ok(self)
    }

    /// Instruments of a panel's series (0 for one instrument's).
    pub fn n_instruments(&self) -> usize {
        self.n_instruments
    }

    /// The one-hot rows `[starts.len(), n_instruments]` of the instruments of the windows
    /// starting at `starts`; `Err` when a window's rows are not all one instrument's.
    pub(super) fn instrument_one_hot(&self, starts: &[usize], len: usize) -> Result<Vec<f32>> {
        let n = self.n_instruments;
        let mut out = vec![0f32; starts.len() * n];
        for (b, &s) in starts.iter().enumerate() {
            let i = self.instrument[s];
            if self.instrument[s + len - 1] != i {
                return Err(Error::config(
                    "SeqSeries batch",
                    format!("the window of rows {s}..{} crosses from one instrument into the next", s + len),
                ));
            }
            out[b * n + i as usize] = 1.0;
        }
        Ok(out)
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

/// A seeded sampler of `len`-row windows inside `spans`, `batch` at a time.
pub(super) fn sampler(spans: &Spans, len: usize, batch: usize, seed: u64) -> Result<fx_data::Sampler> {
    fx_data::Sampler::windows(spans.ranges(), len, batch, seed)
        .map_err(|e| Error::config("window sampler", e.to_string()))
}
