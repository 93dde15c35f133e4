//! INT8 policies on a CUDA device: a [`QuantNet`] as fx-kernels' fused INT8 greedy kernel
//! (`kernels/mlp/mlp_int8.cu`, one launch per batch), giving the scalar reference's scores
//! ([`crate::reference::reference_scores`]) bit for bit; and [`Decide`] for
//! `fx_models::mlp::cuda::MlpDecider`, so a service holds a GPU policy (F32 or INT8)
//! behind the same trait as the CPU ones.
//!
//! The kernel's device tests live here, beside the reference they compare with.

use candle_core::Device;
use fx_models::mlp::cuda::{MlpDecider, MlpPolicy};
use fx_models::mlp::int8::{I8Linear, I8Mlp, I8Weights};
use fx_models::mlp::reference::{Activation, Head};

use crate::decide::{act_batch_u32, Decide};
use crate::error::Result;
use crate::float_net::PolicyKind;
use crate::qnet::{QuantLayer, QuantNet};

impl QuantNet {
    /// The kernel's view of this network (borrowed).
    fn i8_mlp(&self) -> I8Mlp<'_> {
        let dynamic = self.dynamic_inputs();
        let lin = |l| kernel_layer(l, dynamic);
        let nh = self.kind.hidden_layers();
        let act = match self.kind {
            PolicyKind::Dqn => Activation::Relu,
            // The kernel's tanh for INT8 policies is fx-quant's rational one.
            PolicyKind::Ppo => Activation::Tanh,
        };
        let hidden = self.layers[..nh].iter().map(|l| (lin(l), act)).collect();
        let head = if self.kind.dueling() {
            Head::Dueling { value: lin(&self.layers[nh]), advantage: lin(&self.layers[nh + 1]) }
        } else {
            Head::Logits(lin(&self.layers[nh]))
        };
        I8Mlp { hidden, head }
    }

    /// This policy on `device` (CUDA) as one fused INT8 kernel: `greedy_into` / `bind` for
    /// observations already on the device, or wrapped in an `MlpDecider` for host slices.
    /// Every row's scores are [`crate::reference::reference_scores`]' to the bit.
    pub fn cuda_policy(&self, device: &Device) -> Result<MlpPolicy> {
        Ok(MlpPolicy::new_int8(&self.i8_mlp(), device)?)
    }
}

/// The kernel's view of one layer; a dynamic network's INT8 layers take each row's step.
fn kernel_layer(l: &QuantLayer, dynamic: bool) -> I8Linear<'_> {
    match l {
        QuantLayer::Int8(q) => I8Linear {
            out: q.out,
            inp: q.inp,
            weights: I8Weights::Int8 {
                weight: &q.weight,
                weight_scale: &q.weight_scale,
                input_scale: (!dynamic).then_some(q.input_scale),
            },
            bias: &q.bias,
        },
        QuantLayer::F32(f) => {
            I8Linear { out: f.out, inp: f.inp, weights: I8Weights::F32 { weight: &f.weight }, bias: &f.bias }
        }
    }
}

impl Decide for MlpDecider {
    fn state_dim(&self) -> usize {
        self.policy().dims().input
    }
    fn n_actions(&self) -> usize {
        self.policy().dims().n_actions
    }
    fn act(&mut self, obs: &[f32]) -> Result<usize> {
        Ok(MlpDecider::act(self, obs)? as usize)
    }
    fn scores(&self) -> &[f32] {
        MlpDecider::scores(self)
    }
    /// [`MlpDecider::act_batch`] in calls of up to 256 rows (or its `max_batch`).
    fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        let (d, chunk) = (self.policy().dims().input, self.max_batch());
        act_batch_u32(obs, actions, d, chunk, "MlpDecider (Decide::act_batch)", |rows, out| {
            Ok(MlpDecider::act_batch(self, rows, out)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;
    use crate::reference::reference_scores;
    use crate::testing::{random_net, uniforms};
    use crate::CalibMethod;

    fn seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    fn cuda() -> Device {
        fx_hw::open_cuda(0).expect("a CUDA device")
    }

    /// Fresh random networks of both kinds (odd widths, layers kept F32, every calibration)
    /// and observations wider than the calibration range: every row's scores from the GPU
    /// equal the scalar reference's bits, and so do the actions, for batches that take
    /// 1, 2, 4 and 8 rows per block and loop over the grid.
    #[test]
    fn gpu_int8_policies_give_the_reference_scores_to_the_bit() {
        let dev = cuda();
        let s0 = seed();
        println!("FX_TEST_SEED={s0}");
        for case in 0..24u64 {
            let s = s0.wrapping_add(case);
            let u: Vec<f32> = uniforms(s, 1, 8).iter().map(|v| v.abs()).collect();
            let dqn = case % 2 == 0;
            let kind = if dqn { PolicyKind::Dqn } else { PolicyKind::Ppo };
            let state_dim = 1 + (u[0] * 90.0) as usize;
            let (h1, h2) = (1 + (u[1] * 300.0) as usize, 1 + (u[2] * 200.0) as usize);
            let n_actions = 2 + (u[3] * 4.0) as usize;
            let hidden: Vec<usize> = if dqn { vec![h1, h2, h2.div_ceil(2)] } else { vec![h1, h2] };
            let net = random_net(kind, state_dim, &hidden, n_actions, s);
            let names = kind.layer_names();
            // Every other pair of cases keeps one layer (any) in F32, under every calibration
            // (the method cycles with period 3).
            let keep: Vec<&str> =
                if (case / 2) % 2 == 1 { vec![names[(u[4] * names.len() as f32) as usize]] } else { vec![] };
            let obs_scale = 0.05 + 10.0 * u[5];
            let calib: Vec<f32> = uniforms(s ^ 1, 3, 64 * state_dim).iter().map(|v| v * obs_scale).collect();
            let method =
                [CalibMethod::MinMax, CalibMethod::Percentile(99.0), CalibMethod::Dynamic][(case % 3) as usize];
            let q = crate::quantize(&net, &calib, method, &keep).unwrap();
            let policy = q.cuda_policy(&dev).unwrap();
            for rows in [1usize, 3, 67, 300, 1500] {
                let host: Vec<f32> =
                    uniforms(s ^ rows as u64, 4, rows * state_dim).iter().map(|v| v * obs_scale * 1.5).collect();
                let obs = Tensor::from_slice(&host, (rows, state_dim), &dev).unwrap();
                let (acts, vals) = policy.greedy_with_values(&obs, true).unwrap();
                let acts = acts.to_vec1::<u32>().unwrap();
                let vals = vals.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (r, row) in host.chunks_exact(state_dim).enumerate() {
                    let (want, want_a) = reference_scores(&q, row).unwrap();
                    let got = &vals[r * n_actions..(r + 1) * n_actions];
                    let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "seed {s} {kind:?} {method} keep {keep:?} batch {rows} row {r}: {got:?} vs {want:?}");
                    assert_eq!(acts[r] as usize, want_a, "seed {s} batch {rows} row {r}");
                }
            }
        }
    }

    /// The host-in, action-out decider over an INT8 policy, through the service trait:
    /// the reference's action and scores, one at a time and in a batch, and a NaN refused in
    /// one line.
    #[test]
    fn the_decider_serves_int8_decisions_through_decide() {
        let dev = cuda();
        let s = seed();
        let net = random_net(PolicyKind::Dqn, 56, &[256, 256, 128], 3, s);
        let q = crate::quantize(&net, &uniforms(s, 1, 256 * 56), CalibMethod::Dynamic, &[]).unwrap();
        let mut d: Box<dyn Decide> = Box::new(MlpDecider::new(q.cuda_policy(&dev).unwrap(), 4).unwrap());
        assert_eq!((d.state_dim(), d.n_actions()), (56, 3));
        for row in uniforms(s, 2, 20 * 56).chunks_exact(56) {
            let (want, want_a) = reference_scores(&q, row).unwrap();
            assert_eq!(d.act(row).unwrap(), want_a, "seed {s}");
            assert_eq!(d.scores(), &want[..], "seed {s}");
        }
        // A batch through the trait (ten rows: calls of four, four and two) decides each
        // row as the reference.
        let obs = uniforms(s, 3, 10 * 56);
        let mut acts = vec![usize::MAX; 10];
        d.act_batch(&obs, &mut acts).unwrap();
        for (r, row) in obs.chunks_exact(56).enumerate() {
            assert_eq!(acts[r], reference_scores(&q, row).unwrap().1, "seed {s} row {r}");
        }
        assert!(d.act_batch(&obs[..55], &mut acts[..1]).is_err());
        let mut bad = vec![0.1f32; 56];
        bad[9] = f32::NAN;
        let e = d.act(&bad).unwrap_err().to_string();
        assert!(e.contains("NaN at index 9") && !e.contains('\n'), "{e}");
        // An INT8 policy has neither a cluster kernel nor a resident server.
        let mut p = q.cuda_policy(&dev).unwrap();
        assert!(p.is_int8() && !p.has_cluster_kernel());
        assert!(p.set_kernel(fx_models::mlp::cuda::MlpKernel::Cluster).is_err());
        assert!(fx_models::mlp::cuda::MlpServer::new(&p).is_err());
    }

    /// Timing printout (ignored; `--ignored --nocapture timing`): back-to-back launches of
    /// the INT8 kernel on the default DQN and PPO shapes. The benchmark is `fx-train bench`.
    #[test]
    #[ignore = "timing printout; run with --ignored --nocapture on a GPU"]
    fn timing_int8_kernel_launches() {
        let dev = cuda();
        for (kind, hidden) in [(PolicyKind::Dqn, vec![256, 256, 128]), (PolicyKind::Ppo, vec![256, 256])] {
            let net = random_net(kind, 56, &hidden, 3, 5);
            let q = crate::quantize(&net, &uniforms(1, 2, 512 * 56), CalibMethod::Dynamic, &[]).unwrap();
            let policy = q.cuda_policy(&dev).unwrap();
            for rows in [1usize, 256, 8192] {
                let host = uniforms(3, 4, rows * 56);
                let obs = Tensor::from_slice(&host, (rows, 56), &dev).unwrap();
                let out = Tensor::zeros(rows, DType::U32, &dev).unwrap();
                let bound = policy.bind(&obs, &out, None).unwrap();
                for _ in 0..20 {
                    bound.launch().unwrap();
                }
                dev.synchronize().unwrap();
                let t = std::time::Instant::now();
                for _ in 0..200 {
                    bound.launch().unwrap();
                }
                dev.synchronize().unwrap();
                let us = t.elapsed().as_secs_f64() * 1e6 / 200.0;
                println!(
                    "{kind:?} int8 batch {rows}: {us:.2} us a launch back to back ({:.0} rows/s)",
                    rows as f64 / us * 1e6
                );
            }
        }
    }
}
