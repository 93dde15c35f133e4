//! The MAMBA-2 training step (forward, MSE loss, backward) on the GPU without candle's autograd
//! (feature `cuda`): the operation list of [`super::step::StepPlan`] on preallocated device
//! buffers, each operation a cuBLAS call (`fx_kernels::cuda::blas`) or a kernel of
//! `fx_kernels::cuda::{mamba2, ssd}`. About 14 launches per layer instead of candle's
//! thousands; nothing reads to the host and no size depends on the data, so a CUDA graph can
//! capture [`Mamba2Fused::loss_and_grads`], and calling it again overwrites the same buffers.
//!
//! F32, or BF16 compute as the candle path's autocast: the GEMMs read BF16 copies of their
//! inputs (written by the kernels that produce them, or cast from the weights and the input at
//! the start of the step) and accumulate in F32; activations, the scan, norms, reductions and
//! gradients stay F32. The same plan runs on the CPU references in the tests of `step`, which
//! compare it with `Mamba2::loss_and_grads`; the device tests in
//! `tests/mamba2_fused_gpu.rs` compare this with the candle step on the GPU.

use crate::mamba2::ops_cuda::{
    ConvBwdArgs, ConvFwdArgs, GatedBwdArgs, GatedFwdArgs, HeadFwdArgs, Mamba2Kernels, RmsBwdArgs, RmsFwdArgs,
};
use crate::mamba2::ssd_cuda::{SsdBwdArgs, SsdFwdArgs, SsdKernels};
use crate::mlp::train_cuda::MlpTrainKernels;
use candle_core::{DType, Device, Tensor};
use fx_kernels::cuda::address;
use fx_kernels::cuda::blas::{Blas, Gemm};
use fx_precision::Precision;

use super::step::{
    At, Backend, Buf, BufKind, ColSumsOp, ConvBwdOp, ConvFwdOp, GatedBwdOp, GatedFwdOp, GemmOp, HeadFwdOp, LossOp,
    RmsBwdOp, RmsFwdOp, RowGradAt, SsdBwdOp, SsdFwdOp, StepPlan,
};
use super::Mamba2;
use crate::error::{Context, Error, Result};

const CTX: &str = "Mamba2Fused";

/// Buffers and kernels of the fused MAMBA-2 step at one batch size and sequence length.
#[derive(Debug)]
pub struct Mamba2Fused {
    plan: StepPlan,
    blas: Blas,
    mk: Mamba2Kernels,
    sk: SsdKernels,
    /// The F32 → BF16 cast (BF16 compute only).
    cast: Option<MlpTrainKernels>,
    device: Device,
    /// Per plan buffer: the F32 tensor this struct owns (activations, scratch, gradients, loss);
    /// `None` for parameters and the caller's inputs.
    owned: Vec<Option<Tensor>>,
    /// Per plan buffer: its BF16 shadow (BF16 compute only).
    shadows: Vec<Option<Tensor>>,
    /// The model's parameters (updated in place by the optimiser: their addresses hold).
    params: Vec<Tensor>,
    /// Ones for the column sums.
    ones: Tensor,
    /// Views into the flat gradient buffer, one per parameter in `params().vars()` order.
    grads: Vec<Tensor>,
    /// Scalar view of the loss buffer.
    loss: Tensor,
}

fn addr(t: &Tensor) -> Result<u64> {
    address::<f32>(t, "buffer").ctx(CTX)
}

impl Mamba2Fused {
    /// Buffers for `batch` windows of `seq_len` steps of `model` (on a CUDA device); `precision`
    /// F32 or BF16 (GEMM inputs in BF16, F32 accumulation, everything else F32). An
    /// `Error::Config` for sizes beyond the kernels' limits (headdim, d_state <= 64,
    /// d_conv <= 8, d_model, d_inner <= 1536, batch <= 65535).
    pub fn new(model: &Mamba2, batch: usize, seq_len: usize, precision: Precision) -> Result<Self> {
        let bf16 = match precision {
            Precision::F32 => false,
            Precision::Bf16 => true,
            other => return Err(Error::config(CTX, format!("precision {other} (F32 or BF16)"))),
        };
        let device = model.params().device().clone();
        if !device.is_cuda() {
            return Err(Error::config(CTX, "the model's parameters must live on a CUDA device"));
        }
        let plan = StepPlan::new(model, batch, seq_len, bf16)?;
        let mut owned = Vec::with_capacity(plan.bufs.len());
        let mut shadows = Vec::with_capacity(plan.bufs.len());
        for spec in &plan.bufs {
            owned.push(match spec.kind {
                BufKind::Act | BufKind::Grad | BufKind::Loss => {
                    Some(Tensor::zeros(spec.len, DType::F32, &device).ctx(CTX)?)
                }
                BufKind::Param(_) | BufKind::Input | BufKind::Target => None,
            });
            shadows.push(if spec.bf16 { Some(Tensor::zeros(spec.len, DType::BF16, &device).ctx(CTX)?) } else { None });
        }
        let vars = model.params().vars();
        let flat = owned[plan.grad.0].clone().ok_or_else(|| Error::config(CTX, "no gradient buffer"))?;
        let mut grads = Vec::with_capacity(vars.len());
        for (v, &off) in vars.iter().zip(&plan.grad_offsets) {
            grads.push(flat.narrow(0, off, v.elem_count()).and_then(|g| g.reshape(v.dims())).ctx(CTX)?);
        }
        let loss =
            owned[plan.loss.0].as_ref().ok_or_else(|| Error::config(CTX, "no loss buffer"))?.reshape(()).ctx(CTX)?;
        Ok(Self {
            blas: Blas::new(&device).ctx(CTX)?,
            mk: Mamba2Kernels::load(&device).ctx(CTX)?,
            sk: SsdKernels::load(&device).ctx(CTX)?,
            cast: if bf16 { Some(MlpTrainKernels::load(&device).ctx(CTX)?) } else { None },
            ones: Tensor::ones(plan.max_sum_rows(), DType::F32, &device).ctx(CTX)?,
            params: vars.iter().map(|v| v.as_tensor().clone()).collect(),
            device,
            owned,
            shadows,
            grads,
            loss,
            plan,
        })
    }

    /// The batch size the buffers were made for.
    pub fn batch(&self) -> usize {
        self.plan.dims.batch
    }

    /// The sequence length the buffers were made for.
    pub fn seq_len(&self) -> usize {
        self.plan.dims.len
    }

    /// Queues forward, MSE loss and backward of `x [batch, seq_len, n_in]` against
    /// `target [batch, seq_len]` (F32, contiguous, on the model's device) on candle's stream.
    /// Returns the loss (F32 scalar) and one F32 gradient per parameter in
    /// `model.params().vars()` order, views into buffers this struct owns: the next call
    /// overwrites them. Nothing is read to the host and nothing is allocated on the device, so
    /// a CUDA graph can capture the call.
    pub fn loss_and_grads(&self, x: &Tensor, target: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let d = &self.plan.dims;
        let check = |t: &Tensor, what: &'static str, dims: &[usize]| -> Result<()> {
            if t.dims() != dims
                || t.dtype() != DType::F32
                || !t.is_contiguous()
                || !t.device().same_device(&self.device)
            {
                return Err(Error::shape(
                    what,
                    CTX,
                    format!("a contiguous F32 {dims:?} tensor on the model's device"),
                    format!("{:?} {:?} on {:?}", t.dims(), t.dtype(), t.device().location()),
                ));
            }
            Ok(())
        };
        check(x, "x", &[d.batch, d.len, d.n_in])?;
        check(target, "target", &[d.batch, d.len])?;
        let n = self.plan.bufs.len();
        let (mut a, mut a16) = (vec![0u64; n], vec![0u64; n]);
        for (i, spec) in self.plan.bufs.iter().enumerate() {
            a[i] = match spec.kind {
                BufKind::Param(k) => addr(&self.params[k])?,
                BufKind::Input => addr(x)?,
                BufKind::Target => addr(target)?,
                BufKind::Act | BufKind::Grad | BufKind::Loss => {
                    addr(self.owned[i].as_ref().ok_or_else(|| Error::config(CTX, "a missing buffer"))?)?
                }
            };
            if let Some(s) = &self.shadows[i] {
                a16[i] = address::<half::bf16>(s, "shadow").ctx(CTX)?;
            }
        }
        let mut be = GpuBackend { f: self, a, a16, ones: addr(&self.ones)? };
        self.plan.record(&mut be)?;
        Ok((self.loss.clone(), self.grads.clone()))
    }
}

/// The plan's operations as launches on resolved device addresses.
struct GpuBackend<'a> {
    f: &'a Mamba2Fused,
    /// Per plan buffer: its F32 address, and its BF16 shadow's (0: none).
    a: Vec<u64>,
    a16: Vec<u64>,
    ones: u64,
}

impl GpuBackend<'_> {
    fn at(&self, p: At) -> u64 {
        self.a[p.buf.0] + (p.off * 4) as u64
    }
    fn at16(&self, p: At) -> u64 {
        match self.a16[p.buf.0] {
            0 => 0,
            base => base + (p.off * 2) as u64,
        }
    }
    fn opt(&self, p: Option<At>) -> u64 {
        p.map_or(0, |p| self.at(p))
    }
    fn ssd_fwd_args(&self, o: &SsdFwdOp) -> SsdFwdArgs {
        SsdFwdArgs {
            xbc: self.at(o.xbc),
            ld_xbc: o.ld,
            dt: self.at(o.dt),
            a_log: self.at(o.a_log),
            d: self.at(o.d),
            y_ssd: self.at(o.y_ssd),
            y_out: self.at(o.y_out),
            states: self.at(o.states),
        }
    }
}

// SAFETY (every unsafe block below): the addresses come from the plan's buffers, which this
// struct, the model or the caller's inputs own and keep alive; the plan's offsets and sizes are
// the ones its CPU backend checks element for element against the references (`step` tests);
// every launch is queued on candle's stream, in order with the work that reads the results.
impl Backend for GpuBackend<'_> {
    fn gemm(&mut self, g: &GemmOp) -> Result<()> {
        let mut op = Gemm::new(g.ta, g.tb, g.m, g.n, g.k, self.at(g.a), self.at(g.b), self.at(g.c));
        (op.lda, op.ldb, op.ldc) = (g.lda, g.ldb, g.ldc);
        if g.accumulate {
            op = op.accumulate();
        }
        let (a16, b16) = (self.at16(g.a), self.at16(g.b));
        if a16 != 0 && b16 != 0 {
            op = op.bf16(a16, b16);
        }
        unsafe { self.f.blas.run(&op) }.ctx(CTX)
    }

    fn col_sums(&mut self, o: &ColSumsOp) -> Result<()> {
        unsafe { self.f.blas.col_sums(o.rows, o.cols, 1.0, self.at(o.a), o.lda, self.ones, self.at(o.y)) }.ctx(CTX)
    }

    fn cast_bf16(&mut self, bufs: &[Buf]) -> Result<()> {
        let Some(k) = &self.f.cast else { return Ok(()) };
        let items: Vec<(u64, u64, usize)> = bufs
            .iter()
            .filter(|b| self.a16[b.0] != 0)
            .map(|b| (self.a[b.0], self.a16[b.0], self.f.plan.bufs[b.0].len))
            .collect();
        for chunk in items.chunks(8) {
            unsafe { k.cast_bf16(chunk) }.ctx(CTX)?;
        }
        Ok(())
    }

    fn rmsnorm_fwd(&mut self, o: &RmsFwdOp) -> Result<()> {
        let a = RmsFwdArgs {
            h: self.at(o.h),
            bias: self.opt(o.bias),
            w: self.at(o.w),
            copy: self.opt(o.copy),
            u: self.at(o.u),
            u16: self.at16(o.u),
            rstd: self.at(o.rstd),
            rows: o.rows,
            cols: o.cols,
            eps: o.eps as f32,
        };
        unsafe { self.f.mk.rmsnorm_fwd(&a) }.ctx(CTX)
    }

    fn rmsnorm_bwd(&mut self, o: &RmsBwdOp) -> Result<()> {
        let (du, du_scale, du_vec) = match o.du {
            RowGradAt::Full(p) => (self.at(p), 0, 0),
            RowGradAt::Outer { scale, vec } => (0, self.at(scale), self.at(vec)),
        };
        let a = RmsBwdArgs {
            du,
            du_scale,
            du_vec,
            h: self.at(o.h),
            rstd: self.at(o.rstd),
            w: self.at(o.w),
            dh: self.at(o.dh),
            dh16: self.at16(o.dh),
            accumulate: o.accumulate,
            partials: self.at(o.partials),
            rows: o.rows,
            cols: o.cols,
        };
        unsafe { self.f.mk.rmsnorm_bwd(&a) }.ctx(CTX)
    }

    fn conv_fwd(&mut self, o: &ConvFwdOp) -> Result<()> {
        let a = ConvFwdArgs {
            zx: self.at(o.zx),
            ld: o.ld,
            xoff: o.xoff,
            w: self.at(o.w),
            b: self.at(o.b),
            dt_bias: self.at(o.dt_bias),
            xbc: self.at(o.xbc),
            dt: self.at(o.dt),
        };
        unsafe { self.f.mk.conv_fwd(&o.dims, &a) }.ctx(CTX)
    }

    fn conv_bwd(&mut self, o: &ConvBwdOp) -> Result<()> {
        let a = ConvBwdArgs {
            zx: self.at(o.zx),
            ld: o.ld,
            xoff: o.xoff,
            w: self.at(o.w),
            b: self.at(o.b),
            dx: self.at(o.dx),
            dbc: self.at(o.dbc),
            dzx: self.at(o.dzx),
            ldo: o.ldo,
            dzx16: self.at16(o.dzx),
            partials: self.at(o.partials),
        };
        unsafe { self.f.mk.conv_bwd(&o.dims, &a) }.ctx(CTX)
    }

    fn ssd_fwd(&mut self, o: &SsdFwdOp) -> Result<()> {
        let a = self.ssd_fwd_args(o);
        unsafe { self.f.sk.forward(&o.dims, &a) }.ctx(CTX)
    }

    fn ssd_bwd(&mut self, o: &SsdBwdOp) -> Result<()> {
        let a = SsdBwdArgs {
            fwd: self.ssd_fwd_args(&o.fwd),
            dy: self.at(o.dy),
            dx: self.at(o.dx),
            dbc: self.at(o.dbc),
            ddt_raw: self.at(o.ddt_raw),
            ld_ddt: o.ld_ddt,
            ddt16: self.at16(o.ddt_raw),
            partials: self.at(o.partials),
        };
        unsafe { self.f.sk.backward(&o.fwd.dims, &a) }.ctx(CTX)
    }

    fn gated_fwd(&mut self, o: &GatedFwdOp) -> Result<()> {
        let a = GatedFwdArgs {
            y: self.at(o.y),
            z: self.at(o.z),
            ldz: o.ldz,
            w: self.at(o.w),
            out: self.at(o.out),
            out16: self.at16(o.out),
            rstd: self.at(o.rstd),
            rows: o.rows,
            d_inner: o.di,
            groups: o.groups,
            eps: o.eps as f32,
        };
        unsafe { self.f.mk.gated_fwd(&a) }.ctx(CTX)
    }

    fn gated_bwd(&mut self, o: &GatedBwdOp) -> Result<()> {
        let a = GatedBwdArgs {
            dout: self.at(o.dout),
            y: self.at(o.y),
            z: self.at(o.z),
            ldz: o.ldz,
            w: self.at(o.w),
            rstd: self.at(o.rstd),
            dy: self.at(o.dy),
            dz: self.at(o.dz),
            lddz: o.lddz,
            dz16: self.at16(o.dz),
            partials: self.at(o.partials),
            rows: o.rows,
            d_inner: o.di,
            groups: o.groups,
        };
        unsafe { self.f.mk.gated_bwd(&a) }.ctx(CTX)
    }

    fn head_fwd(&mut self, o: &HeadFwdOp) -> Result<()> {
        let a = HeadFwdArgs {
            h: self.at(o.h),
            w_norm: self.at(o.w_norm),
            head_w: self.at(o.head_w),
            head_b: self.at(o.head_b),
            target: self.at(o.target),
            u_f: self.at(o.u_f),
            rstd: self.at(o.rstd),
            sq: self.at(o.sq),
            dpred: self.at(o.dpred),
            rows: o.rows,
            cols: o.cols,
            eps: o.eps as f32,
        };
        unsafe { self.f.mk.head_fwd(&a) }.ctx(CTX)
    }

    fn loss_reduce(&mut self, o: &LossOp) -> Result<()> {
        let (sq, dp, loss, dhb) = (self.at(o.sq), self.at(o.dpred), self.at(o.loss), self.at(o.dhead_b));
        unsafe { self.f.mk.loss_reduce(sq, dp, o.rows, loss, dhb) }.ctx(CTX)
    }
}
