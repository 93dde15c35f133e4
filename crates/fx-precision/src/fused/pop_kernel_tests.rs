//! Device tests: the population optimiser kernels against `fused_ref::pop_sumsq_reference` /
//! `pop_adam_reference` on fresh random tensors (more than one launch table, a member that
//! skips, a member with an infinite gradient, slices of one to several chunks), and the
//! decisions kernel against `pop_decide_reference` (non-finite losses and norms, clipped and
//! unclipped members, step counts at and past the bias tables' ends, dry and real launches).
//! Return early without a GPU (fail with `FX_REQUIRE_GPU=1`).

use candle_core::{DType, Tensor};

use super::kernels::MT_MAX;
use super::pop_kernels::{PopAdamKernels, PopDecide, PopEntry, PopFactors};
use crate::fused_ref::{
    pop_adam_reference, pop_decide_reference, pop_sumsq_reference, PopRefFactors, PopRefMember, PopRefTensor,
};
use fx_hw::test_gpu as gpu;
use fx_kernels::cuda::address;
use fx_kernels::rng;

/// A seed from the clock, printed so that a failure can be replayed.
fn fresh_seed(test: &str) -> u64 {
    fx_hw::test_seed(test)
}

#[test]
fn pop_kernels_match_reference() {
    let Some(dev) = gpu("pop_kernels_match_reference") else { return };
    let seed = fresh_seed("pop_kernels_match_reference");
    let members = 5;
    let n_tensors = MT_MAX + 3;
    let pers: Vec<usize> =
        (0..n_tensors).map(|i| 1 + (rng::draw(seed, 1, i as u64, 0) * [9000.0, 300.0, 3.0][i % 3]) as usize).collect();
    let rand = |stream: u64, i: usize, n: usize, scale: f64| -> Vec<f32> {
        (0..n).map(|j| ((rng::draw(seed, stream, i as u64, j as u64) - 0.5) * 2.0 * scale) as f32).collect()
    };
    let len = |i: usize| members * pers[i];
    let mut p: Vec<Vec<f32>> = (0..n_tensors).map(|i| rand(2, i, len(i), 1.0)).collect();
    let mut g: Vec<Vec<f32>> = (0..n_tensors).map(|i| rand(3, i, len(i), 1.0)).collect();
    let mut m: Vec<Vec<f32>> = (0..n_tensors).map(|i| rand(4, i, len(i), 0.1)).collect();
    let mut v: Vec<Vec<f32>> =
        (0..n_tensors).map(|i| rand(5, i, len(i), 0.01).iter().map(|x| x.abs()).collect()).collect();
    // Every other tensor has a target copy.
    let mut tg: Vec<Option<Vec<f32>>> = (0..n_tensors).map(|i| (i % 2 == 0).then(|| rand(6, i, len(i), 1.0))).collect();
    // Member 3's gradient is infinite somewhere in the last tensor.
    let last = n_tensors - 1;
    g[last][3 * pers[last]] = f32::INFINITY;
    let up = |x: &[f32]| Tensor::from_slice(x, x.len(), &dev).unwrap();
    let dp: Vec<Tensor> = p.iter().map(|x| up(x)).collect();
    let dg: Vec<Tensor> = g.iter().map(|x| up(x)).collect();
    let dm: Vec<Tensor> = m.iter().map(|x| up(x)).collect();
    let dv: Vec<Tensor> = v.iter().map(|x| up(x)).collect();
    let dt: Vec<Option<Tensor>> = tg.iter().map(|x| x.as_ref().map(|x| up(x))).collect();
    let entries: Vec<PopEntry> = (0..n_tensors)
        .map(|i| PopEntry {
            param: address::<f32>(&dp[i], "p").unwrap(),
            grad: address::<f32>(&dg[i], "g").unwrap(),
            exp_avg: address::<f32>(&dm[i], "m").unwrap(),
            exp_avg_sq: address::<f32>(&dv[i], "v").unwrap(),
            target: dt[i].as_ref().map_or(0, |t| address::<f32>(t, "t").unwrap()),
            per: pers[i],
        })
        .collect();
    let kernels = PopAdamKernels::load(&dev).unwrap();
    let cols = PopAdamKernels::partial_cols(&pers);
    let partials = Tensor::zeros((members, cols), DType::F32, &dev).unwrap();
    unsafe { kernels.sumsq(&entries, members, address::<f32>(&partials, "partials").unwrap()).unwrap() };
    let rows: Vec<Vec<f32>> = partials.to_vec2().unwrap();
    let want = pop_sumsq_reference(&g.iter().map(|x| x.as_slice()).collect::<Vec<_>>(), members);
    for k in 0..members {
        let got: f64 = rows[k].iter().map(|&x| f64::from(x)).sum();
        if k == 3 {
            assert!(!got.is_finite(), "member 3's infinite gradient must show in its norm, got {got}");
        } else {
            let rel = (got - want[k]).abs() / want[k];
            assert!(rel < 1e-5, "member {k}: sumsq {got} vs {} (rel {rel:.2e}, seed {seed})", want[k]);
        }
    }
    // Member 1 skips (as member 3 would after the guard); the others with their own factors.
    let ok = [1.0f32, 0.0, 1.0, 0.0, 1.0];
    let fac = |stream: u64, lo: f64, hi: f64| -> Vec<f32> {
        (0..members).map(|k| (lo + (hi - lo) * rng::draw(seed, stream, k as u64, 0)) as f32).collect()
    };
    let (coef, decay, step, inv, tau) =
        (fac(20, 0.1, 1.0), fac(21, 0.99, 1.0), fac(22, 1e-4, 1e-2), fac(23, 1.0, 30.0), fac(24, 0.001, 0.05));
    let df: Vec<Tensor> = [&ok[..], &coef, &decay, &step, &inv, &tau].iter().map(|x| up(x)).collect();
    let a = |i: usize| address::<f32>(&df[i], "factor").unwrap();
    let factors = PopFactors { ok: a(0), coef: a(1), decay: a(2), step_size: a(3), inv_bc2_sqrt: a(4), tau: a(5) };
    let consts = (0.9, 0.999, 1e-8);
    let before: Vec<Vec<f32>> = dp.iter().map(|t| t.to_vec1().unwrap()).collect();
    unsafe { kernels.adam(&entries, members, &factors, consts, true).unwrap() };
    for (i, t) in dp.iter().enumerate() {
        assert!(t.to_vec1::<f32>().unwrap() == before[i], "a dry launch changed tensor {i}");
    }
    unsafe { kernels.adam(&entries, members, &factors, consts, false).unwrap() };
    let f = PopRefFactors { ok: &ok, coef: &coef, decay: &decay, step_size: &step, inv_bc2_sqrt: &inv, tau: &tau };
    let mut refs: Vec<PopRefTensor<'_>> = p
        .iter_mut()
        .zip(&g)
        .zip(m.iter_mut().zip(v.iter_mut()))
        .zip(tg.iter_mut())
        .map(|(((p, g), (m, v)), t)| PopRefTensor {
            param: p,
            grad: g,
            exp_avg: m,
            exp_avg_sq: v,
            target: t.as_deref_mut(),
        })
        .collect();
    pop_adam_reference(&mut refs, members, &f, consts);
    drop(refs);
    for i in 0..n_tensors {
        let same = |d: &Tensor, h: &[f32], what: &str| {
            let d: Vec<f32> = d.to_vec1().unwrap();
            assert!(d.iter().all(|x| x.is_finite()), "{what} {i}: non-finite");
            // The same F32 operations in the same order: bit for bit.
            let bad = d.iter().zip(h).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{what} {i} element {bad:?}: {:?} vs {:?} (seed {seed})",
                bad.map(|j| d[j]),
                bad.map(|j| h[j])
            );
        };
        same(&dp[i], &p[i], "param");
        same(&dm[i], &m[i], "exp_avg");
        same(&dv[i], &v[i], "exp_avg_sq");
        if let (Some(d), Some(h)) = (&dt[i], &tg[i]) {
            same(d, h, "target");
        }
        // Skipped members are untouched.
        let per = pers[i];
        let got: Vec<f32> = dp[i].to_vec1().unwrap();
        assert!(got[per..2 * per] == before[i][per..2 * per], "member 1 of tensor {i} moved");
    }
}

#[test]
fn pop_decide_matches_reference() {
    let Some(dev) = gpu("pop_decide_matches_reference") else { return };
    let seed = fresh_seed("pop_decide_matches_reference");
    // More members than one block of threads; a short second table so that step counts reach
    // its end.
    let (members, cols) = (300usize, 37usize);
    let r = |stream: u64, k: usize, j: usize| rng::draw(seed, stream, k as u64, j as u64);
    let mut partials: Vec<f32> = (0..members * cols).map(|i| (r(1, i / cols, i % cols) * 0.02) as f32).collect();
    let table = |beta: f64, len: usize| -> Vec<f64> { (0..len).map(|t| 1.0 - beta.powf(t as f64)).collect() };
    let (bc1, bc2) = (table(0.9, 400), table(0.999, 50));
    let mut m: Vec<PopRefMember> = (0..members)
        .map(|k| PopRefMember {
            loss: ((r(2, k, 0) - 0.5) * 4.0) as f32,
            lr: 1e-5 + r(3, k, 0) * 1e-2,
            // Half the members clip (a norm of ~0.1–0.9 against a clip of ~0.05–0.3).
            max_norm: if k % 2 == 0 { 0.05 + 0.25 * r(4, k, 0) } else { 10.0 + r(4, k, 0) },
            steps: (r(5, k, 0) * 500.0) as u32,
            skipped_loss: (r(6, k, 0) * 5.0) as u32,
            skipped_grad: (r(7, k, 0) * 5.0) as u32,
            active: true,
        })
        .collect();
    // Non-finite cases: a NaN and an infinite loss, a NaN and an infinite partial, both at once,
    // an all-zero gradient.
    m[5].loss = f32::NAN;
    m[6].loss = f32::INFINITY;
    partials[7 * cols + 3] = f32::NAN;
    partials[8 * cols] = f32::INFINITY;
    m[9].loss = f32::NEG_INFINITY;
    partials[9 * cols + 1] = f32::NAN;
    partials[10 * cols..11 * cols].fill(0.0);
    m[11].steps = 0;
    m[12].steps = bc2.len() as u32 - 2;
    // Members not learning yet, one of them with a NaN loss: nothing steps, no skip counts.
    m[13].active = false;
    m[14].active = false;
    m[14].loss = f32::NAN;
    let up32 = |x: &[f32]| Tensor::from_slice(x, x.len(), &dev).unwrap();
    let up64 = |x: &[f64]| Tensor::from_slice(x, x.len(), &dev).unwrap();
    let upu = |x: &[u32]| Tensor::from_slice(x, x.len(), &dev).unwrap();
    let d_partials = Tensor::from_slice(&partials, (members, cols), &dev).unwrap();
    let d_loss = up32(&m.iter().map(|m| m.loss).collect::<Vec<_>>());
    let d_lr = up64(&m.iter().map(|m| m.lr).collect::<Vec<_>>());
    let d_max = up64(&m.iter().map(|m| m.max_norm).collect::<Vec<_>>());
    let (d_bc1, d_bc2) = (up64(&bc1), up64(&bc2));
    let d_steps = upu(&m.iter().map(|m| m.steps).collect::<Vec<_>>());
    let d_sl = upu(&m.iter().map(|m| m.skipped_loss).collect::<Vec<_>>());
    let d_sg = upu(&m.iter().map(|m| m.skipped_grad).collect::<Vec<_>>());
    let d_last = Tensor::zeros((3, members), DType::F64, &dev).unwrap();
    let d_active = up32(&m.iter().map(|m| f32::from(u8::from(m.active))).collect::<Vec<_>>());
    let outs: Vec<Tensor> = (0..4).map(|_| Tensor::zeros(members, DType::F32, &dev).unwrap()).collect();
    let a32 = |t: &Tensor| address::<f32>(t, "f32").unwrap();
    let a64 = |t: &Tensor| address::<f64>(t, "f64").unwrap();
    let au = |t: &Tensor| address::<u32>(t, "u32").unwrap();
    let d = PopDecide {
        partials: a32(&d_partials),
        loss: a32(&d_loss),
        lr: a64(&d_lr),
        max_norm: a64(&d_max),
        bc1: a64(&d_bc1),
        bc2: a64(&d_bc2),
        steps: au(&d_steps),
        skipped_loss: au(&d_sl),
        skipped_grad: au(&d_sg),
        last: a64(&d_last),
        active: a32(&d_active),
        ok: a32(&outs[0]),
        coef: a32(&outs[1]),
        step_size: a32(&outs[2]),
        inv_bc2_sqrt: a32(&outs[3]),
        bc1_last: bc1.len() as u32 - 1,
        bc2_last: bc2.len() as u32 - 1,
        members: members as u32,
        cols: cols as u32,
    };
    let kernels = PopAdamKernels::load(&dev).unwrap();
    for dry in [true, false] {
        unsafe { kernels.decide(&d, dry).unwrap() };
        let got: Vec<Vec<f32>> = outs.iter().map(|t| t.to_vec1().unwrap()).collect();
        let last: Vec<Vec<f64>> = d_last.to_vec2().unwrap();
        let (steps, sl, sg): (Vec<u32>, Vec<u32>, Vec<u32>) =
            (d_steps.to_vec1().unwrap(), d_sl.to_vec1().unwrap(), d_sg.to_vec1().unwrap());
        let (mut clipped, mut skipped) = (0, 0);
        for k in 0..members {
            let want = pop_decide_reference(&partials[k * cols..(k + 1) * cols], &mut m[k], &bc1, &bc2, dry);
            let ctx = format!("member {k}, dry {dry}, seed {seed}");
            let bits = [got[0][k], got[1][k], got[2][k], got[3][k]].map(f32::to_bits);
            let want_bits = [want.ok, want.coef, want.step_size, want.inv_bc2_sqrt].map(f32::to_bits);
            assert_eq!(bits, want_bits, "factors of {ctx}");
            assert!(got[1][k].is_finite() && got[2][k].is_finite() && got[3][k].is_finite(), "{ctx}: factors finite");
            assert_eq!(
                (steps[k], sl[k], sg[k]),
                (m[k].steps, m[k].skipped_loss, m[k].skipped_grad),
                "counters of {ctx}"
            );
            if !dry {
                let l = [last[0][k], last[1][k], last[2][k]];
                // Bit for bit, except that a NaN's payload is the platform's (the device's F32
                // NaN widened is 0x7fffffffe0000000, the host's 0x7ff8000000000000): a NaN
                // loss or norm must be reported as a NaN, and only a NaN matches one.
                let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(
                    l.iter().zip(&want.last).all(|(&a, &b)| same(a, b)),
                    "last report of {ctx}: {l:?} against {:?}",
                    want.last
                );
            }
            clipped += usize::from(want.coef < 1.0);
            skipped += usize::from(want.ok == 0.0);
        }
        assert!(clipped > members / 4 && skipped == 7, "clipped {clipped}, skipped {skipped}: cases not covered");
    }
}
