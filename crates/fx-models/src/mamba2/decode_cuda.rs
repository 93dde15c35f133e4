//! Launch wrapper of `kernels/mamba2/mamba2_step.cu`: one MAMBA-2 recurrent decode step — a new bar
//! `x [B, n_in]` through every layer's conv and SSM state to the prediction `[B]` — as one kernel
//! launch on one thread-block cluster of 16 blocks, or 8 where 16 do not fit (see
//! [`CLUSTER_SIZES`]; compute capability 9.0+;
//! elsewhere [`Mamba2StepKernel::new`] answers [`Error::Unsupported`]). What it computes, in f64,
//! is [`crate::mamba2::decode_ref::step`]; the limits are [`StepDims::supported`]'s (batch ≤ 8).
//!
//! Why one cluster (the numbers are the default model's: d_model 256, 4 layers, 6.9 MB of F32
//! weights): a step is ~13 dependent phases, each a GEMV too small to fill the GPU. The cluster's
//! SMs each stream 1/C of every weight matrix (~0.43 MB at C = 16, L2-resident between calls) and
//! exchange the vectors through distributed shared memory with three hardware cluster barriers
//! per layer, instead of ~60 launches (candle) or ~13 graph nodes with a kernel boundary each.
//! Sixteen blocks is a non-portable cluster size (the function opts in); on the H200 the kernel
//! takes 53.0 µs on 16 blocks against 62.3 on 8, and 44.2 staged (batch 1, `step_kernel_timing`,
//! docs/perf/2026-12-02-h200-decode/tests-decode.log). At batch 1 each block also stages its weight slices in
//! shared memory with the copy engine (bulk copies, one layer ahead), where they fit (16 blocks
//! at the default size; 8 would need 285 KB a block).
//!
//! The parameters and the state are read and written through raw device addresses taken once, at
//! construction: the kernel keeps clones of the tensors, so their memory stays allocated, and sees
//! in-place updates of them (`Var::set`, `slice_set`), which must be queued on candle's stream (the
//! one the kernel runs on). Nothing reads to the host, so a CUDA graph can capture
//! [`Mamba2StepKernel::launch`]; replays read `x` and the state from the same addresses.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{sys, CudaFunction, CudaStream};

pub use crate::mamba2::decode_ref::{StepDims, CLUSTER_SIZES, MAX_BATCH, MAX_LAYERS};
use fx_kernels::checks::expect_tensor;
use fx_kernels::cuda::{cuda_device, dev_ptr, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/mamba2/mamba2_step.cu` (compute_90).
const PTX_MAMBA2_STEP: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mamba2_step.ptx"));

/// Threads per block (`FX_S_THREADS`): 16 warps, one block per SM (`__launch_bounds__(512, 1)`).
const THREADS: u32 = 512;
/// `FX_S_FLAG_STAGE`: weight slices staged in shared memory by bulk copies (batch 1).
const FLAG_STAGE: u32 = 1;
/// Shared memory a block gets without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

/// `struct FxStepParams` of mamba2_step.cu, field for field (both sides assert 1496 bytes): per
/// layer the addresses of norm_w, in_proj, conv_w, conv_b, dt_bias, A_log, D, the gated norm's
/// weight, out_proj, the conv state and the SSM state; then embed_w, embed_b, norm_f, head_w,
/// head_b; batch, n_in, d_model, n_layer, d_inner, d_state, headdim, ngroups, d_conv; eps; flags
/// (bit 0: [`FLAG_STAGE`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Params {
    layer: [[u64; 11]; MAX_LAYERS],
    globals: [u64; 5],
    dims: [u32; 9],
    eps: f32,
    flags: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<Params>() == 1496);

/// One layer's tensors (F32, contiguous, on the kernel's device; element counts as the model's
/// shapes: weights `[out, in]`, `conv_w [conv_dim, 1, d_conv]` or `[conv_dim, d_conv]`).
#[derive(Debug, Clone, Copy)]
pub struct StepLayerTensors<'a> {
    pub norm_w: &'a Tensor,
    pub in_proj: &'a Tensor,
    pub conv_w: &'a Tensor,
    pub conv_b: &'a Tensor,
    pub dt_bias: &'a Tensor,
    pub a_log: &'a Tensor,
    pub d: &'a Tensor,
    /// The gated RMSNorm's weight `[d_inner]`.
    pub gnorm_w: &'a Tensor,
    pub out_proj: &'a Tensor,
    /// `[B, d_conv − 1, conv_dim]`, updated in place by every launch.
    pub conv_state: &'a Tensor,
    /// `[B, nheads, headdim, d_state]`, updated in place by every launch.
    pub ssm_state: &'a Tensor,
}

/// Every tensor of the step (see [`StepLayerTensors`]); `head_w` has `d_model` elements, `head_b` one.
#[derive(Debug, Clone)]
pub struct StepTensors<'a> {
    pub embed_w: &'a Tensor,
    pub embed_b: &'a Tensor,
    pub layers: Vec<StepLayerTensors<'a>>,
    pub norm_f: &'a Tensor,
    pub head_w: &'a Tensor,
    pub head_b: &'a Tensor,
}

/// The decode-step kernel bound to one model's parameters and one state (see the module docs).
#[derive(Debug)]
pub struct Mamba2StepKernel {
    func: CudaFunction,
    params: Params,
    dims: StepDims,
    /// Blocks of the launch's cluster (one of [`CLUSTER_SIZES`]).
    blocks: u32,
    /// Whether the weight slices are staged in shared memory (see the module docs).
    staged: bool,
    smem: u32,
    stream: Arc<CudaStream>,
    device: Device,
    /// Keeps the memory behind `params`' addresses allocated.
    _tensors: Vec<Tensor>,
}

/// Takes `t`'s address after checking it: F32, `n` elements, contiguous, on `device`. An empty
/// tensor (the conv state at `d_conv = 1`) is address 0, which the kernel never reads.
fn bind(
    t: &Tensor,
    n: usize,
    what: &'static str,
    stream: &CudaStream,
    device: &Device,
    keep: &mut Vec<Tensor>,
) -> Result<u64> {
    const CTX: &str = "Mamba2StepKernel::new";
    if t.elem_count() != n {
        return Err(Error::shape(what, CTX, format!("{n} elements"), format!("{:?}", t.dims())));
    }
    if t.dtype() != DType::F32 {
        return Err(Error::DType { what, expected: DType::F32, got: t.dtype(), context: CTX });
    }
    if !t.device().same_device(device) {
        return Err(Error::Device { what, expected: "the parameters' CUDA device".into(), context: CTX });
    }
    if n == 0 {
        return Ok(0);
    }
    keep.push(t.clone());
    dev_ptr::<f32>(t, stream, what, CTX)
}

/// The launch configuration of one cluster of `blocks` blocks of [`THREADS`] threads with `smem`
/// bytes of dynamic shared memory on `stream`; `attr` must outlive every use of the result.
fn cluster_config(
    blocks: u32,
    smem: u32,
    stream: &CudaStream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: blocks, y: 1, z: 1 };
    sys::CUlaunchConfig {
        gridDimX: blocks,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: THREADS,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attr,
        numAttrs: 1,
    }
}

/// A cluster attribute with no dimensions yet ([`cluster_config`] fills it).
fn cluster_attr() -> sys::CUlaunchAttribute {
    // SAFETY: a plain C struct of an enum whose zero is a valid value, padding and a union of
    // plain values; all zeros is a valid (empty) attribute.
    unsafe { std::mem::zeroed() }
}

/// Whether `f` can run one cluster of `blocks` blocks with `smem` bytes of shared memory each on
/// the stream's device: the opt-ins set (shared memory above the default, the non-portable
/// cluster size 16) and at least one such cluster resident at once (a MIG or MPS partition may
/// have too few SMs, a device may refuse 16).
fn cluster_fits(f: &CudaFunction, stream: &CudaStream, blocks: u32, smem: u32) -> bool {
    // Only ever raised: the function is shared by every kernel built on this device, and a
    // smaller setting would make an earlier, larger layout fail at launch.
    let max_dyn = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    if smem as usize > DEFAULT_SMEM
        && f.get_attribute(max_dyn).unwrap_or(0) < smem as i32
        && f.set_attribute(max_dyn, smem as i32).is_err()
    {
        return false;
    }
    if blocks > 8
        && f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1).is_err()
    {
        return false;
    }
    let mut attr = cluster_attr();
    let config = cluster_config(blocks, smem, stream, &mut attr);
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `f` is a loaded function of this context; `config` and the attribute it points to
    // live across the call.
    let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
    r == sys::CUresult::CUDA_SUCCESS && n > 0
}

impl Mamba2StepKernel {
    /// Binds the kernel to `t` (checked against `dims`: element counts, F32, contiguous, one
    /// CUDA device), on the first of [`CLUSTER_SIZES`] that fits the device, with its weights
    /// staged in shared memory where they fit ([`Self::stages_weights`]). Errors:
    /// [`Error::Unsupported`] beyond [`StepDims::supported`], below compute capability 9.0, or
    /// where no cluster of 8 blocks fits (fall back to candle's step then); shape, dtype and device
    /// errors for the tensors; a driver error if the module fails to load.
    pub fn new(dims: &StepDims, t: &StepTensors<'_>) -> Result<Self> {
        let layouts: Vec<(usize, bool)> = CLUSTER_SIZES
            .iter()
            .flat_map(|&b| [(b, true), (b, false)])
            .filter(|&(_, st)| !st || Self::can_stage(dims))
            .collect();
        Self::build(dims, t, &layouts)
    }

    /// [`Self::new`] on a cluster of exactly `blocks` blocks (one of [`CLUSTER_SIZES`]), the
    /// weights staged or not, e.g. to compare the layouts; [`Error::Unsupported`] if that layout
    /// does not fit or cannot stage these sizes.
    pub fn with_layout(dims: &StepDims, t: &StepTensors<'_>, blocks: usize, staged: bool) -> Result<Self> {
        if !CLUSTER_SIZES.contains(&blocks) || (staged && !Self::can_stage(dims)) {
            return Err(Error::Unsupported {
                context: "Mamba2StepKernel::with_layout",
                message: format!(
                    "a cluster of {blocks} blocks, staged {staged}; the kernel runs on {CLUSTER_SIZES:?} blocks and \
                     stages at batch 1 with d_model and d_inner multiples of 4"
                ),
            });
        }
        Self::build(dims, t, &[(blocks, staged)])
    }

    /// Whether the kernel can stage these sizes' weights: batch 1 (the `_b1` kernel), rows
    /// that are whole 16-byte pieces (bulk copies move 16-byte multiples).
    fn can_stage(dims: &StepDims) -> bool {
        dims.batch == 1 && dims.d_model.is_multiple_of(4) && dims.d_inner.is_multiple_of(4)
    }

    /// Whether the weight slices are staged in shared memory (batch 1 where they fit).
    pub fn stages_weights(&self) -> bool {
        self.staged
    }

    fn build(dims: &StepDims, t: &StepTensors<'_>, layouts: &[(usize, bool)]) -> Result<Self> {
        const CTX: &str = "Mamba2StepKernel::new";
        dims.supported(CTX)?;
        if t.layers.len() != dims.n_layer {
            return Err(Error::shape("layers", CTX, dims.n_layer, t.layers.len()));
        }
        let device = t.embed_w.device().clone();
        let cdev = cuda_device(&device, "embed_w", CTX)?;
        let stream = cdev.cuda_stream();
        let (major, minor) = stream.context().compute_capability().map_err(driver(CTX))?;
        if major < 9 {
            return Err(Error::Unsupported {
                context: CTX,
                message: format!("thread-block clusters need compute capability 9.0+, the device has {major}.{minor}"),
            });
        }
        let optin = stream
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver(CTX))?;
        let name = if dims.batch == 1 { "fx_m2_step_b1" } else { "fx_m2_step_b8" };
        let func = cdev.get_or_load_custom_func(name, "fx_mamba2_step", PTX_MAMBA2_STEP).ctx(CTX)?.into_cuda_function();
        stream.context().bind_to_thread().map_err(driver(CTX))?;
        let (dm, di, nh, cd) = (dims.d_model, dims.d_inner, dims.nheads(), dims.conv_dim());
        let mut keep = Vec::new();
        let mut p = Params::default();
        let mut b = |x: &Tensor, n: usize, what: &'static str| bind(x, n, what, &stream, &device, &mut keep);
        for (slot, l) in p.layer.iter_mut().zip(&t.layers) {
            *slot = [
                b(l.norm_w, dm, "norm_w")?,
                b(l.in_proj, dims.in_proj_rows() * dm, "in_proj")?,
                b(l.conv_w, cd * dims.d_conv, "conv_w")?,
                b(l.conv_b, cd, "conv_b")?,
                b(l.dt_bias, nh, "dt_bias")?,
                b(l.a_log, nh, "a_log")?,
                b(l.d, nh, "d")?,
                b(l.gnorm_w, di, "gnorm_w")?,
                b(l.out_proj, dm * di, "out_proj")?,
                b(l.conv_state, dims.conv_state_len(), "conv_state")?,
                b(l.ssm_state, dims.ssm_state_len(), "ssm_state")?,
            ];
        }
        p.globals = [
            b(t.embed_w, dm * dims.n_in, "embed_w")?,
            b(t.embed_b, dm, "embed_b")?,
            b(t.norm_f, dm, "norm_f")?,
            b(t.head_w, dm, "head_w")?,
            b(t.head_b, 1, "head_b")?,
        ];
        // Bulk copies need 16-byte aligned sources: a parameter that is a view at an odd
        // offset rules staging out.
        let weights = p.layer.iter().take(dims.n_layer).flat_map(|l| [l[1], l[8]]);
        let aligned = weights.chain([p.globals[0], p.globals[2], p.globals[3]]).all(|a| a.is_multiple_of(16));
        let fit =
            layouts.iter().filter(|&&(_, staged)| aligned || !staged).find_map(|&(blocks, staged)| {
                let bytes = dims.smem_floats(blocks, staged) * 4;
                (bytes <= optin.max(0) as usize && cluster_fits(&func, &stream, blocks as u32, bytes as u32))
                    .then_some((blocks as u32, staged, bytes as u32))
            });
        let Some((blocks, staged, smem)) = fit else {
            let least = layouts.iter().map(|&(b, st)| dims.smem_floats(b, st) * 4).min().unwrap_or(0);
            return Err(Error::Unsupported {
                context: CTX,
                message: format!(
                    "no cluster of {layouts:?} (blocks, staged) of {THREADS} threads fits on this device ({least} \
                     bytes of shared memory a block at least; it allows {optin})"
                ),
            });
        };
        // The opt-ins of a larger size tried first stay set; they allow, they do not require.

        // `supported` bounds every size far below 2^31.
        let u = |v: usize| v as u32;
        p.dims = [
            u(dims.batch),
            u(dims.n_in),
            u(dm),
            u(dims.n_layer),
            u(di),
            u(dims.d_state),
            u(dims.headdim),
            u(dims.ngroups),
            u(dims.d_conv),
        ];
        p.eps = dims.eps as f32;
        p.flags = if staged { FLAG_STAGE } else { 0 };
        Ok(Self { func, params: p, dims: *dims, blocks, staged, smem, stream, device, _tensors: keep })
    }

    /// The sizes it was built for.
    pub fn dims(&self) -> &StepDims {
        &self.dims
    }

    /// The CUDA device of every tensor.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks of the launch's cluster (one of [`CLUSTER_SIZES`]).
    pub fn cluster_blocks(&self) -> usize {
        self.blocks as usize
    }

    /// Queues one step on candle's stream (no sync): reads `x [B, n_in]`, updates the bound state
    /// in place and writes the predictions into `pred [B]` (both F32, contiguous, on the kernel's
    /// device).
    pub fn launch(&self, x: &Tensor, pred: &Tensor) -> Result<()> {
        const CTX: &str = "Mamba2StepKernel::launch";
        expect_tensor(x, "x", CTX, &[self.dims.batch, self.dims.n_in], DType::F32, &self.device)?;
        expect_tensor(pred, "pred", CTX, &[self.dims.batch], DType::F32, &self.device)?;
        let px = dev_ptr::<f32>(x, &self.stream, "x", CTX)?;
        let pp = dev_ptr::<f32>(pred, &self.stream, "pred", CTX)?;
        let (mut p, mut px, mut pp) = (self.params, px, pp);
        let mut args: [*mut c_void; 3] = [
            &mut p as *mut Params as *mut c_void,
            &mut px as *mut u64 as *mut c_void,
            &mut pp as *mut u64 as *mut c_void,
        ];
        self.stream.context().bind_to_thread().map_err(driver(CTX))?;
        let mut attr = cluster_attr();
        let config = cluster_config(self.blocks, self.smem, &self.stream, &mut attr);
        // SAFETY: the arguments match fx_m2_step_b{1,8}'s signature (FxStepParams by value, two
        // pointers); the grid is one cluster of `blocks` (checked to fit in `new`, with its
        // opt-ins set) with the shared memory the kernel carves (StepDims::smem_floats); every
        // address in `p` was checked in `new` and is kept allocated by `self`; `x` and `pred`
        // were checked above and live until the kernel ran (candle frees stream-ordered);
        // `config` and `attr` live across the call.
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(driver(CTX))
    }
}

#[cfg(test)]
mod tests {
    //! Device tests: the kernel against [`crate::mamba2::decode_ref::step`] over a few steps on fresh
    //! random parameters and state (the seed is printed), predictions poisoned with NaN before
    //! each launch, on every cluster size the device runs; bit-identical repeats; refusals. Each
    //! test returns early without a GPU of compute capability 9.0+.
    use super::*;
    use crate::mamba2::decode_ref::testing::{fresh_seed, random_model, uniform};
    use crate::mamba2::decode_ref::{step, HostStepParams, LayerState};
    use fx_hw::test_gpu as gpu;

    /// A Hopper+ device, or None (the test is skipped).
    fn hopper(test: &str) -> Option<Device> {
        let dev = gpu(test)?;
        let Device::Cuda(cd) = &dev else { return None };
        match cd.cuda_stream().context().compute_capability() {
            Ok((major, _)) if major >= 9 => Some(dev),
            other => {
                eprintln!("{test}: skipped, compute capability {other:?} < 9.0");
                None
            }
        }
    }

    fn up(dev: &Device, v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), v.len(), dev).unwrap()
    }

    /// F32-representable values (the testing draws) as an F32 tensor.
    fn up64(dev: &Device, v: &[f64]) -> Tensor {
        up(dev, &v.iter().map(|&x| x as f32).collect::<Vec<_>>())
    }

    fn down(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// ‖got − want‖ / ‖want‖, every element finite.
    fn check(what: &str, got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(i) = got.iter().position(|v| !v.is_finite()) {
            panic!("{what}[{i}] = {} is not finite (unwritten?)", got[i]);
        }
        let num = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let den = want.iter().map(|b| b * b).sum::<f64>().sqrt();
        let e = num / den.max(1e-30);
        eprintln!("{what}: rel err {e:.2e}");
        assert!(e <= tol, "{what}: rel err {e} > {tol}");
    }

    /// Device copies of a model's parameters (in [`StepTensors`] order) and state.
    struct Dev {
        globals: Vec<Tensor>,
        layers: Vec<Vec<Tensor>>,
        conv: Vec<Tensor>,
        ssm: Vec<Tensor>,
    }

    fn upload(dev: &Device, (p, st): &(HostStepParams, Vec<LayerState>)) -> Dev {
        Dev {
            globals: p.globals.iter().map(|v| up64(dev, v)).collect(),
            layers: p.layers.iter().map(|l| l.iter().map(|v| up64(dev, v)).collect()).collect(),
            conv: st.iter().map(|s| up64(dev, &s.conv)).collect(),
            ssm: st.iter().map(|s| up64(dev, &s.ssm)).collect(),
        }
    }

    fn tensors(t: &Dev) -> StepTensors<'_> {
        let layers = t
            .layers
            .iter()
            .zip(t.conv.iter().zip(&t.ssm))
            .map(|(l, (c, s))| StepLayerTensors {
                norm_w: &l[0],
                in_proj: &l[1],
                conv_w: &l[2],
                conv_b: &l[3],
                dt_bias: &l[4],
                a_log: &l[5],
                d: &l[6],
                gnorm_w: &l[7],
                out_proj: &l[8],
                conv_state: c,
                ssm_state: s,
            })
            .collect();
        let g = &t.globals;
        StepTensors { embed_w: &g[0], embed_b: &g[1], layers, norm_f: &g[2], head_w: &g[3], head_b: &g[4] }
    }

    fn dims(batch: usize, n_in: usize, d_model: usize, n_layer: usize, d_inner: usize) -> StepDims {
        StepDims { batch, n_in, d_model, n_layer, d_inner, d_state: 64, headdim: 64, ngroups: 1, d_conv: 4, eps: 1e-5 }
    }

    #[test]
    fn step_kernel_matches_reference() {
        const T: &str = "step_kernel_matches_reference";
        let Some(dev) = hopper(T) else { return };
        let seed = fresh_seed(T);
        let default = dims(1, 51, 256, 4, 512);
        let cases = [
            default,
            StepDims { batch: 3, ..default },
            StepDims { batch: 8, ..default },
            // d_state 33 (crosses a warp), 3 groups, d_conv 2
            StepDims {
                batch: 8,
                n_in: 7,
                d_model: 24,
                n_layer: 2,
                d_inner: 48,
                d_state: 33,
                headdim: 8,
                ngroups: 3,
                d_conv: 2,
                eps: 1e-5,
            },
            // d_model 6: scalar GEMV loads; d_state 128; d_conv 2 (d_conv 1, with no conv state,
            // is left to the CPU tests: CUDA refuses the zero-byte allocation of its state)
            StepDims {
                batch: 2,
                n_in: 6,
                d_model: 6,
                n_layer: 3,
                d_inner: 12,
                d_state: 128,
                headdim: 4,
                ngroups: 1,
                d_conv: 2,
                eps: 1e-5,
            },
            // 16 layers, 4 groups, most blocks with short or empty slices
            StepDims {
                batch: 1,
                n_in: 9,
                d_model: 20,
                n_layer: 16,
                d_inner: 40,
                d_state: 8,
                headdim: 10,
                ngroups: 4,
                d_conv: 3,
                eps: 1e-5,
            },
        ];
        let layouts = CLUSTER_SIZES.iter().flat_map(|&b| [(b, false), (b, true)]);
        let mut staged_runs = 0;
        for (ci, d, (blocks, staged)) in
            cases.into_iter().enumerate().flat_map(|(ci, d)| layouts.clone().map(move |l| (ci, d, l)))
        {
            let h = random_model(&d, seed.wrapping_add(ci as u64));
            let t = upload(&dev, &h);
            let k = match Mamba2StepKernel::with_layout(&d, &tensors(&t), blocks, staged) {
                Ok(k) => k,
                // 16 is non-portable: a device may refuse it, and staging needs batch 1, aligned
                // rows and room (8 unstaged blocks must run on every Hopper+). Only a refusal
                // skips; any other error fails the test.
                Err(e @ Error::Unsupported { .. }) if blocks > 8 || staged => {
                    eprintln!("{T}: case {ci} on {blocks} blocks, staged {staged}, skipped: {e}");
                    continue;
                }
                Err(e) => panic!("case {ci} on {blocks} blocks, staged {staged}: {e}"),
            };
            staged_runs += usize::from(staged);
            let p = h.0.view();
            let mut st = h.1.clone();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for s in 0..3u64 {
                let x = uniform(d.batch * d.n_in, seed, 1000 + 10 * ci as u64 + s, -1.0, 1.0);
                let pred = up(&dev, &vec![f32::NAN; d.batch]);
                k.launch(&up64(&dev, &x).reshape((d.batch, d.n_in)).unwrap(), &pred).unwrap();
                got.extend(down(&pred));
                want.extend(step(&d, &p, &mut st, &x).unwrap());
            }
            let tag = format!("case {ci} on {blocks} blocks, staged {staged}, {d:?}");
            check(&format!("{tag}: predictions"), &got, &want, 1e-5);
            for (l, s) in st.iter().enumerate() {
                // Layer l's conv state holds l layers of F32 rounding: 1e-5, as the ssm state
                // and the predictions (1e-6 held to 4 layers; the 16-layer case reached
                // 1.0e-6 at layer 14 on a fresh seed).
                check(&format!("{tag}: layer {l} conv state"), &down(&t.conv[l]), &s.conv, 1e-5);
                check(&format!("{tag}: layer {l} ssm state"), &down(&t.ssm[l]), &s.ssm, 1e-5);
            }
        }
        // The two batch-1 shapes stage on 16 blocks on any Hopper (the 16-layer one on 8 too).
        assert!(staged_runs > 0, "no staged layout ran");
    }

    /// The same two steps from the same state, three times with `new`'s layout (the largest
    /// cluster that fits, staged at batch 1) and once unstaged on the same cluster:
    /// bit-identical predictions and states (every sum runs in a fixed order; staging changes
    /// where weights are read, not the arithmetic).
    #[test]
    fn step_kernel_is_deterministic() {
        const T: &str = "step_kernel_is_deterministic";
        let Some(dev) = hopper(T) else { return };
        let seed = fresh_seed(T);
        let d = dims(1, 51, 256, 4, 512);
        let h = random_model(&d, seed);
        let x = up64(&dev, &uniform(d.batch * d.n_in, seed, 999, -1.0, 1.0)).reshape((d.batch, d.n_in)).unwrap();
        let mut outs = Vec::new();
        let mut layout: Option<(usize, bool)> = None;
        let mut first_staged = false;
        for run in 0..4 {
            let t = upload(&dev, &h);
            let k = match layout {
                Some((blocks, _)) if run == 3 => {
                    Mamba2StepKernel::with_layout(&d, &tensors(&t), blocks, false).unwrap()
                }
                _ => Mamba2StepKernel::new(&d, &tensors(&t)).unwrap(),
            };
            layout = Some((k.cluster_blocks(), k.stages_weights()));
            first_staged |= run == 0 && k.stages_weights();
            eprintln!("{T}: {} blocks, staged {}", k.cluster_blocks(), k.stages_weights());
            let pred = up(&dev, &vec![f32::NAN; d.batch]);
            k.launch(&x, &pred).unwrap();
            k.launch(&x, &pred).unwrap();
            let mut all = down(&pred);
            for s in t.conv.iter().chain(&t.ssm) {
                all.extend(down(s));
            }
            outs.push(all);
        }
        assert!(outs[0].iter().all(|v| v.is_finite()));
        assert!(outs[0] == outs[1] && outs[0] == outs[2], "runs differ");
        assert!(first_staged, "new() stages the default size at batch 1 on a Hopper");
        assert!(layout.is_some_and(|(_, staged)| !staged), "run 3 is the unstaged one");
        assert!(outs[0] == outs[3], "staging changed a result");
    }

    #[test]
    fn step_kernel_refuses_what_it_cannot_run() {
        const T: &str = "step_kernel_refuses_what_it_cannot_run";
        let Some(dev) = hopper(T) else { return };
        let d = dims(1, 5, 16, 1, 32);
        let h = random_model(&StepDims { d_state: 8, headdim: 8, ..d }, 1);
        let t = upload(&dev, &h);
        let too_big = StepDims { batch: 9, d_state: 8, headdim: 8, ..d };
        assert!(matches!(Mamba2StepKernel::new(&too_big, &tensors(&t)), Err(Error::Unsupported { .. })));
        let ok = StepDims { d_state: 8, headdim: 8, ..d };
        assert!(matches!(Mamba2StepKernel::with_layout(&ok, &tensors(&t), 4, false), Err(Error::Unsupported { .. })));
        // state sized for batch 1 against dims for batch 2
        let two = StepDims { batch: 2, d_state: 8, headdim: 8, ..d };
        assert!(matches!(Mamba2StepKernel::new(&two, &tensors(&t)), Err(Error::Shape { .. })));
        let k = Mamba2StepKernel::new(&StepDims { d_state: 8, headdim: 8, ..d }, &tensors(&t)).unwrap();
        let pred = up(&dev, &[0.0]);
        assert!(k.launch(&up(&dev, &[0.0; 4]).reshape((1, 4)).unwrap(), &pred).is_err(), "x of the wrong width");
        let x = up(&dev, &[0.0; 5]).reshape((1, 5)).unwrap();
        assert!(k.launch(&x, &up(&dev, &[0.0, 0.0])).is_err(), "pred of the wrong length");
        k.launch(&x, &pred).unwrap();
    }

    /// Device time of one step at the default size (200 launches back to back between two events),
    /// on each cluster size, at batch 1 and 8: `--ignored --nocapture`.
    #[test]
    #[ignore]
    fn step_kernel_timing() {
        use cudarc::driver::sys::CUevent_flags;
        const T: &str = "step_kernel_timing";
        let Some(dev) = hopper(T) else { return };
        for batch in [1usize, 8] {
            let d = dims(batch, 51, 256, 4, 512);
            let h = random_model(&d, 5);
            let t = upload(&dev, &h);
            let x = up64(&dev, &uniform(batch * d.n_in, 5, 999, -1.0, 1.0)).reshape((batch, d.n_in)).unwrap();
            let pred = up(&dev, &vec![0.0; batch]);
            let Device::Cuda(cd) = &dev else { return };
            let stream = cd.cuda_stream();
            for (blocks, staged) in CLUSTER_SIZES.iter().flat_map(|&b| [(b, true), (b, false)]) {
                let Ok(k) = Mamba2StepKernel::with_layout(&d, &tensors(&t), blocks, staged) else { continue };
                for _ in 0..50 {
                    k.launch(&x, &pred).unwrap();
                }
                let ctx = stream.context();
                let (a, b) = (
                    ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap(),
                    ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap(),
                );
                a.record(&stream).unwrap();
                for _ in 0..200 {
                    k.launch(&x, &pred).unwrap();
                }
                b.record(&stream).unwrap();
                stream.synchronize().unwrap();
                let us = a.elapsed_ms(&b).unwrap() as f64 * 1e3 / 200.0;
                eprintln!("{T}: batch {batch}, {blocks} blocks, staged {staged}: {us:.2} us per step (device time)");
            }
        }
    }
}
