//! Test-only scalar f64 references of the networks and losses, written straight from
//! MODELS.md, and proptests comparing the candle implementations with them on fresh
//! random weights and inputs.

use candle_core::{Device, Tensor};
use proptest::prelude::*;

use crate::dqn::{dqn_loss, DqnBatch, DqnNetConfig, DuelingDqn};
use crate::fixtures::rel_err;
use crate::params::ParamStore;
use crate::ppo::{ppo_loss, ActorCritic, PpoBatch, PpoLossConfig, PpoNetConfig};

/// Parameters of `set` as f64 vectors, in spec order.
fn params(set: &ParamStore) -> Vec<Vec<f64>> {
    set.vars()
        .iter()
        .map(|v| v.as_tensor().flatten_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_vec1().unwrap())
        .collect()
}

/// `x · Wᵀ + b` for one row.
fn lin(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let i = x.len();
    b.iter().enumerate().map(|(o, bo)| bo + (0..i).map(|k| w[o * i + k] * x[k]).sum::<f64>()).collect()
}

fn dqn_q(p: &[Vec<f64>], s: &[f64]) -> Vec<f64> {
    let relu = |v: Vec<f64>| v.into_iter().map(|x| x.max(0.0)).collect::<Vec<_>>();
    let z = relu(lin(s, &p[0], &p[1]));
    let z = relu(lin(&z, &p[2], &p[3]));
    let z = relu(lin(&z, &p[4], &p[5]));
    let v = lin(&z, &p[6], &p[7])[0];
    let a = lin(&z, &p[8], &p[9]);
    let m = a.iter().sum::<f64>() / a.len() as f64;
    a.iter().map(|ai| v + ai - m).collect()
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (j, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = j;
        }
    }
    best
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(candle_core::DType::F64).unwrap().to_vec2().unwrap()
}

fn vec1(t: &Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64).unwrap().to_vec1().unwrap()
}

/// Random `[b, 56]` states and per-row scalars from a proptest seed.
fn random_inputs(seed: u64, b: usize) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let u = |stream: u64, i: u64| fx_kernels::rng::draw(seed, stream, 0, i);
    let dev = Device::Cpu;
    let s: Vec<f32> = (0..b * 56).map(|i| (2.0 * u(10, i as u64) - 1.0) as f32 * 2.0).collect();
    let s2: Vec<f32> = (0..b * 56).map(|i| (2.0 * u(11, i as u64) - 1.0) as f32 * 2.0).collect();
    let a: Vec<u32> = (0..b).map(|i| (u(12, i as u64) * 3.0) as u32).collect();
    let r: Vec<f32> = (0..b).map(|i| (u(13, i as u64) * 4.0 - 2.0) as f32).collect();
    let d: Vec<f32> = (0..b).map(|i| if u(14, i as u64) < 0.3 { 1.0 } else { 0.0 }).collect();
    (
        Tensor::from_vec(s, (b, 56), &dev).unwrap(),
        Tensor::from_vec(a, b, &dev).unwrap(),
        Tensor::from_vec(r, b, &dev).unwrap(),
        Tensor::from_vec(s2, (b, 56), &dev).unwrap(),
        Tensor::from_vec(d, b, &dev).unwrap(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn dqn_loss_matches_f64_reference(seed in any::<u64>(), b in 2usize..24, hidden in 2usize..20) {
        let cfg = DqnNetConfig { hidden, ..Default::default() };
        let online = DuelingDqn::new(cfg, &Device::Cpu, seed).unwrap();
        let target = DuelingDqn::new(cfg, &Device::Cpu, seed ^ 1).unwrap();
        let (s, a, r, s2, d) = random_inputs(seed, b);
        let batch = DqnBatch { obs: &s, actions: &a, rewards: &r, next_obs: &s2, dones: &d };
        let parts = dqn_loss(&online, &target, batch, 0.99, 1.0).unwrap();
        let (po, pt) = (params(online.params()), params(target.params()));
        let (sr, s2r) = (rows(&s), rows(&s2));
        let (a, r, d) = (a.to_vec1::<u32>().unwrap(), vec1(&r), vec1(&d));
        let mut q_ref = Vec::new();
        let mut loss = 0.0;
        for i in 0..b {
            let q = dqn_q(&po, &sr[i]);
            let a_star = argmax(&dqn_q(&po, &s2r[i]));
            let y = r[i] + 0.99 * (1.0 - d[i]) * dqn_q(&pt, &s2r[i])[a_star];
            let e: f64 = q[a[i] as usize] - y;
            loss += if e.abs() <= 1.0 { 0.5 * e * e } else { e.abs() - 0.5 };
            q_ref.push(q);
        }
        loss /= b as f64;
        let q_ref = Tensor::new(q_ref, &Device::Cpu).unwrap();
        prop_assert!(rel_err(&parts.q, &q_ref) < 1e-5);
        let l = parts.loss.to_scalar::<f32>().unwrap() as f64;
        prop_assert!((l - loss).abs() <= 1e-5 * loss.abs().max(1e-3), "{} vs {}", l, loss);
    }

    #[test]
    fn ppo_loss_matches_f64_reference(seed in any::<u64>(), b in 2usize..24, hidden in 1usize..20) {
        let m = ActorCritic::new(PpoNetConfig { hidden, ..Default::default() }, &Device::Cpu, seed).unwrap();
        let (s, a, adv, _, _) = random_inputs(seed, b);
        let u = |stream: u64, i: u64| fx_kernels::rng::draw(seed, stream, 1, i);
        let logp_old: Vec<f32> = (0..b).map(|i| (-0.3 - 1.5 * u(20, i as u64)) as f32).collect();
        let ret: Vec<f32> = (0..b).map(|i| (u(21, i as u64) * 2.0 - 1.0) as f32).collect();
        let (logp_old, ret) = (Tensor::new(logp_old, &Device::Cpu).unwrap(), Tensor::new(ret, &Device::Cpu).unwrap());
        let cfg = PpoLossConfig::default();
        let batch = PpoBatch { obs: &s, actions: &a, logp_old: &logp_old, advantages: &adv, returns: &ret };
        let p = ppo_loss(&m, batch, &cfg).unwrap();

        let w = params(m.params());
        let tanh = |v: Vec<f64>| v.into_iter().map(f64::tanh).collect::<Vec<_>>();
        let (sr, a) = (rows(&s), a.to_vec1::<u32>().unwrap());
        let (adv, lo, ret) = (vec1(&adv), vec1(&logp_old), vec1(&ret));
        let mean = adv.iter().sum::<f64>() / b as f64;
        let std = (adv.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (b as f64 - 1.0)).sqrt();
        let (mut lc, mut lc_terms, mut lv, mut ent) = (0.0, 0.0, 0.0, 0.0);
        for i in 0..b {
            let logits = lin(&tanh(lin(&tanh(lin(&sr[i], &w[0], &w[1])), &w[2], &w[3])), &w[4], &w[5]);
            let v = lin(&tanh(lin(&tanh(lin(&sr[i], &w[6], &w[7])), &w[8], &w[9])), &w[10], &w[11])[0];
            let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + logits.iter().map(|l| (l - mx).exp()).sum::<f64>().ln();
            let logp: Vec<f64> = logits.iter().map(|l| l - lse).collect();
            ent -= logp.iter().map(|l| l.exp() * l).sum::<f64>();
            let ratio = (logp[a[i] as usize] - lo[i]).exp();
            let an = (adv[i] - mean) / (std + 1e-8);
            let clip = (ratio * an).min(ratio.clamp(0.8, 1.2) * an);
            lc -= clip;
            lc_terms += clip.abs();
            lv += (v - ret[i]).powi(2);
        }
        let (lc, lc_terms, lv, ent) = (lc / b as f64, lc_terms / b as f64, 0.5 * lv / b as f64, ent / b as f64);
        let want = lc + 0.5 * lv - 0.01 * ent;
        let got = p.loss.to_scalar::<f32>().unwrap() as f64;
        // Relative to the terms' sizes, not the sum's: the terms can cancel to a small loss
        // (seen: −0.0105 from terms near 0.1, F32 off by 2.4e-7), and F32's error follows the
        // terms.
        // F32 normalises the advantages with an absolute error near ulp(max |adv|), so
        // relative to their spread it grows as max |adv| / std (seen: 1.446 and 1.467,
        // normalised about 1e-5 off).
        let cond = adv.iter().fold(0.0f64, |m, x| m.max(x.abs())) / std;
        let rel = 2e-5 + 8.0 * f64::from(f32::EPSILON) * cond;
        let scale = lc_terms + 0.5 * lv.abs() + 0.01 * ent.abs();
        prop_assert!((got - want).abs() <= rel * scale.max(1e-2), "{} vs {} (terms {})", got, want, scale);
        let l_clip = p.l_clip.to_scalar::<f32>().unwrap() as f64;
        // The same for the clip term alone: normalised advantages sum to zero, so its
        // per-row terms cancel (seen: b = 2, terms near 0.7, F32 off by more than 2e-7).
        prop_assert!((l_clip - lc).abs() <= rel * lc_terms.max(1e-2), "{} vs {} (terms {})", l_clip, lc, lc_terms);
    }

    /// The loss only sees normalised advantages: a positive affine map of the raw
    /// advantages leaves it unchanged.
    #[test]
    fn ppo_loss_invariant_to_advantage_scale_and_shift(seed in any::<u64>(), scale in 0.1f64..100.0, shift in -10.0f64..10.0) {
        let m = ActorCritic::new(PpoNetConfig { hidden: 8, ..Default::default() }, &Device::Cpu, seed).unwrap();
        let (s, a, adv, _, r) = random_inputs(seed, 16);
        let lo = Tensor::full(-1.1f32, 16, &Device::Cpu).unwrap();
        let adv2 = adv.affine(scale, shift).unwrap();
        let cfg = PpoLossConfig::default();
        let l1 = ppo_loss(&m, PpoBatch { obs: &s, actions: &a, logp_old: &lo, advantages: &adv, returns: &r }, &cfg).unwrap();
        let l2 = ppo_loss(&m, PpoBatch { obs: &s, actions: &a, logp_old: &lo, advantages: &adv2, returns: &r }, &cfg).unwrap();
        let (x, y) = (l1.loss.to_scalar::<f32>().unwrap(), l2.loss.to_scalar::<f32>().unwrap());
        // The per-sample terms are O(1); the only difference is the f32 rounding of the
        // mapped advantages (≈ 6e-8 · |shift| / scale relative to their spread).
        prop_assert!((x - y).abs() <= 1e-4, "{} vs {}", x, y);
    }
}
