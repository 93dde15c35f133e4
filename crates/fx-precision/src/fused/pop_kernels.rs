//! Launch wrappers of `kernels/train/pop_optim.cu`: the optimiser tail of a population's
//! update (N members of one architecture, every tensor stacked `[N, per]`): per-member
//! partial sums of the squared gradient (a launch per table of up to [`MT_MAX`] tensors),
//! each member's decisions from them (the guard, clip factor, step count, bias corrections
//! and counters: one launch), then AdamW with member k's factors (skipped where member k is
//! not ok) and the soft target update (a launch per table). Everything is read from and
//! written to device memory, so a CUDA graph captures it and serves any mix of members'
//! hyperparameters. [`crate::fused_ref::pop_sumsq_reference`],
//! [`crate::fused_ref::pop_decide_reference`] and [`crate::fused_ref::pop_adam_reference`]
//! define what they compute.

use candle_core::CudaDevice;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use super::kernels::MT_MAX;
use fx_kernels::cuda::{cuda_device, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/train/pop_optim.cu`.
const PTX_POP_OPTIM: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/pop_optim.ptx"));

const BLOCK: u32 = 256;
const CHUNK: usize = 256 * 8;

/// `struct PopTable` of pop_optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PopTable {
    param: [u64; MT_MAX],
    grad: [u64; MT_MAX],
    exp_avg: [u64; MT_MAX],
    exp_avg_sq: [u64; MT_MAX],
    target: [u64; MT_MAX],
    per: [u32; MT_MAX],
    block_start: [u32; MT_MAX + 1],
    col_start: [u32; MT_MAX],
    n: u32,
    members: u32,
    cols: u32,
}

// SAFETY: plain old data with the C layout of `PopTable` in kernels/train/pop_optim.cu.
unsafe impl DeviceRepr for PopTable {}

/// Device addresses of one stacked tensor (F32, contiguous, `members × per` elements each;
/// `target` 0 when the tensor has no target copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PopEntry {
    pub param: u64,
    pub grad: u64,
    pub exp_avg: u64,
    pub exp_avg_sq: u64,
    pub target: u64,
    /// Elements per member.
    pub per: usize,
}

/// Device addresses of the per-member factors, F32 `[members]` each (`struct PopFactors`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PopFactors {
    /// 1.0: apply member k's step; 0.0: leave its tensors as they are.
    pub ok: u64,
    /// Gradient factor (the clip).
    pub coef: u64,
    /// Decoupled weight decay factor `1 − lr·wd`.
    pub decay: u64,
    /// `lr / (1 − β₁ᵗ)`.
    pub step_size: u64,
    /// `1 / √(1 − β₂ᵗ)`.
    pub inv_bc2_sqrt: u64,
    /// Soft target update rate.
    pub tau: u64,
}

// SAFETY: plain old data with the C layout of `PopFactors` in kernels/train/pop_optim.cu.
unsafe impl DeviceRepr for PopFactors {}

/// Device addresses of a step's decisions (`struct PopDecide`): member k at index k of
/// every `[members]` array.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PopDecide {
    /// F32 `[members, cols]`: [`PopAdamKernels::sumsq`]'s partials.
    pub partials: u64,
    /// F32: each member's loss.
    pub loss: u64,
    /// F64: learning rate and gradient-norm clip.
    pub lr: u64,
    pub max_norm: u64,
    /// F64 tables `1 − β₁ᵗ`, `1 − β₂ᵗ` for t = 0..=`bc1_last` / `bc2_last`.
    pub bc1: u64,
    pub bc2: u64,
    /// U32, read and written: steps applied, skips for a non-finite loss / gradient.
    pub steps: u64,
    pub skipped_loss: u64,
    pub skipped_grad: u64,
    /// F64 `[3, members]`, written: loss, gradient norm before clipping, 1 where skipped.
    pub last: u64,
    /// F32: 0 where a member is not learning yet (it steps nothing and counts no skip).
    pub active: u64,
    /// F32, written: [`PopFactors`]' `ok`, `coef`, `step_size` and `inv_bc2_sqrt`.
    pub ok: u64,
    pub coef: u64,
    pub step_size: u64,
    pub inv_bc2_sqrt: u64,
    pub bc1_last: u32,
    pub bc2_last: u32,
    pub members: u32,
    pub cols: u32,
}

// SAFETY: plain old data with the C layout of `PopDecide` in kernels/train/pop_optim.cu.
unsafe impl DeviceRepr for PopDecide {}

/// The three loaded kernels.
#[derive(Debug, Clone)]
pub struct PopAdamKernels {
    sumsq: CudaFunction,
    decide: CudaFunction,
    adam: CudaFunction,
    dev: CudaDevice,
}

impl PopAdamKernels {
    /// Loads the kernels on `device` (a CUDA device).
    pub fn load(device: &candle_core::Device) -> Result<Self> {
        const CTX: &str = "PopAdamKernels::load";
        let dev = cuda_device(device, "device", CTX)?.clone();
        let get = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_pop_optim", PTX_POP_OPTIM).ctx(CTX)?.into_cuda_function())
        };
        Ok(Self { sumsq: get("fx_pop_sumsq")?, decide: get("fx_pop_decide")?, adam: get("fx_pop_adam")?, dev })
    }

    /// Partials per member (the columns of the `[members, cols]` partials buffer) for
    /// tensors of these per-member lengths; summing a member's row gives its squared norm.
    pub fn partial_cols(pers: &[usize]) -> usize {
        pers.iter().map(|&n| n.div_ceil(CHUNK)).sum()
    }

    /// Tables of at most [`MT_MAX`] tensors and their block counts.
    fn tables(entries: &[PopEntry], members: usize) -> Result<Vec<(PopTable, u32)>> {
        const CTX: &str = "PopAdamKernels";
        let cols = Self::partial_cols(&entries.iter().map(|e| e.per).collect::<Vec<_>>());
        let mut out = Vec::new();
        let mut col = 0usize;
        for group in entries.chunks(MT_MAX) {
            let mut t = PopTable {
                param: [0; MT_MAX],
                grad: [0; MT_MAX],
                exp_avg: [0; MT_MAX],
                exp_avg_sq: [0; MT_MAX],
                target: [0; MT_MAX],
                per: [0; MT_MAX],
                block_start: [0; MT_MAX + 1],
                col_start: [0; MT_MAX],
                n: group.len() as u32,
                members: members as u32,
                cols: cols as u32,
            };
            let mut blocks = 0u64;
            for (i, e) in group.iter().enumerate() {
                if e.per == 0 || e.per > u32::MAX as usize {
                    return Err(Error::shape("tensor", CTX, "1..2^32 elements per member", e.per));
                }
                t.param[i] = e.param;
                t.grad[i] = e.grad;
                t.exp_avg[i] = e.exp_avg;
                t.exp_avg_sq[i] = e.exp_avg_sq;
                t.target[i] = e.target;
                t.per[i] = e.per as u32;
                t.block_start[i] = blocks as u32;
                t.col_start[i] = col as u32;
                let chunks = e.per.div_ceil(CHUNK);
                blocks += (members * chunks) as u64;
                col += chunks;
                if blocks > i32::MAX as u64 {
                    return Err(Error::shape("population", CTX, "fewer than 2^31 blocks", blocks));
                }
            }
            for k in group.len()..=MT_MAX {
                t.block_start[k] = blocks as u32;
            }
            out.push((t, blocks as u32));
        }
        Ok(out)
    }

    fn check(entries: &[PopEntry], members: usize, ctx: &'static str) -> Result<()> {
        if entries.is_empty() || members == 0 {
            return Err(Error::Config { context: ctx, message: "no tensors or no members to step".into() });
        }
        Ok(())
    }

    /// Queues the partial sums of squared gradients: member k's row of the F32
    /// `[members, partial_cols]` buffer at `partials` (non-finite where a gradient is).
    ///
    /// # Safety
    /// Every address must point to live device memory of the stated length and dtype on
    /// this device until the launches have run (or, inside a graph capture, for as long as
    /// the graph is replayed).
    pub unsafe fn sumsq(&self, entries: &[PopEntry], members: usize, partials: u64) -> Result<()> {
        const CTX: &str = "PopAdamKernels::sumsq";
        Self::check(entries, members, CTX)?;
        let stream = self.dev.cuda_stream();
        for (t, blocks) in &Self::tables(entries, members)? {
            let cfg = LaunchConfig { grid_dim: (*blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.sumsq);
            b.arg(t).arg(&partials);
            b.launch(cfg).map_err(driver(CTX))?;
        }
        Ok(())
    }

    /// Queues each member's decisions from the partials of [`Self::sumsq`] (one thread a
    /// member): the four factor arrays always, the step and skip counters and the last
    /// report unless `dry`.
    ///
    /// # Safety
    /// As [`Self::sumsq`], for every array of `d` at the length and dtype its field states.
    pub unsafe fn decide(&self, d: &PopDecide, dry: bool) -> Result<()> {
        const CTX: &str = "PopAdamKernels::decide";
        if d.members == 0 || d.cols == 0 {
            return Err(Error::Config { context: CTX, message: "no members or no partials to decide from".into() });
        }
        let cfg =
            LaunchConfig { grid_dim: (d.members.div_ceil(BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let dry = dry as u32;
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(&self.decide);
        b.arg(d).arg(&dry);
        b.launch(cfg).map_err(driver(CTX))?;
        Ok(())
    }

    /// Queues AdamW (β₁, β₂, ε shared by the members) with each member's factors, then the
    /// soft target update where an entry has a target. `dry` launches touch nothing.
    ///
    /// # Safety
    /// As [`Self::sumsq`], for the entries and every factor array (`members` F32 each).
    pub unsafe fn adam(
        &self,
        entries: &[PopEntry],
        members: usize,
        factors: &PopFactors,
        (beta1, beta2, eps): (f64, f64, f64),
        dry: bool,
    ) -> Result<()> {
        const CTX: &str = "PopAdamKernels::adam";
        Self::check(entries, members, CTX)?;
        let stream = self.dev.cuda_stream();
        let (b1, b2) = (beta1 as f32, beta2 as f32);
        let (omb1, omb2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
        let (eps, dry) = (eps as f32, dry as u32);
        for (t, blocks) in &Self::tables(entries, members)? {
            let cfg = LaunchConfig { grid_dim: (*blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.adam);
            b.arg(t).arg(factors).arg(&b1).arg(&omb1).arg(&b2).arg(&omb2).arg(&eps).arg(&dry);
            b.launch(cfg).map_err(driver(CTX))?;
        }
        Ok(())
    }
}
