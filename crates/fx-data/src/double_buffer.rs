//! `DoubleBufferedLoader`: the GPU feed. With the `cuda` feature it uploads
//! batch n+1 into a second device buffer on its own copy stream while the
//! model computes on batch n, ordered with events (no host-side waits on the
//! GPU). Without `cuda` it is the [`BatchLoader`](crate::batch::BatchLoader) itself: host batches from
//! the prefetch workers.
//!
//! Ordering (cuda): each call first records an event on the compute stream
//! that marks the end of the work queued on the previous batch; an upload
//! into a slot waits (on the copy stream) for the event of the batch that
//! last used that slot, and the compute stream waits for the upload's event
//! before any work queued on the returned batch.

#[cfg(not(feature = "cuda"))]
/// On CPU builds the double-buffered loader degrades to the prefetching
/// [`BatchLoader`](crate::batch::BatchLoader).
pub type DoubleBufferedLoader = crate::batch::BatchLoader;

#[cfg(feature = "cuda")]
pub use imp::{DeviceBatch, DoubleBufferedLoader};

#[cfg(feature = "cuda")]
mod imp {
    use std::ops::Range;
    use std::sync::Arc;

    use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};

    use crate::batch::{BatchLayout, BatchLoader, HostBatch};
    use crate::error::Error;
    use crate::prefetch::TryNext;
    use crate::sampler::BatchIndex;

    fn cuda(what: &'static str) -> impl Fn(DriverError) -> Error {
        move |e| Error::Cuda { what, msg: e.to_string() }
    }

    /// A batch resident on the device, valid for work queued on the compute
    /// stream until the next call to [`DoubleBufferedLoader::next_batch`]
    /// (later work reuses the other buffer, earlier-queued work is safe).
    #[derive(Debug)]
    pub struct DeviceBatch<'a> {
        /// Which batch this is.
        pub index: &'a BatchIndex,
        /// Region offsets inside `data`.
        pub layout: BatchLayout,
        /// The whole device buffer (see [`BatchLayout`] for the regions).
        pub data: &'a CudaSlice<f32>,
    }

    impl DeviceBatch<'_> {
        /// Samples in the batch.
        pub fn samples(&self) -> usize {
            self.index.starts.len()
        }
        /// Offsets of the market features `[samples, L, F]` in `data`.
        pub fn market_range(&self) -> Range<usize> {
            self.layout.market_range(self.samples())
        }
        /// Offsets of the calendar features `[samples, L, 4]` in `data`.
        pub fn known_range(&self) -> Range<usize> {
            self.layout.known_range(self.samples())
        }
        /// Offsets of the targets `[samples, L]` in `data`.
        pub fn target_range(&self) -> Range<usize> {
            self.layout.target_range(self.samples())
        }
    }

    struct Staged {
        slot: usize,
        index: BatchIndex,
        uploaded: CudaEvent,
    }

    /// Two device buffers fed from a [`BatchLoader`] on a dedicated copy stream.
    pub struct DoubleBufferedLoader {
        source: BatchLoader,
        compute: Arc<CudaStream>,
        copy: Arc<CudaStream>,
        slots: [CudaSlice<f32>; 2],
        /// Per slot: compute work that read it is complete once this fires.
        released: [Option<CudaEvent>; 2],
        staged: Option<Staged>,
        current: Option<(usize, BatchIndex)>,
        /// An error met while staging ahead, returned at the next call.
        deferred: Option<Error>,
        ended: bool,
    }

    impl std::fmt::Debug for DoubleBufferedLoader {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DoubleBufferedLoader").field("layout", &self.source.layout()).finish()
        }
    }

    impl DoubleBufferedLoader {
        /// Feeds `compute` (the stream the model runs on) from `source`.
        /// Pinned source pools give truly asynchronous uploads; pageable
        /// ones work but the driver stages them synchronously.
        pub fn new(source: BatchLoader, compute: Arc<CudaStream>) -> Result<Self, Error> {
            let copy = compute.context().new_stream().map_err(cuda("creating the copy stream"))?;
            let n = source.layout().buffer_len();
            let a = copy.alloc_zeros::<f32>(n).map_err(cuda("allocating a device batch buffer"))?;
            let b = copy.alloc_zeros::<f32>(n).map_err(cuda("allocating a device batch buffer"))?;
            Ok(DoubleBufferedLoader {
                source,
                compute,
                copy,
                slots: [a, b],
                released: [None, None],
                staged: None,
                current: None,
                deferred: None,
                ended: false,
            })
        }

        /// Queues the upload of `batch` into `slot` on the copy stream.
        fn upload(&mut self, slot: usize, batch: HostBatch) -> Result<Staged, Error> {
            if let Some(ev) = &self.released[slot] {
                self.copy.wait(ev).map_err(cuda("ordering an upload after compute"))?;
            }
            let buf = batch.buffer().buffer();
            match buf.pinned() {
                // Asynchronous DMA; the pinned slice records its own event so
                // the pool's next writer waits for this copy to finish.
                Some(p) => self.copy.memcpy_htod(p, &mut self.slots[slot]),
                None => self.copy.memcpy_htod(buf.as_slice(), &mut self.slots[slot]),
            }
            .map_err(cuda("uploading a batch"))?;
            let uploaded = self.copy.record_event(None).map_err(cuda("recording an upload event"))?;
            Ok(Staged { slot, index: batch.index, uploaded })
        }

        /// The next batch on the device (ordered before any work queued on
        /// the compute stream after this call), `None` at the end. Starts the
        /// upload of the following batch when its host copy is ready.
        pub fn next_batch(&mut self) -> Option<Result<DeviceBatch<'_>, Error>> {
            if let Some(e) = self.deferred.take() {
                self.ended = true;
                return Some(Err(e));
            }
            match self.advance() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => {
                    self.ended = true;
                    return Some(Err(e));
                }
            }
            let (slot, index) = self.current.as_ref()?;
            Some(Ok(DeviceBatch { index, layout: self.source.layout(), data: &self.slots[*slot] }))
        }

        fn advance(&mut self) -> Result<bool, Error> {
            // Work queued on the previous batch ends here: its slot is free after this event.
            let prev = self.current.take().map(|(slot, _)| slot);
            if let Some(slot) = prev {
                self.released[slot] = Some(self.compute.record_event(None).map_err(cuda("recording a compute event"))?);
            }
            let staged = match self.staged.take() {
                Some(s) => s,
                None => {
                    if self.ended {
                        return Ok(false);
                    }
                    let Some(batch) = self.source.next() else {
                        self.ended = true;
                        return Ok(false);
                    };
                    // Alternate slots; the first batch goes to slot 0.
                    let slot = prev.map_or(0, |s| 1 - s);
                    self.upload(slot, batch?)?
                }
            };
            self.compute.wait(&staged.uploaded).map_err(cuda("ordering compute after an upload"))?;
            let slot = staged.slot;
            self.current = Some((slot, staged.index));
            // Stage the following batch into the other slot now if its host
            // copy is ready, so the upload overlaps this batch's compute.
            match self.source.try_next() {
                TryNext::Ready(Ok(batch)) => match self.upload(1 - slot, batch) {
                    Ok(s) => self.staged = Some(s),
                    Err(e) => self.deferred = Some(e),
                },
                TryNext::Ready(Err(e)) => self.deferred = Some(e),
                TryNext::Pending => {}
                TryNext::End => self.ended = true,
            }
            Ok(true)
        }
    }
}
