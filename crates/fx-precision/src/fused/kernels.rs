//! Launch wrappers of `kernels/train/optim.cu`: the fused training-step tail (gradient norm,
//! NaN/Inf guard, clipping, loss-scale update, Adam/AdamW, soft target update) in three
//! launches per table of up to [`MT_MAX`] tensors, reading and writing only device memory so
//! that a CUDA graph can capture it. [`crate::fused_ref::fused_step_reference`] defines
//! what they compute.

use candle_core::CudaDevice;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::fused_ref::{AdamConsts, GuardConsts, MAX_EXTRA};
use fx_kernels::cuda::{cuda_device, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/train/optim.cu` (multi-tensor gradient norm, step finalisation, fused Adam/AdamW).
const PTX_OPTIM: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/optim.ptx"));

/// Tensors per launch (the kernels' `FX_MT_MAX`): their addresses travel as kernel
/// parameters, which a graph captures by value.
pub const MT_MAX: usize = 24;
const BLOCK: u32 = 256;
const CHUNK: usize = 256 * 8;

/// `struct MtTable` of optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct MtTable {
    param: [u64; MT_MAX],
    grad: [u64; MT_MAX],
    exp_avg: [u64; MT_MAX],
    exp_avg_sq: [u64; MT_MAX],
    target: [u64; MT_MAX],
    len: [u32; MT_MAX],
    block_start: [u32; MT_MAX + 1],
    n: u32,
}

// SAFETY: plain old data with the C layout of `MtTable` in kernels/train/optim.cu.
unsafe impl DeviceRepr for MtTable {}

/// `struct StepConsts` of optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct StepConsts {
    max_norm: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    scaler_enabled: u32,
    n_extra: u32,
    extra: [u64; MAX_EXTRA],
}

// SAFETY: plain old data with the C layout of `StepConsts` in kernels/train/optim.cu.
unsafe impl DeviceRepr for StepConsts {}

/// Device addresses of one tensor of the fused step (F32, contiguous, `len` elements each;
/// `target` 0 when the tensor has no target copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MtEntry {
    pub param: u64,
    pub grad: u64,
    pub exp_avg: u64,
    pub exp_avg_sq: u64,
    pub target: u64,
    pub len: usize,
}

/// Device addresses of the step's scalars and buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBuffers {
    /// The unscaled scalar loss (F32).
    pub loss: u64,
    /// The control block (F64 × `optim_ref::ctrl::LEN`).
    pub ctrl: u64,
    /// Receives the new loss scale as F32 (0: none).
    pub scale32: u64,
    /// F32 scratch of [`FusedStepKernels::partials_len`] elements.
    pub partials: u64,
}

/// The three loaded kernels.
#[derive(Debug, Clone)]
pub struct FusedStepKernels {
    sumsq: CudaFunction,
    finalize: CudaFunction,
    adam: CudaFunction,
    dev: CudaDevice,
}

impl FusedStepKernels {
    /// Loads the kernels on `device` (a CUDA device).
    pub fn load(device: &candle_core::Device) -> Result<Self> {
        const CTX: &str = "FusedStepKernels::load";
        let dev = cuda_device(device, "device", CTX)?.clone();
        let get = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_optim", PTX_OPTIM).ctx(CTX)?.into_cuda_function())
        };
        Ok(Self { sumsq: get("fx_mt_sumsq")?, finalize: get("fx_step_finalize")?, adam: get("fx_mt_adam")?, dev })
    }

    /// Scratch elements the step needs for tensors of these lengths.
    pub fn partials_len(lens: &[usize]) -> usize {
        lens.iter().map(|&n| n.div_ceil(CHUNK)).sum::<usize>().max(1)
    }

    /// Tables of at most [`MT_MAX`] tensors and their block counts.
    fn tables(entries: &[MtEntry]) -> Result<Vec<(MtTable, u32)>> {
        let mut out = Vec::new();
        for group in entries.chunks(MT_MAX) {
            let mut t = MtTable {
                param: [0; MT_MAX],
                grad: [0; MT_MAX],
                exp_avg: [0; MT_MAX],
                exp_avg_sq: [0; MT_MAX],
                target: [0; MT_MAX],
                len: [0; MT_MAX],
                block_start: [0; MT_MAX + 1],
                n: group.len() as u32,
            };
            let mut blocks = 0u32;
            for (i, e) in group.iter().enumerate() {
                if e.len == 0 || e.len > u32::MAX as usize {
                    return Err(Error::shape("tensor", "FusedStepKernels", "1..2^32 elements", e.len));
                }
                t.param[i] = e.param;
                t.grad[i] = e.grad;
                t.exp_avg[i] = e.exp_avg;
                t.exp_avg_sq[i] = e.exp_avg_sq;
                t.target[i] = e.target;
                t.len[i] = e.len as u32;
                t.block_start[i] = blocks;
                blocks += e.len.div_ceil(CHUNK) as u32;
            }
            for k in group.len()..=MT_MAX {
                t.block_start[k] = blocks;
            }
            out.push((t, blocks));
        }
        Ok(out)
    }

    /// Queues the fused step on candle's stream: norm partials, finalisation (guard, clip,
    /// counters, scaler) and Adam/AdamW (+ soft target update). `extras` are addresses of
    /// F32 scalars recorded in the control block. `dry` runs the launches without touching
    /// any state (graph warm-up). Everything is read and written on the device.
    ///
    /// # Safety
    /// Every address must point to live device memory of the stated length and dtype on
    /// this device until the launches have run (or, inside a graph capture, for as long as
    /// the graph is replayed).
    pub unsafe fn launch(
        &self,
        entries: &[MtEntry],
        bufs: &StepBuffers,
        extras: &[u64],
        adam: &AdamConsts,
        guard: &GuardConsts,
        dry: bool,
    ) -> Result<()> {
        const CTX: &str = "FusedStepKernels::launch";
        if extras.len() > MAX_EXTRA {
            return Err(Error::Config { context: CTX, message: format!("{} extras (max {MAX_EXTRA})", extras.len()) });
        }
        if entries.is_empty() {
            return Err(Error::Config { context: CTX, message: "no tensors to step".into() });
        }
        let stream = self.dev.cuda_stream();
        let tables = Self::tables(entries)?;
        let dry = dry as u32;
        let mut offset = 0u32;
        for (t, blocks) in &tables {
            let cfg = LaunchConfig { grid_dim: (*blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.sumsq);
            b.arg(t).arg(&bufs.partials).arg(&offset);
            b.launch(cfg).map_err(driver(CTX))?;
            offset += blocks;
        }
        let scaler = guard.scaler;
        let mut consts = StepConsts {
            max_norm: guard.max_norm.unwrap_or(0.0),
            beta1: adam.beta1,
            beta2: adam.beta2,
            weight_decay: adam.weight_decay,
            growth_factor: scaler.map_or(1.0, |s| s.growth_factor),
            backoff_factor: scaler.map_or(1.0, |s| s.backoff_factor),
            growth_interval: scaler.map_or(1, |s| s.growth_interval),
            scaler_enabled: scaler.is_some() as u32,
            n_extra: extras.len() as u32,
            extra: [0; MAX_EXTRA],
        };
        consts.extra[..extras.len()].copy_from_slice(extras);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.finalize);
        b.arg(&bufs.partials).arg(&offset).arg(&bufs.loss).arg(&bufs.ctrl).arg(&bufs.scale32).arg(&consts).arg(&dry);
        b.launch(cfg).map_err(driver(CTX))?;
        let (b1, b2) = (adam.beta1 as f32, adam.beta2 as f32);
        let (omb1, omb2) = ((1.0 - adam.beta1) as f32, (1.0 - adam.beta2) as f32);
        let (eps, wd, tau) = (adam.eps as f32, adam.weight_decay as f32, adam.tau as f32);
        let decoupled = adam.decoupled as u32;
        for (t, blocks) in &tables {
            let cfg = LaunchConfig { grid_dim: (*blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.adam);
            b.arg(t).arg(&bufs.ctrl).arg(&b1).arg(&omb1).arg(&b2).arg(&omb2).arg(&eps).arg(&wd);
            b.arg(&decoupled).arg(&tau).arg(&dry);
            b.launch(cfg).map_err(driver(CTX))?;
        }
        Ok(())
    }
}
