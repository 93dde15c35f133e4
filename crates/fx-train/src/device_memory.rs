//! Peak device memory (benchmark cases and training metrics).
//!
//! candle allocates through cudarc's `CudaStream::alloc`, which uses the stream-ordered
//! allocator (`cuMemAllocAsync`, the device's current memory pool) whenever the context
//! reports `has_async_alloc`. That pool keeps a high-water mark of the bytes in use
//! (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`), the analogue of `torch.cuda.max_memory_allocated()`:
//! at a case's start we synchronise, read the bytes still in use (the baseline, like
//! bench.py's `mem_baseline_mib`) and reset the mark; the case's peak is the mark minus the
//! baseline. Without async allocation the fallback is `cuMemGetInfo` (device-wide used
//! bytes) sampled at the case's synchronisation points, a lower bound of the true peak.
//! On the CPU nothing is measured (null in the records, as bench.py does).

use anyhow::Result;
use candle_core::Device;

/// Where peak memory comes from.
pub(crate) enum MemProbe {
    /// CPU: not measured.
    None,
    /// The current memory pool's used-bytes high-water mark.
    #[cfg(feature = "cuda")]
    Pool {
        ctx: std::sync::Arc<cudarc::driver::CudaContext>,
        pool: cudarc::driver::sys::CUmemoryPool,
        base: u64,
        base_reserved: u64,
    },
    /// `total − free` from `cuMemGetInfo`, sampled.
    #[cfg(feature = "cuda")]
    MemInfo { stream: std::sync::Arc<cudarc::driver::CudaStream>, base: u64, high: u64 },
}

#[cfg(feature = "cuda")]
const MIB: f64 = (1u64 << 20) as f64;

impl MemProbe {
    /// The best method `device` supports.
    pub(crate) fn for_device(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = device {
            let stream = cd.cuda_stream();
            let ctx = stream.context().clone();
            if ctx.has_async_alloc() {
                if let Ok(pool) = pool::current(&ctx) {
                    return MemProbe::Pool { ctx, pool, base: 0, base_reserved: 0 };
                }
            }
            return MemProbe::MemInfo { stream, base: 0, high: 0 };
        }
        let _ = device;
        MemProbe::None
    }

    /// The method's name for the records (`mem_method`); `None` on the CPU.
    pub(crate) fn method(&self) -> Option<&'static str> {
        match self {
            MemProbe::None => None,
            #[cfg(feature = "cuda")]
            MemProbe::Pool { .. } => Some("mempool_used_high"),
            #[cfg(feature = "cuda")]
            MemProbe::MemInfo { .. } => Some("cuMemGetInfo_sampled"),
        }
    }

    /// Marks the start of a case: synchronise, remember what is in use, reset the peak.
    pub(crate) fn start(&mut self, device: &Device) -> Result<()> {
        device.synchronize()?;
        match self {
            MemProbe::None => {}
            #[cfg(feature = "cuda")]
            MemProbe::Pool { ctx, pool, base, base_reserved } => {
                *base = pool::get(ctx, *pool, pool::USED)?;
                *base_reserved = pool::get(ctx, *pool, pool::RESERVED)?;
                pool::reset_high(ctx, *pool, pool::USED_HIGH)?;
                pool::reset_high(ctx, *pool, pool::RESERVED_HIGH)?;
            }
            #[cfg(feature = "cuda")]
            MemProbe::MemInfo { stream, base, high } => {
                let (free, total) = stream.context().mem_get_info()?;
                *base = (total - free) as u64;
                *high = *base;
            }
        }
        Ok(())
    }

    /// A sample point (after a synchronisation); only the `cuMemGetInfo` fallback needs it.
    pub(crate) fn sample(&mut self, device: &Device) -> Result<()> {
        match self {
            MemProbe::None => {}
            #[cfg(feature = "cuda")]
            MemProbe::Pool { .. } => {}
            #[cfg(feature = "cuda")]
            MemProbe::MemInfo { stream, high, .. } => {
                device.synchronize()?;
                let (free, total) = stream.context().mem_get_info()?;
                *high = (*high).max((total - free) as u64);
            }
        }
        let _ = device;
        Ok(())
    }

    /// Peak bytes in use since [`MemProbe::start`] minus the baseline, in MiB.
    pub(crate) fn peak_mib(&mut self, device: &Device) -> Result<Option<f64>> {
        self.sample(device)?;
        Ok(match self {
            MemProbe::None => None,
            #[cfg(feature = "cuda")]
            MemProbe::Pool { ctx, pool, base, .. } => {
                device.synchronize()?;
                let high = pool::get(ctx, *pool, pool::USED_HIGH)?;
                Some(high.saturating_sub(*base) as f64 / MIB)
            }
            #[cfg(feature = "cuda")]
            MemProbe::MemInfo { base, high, .. } => Some(high.saturating_sub(*base) as f64 / MIB),
        })
    }

    /// Peak bytes the pool reserved from the device since [`MemProbe::start`] minus what
    /// it held then, in MiB (bench.py's `peak_reserved_mib`); pool method only.
    pub(crate) fn peak_reserved_mib(&self) -> Result<Option<f64>> {
        #[cfg(feature = "cuda")]
        if let MemProbe::Pool { ctx, pool, base_reserved, .. } = self {
            let high = pool::get(ctx, *pool, pool::RESERVED_HIGH)?;
            return Ok(Some(high.saturating_sub(*base_reserved) as f64 / MIB));
        }
        Ok(None)
    }

    /// Bytes in use at the case's start, in MiB.
    pub(crate) fn baseline_mib(&self) -> Option<f64> {
        match self {
            MemProbe::None => None,
            #[cfg(feature = "cuda")]
            MemProbe::Pool { base, .. } | MemProbe::MemInfo { base, .. } => Some(*base as f64 / MIB),
        }
    }
}

#[cfg(feature = "cuda")]
mod pool {
    //! The memory-pool attribute calls (driver API through cudarc's `sys`).

    use std::sync::Arc;

    use cudarc::driver::sys::{self, CUmemPool_attribute, CUmemoryPool};
    use cudarc::driver::CudaContext;

    /// The pool `cuMemAllocAsync` draws from on this context's device (the default pool
    /// unless someone called `cuDeviceSetMemPool`).
    pub(super) fn current(ctx: &Arc<CudaContext>) -> anyhow::Result<CUmemoryPool> {
        ctx.bind_to_thread()?;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer, device handle owned by the live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }.result()?;
        anyhow::ensure!(!pool.is_null(), "cuDeviceGetMemPool returned a null pool");
        Ok(pool)
    }

    /// Bytes in use by allocations now.
    pub(super) const USED: CUmemPool_attribute = CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
    /// High-water mark of the bytes in use since the last reset.
    pub(super) const USED_HIGH: CUmemPool_attribute = CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    /// Bytes the pool holds from the device now.
    pub(super) const RESERVED: CUmemPool_attribute = CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT;
    /// High-water mark of the bytes the pool held since the last reset.
    pub(super) const RESERVED_HIGH: CUmemPool_attribute = CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH;

    /// One of the cuuint64_t attributes above.
    pub(super) fn get(ctx: &Arc<CudaContext>, pool: CUmemoryPool, attr: CUmemPool_attribute) -> anyhow::Result<u64> {
        ctx.bind_to_thread()?;
        let mut v: sys::cuuint64_t = 0;
        // SAFETY: the USED/RESERVED attributes are cuuint64_t values; pool is live.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }.result()?;
        Ok(v)
    }

    /// Resets a high-water mark (`USED_HIGH` or `RESERVED_HIGH`) to the current value
    /// (the driver accepts only 0).
    pub(super) fn reset_high(
        ctx: &Arc<CudaContext>,
        pool: CUmemoryPool,
        attr: CUmemPool_attribute,
    ) -> anyhow::Result<()> {
        ctx.bind_to_thread()?;
        let mut zero: sys::cuuint64_t = 0;
        // SAFETY: as in `get`; setting a *_HIGH attribute to 0 is the documented reset.
        unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast()) }.result()?;
        Ok(())
    }
}
