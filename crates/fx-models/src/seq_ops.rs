//! Differentiable building blocks shared by the TFT and MAMBA-2 and the forward
//! context (compute dtype, training mode, gradient tape on/off).
//!
//! candle's fused `LayerNorm`, `softmax_last_dim` and `rms_norm` are forward-only and
//! silently drop gradients: the normalisations and softmax come from
//! `fx_precision::ops` (compositions of basic ops), re-exported here so the models
//! have one import.
//!
//! Reduced precision follows PyTorch autocast: parameters and the activations between
//! layers stay F32, and only the matmuls run in the compute dtype (operands cast down,
//! result cast back). Elementwise ops, normalisations, softmax, the scans' decays and
//! the loss stay F32, so the backward's reductions (bias and embedding gradients
//! summed over the batch) do not accumulate in BF16.
//!
//! Unlike `fx_precision::Linear`, whose output stays in the compute dtype,
//! [`Ctx::linear`] returns F32: with BF16 activations the backward's bias/embedding
//! reductions put several TFT gradients 2–7% off the reference, beyond the 2e-2 bound.

use candle_core::{DType, Tensor, Var, D};

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::Result;
pub use fx_precision::ops::{layer_norm, rms_norm, softmax_last_dim};
use fx_precision::{Precision, PrecisionExt};

/// How a forward pass runs.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    /// Dtype of the matmuls (F32, BF16 or F16; F64 for reference computations in
    /// tests); parameters and other activations stay F32.
    pub compute: DType,
    /// Training mode: dropout active.
    pub train: bool,
    /// Record the gradient tape. Off for inference: parameters enter detached, so no
    /// graph is kept alive.
    pub grad: bool,
    /// Where dropout masks are recorded and replayed, so that a checkpointed segment
    /// re-run in the backward drops the same units as its forward; `None` draws fresh
    /// masks.
    pub masks: Option<&'a DropoutMasks>,
}

impl Ctx<'static> {
    /// Training forward: dropout on, tape on.
    pub fn train(p: Precision) -> Self {
        Self::with_dtype(p.compute_dtype(), true, true)
    }
    /// Forward with a tape but no dropout (parity tests, gradient checks).
    pub fn eval_with_grad(p: Precision) -> Self {
        Self::with_dtype(p.compute_dtype(), false, true)
    }
    /// Inference: dropout off, no tape.
    pub fn inference(p: Precision) -> Self {
        Self::with_dtype(p.compute_dtype(), false, false)
    }
    /// An explicit matmul dtype (F64 reference computations in tests).
    pub fn with_dtype(compute: DType, train: bool, grad: bool) -> Self {
        Self { compute, train, grad, masks: None }
    }
}

impl<'a> Ctx<'a> {
    /// The same context recording/replaying dropout masks in `masks`.
    pub fn with_masks<'b>(&self, masks: &'b DropoutMasks) -> Ctx<'b> {
        Ctx { compute: self.compute, train: self.train, grad: self.grad, masks: Some(masks) }
    }

    /// A parameter as it enters the computation: detached from the tape when
    /// gradients are off.
    pub fn p(&self, v: &Var) -> Result<Tensor> {
        Ok(if self.grad { v.as_tensor().clone() } else { v.as_tensor().detach() })
    }

    /// `a · b` (batched) with both operands in the compute dtype; the result comes
    /// back in `a`'s dtype.
    pub fn mm(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        // candle's CPU matmul handles at most one batch axis and accepts transposed
        // matrices but not arbitrary batch strides: higher-rank operands are made
        // contiguous and their batch axes flattened. Plain 2-D operands (weights
        // viewed transposed) pass as they are.
        let rank = a.rank();
        if rank > 3 {
            let lead = &a.dims()[..rank - 2];
            let batch: usize = lead.iter().product();
            let (m, k) = (a.dim(rank - 2)?, a.dim(rank - 1)?);
            let n = b.dim(rank - 1)?;
            let a3 = a.contiguous()?.reshape((batch, m, k))?;
            let b3 = b.contiguous()?.reshape((batch, k, n))?;
            let mut out = lead.to_vec();
            out.extend_from_slice(&[m, n]);
            return self.mm(&a3, &b3)?.reshape(out);
        }
        let (a, b) = if rank == 3 { (&a.contiguous()?, &b.contiguous()?) } else { (a, b) };
        let dt = a.dtype();
        if dt == self.compute {
            return a.matmul(&b.to_dtype(dt)?);
        }
        let y = a.to_dtype(self.compute)?.matmul(&b.to_dtype(self.compute)?)?;
        y.to_dtype(dt)
    }

    /// `y = x · wᵀ + b` over the last axis of `x` (PyTorch layout `w [o, i]`), the
    /// matmul in the compute dtype, the bias added in `x`'s dtype.
    pub fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let i = dims[dims.len() - 1];
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let y = self.mm(&x.reshape((rows, i))?, &w.t()?)?;
        let y = match b {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        };
        let mut out = dims;
        let last = out.len() - 1;
        out[last] = w.dim(0)?;
        y.reshape(out)
    }

    /// Inverted dropout with probability `p`, only in training mode.
    pub fn dropout(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        if !self.train || p <= 0.0 {
            return Ok(x.clone());
        }
        match self.masks {
            None => candle_nn::ops::dropout(x, p as f32),
            Some(m) => {
                let keep = m.mask(x, p)?;
                x.mul(&(keep.to_dtype(x.dtype())? * (1.0 / (1.0 - p)))?)
            }
        }
    }
}

/// Dropout masks keyed by (segment, call number within the segment): the first forward
/// of a segment draws them, a re-run of the same segment replays them. Masks are kept
/// as U8 (a quarter of an F32 activation).
#[derive(Debug, Default)]
pub struct DropoutMasks {
    state: RefCell<MaskState>,
}

#[derive(Debug, Default)]
struct MaskState {
    segment: usize,
    call: usize,
    masks: HashMap<(usize, usize), Tensor>,
}

impl DropoutMasks {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts (or restarts) segment `segment`: its dropout calls are numbered from 0.
    pub fn begin_segment(&self, segment: usize) {
        let mut s = self.state.borrow_mut();
        s.segment = segment;
        s.call = 0;
    }

    fn mask(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        let mut s = self.state.borrow_mut();
        let key = (s.segment, s.call);
        s.call += 1;
        if let Some(m) = s.masks.get(&key) {
            if m.dims() == x.dims() {
                return Ok(m.clone());
            }
            candle_core::bail!("dropout mask replay: shape {:?} recorded, {:?} now", m.dims(), x.dims());
        }
        let keep = Tensor::rand(0f32, 1f32, x.shape(), x.device())?.ge(p)?;
        s.masks.insert(key, keep.clone());
        Ok(keep)
    }
}

/// `x · rsqrt(mean(x²) + eps)` over the last axis without a weight (the grouped
/// gated RMSNorm applies its weight after regrouping).
pub fn rms_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let n = x.dim(D::Minus1)?;
    rms_norm(x, &Tensor::ones(n, DType::F32, x.device())?, eps)
}

/// Logistic sigmoid (candle-nn's op has a backward pass).
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::sigmoid(x)
}

/// Numerically stable softplus `ln(1 + eˣ) = max(x, 0) + ln(1 + e^{-|x|})`.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    let t = ((x.abs()?.neg()?.exp()? + 1.0)?).log()?;
    x.relu()? + t
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let d = d.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        assert!(d <= tol, "max diff {d}");
    }

    /// Central differences of sum(f(x) * r) against the tape gradient, in f64.
    fn grad_check(f: impl Fn(&Tensor) -> Tensor) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, (3, 5), &dev).unwrap()).unwrap();
        let r = Tensor::randn(0f64, 1.0, (3, 5), &dev).unwrap();
        let loss = (f(x.as_tensor()) * &r).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let g = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let x0 = x.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let h = 1e-6;
        for i in 0..x0.len() {
            let eval = |d: f64| {
                let mut xs = x0.clone();
                xs[i] += d;
                let t = Tensor::from_vec(xs, (3, 5), &dev).unwrap();
                (f(&t) * &r).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
            };
            let num = (eval(h) - eval(-h)) / (2.0 * h);
            assert!((num - g[i]).abs() < 1e-6 * (1.0 + num.abs()), "{i}: {num} vs {}", g[i]);
        }
    }

    #[test]
    fn softplus_sigmoid_rms_normalize_match_definitions_and_have_gradients() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f64, 1.0, (3, 5), &dev).unwrap();
        let r = rms_normalize(&x, 0.0).unwrap().sqr().unwrap().mean(1).unwrap();
        close(&r, &Tensor::ones(3, DType::F64, &dev).unwrap(), 1e-12);
        let sp = softplus(&x).unwrap();
        let sp_ref = (x.exp().unwrap() + 1.0).unwrap().log().unwrap();
        close(&sp, &sp_ref, 1e-12);
        grad_check(|x| rms_normalize(x, 1e-5).unwrap());
        grad_check(|x| softplus(x).unwrap());
        grad_check(|x| sigmoid(x).unwrap());
    }
}
