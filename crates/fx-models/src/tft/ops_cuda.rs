//! [`CudaTft`]: the TFT fused step's operations ([`crate::tft::ops`]) on the GPU — cuBLAS for
//! the GEMMs, `kernels/tft/tft.cu` and `kernels/tft/lstm.cu` for the rest — all queued on candle's
//! stream, nothing read back, so a CUDA graph can capture a whole step.

use candle_core::{DType, Device, Tensor};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use crate::tft::ops::{
    partials_len, Act, Addr, Attn, AttnGrads, BiasAct, Embed, EmbedGrads, GluLn, GluLnGrads, Lstm, LstmGrads, Pack,
    Pinball, TftBackend, TftKernels, VsnMix, VsnMixGrads, MAX_ATTN_SCORES, MAX_ATTN_STEPS, MAX_HEAD_DIM,
    MAX_NORM_WIDTH, PARTIAL_ROWS,
};
use fx_kernels::cuda::blas::Blas;
use fx_kernels::cuda::{cuda_device, dev_ptr, driver};
use fx_kernels::gemm::Gemm;
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/tft/lstm.cu` (one LSTM step, forward and backward).
const PTX_LSTM: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/lstm.ptx"));

/// PTX of `kernels/tft/tft.cu` (the TFT's fused training-step kernels).
const PTX_TFT: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/tft.ptx"));

const BLOCK: u32 = 256;
/// Grid bound for the grid-stride kernels: plenty of blocks to fill an H200.
const MAX_BLOCKS: usize = 8192;

struct Funcs {
    pack: CudaFunction,
    embed_fwd: CudaFunction,
    embed_bwd: CudaFunction,
    reduce: CudaFunction,
    bias_act: CudaFunction,
    act_bwd: CudaFunction,
    /// Per row-register width (V = 2, 4, 8: rows up to 64, 128, 256 wide).
    glu_fwd: [CudaFunction; 3],
    glu_bwd: [CudaFunction; 3],
    mix_fwd: [CudaFunction; 3],
    mix_bwd: [CudaFunction; 3],
    attn_fwd: CudaFunction,
    attn_bwd: CudaFunction,
    pinball: CudaFunction,
    cast: CudaFunction,
    lstm_fwd: CudaFunction,
    lstm_bwd: CudaFunction,
}

/// The GPU backend; see the module docs. Owns the buffers it allocates (candle tensors).
pub struct CudaTft {
    dev: candle_core::CudaDevice,
    blas: Blas,
    f: Funcs,
    buffers: Vec<(Addr, usize, Tensor)>,
}

impl std::fmt::Debug for CudaTft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaTft({} buffers)", self.buffers.len())
    }
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// A warp-per-row kernel's launch: 8 warps a block, grid-stride over `rows`.
fn warp_rows_grid(rows: usize) -> LaunchConfig {
    let blocks = rows.div_ceil((BLOCK / 32) as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// A row kernel's launch: a block (whole warps, up to 256 threads) per row of `cols`,
/// grid-stride over `rows`.
fn rows_grid(rows: usize, cols: usize) -> LaunchConfig {
    let block = (cols.div_ceil(32) * 32).clamp(32, BLOCK as usize) as u32;
    LaunchConfig { grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

fn u32_of(v: usize, what: &'static str, ctx: &'static str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::shape(what, ctx, "< 2^32", v.to_string()))
}

impl CudaTft {
    /// Loads the kernels on `device` (CUDA) with a cuBLAS handle on candle's stream.
    pub fn new(device: &Device) -> Result<Self> {
        const CTX: &str = "CudaTft::new";
        let dev = cuda_device(device, "device", CTX)?.clone();
        let tft = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_tft", PTX_TFT).ctx(CTX)?.into_cuda_function())
        };
        let lstm = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_lstm", PTX_LSTM).ctx(CTX)?.into_cuda_function())
        };
        let widths = |name: &str| -> Result<[CudaFunction; 3]> {
            Ok([tft(&format!("{name}2"))?, tft(&format!("{name}4"))?, tft(&format!("{name}8"))?])
        };
        let f = Funcs {
            pack: tft("fx_tft_pack")?,
            embed_fwd: tft("fx_tft_embed_fwd")?,
            embed_bwd: tft("fx_tft_embed_bwd")?,
            reduce: tft("fx_tft_reduce_partials")?,
            bias_act: tft("fx_tft_bias_act")?,
            act_bwd: tft("fx_tft_act_bwd")?,
            glu_fwd: widths("fx_tft_glu_ln_fwd")?,
            glu_bwd: widths("fx_tft_glu_ln_bwd")?,
            mix_fwd: widths("fx_tft_vsn_mix_fwd")?,
            mix_bwd: widths("fx_tft_vsn_mix_bwd")?,
            attn_fwd: tft("fx_tft_attn_fwd")?,
            attn_bwd: tft("fx_tft_attn_bwd")?,
            pinball: tft("fx_tft_pinball")?,
            cast: tft("fx_tft_cast_bf16")?,
            lstm_fwd: lstm("fx_lstm_fwd_step")?,
            lstm_bwd: lstm("fx_lstm_bwd_step")?,
        };
        Ok(Self { blas: Blas::new(device)?, dev, f, buffers: Vec::new() })
    }

    fn stream(&self) -> std::sync::Arc<cudarc::driver::CudaStream> {
        self.dev.cuda_stream()
    }

    /// The variant of a row kernel for rows `o` wide: the fewest registers that hold one.
    fn width_variant(o: usize, ctx: &'static str) -> Result<usize> {
        match o {
            1..=64 => Ok(0),
            65..=128 => Ok(1),
            129..=MAX_NORM_WIDTH => Ok(2),
            _ => Err(Error::Unsupported { context: ctx, message: format!("row width {o} (1..={MAX_NORM_WIDTH})") }),
        }
    }

    /// `partials` summed over their row blocks into `w`, `b` (`groups × width` each).
    unsafe fn reduce(&self, partials: Addr, groups: usize, rows: usize, width: usize, w: Addr, b: Addr) -> Result<()> {
        const CTX: &str = "CudaTft::reduce";
        let blocks = u32_of(rows.div_ceil(PARTIAL_ROWS), "blocks", CTX)?;
        let (g32, w32) = (u32_of(groups, "groups", CTX)?, u32_of(width, "width", CTX)?);
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.reduce);
        l.arg(&partials).arg(&g32).arg(&blocks).arg(&w32).arg(&w).arg(&b);
        // SAFETY: partials holds partials_len(groups, rows, width) F32, w and b groups × width.
        unsafe { l.launch(grid(groups * width)) }.map_err(driver(CTX))?;
        Ok(())
    }
}

impl TftBackend for CudaTft {
    fn alloc(&mut self, n: usize) -> Result<Addr> {
        const CTX: &str = "CudaTft::alloc";
        if n == 0 {
            return Err(Error::shape("buffer", CTX, "at least one element", "0"));
        }
        let t = Tensor::zeros(n, DType::F32, &Device::Cuda(self.dev.clone())).ctx(CTX)?;
        let a = dev_ptr::<f32>(&t, &self.stream(), "buffer", CTX)?;
        self.buffers.push((a, n, t));
        Ok(a)
    }

    fn addr_of(&self, t: &Tensor, what: &'static str) -> Result<Addr> {
        const CTX: &str = "CudaTft::addr_of";
        let stream = self.stream();
        match t.dtype() {
            DType::F32 => dev_ptr::<f32>(t, &stream, what, CTX),
            DType::U32 => dev_ptr::<u32>(t, &stream, what, CTX),
            other => Err(Error::DType { what, expected: DType::F32, got: other, context: CTX }),
        }
    }

    fn tensor_at(&self, a: Addr, shape: &[usize]) -> Result<Tensor> {
        const CTX: &str = "CudaTft::tensor_at";
        let n: usize = shape.iter().product();
        let (base, _, t) = self
            .buffers
            .iter()
            .find(|(base, len, _)| a >= *base && a + (n * 4) as Addr <= base + (len * 4) as Addr)
            .ok_or_else(|| Error::shape("address", CTX, "inside one allocated buffer", format!("{a:#x} + {n}")))?;
        let start = (a - base) as usize / 4;
        t.narrow(0, start, n).and_then(|v| v.reshape(shape)).ctx(CTX)
    }
}

impl TftKernels for CudaTft {
    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        // SAFETY: forwarded from the caller (the trait's contract).
        unsafe { self.blas.run(g) }
    }

    unsafe fn zero(&self, a: Addr, n: usize) -> Result<()> {
        let s = self.stream();
        // SAFETY: `a` holds n F32 (the trait's contract); queued on candle's stream.
        unsafe { cudarc::driver::result::memset_d8_async(a, 0, n * 4, s.cu_stream()) }.map_err(driver("CudaTft::zero"))
    }

    unsafe fn copy(&self, dst: Addr, src: Addr, n: usize) -> Result<()> {
        let s = self.stream();
        // SAFETY: both hold n F32 (the trait's contract).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, n * 4, s.cu_stream()) }
            .map_err(driver("CudaTft::copy"))
    }

    unsafe fn cast_bf16(&self, src: Addr, dst: Addr, n: usize) -> Result<()> {
        const CTX: &str = "CudaTft::cast_bf16";
        let n64 = n as u64;
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.cast);
        l.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: src holds n F32, dst n BF16 (the trait's contract).
        unsafe { l.launch(grid(n)) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn pack(&self, a: &Pack) -> Result<()> {
        const CTX: &str = "CudaTft::pack";
        let n = (a.l_enc * (a.n_obs + a.n_known) + a.h * a.n_known) * a.batch;
        let v: Vec<u32> = [a.batch, a.l_enc, a.h, a.n_obs, a.n_known]
            .iter()
            .map(|&x| u32_of(x, "size", CTX))
            .collect::<Result<_>>()?;
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.pack);
        l.arg(&a.observed).arg(&a.known).arg(&a.raw_enc).arg(&a.raw_dec);
        l.arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]);
        // SAFETY: the buffers match `Pack`'s documented shapes (the trait's contract).
        unsafe { l.launch(grid(n)) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn embed_fwd(&self, a: &Embed) -> Result<()> {
        const CTX: &str = "CudaTft::embed_fwd";
        let (rows, n, d) = (a.rows as u64, u32_of(a.n, "n", CTX)?, u32_of(a.d, "d", CTX)?);
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.embed_fwd);
        l.arg(&a.raw).arg(&a.w).arg(&a.b).arg(&a.emb).arg(&rows).arg(&n).arg(&d).arg(&a.emb16);
        // SAFETY: as `Embed` documents.
        unsafe { l.launch(rows_grid(a.rows * a.n, a.d)) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn embed_bwd(&self, a: &Embed, g: &EmbedGrads) -> Result<()> {
        const CTX: &str = "CudaTft::embed_bwd";
        let (rows, n, d) = (a.rows as u64, u32_of(a.n, "n", CTX)?, u32_of(a.d, "d", CTX)?);
        let blocks = u32_of(a.rows.div_ceil(PARTIAL_ROWS), "blocks", CTX)?;
        let cfg = LaunchConfig { grid_dim: (blocks, n, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.embed_bwd);
        l.arg(&a.raw).arg(&g.demb).arg(&g.partials).arg(&rows).arg(&n).arg(&d);
        // SAFETY: partials holds partials_len(n, rows, d) F32 (the trait's contract).
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        debug_assert!(partials_len(a.n, a.rows, a.d) > 0);
        unsafe { self.reduce(g.partials, a.n, a.rows, a.d, g.dw, g.db) }
    }

    unsafe fn bias_act(&self, a: &BiasAct) -> Result<()> {
        unsafe { self.bias_act_launch(a, None) }
    }

    unsafe fn act_bwd(&self, a: &BiasAct, grad: Addr) -> Result<()> {
        unsafe { self.bias_act_launch(a, Some(grad)) }
    }

    unsafe fn glu_ln_fwd(&self, a: &GluLn) -> Result<()> {
        const CTX: &str = "CudaTft::glu_ln_fwd";
        let v = Self::width_variant(a.o, CTX)?;
        let (rows, o, sm) = (a.rows as u64, a.o as u32, u32::from(a.softmax));
        let cfg = warp_rows_grid(a.rows);
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.glu_fwd[v]);
        l.arg(&rows).arg(&o).arg(&a.g4).arg(&a.b4).arg(&a.g5).arg(&a.b5).arg(&a.res).arg(&a.res_bias);
        l.arg(&a.ln_w).arg(&a.ln_b).arg(&a.eps).arg(&sm).arg(&a.out).arg(&a.stats).arg(&a.out16);
        // SAFETY: as `GluLn` documents; a null res_bias is the kernel's "none".
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn glu_ln_bwd(&self, a: &GluLn, g: &GluLnGrads) -> Result<()> {
        const CTX: &str = "CudaTft::glu_ln_bwd";
        let v = Self::width_variant(a.o, CTX)?;
        let (rows, o, sm, acc) = (a.rows as u64, a.o as u32, u32::from(a.softmax), u32::from(g.res_acc));
        let blocks = u32_of(a.rows.div_ceil(PARTIAL_ROWS), "blocks", CTX)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: (BLOCK / 32) * 2 * o * 4,
        };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.glu_bwd[v]);
        l.arg(&rows).arg(&o).arg(&a.g4).arg(&a.b4).arg(&a.g5).arg(&a.b5).arg(&a.res).arg(&a.res_bias);
        l.arg(&a.ln_w).arg(&a.ln_b).arg(&sm).arg(&a.stats).arg(&g.dout).arg(&g.dres).arg(&acc);
        l.arg(&g.dg4).arg(&g.dg5).arg(&g.partials).arg(&g.dg4_16).arg(&g.dg5_16);
        // SAFETY: as `GluLnGrads` documents (dg4/dg5 may alias g4/g5: each element is read
        // and then written by the same thread).
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        unsafe { self.reduce(g.partials, 1, a.rows, a.o, g.dln_w, g.dln_b) }
    }

    unsafe fn vsn_mix_fwd(&self, a: &VsnMix) -> Result<()> {
        const CTX: &str = "CudaTft::vsn_mix_fwd";
        let v = Self::width_variant(a.d, CTX)?;
        let (rows, n, d) = (a.rows as u64, u32_of(a.n, "n", CTX)?, a.d as u32);
        let cfg = warp_rows_grid(a.rows);
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.mix_fwd[v]);
        l.arg(&rows).arg(&n).arg(&d).arg(&a.emb).arg(&a.g4).arg(&a.b4).arg(&a.g5).arg(&a.b5);
        l.arg(&a.ln_w).arg(&a.ln_b).arg(&a.eps).arg(&a.wsel).arg(&a.out).arg(&a.stats).arg(&a.out16);
        // SAFETY: as `VsnMix` documents.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn vsn_mix_bwd(&self, a: &VsnMix, g: &VsnMixGrads) -> Result<()> {
        const CTX: &str = "CudaTft::vsn_mix_bwd";
        let v = Self::width_variant(a.d, CTX)?;
        let (rows, n, d) = (a.rows as u64, u32_of(a.n, "n", CTX)?, a.d as u32);
        let blocks = u32_of(a.rows.div_ceil(PARTIAL_ROWS), "blocks", CTX)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, n, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: (BLOCK / 32) * 2 * d * 4,
        };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.mix_bwd[v]);
        l.arg(&rows).arg(&n).arg(&d).arg(&a.emb).arg(&a.g4).arg(&a.b4).arg(&a.g5).arg(&a.b5);
        l.arg(&a.ln_w).arg(&a.ln_b).arg(&a.wsel).arg(&a.stats).arg(&g.dout).arg(&g.dwsel).arg(&g.demb);
        l.arg(&g.dg4).arg(&g.dg5).arg(&g.partials).arg(&g.dg4_16).arg(&g.dg5_16);
        // SAFETY: as `VsnMixGrads` documents.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        unsafe { self.reduce(g.partials, a.n, a.rows, a.d, g.dln_w, g.dln_b) }
    }

    unsafe fn lstm_fwd_step(&self, a: &Lstm, t: usize) -> Result<()> {
        const CTX: &str = "CudaTft::lstm_fwd_step";
        let (cfg, t32, l32, b32, d32) = lstm_launch(a, t, CTX)?;
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.lstm_fwd);
        l.arg(&a.xg).arg(&a.w_hh[0]).arg(&a.w_hh[1]).arg(&a.b_ih[0]).arg(&a.b_ih[1]).arg(&a.b_hh[0]);
        l.arg(&a.b_hh[1]).arg(&a.h).arg(&a.c).arg(&a.gates).arg(&t32).arg(&l32).arg(&b32).arg(&d32);
        // SAFETY: as `Lstm` documents; step t reads step t − 1's rows, written by the
        // previous launch on the same stream.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn lstm_bwd_step(&self, a: &Lstm, g: &LstmGrads, t: usize) -> Result<()> {
        const CTX: &str = "CudaTft::lstm_bwd_step";
        let (cfg, t32, l32, b32, d32) = lstm_launch(a, t, CTX)?;
        let steps = u32_of(a.steps, "steps", CTX)?;
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.lstm_bwd);
        l.arg(&g.dh_out).arg(&g.dgates).arg(&g.dc).arg(&a.gates).arg(&a.c).arg(&a.w_hh[0]).arg(&a.w_hh[1]);
        l.arg(&t32).arg(&l32).arg(&steps).arg(&b32).arg(&d32);
        // SAFETY: as `LstmGrads` documents.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn attn_fwd(&self, a: &Attn) -> Result<()> {
        const CTX: &str = "CudaTft::attn_fwd";
        let sizes = check_attn(a, CTX)?;
        let pairs = a.batch * a.h;
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(8).clamp(1, MAX_BLOCKS) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.attn_fwd);
        l.arg(&sizes[0]).arg(&sizes[1]).arg(&sizes[2]).arg(&sizes[3]).arg(&sizes[4]).arg(&a.scale);
        l.arg(&a.q).arg(&a.bq).arg(&a.k).arg(&a.bk).arg(&a.v).arg(&a.bv).arg(&a.attn).arg(&a.avg);
        // SAFETY: as `Attn` documents; 8 warps per block match the kernel's shared scores.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn attn_bwd(&self, a: &Attn, g: &AttnGrads) -> Result<()> {
        const CTX: &str = "CudaTft::attn_bwd";
        let sizes = check_attn(a, CTX)?;
        let scores = a.n_head * a.h * (a.l_enc + a.h);
        if scores > MAX_ATTN_SCORES {
            return Err(Error::Unsupported { context: CTX, message: format!("{scores} score gradients") });
        }
        let smem = scores * 4;
        let cfg = LaunchConfig { grid_dim: (sizes[0], 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: smem as u32 };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.attn_bwd);
        l.arg(&sizes[0]).arg(&sizes[1]).arg(&sizes[2]).arg(&sizes[3]).arg(&sizes[4]).arg(&a.scale);
        l.arg(&a.q).arg(&a.bq).arg(&a.k).arg(&a.bk).arg(&a.v).arg(&a.bv).arg(&a.attn).arg(&g.davg);
        l.arg(&g.dq).arg(&g.dk).arg(&g.dv);
        // SAFETY: as `AttnGrads` documents; one block per batch row owns its rows' outputs.
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }

    unsafe fn pinball(&self, a: &Pinball) -> Result<()> {
        const CTX: &str = "CudaTft::pinball";
        let (b, h, nq) = (u32_of(a.batch, "batch", CTX)?, u32_of(a.h, "h", CTX)?, u32_of(a.nq, "nq", CTX)?);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let stream = self.stream();
        let mut l = stream.launch_builder(&self.f.pinball);
        l.arg(&b).arg(&h).arg(&nq).arg(&a.out).arg(&a.bias).arg(&a.target).arg(&a.quantiles);
        l.arg(&a.loss).arg(&a.dout);
        // SAFETY: as `Pinball` documents (one block; its power-of-two size fits the kernel's
        // 1024-float reduction buffer).
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }
}

impl CudaTft {
    /// [`TftKernels::bias_act`] (`grad` None) or [`TftKernels::act_bwd`].
    unsafe fn bias_act_launch(&self, a: &BiasAct, grad: Option<Addr>) -> Result<()> {
        const CTX: &str = "CudaTft::bias_act";
        if grad.is_some() && a.act == Act::Elu && a.dropout.is_some() {
            return Err(Error::Unsupported { context: CTX, message: "ELU and dropout together".into() });
        }
        let (rows, cols, act) = (a.rows as u64, u32_of(a.cols, "cols", CTX)?, a.act as u32);
        let (on, seed, call, step, p, scale, batch, steps) = match &a.dropout {
            Some(s) => (1u32, s.seed, s.call, s.step, s.p, s.scale, s.batch as u64, s.steps as u64),
            None => (0u32, 0u64, 0u64, 0u64, 0f64, 1f32, 1u64, 1u64),
        };
        let stream = self.stream();
        let cfg = rows_grid(a.rows, a.cols);
        match grad {
            None => {
                let rpg = a.rows_per_group.max(1) as u64;
                let mut l = stream.launch_builder(&self.f.bias_act);
                l.arg(&a.y).arg(&a.bias).arg(&rows).arg(&cols).arg(&rpg).arg(&act).arg(&on).arg(&seed);
                l.arg(&call).arg(&step).arg(&p).arg(&scale).arg(&batch).arg(&steps).arg(&a.out16);
                // SAFETY: as `BiasAct` documents; a zero step address is never read when the
                // mask is off.
                unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
            }
            Some(g) => {
                let mut l = stream.launch_builder(&self.f.act_bwd);
                l.arg(&g).arg(&a.y).arg(&rows).arg(&cols).arg(&act).arg(&on).arg(&seed);
                l.arg(&call).arg(&step).arg(&p).arg(&scale).arg(&batch).arg(&steps).arg(&a.out16);
                // SAFETY: as above; `g` holds rows × cols F32.
                unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
            }
        }
        Ok(())
    }
}

/// The LSTM kernels' launch: tiles of 8 rows × 32 units.
fn lstm_launch(a: &Lstm, t: usize, ctx: &'static str) -> Result<(LaunchConfig, u32, u32, u32, u32)> {
    if t >= a.steps || a.l_enc == 0 || a.d == 0 || a.batch == 0 {
        return Err(Error::shape("step", ctx, format!("< {} with L, d, B > 0", a.steps), t.to_string()));
    }
    let (d, b) = (u32_of(a.d, "d", ctx)?, u32_of(a.batch, "batch", ctx)?);
    let cfg = LaunchConfig { grid_dim: (d.div_ceil(32), b.div_ceil(8), 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 };
    Ok((cfg, t as u32, u32_of(a.l_enc, "l_enc", ctx)?, b, d))
}

/// `[B, L, H, n_head, dk]` as u32, within the attention kernels' limits.
fn check_attn(a: &Attn, ctx: &'static str) -> Result<[u32; 5]> {
    let steps = a.l_enc + a.h;
    if steps > MAX_ATTN_STEPS || a.dk == 0 || a.dk > MAX_HEAD_DIM || a.n_head == 0 || a.h == 0 {
        return Err(Error::Unsupported {
            context: ctx,
            message: format!("{steps} steps (≤ {MAX_ATTN_STEPS}), head width {} (1..={MAX_HEAD_DIM})", a.dk),
        });
    }
    Ok([
        u32_of(a.batch, "batch", ctx)?,
        u32_of(a.l_enc, "l_enc", ctx)?,
        u32_of(a.h, "h", ctx)?,
        u32_of(a.n_head, "n_head", ctx)?,
        u32_of(a.dk, "dk", ctx)?,
    ])
}
