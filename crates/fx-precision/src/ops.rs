//! Differentiable normalisation and softmax ops.
//!
//! candle's `candle_nn::ops::{softmax_last_dim, rms_norm, layer_norm}` and
//! `candle_nn::LayerNorm` dispatch to fused kernels that have no backward pass: on
//! contiguous inputs they silently return *no* gradient for the input or the
//! parameters (candle issues #2168, #2977, #3011, #3752). The functions here are built
//! only from basic ops that candle can differentiate. Following the precision policy,
//! they compute in F32 when the input is BF16/F16 and cast the result back to the
//! input's dtype; F32 and F64 inputs are computed in their own dtype.
//!
//! They return `candle_core::Result` so that they compose with candle ops inside model
//! code and checkpointed segments.

use candle_core::{DType, Result, Tensor, D};

/// The dtype these ops compute in for an input of `dtype`: F32 for half types.
fn work_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// Casts `t` to `dtype` unless it already has it (a cast is a graph node; skip no-ops).
fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t.clone())
    } else {
        t.to_dtype(dtype)
    }
}

/// Layer normalisation over the last dimension, as `torch.nn.functional.layer_norm`:
/// `(x - mean) / sqrt(var + eps) * weight + bias` with the biased variance.
/// `weight` and `bias` have the size of the last dimension of `x`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let wd = work_dtype(dtype);
    let xf = cast(x, wd)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let xc = xf.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    let y = xn.broadcast_mul(&cast(weight, wd)?)?.broadcast_add(&cast(bias, wd)?)?;
    cast(&y, dtype)
}

/// RMS normalisation over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`
/// (eps inside the square root, as in Mamba-2's reference).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let wd = work_dtype(dtype);
    let xf = cast(x, wd)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xf.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(&cast(weight, wd)?)?;
    cast(&y, dtype)
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = cast(x, work_dtype(dtype))?;
    // The max shift only guards exp against overflow; its gradient cancels exactly, so it
    // is detached (saves work and avoids candle's tie-splitting max backward).
    let m = xf.max_keepdim(D::Minus1)?.detach();
    let e = xf.broadcast_sub(&m)?.exp()?;
    let y = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    cast(&y, dtype)
}

/// Log-softmax over the last dimension: `x - max - log(sum(exp(x - max)))`.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = cast(x, work_dtype(dtype))?;
    let m = xf.max_keepdim(D::Minus1)?.detach();
    let shifted = xf.broadcast_sub(&m)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let y = shifted.broadcast_sub(&lse)?;
    cast(&y, dtype)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use proptest::prelude::*;

    /// SplitMix64-based uniform draws for test data (fresh seeds come from proptest).
    pub(crate) struct Rng(u64);
    impl Rng {
        pub(crate) fn new(seed: u64) -> Self {
            Rng(seed)
        }
        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [lo, hi), rounded to f32 so that f32 and f64 paths see equal inputs.
        pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
            let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            (lo + (hi - lo) * u) as f32 as f64
        }
        pub(crate) fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
            (0..n).map(|_| self.uniform(lo, hi)).collect()
        }
    }

    type RefFn = dyn Fn(&[Vec<f64>]) -> Vec<f64>;
    type OpFn = dyn Fn(&[Tensor]) -> Result<Tensor>;

    /// Row-wise f64 references on a [rows, n] layout.
    fn ref_layer_norm(x: &[f64], w: &[f64], b: &[f64], n: usize, eps: f64) -> Vec<f64> {
        x.chunks(n)
            .flat_map(|r| {
                let mean = r.iter().sum::<f64>() / n as f64;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
                let s = (var + eps).sqrt();
                r.iter().enumerate().map(|(i, v)| (v - mean) / s * w[i] + b[i]).collect::<Vec<_>>()
            })
            .collect()
    }
    fn ref_rms_norm(x: &[f64], w: &[f64], n: usize, eps: f64) -> Vec<f64> {
        x.chunks(n)
            .flat_map(|r| {
                let ms = r.iter().map(|v| v * v).sum::<f64>() / n as f64;
                let s = (ms + eps).sqrt();
                r.iter().enumerate().map(|(i, v)| v / s * w[i]).collect::<Vec<_>>()
            })
            .collect()
    }
    fn ref_log_softmax(x: &[f64], n: usize) -> Vec<f64> {
        x.chunks(n)
            .flat_map(|r| {
                let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = r.iter().map(|v| (v - m).exp()).sum::<f64>().ln() + m;
                r.iter().map(|v| v - lse).collect::<Vec<_>>()
            })
            .collect()
    }

    /// Checks an op against its f64 reference: forward values, and for every input the
    /// gradient of `sum(r * op(inputs))` from candle's backward against central finite
    /// differences of the f64 reference. Fails if any input gets no gradient, which is
    /// what candle's fused kernels do.
    fn check_op(op: &OpFn, reference: &RefFn, shapes: &[Vec<usize>], seed: u64) -> std::result::Result<(), String> {
        let dev = Device::Cpu;
        let mut rng = Rng::new(seed);
        let inputs: Vec<Vec<f64>> = shapes.iter().map(|s| rng.vec(s.iter().product(), -2.0, 2.0)).collect();
        let vars: Vec<Var> = inputs
            .iter()
            .zip(shapes)
            .map(|(v, s)| {
                let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                Var::from_tensor(&Tensor::from_vec(f, s.as_slice(), &dev).unwrap()).unwrap()
            })
            .collect();
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = op(&tensors).map_err(|e| e.to_string())?;
        let n_out = out.elem_count();
        let r = rng.vec(n_out, -1.0, 1.0);
        let r_t = Tensor::from_vec(r.iter().map(|&x| x as f32).collect::<Vec<_>>(), out.shape(), &dev)
            .map_err(|e| e.to_string())?;
        let loss = (&out * &r_t).and_then(|t| t.sum_all()).map_err(|e| e.to_string())?;
        let grads = loss.backward().map_err(|e| e.to_string())?;

        let want = reference(&inputs);
        let got: Vec<f32> = out.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| e.to_string())?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if (*g as f64 - w).abs() > 1e-5 * (1.0 + w.abs()) {
                return Err(format!("forward element {i}: got {g}, want {w}"));
            }
        }
        let objective = |ins: &[Vec<f64>]| -> f64 { reference(ins).iter().zip(&r).map(|(a, b)| a * b).sum() };
        let h = 1e-5;
        for (k, var) in vars.iter().enumerate() {
            let g = grads.get(var.as_tensor()).ok_or_else(|| format!("input {k} received no gradient"))?;
            let g: Vec<f32> = g.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| e.to_string())?;
            for j in 0..inputs[k].len() {
                let mut plus = inputs.clone();
                plus[k][j] += h;
                let mut minus = inputs.clone();
                minus[k][j] -= h;
                let fd = (objective(&plus) - objective(&minus)) / (2.0 * h);
                if (g[j] as f64 - fd).abs() > 2e-4 * (1.0 + fd.abs()) {
                    return Err(format!("input {k} element {j}: grad {} vs finite diff {fd}", g[j]));
                }
            }
        }
        Ok(())
    }

    const EPS: f64 = 1e-5;

    fn layer_norm_case() -> (Box<OpFn>, Box<RefFn>, Vec<Vec<usize>>) {
        (
            Box::new(|t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], EPS)),
            Box::new(|v: &[Vec<f64>]| ref_layer_norm(&v[0], &v[1], &v[2], 5, EPS)),
            vec![vec![2, 3, 5], vec![5], vec![5]],
        )
    }
    fn rms_norm_case() -> (Box<OpFn>, Box<RefFn>, Vec<Vec<usize>>) {
        (
            Box::new(|t: &[Tensor]| rms_norm(&t[0], &t[1], EPS)),
            Box::new(|v: &[Vec<f64>]| ref_rms_norm(&v[0], &v[1], 5, EPS)),
            vec![vec![2, 3, 5], vec![5]],
        )
    }
    fn softmax_ref(v: &[Vec<f64>]) -> Vec<f64> {
        ref_log_softmax(&v[0], 4).iter().map(|x| x.exp()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

        #[test]
        fn layer_norm_matches_f64_with_all_gradients(seed in any::<u64>()) {
            let (op, r, s) = layer_norm_case();
            prop_assert_eq!(check_op(&*op, &*r, &s, seed), Ok(()));
        }

        #[test]
        fn rms_norm_matches_f64_with_all_gradients(seed in any::<u64>()) {
            let (op, r, s) = rms_norm_case();
            prop_assert_eq!(check_op(&*op, &*r, &s, seed), Ok(()));
        }

        #[test]
        fn softmax_matches_f64_with_gradient(seed in any::<u64>()) {
            let op = |t: &[Tensor]| softmax_last_dim(&t[0]);
            prop_assert_eq!(check_op(&op, &softmax_ref, &[vec![3, 2, 4]], seed), Ok(()));
        }

        #[test]
        fn log_softmax_matches_f64_with_gradient(seed in any::<u64>()) {
            let op = |t: &[Tensor]| log_softmax_last_dim(&t[0]);
            let r = |v: &[Vec<f64>]| ref_log_softmax(&v[0], 4);
            prop_assert_eq!(check_op(&op, &r, &[vec![3, 2, 4]], seed), Ok(()));
        }
    }

    /// The harness above must be able to fail: candle's fused kernels, run through it,
    /// are caught. (If candle ever gives them a backward pass this test fails, which is
    /// the signal to revisit the trap in CONVENTIONS-helpers.md.)
    #[test]
    fn harness_catches_candles_fused_ops() {
        let fused_softmax = |t: &[Tensor]| candle_nn::ops::softmax_last_dim(&t[0]);
        let err = check_op(&fused_softmax, &softmax_ref, &[vec![3, 2, 4]], 7).unwrap_err();
        assert!(err.contains("no gradient"), "{err}");
        let fused_rms = |t: &[Tensor]| candle_nn::ops::rms_norm(&t[0], &t[1], EPS as f32);
        let (_, r, s) = rms_norm_case();
        let err = check_op(&fused_rms, &*r, &s, 7).unwrap_err();
        assert!(err.contains("no gradient"), "{err}");
        let fused_ln = |t: &[Tensor]| candle_nn::ops::layer_norm(&t[0], &t[1], &t[2], EPS as f32);
        let (_, r, s) = layer_norm_case();
        let err = check_op(&fused_ln, &*r, &s, 7).unwrap_err();
        assert!(err.contains("no gradient"), "{err}");
    }

    /// Half inputs: computed in F32 and cast back; every input gets a gradient (the
    /// activation's in its own dtype, the F32 parameter's in F32) close to the F32 one.
    #[test]
    fn half_inputs_compute_in_f32_and_keep_gradients() {
        let dev = Device::Cpu;
        let mut rng = Rng::new(11);
        let x32 = Tensor::from_vec(rng.vec(30, -2.0, 2.0).iter().map(|&v| v as f32).collect::<Vec<_>>(), (6, 5), &dev)
            .unwrap();
        let w = Var::from_tensor(
            &Tensor::from_vec(rng.vec(5, 0.5, 1.5).iter().map(|&v| v as f32).collect::<Vec<_>>(), 5, &dev).unwrap(),
        )
        .unwrap();
        let b = Var::zeros(5, DType::F32, &dev).unwrap();
        for dt in [DType::BF16, DType::F16] {
            let tol = if dt == DType::BF16 { 3e-2 } else { 4e-3 };
            let run = |x: &Var| -> (Tensor, GradsOut) {
                let ln = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), EPS).unwrap();
                let rn = rms_norm(x.as_tensor(), w.as_tensor(), EPS).unwrap();
                let sm = softmax_last_dim(x.as_tensor()).unwrap();
                let ls = log_softmax_last_dim(x.as_tensor()).unwrap();
                let out = Tensor::cat(&[&ln, &rn, &sm, &ls], 1).unwrap();
                let loss = out.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                let gx = g.get(x.as_tensor()).expect("x grad").to_dtype(DType::F32).unwrap();
                let gw = g.get(w.as_tensor()).expect("w grad").clone();
                let gb = g.get(b.as_tensor()).expect("b grad").clone();
                (out, (gx, gw, gb))
            };
            let xh = Var::from_tensor(&x32.to_dtype(dt).unwrap()).unwrap();
            let (out_h, gh) = run(&xh);
            assert_eq!(out_h.dtype(), dt);
            assert_eq!(gh.1.dtype(), DType::F32);
            // Reference: same (half-rounded) input in F32.
            let xr = Var::from_tensor(&xh.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
            let (out_r, gr) = run(&xr);
            let close = |a: &Tensor, b: &Tensor| {
                let a: Vec<f32> = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
                let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
                for (x, y) in a.iter().zip(&b) {
                    assert!(x.is_finite() && (x - y).abs() <= tol * scale, "{dt:?}: {x} vs {y}");
                }
            };
            close(&out_h, &out_r);
            close(&gh.0, &gr.0);
            close(&gh.1, &gr.1);
            close(&gh.2, &gr.2);
        }
    }
    type GradsOut = (Tensor, Tensor, Tensor);

    /// On the GPU, BF16/F16 inputs: outputs and gradients match the CPU's F32 run within
    /// half-precision rounding. Skips without a device.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_half_ops_match_cpu() {
        let Some(gpu) = fx_hw::test_gpu("cuda_half_ops_match_cpu") else { return };
        let mut rng = Rng::new(3);
        let x = Tensor::from_vec(
            rng.vec(40, -2.0, 2.0).iter().map(|&v| v as f32).collect::<Vec<_>>(),
            (8, 5),
            &Device::Cpu,
        )
        .unwrap();
        let w = Tensor::from_vec(rng.vec(5, 0.5, 1.5).iter().map(|&v| v as f32).collect::<Vec<_>>(), 5, &Device::Cpu)
            .unwrap();
        let b = Tensor::from_vec(rng.vec(5, -0.5, 0.5).iter().map(|&v| v as f32).collect::<Vec<_>>(), 5, &Device::Cpu)
            .unwrap();
        let run = |dev: &Device, dt: DType| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let xv = Var::from_tensor(&x.to_device(dev).unwrap().to_dtype(dt).unwrap()).unwrap();
            let wv = Var::from_tensor(&w.to_device(dev).unwrap()).unwrap();
            let bv = Var::from_tensor(&b.to_device(dev).unwrap()).unwrap();
            let out = Tensor::cat(
                &[
                    layer_norm(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), EPS).unwrap(),
                    rms_norm(xv.as_tensor(), wv.as_tensor(), EPS).unwrap(),
                    softmax_last_dim(xv.as_tensor()).unwrap(),
                    log_softmax_last_dim(xv.as_tensor()).unwrap(),
                ],
                1,
            )
            .unwrap();
            assert_eq!(out.dtype(), dt);
            let out = out.to_dtype(DType::F32).unwrap();
            let g = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let flat = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let gx = flat(g.get(xv.as_tensor()).unwrap());
            let mut gp = flat(g.get(wv.as_tensor()).unwrap());
            gp.extend(flat(g.get(bv.as_tensor()).unwrap()));
            (flat(&out), gx, gp)
        };
        let reference = run(&Device::Cpu, DType::F32);
        for (dt, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 3e-2), (DType::F16, 4e-3)] {
            let got = run(&gpu, dt);
            for (a, r) in [(&got.0, &reference.0), (&got.1, &reference.1), (&got.2, &reference.2)] {
                let scale = r.iter().fold(1f32, |m, v| m.max(v.abs()));
                for (u, v) in a.iter().zip(r.iter()) {
                    assert!((u - v).abs() <= tol * scale, "{dt:?}: {u} vs {v}");
                }
            }
        }
    }

    /// Causal-attention style masks (-inf entries) give exact zeros there and finite
    /// gradients everywhere.
    #[test]
    fn masked_softmax_has_finite_gradients() {
        let dev = Device::Cpu;
        let ninf = f32::NEG_INFINITY;
        let x = Var::from_tensor(&Tensor::new(&[[0.3f32, ninf, -1.2], [ninf, ninf, 2.0]], &dev).unwrap()).unwrap();
        let y = softmax_last_dim(x.as_tensor()).unwrap();
        let v = y.to_vec2::<f32>().unwrap();
        assert_eq!((v[0][1], v[1][0], v[1][1], v[1][2]), (0.0, 0.0, 0.0, 1.0));
        let w = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev).unwrap();
        let g = (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        let g = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(g.iter().all(|v| v.is_finite()), "{g:?}");
        // d/dx0 of softmax([x0, -inf, x2]) . [1, 3] = p0 p2 (1 - 3)
        let (p0, p2) = (v[0][0] as f64, v[0][2] as f64);
        assert!((g[0] as f64 - p0 * p2 * (1.0 - 3.0)).abs() < 1e-6);
    }
}
