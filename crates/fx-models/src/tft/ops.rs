//! The operations of the TFT's fused training step: forward, pinball loss and backward on
//! preallocated buffers, without an autograd tape.
//!
//! candle's autograd turns a TFT step into ~24,000 kernels (every op's backward allocates a
//! zero gradient and adds into it), so a captured step was launch-bound at ~140 ms. The
//! fused step instead runs GEMMs ([`Gemm`]) and the few fused element-wise kernels named by
//! [`TftKernels`]: bias + activation + dropout, GLU + residual + LayerNorm (+ softmax), the
//! variable-selection mix, a whole-sequence LSTM step, interpretable attention and the
//! pinball loss, each with its backward. [`CpuTft`] implements them with plain loops over
//! host memory: it is the reference the CUDA kernels (`cuda::tft::CudaTft`,
//! `kernels/tft/tft.cu`, `kernels/tft/lstm.cu`) are tested against, and because fx-models writes the
//! step once over any `TftKernels`, running it on `CpuTft` tests the whole orchestration
//! against candle's autograd without a GPU.
//!
//! Layouts: rows are time-major within a segment (`row = step · B + b`), so the LSTM's step
//! `t` is one contiguous block of rows; stacked per-variable tensors are variable-major
//! (`[n, rows, d]`); parameters keep PyTorch's layout (`Linear` weight `[out, in]`).
//! Dropout masks are the counter-based ones of [`fx_precision::dropout`], indexed as candle's
//! batch-major tensors are, so the fused step drops exactly the units the candle step does.

use candle_core::{DType, Device, Storage, Tensor};

use fx_kernels::gemm::{gemm_ref, Gemm};
use fx_kernels::{CandleContext, Error, Result};

/// A buffer's address on the backend that runs the op: a device pointer on CUDA, a host
/// pointer on the CPU.
pub type Addr = u64;

/// Rows one block of the LayerNorm-type backward kernels reduces into one partial sum of the
/// norm's weight and bias gradients (the partials are then summed in a fixed order, so a
/// step is bit-reproducible without float atomics).
pub const PARTIAL_ROWS: usize = 64;

/// Widest LayerNorm row the kernels take (one warp per row holds 8 values per lane).
pub const MAX_NORM_WIDTH: usize = 256;
/// Most attention steps (`L_enc + H`) the kernels take.
pub const MAX_ATTN_STEPS: usize = 256;
/// Widest attention head (`d / n_head`).
pub const MAX_HEAD_DIM: usize = 64;
/// Most score gradients (`n_head · H · (L_enc + H)`) the attention backward keeps in one
/// block's shared memory (48 KiB of F32).
pub const MAX_ATTN_SCORES: usize = 12 * 1024;

/// Elements of the scratch a backward op with per-group partial sums needs: `groups` ×
/// `⌈rows_per_group / PARTIAL_ROWS⌉` blocks × 2 (weight, bias) × `width`.
pub fn partials_len(groups: usize, rows_per_group: usize, width: usize) -> usize {
    groups * rows_per_group.div_ceil(PARTIAL_ROWS) * 2 * width
}

/// The activation a [`BiasAct`] applies after its bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// None.
    None = 0,
    /// `ELU(α = 1)`: `x` for `x ≥ 0`, `eˣ − 1` below (candle's and PyTorch's).
    Elu = 1,
}

/// Counter-based dropout at one call site ([`fx_precision::dropout::mask_reference`]): element
/// `(group j, step s, batch b, column k)` of a `[groups · steps · B, cols]` time-major buffer
/// draws with index `((j·B + b)·steps + s)·cols + k`, its position in candle's batch-major
/// `[groups, B, steps, cols]` tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutSite {
    /// The generator's seed.
    pub seed: u64,
    /// The call's number within the training step.
    pub call: u64,
    /// Address of the step counter (one U32).
    pub step: Addr,
    /// Drop probability.
    pub p: f64,
    /// `1/(1 − p)` as F32 ([`fx_precision::dropout::keep_scale`]).
    pub scale: f32,
    /// Batch size `B`.
    pub batch: usize,
    /// Steps per group (`L`, `H` or `L + H`).
    pub steps: usize,
}

/// `y = drop(act(y + bias[group]))` in place on `[rows, cols]`, `group = row / rows_per_group`
/// (bias `[groups, cols]`): a GEMM's epilogue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BiasAct {
    pub y: Addr,
    pub bias: Addr,
    pub rows: usize,
    pub cols: usize,
    pub rows_per_group: usize,
    pub act: Act,
    pub dropout: Option<DropoutSite>,
    /// A BF16 copy of what the op writes (`y` forward, `grad` backward), or 0 for none.
    pub out16: Addr,
}

/// GLU + residual + LayerNorm over rows of width `o` (one group of parameters):
/// `z = res (+ res_bias) + σ(g4 + b4) ⊙ (g5 + b5)`, `out = LN(z) · w + b`, or with `softmax`
/// `out = softmax(LN(z) · w + b)`. `g4`, `g5` are the raw GEMM outputs; `stats [rows, 2]`
/// keeps each row's mean and `1/σ` for the backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GluLn {
    pub rows: usize,
    pub o: usize,
    pub g4: Addr,
    pub b4: Addr,
    pub g5: Addr,
    pub b5: Addr,
    pub res: Addr,
    /// `[o]` added to `res` (the flat GRN's skip bias), or 0 for none.
    pub res_bias: Addr,
    pub ln_w: Addr,
    pub ln_b: Addr,
    pub eps: f32,
    pub softmax: bool,
    pub out: Addr,
    pub stats: Addr,
    /// A BF16 copy of `out`, or 0.
    pub out16: Addr,
}

/// The gradients of a [`GluLn`] given `dout`: `dres` (written, or added with `res_acc`),
/// `dg4`, `dg5` (the gradients of `g4 + b4` and `g5 + b5`; they may alias `g4`, `g5`), and the
/// norm's `dln_w`, `dln_b` via `partials` ([`partials_len`]`(1, rows, o)` elements).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GluLnGrads {
    pub dout: Addr,
    pub dres: Addr,
    pub res_acc: bool,
    pub dg4: Addr,
    pub dg5: Addr,
    pub partials: Addr,
    pub dln_w: Addr,
    pub dln_b: Addr,
    /// BF16 copies of `dg4`, `dg5` (both or neither; 0 for none).
    pub dg4_16: Addr,
    pub dg5_16: Addr,
}

/// The variable selection's mix of its `n` per-variable GRNs (`d → d`, residual = the
/// variable's embedding): `out[r] = Σ_j wsel[r, j] · LN_j(emb[r, j] + σ(g4[j, r] + b4[j]) ⊙
/// (g5[j, r] + b5[j]))`. `emb [rows, n, d]`, `g4`/`g5 [n, rows, d]`, parameters `[n, d]`,
/// `wsel [rows, n]`, `out [rows, d]`, `stats [n, rows, 2]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VsnMix {
    pub rows: usize,
    pub n: usize,
    pub d: usize,
    pub emb: Addr,
    pub g4: Addr,
    pub b4: Addr,
    pub g5: Addr,
    pub b5: Addr,
    pub ln_w: Addr,
    pub ln_b: Addr,
    pub eps: f32,
    pub wsel: Addr,
    pub out: Addr,
    pub stats: Addr,
    /// A BF16 copy of `out`, or 0.
    pub out16: Addr,
}

/// The gradients of a [`VsnMix`] given `dout [rows, d]`: `dwsel [rows, n]`, `demb` (written),
/// `dg4`, `dg5` (may alias `g4`, `g5`), the norms' `dln_w`, `dln_b [n, d]` via `partials`
/// ([`partials_len`]`(n, rows, d)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VsnMixGrads {
    pub dout: Addr,
    pub dwsel: Addr,
    pub demb: Addr,
    pub dg4: Addr,
    pub dg5: Addr,
    pub partials: Addr,
    pub dln_w: Addr,
    pub dln_b: Addr,
    /// BF16 copies of `dg4`, `dg5` (both or neither; 0 for none).
    pub dg4_16: Addr,
    pub dg5_16: Addr,
}

/// A variable selection network's whole forward for a forecast (no dropout, nothing kept for
/// a backward), for a backend with its own (`fx-quant`'s INT8 TFT on the GPU): the
/// selection weights into `wsel [rows, n]` and the mix into `out [rows, d]` (and its BF16
/// copy `out16`, or 0) from `raw [rows, n]`. `key` names the network: the address of its
/// per-variable GRNs' stacked `fc2` weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VsnForecast {
    pub key: Addr,
    pub rows: usize,
    pub n: usize,
    pub d: usize,
    pub raw: Addr,
    pub wsel: Addr,
    pub out: Addr,
    pub out16: Addr,
}

/// Per-variable scalar embeddings `emb[r, j, k] = raw[r, j] · w[j, k] + b[j, k]`
/// (`raw [rows, n]`, `w`, `b [n, d]`, `emb [rows, n, d]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Embed {
    pub rows: usize,
    pub n: usize,
    pub d: usize,
    pub raw: Addr,
    pub w: Addr,
    pub b: Addr,
    pub emb: Addr,
    /// A BF16 copy of `emb`, or 0.
    pub emb16: Addr,
}

/// The gradients of an [`Embed`] given `demb`: `dw`, `db [n, d]` via `partials`
/// ([`partials_len`]`(n, rows, d)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbedGrads {
    pub demb: Addr,
    pub partials: Addr,
    pub dw: Addr,
    pub db: Addr,
}

/// The model inputs, batch-major `observed [B, L, n_obs]`, `known [B, L + H, n_known]`, as
/// time-major variable rows `raw_enc [L·B, n_obs + n_known]` (observed, then known) and
/// `raw_dec [H·B, n_known]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pack {
    pub batch: usize,
    pub l_enc: usize,
    pub h: usize,
    pub n_obs: usize,
    pub n_known: usize,
    pub observed: Addr,
    pub known: Addr,
    pub raw_enc: Addr,
    pub raw_dec: Addr,
}

/// A single-layer LSTM (PyTorch layout, gates i, f, g, o) run over `steps` time-major steps
/// of `batch` rows, the first `l_enc` with the encoder's parameters (index 0), the rest with
/// the decoder's (index 1), which starts from the encoder's last state. `xg [steps·B, 4d]`
/// holds `x · W_ihᵀ` (no bias); the step adds both biases and `h_{t−1} · W_hhᵀ`, and writes
/// `h`, `c [steps·B, d]` and the activated gates `gates [steps·B, 4d]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lstm {
    pub batch: usize,
    pub d: usize,
    pub l_enc: usize,
    pub steps: usize,
    pub xg: Addr,
    pub w_hh: [Addr; 2],
    pub b_ih: [Addr; 2],
    pub b_hh: [Addr; 2],
    pub h: Addr,
    pub c: Addr,
    pub gates: Addr,
}

/// The LSTM's backward buffers: `dh_out [steps·B, d]` (the gradient reaching the outputs),
/// `dgates [steps·B, 4d]` (written: the gradient of the gate pre-activations, i.e. of `xg`
/// and of both biases) and `dc [B, d]` (the cell gradient carried from step to step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LstmGrads {
    pub dh_out: Addr,
    pub dgates: Addr,
    pub dc: Addr,
}

/// Interpretable multi-head attention of the `h` decoder steps over all `l_enc + h` steps
/// (causal): per head `k`, `A = softmax((q_k + bq_k)(k_k + bk_k)ᵀ · scale + mask)`; the heads'
/// `A · (v + bv)` are averaged into `avg [h·B, dk]`. `q [h·B, n_head·dk]` (decoder rows),
/// `k [steps·B, n_head·dk]`, `v [steps·B, dk]` are raw GEMM outputs (time-major); `attn
/// [B, n_head, h, steps]` keeps the weights (0 where masked).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attn {
    pub batch: usize,
    pub l_enc: usize,
    pub h: usize,
    pub n_head: usize,
    pub dk: usize,
    pub scale: f32,
    pub q: Addr,
    pub bq: Addr,
    pub k: Addr,
    pub bk: Addr,
    pub v: Addr,
    pub bv: Addr,
    pub attn: Addr,
    pub avg: Addr,
}

/// The gradients of an [`Attn`] given `davg`: `dq`, `dk`, `dv` (written, shaped as `q`, `k`,
/// `v`; they are also the biases' per-row gradients).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnGrads {
    pub davg: Addr,
    pub dq: Addr,
    pub dk: Addr,
    pub dv: Addr,
}

/// Mean pinball loss of `pred = out + bias` (`out [h·B, nq]` time-major) against `target
/// [B, h]` (batch-major) at `quantiles [nq]` (F32): `loss [1]` and `dout [h·B, nq]`, the
/// gradient of the mean with candle's tie rule for `max` (an exact tie splits it in half).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pinball {
    pub batch: usize,
    pub h: usize,
    pub nq: usize,
    pub out: Addr,
    pub bias: Addr,
    pub target: Addr,
    pub quantiles: Addr,
    pub loss: Addr,
    pub dout: Addr,
}

/// The fused TFT step's operations on one backend. Every method queues its work (in order,
/// on one stream for CUDA) and reads nothing back, so a CUDA graph can capture a whole step.
///
/// # Safety
/// Every method dereferences the addresses in its arguments: they must be live buffers of
/// this backend (F32 unless said otherwise) of the sizes the arguments imply, and outputs
/// must not overlap inputs except where a field says it may.
// One contract for every method, stated above rather than repeated on each.
#[allow(clippy::missing_safety_doc)]
pub trait TftKernels {
    /// Runs a GEMM ([`Gemm`], F32 output).
    unsafe fn gemm(&self, g: &Gemm) -> Result<()>;
    /// Zeroes `n` F32 values.
    unsafe fn zero(&self, a: Addr, n: usize) -> Result<()>;
    /// Copies `n` F32 values.
    unsafe fn copy(&self, dst: Addr, src: Addr, n: usize) -> Result<()>;
    /// Writes `n` F32 values at `src` as BF16 (round to nearest even) at `dst`: a GEMM
    /// operand's copy under BF16 compute.
    unsafe fn cast_bf16(&self, src: Addr, dst: Addr, n: usize) -> Result<()>;
    unsafe fn pack(&self, a: &Pack) -> Result<()>;
    unsafe fn embed_fwd(&self, a: &Embed) -> Result<()>;
    unsafe fn embed_bwd(&self, a: &Embed, g: &EmbedGrads) -> Result<()>;
    unsafe fn bias_act(&self, a: &BiasAct) -> Result<()>;
    /// The gradient through a [`BiasAct`] in place on `grad [rows, cols]`, from its output
    /// (`a.y` after the forward): ELU's derivative from its output, or the same dropout
    /// mask (ELU with dropout together is not supported).
    unsafe fn act_bwd(&self, a: &BiasAct, grad: Addr) -> Result<()>;
    unsafe fn glu_ln_fwd(&self, a: &GluLn) -> Result<()>;
    unsafe fn glu_ln_bwd(&self, a: &GluLn, g: &GluLnGrads) -> Result<()>;
    unsafe fn vsn_mix_fwd(&self, a: &VsnMix) -> Result<()>;
    unsafe fn vsn_mix_bwd(&self, a: &VsnMix, g: &VsnMixGrads) -> Result<()>;
    /// LSTM step `t` (0-based, in order).
    unsafe fn lstm_fwd_step(&self, a: &Lstm, t: usize) -> Result<()>;
    /// LSTM backward step `t` (from `steps − 1` down to 0).
    unsafe fn lstm_bwd_step(&self, a: &Lstm, g: &LstmGrads, t: usize) -> Result<()>;
    unsafe fn attn_fwd(&self, a: &Attn) -> Result<()>;
    unsafe fn attn_bwd(&self, a: &Attn, g: &AttnGrads) -> Result<()>;
    unsafe fn pinball(&self, a: &Pinball) -> Result<()>;
    /// Runs a [`VsnForecast`] if this backend has its own for network `a.key` (true); by
    /// default none (false), and the caller runs the network op by op.
    unsafe fn vsn_forecast(&self, a: &VsnForecast) -> Result<bool> {
        let _ = a;
        Ok(false)
    }
}

/// The memory side of a backend: the fused step's buffers and the addresses of candle
/// tensors it reads.
pub trait TftBackend: TftKernels {
    /// A new zeroed F32 buffer of `n > 0` elements, alive as long as the backend.
    fn alloc(&mut self, n: usize) -> Result<Addr>;
    /// The address of a contiguous candle tensor's first element (F32 or U32) on this
    /// backend's device; valid while the tensor's storage lives.
    fn addr_of(&self, t: &Tensor, what: &'static str) -> Result<Addr>;
    /// `shape`'s elements at `a` (inside one buffer from [`TftBackend::alloc`]) as an F32
    /// tensor: a view of the buffer on CUDA, a copy on the CPU.
    fn tensor_at(&self, a: Addr, shape: &[usize]) -> Result<Tensor>;
}

/// The reference backend: plain loops over host memory (addresses are host pointers), in
/// F32 as the kernels compute (GEMMs accumulate in f64). Owns the buffers it allocates: raw
/// allocations (address, length), since the ops write through their addresses, which a
/// pointer taken from a live `Box` or `Vec` would not permit.
#[derive(Debug, Default)]
pub struct CpuTft {
    buffers: Vec<(*mut f32, usize)>,
}

impl CpuTft {
    /// A backend with no buffers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The buffer holding `n` elements at `a`, as (base, length).
    fn buffer_of(&self, a: Addr, n: usize) -> Option<(*mut f32, usize)> {
        self.buffers.iter().copied().find(|&(p, len)| {
            let base = p as Addr;
            a >= base && a + (n * 4) as Addr <= base + (len * 4) as Addr
        })
    }
}

impl Drop for CpuTft {
    fn drop(&mut self) {
        for &(p, len) in &self.buffers {
            // SAFETY: each pair came from `Box::into_raw` of a `[f32]` of `len` elements in
            // `alloc` and is freed once, here.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) });
        }
    }
}

impl TftBackend for CpuTft {
    fn alloc(&mut self, n: usize) -> Result<Addr> {
        if n == 0 {
            return Err(Error::shape("buffer", "CpuTft::alloc", "at least one element", "0"));
        }
        let p = Box::into_raw(vec![0f32; n].into_boxed_slice()) as *mut f32;
        self.buffers.push((p, n));
        Ok(p as Addr)
    }

    fn addr_of(&self, t: &Tensor, what: &'static str) -> Result<Addr> {
        const CTX: &str = "CpuTft::addr_of";
        let (storage, layout) = t.storage_and_layout();
        if !layout.is_contiguous() {
            return Err(Error::shape(what, CTX, "a contiguous tensor", "a strided view"));
        }
        let Storage::Cpu(cs) = &*storage else {
            return Err(Error::Device { what, expected: "the CPU".into(), context: CTX });
        };
        let base = match t.dtype() {
            DType::F32 => cs.as_slice::<f32>().ctx(CTX)?.as_ptr() as Addr,
            DType::U32 => cs.as_slice::<u32>().ctx(CTX)?.as_ptr() as Addr,
            other => return Err(Error::DType { what, expected: DType::F32, got: other, context: CTX }),
        };
        Ok(base + (layout.start_offset() * 4) as Addr)
    }

    fn tensor_at(&self, a: Addr, shape: &[usize]) -> Result<Tensor> {
        const CTX: &str = "CpuTft::tensor_at";
        let n: usize = shape.iter().product();
        self.buffer_of(a, n)
            .ok_or_else(|| Error::shape("address", CTX, "inside one allocated buffer", format!("{a:#x} + {n}")))?;
        // SAFETY: `a .. a + n` lies inside a live buffer of this backend (checked above).
        let values = unsafe { std::slice::from_raw_parts(a as *const f32, n) };
        Tensor::from_slice(values, shape, &Device::Cpu).ctx(CTX)
    }
}

#[inline]
unsafe fn rd(a: Addr, i: usize) -> f32 {
    unsafe { *(a as *const f32).add(i) }
}

#[inline]
unsafe fn wr(a: Addr, i: usize, v: f32) {
    unsafe { *(a as *mut f32).add(i) = v }
}

/// Writes `v` as BF16 at element `i` of `a`, if `a` is not 0.
#[inline]
unsafe fn wr16(a: Addr, i: usize, v: f32) {
    if a != 0 {
        unsafe { *(a as *mut u16).add(i) = half::bf16::from_f32(v).to_bits() }
    }
}

/// `1 / (1 + e^{−x})`, as candle-nn's sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / ((-x).exp() + 1.0)
}

/// ELU with α = 1 (candle's: a negative sign, −0 included, takes `eˣ − 1`).
#[inline]
pub fn elu(x: f32) -> f32 {
    if x.is_sign_negative() {
        x.exp() - 1.0
    } else {
        x
    }
}

/// ELU's derivative from its output `y`: 1 above zero, `y + 1 = eˣ` at or below.
#[inline]
pub fn elu_grad_from_output(y: f32) -> f32 {
    if y > 0.0 {
        1.0
    } else {
        y + 1.0
    }
}

impl DropoutSite {
    /// The scaled mask value of element `(row, col)` of a `[groups · steps · B, cols]` buffer.
    pub fn mask(&self, row: usize, col: usize, cols: usize, step: u32) -> f32 {
        let per_group = self.steps * self.batch;
        let (j, rr) = (row / per_group, row % per_group);
        let (s, b) = (rr / self.batch, rr % self.batch);
        let idx = (((j * self.batch + b) * self.steps + s) * cols + col) as u64;
        let u = fx_kernels::rng::draw(
            self.seed,
            fx_precision::dropout::STREAM_DROPOUT,
            self.call,
            ((step as u64) << 32) | idx,
        );
        if u >= self.p {
            self.scale
        } else {
            0.0
        }
    }
}

/// Mean, `1/σ` (as `1 / sqrt(var + eps)`) of `z`, the biased variance, as candle's composite.
fn ln_stats(z: &[f32], eps: f32) -> (f32, f32) {
    let n = z.len() as f32;
    let mean = z.iter().sum::<f32>() / n;
    let var = z.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// LayerNorm backward of one row: `dz` from `dy`, the normalised row `xn`, `w` and `rstd`;
/// adds `dy · xn` and `dy` into `dw`, `db`.
fn ln_backward(dy: &[f32], xn: &[f32], w: &[f32], rstd: f32, dz: &mut [f32], dw: &mut [f32], db: &mut [f32]) {
    let o = dy.len() as f32;
    let (mut mg, mut mgx) = (0f32, 0f32);
    for k in 0..dy.len() {
        let g = dy[k] * w[k];
        mg += g;
        mgx += g * xn[k];
        dw[k] += dy[k] * xn[k];
        db[k] += dy[k];
    }
    let (mg, mgx) = (mg / o, mgx / o);
    for k in 0..dy.len() {
        dz[k] = (dy[k] * w[k] - mg - xn[k] * mgx) * rstd;
    }
}

/// Sums `partials [groups][blocks][2][width]` over blocks into `w [groups, width]` and
/// `b [groups, width]`.
unsafe fn reduce_partials(partials: Addr, groups: usize, blocks: usize, width: usize, w: Addr, b: Addr) {
    for g in 0..groups {
        for k in 0..width {
            let (mut sw, mut sb) = (0f32, 0f32);
            for bi in 0..blocks {
                let base = ((g * blocks + bi) * 2) * width;
                unsafe {
                    sw += rd(partials, base + k);
                    sb += rd(partials, base + width + k);
                }
            }
            unsafe {
                wr(w, g * width + k, sw);
                wr(b, g * width + k, sb);
            }
        }
    }
}

impl GluLn {
    /// Row `r`'s `z`, `σ(g4 + b4)` and `g5 + b5`.
    unsafe fn row(&self, r: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let o = self.o;
        let (mut z, mut s, mut v5) = (vec![0f32; o], vec![0f32; o], vec![0f32; o]);
        for k in 0..o {
            unsafe {
                let i = r * o + k;
                s[k] = sigmoid(rd(self.g4, i) + rd(self.b4, k));
                v5[k] = rd(self.g5, i) + rd(self.b5, k);
                let res = if self.res_bias != 0 { rd(self.res, i) + rd(self.res_bias, k) } else { rd(self.res, i) };
                z[k] = res + s[k] * v5[k];
            }
        }
        (z, s, v5)
    }
}

fn softmax_in_place(y: &mut [f32]) {
    let m = y.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in y.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in y.iter_mut() {
        *v /= sum;
    }
}

impl VsnMix {
    /// Row `r`, variable `j`: `z`, `σ(g4 + b4)`, `g5 + b5`.
    unsafe fn row(&self, r: usize, j: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = self.d;
        let (mut z, mut s, mut v5) = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
        for k in 0..d {
            unsafe {
                let gi = (j * self.rows + r) * d + k;
                s[k] = sigmoid(rd(self.g4, gi) + rd(self.b4, j * d + k));
                v5[k] = rd(self.g5, gi) + rd(self.b5, j * d + k);
                z[k] = rd(self.emb, (r * self.n + j) * d + k) + s[k] * v5[k];
            }
        }
        (z, s, v5)
    }
}

/// The cell of LSTM step `t` on the host (what [`CpuTft`]'s step runs after its recurrent
/// product, and what a backend with its own recurrent product reuses): gates from `xg`, both
/// biases and `rec [B, 4d]` (`h_{t−1} · W_hhᵀ`, row `b` for batch row `b`; ignored at `t =
/// 0`, where `h` and `c` start at zero), then `c`, `h` and the activated gates of step `t`.
///
/// # Safety
/// `a`'s addresses are live host buffers of the sizes [`Lstm`] states; `rec` holds `B · 4d`
/// values.
pub unsafe fn lstm_cell_step(a: &Lstm, t: usize, rec: &[f32]) {
    let (bs, d) = (a.batch, a.d);
    let seg = usize::from(t >= a.l_enc);
    for b in 0..bs {
        let row = t * bs + b;
        for u in 0..d {
            let mut pre = [0f32; 4];
            for (gi, p) in pre.iter_mut().enumerate() {
                let col = gi * d + u;
                let r = if t > 0 { rec[b * 4 * d + col] } else { 0.0 };
                let bias = unsafe { rd(a.b_ih[seg], col) + rd(a.b_hh[seg], col) };
                *p = unsafe { rd(a.xg, row * 4 * d + col) } + bias + r;
            }
            let (i, f, g, o) = (sigmoid(pre[0]), sigmoid(pre[1]), pre[2].tanh(), sigmoid(pre[3]));
            let c_prev = if t > 0 { unsafe { rd(a.c, (row - bs) * d + u) } } else { 0.0 };
            let c = f * c_prev + i * g;
            unsafe {
                wr(a.c, row * d + u, c);
                wr(a.h, row * d + u, o * c.tanh());
                for (gi, v) in [i, f, g, o].into_iter().enumerate() {
                    wr(a.gates, row * 4 * d + gi * d + u, v);
                }
            }
        }
    }
}

impl TftKernels for CpuTft {
    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        unsafe { gemm_ref(g) };
        Ok(())
    }

    unsafe fn zero(&self, a: Addr, n: usize) -> Result<()> {
        for i in 0..n {
            unsafe { wr(a, i, 0.0) };
        }
        Ok(())
    }

    unsafe fn copy(&self, dst: Addr, src: Addr, n: usize) -> Result<()> {
        unsafe { std::ptr::copy(src as *const f32, dst as *mut f32, n) };
        Ok(())
    }

    unsafe fn cast_bf16(&self, src: Addr, dst: Addr, n: usize) -> Result<()> {
        for i in 0..n {
            unsafe { wr16(dst, i, rd(src, i)) };
        }
        Ok(())
    }

    unsafe fn pack(&self, a: &Pack) -> Result<()> {
        let (bs, l, steps) = (a.batch, a.l_enc, a.l_enc + a.h);
        let ne = a.n_obs + a.n_known;
        for s in 0..l {
            for b in 0..bs {
                let row = s * bs + b;
                for j in 0..ne {
                    let v = if j < a.n_obs {
                        unsafe { rd(a.observed, (b * l + s) * a.n_obs + j) }
                    } else {
                        unsafe { rd(a.known, (b * steps + s) * a.n_known + j - a.n_obs) }
                    };
                    unsafe { wr(a.raw_enc, row * ne + j, v) };
                }
            }
        }
        for s in 0..a.h {
            for b in 0..bs {
                for j in 0..a.n_known {
                    let v = unsafe { rd(a.known, (b * steps + l + s) * a.n_known + j) };
                    unsafe { wr(a.raw_dec, (s * bs + b) * a.n_known + j, v) };
                }
            }
        }
        Ok(())
    }

    unsafe fn embed_fwd(&self, a: &Embed) -> Result<()> {
        for r in 0..a.rows {
            for j in 0..a.n {
                let x = unsafe { rd(a.raw, r * a.n + j) };
                for k in 0..a.d {
                    let v = unsafe { x * rd(a.w, j * a.d + k) + rd(a.b, j * a.d + k) };
                    unsafe {
                        wr(a.emb, (r * a.n + j) * a.d + k, v);
                        wr16(a.emb16, (r * a.n + j) * a.d + k, v);
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn embed_bwd(&self, a: &Embed, g: &EmbedGrads) -> Result<()> {
        let blocks = a.rows.div_ceil(PARTIAL_ROWS);
        for j in 0..a.n {
            for bi in 0..blocks {
                let base = ((j * blocks + bi) * 2) * a.d;
                for k in 0..a.d {
                    let (mut sw, mut sb) = (0f32, 0f32);
                    for r in bi * PARTIAL_ROWS..((bi + 1) * PARTIAL_ROWS).min(a.rows) {
                        let de = unsafe { rd(g.demb, (r * a.n + j) * a.d + k) };
                        sw += de * unsafe { rd(a.raw, r * a.n + j) };
                        sb += de;
                    }
                    unsafe {
                        wr(g.partials, base + k, sw);
                        wr(g.partials, base + a.d + k, sb);
                    }
                }
            }
        }
        unsafe { reduce_partials(g.partials, a.n, blocks, a.d, g.dw, g.db) };
        Ok(())
    }

    unsafe fn bias_act(&self, a: &BiasAct) -> Result<()> {
        let step = match &a.dropout {
            Some(s) => unsafe { *(s.step as *const u32) },
            None => 0,
        };
        for r in 0..a.rows {
            let g = r / a.rows_per_group;
            for k in 0..a.cols {
                let i = r * a.cols + k;
                let mut v = unsafe { rd(a.y, i) + rd(a.bias, g * a.cols + k) };
                if a.act == Act::Elu {
                    v = elu(v);
                }
                if let Some(s) = &a.dropout {
                    v *= s.mask(r, k, a.cols, step);
                }
                unsafe {
                    wr(a.y, i, v);
                    wr16(a.out16, i, v);
                }
            }
        }
        Ok(())
    }

    unsafe fn act_bwd(&self, a: &BiasAct, grad: Addr) -> Result<()> {
        if a.act == Act::Elu && a.dropout.is_some() {
            // ELU's derivative comes from its output, which a mask has scaled.
            return Err(Error::Unsupported { context: "CpuTft::act_bwd", message: "ELU and dropout together".into() });
        }
        let step = match &a.dropout {
            Some(s) => unsafe { *(s.step as *const u32) },
            None => 0,
        };
        for r in 0..a.rows {
            for k in 0..a.cols {
                let i = r * a.cols + k;
                let mut gv = unsafe { rd(grad, i) };
                if a.act == Act::Elu {
                    gv *= elu_grad_from_output(unsafe { rd(a.y, i) });
                }
                if let Some(s) = &a.dropout {
                    gv *= s.mask(r, k, a.cols, step);
                }
                unsafe {
                    wr(grad, i, gv);
                    wr16(a.out16, i, gv);
                }
            }
        }
        Ok(())
    }

    unsafe fn glu_ln_fwd(&self, a: &GluLn) -> Result<()> {
        for r in 0..a.rows {
            let (z, _, _) = unsafe { a.row(r) };
            let (mean, rstd) = ln_stats(&z, a.eps);
            let mut y: Vec<f32> =
                (0..a.o).map(|k| unsafe { (z[k] - mean) * rstd * rd(a.ln_w, k) + rd(a.ln_b, k) }).collect();
            if a.softmax {
                softmax_in_place(&mut y);
            }
            for (k, v) in y.iter().enumerate() {
                unsafe {
                    wr(a.out, r * a.o + k, *v);
                    wr16(a.out16, r * a.o + k, *v);
                }
            }
            unsafe {
                wr(a.stats, 2 * r, mean);
                wr(a.stats, 2 * r + 1, rstd);
            }
        }
        Ok(())
    }

    unsafe fn glu_ln_bwd(&self, a: &GluLn, g: &GluLnGrads) -> Result<()> {
        let o = a.o;
        let blocks = a.rows.div_ceil(PARTIAL_ROWS);
        let w: Vec<f32> = (0..o).map(|k| unsafe { rd(a.ln_w, k) }).collect();
        for bi in 0..blocks {
            let (mut dw, mut db) = (vec![0f32; o], vec![0f32; o]);
            for r in bi * PARTIAL_ROWS..((bi + 1) * PARTIAL_ROWS).min(a.rows) {
                let (z, s, v5) = unsafe { a.row(r) };
                let (mean, rstd) = unsafe { (rd(a.stats, 2 * r), rd(a.stats, 2 * r + 1)) };
                let xn: Vec<f32> = z.iter().map(|v| (v - mean) * rstd).collect();
                let mut dy: Vec<f32> = (0..o).map(|k| unsafe { rd(g.dout, r * o + k) }).collect();
                if a.softmax {
                    // dy = p ⊙ (dp − Σ p·dp), p recomputed from the LN output.
                    let mut p: Vec<f32> = (0..o).map(|k| unsafe { xn[k] * w[k] + rd(a.ln_b, k) }).collect();
                    softmax_in_place(&mut p);
                    let dot: f32 = p.iter().zip(&dy).map(|(p, d)| p * d).sum();
                    for k in 0..o {
                        dy[k] = p[k] * (dy[k] - dot);
                    }
                }
                let mut dz = vec![0f32; o];
                ln_backward(&dy, &xn, &w, rstd, &mut dz, &mut dw, &mut db);
                for k in 0..o {
                    let i = r * o + k;
                    unsafe {
                        let prev = if g.res_acc { rd(g.dres, i) } else { 0.0 };
                        wr(g.dres, i, prev + dz[k]);
                        let (d4, d5) = (dz[k] * v5[k] * s[k] * (1.0 - s[k]), dz[k] * s[k]);
                        wr(g.dg4, i, d4);
                        wr(g.dg5, i, d5);
                        wr16(g.dg4_16, i, d4);
                        wr16(g.dg5_16, i, d5);
                    }
                }
            }
            for k in 0..o {
                unsafe {
                    wr(g.partials, bi * 2 * o + k, dw[k]);
                    wr(g.partials, bi * 2 * o + o + k, db[k]);
                }
            }
        }
        unsafe { reduce_partials(g.partials, 1, blocks, o, g.dln_w, g.dln_b) };
        Ok(())
    }

    unsafe fn vsn_mix_fwd(&self, a: &VsnMix) -> Result<()> {
        let d = a.d;
        for r in 0..a.rows {
            let mut acc = vec![0f32; d];
            for j in 0..a.n {
                let (z, _, _) = unsafe { a.row(r, j) };
                let (mean, rstd) = ln_stats(&z, a.eps);
                let wj = unsafe { rd(a.wsel, r * a.n + j) };
                for k in 0..d {
                    let y = unsafe { (z[k] - mean) * rstd * rd(a.ln_w, j * d + k) + rd(a.ln_b, j * d + k) };
                    acc[k] += wj * y;
                }
                unsafe {
                    wr(a.stats, 2 * (j * a.rows + r), mean);
                    wr(a.stats, 2 * (j * a.rows + r) + 1, rstd);
                }
            }
            for (k, v) in acc.iter().enumerate() {
                unsafe {
                    wr(a.out, r * d + k, *v);
                    wr16(a.out16, r * d + k, *v);
                }
            }
        }
        Ok(())
    }

    unsafe fn vsn_mix_bwd(&self, a: &VsnMix, g: &VsnMixGrads) -> Result<()> {
        let d = a.d;
        let blocks = a.rows.div_ceil(PARTIAL_ROWS);
        for j in 0..a.n {
            let w: Vec<f32> = (0..d).map(|k| unsafe { rd(a.ln_w, j * d + k) }).collect();
            for bi in 0..blocks {
                let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
                for r in bi * PARTIAL_ROWS..((bi + 1) * PARTIAL_ROWS).min(a.rows) {
                    let (z, s, v5) = unsafe { a.row(r, j) };
                    let si = 2 * (j * a.rows + r);
                    let (mean, rstd) = unsafe { (rd(a.stats, si), rd(a.stats, si + 1)) };
                    let xn: Vec<f32> = z.iter().map(|v| (v - mean) * rstd).collect();
                    let dout: Vec<f32> = (0..d).map(|k| unsafe { rd(g.dout, r * d + k) }).collect();
                    // d wsel[r, j] = dout · y_j.
                    let dsel: f32 = (0..d).map(|k| dout[k] * unsafe { xn[k] * w[k] + rd(a.ln_b, j * d + k) }).sum();
                    unsafe { wr(g.dwsel, r * a.n + j, dsel) };
                    let wj = unsafe { rd(a.wsel, r * a.n + j) };
                    let dy: Vec<f32> = dout.iter().map(|v| v * wj).collect();
                    let mut dz = vec![0f32; d];
                    ln_backward(&dy, &xn, &w, rstd, &mut dz, &mut dw, &mut db);
                    for k in 0..d {
                        let gi = (j * a.rows + r) * d + k;
                        let (d4, d5) = (dz[k] * v5[k] * s[k] * (1.0 - s[k]), dz[k] * s[k]);
                        unsafe {
                            wr(g.demb, (r * a.n + j) * d + k, dz[k]);
                            wr(g.dg4, gi, d4);
                            wr(g.dg5, gi, d5);
                            wr16(g.dg4_16, gi, d4);
                            wr16(g.dg5_16, gi, d5);
                        }
                    }
                }
                let base = ((j * blocks + bi) * 2) * d;
                for k in 0..d {
                    unsafe {
                        wr(g.partials, base + k, dw[k]);
                        wr(g.partials, base + d + k, db[k]);
                    }
                }
            }
        }
        unsafe { reduce_partials(g.partials, a.n, blocks, d, g.dln_w, g.dln_b) };
        Ok(())
    }

    unsafe fn lstm_fwd_step(&self, a: &Lstm, t: usize) -> Result<()> {
        let (bs, d) = (a.batch, a.d);
        let seg = usize::from(t >= a.l_enc);
        let mut rec = vec![0f32; bs * 4 * d];
        if t > 0 {
            for (b, rb) in rec.chunks_exact_mut(4 * d).enumerate() {
                let prev = (t - 1) * bs + b;
                for (col, r) in rb.iter_mut().enumerate() {
                    for k in 0..d {
                        *r += unsafe { rd(a.h, prev * d + k) * rd(a.w_hh[seg], col * d + k) };
                    }
                }
            }
        }
        unsafe { lstm_cell_step(a, t, &rec) };
        Ok(())
    }

    unsafe fn lstm_bwd_step(&self, a: &Lstm, g: &LstmGrads, t: usize) -> Result<()> {
        let (bs, d) = (a.batch, a.d);
        // The recurrent gradient comes through the *next* step's weights.
        let next_seg = usize::from(t + 1 >= a.l_enc);
        for b in 0..bs {
            let row = t * bs + b;
            for u in 0..d {
                let mut dh = unsafe { rd(g.dh_out, row * d + u) };
                if t + 1 < a.steps {
                    for k in 0..4 * d {
                        dh += unsafe { rd(g.dgates, (row + bs) * 4 * d + k) * rd(a.w_hh[next_seg], k * d + u) };
                    }
                }
                let gate = |gi: usize| unsafe { rd(a.gates, row * 4 * d + gi * d + u) };
                let (i, f, gg, o) = (gate(0), gate(1), gate(2), gate(3));
                let c = unsafe { rd(a.c, row * d + u) };
                let c_prev = if t > 0 { unsafe { rd(a.c, (row - bs) * d + u) } } else { 0.0 };
                let tc = c.tanh();
                let dc_next = if t + 1 < a.steps { unsafe { rd(g.dc, b * d + u) } } else { 0.0 };
                let dc = dc_next + dh * o * (1.0 - tc * tc);
                let pre = [
                    dc * gg * i * (1.0 - i),
                    dc * c_prev * f * (1.0 - f),
                    dc * i * (1.0 - gg * gg),
                    dh * tc * o * (1.0 - o),
                ];
                unsafe {
                    for (gi, v) in pre.into_iter().enumerate() {
                        wr(g.dgates, row * 4 * d + gi * d + u, v);
                    }
                    wr(g.dc, b * d + u, dc * f);
                }
            }
        }
        Ok(())
    }

    unsafe fn attn_fwd(&self, a: &Attn) -> Result<()> {
        let (bs, steps, w) = (a.batch, a.l_enc + a.h, a.n_head * a.dk);
        for b in 0..bs {
            for s in 0..a.h {
                let qrow = s * bs + b;
                let mut avg = vec![0f32; a.dk];
                for hd in 0..a.n_head {
                    let visible = a.l_enc + s + 1;
                    let mut sc = vec![0f32; visible];
                    for (t, v) in sc.iter_mut().enumerate() {
                        let krow = t * bs + b;
                        let mut dot = 0f32;
                        for c in 0..a.dk {
                            let col = hd * a.dk + c;
                            dot += unsafe {
                                (rd(a.q, qrow * w + col) + rd(a.bq, col)) * (rd(a.k, krow * w + col) + rd(a.bk, col))
                            };
                        }
                        *v = dot * a.scale;
                    }
                    softmax_in_place(&mut sc);
                    let abase = ((b * a.n_head + hd) * a.h + s) * steps;
                    for t in 0..steps {
                        unsafe { wr(a.attn, abase + t, if t < visible { sc[t] } else { 0.0 }) };
                    }
                    for c in 0..a.dk {
                        let mut o = 0f32;
                        for (t, p) in sc.iter().enumerate() {
                            o += p * unsafe { rd(a.v, (t * bs + b) * a.dk + c) + rd(a.bv, c) };
                        }
                        avg[c] += o;
                    }
                }
                let inv = 1.0 / a.n_head as f32;
                for (c, v) in avg.iter().enumerate() {
                    unsafe { wr(a.avg, qrow * a.dk + c, v * inv) };
                }
            }
        }
        Ok(())
    }

    unsafe fn attn_bwd(&self, a: &Attn, g: &AttnGrads) -> Result<()> {
        let (bs, steps, w, dk) = (a.batch, a.l_enc + a.h, a.n_head * a.dk, a.dk);
        let inv = 1.0 / a.n_head as f32;
        for b in 0..bs {
            // ds[hd][s][t]: the gradient of the scaled score.
            let mut ds = vec![0f32; a.n_head * a.h * steps];
            for hd in 0..a.n_head {
                for s in 0..a.h {
                    let abase = ((b * a.n_head + hd) * a.h + s) * steps;
                    let da: Vec<f32> = (0..steps)
                        .map(|t| {
                            (0..dk)
                                .map(|c| unsafe {
                                    rd(g.davg, (s * bs + b) * dk + c)
                                        * inv
                                        * (rd(a.v, (t * bs + b) * dk + c) + rd(a.bv, c))
                                })
                                .sum()
                        })
                        .collect();
                    let dot: f32 = (0..steps).map(|t| unsafe { rd(a.attn, abase + t) } * da[t]).sum();
                    for t in 0..steps {
                        ds[(hd * a.h + s) * steps + t] = unsafe { rd(a.attn, abase + t) } * (da[t] - dot);
                    }
                }
            }
            for t in 0..steps {
                let krow = t * bs + b;
                for hd in 0..a.n_head {
                    for c in 0..dk {
                        let col = hd * dk + c;
                        let mut acc = 0f32;
                        for s in 0..a.h {
                            acc += ds[(hd * a.h + s) * steps + t]
                                * unsafe { rd(a.q, (s * bs + b) * w + col) + rd(a.bq, col) };
                        }
                        unsafe { wr(g.dk, krow * w + col, acc * a.scale) };
                    }
                }
                for c in 0..dk {
                    let mut acc = 0f32;
                    for hd in 0..a.n_head {
                        for s in 0..a.h {
                            let p = unsafe { rd(a.attn, ((b * a.n_head + hd) * a.h + s) * steps + t) };
                            acc += p * unsafe { rd(g.davg, (s * bs + b) * dk + c) } * inv;
                        }
                    }
                    unsafe { wr(g.dv, krow * dk + c, acc) };
                }
            }
            for s in 0..a.h {
                for hd in 0..a.n_head {
                    for c in 0..dk {
                        let col = hd * dk + c;
                        let mut acc = 0f32;
                        for t in 0..steps {
                            acc += ds[(hd * a.h + s) * steps + t]
                                * unsafe { rd(a.k, (t * bs + b) * w + col) + rd(a.bk, col) };
                        }
                        unsafe { wr(g.dq, (s * bs + b) * w + col, acc * a.scale) };
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn pinball(&self, a: &Pinball) -> Result<()> {
        let n = a.batch * a.h * a.nq;
        let inv = 1.0 / n as f32;
        let mut sum = 0f32;
        for s in 0..a.h {
            for b in 0..a.batch {
                let row = s * a.batch + b;
                let y = unsafe { rd(a.target, b * a.h + s) };
                for qi in 0..a.nq {
                    let q = unsafe { rd(a.quantiles, qi) };
                    let pred = unsafe { rd(a.out, row * a.nq + qi) + rd(a.bias, qi) };
                    let e = y - pred;
                    let (l1, l2) = (e * q, e * (q - 1.0));
                    sum += l1.max(l2);
                    unsafe { wr(a.dout, row * a.nq + qi, -inv * pinball_slope(l1, l2, q)) };
                }
            }
        }
        unsafe { wr(a.loss, 0, sum * inv) };
        Ok(())
    }
}

/// `d max(e·q, e·(q − 1)) / de` with candle's rule for `max`: the larger side's slope, half
/// of each at an exact tie.
pub fn pinball_slope(l1: f32, l2: f32, q: f32) -> f32 {
    if l1 > l2 {
        q
    } else if l2 > l1 {
        q - 1.0
    } else {
        0.5 * q + 0.5 * (q - 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partials_len_counts_blocks_per_group() {
        assert_eq!(partials_len(1, 64, 8), 16);
        assert_eq!(partials_len(3, 65, 8), 3 * 2 * 2 * 8);
    }

    #[test]
    fn dropout_site_indexes_like_the_batch_major_tensor() {
        // Group 1, step 2, batch 0 of a [2 groups, B 3, 4 steps, 5 cols] tensor, column 4.
        let step = 7u32;
        let site = DropoutSite { seed: 9, call: 2, step: 0, p: 0.5, scale: 2.0, batch: 3, steps: 4 };
        let row = 4 * 3 + 2 * 3;
        // Batch-major index ((j·B + b)·steps + s)·cols + k with j 1, b 0, s 2, k 4.
        let (j, b, s, k) = (1, 0, 2, 4);
        let want = fx_precision::dropout::mask_reference(9, 2, step, 2 * 3 * 4 * 5, 0.5)[((j * 3 + b) * 4 + s) * 5 + k];
        assert_eq!(site.mask(row, 4, 5, step), want);
    }

    #[test]
    fn elu_derivative_from_its_output_matches_the_input_form() {
        for x in [-3.0f32, -0.5, -1e-12, 0.0, 1e-12, 0.25, 4.0] {
            let want = if x > 0.0 { 1.0 } else { x.exp() };
            assert!((elu_grad_from_output(elu(x)) - want).abs() < 1e-6, "{x}");
        }
    }

    #[test]
    fn pinball_slope_splits_ties() {
        assert_eq!(pinball_slope(1.0, -1.0, 0.9), 0.9);
        assert!((pinball_slope(-0.1, 0.9, 0.1) - (0.1 - 1.0)).abs() < 1e-7);
        assert!((pinball_slope(0.0, 0.0, 0.1) - (0.1 - 0.5)).abs() < 1e-7);
    }
}
