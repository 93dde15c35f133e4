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
    /// Counter-based masks (seeded, step counter in device memory: what a captured CUDA
    /// graph needs); `None` draws from candle's generator.
    pub rng: Option<&'a DropoutRng>,
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
        Self { compute, train, grad, masks: None, rng: None }
    }
}

impl<'a> Ctx<'a> {
    /// The same context recording/replaying dropout masks in `masks`.
    pub fn with_masks<'b>(&self, masks: &'b DropoutMasks) -> Ctx<'b>
    where
        'a: 'b,
    {
        Ctx { masks: Some(masks), ..*self }
    }

    /// The same context drawing its dropout masks from `rng`.
    pub fn with_rng<'b>(&self, rng: &'b DropoutRng) -> Ctx<'b>
    where
        'a: 'b,
    {
        Ctx { rng: Some(rng), ..*self }
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
        match (self.rng, self.masks) {
            (Some(r), masks) => {
                // With a counter-based generator a replayed segment needs no stored mask:
                // the same (segment, call) key draws the same mask again.
                let call = match masks {
                    Some(m) => m.next_key(),
                    None => r.next_call(),
                };
                x.mul(&r.mask(x.dims(), p, call)?.to_dtype(x.dtype())?)
            }
            (None, None) => candle_nn::ops::dropout(x, p as f32),
            (None, Some(m)) => {
                let keep = m.mask(x, p)?;
                x.mul(&(keep.to_dtype(x.dtype())? * (1.0 / (1.0 - p)))?)
            }
        }
    }
}

/// Counter-based dropout ([`fx_precision::dropout`]): masks are a function of a seed, the
/// call's number within the training step and the step counter, which lives in a device
/// tensor. A CUDA graph that captures a step therefore draws fresh masks on every replay
/// (a stateful generator's offset would be frozen into the graph), and a resumed run
/// drops the same units as an uninterrupted one.
#[derive(Debug)]
pub struct DropoutRng {
    seed: u64,
    /// The step counter: one U32 on the parameters' device.
    step: Tensor,
    /// Dropout calls so far in this step (their masks' `call` number).
    calls: std::cell::Cell<u64>,
    #[cfg(feature = "cuda")]
    kernels: Option<fx_precision::dropout::cuda::DropoutKernels>,
}

impl DropoutRng {
    /// A generator for `seed` at step 0 on `device`.
    pub fn new(seed: u64, device: &candle_core::Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let kernels = if device.is_cuda() {
            Some(fx_precision::dropout::cuda::DropoutKernels::load(device).map_err(candle_core::Error::wrap)?)
        } else {
            None
        };
        Ok(Self {
            seed,
            step: Tensor::new(&[0u32], device)?,
            calls: std::cell::Cell::new(0),
            #[cfg(feature = "cuda")]
            kernels,
        })
    }

    /// Sets the step counter (a resumed run continues its masks) and restarts the calls.
    pub fn set_step(&self, step: u64) -> Result<()> {
        let v = u32::try_from(step).map_err(|_| candle_core::Error::Msg(format!("dropout step {step} ≥ 2^32")))?;
        self.step.slice_set(&Tensor::new(&[v], self.step.device())?, 0, 0)?;
        self.calls.set(0);
        Ok(())
    }

    /// Ends a training step: the counter advances on the device (inside a captured graph
    /// too) and the call numbers restart.
    pub fn advance(&self) -> Result<()> {
        self.calls.set(0);
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.kernels {
            return k.advance(&self.step).map_err(candle_core::Error::wrap);
        }
        let next = (&self.step + 1.0)?;
        self.step.slice_set(&next, 0, 0)
    }

    /// The generator's seed (fused training steps draw the same masks in their kernels).
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// The step counter: one U32 on the parameters' device.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn step_tensor(&self) -> &Tensor {
        &self.step
    }

    /// Restarts the call numbers without advancing (a dry run of a step).
    pub fn restart_calls(&self) {
        self.calls.set(0);
    }

    fn next_call(&self) -> u64 {
        let c = self.calls.get();
        self.calls.set(c + 1);
        c
    }

    /// The scaled F32 mask of dropout call `call` at the current step.
    fn mask(&self, shape: &[usize], p: f64, call: u64) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.kernels {
            return k.mask(shape, self.seed, call, &self.step, p).map_err(candle_core::Error::wrap);
        }
        let step = self.step.to_vec1::<u32>()?[0];
        let n = shape.iter().product();
        Tensor::from_vec(fx_precision::dropout::mask_reference(self.seed, call, step, n, p), shape, self.step.device())
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

    /// The key of the next call of the current segment, as a counter-based generator's
    /// call number (segment in the high half), so a re-run segment draws the same masks.
    fn next_key(&self) -> u64 {
        let mut s = self.state.borrow_mut();
        let key = ((s.segment as u64) << 32) | s.call as u64;
        s.call += 1;
        key
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

    #[test]
    fn counter_dropout_follows_the_reference_advances_and_replays_by_key() {
        let dev = Device::Cpu;
        let rng = DropoutRng::new(17, &dev).unwrap();
        let x = Tensor::ones((4, 50), DType::F32, &dev).unwrap();
        let c = Ctx::train(Precision::F32).with_rng(&rng);
        let y0: Vec<f32> = c.dropout(&x, 0.3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(y0, fx_precision::dropout::mask_reference(17, 0, 0, 200, 0.3));
        // The second call of the step draws another mask; a new step another again.
        let y1: Vec<f32> = c.dropout(&x, 0.3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(y1, fx_precision::dropout::mask_reference(17, 1, 0, 200, 0.3));
        rng.advance().unwrap();
        let y2: Vec<f32> = c.dropout(&x, 0.3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(y2, fx_precision::dropout::mask_reference(17, 0, 1, 200, 0.3));
        // Recomputed segments: a re-run of segment 2 draws its masks again, by key.
        let masks = DropoutMasks::new();
        let cm = c.with_masks(&masks);
        masks.begin_segment(2);
        let a = cm.dropout(&x, 0.5).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        masks.begin_segment(2);
        let b = cm.dropout(&x, 0.5).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
        assert_eq!(a, fx_precision::dropout::mask_reference(17, 2 << 32, 1, 200, 0.5));
        rng.set_step(9).unwrap();
        let y9: Vec<f32> = c.dropout(&x, 0.3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(y9, fx_precision::dropout::mask_reference(17, 0, 9, 200, 0.3));
    }
}
