//! Launch configuration from the device: block size for occupancy, grid from the SM count.

use candle_core::CudaDevice;
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::driver;
use crate::error::Result;

/// No dynamic shared memory for any block size (the occupancy API's callback).
extern "C" fn no_dynamic_smem(_block_size: std::ffi::c_int) -> usize {
    0
}

/// How a one-thread-per-account kernel is launched: `block` threads per block and at most
/// `max_grid` blocks (the number that can be resident at once: SMs × blocks per SM at
/// that block size); kernels loop grid-stride over the remaining accounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Threads per block.
    pub block: u32,
    /// Upper bound on blocks per launch.
    pub max_grid: u32,
    /// Streaming multiprocessors the plan was made for.
    pub sm_count: u32,
}

impl LaunchPlan {
    /// Plans `func` on `dev`: the block size maximising occupancy (driver occupancy API,
    /// capped at 512 so small E still spreads over many SMs, a multiple of 32), and the grid bound from
    /// `sm_count` (e.g. `fx_hw::GpuInfo::sm_count`; when `None`, queried from the device).
    pub fn for_function(
        func: &CudaFunction,
        dev: &CudaDevice,
        sm_count: Option<u32>,
        ctx: &'static str,
    ) -> Result<Self> {
        let sm_count = match sm_count {
            Some(n) if n > 0 => n,
            _ => super::sm_count(&dev.cuda_stream(), ctx)?,
        };
        let (_, block) = func.occupancy_max_potential_block_size(no_dynamic_smem, 0, 512, None).map_err(driver(ctx))?;
        // Whole warps only: the env kernels' warp-cooperative row writes need them.
        let block = block.clamp(32, 512) / 32 * 32;
        let per_sm = func.occupancy_max_active_blocks_per_multiprocessor(block, 0, None).map_err(driver(ctx))?.max(1);
        Ok(Self { block, max_grid: sm_count.saturating_mul(per_sm).max(1), sm_count })
    }

    /// The launch configuration for `n` threads' worth of work. When `n` would not fill
    /// one block per SM, blocks shrink (whole warps, at least one) so the work spreads
    /// over as many SMs as it can: at small E the step is latency-bound per SM.
    pub fn config(&self, n: usize) -> LaunchConfig {
        let spread = n.div_ceil(self.sm_count as usize).div_ceil(32) * 32;
        let block = (self.block as usize).min(spread.max(32)) as u32;
        let blocks = n.div_ceil(block as usize).clamp(1, self.max_grid as usize) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
    }
}
