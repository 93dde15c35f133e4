//! Seeded-shuffle samplers over row ranges: row batches (RL state tables,
//! window length 1) and windows (`L_enc + H` for TFT, `L` for MAMBA-2). A
//! window lies entirely inside one of the sampler's ranges, so it never
//! crosses a split (or fold) boundary; every valid window start appears
//! exactly once per epoch. [`EpochStream`] shuffles the next epoch on a
//! background thread while the current one is consumed.

use std::collections::VecDeque;
use std::ops::Range;
use std::thread::JoinHandle;

use crate::error::Error;
use crate::rng::Rng;

/// One batch of sample starts: sample `k` covers rows `starts[k] .. starts[k] + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchIndex {
    /// Epoch number.
    pub epoch: u64,
    /// Batch number within the epoch.
    pub index: usize,
    /// First row of each sample.
    pub starts: Vec<usize>,
}

/// A seeded sampler of windows of `len` rows inside disjoint row ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampler {
    ranges: Vec<Range<usize>>,
    len: usize,
    batch_size: usize,
    seed: u64,
    drop_last: bool,
    n_starts: usize,
}

impl Sampler {
    /// Row batches (window length 1) over `ranges`.
    pub fn rows(ranges: &[Range<usize>], batch_size: usize, seed: u64) -> Result<Self, Error> {
        Self::windows(ranges, 1, batch_size, seed)
    }

    /// Windows of `len` rows inside `ranges` (which must not overlap).
    pub fn windows(ranges: &[Range<usize>], len: usize, batch_size: usize, seed: u64) -> Result<Self, Error> {
        if len == 0 || batch_size == 0 {
            return Err(Error::config("sampler", "window length and batch size must be > 0".to_string()));
        }
        let mut sorted: Vec<Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
        sorted.sort_by_key(|r| r.start);
        if sorted.windows(2).any(|w| w[1].start < w[0].end) {
            return Err(Error::config("sampler", format!("ranges overlap: {ranges:?}")));
        }
        let n_starts = sorted.iter().map(|r| (r.len() + 1).saturating_sub(len)).sum();
        if n_starts == 0 {
            return Err(Error::config("sampler", format!("no window of {len} rows fits in {ranges:?}")));
        }
        Ok(Sampler { ranges: sorted, len, batch_size, seed, drop_last: false, n_starts })
    }

    /// Drop the last, short batch of each epoch (default: keep it).
    pub fn drop_last(mut self, drop: bool) -> Self {
        self.drop_last = drop;
        self
    }

    /// Rows per sample.
    pub fn window_len(&self) -> usize {
        self.len
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Valid window starts (samples per epoch before dropping).
    pub fn starts_per_epoch(&self) -> usize {
        self.n_starts
    }

    /// One past the last row any window may touch.
    pub fn rows_end(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// Batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        if self.drop_last {
            self.n_starts / self.batch_size
        } else {
            self.n_starts.div_ceil(self.batch_size)
        }
    }

    /// The shuffled window starts of `epoch` (deterministic in seed and epoch).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.n_starts);
        for r in &self.ranges {
            if r.len() >= self.len {
                order.extend(r.start..=r.end - self.len);
            }
        }
        // Decorrelate epochs: derive the epoch's stream from (seed, epoch).
        let mut mix = Rng::new(self.seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let mut rng = Rng::new(mix.next_u64());
        rng.shuffle(&mut order);
        order
    }

    /// The batches of `epoch`.
    pub fn epoch_batches(&self, epoch: u64) -> Vec<BatchIndex> {
        self.chunk(epoch, self.epoch_order(epoch)).into()
    }

    fn chunk(&self, epoch: u64, order: Vec<usize>) -> VecDeque<BatchIndex> {
        order
            .chunks(self.batch_size)
            .filter(|c| !self.drop_last || c.len() == self.batch_size)
            .enumerate()
            .map(|(index, c)| BatchIndex { epoch, index, starts: c.to_vec() })
            .collect()
    }

    /// A stream of the batches of `epochs` in order, with the next
    /// epoch's order computed on a background thread during the current one.
    pub fn stream(&self, epochs: Range<u64>) -> EpochStream {
        EpochStream { sampler: self.clone(), epochs, current: VecDeque::new(), next: None }
    }
}

/// Iterator over batches of successive epochs (see [`Sampler::stream`]).
#[derive(Debug)]
pub struct EpochStream {
    sampler: Sampler,
    epochs: Range<u64>,
    current: VecDeque<BatchIndex>,
    next: Option<(u64, JoinHandle<Vec<usize>>)>,
}

impl EpochStream {
    /// True while the following epoch's order is being (or has been)
    /// prepared in the background.
    pub fn next_epoch_pending(&self) -> bool {
        self.next.is_some()
    }

    fn spawn_next(&mut self) {
        if let Some(e) = self.epochs.next() {
            let s = self.sampler.clone();
            self.next = Some((e, std::thread::spawn(move || s.epoch_order(e))));
        }
    }
}

impl Iterator for EpochStream {
    type Item = BatchIndex;

    fn next(&mut self) -> Option<BatchIndex> {
        if self.current.is_empty() {
            let (epoch, order) = match self.next.take() {
                // A shuffle cannot panic short of OOM; recompute inline if it did.
                Some((e, h)) => (e, h.join().unwrap_or_else(|_| self.sampler.epoch_order(e))),
                None => {
                    let e = self.epochs.next()?;
                    (e, self.sampler.epoch_order(e))
                }
            };
            self.current = self.sampler.chunk(epoch, order);
            // Start shuffling the following epoch while this one is consumed.
            self.spawn_next();
        }
        self.current.pop_front()
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-range samplers are the common case
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn deterministic_and_epochs_differ() {
        let s = Sampler::windows(&[0..100, 120..200], 10, 8, 5).unwrap();
        assert_eq!(s.epoch_order(3), s.epoch_order(3));
        assert_ne!(s.epoch_order(3), s.epoch_order(4));
        let t = Sampler::windows(&[0..100, 120..200], 10, 8, 6).unwrap();
        assert_ne!(s.epoch_order(3), t.epoch_order(3));
    }

    #[test]
    fn stream_matches_epoch_batches_and_prefetches() {
        let s = Sampler::rows(&[0..50], 7, 1).unwrap();
        let mut st = s.stream(2..5);
        let first = st.next().unwrap();
        assert!(st.next_epoch_pending(), "epoch 3 is shuffled while epoch 2 runs");
        let mut all = vec![first];
        all.extend(st);
        let want: Vec<_> = (2..5).flat_map(|e| s.epoch_batches(e)).collect();
        assert_eq!(all, want);
        assert_eq!(all.len(), 3 * 8);
    }

    #[test]
    fn refuses_bad_settings() {
        assert!(Sampler::windows(&[0..10, 5..20], 2, 4, 0).is_err());
        assert!(Sampler::windows(&[0..10], 11, 4, 0).is_err());
        assert!(Sampler::windows(&[0..10], 0, 4, 0).is_err());
        assert!(Sampler::rows(&[0..10], 0, 0).is_err());
    }

    proptest! {
        #[test]
        fn windows_stay_inside_and_cover_once(
            cuts in proptest::collection::vec(0usize..300, 1..6),
            len in 1usize..30,
            batch in 1usize..40,
            seed in any::<u64>(),
            drop in any::<bool>(),
        ) {
            // Build adjacent ranges from sorted cut points (adjacent = split boundaries).
            let mut c = cuts.clone();
            c.push(0);
            c.push(300);
            c.sort();
            c.dedup();
            let ranges: Vec<Range<usize>> = c.windows(2).map(|w| w[0]..w[1]).collect();
            let Ok(s) = Sampler::windows(&ranges, len, batch, seed) else {
                prop_assert!(ranges.iter().all(|r| r.len() < len));
                return Ok(());
            };
            let s = s.drop_last(drop);
            let batches = s.epoch_batches(1);
            prop_assert_eq!(batches.len(), s.batches_per_epoch());
            let mut seen: Vec<usize> = Vec::new();
            for b in &batches {
                prop_assert!(b.starts.len() <= batch);
                if drop { prop_assert_eq!(b.starts.len(), batch); }
                for &st in &b.starts {
                    // Entirely inside exactly one range: never crosses a boundary.
                    prop_assert!(ranges.iter().any(|r| r.start <= st && st + len <= r.end), "{} crosses", st);
                    seen.push(st);
                }
            }
            seen.sort();
            let n = seen.len();
            seen.dedup();
            prop_assert_eq!(seen.len(), n, "a start appeared twice");
            if !drop {
                let want: Vec<usize> = ranges.iter().filter(|r| r.len() >= len).flat_map(|r| r.start..=r.end - len).collect();
                prop_assert_eq!(seen, want);
            }
        }
    }
}
