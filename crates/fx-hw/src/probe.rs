//! Measuring bytes per sample on the GPU.

use std::any::Any;

use cudarc::driver::CudaContext;

use crate::{CostModel, Error};

/// Measures a model's memory cost on CUDA device `ordinal` by running its training step at
/// two batch sizes and taking the difference in device memory in use.
///
/// `step(batch)` must run one full training step at `batch` and return whatever keeps the
/// step's memory alive (the loss, its graph and the gradients); the probe reads the driver's
/// free memory while that guard is held, after synchronising the device. The overhead is
/// what the smaller step used beyond `batch_small` samples' worth.
pub fn probe_bytes_per_sample<F>(
    ordinal: usize,
    batch_small: usize,
    batch_large: usize,
    mut step: F,
) -> Result<CostModel, Error>
where
    F: FnMut(usize) -> Result<Box<dyn Any>, String>,
{
    if batch_large <= batch_small {
        return Err(Error::Probe(format!("batch sizes must grow ({batch_small} then {batch_large})")));
    }
    let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
        .map_err(|_| Error::Probe("CUDA driver unavailable".into()))?
        .map_err(|e| Error::Driver { during: "cuCtxCreate", message: e.to_string() })?;
    let used = |ctx: &std::sync::Arc<CudaContext>| -> Result<u64, Error> {
        ctx.synchronize().map_err(|e| Error::Driver { during: "synchronize", message: e.to_string() })?;
        let (free, total) =
            ctx.mem_get_info().map_err(|e| Error::Driver { during: "cuMemGetInfo", message: e.to_string() })?;
        Ok((total - free) as u64)
    };
    // Warm up once so lazily created handles (cuBLAS, module loads) are not counted per sample.
    drop(step(batch_small).map_err(Error::Probe)?);
    let base = used(&ctx)?;
    let guard = step(batch_small).map_err(Error::Probe)?;
    let small = used(&ctx)?;
    drop(guard);
    let guard = step(batch_large).map_err(Error::Probe)?;
    let large = used(&ctx)?;
    drop(guard);
    if large <= small {
        return Err(Error::Probe(format!(
            "memory in use did not grow with the batch ({small} B at {batch_small}, {large} B at {batch_large}); \
             the allocator may cache blocks: use larger batches"
        )));
    }
    let per = (large - small) / (batch_large - batch_small) as u64;
    let overhead = (small.saturating_sub(base)).saturating_sub(per * batch_small as u64);
    Ok(CostModel { overhead_bytes: overhead, bytes_per_sample: per })
}
