//! Launch wrappers of `kernels/mamba2/mamba2.cu`, the element-wise, norm and loss kernels of the fused
//! MAMBA-2 training step ([`Mamba2Kernels`]): RMSNorm forward/backward, the causal conv + SiLU
//! with the `dt` softplus and its backward, the gated RMSNorm forward/backward, `norm_f` with
//! the head and the per-row MSE terms, and the loss reduction. The GEMMs around them are
//! `fx_kernels::cuda::blas::Blas` calls and the scan is [`super::ssd_cuda`]. [`crate::mamba2::ops_ref`] defines what
//! each computes (same arguments and layouts, f64); weight gradients come out as per-block
//! partial sums that a second pass (`Blas::col_sums`) adds up, so nothing uses float atomics and
//! a step is bit-reproducible. Nothing reads to the host: a CUDA graph can capture every launch.

use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::mamba2::ops_ref::{conv_tiles, row_blocks, MixerDims, MAX_NORM_COLS};
use fx_kernels::cuda::{cuda_device, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/mamba2/mamba2.cu`.
const PTX_MAMBA2: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mamba2.ptx"));

const THREADS: u32 = 256;
const WARPS: usize = 8;

/// [`Mamba2Kernels::rmsnorm_fwd`]'s buffers (F32 unless named 16, BF16; 0 = none where optional).
#[derive(Debug, Clone, Copy)]
pub struct RmsFwdArgs {
    /// `[rows, cols]`, gains `bias` in place when `bias` is given.
    pub h: u64,
    pub bias: u64,
    /// `[cols]`.
    pub w: u64,
    /// Receives `h` (optional).
    pub copy: u64,
    /// Output `[rows, cols]` and its optional BF16 copy.
    pub u: u64,
    pub u16: u64,
    /// Output `[rows]`.
    pub rstd: u64,
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

/// [`Mamba2Kernels::rmsnorm_bwd`]'s buffers: the upstream gradient is `du [rows, cols]`, or when
/// `du` is 0 the outer product `du_scale [rows] ⊗ du_vec [cols]`.
#[derive(Debug, Clone, Copy)]
pub struct RmsBwdArgs {
    pub du: u64,
    pub du_scale: u64,
    pub du_vec: u64,
    /// The forward's input `[rows, cols]`, `rstd [rows]` and weight `[cols]`.
    pub h: u64,
    pub rstd: u64,
    pub w: u64,
    /// Output `[rows, cols]` (added to when `accumulate`) and its optional BF16 copy.
    pub dh: u64,
    pub dh16: u64,
    pub accumulate: bool,
    /// Output `[row_blocks(rows), cols]`.
    pub partials: u64,
    pub rows: usize,
    pub cols: usize,
}

/// [`Mamba2Kernels::conv_fwd`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct ConvFwdArgs {
    /// in_proj output `[rows, ld]`: xBC at column `xoff`, dt right after it.
    pub zx: u64,
    pub ld: usize,
    pub xoff: usize,
    /// `conv1d.weight [conv_dim, K]`, `conv1d.bias [conv_dim]`, `dt_bias [nheads]`.
    pub w: u64,
    pub b: u64,
    pub dt_bias: u64,
    /// Outputs `[rows, conv_dim]`, `[rows, nheads]`.
    pub xbc: u64,
    pub dt: u64,
}

/// [`Mamba2Kernels::conv_bwd`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct ConvBwdArgs {
    /// As [`ConvFwdArgs`].
    pub zx: u64,
    pub ld: usize,
    pub xoff: usize,
    pub w: u64,
    pub b: u64,
    /// Gradient of the conv output: x columns `[rows, d_inner]`, per-head `dB | dC`
    /// `[nheads, rows, 2N]`.
    pub dx: u64,
    pub dbc: u64,
    /// Output: the conv input's gradient at `dzx[r·ldo + xoff + c]`, and its optional BF16 copy.
    pub dzx: u64,
    pub ldo: usize,
    pub dzx16: u64,
    /// Output `[batch · conv_tiles(len), conv_dim · (K + 1)]`.
    pub partials: u64,
}

/// [`Mamba2Kernels::gated_fwd`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct GatedFwdArgs {
    /// `[rows, d_inner]`; `z` at `z[r·ldz + c]`; weight `[d_inner]`.
    pub y: u64,
    pub z: u64,
    pub ldz: usize,
    pub w: u64,
    /// Outputs `[rows, d_inner]` (+ optional BF16 copy), `[rows, groups]`.
    pub out: u64,
    pub out16: u64,
    pub rstd: u64,
    pub rows: usize,
    pub d_inner: usize,
    pub groups: usize,
    pub eps: f32,
}

/// [`Mamba2Kernels::gated_bwd`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct GatedBwdArgs {
    /// Gradient of the output `[rows, d_inner]`.
    pub dout: u64,
    /// As [`GatedFwdArgs`] (`rstd` is the forward's output).
    pub y: u64,
    pub z: u64,
    pub ldz: usize,
    pub w: u64,
    pub rstd: u64,
    /// Outputs: `dy [rows, d_inner]`, `dz` at `dz[r·lddz + c]` (+ optional BF16 copy),
    /// `[row_blocks(rows), d_inner]` partial sums.
    pub dy: u64,
    pub dz: u64,
    pub lddz: usize,
    pub dz16: u64,
    pub partials: u64,
    pub rows: usize,
    pub d_inner: usize,
    pub groups: usize,
}

/// [`Mamba2Kernels::head_fwd`]'s buffers.
#[derive(Debug, Clone, Copy)]
pub struct HeadFwdArgs {
    /// Last residual stream `[rows, cols]`, `norm_f.weight`, `head.weight` `[cols]`, `head.bias`
    /// `[1]`, target `[rows]`.
    pub h: u64,
    pub w_norm: u64,
    pub head_w: u64,
    pub head_b: u64,
    pub target: u64,
    /// Outputs `[rows, cols]`, `[rows]` × 3.
    pub u_f: u64,
    pub rstd: u64,
    pub sq: u64,
    pub dpred: u64,
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

/// The kernels of `kernels/mamba2/mamba2.cu`.
#[derive(Debug, Clone)]
pub struct Mamba2Kernels {
    rmsnorm_fwd: CudaFunction,
    rmsnorm_bwd: CudaFunction,
    conv_fwd: CudaFunction,
    conv_bwd: CudaFunction,
    gated_fwd: CudaFunction,
    gated_bwd: CudaFunction,
    head_fwd: CudaFunction,
    loss_reduce: CudaFunction,
    stream: Arc<CudaStream>,
    sm_count: u32,
}

fn u32_of(v: usize, what: &str, context: &'static str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::Config { context, message: format!("{what} = {v} exceeds u32") })
}

fn cfg(blocks: usize, smem: usize, context: &'static str) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (u32_of(blocks.max(1), "blocks", context)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    })
}

fn check_rows(rows: usize, cols: usize, max_cols: usize, context: &'static str) -> Result<()> {
    if rows == 0 || cols == 0 || cols > max_cols || rows.checked_mul(cols).is_none_or(|n| n >= 1 << 40) {
        return Err(Error::Config { context, message: format!("{rows} rows of {cols} (1..={max_cols}) columns") });
    }
    u32_of(rows, "rows", context)?;
    Ok(())
}

impl Mamba2Kernels {
    /// Loads the kernels on `device` (CUDA).
    pub fn load(device: &Device) -> Result<Self> {
        const CTX: &str = "Mamba2Kernels::load";
        let dev = cuda_device(device, "device", CTX)?;
        let get = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_mamba2", PTX_MAMBA2).ctx(CTX)?.into_cuda_function())
        };
        let stream = dev.cuda_stream();
        let sm_count = fx_kernels::cuda::sm_count(&stream, CTX)?;
        Ok(Self {
            rmsnorm_fwd: get("fx_m2_rmsnorm_fwd")?,
            rmsnorm_bwd: get("fx_m2_rmsnorm_bwd")?,
            conv_fwd: get("fx_m2_conv_fwd")?,
            conv_bwd: get("fx_m2_conv_bwd")?,
            gated_fwd: get("fx_m2_gated_fwd")?,
            gated_bwd: get("fx_m2_gated_bwd")?,
            head_fwd: get("fx_m2_head_fwd")?,
            loss_reduce: get("fx_m2_loss_reduce")?,
            stream,
            sm_count,
        })
    }

    /// RMSNorm forward, a warp per row.
    ///
    /// # Safety
    /// Every address holds what [`RmsFwdArgs`] describes on this device until the launch ran.
    pub unsafe fn rmsnorm_fwd(&self, a: &RmsFwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::rmsnorm_fwd";
        check_rows(a.rows, a.cols, u32::MAX as usize, CTX)?;
        let (rows, cols) = (a.rows as u32, a.cols as u32);
        let mut l = self.stream.launch_builder(&self.rmsnorm_fwd);
        l.arg(&a.h).arg(&a.bias).arg(&a.w).arg(&a.copy).arg(&a.u).arg(&a.u16).arg(&a.rstd);
        l.arg(&rows).arg(&cols).arg(&a.eps);
        l.launch(cfg(a.rows.div_ceil(WARPS), 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    /// RMSNorm backward over blocks of [`crate::mamba2::ops_ref::ROWS_PER_BLOCK`] rows.
    ///
    /// # Safety
    /// Every address holds what [`RmsBwdArgs`] describes on this device until the launch ran.
    pub unsafe fn rmsnorm_bwd(&self, a: &RmsBwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::rmsnorm_bwd";
        check_rows(a.rows, a.cols, MAX_NORM_COLS, CTX)?;
        if a.du == 0 && (a.du_scale == 0 || a.du_vec == 0) {
            return Err(Error::Config { context: CTX, message: "neither du nor du_scale ⊗ du_vec".into() });
        }
        let (rows, cols, acc) = (a.rows as u32, a.cols as u32, a.accumulate as u32);
        let mut l = self.stream.launch_builder(&self.rmsnorm_bwd);
        l.arg(&a.du).arg(&a.du_scale).arg(&a.du_vec).arg(&a.h).arg(&a.rstd).arg(&a.w).arg(&a.dh).arg(&a.dh16);
        l.arg(&acc).arg(&a.partials).arg(&rows).arg(&cols);
        l.launch(cfg(row_blocks(a.rows), WARPS * a.cols * 4, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    fn check_mixer(d: &MixerDims, ld: usize, xoff: usize, context: &'static str) -> Result<()> {
        let ok = d.batch > 0
            && d.len > 0
            && d.d_inner > 0
            && d.d_state > 0
            && d.ngroups > 0
            && d.nheads > 0
            && d.nheads.is_multiple_of(d.ngroups)
            && d.d_conv > 0
            && d.d_conv <= crate::mamba2::ops_ref::MAX_CONV
            && ld >= xoff + d.conv_dim() + d.nheads
            && (d.rows() as u64) * (ld as u64) < (1 << 40);
        if !ok {
            return Err(Error::Config { context, message: format!("mixer {d:?}, row stride {ld}, xBC at {xoff}") });
        }
        u32_of(d.rows(), "rows", context)?;
        u32_of(ld, "ld", context)?;
        Ok(())
    }

    /// Conv + SiLU and dt softplus, a thread per (row, column), grid-stride.
    ///
    /// # Safety
    /// Every address holds what [`ConvFwdArgs`] describes for `d` on this device until the
    /// launch ran.
    pub unsafe fn conv_fwd(&self, d: &MixerDims, a: &ConvFwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::conv_fwd";
        Self::check_mixer(d, a.ld, a.xoff, CTX)?;
        let (ld, xoff, rows, len) = (a.ld as u32, a.xoff as u32, d.rows() as u32, d.len as u32);
        let (cd, nh, k) = (d.conv_dim() as u32, d.nheads as u32, d.d_conv as u32);
        let total = d.rows() * (d.conv_dim() + d.nheads);
        let blocks = total.div_ceil(THREADS as usize).min(self.sm_count as usize * 16);
        let mut l = self.stream.launch_builder(&self.conv_fwd);
        l.arg(&a.zx).arg(&ld).arg(&xoff).arg(&a.w).arg(&a.b).arg(&a.dt_bias).arg(&a.xbc).arg(&a.dt);
        l.arg(&rows).arg(&len).arg(&cd).arg(&nh).arg(&k);
        l.launch(cfg(blocks, 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    /// Conv backward, a thread per (batch row, tile of [`crate::mamba2::ops_ref::CONV_TILE`] steps,
    /// column).
    ///
    /// # Safety
    /// Every address holds what [`ConvBwdArgs`] describes for `d` on this device until the
    /// launch ran.
    pub unsafe fn conv_bwd(&self, d: &MixerDims, a: &ConvBwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::conv_bwd";
        Self::check_mixer(d, a.ld, a.xoff, CTX)?;
        Self::check_mixer(d, a.ldo, a.xoff, CTX)?;
        let (ld, xoff, ldo) = (a.ld as u32, a.xoff as u32, a.ldo as u32);
        let (batch, len, di) = (d.batch as u32, d.len as u32, d.d_inner as u32);
        let (n, g, nh, k) = (d.d_state as u32, d.ngroups as u32, d.nheads as u32, d.d_conv as u32);
        let threads = d.batch * conv_tiles(d.len) * d.conv_dim();
        let mut l = self.stream.launch_builder(&self.conv_bwd);
        l.arg(&a.zx).arg(&ld).arg(&xoff).arg(&a.w).arg(&a.b).arg(&a.dx).arg(&a.dbc).arg(&a.dzx).arg(&ldo);
        l.arg(&a.dzx16).arg(&a.partials).arg(&batch).arg(&len).arg(&di).arg(&n).arg(&g).arg(&nh).arg(&k);
        l.launch(cfg(threads.div_ceil(THREADS as usize), 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    fn check_gated(rows: usize, di: usize, groups: usize, ldz: usize, context: &'static str) -> Result<()> {
        check_rows(rows, di, MAX_NORM_COLS, context)?;
        if groups == 0 || !di.is_multiple_of(groups) || ldz < di || ldz > u32::MAX as usize {
            return Err(Error::Config { context, message: format!("d_inner {di}, {groups} groups, ldz {ldz}") });
        }
        u32_of(rows * groups, "rows · groups", context)?;
        Ok(())
    }

    /// Gated RMSNorm forward, a warp per (row, group).
    ///
    /// # Safety
    /// Every address holds what [`GatedFwdArgs`] describes on this device until the launch ran.
    pub unsafe fn gated_fwd(&self, a: &GatedFwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::gated_fwd";
        Self::check_gated(a.rows, a.d_inner, a.groups, a.ldz, CTX)?;
        let (ldz, rows, di, g) = (a.ldz as u32, a.rows as u32, a.d_inner as u32, a.groups as u32);
        let mut l = self.stream.launch_builder(&self.gated_fwd);
        l.arg(&a.y).arg(&a.z).arg(&ldz).arg(&a.w).arg(&a.out).arg(&a.out16).arg(&a.rstd);
        l.arg(&rows).arg(&di).arg(&g).arg(&a.eps);
        l.launch(cfg((a.rows * a.groups).div_ceil(WARPS), 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    /// Gated RMSNorm backward over blocks of [`crate::mamba2::ops_ref::ROWS_PER_BLOCK`] rows.
    ///
    /// # Safety
    /// Every address holds what [`GatedBwdArgs`] describes on this device until the launch ran.
    pub unsafe fn gated_bwd(&self, a: &GatedBwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::gated_bwd";
        Self::check_gated(a.rows, a.d_inner, a.groups, a.ldz, CTX)?;
        if a.lddz < a.d_inner || a.lddz > u32::MAX as usize {
            return Err(Error::shape("lddz", CTX, format!("a row stride >= {}", a.d_inner), a.lddz));
        }
        let (ldz, lddz) = (a.ldz as u32, a.lddz as u32);
        let (rows, di, g) = (a.rows as u32, a.d_inner as u32, a.groups as u32);
        let mut l = self.stream.launch_builder(&self.gated_bwd);
        l.arg(&a.dout).arg(&a.y).arg(&a.z).arg(&ldz).arg(&a.w).arg(&a.rstd).arg(&a.dy).arg(&a.dz).arg(&lddz);
        l.arg(&a.dz16).arg(&a.partials).arg(&rows).arg(&di).arg(&g);
        l.launch(cfg(row_blocks(a.rows), WARPS * a.d_inner * 4, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    /// `norm_f` + head + per-row MSE terms, a warp per row (`dpred = 2 (pred − target) / rows`).
    ///
    /// # Safety
    /// Every address holds what [`HeadFwdArgs`] describes on this device until the launch ran.
    pub unsafe fn head_fwd(&self, a: &HeadFwdArgs) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::head_fwd";
        check_rows(a.rows, a.cols, u32::MAX as usize, CTX)?;
        let (rows, cols, scale) = (a.rows as u32, a.cols as u32, 2.0f32 / a.rows as f32);
        let mut l = self.stream.launch_builder(&self.head_fwd);
        l.arg(&a.h).arg(&a.w_norm).arg(&a.head_w).arg(&a.head_b).arg(&a.target).arg(&a.u_f).arg(&a.rstd);
        l.arg(&a.sq).arg(&a.dpred).arg(&rows).arg(&cols).arg(&a.eps).arg(&scale);
        l.launch(cfg(a.rows.div_ceil(WARPS), 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }

    /// `loss[0] = mean(sq[..rows])`, `dhead_b[0] = Σ dpred[..rows]`, one block in a fixed order.
    ///
    /// # Safety
    /// `sq`, `dpred` hold `rows` and `loss`, `dhead_b` one F32 on this device until the launch ran.
    pub unsafe fn loss_reduce(&self, sq: u64, dpred: u64, rows: usize, loss: u64, dhead_b: u64) -> Result<()> {
        const CTX: &str = "Mamba2Kernels::loss_reduce";
        check_rows(rows, 1, 1, CTX)?;
        let (r, inv) = (rows as u32, 1.0f32 / rows as f32);
        let mut l = self.stream.launch_builder(&self.loss_reduce);
        l.arg(&sq).arg(&dpred).arg(&r).arg(&inv).arg(&loss).arg(&dhead_b);
        l.launch(cfg(1, 0, CTX)?).map_err(driver(CTX))?;
        Ok(())
    }
}
