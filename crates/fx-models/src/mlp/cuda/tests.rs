//! Device tests of the fused greedy policies against the f64 reference. Each test returns
//! early with a printed note when no CUDA device can be opened (except the limit checks,
//! which fail before any device is touched).

use candle_core::{DType, Device, Tensor, Var};

use super::{MlpDecider, MlpKernel, MlpPolicy, MlpServer};
use crate::mlp::reference::{reference_greedy, Activation, GreedyMlp, Head, Linear, MAX_WIDTH};
use fx_hw::test_gpu as gpu;
use fx_kernels::rng;
use fx_kernels::Error;

/// `n` uniforms in [-scale, scale) from stream `(seed, salt)`.
fn uniform(n: usize, scale: f64, seed: u64, salt: u64) -> Vec<f32> {
    (0..n as u64).map(|i| ((rng::draw(seed, 11, salt, i) * 2.0 - 1.0) * scale) as f32).collect()
}

/// A network's parameters, PyTorch-initialised (U(±1/√in)), and its head kind.
struct Net {
    layers: Vec<(Tensor, Tensor)>,
    acts: Vec<Activation>,
    dueling: bool,
}

impl Net {
    /// Hidden widths `widths[0] → widths[1] → ...` (widths[0] = input), then the head.
    fn new(dev: &Device, widths: &[usize], act: Activation, n_actions: usize, dueling: bool, seed: u64) -> Self {
        let last = *widths.last().unwrap();
        let mut shapes: Vec<(usize, usize)> = widths.windows(2).map(|w| (w[1], w[0])).collect();
        if dueling {
            shapes.push((1, last));
        }
        shapes.push((n_actions, last));
        let layers = shapes
            .iter()
            .enumerate()
            .map(|(i, &(o, inp))| {
                let s = 1.0 / (inp as f64).sqrt();
                let w = Tensor::from_vec(uniform(o * inp, s, seed, 2 * i as u64), (o, inp), dev).unwrap();
                let b = Tensor::from_vec(uniform(o, s, seed, 2 * i as u64 + 1), o, dev).unwrap();
                (w, b)
            })
            .collect();
        Self { layers, acts: vec![act; widths.len() - 1], dueling }
    }

    fn with<R>(&self, f: impl FnOnce(&GreedyMlp<'_>) -> R) -> R {
        fn lin(p: &(Tensor, Tensor)) -> Linear<'_> {
            Linear { weight: &p.0, bias: &p.1 }
        }
        let nh = self.acts.len();
        let hidden: Vec<_> = self.layers[..nh].iter().zip(&self.acts).map(|(p, &a)| (lin(p), a)).collect();
        let head = if self.dueling {
            Head::Dueling { value: lin(&self.layers[nh]), advantage: lin(&self.layers[nh + 1]) }
        } else {
            Head::Logits(lin(&self.layers[nh]))
        };
        f(&GreedyMlp { hidden: &hidden, head })
    }

    fn policy(&self) -> MlpPolicy {
        self.with(MlpPolicy::new).expect("policy")
    }
}

/// `policy` once per kernel the device runs (the cluster kernel from compute capability 9.0).
fn each_kernel(policy: &MlpPolicy) -> Vec<MlpPolicy> {
    let mut out = Vec::new();
    for k in [MlpKernel::BlockPerRow, MlpKernel::Cluster] {
        let mut p = policy.clone();
        if p.set_kernel(k).is_ok() {
            out.push(p);
        }
    }
    if !policy.has_cluster_kernel() {
        println!("note: no cluster kernel on this device; only the block-per-row kernel was checked");
    }
    out
}

fn obs(dev: &Device, b: usize, s: usize, seed: u64) -> Tensor {
    Tensor::from_vec(uniform(b * s, 2.0, seed, 99), (b, s), dev).unwrap()
}

/// Scores within 1e-4 (norm-wise relative) of the reference, actions equal except on
/// near-ties of the reference's top two scores.
fn check_against_reference(net: &Net, policy: &MlpPolicy, x: &Tensor, what: &str) {
    let a = policy.dims().n_actions;
    let (actions, values) = policy.greedy_with_values(x, true).expect("greedy");
    let got_q: Vec<f32> = values.unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let got_a: Vec<u32> = actions.to_vec1().unwrap();
    let (want_q, want_a) = net.with(|n| reference_greedy(n, x)).expect("reference");
    let num: f64 = got_q.iter().zip(&want_q).map(|(g, w)| (*g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let den: f64 = want_q.iter().map(|w| w * w).sum::<f64>().sqrt().max(1e-30);
    assert!(num / den <= 1e-4, "{what}: scores rel err {:e}", num / den);
    for (r, (g, w)) in got_a.iter().zip(&want_a).enumerate() {
        if g != w {
            let mut row = want_q[r * a..(r + 1) * a].to_vec();
            row.sort_by(|x, y| y.total_cmp(x));
            assert!(
                row[0] - row[1] <= 1e-5 * (1.0 + row[0].abs()),
                "{what}: row {r}: action {g} vs reference {w} ({row:?})"
            );
        }
    }
}

const BATCHES: [usize; 4] = [1, 3, 256, 1000];

#[test]
fn dqn_default_dims_match_reference() {
    let Some(dev) = gpu("dqn_default_dims_match_reference") else { return };
    let net = Net::new(&dev, &[56, 256, 256, 128], Activation::Relu, 3, true, 1);
    for policy in each_kernel(&net.policy()) {
        for b in BATCHES {
            let what = format!("dqn {:?} B={b}", policy.kernel());
            check_against_reference(&net, &policy, &obs(&dev, b, 56, b as u64), &what);
        }
    }
}

#[test]
fn ppo_actor_default_dims_match_reference() {
    let Some(dev) = gpu("ppo_actor_default_dims_match_reference") else { return };
    let net = Net::new(&dev, &[56, 256, 256], Activation::Tanh, 3, false, 2);
    for policy in each_kernel(&net.policy()) {
        for b in BATCHES {
            let what = format!("ppo {:?} B={b}", policy.kernel());
            check_against_reference(&net, &policy, &obs(&dev, b, 56, b as u64), &what);
        }
    }
}

/// h = 64 with 5 actions; odd widths (scalar row reads); the widest and deepest allowed.
#[test]
fn non_default_dims_match_reference() {
    let Some(dev) = gpu("non_default_dims_match_reference") else { return };
    let cases: [(&[usize], Activation, usize, bool); 5] = [
        (&[56, 64, 64, 32], Activation::Relu, 5, true),
        (&[56, 64, 64], Activation::Tanh, 5, false),
        (&[55, 37, 19], Activation::Relu, 7, true),
        (&[MAX_WIDTH, MAX_WIDTH, 8, 1024, 3], Activation::Tanh, 16, false),
        (&[6], Activation::Identity, 2, true),
    ];
    for (i, (widths, act, a, dueling)) in cases.into_iter().enumerate() {
        let net = Net::new(&dev, widths, act, a, dueling, 10 + i as u64);
        for policy in each_kernel(&net.policy()) {
            for b in BATCHES {
                let what = format!("{widths:?} {:?} B={b}", policy.kernel());
                check_against_reference(&net, &policy, &obs(&dev, b, widths[0], b as u64), &what);
            }
        }
    }
}

/// A weight view at an odd element offset cannot be read as float4: the kernel must take
/// the scalar path for that layer and still agree.
#[test]
fn unaligned_weight_views_match_reference() {
    let Some(dev) = gpu("unaligned_weight_views_match_reference") else { return };
    let mut net = Net::new(&dev, &[56, 64, 32], Activation::Relu, 3, true, 20);
    let w = net.layers[1].0.clone();
    let padded = Tensor::cat(&[Tensor::zeros(1, DType::F32, &dev).unwrap(), w.flatten_all().unwrap()], 0).unwrap();
    net.layers[1].0 = padded.narrow(0, 1, 64 * 32).unwrap().reshape((32, 64)).unwrap();
    assert_eq!(net.layers[1].0.layout().start_offset(), 1);
    for policy in each_kernel(&net.policy()) {
        for b in BATCHES {
            let what = format!("unaligned {:?} B={b}", policy.kernel());
            check_against_reference(&net, &policy, &obs(&dev, b, 56, b as u64), &what);
        }
    }
}

/// Outputs poisoned first: every action and score must be overwritten, also past the
/// launch's grid (grid-stride rows beyond 65,535).
#[test]
fn every_row_is_written() {
    let Some(dev) = gpu("every_row_is_written") else { return };
    let net = Net::new(&dev, &[56, 16, 16], Activation::Relu, 3, true, 30);
    for (policy, b) in each_kernel(&net.policy()).iter().flat_map(|p| [(p, 1), (p, 1000), (p, 70_000)]) {
        let x = obs(&dev, b, 56, 7);
        let actions = Tensor::full(u32::MAX, b, &dev).unwrap();
        let values = Tensor::full(f32::NAN, (b, 3), &dev).unwrap();
        policy.greedy_into(&x, &actions, Some(&values)).expect("greedy_into");
        let a: Vec<u32> = actions.to_vec1().unwrap();
        assert!(a.iter().all(|&a| a < 3), "{:?} B={b}: an action was not written", policy.kernel());
        let v: Vec<f32> = values.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|v| v.is_finite()), "{:?} B={b}: a score was not written", policy.kernel());
        // Without values the actions are the same.
        let again = policy.greedy(&x).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(again, a, "B={b}");
    }
}

/// Beyond the limits the policy is refused with `Unsupported` (before any device work, so
/// this runs on the CPU too); CPU tensors within the limits are a device error.
#[test]
fn configs_beyond_the_limits_are_refused() {
    let cpu = Device::Cpu;
    let too_wide = Net::new(&cpu, &[8, MAX_WIDTH + 1], Activation::Relu, 3, true, 40);
    let err = too_wide.with(MlpPolicy::new).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let too_many_actions = Net::new(&cpu, &[8, 8], Activation::Relu, 17, false, 41);
    assert!(matches!(too_many_actions.with(MlpPolicy::new).unwrap_err(), Error::Unsupported { .. }));
    let too_deep = Net::new(&cpu, &[8, 8, 8, 8, 8, 8], Activation::Tanh, 3, false, 42);
    assert!(matches!(too_deep.with(MlpPolicy::new).unwrap_err(), Error::Unsupported { .. }));
    let on_cpu = Net::new(&cpu, &[8, 8], Activation::Tanh, 3, false, 43);
    assert!(matches!(on_cpu.with(MlpPolicy::new).unwrap_err(), Error::Device { .. }));
}

/// Bad inputs are errors naming the argument, never a panic or a launch.
#[test]
fn bad_inputs_are_errors() {
    let Some(dev) = gpu("bad_inputs_are_errors") else { return };
    let net = Net::new(&dev, &[56, 32], Activation::Relu, 3, false, 50);
    let policy = net.policy();
    let e = policy.greedy(&obs(&dev, 2, 55, 1)).unwrap_err().to_string();
    assert!(e.contains("obs"), "{e}");
    let e = policy.greedy(&obs(&dev, 2, 56, 1).to_device(&Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(e.contains("obs") && e.contains("device"), "{e}");
    let x = obs(&dev, 2, 56, 1);
    let e = policy.greedy_into(&x, &Tensor::zeros(2, DType::U8, &dev).unwrap(), None).unwrap_err().to_string();
    assert!(e.contains("actions"), "{e}");
    let strided = Tensor::zeros((2, 2), DType::U32, &dev).unwrap().narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    assert!(policy.greedy_into(&x, &strided, None).is_err());
    assert_eq!(policy.greedy(&obs(&dev, 0, 56, 1)).unwrap().dims(), [0]);
    let mut d = MlpDecider::new(policy.clone(), 4).unwrap();
    assert!(d.act(&[0.0; 55]).is_err());
    assert!(d.act_batch(&[0.0; 56 * 5], &mut [0; 5]).is_err());
    assert!(d.act_batch(&[], &mut []).is_err());
    assert!(MlpDecider::new(policy, 0).is_err());
}

/// A bound launch decides as `greedy_into` does, also after its observation buffer is
/// rewritten in place (the decision loop's use), with both kernels; bad buffers are refused.
#[test]
fn bound_launch_matches_greedy_into() {
    let Some(dev) = gpu("bound_launch_matches_greedy_into") else { return };
    let net = Net::new(&dev, &[56, 256, 256, 128], Activation::Relu, 3, true, 65);
    for policy in each_kernel(&net.policy()) {
        for rows in [1usize, 5] {
            let x = Var::from_tensor(&obs(&dev, rows, 56, 1)).unwrap();
            let (actions, values) =
                (Tensor::full(u32::MAX, rows, &dev).unwrap(), Tensor::full(f32::NAN, (rows, 3), &dev).unwrap());
            let bound = policy.bind(x.as_tensor(), &actions, Some(&values)).unwrap();
            for k in 0..4u64 {
                x.set(&obs(&dev, rows, 56, 500 + k)).unwrap();
                bound.launch().unwrap();
                let (want_a, want_v) = policy.greedy_with_values(x.as_tensor(), true).unwrap();
                let what = format!("{:?} rows {rows} k {k}", policy.kernel());
                assert_eq!(actions.to_vec1::<u32>().unwrap(), want_a.to_vec1::<u32>().unwrap(), "{what}");
                let (got, want): (Vec<f32>, Vec<f32>) = (
                    values.flatten_all().unwrap().to_vec1().unwrap(),
                    want_v.unwrap().flatten_all().unwrap().to_vec1().unwrap(),
                );
                assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{what}");
            }
        }
        let x = obs(&dev, 2, 56, 1);
        assert!(policy.bind(&x, &Tensor::zeros(3, DType::U32, &dev).unwrap(), None).is_err());
        assert!(policy.bind(&obs(&dev, 2, 55, 1), &Tensor::zeros(2, DType::U32, &dev).unwrap(), None).is_err());
        assert!(policy.bind(&obs(&dev, 0, 56, 1), &Tensor::zeros(0, DType::U32, &dev).unwrap(), None).is_err());
    }
}

/// The host path agrees with the device path for single rows and batches, call after call
/// (the buffers are reused).
#[test]
fn decider_matches_policy() {
    let Some(dev) = gpu("decider_matches_policy") else { return };
    let net = Net::new(&dev, &[56, 256, 256, 128], Activation::Relu, 3, true, 60);
    let policy = net.policy();
    let mut d = MlpDecider::new(policy.clone(), 64).unwrap();
    for (k, rows) in [1usize, 1, 7, 64, 1, 33].into_iter().enumerate() {
        let x = obs(&dev, rows, 56, 100 + k as u64);
        let want: Vec<u32> = policy.greedy(&x).unwrap().to_vec1().unwrap();
        let host: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let mut got = vec![u32::MAX; rows];
        d.act_batch(&host, &mut got).unwrap();
        assert_eq!(got, want, "rows {rows}");
        assert_eq!(d.act(&host[..56]).unwrap(), want[0]);
    }
}

/// Updates through `Var::set` (in place, as the optimisers do) are seen by a policy built
/// before them.
#[test]
fn policy_sees_in_place_weight_updates() {
    let Some(dev) = gpu("policy_sees_in_place_weight_updates") else { return };
    let mut net = Net::new(&dev, &[56, 64, 32], Activation::Tanh, 4, false, 70);
    let vars: Vec<(Var, Var)> =
        net.layers.iter().map(|(w, b)| (Var::from_tensor(w).unwrap(), Var::from_tensor(b).unwrap())).collect();
    net.layers = vars.iter().map(|(w, b)| (w.as_tensor().clone(), b.as_tensor().clone())).collect();
    let policies = each_kernel(&net.policy());
    let x = obs(&dev, 300, 56, 3);
    for policy in &policies {
        check_against_reference(&net, policy, &x, "before the update");
    }
    let other = Net::new(&dev, &[56, 64, 32], Activation::Tanh, 4, false, 71);
    for ((w, b), (nw, nb)) in vars.iter().zip(&other.layers) {
        w.set(nw).unwrap();
        b.set(nb).unwrap();
    }
    for policy in &policies {
        check_against_reference(&net, policy, &x, "after the update");
        check_against_reference(&other, policy, &x, "after the update, against the new weights");
    }
}

/// Both kernels sum every neuron in the same order (a lane strides along the row, then the
/// same shuffle tree), so their scores agree bit for bit, whatever the batch; `Auto` takes
/// the cluster kernel exactly up to CLUSTER_MAX_ROWS rows where the device has it.
#[test]
fn cluster_and_block_kernels_agree_bitwise() {
    let Some(dev) = gpu("cluster_and_block_kernels_agree_bitwise") else { return };
    let cases: [(&[usize], Activation, usize, bool); 4] = [
        (&[56, 256, 256, 128], Activation::Relu, 3, true),
        (&[56, 256, 256], Activation::Tanh, 3, false),
        (&[55, 37, 19], Activation::Relu, 7, true),
        (&[6], Activation::Identity, 2, true),
    ];
    for (i, (widths, act, a, dueling)) in cases.into_iter().enumerate() {
        let net = Net::new(&dev, widths, act, a, dueling, 200 + i as u64);
        let policy = net.policy();
        assert_eq!(
            policy.kernel_for(1),
            if policy.has_cluster_kernel() { MlpKernel::Cluster } else { MlpKernel::BlockPerRow }
        );
        assert_eq!(policy.kernel_for(super::CLUSTER_MAX_ROWS + 1), MlpKernel::BlockPerRow);
        let kernels = each_kernel(&policy);
        for b in [1, 2, 16, 17, 300] {
            let x = obs(&dev, b, widths[0], 300 + b as u64);
            let runs: Vec<(Vec<u32>, Vec<f32>)> = kernels
                .iter()
                .map(|p| {
                    let (act, val) = p.greedy_with_values(&x, true).unwrap();
                    (act.to_vec1().unwrap(), val.unwrap().flatten_all().unwrap().to_vec1().unwrap())
                })
                .collect();
            for r in &runs[1..] {
                assert_eq!(r.0, runs[0].0, "{widths:?} B={b}: actions differ between kernels");
                let same = r.1.iter().zip(&runs[0].1).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{widths:?} B={b}: scores differ between kernels");
            }
        }
    }
}

/// The greedy actions of `net`'s f64 reference for the rows of `x`.
fn reference_actions(net: &Net, x: &Tensor) -> Vec<u32> {
    net.with(|n| reference_greedy(n, x)).expect("reference").1
}

/// The resident server decides as the launched kernel does, request after request (DQN and
/// PPO-actor shapes), agrees with the f64 reference off near-ties, refuses bad input and
/// refuses to answer once stopped.
#[test]
#[ignore = "a resident kernel: run alone (`server --ignored --test-threads=1`), see MlpServer's docs"]
fn server_matches_policy() {
    let Some(dev) = gpu("server_matches_policy") else { return };
    let cases: [(&[usize], Activation, usize, bool, u64); 2] =
        [(&[56, 256, 256, 128], Activation::Relu, 3, true, 80), (&[56, 256, 256], Activation::Tanh, 3, false, 81)];
    for (widths, act, na, dueling, seed) in cases {
        let net = Net::new(&dev, widths, act, na, dueling, seed);
        for policy in each_kernel(&net.policy()) {
            let mut server = MlpServer::new(&policy).unwrap();
            assert_eq!(server.kernel(), policy.kernel_for(1));
            let x = obs(&dev, 300, 56, seed + 1);
            let want: Vec<u32> = policy.greedy(&x).unwrap().to_vec1().unwrap();
            let reference = reference_actions(&net, &x);
            let host: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let mut same_as_reference = 0;
            for (r, row) in host.chunks_exact(56).enumerate() {
                let a = server.act(row).unwrap();
                assert_eq!(a, want[r], "{widths:?} row {r}: server vs launched kernel");
                same_as_reference += usize::from(a == reference[r]);
            }
            assert!(same_as_reference >= 297, "{widths:?}: {same_as_reference}/300 equal to the f64 reference");
            assert!(server.act(&host[..55]).is_err(), "a short observation must be refused");
            server.stop().unwrap();
            assert!(server.act(&host[..56]).is_err(), "a stopped server must refuse");
        }
    }
}

/// A server serves the weights of its start: an in-place update made while it runs does not
/// reach it, and a server started after it does. (The second server starts only after the
/// first stopped: starting one allocates page-locked memory, which waits for every running
/// kernel, a resident one included; see MlpServer's docs.)
#[test]
#[ignore = "a resident kernel: run alone (`server --ignored --test-threads=1`), see MlpServer's docs"]
fn server_serves_its_snapshot() {
    let Some(dev) = gpu("server_serves_its_snapshot") else { return };
    let mut net = Net::new(&dev, &[56, 64, 32], Activation::Tanh, 4, false, 90);
    let vars: Vec<(Var, Var)> =
        net.layers.iter().map(|(w, b)| (Var::from_tensor(w).unwrap(), Var::from_tensor(b).unwrap())).collect();
    net.layers = vars.iter().map(|(w, b)| (w.as_tensor().clone(), b.as_tensor().clone())).collect();
    let policy = net.policy();
    let x = obs(&dev, 200, 56, 5);
    let host: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let before: Vec<u32> = policy.greedy(&x).unwrap().to_vec1().unwrap();
    let mut old = MlpServer::new(&policy).unwrap();
    let other = Net::new(&dev, &[56, 64, 32], Activation::Tanh, 4, false, 91);
    for ((w, b), (nw, nb)) in vars.iter().zip(&other.layers) {
        w.set(nw).unwrap();
        b.set(nb).unwrap();
    }
    let after: Vec<u32> = policy.greedy(&x).unwrap().to_vec1().unwrap();
    assert_ne!(before, after, "the update must change some actions for the test to mean anything");
    for (r, row) in host.chunks_exact(56).enumerate() {
        assert_eq!(old.act(row).unwrap(), before[r], "row {r}: the running server changed weights");
    }
    old.stop().unwrap();
    let mut new = MlpServer::new(&policy).unwrap();
    for (r, row) in host.chunks_exact(56).enumerate() {
        assert_eq!(new.act(row).unwrap(), after[r], "row {r}: the new server missed the update");
    }
}
