//! A pool of reusable host buffers for batch assembly. On CPU builds the
//! buffers are plain `Vec<f32>`; with the `cuda` feature a pool can hand out
//! page-locked (pinned) memory from cudarc instead, so host-to-device copies
//! run at full DMA speed and asynchronously. Both kinds have the same API.
//!
//! Buffers go back to the pool when dropped and are reused, so pinned
//! allocation (slow: it maps pages with the driver) happens only at warm-up.
//! The pool never blocks: when no buffer is free it allocates one, which
//! keeps a consumer that holds buffers from starving (or deadlocking) workers.

use std::sync::{Arc, Mutex};

use crate::error::Error;

#[cfg(feature = "cuda")]
use cudarc::driver::{CudaContext, PinnedHostSlice};

enum Storage {
    Plain(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pinned(PinnedHostSlice<f32>, *mut f32),
}

/// One host buffer of `f32`s (plain or page-locked).
pub struct HostBuffer {
    storage: Storage,
}

// SAFETY: the raw pointer cached next to a pinned slice points into memory the
// slice owns; the buffer is moved between threads as a unit, never shared
// mutably (access goes through &self / &mut self).
#[cfg(feature = "cuda")]
unsafe impl Send for HostBuffer {}
#[cfg(feature = "cuda")]
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len()).field("pinned", &self.is_pinned()).finish()
    }
}

impl HostBuffer {
    /// Number of `f32`s.
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Plain(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Pinned(p, _) => p.len(),
        }
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        match &self.storage {
            Storage::Plain(_) => false,
            #[cfg(feature = "cuda")]
            Storage::Pinned(..) => true,
        }
    }

    /// Read access. Reading while an upload from this buffer is in flight is
    /// harmless (the copy engine only reads it too), so no wait is needed.
    pub fn as_slice(&self) -> &[f32] {
        match &self.storage {
            Storage::Plain(v) => v,
            // SAFETY: ptr/len describe the live allocation owned by `p`.
            #[cfg(feature = "cuda")]
            Storage::Pinned(p, ptr) => unsafe { std::slice::from_raw_parts(*ptr, p.len()) },
        }
    }

    /// Write access. For pinned memory this first waits for any upload still
    /// reading the buffer, so a refill never races a DMA.
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32], Error> {
        match &mut self.storage {
            Storage::Plain(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Pinned(p, _) => p
                .as_mut_slice()
                .map_err(|e| Error::Cuda { what: "waiting for an upload from a pinned buffer", msg: e.to_string() }),
        }
    }

    /// The underlying page-locked slice, for uploads (`cuda` feature only).
    #[cfg(feature = "cuda")]
    pub fn pinned(&self) -> Option<&PinnedHostSlice<f32>> {
        match &self.storage {
            Storage::Pinned(p, _) => Some(p),
            Storage::Plain(_) => None,
        }
    }
}

enum Kind {
    Plain,
    #[cfg(feature = "cuda")]
    Pinned(Arc<CudaContext>),
}

struct PoolInner {
    buffer_len: usize,
    kind: Kind,
    free: Mutex<Vec<HostBuffer>>,
    allocated: std::sync::atomic::AtomicUsize,
}

/// A shared pool of equally sized host buffers (cheap to clone).
#[derive(Clone)]
pub struct HostBufferPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for HostBufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBufferPool")
            .field("buffer_len", &self.inner.buffer_len)
            .field("pinned", &self.is_pinned())
            .field("allocated", &self.allocated())
            .finish()
    }
}

impl HostBufferPool {
    /// A pool of plain (pageable) buffers of `buffer_len` floats.
    pub fn new(buffer_len: usize) -> Self {
        Self::with_kind(buffer_len, Kind::Plain)
    }

    /// A pool of page-locked buffers of `buffer_len` floats in `ctx`.
    #[cfg(feature = "cuda")]
    pub fn pinned(ctx: Arc<CudaContext>, buffer_len: usize) -> Self {
        Self::with_kind(buffer_len, Kind::Pinned(ctx))
    }

    fn with_kind(buffer_len: usize, kind: Kind) -> Self {
        HostBufferPool {
            inner: Arc::new(PoolInner {
                buffer_len,
                kind,
                free: Mutex::new(Vec::new()),
                allocated: std::sync::atomic::AtomicUsize::new(0),
            }),
        }
    }

    /// Floats per buffer.
    pub fn buffer_len(&self) -> usize {
        self.inner.buffer_len
    }

    /// True when the pool hands out page-locked memory.
    pub fn is_pinned(&self) -> bool {
        !matches!(self.inner.kind, Kind::Plain)
    }

    /// Buffers allocated so far (reuse keeps this at the pipeline depth).
    pub fn allocated(&self) -> usize {
        self.inner.allocated.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tops the free list up to `n` buffers so the first batches do not pay
    /// for allocation.
    pub fn preallocate(&self, n: usize) -> Result<(), Error> {
        let have = self.lock_free().len();
        let bufs = (have..n).map(|_| self.alloc()).collect::<Result<Vec<_>, _>>()?;
        self.lock_free().extend(bufs);
        Ok(())
    }

    /// A free buffer (contents are whatever the last user left), or a new
    /// zeroed one when none is free. It returns to the pool when dropped.
    pub fn get(&self) -> Result<PooledBuffer, Error> {
        let reused = self.lock_free().pop();
        let buf = match reused {
            Some(b) => b,
            None => self.alloc()?,
        };
        Ok(PooledBuffer { buf: Some(buf), pool: self.inner.clone() })
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, Vec<HostBuffer>> {
        // A panic while holding the lock cannot leave the Vec inconsistent.
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn alloc(&self) -> Result<HostBuffer, Error> {
        let n = self.inner.buffer_len;
        let storage = match &self.inner.kind {
            Kind::Plain => Storage::Plain(vec![0.0; n]),
            #[cfg(feature = "cuda")]
            Kind::Pinned(ctx) => {
                let err = |e: cudarc::driver::DriverError| Error::Cuda {
                    what: "allocating page-locked host memory",
                    msg: e.to_string(),
                };
                // Flags 0: plain page-locked memory. cudarc's default is
                // write-combined, which is very slow for the CPU to read back.
                // SAFETY: the memory is zeroed below before anyone reads it.
                let mut p = unsafe { ctx.alloc_pinned_with_flags::<f32>(n, 0) }.map_err(err)?;
                p.as_mut_slice().map_err(err)?.fill(0.0);
                let ptr = p.as_mut_ptr().map_err(err)?;
                Storage::Pinned(p, ptr)
            }
        };
        self.inner.allocated.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(HostBuffer { storage })
    }
}

/// A buffer checked out of a [`HostBufferPool`]; derefs to its `f32`s.
#[derive(Debug)]
pub struct PooledBuffer {
    buf: Option<HostBuffer>,
    pool: Arc<PoolInner>,
}

impl PooledBuffer {
    /// The buffer.
    pub fn buffer(&self) -> &HostBuffer {
        self.buf.as_ref().expect("a pooled buffer is present until drop")
    }

    /// Write access (waits for in-flight uploads on pinned memory).
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32], Error> {
        self.buf.as_mut().expect("a pooled buffer is present until drop").as_mut_slice()
    }
}

impl std::ops::Deref for PooledBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.buffer().as_slice()
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).push(b);
        }
    }
}

impl std::fmt::Debug for PoolInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolInner").field("buffer_len", &self.buffer_len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused() {
        let pool = HostBufferPool::new(16);
        assert!(!pool.is_pinned());
        {
            let mut a = pool.get().unwrap();
            a.as_mut_slice().unwrap()[3] = 7.0;
            let b = pool.get().unwrap();
            assert_eq!((a.len(), b.len()), (16, 16));
            assert_eq!(pool.allocated(), 2);
        }
        for _ in 0..10 {
            let a = pool.get().unwrap();
            let _b = pool.get().unwrap();
            drop(a);
        }
        assert_eq!(pool.allocated(), 2, "steady state allocates nothing");
        pool.preallocate(3).unwrap();
        assert_eq!(pool.allocated(), 3, "tops up the two free buffers to three");
        // Buffers cross threads.
        let p2 = pool.clone();
        std::thread::spawn(move || {
            let mut b = p2.get().unwrap();
            b.as_mut_slice().unwrap().fill(1.0);
        })
        .join()
        .unwrap();
    }
}
