//! Global-norm gradient clipping (`torch.nn.utils.clip_grad_norm_`) and the one-pass
//! gradient statistics shared with the GradScaler and the step guard.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Context, Result};

/// All gradients of `vars` present in `grads`, flattened into one F32 vector on their
/// device (`None` when there are none). One vector means one reduction over it.
pub(crate) fn flat_grads(vars: &[Var], grads: &GradStore) -> Result<Option<Tensor>> {
    let mut parts = Vec::with_capacity(vars.len());
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            parts.push(g.flatten_all().and_then(|g| g.to_dtype(DType::F32)).ctx("flattening gradients")?);
        }
    }
    if parts.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tensor::cat(&parts, 0).ctx("concatenating gradients")?))
}

/// The dtype to accumulate a sum of squares in: F64 on the CPU, where candle's reduction
/// is a sequential loop (cheap there, and it keeps the norm exact to ~1e-12); F32 on GPUs,
/// whose reductions are trees.
pub(crate) fn accum_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F64
    } else {
        DType::F32
    }
}

/// Multiplies every gradient of `vars` by `factor` (in the gradient's dtype).
pub(crate) fn scale_grads(vars: &[Var], grads: &mut GradStore, factor: f64) -> Result<()> {
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let scaled = g.affine(factor, 0.0).ctx("scaling gradients")?;
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(())
}

/// The L2 norm over all gradients of `vars`: one reduction on the device, one read.
pub fn grad_norm(vars: &[Var], grads: &GradStore) -> Result<f64> {
    let Some(flat) = flat_grads(vars, grads)? else {
        return Ok(0.0);
    };
    let sumsq = flat
        .to_dtype(accum_dtype(flat.device()))
        .and_then(|f| f.sqr())
        .and_then(|f| f.sum_all())
        .and_then(|s| s.to_dtype(DType::F64))
        .and_then(|s| s.to_scalar::<f64>())
        .ctx("gradient norm")?;
    Ok(sumsq.sqrt())
}

/// PyTorch's `clip_grad_norm_(params, max_norm)`: the global L2 norm over all gradients
/// of `vars` (computed on the device in one reduction, read once); when
/// `max_norm / (norm + 1e-6) < 1` every gradient is multiplied by that factor. Returns the
/// norm before clipping. A non-finite norm leaves the gradients as they are (the step
/// guard must skip such a step; PyTorch would turn them into NaN).
pub fn clip_grad_norm(vars: &[Var], grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    let norm = grad_norm(vars, grads)?;
    let coef = max_norm / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        scale_grads(vars, grads, coef)?;
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::Rng;
    use proptest::prelude::*;

    fn setup(seed: u64, scale: f64) -> (Vec<Var>, GradStore, Vec<Vec<f64>>) {
        let mut rng = Rng::new(seed);
        let dev = Device::Cpu;
        let shapes: [&[usize]; 3] = [&[4, 3], &[3], &[2, 2, 2]];
        let mut grads = GradStore::default();
        let mut vars = Vec::new();
        let mut raw = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            let v = Var::zeros(*s, DType::F32, &dev).unwrap();
            if i != 1 {
                let g = rng.vec(s.iter().product(), -scale, scale);
                let t = Tensor::from_vec(g.iter().map(|&x| x as f32).collect::<Vec<_>>(), *s, &dev).unwrap();
                grads.insert(v.as_tensor(), t);
                raw.push(g);
            } else {
                raw.push(vec![]); // no gradient for this one: ignored, as in PyTorch
            }
            vars.push(v);
        }
        (vars, grads, raw)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

        #[test]
        fn matches_torch_clip_grad_norm(seed in any::<u64>(), scale in 0.01f64..10.0, max_norm in 0.1f64..5.0) {
            let (vars, mut grads, raw) = setup(seed, scale);
            let norm_ref = raw.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
            let coef = (max_norm / (norm_ref + 1e-6)).min(1.0);
            let norm = clip_grad_norm(&vars, &mut grads, max_norm).unwrap();
            prop_assert!((norm - norm_ref).abs() <= 1e-9 * norm_ref);
            for (v, r) in vars.iter().zip(&raw) {
                match grads.get(v.as_tensor()) {
                    None => prop_assert!(r.is_empty()),
                    Some(g) => {
                        let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                        for (a, b) in g.iter().zip(r) {
                            let want = b * coef;
                            prop_assert!((*a as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "{} vs {}", a, want);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn non_finite_norm_is_reported_and_grads_untouched() {
        let (vars, mut grads, _) = setup(1, 1.0);
        let g0 = grads.get(vars[0].as_tensor()).unwrap();
        let mut v: Vec<f32> = g0.flatten_all().unwrap().to_vec1().unwrap();
        v[3] = f32::NAN;
        grads.insert(vars[0].as_tensor(), Tensor::from_vec(v, (4, 3), &Device::Cpu).unwrap());
        let norm = clip_grad_norm(&vars, &mut grads, 1.0).unwrap();
        assert!(norm.is_nan());
        assert_eq!(clip_grad_norm(&vars, &mut GradStore::default(), 1.0).unwrap(), 0.0);
    }
}
