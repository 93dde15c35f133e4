//! The precision policy and the layer that applies it.
//!
//! [`Precision`] (re-exported from `fx-hw`, which picks it per GPU) says which dtype the
//! matmul-heavy ops compute in. The rules, as PyTorch's autocast applies them:
//! - master weights are F32 `Var`s, always; the optimiser updates them in F32;
//! - matmuls (and the bias add fused with them) run in [`PrecisionExt::compute_dtype`]:
//!   use [`Linear`], which casts input and weight and returns the compute dtype;
//! - softmax, normalisation, losses and reductions run in F32: [`crate::ops`] does so
//!   for half inputs, and models call [`to_f32`] on activations before a loss, so the
//!   loss is F32;
//! - under F16 the loss is scaled ([`PrecisionExt::uses_loss_scaling`]), under BF16 not.
//!
//! Gradients reach the F32 weights through candle's backward of the casts, so they are
//! F32 too.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

pub use fx_hw::Precision;

/// Policy queries on [`Precision`] (a trait because the type lives in `fx-hw`).
pub trait PrecisionExt {
    /// The dtype matmuls compute in: F32, BF16 or F16.
    fn compute_dtype(self) -> DType;
    /// Whether the GradScaler is on by default: only under F16, as in PyTorch (BF16 has
    /// F32's exponent range, so gradients do not underflow).
    fn uses_loss_scaling(self) -> bool;
    /// `x` cast to the compute dtype (no graph node when it already has it).
    fn to_compute(self, x: &Tensor) -> Result<Tensor>;
}

impl PrecisionExt for Precision {
    fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    fn uses_loss_scaling(self) -> bool {
        self == Precision::F16
    }

    fn to_compute(self, x: &Tensor) -> Result<Tensor> {
        cast(x, self.compute_dtype())
    }
}

fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        x.to_dtype(dtype)
    }
}

/// `x` as F32 (for losses, softmax and reductions); no graph node when it already is.
pub fn to_f32(x: &Tensor) -> Result<Tensor> {
    cast(x, DType::F32)
}

/// Opt in (or back out) of TF32 tensor-core math for F32 matmuls on CUDA. candle, like
/// PyTorch, keeps F32 GEMMs at full precision by default. Process-wide. Returns whether the
/// setting took effect: `false` in builds without the `cuda` feature.
pub fn allow_tf32_matmul(enabled: bool) -> bool {
    #[cfg(feature = "cuda")]
    {
        candle_core::cuda::set_gemm_reduced_precision_f32(enabled);
        true
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = enabled;
        false
    }
}

/// A linear layer under the precision policy: F32 master weight `[out, in]` and bias
/// `[out]` (PyTorch's layout, names `{path}.weight` / `{path}.bias`), forward in the
/// compute dtype, output in the compute dtype.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    precision: Precision,
}

impl Linear {
    /// Gets (or creates with PyTorch's default initialisation, `U(-1/sqrt(in), 1/sqrt(in))`
    /// for weight and bias) `weight` and `bias` under `vb`'s path, always as F32.
    pub fn new(in_dim: usize, out_dim: usize, vb: VarBuilder, precision: Precision) -> Result<Self> {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let init = Init::Uniform { lo: -bound, up: bound };
        let weight = vb.get_with_hints_dtype((out_dim, in_dim), "weight", init, DType::F32)?;
        let bias = vb.get_with_hints_dtype(out_dim, "bias", init, DType::F32)?;
        Ok(Linear { weight, bias: Some(bias), precision })
    }

    /// As [`Linear::new`] without a bias.
    pub fn new_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder, precision: Precision) -> Result<Self> {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let init = Init::Uniform { lo: -bound, up: bound };
        let weight = vb.get_with_hints_dtype((out_dim, in_dim), "weight", init, DType::F32)?;
        Ok(Linear { weight, bias: None, precision })
    }

    /// From existing tensors (weight `[out, in]`, bias `[out]`).
    pub fn from_parts(weight: Tensor, bias: Option<Tensor>, precision: Precision) -> Result<Self> {
        let (out_dim, _) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [out_dim] {
                candle_core::bail!("Linear: bias shape {:?} does not match weight {:?}", b.dims(), weight.dims());
            }
        }
        Ok(Linear { weight, bias, precision })
    }

    /// The F32 master weight `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The F32 master bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The policy this layer computes under.
    pub fn precision(&self) -> Precision {
        self.precision
    }
}

impl Module for Linear {
    /// `x [.., in]` → `x W^T + b` as `[.., out]` in the compute dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.precision;
        let (out_dim, in_dim) = self.weight.dims2()?;
        let x = p.to_compute(x)?;
        let w = p.to_compute(&self.weight)?;
        let dims = x.dims().to_vec();
        let Some((&last, lead)) = dims.split_last() else {
            candle_core::bail!("Linear: input must have at least one dimension");
        };
        if last != in_dim {
            candle_core::bail!("Linear: input last dimension {last}, weight expects {in_dim}");
        }
        let rows: usize = lead.iter().product();
        let y = x.reshape((rows, in_dim))?.matmul(&w.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&p.to_compute(b)?)?,
            None => y,
        };
        let mut out_shape = lead.to_vec();
        out_shape.push(out_dim);
        y.reshape(out_shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::Rng;
    use candle_core::{Device, Var};
    use candle_nn::VarMap;

    #[test]
    fn policy_dtypes_and_parsing() {
        let p: Precision = "bf16".parse().unwrap();
        assert_eq!(p.compute_dtype(), DType::BF16);
        assert!(!p.uses_loss_scaling());
        assert!("f16".parse::<Precision>().unwrap().uses_loss_scaling());
        assert_eq!(serde_json::to_string(&Precision::F16).unwrap(), "\"f16\"");
        assert_eq!(Precision::F32.compute_dtype(), DType::F32);
        assert!(!allow_tf32_matmul(false) || cfg!(feature = "cuda"));
    }

    #[test]
    fn linear_names_layout_and_f32_master_weights() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        // Even a BF16 VarBuilder yields F32 master weights.
        let vb = VarBuilder::from_varmap(&vm, DType::BF16, &dev);
        let l = Linear::new(3, 2, vb.pp("trunk").pp(0), Precision::Bf16).unwrap();
        let data = vm.data().lock().unwrap();
        let mut names: Vec<_> = data.keys().cloned().collect();
        names.sort();
        assert_eq!(names, ["trunk.0.bias", "trunk.0.weight"]);
        assert_eq!(data["trunk.0.weight"].dims(), [2, 3]);
        assert_eq!(data["trunk.0.weight"].dtype(), DType::F32);
        let bound = 1.0 / 3f32.sqrt();
        let w: Vec<f32> = l.weight().flatten_all().unwrap().to_vec1().unwrap();
        assert!(w.iter().all(|v| v.abs() <= bound));
    }

    /// Forward against an f64 reference in every precision, rank-3 input; gradients reach
    /// the F32 masters as F32 and match the F32 gradients within the dtype's rounding.
    #[test]
    fn linear_forward_and_gradients_per_precision() {
        let dev = Device::Cpu;
        let mut rng = Rng::new(5);
        let (b0, b1, i, o) = (2, 3, 4, 5);
        let xv = rng.vec(b0 * b1 * i, -1.0, 1.0);
        let wv = rng.vec(o * i, -1.0, 1.0);
        let bv = rng.vec(o, -1.0, 1.0);
        let f32t = |v: &[f64], s: &[usize]| {
            Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<_>>(), s, &dev).unwrap()
        };
        let mut want = vec![0.0; b0 * b1 * o];
        for r in 0..b0 * b1 {
            for k in 0..o {
                want[r * o + k] = bv[k] + (0..i).map(|j| xv[r * i + j] * wv[k * i + j]).sum::<f64>();
            }
        }
        let mut f32_grads: Option<(Vec<f32>, Vec<f32>)> = None;
        for (p, tol) in [(Precision::F32, 1e-6), (Precision::Bf16, 3e-2), (Precision::F16, 4e-3)] {
            let w = Var::from_tensor(&f32t(&wv, &[o, i])).unwrap();
            let b = Var::from_tensor(&f32t(&bv, &[o])).unwrap();
            let l = Linear::from_parts(w.as_tensor().clone(), Some(b.as_tensor().clone()), p).unwrap();
            let y = l.forward(&f32t(&xv, &[b0, b1, i])).unwrap();
            assert_eq!(y.dtype(), p.compute_dtype());
            assert_eq!(y.dims(), [b0, b1, o]);
            let got: Vec<f32> = to_f32(&y).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{p}: {g} vs {w}");
            }
            let loss = to_f32(&y).unwrap().sqr().unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let gw = grads.get(w.as_tensor()).expect("weight grad");
            let gb = grads.get(b.as_tensor()).expect("bias grad");
            assert_eq!((gw.dtype(), gb.dtype()), (DType::F32, DType::F32));
            let gw: Vec<f32> = gw.flatten_all().unwrap().to_vec1().unwrap();
            let gb: Vec<f32> = gb.to_vec1().unwrap();
            match &f32_grads {
                None => f32_grads = Some((gw, gb)),
                Some((rw, rb)) => {
                    let scale = rw.iter().chain(rb).fold(0f32, |m, v| m.max(v.abs()));
                    for (a, r) in gw.iter().chain(&gb).zip(rw.iter().chain(rb)) {
                        assert!((a - r).abs() <= 2.0 * tol as f32 * scale, "{p}: grad {a} vs {r}");
                    }
                }
            }
        }
    }
}
