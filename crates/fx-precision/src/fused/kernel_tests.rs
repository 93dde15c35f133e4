//! Device test: the fused step kernels against `optim_ref::fused_step_reference` on fresh
//! random tensors (more than one launch table, clipping, a skipped step, F16-style
//! scaling, a learning-rate change, soft target update). Returns early without a GPU.

use candle_core::{DType, Tensor};

use super::kernels::{FusedStepKernels, MtEntry, StepBuffers, MT_MAX};
use crate::fused_ref::{ctrl, fused_step_reference, new_ctrl, AdamConsts, GuardConsts, RefTensor, ScalerConsts};
use fx_hw::test_gpu as gpu;
use fx_kernels::cuda::address;
use fx_kernels::rng;

fn host(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().expect("to host")
}

#[test]
fn fused_step_matches_reference() {
    let Some(dev) = gpu("fused_step_matches_reference") else { return };
    let seed = fx_hw::test_seed("fused_step_matches_reference");
    let n_tensors = MT_MAX + 5;
    let lens: Vec<usize> = (0..n_tensors)
        .map(|i| 1 + (rng::draw(seed, 1, i as u64, 0) * [70_000.0, 3000.0, 17.0][i % 3]) as usize)
        .collect();
    let rand = |stream: u64, i: usize, n: usize, scale: f64| -> Vec<f32> {
        (0..n).map(|j| ((rng::draw(seed, stream, i as u64, j as u64) - 0.5) * 2.0 * scale) as f32).collect()
    };
    let mut p: Vec<Vec<f32>> = lens.iter().enumerate().map(|(i, &n)| rand(2, i, n, 1.0)).collect();
    let mut tg: Vec<Vec<f32>> = lens.iter().enumerate().map(|(i, &n)| rand(3, i, n, 1.0)).collect();
    let mut m: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
    let mut v = m.clone();
    let up = |x: &[f32]| Tensor::from_slice(x, x.len(), &dev).unwrap();
    let (dp, dt, dm, dv): (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>, Vec<Tensor>) = (
        p.iter().map(|x| up(x)).collect(),
        tg.iter().map(|x| up(x)).collect(),
        m.iter().map(|x| up(x)).collect(),
        v.iter().map(|x| up(x)).collect(),
    );
    let adam = AdamConsts { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true, tau: 0.005 };
    let guard = GuardConsts {
        max_norm: Some(50.0),
        scaler: Some(ScalerConsts { growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2 }),
    };
    let mut c = new_ctrl(1e-3, 1024.0);
    let dctrl = Tensor::from_slice(&c, ctrl::LEN, &dev).unwrap();
    let scale32 = Tensor::zeros(1, DType::F32, &dev).unwrap();
    let partials = Tensor::zeros(FusedStepKernels::partials_len(&lens), DType::F32, &dev).unwrap();
    let kernels = FusedStepKernels::load(&dev).unwrap();
    for step in 0..6 {
        if step == 4 {
            c[ctrl::LR] = 3e-4;
            dctrl.slice_set(&Tensor::new(&[3e-4f64], &dev).unwrap(), 0, ctrl::LR).unwrap();
        }
        // Step 2 carries an infinite gradient (skipped); step 3 a large one (clipped).
        let gscale = if step == 3 { 1e4 } else { 1.0 };
        let mut g: Vec<Vec<f32>> = lens.iter().enumerate().map(|(i, &n)| rand(10 + step, i, n, gscale)).collect();
        if step == 2 {
            g[n_tensors - 1][0] = f32::INFINITY;
        }
        let loss = 0.5 + step as f32;
        let extra = -(step as f32);
        let dg: Vec<Tensor> = g.iter().map(|x| up(x)).collect();
        let dloss = Tensor::new(&[loss], &dev).unwrap();
        let dextra = Tensor::new(&[extra], &dev).unwrap();
        for dry in [true, false] {
            let entries: Vec<MtEntry> = (0..n_tensors)
                .map(|i| MtEntry {
                    param: address::<f32>(&dp[i], "p").unwrap(),
                    grad: address::<f32>(&dg[i], "g").unwrap(),
                    exp_avg: address::<f32>(&dm[i], "m").unwrap(),
                    exp_avg_sq: address::<f32>(&dv[i], "v").unwrap(),
                    target: address::<f32>(&dt[i], "t").unwrap(),
                    len: lens[i],
                })
                .collect();
            let bufs = StepBuffers {
                loss: address::<f32>(&dloss, "loss").unwrap(),
                ctrl: address::<f64>(&dctrl, "ctrl").unwrap(),
                scale32: address::<f32>(&scale32, "scale32").unwrap(),
                partials: address::<f32>(&partials, "partials").unwrap(),
            };
            let ex = [address::<f32>(&dextra, "extra").unwrap()];
            // SAFETY: all tensors above outlive the launches (synchronised below).
            unsafe { kernels.launch(&entries, &bufs, &ex, &adam, &guard, dry) }.unwrap();
        }
        let mut ts: Vec<RefTensor<'_>> = p
            .iter_mut()
            .zip(&g)
            .zip(m.iter_mut().zip(v.iter_mut()))
            .zip(tg.iter_mut())
            .map(|(((p, g), (m, v)), t)| RefTensor { param: p, grad: g, exp_avg: m, exp_avg_sq: v, target: Some(t) })
            .collect();
        fused_step_reference(&mut ts, loss, &[extra], &mut c, &adam, &guard);
        let got: Vec<f64> = dctrl.to_vec1().unwrap();
        for k in [
            ctrl::STEP,
            ctrl::SCALE,
            ctrl::GROWTH,
            ctrl::APPLIED,
            ctrl::SKIP_LOSS,
            ctrl::SKIP_GRAD,
            ctrl::LAST_SKIPPED,
            ctrl::CLIPPED,
        ] {
            assert_eq!(got[k], c[k], "step {step}: ctrl[{k}]");
        }
        for k in [ctrl::LAST_NORM, ctrl::COEF, ctrl::LOSS_SUM, ctrl::NORM_SUM, ctrl::EXTRA_SUM] {
            assert!(
                got[k] == c[k] || (got[k] - c[k]).abs() <= 1e-6 * c[k].abs().max(1e-30),
                "step {step}: ctrl[{k}] {} vs {}",
                got[k],
                c[k]
            );
        }
        assert_eq!(host(&scale32)[0] as f64, c[ctrl::SCALE]);
        for i in 0..n_tensors {
            for (what, d, h) in [
                ("param", &dp[i], &p[i]),
                ("exp_avg", &dm[i], &m[i]),
                ("exp_avg_sq", &dv[i], &v[i]),
                ("target", &dt[i], &tg[i]),
            ] {
                let d = host(d);
                let err = d.iter().zip(h.iter()).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
                let norm = h.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
                assert!(d.iter().all(|x| x.is_finite()), "step {step}: {what}[{i}] not finite");
                assert!(err <= 1e-6 * norm.max(1e-30), "step {step}: {what}[{i}] rel err {}", err / norm.max(1e-30));
            }
        }
    }
}
