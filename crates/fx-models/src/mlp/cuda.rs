//! Fused greedy policies (`kernels/mlp/mlp_forward.cu`): a dueling DQN's or a PPO actor's greedy
//! action in one kernel launch instead of ~20 candle launches, for microsecond batch-1
//! decisions. [`MlpPolicy`] runs on device tensors; [`MlpDecider`] takes host slices through
//! mapped page-locked buffers (host in, action out: one launch, one sync, no allocation);
//! [`MlpServer`] keeps one block (or one cluster) resident and answers through mapped memory
//! with no launch and no sync at all.
//!
//! Two kernels compute the same thing ([`MlpKernel`]): a block per row
//! (`kernels/mlp/mlp_forward.cu`, any arch), and on Hopper and later a cluster of
//! [`CLUSTER_BLOCKS`] blocks per row (`kernels/mlp/mlp_cluster.cu`), which spreads each layer
//! over as many SMs (on the H200 the DQN kernel takes 6.25 µs that way against 9.91 µs on
//! one block, `docs/PERFORMANCE.md`). Every neuron is summed in the same order by both, so they agree bit for bit.
//! What both compute, in f64, is [`crate::mlp::reference::reference_greedy`]; the limits are
//! [`crate::mlp::reference`]'s.
//!
//! The weights are read through raw device pointers taken once, at construction. The policy
//! keeps clones of the tensors, so their memory stays allocated, and it sees every in-place
//! update (`Var::set`, the optimisers), which run before it on the same stream. A parameter
//! whose storage is replaced (a new `Var`, a reloaded model built anew) is not seen: build a
//! new policy then. The stream is the device's: with `fx_hw::open_cuda` one stream of its
//! own, so calls from any thread are ordered after the updates; with candle's
//! `Device::new_cuda` CUDA's per-thread default stream, where a call from another thread is
//! not ordered after the training thread's updates.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use cudarc::driver::{result, sys, CudaFunction, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use crate::mlp::int8::{self, I8Mlp, MlpI8Params};
use crate::mlp::reference::{GreedyMlp, Head, MlpDims, MAX_HIDDEN};
use fx_kernels::checks::expect_tensor;
use fx_kernels::cuda::{alloc_tensor, cuda_device, dev_ptr, driver, sm_count};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/mlp/mlp_forward.cu` (fused greedy policy MLPs).
const PTX_MLP: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mlp_forward.ptx"));

/// PTX of `kernels/mlp/mlp_cluster.cu` (the same policies on a thread-block cluster per row; compute_90, loaded only on Hopper and later).
const PTX_MLP_CLUSTER: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mlp_cluster.ptx"));

/// PTX of `kernels/mlp/mlp_int8.cu` (INT8 greedy policies, `MlpPolicy::new_int8`).
const PTX_MLP_INT8: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mlp_int8.ptx"));

/// Threads per block (the kernel's `__launch_bounds__`): 16 warps share one row's layers.
const BLOCK: u32 = 512;
/// Most blocks per launch; larger batches loop grid-stride inside the kernel.
const MAX_GRID: usize = 65_535;
/// Blocks per row of the cluster kernel (`FX_CLUSTER` in mlp_cluster.cu; 8 is the portable
/// cluster size).
pub const CLUSTER_BLOCKS: usize = 8;
/// Threads per block of the cluster kernel.
const CLUSTER_BLOCK: u32 = 256;
/// Batches up to this many rows take the cluster kernel under [`MlpKernel::Auto`]; beyond,
/// a block per row already fills the GPU with rows and the cluster's barriers only cost.
pub const CLUSTER_MAX_ROWS: usize = 16;

/// Which kernel computes a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlpKernel {
    /// The cluster kernel for batches of at most [`CLUSTER_MAX_ROWS`] rows where the device
    /// has it (compute capability 9.0+), else a block per row.
    #[default]
    Auto,
    /// One thread block per row (`fx_mlp_greedy`), on every device.
    BlockPerRow,
    /// A cluster of [`CLUSTER_BLOCKS`] blocks per row (`fx_mlp_greedy_cluster`), Hopper+.
    Cluster,
}

/// `struct FxMlpParams` of mlp_forward.cu, field for field (both sides assert 152 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MlpParams {
    w: [u64; MAX_HIDDEN + 2],
    b: [u64; MAX_HIDDEN + 2],
    width: [u32; MAX_HIDDEN + 1],
    act: [u32; MAX_HIDDEN],
    n_hidden: u32,
    n_actions: u32,
    head: u32,
    vec4_mask: u32,
}
const _: () = assert!(std::mem::size_of::<MlpParams>() == 152);
// SAFETY: plain data whose layout (repr(C): the same field order, types and size as
// FxMlpParams) is what the kernel reads from its by-value parameter.
unsafe impl DeviceRepr for MlpParams {}

/// A greedy policy network bound to its weights on a CUDA device (see the module docs for
/// how the weights are held).
#[derive(Debug, Clone)]
pub struct MlpPolicy {
    program: Program,
    dims: MlpDims,
    /// The block kernel: `fx_mlp_greedy` (F32) or `fx_mlp_i8_greedy` (INT8, one or two rows
    /// a block).
    func: CudaFunction,
    kernel: MlpKernel,
    stream: Arc<CudaStream>,
    device: Device,
    /// Keeps the memory behind the parameter block's pointers allocated.
    _weights: Vec<Tensor>,
}

/// What a policy's kernels read.
#[derive(Debug, Clone)]
enum Program {
    /// F32 weights (the model's own tensors); `cluster` is `fx_mlp_greedy_cluster`, where
    /// the device runs clusters.
    F32 { params: MlpParams, cluster: Option<CudaFunction> },
    /// INT8 weights in the policy's own buffers (`kernels/mlp/mlp_int8.cu`); `sms` sizes the
    /// rows per block; `wide` is `fx_mlp_i8_greedy_wide`, for four or eight rows a block.
    Int8 { params: MlpI8Params, sms: usize, wide: CudaFunction },
}

impl MlpPolicy {
    /// Binds `net` (F32 contiguous tensors on one CUDA device). Errors: the shape checks of
    /// [`GreedyMlp::dims`], [`Error::Unsupported`] beyond the kernel's limits (fall back to
    /// candle then), a device error off CUDA, a strided tensor, or the module failing to load.
    pub fn new(net: &GreedyMlp<'_>) -> Result<Self> {
        const CTX: &str = "MlpPolicy::new";
        let dims = net.dims()?;
        let tensors = net.tensors();
        let device = tensors[0].device().clone();
        let cdev = cuda_device(&device, "weights", CTX)?;
        let stream = cdev.cuda_stream();
        let mut p = MlpParams::default();
        for (i, pair) in tensors.chunks(2).enumerate() {
            p.w[i] = dev_ptr::<f32>(pair[0], &stream, "weight", CTX)?;
            p.b[i] = dev_ptr::<f32>(pair[1], &stream, "bias", CTX)?;
        }
        let nh = net.hidden.len();
        p.width[0] = dims.input as u32;
        for (l, (&w, (_, act))) in dims.hidden.iter().zip(net.hidden).enumerate() {
            p.width[l + 1] = w as u32;
            p.act[l] = *act as u32;
        }
        (p.n_hidden, p.n_actions) = (nh as u32, dims.n_actions as u32);
        p.head = matches!(net.head, Head::Dueling { .. }) as u32;
        // float4 row reads need every row of the layer 16-byte aligned: `in` a multiple of 4
        // and the matrix base aligned (a view at an odd offset falls back to scalar reads).
        for l in 0..=nh {
            let mats = if l == nh { &p.w[l..l + 1 + p.head as usize] } else { &p.w[l..l + 1] };
            if p.width[l] % 4 == 0 && mats.iter().all(|&w| w % 16 == 0) {
                p.vec4_mask |= 1 << l;
            }
        }
        let func = cdev.get_or_load_custom_func("fx_mlp_greedy", "fx_mlp_forward", PTX_MLP).ctx(CTX)?;
        let cluster = if runs_clusters(&stream, CTX)? {
            let f =
                cdev.get_or_load_custom_func("fx_mlp_greedy_cluster", "fx_mlp_cluster", PTX_MLP_CLUSTER).ctx(CTX)?;
            let f = f.into_cuda_function();
            // A partition (MIG, MPS) may not fit 8 co-resident blocks: keep the block-per-row
            // kernel there instead of failing every small launch.
            cluster_fits(&f, &stream).then_some(f)
        } else {
            None
        };
        Ok(Self {
            program: Program::F32 { params: p, cluster },
            dims,
            func: func.into_cuda_function(),
            kernel: MlpKernel::Auto,
            stream,
            device,
            _weights: tensors.into_iter().cloned().collect(),
        })
    }

    /// Uploads the INT8 policy `net` to `device` (its own copy of the weights, in the
    /// kernel's layout, [`crate::mlp::int8::I8Image`]) and binds `fx_mlp_i8_greedy` and
    /// `fx_mlp_i8_greedy_wide` (`kernels/mlp/mlp_int8.cu`; a launch picks one by its rows per block): the scores of `fx_quant::reference::reference_scores`, bit
    /// for bit, for any batch. It has no cluster kernel and no resident server. Errors: the
    /// checks of [`I8Mlp::dims`], a device error off CUDA, or the module failing to load.
    pub fn new_int8(net: &I8Mlp<'_>, device: &Device) -> Result<Self> {
        const CTX: &str = "MlpPolicy::new_int8";
        let img = net.image()?;
        let cdev = cuda_device(device, "device", CTX)?;
        let stream = cdev.cuda_stream();
        let words = Tensor::from_slice(&img.words, img.words.len(), device).ctx(CTX)?;
        let floats = Tensor::from_slice(&img.floats, img.floats.len(), device).ctx(CTX)?;
        let params = img
            .params(dev_ptr::<u32>(&words, &stream, "weights", CTX)?, dev_ptr::<f32>(&floats, &stream, "scales", CTX)?);
        let func = cdev.get_or_load_custom_func("fx_mlp_i8_greedy", "fx_mlp_int8", PTX_MLP_INT8).ctx(CTX)?;
        let wide = cdev.get_or_load_custom_func("fx_mlp_i8_greedy_wide", "fx_mlp_int8", PTX_MLP_INT8).ctx(CTX)?;
        let sms = sm_count(&stream, CTX)? as usize;
        Ok(Self {
            program: Program::Int8 { params, sms, wide: wide.into_cuda_function() },
            dims: img.dims,
            func: func.into_cuda_function(),
            kernel: MlpKernel::Auto,
            stream,
            device: device.clone(),
            _weights: vec![words, floats],
        })
    }

    /// The network's dimensions.
    pub fn dims(&self) -> &MlpDims {
        &self.dims
    }

    /// Whether the device runs the cluster kernel (compute capability 9.0 or later).
    pub fn has_cluster_kernel(&self) -> bool {
        self.cluster().is_some()
    }

    /// The cluster kernel of an F32 policy on a device that runs clusters.
    fn cluster(&self) -> Option<&CudaFunction> {
        match &self.program {
            Program::F32 { cluster, .. } => cluster.as_ref(),
            Program::Int8 { .. } => None,
        }
    }

    /// Whether the policy runs INT8 weights ([`MlpPolicy::new_int8`]).
    pub fn is_int8(&self) -> bool {
        matches!(self.program, Program::Int8 { .. })
    }

    /// The kernel choice (default [`MlpKernel::Auto`]).
    pub fn kernel(&self) -> MlpKernel {
        self.kernel
    }

    /// The kernel that computes a batch of `rows` rows.
    pub fn kernel_for(&self, rows: usize) -> MlpKernel {
        match self.kernel {
            MlpKernel::Auto if self.cluster().is_some() && rows <= CLUSTER_MAX_ROWS => MlpKernel::Cluster,
            MlpKernel::Auto => MlpKernel::BlockPerRow,
            k => k,
        }
    }

    /// Chooses the kernel; [`MlpKernel::Cluster`] on a device without clusters is an
    /// [`Error::Unsupported`].
    pub fn set_kernel(&mut self, kernel: MlpKernel) -> Result<()> {
        if kernel == MlpKernel::Cluster && self.cluster().is_none() {
            return Err(Error::Unsupported {
                context: "MlpPolicy::set_kernel",
                message: if self.is_int8() {
                    "INT8 policies have no cluster kernel".into()
                } else {
                    "the cluster kernel needs compute capability 9.0 or later".into()
                },
            });
        }
        self.kernel = kernel;
        Ok(())
    }

    /// The CUDA device of the weights (and of every tensor passed in).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The rows of `obs [B, input]` (F32) after checking it, `actions [B]` (U32) and
    /// `values [B, n_actions]` (F32) against this policy.
    fn check_buffers(
        &self,
        obs: &Tensor,
        actions: &Tensor,
        values: Option<&Tensor>,
        ctx: &'static str,
    ) -> Result<usize> {
        let b = obs.dim(0).ctx(ctx)?;
        expect_tensor(obs, "obs", ctx, &[b, self.dims.input], DType::F32, &self.device)?;
        expect_tensor(actions, "actions", ctx, &[b], DType::U32, &self.device)?;
        if let Some(v) = values {
            expect_tensor(v, "values", ctx, &[b, self.dims.n_actions], DType::F32, &self.device)?;
        }
        Ok(b)
    }

    /// Greedy actions of `obs [B, input]` (F32) into `actions [B]` (U32, contiguous) and,
    /// when given, the scores (Q values or logits) into `values [B, n_actions]` (F32,
    /// contiguous); both are overwritten in place. One launch on candle's stream, no sync.
    pub fn greedy_into(&self, obs: &Tensor, actions: &Tensor, values: Option<&Tensor>) -> Result<()> {
        const CTX: &str = "MlpPolicy::greedy_into";
        let b = self.check_buffers(obs, actions, values, CTX)?;
        if b == 0 {
            return Ok(());
        }
        let obs = obs.contiguous().ctx(CTX)?;
        let p_obs = dev_ptr::<f32>(&obs, &self.stream, "obs", CTX)?;
        let p_act = dev_ptr::<u32>(actions, &self.stream, "actions", CTX)?;
        let p_val = values.map(|v| dev_ptr::<f32>(v, &self.stream, "values", CTX)).transpose()?.unwrap_or(0);
        // SAFETY: shapes, dtypes and device checked above; the tensors outlive the enqueue
        // and candle frees stream-ordered (see the cuda module docs).
        unsafe { self.launch(p_obs, b, p_act, p_val, CTX) }
    }

    /// A launch bound once to fixed device buffers (`obs [B, input]` F32, `actions [B]` U32
    /// and optionally `values [B, n_actions]` F32, all contiguous, checked here): each
    /// [`BoundGreedy::launch`] is then the kernel launch alone, with no shape checks and no
    /// per-call pointer lookups (cudarc adds an event wait and record per tensor to those
    /// once a process has a second stream; in the H200 bench, with one stream, bound and
    /// checked calls timed the same: 14.10 against 14.07 µs). For a decision loop whose
    /// observation already sits in a device buffer that it rewrites in place.
    pub fn bind(&self, obs: &Tensor, actions: &Tensor, values: Option<&Tensor>) -> Result<BoundGreedy> {
        const CTX: &str = "MlpPolicy::bind";
        let b = self.check_buffers(obs, actions, values, CTX)?;
        if b == 0 {
            return Err(Error::shape("obs", CTX, "at least one row", "0 rows"));
        }
        let p_obs = dev_ptr::<f32>(obs, &self.stream, "obs", CTX)?;
        let p_actions = dev_ptr::<u32>(actions, &self.stream, "actions", CTX)?;
        let p_values = values.map(|v| dev_ptr::<f32>(v, &self.stream, "values", CTX)).transpose()?.unwrap_or(0);
        Ok(BoundGreedy {
            policy: self.clone(),
            rows: b,
            p_obs,
            p_actions,
            p_values,
            _buffers: [Some(obs.clone()), Some(actions.clone()), values.cloned()],
        })
    }

    /// Greedy actions `[B]` (U32) of `obs [B, input]`.
    pub fn greedy(&self, obs: &Tensor) -> Result<Tensor> {
        Ok(self.greedy_with_values(obs, false)?.0)
    }

    /// Greedy actions `[B]` (U32) and, when `with_values`, the scores `[B, n_actions]` (F32).
    pub fn greedy_with_values(&self, obs: &Tensor, with_values: bool) -> Result<(Tensor, Option<Tensor>)> {
        const CTX: &str = "MlpPolicy::greedy";
        let b = obs.dim(0).ctx(CTX)?;
        if b == 0 {
            let v = with_values.then(|| Tensor::zeros((0, self.dims.n_actions), DType::F32, &self.device));
            return Ok((Tensor::zeros(0, DType::U32, &self.device).ctx(CTX)?, v.transpose().ctx(CTX)?));
        }
        let cdev = cuda_device(&self.device, "obs", CTX)?;
        let actions = alloc_tensor::<u32>(cdev, &[b], CTX)?;
        let values = with_values.then(|| alloc_tensor::<f32>(cdev, &[b, self.dims.n_actions], CTX)).transpose()?;
        self.greedy_into(obs, &actions, values.as_ref())?;
        Ok((actions, values))
    }

    /// Enqueues the kernel for `batch >= 1` rows at raw device addresses (`values` 0: none),
    /// without allocating (the argument array lives on the stack).
    ///
    /// # Safety
    /// `obs` holds `batch × input` f32, `actions` `batch` u32 and `values` (unless 0)
    /// `batch × n_actions` f32, all on this policy's device and alive until the kernel ends.
    unsafe fn launch(&self, obs: u64, batch: usize, actions: u64, values: u64, ctx: &'static str) -> Result<()> {
        let rows = u32::try_from(batch)
            .map_err(|_| Error::shape("obs", ctx, "at most 2^32 - 1 rows", format!("{batch} rows")))?;
        let (mut obs, mut rows_arg, mut actions, mut values) = (obs, rows, actions, values);
        // Both parameter blocks live on this frame; the argument array points at one of them.
        let (mut p32, mut p8);
        let params: *mut c_void;
        self.stream.context().bind_to_thread().map_err(driver(ctx))?;
        let (func, grid, block, smem) = match &self.program {
            Program::Int8 { params: p, sms, wide } => {
                p8 = *p;
                p8.rows = int8::rows_per_block(&p8, batch, *sms);
                params = &mut p8 as *mut MlpI8Params as *mut c_void;
                let grid = batch.div_ceil(p8.rows as usize).min(MAX_GRID) as u32;
                let f = if p8.rows <= 2 { &self.func } else { wide };
                (f, grid, int8::block_threads(p8.rows), int8::smem_bytes(&p8, p8.rows) as u32)
            }
            Program::F32 { params: p, cluster } => {
                p32 = *p;
                params = &mut p32 as *mut MlpParams as *mut c_void;
                match (self.kernel_for(batch), cluster) {
                    (MlpKernel::Cluster, Some(f)) => {
                        (f, (batch.min(MAX_GRID / CLUSTER_BLOCKS) * CLUSTER_BLOCKS) as u32, CLUSTER_BLOCK, 0)
                    }
                    _ => (&self.func, batch.min(MAX_GRID) as u32, BLOCK, 0),
                }
            }
        };
        let mut args: [*mut c_void; 5] = [
            params,
            &mut obs as *mut u64 as *mut c_void,
            &mut rows_arg as *mut u32 as *mut c_void,
            &mut actions as *mut u64 as *mut c_void,
            &mut values as *mut u64 as *mut c_void,
        ];
        // SAFETY: the arguments match fx_mlp_greedy's, fx_mlp_greedy_cluster's,
        // fx_mlp_i8_greedy's and fx_mlp_i8_greedy_wide's signature (the parameter block by value, three pointers and a
        // count); the cluster kernel's grid is a multiple of its compiled cluster size; the
        // INT8 kernel's shared memory is what its rows per block need (within the static
        // 48 KB); the buffers are the caller's contract.
        unsafe {
            result::launch_kernel(
                func.cu_function(),
                (grid, 1, 1),
                (block, 1, 1),
                smem,
                self.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(driver(ctx))
    }
}

/// A greedy launch bound to fixed device buffers ([`MlpPolicy::bind`]). It holds clones of
/// the tensors, so their memory stays allocated. Writes into them must be queued on the
/// policy's stream (candle's) to be ordered with the launch: the bound launch does not wait
/// on cudarc's events.
#[derive(Debug)]
pub struct BoundGreedy {
    policy: MlpPolicy,
    rows: usize,
    p_obs: u64,
    p_actions: u64,
    p_values: u64,
    _buffers: [Option<Tensor>; 3],
}

impl BoundGreedy {
    /// Enqueues the kernel on the policy's stream (no sync): actions (and values) of the
    /// bound observations.
    pub fn launch(&self) -> Result<()> {
        // SAFETY: the buffers were checked by `bind` (shapes, dtypes, device, contiguity)
        // and stay allocated in `self`; the launch is on their stream.
        unsafe { self.policy.launch(self.p_obs, self.rows, self.p_actions, self.p_values, "BoundGreedy::launch") }
    }

    /// The policy it runs.
    pub fn policy(&self) -> &MlpPolicy {
        &self.policy
    }
}

/// Whether the stream's device runs thread-block clusters (compute capability 9.0+, which the
/// cluster kernels' compute_90 PTX needs as well).
fn runs_clusters(stream: &CudaStream, ctx: &'static str) -> Result<bool> {
    let (major, _) = stream.context().compute_capability().map_err(driver(ctx))?;
    Ok(major >= 9)
}

/// Whether at least one cluster of the cluster kernel `f` (compiled cluster size, 256
/// threads a block) can be resident on the stream's device at once.
fn cluster_fits(f: &CudaFunction, stream: &CudaStream) -> bool {
    let config = sys::CUlaunchConfig {
        gridDimX: CLUSTER_BLOCKS as u32,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: CLUSTER_BLOCK,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream.cu_stream(),
        attrs: std::ptr::null_mut(),
        numAttrs: 0,
    };
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `f` is a loaded function of this context; `config` lives across the call and
    // names no attributes.
    let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
    r == sys::CUresult::CUDA_SUCCESS && n > 0
}

/// Host-in, action-out decisions through one policy with no copy commands: the observations
/// go into page-locked host memory mapped into the device's address space, which the kernel
/// reads over the bus, and the kernel writes the actions straight into mapped host memory;
/// a call is one launch and one stream sync (two async copies would add a few microseconds
/// each). Buffers for `max_batch` rows are allocated once.
#[derive(Debug)]
pub struct MlpDecider {
    policy: MlpPolicy,
    max_batch: usize,
    /// `[max_batch, input]`, mapped (cached host memory: the host writes it, then launches).
    host_obs: PinnedHostSlice<f32>,
    /// `[max_batch]`, mapped; read after the stream sync.
    host_actions: PinnedHostSlice<u32>,
    /// `[max_batch, n_actions]`, mapped: the last call's scores.
    host_values: PinnedHostSlice<f32>,
    /// Rows of the last call.
    last_rows: usize,
    /// Device addresses of the three mappings.
    p_obs: u64,
    p_actions: u64,
    p_values: u64,
}

/// The device address of a mapped page-locked allocation.
fn mapped<T: ValidAsZeroBits>(buf: &mut PinnedHostSlice<T>, ctx: &'static str) -> Result<u64> {
    let host = buf.as_mut_ptr().map_err(driver(ctx))?;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `host` is the start of a live cuMemHostAlloc allocation made with DEVICEMAP.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0) }.result().map_err(driver(ctx))?;
    Ok(dptr)
}

impl MlpDecider {
    /// Mapped buffers for up to `max_batch` rows (at least 1) on the policy's device.
    pub fn new(policy: MlpPolicy, max_batch: usize) -> Result<Self> {
        const CTX: &str = "MlpDecider::new";
        let n_obs = max_batch.checked_mul(policy.dims.input).filter(|&n| max_batch > 0 && n <= u32::MAX as usize);
        let Some(n_obs) = n_obs else {
            return Err(Error::Config {
                context: CTX,
                message: format!("max_batch {max_batch} must be 1 ..= 2^32/input"),
            });
        };
        let ctx = policy.stream.context().clone();
        // Not write-combined: the host's plain cached stores are ordered before the launch.
        // SAFETY: both buffers are written (observations by the host, actions by the kernel)
        // before they are read.
        let mut host_obs = unsafe { ctx.alloc_pinned_with_flags::<f32>(n_obs, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(driver(CTX))?;
        let mut host_actions = unsafe { ctx.alloc_pinned_with_flags::<u32>(max_batch, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(driver(CTX))?;
        let n_values = max_batch * policy.dims.n_actions;
        // SAFETY: written by the kernel before `scores` reads it (zero rows before a call).
        let mut host_values = unsafe { ctx.alloc_pinned_with_flags::<f32>(n_values, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(driver(CTX))?;
        let (p_obs, p_actions) = (mapped(&mut host_obs, CTX)?, mapped(&mut host_actions, CTX)?);
        let p_values = mapped(&mut host_values, CTX)?;
        Ok(Self { policy, max_batch, host_obs, host_actions, host_values, last_rows: 0, p_obs, p_actions, p_values })
    }

    /// The policy it runs.
    pub fn policy(&self) -> &MlpPolicy {
        &self.policy
    }

    /// The most rows one call takes.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The greedy action for one observation (`input` floats).
    pub fn act(&mut self, obs: &[f32]) -> Result<u32> {
        let mut a = [0u32];
        self.act_batch(obs, &mut a)?;
        Ok(a[0])
    }

    /// Greedy actions for `actions.len()` rows (1 ..= max_batch) of `obs` (row-major,
    /// `rows × input` finite floats; a NaN or infinity is a one-line error), returned when
    /// they are on the host.
    pub fn act_batch(&mut self, obs: &[f32], actions: &mut [u32]) -> Result<()> {
        const CTX: &str = "MlpDecider::act_batch";
        let (rows, input) = (actions.len(), self.policy.dims.input);
        if rows == 0 || rows > self.max_batch {
            return Err(Error::shape("actions", CTX, format!("1 ..= {} rows", self.max_batch), rows));
        }
        if obs.len() != rows * input {
            return Err(Error::shape("obs", CTX, format!("{rows} × {input} floats"), obs.len()));
        }
        // The kernels take any float; a decision on a NaN is refused here, as by `CpuPolicy`.
        if let Some(i) = obs.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "obs", index: i, value: obs[i] as f64, context: CTX });
        }
        let stream = self.policy.stream.clone();
        // `as_*slice` wait on the buffers' own events, which nothing records, so they return
        // at once; the stream sync below is the fence for the kernel's reads and writes.
        let launched = (|| -> Result<()> {
            stream.context().bind_to_thread().map_err(driver(CTX))?;
            self.host_obs.as_mut_slice().map_err(driver(CTX))?[..obs.len()].copy_from_slice(obs);
            // SAFETY: the mappings hold max_batch × input f32 and max_batch u32, rows <=
            // max_batch, and nothing touches them until the sync below.
            unsafe { self.policy.launch(self.p_obs, rows, self.p_actions, self.p_values, CTX) }
        })();
        self.last_rows = 0;
        // Sync even after a failed launch: the kernel may not still be using our buffers.
        let synced = stream.synchronize().map_err(driver(CTX));
        launched.and(synced)?;
        actions.copy_from_slice(&self.host_actions.as_slice().map_err(driver(CTX))?[..rows]);
        self.last_rows = rows;
        Ok(())
    }

    /// The last successful call's scores (Q values or logits), `rows × n_actions`; empty
    /// before the first call or after a failed one.
    pub fn scores(&self) -> &[f32] {
        let n = self.last_rows * self.policy.dims.n_actions;
        // The buffer's own event is never recorded, so this cannot fail; an empty slice if
        // it ever did.
        self.host_values.as_slice().map_or(&[], |v| &v[..n])
    }
}

/// A resident decision server: one thread block of `fx_mlp_serve` (or, where the policy's
/// batch-1 kernel is the cluster one, a cluster of `fx_mlp_serve_cluster`) stays running on
/// a stream of its own and answers requests posted in mapped page-locked host memory, so a decision
/// costs no kernel launch and no stream synchronisation, only the bus round trips (the host
/// writes the observation and a sequence number; the block, polling, computes the greedy
/// action and writes it back; the host polls for it).
///
/// It serves a private snapshot of the policy's weights taken by [`MlpServer::new`] (a
/// resident kernel keeps cached lines across requests, so weights updated in place would
/// not be seen reliably): after training further, start a new server. While it runs it
/// occupies one SM (a cluster: eight) and keeps polling; dropping it (or
/// [`MlpServer::stop`]) ends the kernel.
///
/// While it runs, work that CUDA orders after every running kernel waits for the resident
/// one, that is until the server stops: `cuCtxSynchronize`, the synchronous frees, and the
/// operations CUDA documents as implicitly synchronising (a page-locked host allocation, a
/// synchronous device allocation or memset, work on the legacy NULL stream). Starting a
/// second server allocates page-locked memory, so one server runs at a time: stop it
/// before starting the next. Seen on the H200: GPU tests in other threads of the same
/// process stalled behind a running server, and so did a second server's start. Candle's
/// allocations and frees are stream-ordered on the device's own stream, so training on
/// another thread keeps running; stop the server before anything else allocates page-locked
/// memory or synchronises the device — `fx_hw::open_cuda` making a new device does (cudarc
/// synchronises a fresh context when it creates the device's stream), reusing a pooled one
/// does not.
pub struct MlpServer {
    stream: Arc<CudaStream>,
    dims: MlpDims,
    /// The weights' snapshot and the three mappings (accessed through raw addresses),
    /// freed on drop only once the kernel has ended (else leaked: it may still use them).
    buffers: std::mem::ManuallyDrop<ServerBuffers>,
    /// The kernel has ended (stopped and waited for).
    ended: bool,
    /// Block per row or cluster (never `Auto`).
    kernel: MlpKernel,
    /// Host addresses of the three mappings (stable for their lifetime).
    obs_ptr: *mut f32,
    ctrl_ptr: *mut u32,
    reply_ptr: *mut u32,
    seq: u32,
    running: bool,
}

/// What a running server kernel reads and writes.
struct ServerBuffers {
    _snapshot: cudarc::driver::CudaSlice<f32>,
    _host_obs: PinnedHostSlice<f32>,
    _ctrl: PinnedHostSlice<u32>,
    _reply: PinnedHostSlice<u32>,
}

impl std::fmt::Debug for MlpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlpServer").field("dims", &self.dims).field("running", &self.running).finish()
    }
}

/// How long [`MlpServer::act`] waits for an answer before it calls the server dead.
const SERVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

impl MlpServer {
    /// Snapshots `policy`'s weights (after the work queued on its stream) and starts the
    /// server kernel on a new non-blocking stream.
    pub fn new(policy: &MlpPolicy) -> Result<Self> {
        const CTX: &str = "MlpServer::new";
        let cdev = cuda_device(&policy.device, "policy", CTX)?;
        let ctx = policy.stream.context().clone();
        ctx.bind_to_thread().map_err(driver(CTX))?;
        let stream = ctx.new_stream().map_err(driver(CTX))?;
        let Program::F32 { params: p0, .. } = policy.program else {
            return Err(Error::Unsupported { context: CTX, message: "no resident server for INT8 policies".into() });
        };
        let (nh, na) = (p0.n_hidden as usize, p0.n_actions as usize);
        // (rows, cols) of each weight matrix in params order: hidden layers, then the head
        // (dueling: value [1, k] and advantage [na, k]; logits: [na, k]).
        let k = p0.width[nh] as usize;
        let mut mats: Vec<(usize, usize)> = (0..nh).map(|l| (p0.width[l + 1] as usize, p0.width[l] as usize)).collect();
        if p0.head == 1 {
            mats.extend([(1, k), (na, k)]);
        } else {
            mats.push((na, k));
        }
        // Offsets in floats, each block 16-byte aligned so float4 reads stay possible.
        let round4 = |n: usize| n.div_ceil(4) * 4;
        let mut offs = Vec::with_capacity(2 * mats.len());
        let mut total = 0usize;
        for &(r, c) in &mats {
            offs.push((total, r * c));
            total += round4(r * c);
            offs.push((total, r));
            total += round4(r);
        }
        policy.stream.synchronize().map_err(driver(CTX))?;
        let snapshot = stream.alloc_zeros::<f32>(total).map_err(driver(CTX))?;
        let base = {
            use cudarc::driver::DevicePtr;
            snapshot.device_ptr(&stream).0
        };
        let mut p = p0;
        for (i, &(off, n)) in offs.iter().enumerate() {
            let (src, dst) = (if i % 2 == 0 { p0.w[i / 2] } else { p0.b[i / 2] }, base + (off * 4) as u64);
            // SAFETY: src holds n f32 of the policy's (live) weights, dst n f32 inside the
            // snapshot; both on this context, copied on the server's stream.
            unsafe { result::memcpy_dtod_async(dst, src, n * 4, stream.cu_stream()) }.map_err(driver(CTX))?;
            if i % 2 == 0 {
                p.w[i / 2] = dst;
            } else {
                p.b[i / 2] = dst;
            }
        }
        stream.synchronize().map_err(driver(CTX))?;
        // Every matrix of the snapshot is 16-byte aligned: float4 rows need only in % 4 == 0.
        p.vec4_mask = 0;
        for l in 0..=nh {
            if p.width[l].is_multiple_of(4) {
                p.vec4_mask |= 1 << l;
            }
        }
        // SAFETY: written by the host (obs, ctrl) or the kernel (reply) before either reads
        // them; zeroed below before the kernel starts.
        let mut host_obs =
            unsafe { ctx.alloc_pinned_with_flags::<f32>(policy.dims.input, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
                .map_err(driver(CTX))?;
        let mut ctrl =
            unsafe { ctx.alloc_pinned_with_flags::<u32>(2, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.map_err(driver(CTX))?;
        let mut reply =
            unsafe { ctx.alloc_pinned_with_flags::<u32>(2, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.map_err(driver(CTX))?;
        let (obs_ptr, ctrl_ptr, reply_ptr) = (
            host_obs.as_mut_ptr().map_err(driver(CTX))?,
            ctrl.as_mut_ptr().map_err(driver(CTX))?,
            reply.as_mut_ptr().map_err(driver(CTX))?,
        );
        // SAFETY: the mappings hold input f32 and 2 + 2 u32; nothing reads them yet.
        unsafe {
            std::ptr::write_bytes(obs_ptr, 0, policy.dims.input);
            std::ptr::write_bytes(ctrl_ptr, 0, 2);
            std::ptr::write_bytes(reply_ptr, 0, 2);
        }
        let (d_obs, d_ctrl, d_reply) = (mapped(&mut host_obs, CTX)?, mapped(&mut ctrl, CTX)?, mapped(&mut reply, CTX)?);
        // The policy's batch-1 kernel: a cluster of blocks where it would take one.
        let kernel = policy.kernel_for(1);
        let (func, grid, block) = if kernel == MlpKernel::Cluster {
            let f = cdev.get_or_load_custom_func("fx_mlp_serve_cluster", "fx_mlp_cluster", PTX_MLP_CLUSTER);
            (f.ctx(CTX)?, CLUSTER_BLOCKS as u32, CLUSTER_BLOCK)
        } else {
            (cdev.get_or_load_custom_func("fx_mlp_serve", "fx_mlp_forward", PTX_MLP).ctx(CTX)?, 1, BLOCK)
        };
        let func = func.into_cuda_function();
        let (mut pp, mut o, mut c, mut r, mut first) = (p, d_obs, d_ctrl, d_reply, 0u32);
        let mut args: [*mut c_void; 5] = [
            &mut pp as *mut MlpParams as *mut c_void,
            &mut o as *mut u64 as *mut c_void,
            &mut c as *mut u64 as *mut c_void,
            &mut r as *mut u64 as *mut c_void,
            &mut first as *mut u32 as *mut c_void,
        ];
        // SAFETY: the arguments match fx_mlp_serve's (and fx_mlp_serve_cluster's) signature;
        // the snapshot and the mappings live in `Self`, which stops the kernel before freeing
        // them; the cluster grid is one cluster.
        unsafe {
            result::launch_kernel(func.cu_function(), (grid, 1, 1), (block, 1, 1), 0, stream.cu_stream(), &mut args)
        }
        .map_err(driver(CTX))?;
        Ok(Self {
            stream,
            dims: policy.dims.clone(),
            buffers: std::mem::ManuallyDrop::new(ServerBuffers {
                _snapshot: snapshot,
                _host_obs: host_obs,
                _ctrl: ctrl,
                _reply: reply,
            }),
            ended: false,
            kernel,
            obs_ptr,
            ctrl_ptr,
            reply_ptr,
            seq: 0,
            running: true,
        })
    }

    /// The network's dimensions.
    pub fn dims(&self) -> &MlpDims {
        &self.dims
    }

    /// The kernel it runs: one block, or a cluster of [`CLUSTER_BLOCKS`] (on SMs of their own).
    pub fn kernel(&self) -> MlpKernel {
        self.kernel
    }

    /// The greedy action for one observation (`input` floats), host to host. Errors: a wrong
    /// length, a stopped server, or no answer within 2 s (the kernel died).
    pub fn act(&mut self, obs: &[f32]) -> Result<u32> {
        use std::sync::atomic::{fence, Ordering};
        const CTX: &str = "MlpServer::act";
        if obs.len() != self.dims.input {
            return Err(Error::shape("obs", CTX, format!("{} floats", self.dims.input), obs.len()));
        }
        if !self.running {
            return Err(Error::Config { context: CTX, message: "the server was stopped".into() });
        }
        let seq = self.seq.wrapping_add(1);
        // SAFETY: the mappings are live and sized as checked; the kernel only reads obs and
        // ctrl and only writes reply; volatile accesses keep every access to the bus.
        unsafe {
            for (i, &x) in obs.iter().enumerate() {
                std::ptr::write_volatile(self.obs_ptr.add(i), x);
            }
            fence(Ordering::SeqCst); // the observation before the request
            std::ptr::write_volatile(self.ctrl_ptr, seq);
        }
        self.seq = seq;
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        // SAFETY: as above.
        while unsafe { std::ptr::read_volatile(self.reply_ptr.add(1)) } != seq {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && start.elapsed() > SERVE_TIMEOUT {
                self.running = false;
                return Err(Error::Config {
                    context: CTX,
                    message: format!("no answer within {SERVE_TIMEOUT:?}: the server kernel is not running"),
                });
            }
        }
        fence(Ordering::SeqCst); // the sequence number before the action
                                 // SAFETY: as above.
        Ok(unsafe { std::ptr::read_volatile(self.reply_ptr) })
    }

    /// Ends the kernel and waits for it (also done on drop). An error if it does not end
    /// within 2 s (its buffers then stay allocated for good).
    pub fn stop(&mut self) -> Result<()> {
        self.running = false;
        if !self.ended && !self.halt()? {
            return Err(Error::Config {
                context: "MlpServer::stop",
                message: format!("the server kernel did not end within {SERVE_TIMEOUT:?}"),
            });
        }
        Ok(())
    }

    /// Raises the stop flag and waits up to [`SERVE_TIMEOUT`] for the kernel to end (a
    /// bounded wait: a stream sync on a kernel that cannot see the flag would never return).
    fn halt(&mut self) -> Result<bool> {
        const CTX: &str = "MlpServer::halt";
        // SAFETY: the mapping is live; the kernel polls ctrl[1].
        unsafe { std::ptr::write_volatile(self.ctrl_ptr.add(1), 1) };
        self.stream.context().bind_to_thread().map_err(driver(CTX))?;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: a query of this server's own live stream.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => {
                    self.ended = true;
                    return Ok(true);
                }
                sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < SERVE_TIMEOUT => {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
                e => return Err(driver(CTX)(cudarc::driver::DriverError(e))),
            }
        }
    }
}

impl Drop for MlpServer {
    fn drop(&mut self) {
        self.running = false;
        if self.ended || self.halt().unwrap_or(false) {
            // SAFETY: the kernel has ended, so nothing uses the buffers; dropped once.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.buffers) };
        } else {
            eprintln!("MlpServer: the server kernel did not end; its buffers stay allocated");
        }
    }
}

#[cfg(test)]
mod tests;
