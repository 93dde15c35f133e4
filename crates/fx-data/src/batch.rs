//! Batch assembly: copies the sampled windows of a [`FeatureStore`] (market
//! features normalised on the fly, calendar features, next-bar log-return
//! targets) into one pooled host buffer, laid out for a single upload, and
//! [`BatchLoader`], which does it on prefetch workers ahead of the consumer.

use std::ops::Range;
use std::sync::Arc;

use crate::error::Error;
use crate::feature_file::FeatureStore;
use crate::features::N_KNOWN;
use crate::normalize::Normalizer;
use crate::pinned::{HostBufferPool, PooledBuffer};
use crate::prefetch::{PrefetchConfig, Prefetcher, TryNext};
use crate::sampler::{BatchIndex, Sampler};

/// Shape of a batch buffer. Regions sit at fixed offsets computed from the
/// full batch size (so device-side offsets never change): market
/// `[B, L, F]`, then known `[B, L, 4]`, then target `[B, L]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Samples per full batch (B).
    pub batch_size: usize,
    /// Rows per sample (L; 1 for row batches).
    pub window: usize,
    /// Market features per row (F).
    pub n_market: usize,
}

impl BatchLayout {
    /// Floats in one batch buffer.
    pub fn buffer_len(&self) -> usize {
        self.batch_size * self.window * (self.n_market + N_KNOWN + 1)
    }
    /// Offset range of the market region for `samples` samples.
    pub fn market_range(&self, samples: usize) -> Range<usize> {
        0..samples * self.window * self.n_market
    }
    /// Offset range of the known region for `samples` samples.
    pub fn known_range(&self, samples: usize) -> Range<usize> {
        let o = self.batch_size * self.window * self.n_market;
        o..o + samples * self.window * N_KNOWN
    }
    /// Offset range of the target region for `samples` samples.
    pub fn target_range(&self, samples: usize) -> Range<usize> {
        let o = self.batch_size * self.window * (self.n_market + N_KNOWN);
        o..o + samples * self.window
    }
}

/// Copies the windows starting at `starts` into `out` (see [`BatchLayout`]).
/// `out` must hold `layout.buffer_len()` floats and `starts.len() <= batch_size`.
pub fn assemble(
    store: &FeatureStore,
    norm: Option<&Normalizer>,
    layout: &BatchLayout,
    starts: &[usize],
    out: &mut [f32],
) -> Result<(), Error> {
    let (l, f) = (layout.window, layout.n_market);
    if f != store.n_market() || out.len() < layout.buffer_len() || starts.len() > layout.batch_size {
        return Err(Error::config(
            "batch layout",
            format!("{layout:?} does not fit {} / buffer {}", store.path().display(), out.len()),
        ));
    }
    if let Some(&bad) = starts.iter().find(|&&s| s + l > store.rows()) {
        return Err(Error::config(
            "batch",
            format!("window {bad}..{} exceeds the {} rows of {}", bad + l, store.rows(), store.path().display()),
        ));
    }
    let n = starts.len();
    let (m_off, k_off, t_off) =
        (layout.market_range(n).start, layout.known_range(n).start, layout.target_range(n).start);
    for (k, &s) in starts.iter().enumerate() {
        // Windows are contiguous rows: one memcpy per region and sample.
        let dst = &mut out[m_off + k * l * f..m_off + (k + 1) * l * f];
        dst.copy_from_slice(store.market_rows(s..s + l));
        if let Some(nm) = norm {
            nm.apply_in_place(dst);
        }
        out[k_off + k * l * N_KNOWN..k_off + (k + 1) * l * N_KNOWN]
            .copy_from_slice(&store.known()[s * N_KNOWN..(s + l) * N_KNOWN]);
        out[t_off + k * l..t_off + (k + 1) * l].copy_from_slice(&store.logret_next()[s..s + l]);
    }
    Ok(())
}

/// An assembled batch in a pooled host buffer.
#[derive(Debug)]
pub struct HostBatch {
    /// Which batch this is.
    pub index: BatchIndex,
    /// The buffer layout.
    pub layout: BatchLayout,
    buf: PooledBuffer,
}

impl HostBatch {
    /// Samples in this batch (≤ batch size; the last of an epoch may be short).
    pub fn samples(&self) -> usize {
        self.index.starts.len()
    }
    /// Market features `[samples, L, F]`, normalised when a normaliser was given.
    pub fn market(&self) -> &[f32] {
        &self.buf[self.layout.market_range(self.samples())]
    }
    /// Calendar features `[samples, L, 4]`.
    pub fn known(&self) -> &[f32] {
        &self.buf[self.layout.known_range(self.samples())]
    }
    /// Next-bar log returns `[samples, L]`.
    pub fn target(&self) -> &[f32] {
        &self.buf[self.layout.target_range(self.samples())]
    }
    /// The whole buffer (fixed-offset regions; for one upload).
    pub fn buffer(&self) -> &PooledBuffer {
        &self.buf
    }
}

/// Assembles the batches of a sampler's epochs on background workers.
/// Because the workers run ahead across epoch boundaries, the next epoch's
/// order and first batches are ready before the current epoch ends.
#[derive(Debug)]
pub struct BatchLoader {
    inner: Prefetcher<HostBatch>,
    layout: BatchLayout,
    pool: HostBufferPool,
}

impl BatchLoader {
    /// Starts assembling the batches of `epochs` of `sampler` from `store`.
    /// `pool` buffers must hold a full batch (see [`BatchLayout::buffer_len`]).
    pub fn new(
        store: Arc<FeatureStore>,
        norm: Option<Arc<Normalizer>>,
        sampler: &Sampler,
        epochs: Range<u64>,
        pool: HostBufferPool,
        cfg: &PrefetchConfig,
    ) -> Result<Self, Error> {
        let layout =
            BatchLayout { batch_size: sampler.batch_size(), window: sampler.window_len(), n_market: store.n_market() };
        if pool.buffer_len() < layout.buffer_len() {
            return Err(Error::config(
                "buffer pool",
                format!("buffers of {} floats, a batch needs {}", pool.buffer_len(), layout.buffer_len()),
            ));
        }
        if sampler.rows_end() > store.rows() {
            return Err(Error::config(
                "sampler",
                format!(
                    "ranges reach row {} but {} has {} rows",
                    sampler.rows_end(),
                    store.path().display(),
                    store.rows()
                ),
            ));
        }
        if let Some(n) = &norm {
            if n.width() != store.n_market() {
                return Err(Error::config(
                    "normaliser",
                    format!("{} features, {} has {}", n.width(), store.path().display(), store.n_market()),
                ));
            }
        }
        // Enough buffers for the channels, the workers and the consumer.
        pool.preallocate(cfg.workers * (cfg.depth + 1) + 1)?;
        let p = pool.clone();
        let inner = Prefetcher::spawn(cfg, sampler.stream(epochs), move |index: BatchIndex| {
            let mut buf = p.get()?;
            assemble(&store, norm.as_deref(), &layout, &index.starts, buf.as_mut_slice()?)?;
            Ok(HostBatch { index, layout, buf })
        })?;
        Ok(BatchLoader { inner, layout, pool })
    }

    /// The buffer layout of every batch.
    pub fn layout(&self) -> BatchLayout {
        self.layout
    }

    /// The pool the batches' buffers come from.
    pub fn pool(&self) -> &HostBufferPool {
        &self.pool
    }
}

impl BatchLoader {
    /// Assembled batches waiting to be consumed.
    pub fn ready(&self) -> usize {
        self.inner.ready()
    }

    /// The next batch if it is already assembled, without blocking.
    pub fn try_next(&mut self) -> TryNext<HostBatch> {
        self.inner.try_next()
    }
}

impl Iterator for BatchLoader {
    type Item = Result<HostBatch, Error>;
    fn next(&mut self) -> Option<Self::Item> {
        self.inner.next()
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-range samplers are the common case
mod tests {
    use super::*;
    use crate::features::N_MARKET;
    use crate::rng::Rng;
    use crate::synthetic::{feature_table, SyntheticConfig};

    fn store(bars: usize, seed: u64) -> Arc<FeatureStore> {
        let t = feature_table(&SyntheticConfig { bars, seed, ..Default::default() }).unwrap();
        Arc::new(FeatureStore::from_table(t).unwrap())
    }

    /// Element-by-element f64 reference of `assemble`.
    fn reference(
        store: &FeatureStore,
        norm: &Normalizer,
        l: usize,
        starts: &[usize],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut m, mut k, mut t) = (Vec::new(), Vec::new(), Vec::new());
        for &s in starts {
            for i in s..s + l {
                for j in 0..store.n_market() {
                    let z = (store.market_row(i)[j] as f64 - norm.mean[j] as f64) / norm.std[j] as f64;
                    m.push(z.clamp(-10.0, 10.0));
                }
                k.extend(store.known_row(i).iter().map(|&x| x as f64));
                t.push(store.logret_next()[i] as f64);
            }
        }
        (m, k, t)
    }

    #[test]
    fn assemble_matches_reference_on_random_windows() {
        let st = store(400, 3);
        let norm = Normalizer::fit(&st, 0..200).unwrap();
        let mut rng = Rng::new(17);
        for _ in 0..20 {
            let l = 1 + rng.below(24) as usize;
            let b = 1 + rng.below(8) as usize;
            let n = 1 + rng.below(b as u64) as usize;
            let starts: Vec<usize> = (0..n).map(|_| rng.below((st.rows() - l + 1) as u64) as usize).collect();
            let layout = BatchLayout { batch_size: b, window: l, n_market: N_MARKET };
            let mut out = vec![f32::NAN; layout.buffer_len()];
            assemble(&st, Some(&norm), &layout, &starts, &mut out).unwrap();
            let (m, k, t) = reference(&st, &norm, l, &starts);
            let close = |got: &[f32], want: &[f64]| {
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(want) {
                    assert!((*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
                }
            };
            close(&out[layout.market_range(n)], &m);
            close(&out[layout.known_range(n)], &k);
            close(&out[layout.target_range(n)], &t);
        }
        let layout = BatchLayout { batch_size: 2, window: 10, n_market: N_MARKET };
        let mut out = vec![0.0; layout.buffer_len()];
        assert!(assemble(&st, None, &layout, &[st.rows() - 5], &mut out).is_err());
    }

    #[test]
    fn loader_yields_every_window_in_sampler_order() {
        let st = store(300, 4);
        let sampler = Sampler::windows(&[0..120, 120..200], 16, 8, 9).unwrap();
        let pool = HostBufferPool::new(BatchLayout { batch_size: 8, window: 16, n_market: N_MARKET }.buffer_len());
        for workers in [1, 2] {
            let cfg = PrefetchConfig { depth: 2, workers };
            let loader = BatchLoader::new(st.clone(), None, &sampler, 0..2, pool.clone(), &cfg).unwrap();
            let want: Vec<BatchIndex> = (0..2).flat_map(|e| sampler.epoch_batches(e)).collect();
            let mut n = 0;
            for (b, w) in loader.zip(&want) {
                let b = b.unwrap();
                assert_eq!(&b.index, w);
                let s = b.index.starts[0];
                assert_eq!(&b.market()[..16 * N_MARKET], st.market_rows(s..s + 16));
                assert_eq!(b.target()[0], st.logret_next()[s]);
                n += 1;
            }
            assert_eq!(n, want.len());
        }
        // Buffers are recycled: the pool holds about the pipeline depth
        // (per worker: channel depth + one in progress; plus the consumer's).
        assert!(pool.allocated() <= 2 * (2 + 1) + 1, "{}", pool.allocated());
    }

    #[test]
    fn next_epoch_is_ready_before_the_current_one_ends() {
        let st = store(200, 6);
        let sampler = Sampler::rows(&[0..60], 20, 2).unwrap(); // 3 batches per epoch
        let pool = HostBufferPool::new(BatchLayout { batch_size: 20, window: 1, n_market: N_MARKET }.buffer_len());
        let mut loader = BatchLoader::new(st, None, &sampler, 0..2, pool, &PrefetchConfig::default()).unwrap();
        assert_eq!(loader.next().unwrap().unwrap().index.epoch, 0);
        assert_eq!(loader.next().unwrap().unwrap().index.epoch, 0);
        // While the consumer works on batch 2 of epoch 0, the workers finish
        // the last batch of epoch 0 and the first of epoch 1.
        let t = std::time::Instant::now();
        while loader.ready() < 2 && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(loader.ready(), 2);
        assert_eq!(loader.next().unwrap().unwrap().index.epoch, 0);
        match loader.try_next() {
            TryNext::Ready(b) => assert_eq!(b.unwrap().index, sampler.epoch_batches(1)[0]),
            other => panic!("epoch 1 was not ready: {other:?}"),
        }
    }

    #[test]
    fn loader_checks_its_inputs() {
        let st = store(300, 5);
        let sampler = Sampler::rows(&[0..150], 4, 0).unwrap();
        let cfg = PrefetchConfig::default();
        assert!(BatchLoader::new(st.clone(), None, &sampler, 0..1, HostBufferPool::new(3), &cfg).is_err());
        let far = Sampler::rows(&[0..10_000], 4, 0).unwrap();
        assert!(BatchLoader::new(st.clone(), None, &far, 0..1, HostBufferPool::new(1 << 12), &cfg).is_err());
        let narrow = Arc::new(Normalizer::fit_rows(&[1.0, 2.0], 1, 0..2).unwrap());
        assert!(BatchLoader::new(st, Some(narrow), &sampler, 0..1, HostBufferPool::new(1 << 12), &cfg).is_err());
    }
}
