//! Launch wrappers of `kernels/mamba2/ssd.cu`, the chunked MAMBA-2 SSD scan: [`SsdKernels::forward`]
//! (outputs with and without the `D` skip, and the state entering each chunk) and
//! [`SsdKernels::backward`] (gradients of the conv output, of `dt_raw` and per-batch-row partial
//! sums of the `dt_bias`, `A_log` and `D` gradients). One block of 256 threads per (head, batch
//! row) walks the chunks with 64 × 64 tiles in shared memory (84 KiB forward, 99 KiB backward,
//! two blocks per SM on Hopper). [`crate::mamba2::ssd_ref`] defines what they compute and the buffer
//! layouts; nothing reads to the host, so a CUDA graph can capture both.

use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::mamba2::ssd_ref::SsdDims;
use fx_kernels::cuda::{cuda_device, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/mamba2/ssd.cu`.
const PTX_SSD: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/ssd.ptx"));

const TILE: usize = 64 * 65;
const THREADS: u32 = 256;
/// Dynamic shared memory of the forward: 5 tiles (X, B, C, M, H) and 5 vectors of 64.
pub const SSD_FWD_SMEM: usize = (5 * TILE + 5 * 64) * 4;
/// Dynamic shared memory of the backward: 6 tiles (X/H, B, C, dY, G, M/W) and 7 vectors of 64.
pub const SSD_BWD_SMEM: usize = (6 * TILE + 7 * 64) * 4;

/// Device addresses of [`SsdKernels::forward`]'s buffers (layouts in [`crate::mamba2::ssd_ref`]; all F32).
#[derive(Debug, Clone, Copy)]
pub struct SsdFwdArgs {
    /// Conv output `[rows, ld_xbc]` (x | B | C).
    pub xbc: u64,
    pub ld_xbc: usize,
    /// `[rows, nheads]` after softplus.
    pub dt: u64,
    /// `[nheads]`.
    pub a_log: u64,
    /// `[nheads]`.
    pub d: u64,
    /// Outputs `[rows, d_inner]`: before and after the `D` skip.
    pub y_ssd: u64,
    pub y_out: u64,
    /// Output `[batch, nheads, n_chunks, P, N]`.
    pub states: u64,
}

/// Device addresses of [`SsdKernels::backward`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct SsdBwdArgs {
    /// The forward's inputs and outputs (`fwd.y_out` is not read).
    pub fwd: SsdFwdArgs,
    /// Gradient of `y_out` `[rows, d_inner]`.
    pub dy: u64,
    /// Output: gradient of the conv output's x columns `[rows, d_inner]`.
    pub dx: u64,
    /// Output: per-head `dB | dC` `[nheads, rows, 2N]`.
    pub dbc: u64,
    /// Output: gradient of `dt_raw`, element `r·ld_ddt + h`.
    pub ddt_raw: u64,
    pub ld_ddt: usize,
    /// Output: its BF16 copy at the same positions (0: none).
    pub ddt16: u64,
    /// Output: `[batch, 3·nheads]` (`dt_bias` | `A_log` | `D` sums).
    pub partials: u64,
}

/// The kernels of `kernels/mamba2/ssd.cu`.
#[derive(Debug, Clone)]
pub struct SsdKernels {
    fwd: CudaFunction,
    bwd: CudaFunction,
    stream: Arc<CudaStream>,
}

impl SsdKernels {
    /// Loads the kernels on `device` (CUDA) and raises their shared-memory limit; an error when
    /// the device cannot give a block [`SSD_BWD_SMEM`] bytes.
    pub fn load(device: &Device) -> Result<Self> {
        const CTX: &str = "SsdKernels::load";
        let dev = cuda_device(device, "device", CTX)?;
        let stream = dev.cuda_stream();
        let optin = stream
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver(CTX))?;
        if (optin.max(0) as usize) < SSD_BWD_SMEM {
            return Err(Error::Unsupported {
                context: CTX,
                message: format!("{optin} bytes of shared memory per block; the SSD backward needs {SSD_BWD_SMEM}"),
            });
        }
        let get = |name: &str, smem: usize| -> Result<CudaFunction> {
            let f = dev.get_or_load_custom_func(name, "fx_ssd", PTX_SSD).ctx(CTX)?.into_cuda_function();
            stream.context().bind_to_thread().map_err(driver(CTX))?;
            f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(driver(CTX))?;
            // As much shared memory as the SM has: two blocks per SM need ~200 KiB.
            f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(driver(CTX))?;
            Ok(f)
        };
        Ok(Self { fwd: get("fx_ssd_fwd", SSD_FWD_SMEM)?, bwd: get("fx_ssd_bwd", SSD_BWD_SMEM)?, stream })
    }

    fn config(d: &SsdDims, smem: usize, context: &'static str) -> Result<LaunchConfig> {
        d.check(context)?;
        if d.batch > 65535 || d.nheads > u32::MAX as usize {
            return Err(Error::Config { context, message: format!("batch {} > 65535 (the grid's y)", d.batch) });
        }
        Ok(LaunchConfig {
            grid_dim: (d.nheads as u32, d.batch as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        })
    }

    fn dims_args(d: &SsdDims) -> [u32; 6] {
        [d.len as u32, d.nheads as u32, d.headdim as u32, d.d_state as u32, d.ngroups as u32, d.chunk as u32]
    }

    /// The forward scan.
    ///
    /// # Safety
    /// Every address holds what [`SsdFwdArgs`] describes for `dims` (F32) on this device until
    /// the launch ran.
    pub unsafe fn forward(&self, dims: &SsdDims, a: &SsdFwdArgs) -> Result<()> {
        const CTX: &str = "SsdKernels::forward";
        let cfg = Self::config(dims, SSD_FWD_SMEM, CTX)?;
        check_ld(a.ld_xbc, dims.xbc_width(), "ld_xbc", CTX)?;
        let ld = a.ld_xbc as u32;
        let [len, nh, p, n, g, q] = Self::dims_args(dims);
        let mut l = self.stream.launch_builder(&self.fwd);
        l.arg(&a.xbc).arg(&ld).arg(&a.dt).arg(&a.a_log).arg(&a.d).arg(&a.y_ssd).arg(&a.y_out).arg(&a.states);
        l.arg(&len).arg(&nh).arg(&p).arg(&n).arg(&g).arg(&q);
        l.launch(cfg).map_err(driver(CTX))?;
        Ok(())
    }

    /// The backward scan.
    ///
    /// # Safety
    /// Every address holds what [`SsdBwdArgs`] describes for `dims` on this device until the
    /// launch ran; the outputs do not overlap the inputs.
    pub unsafe fn backward(&self, dims: &SsdDims, a: &SsdBwdArgs) -> Result<()> {
        const CTX: &str = "SsdKernels::backward";
        let cfg = Self::config(dims, SSD_BWD_SMEM, CTX)?;
        check_ld(a.fwd.ld_xbc, dims.xbc_width(), "ld_xbc", CTX)?;
        check_ld(a.ld_ddt, dims.nheads, "ld_ddt", CTX)?;
        let (ld, ld_ddt) = (a.fwd.ld_xbc as u32, a.ld_ddt as u32);
        let [len, nh, p, n, g, q] = Self::dims_args(dims);
        let f = &a.fwd;
        let mut l = self.stream.launch_builder(&self.bwd);
        l.arg(&f.xbc).arg(&ld).arg(&f.dt).arg(&f.a_log).arg(&f.d).arg(&f.y_ssd).arg(&f.states).arg(&a.dy);
        l.arg(&a.dx).arg(&a.dbc).arg(&a.ddt_raw).arg(&ld_ddt).arg(&a.ddt16).arg(&a.partials);
        l.arg(&len).arg(&nh).arg(&p).arg(&n).arg(&g).arg(&q);
        l.launch(cfg).map_err(driver(CTX))?;
        Ok(())
    }
}

fn check_ld(ld: usize, min: usize, what: &'static str, context: &'static str) -> Result<()> {
    if ld < min || ld > u32::MAX as usize {
        return Err(Error::shape(what, context, format!("a row stride in {min}..2^32"), ld));
    }
    Ok(())
}
