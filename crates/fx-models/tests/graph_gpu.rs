//! Captured-graph updates on a CUDA device (feature `cuda`; each test returns early without
//! a GPU): a DQN run with `graph = on` and one with `graph = off` from the same seed take
//! the same 200 updates, a non-finite batch included (skipped by both); a checkpoint
//! written mid-run by the graph trainer resumes, in graph or eager mode, to the
//! uninterrupted run's weights; the PPO minibatch update likewise, its short last
//! minibatch included (run eagerly through the same fused step).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use fx_models::{DqnBatch, DqnConfig, DqnTrainer, PpoBatch, PpoConfig, PpoTrainer};
use fx_precision::GraphMode;

fn gpu() -> Option<Device> {
    match std::panic::catch_unwind(|| Device::new_cuda(0)) {
        Ok(Ok(d)) => Some(d),
        _ => {
            eprintln!("skipped: no CUDA device");
            None
        }
    }
}

/// Deterministic pseudo-random values in [-1, 1) (`salt`, `k` pick the stream).
fn vals(n: usize, salt: u64, k: u64) -> Vec<f32> {
    (0..n as u64).map(|i| (fx_kernels::rng::draw(salt, 7, k, i) * 2.0 - 1.0) as f32).collect()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let n = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    let d = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    if n.is_finite() {
        n / d.max(1e-30)
    } else {
        f64::INFINITY
    }
}

struct DqnData(Vec<Tensor>);

fn dqn_batch(dev: &Device, b: usize, k: u64, poison: bool) -> DqnData {
    let mut r = vals(b, 2, k);
    if poison {
        r[3] = f32::NAN;
    }
    let a: Vec<u32> = vals(b, 3, k).iter().map(|u| ((u + 1.0) * 1.5) as u32 % 3).collect();
    let d: Vec<f32> = vals(b, 4, k).iter().map(|&u| if u > 0.9 { 1.0 } else { 0.0 }).collect();
    DqnData(vec![
        Tensor::from_vec(vals(b * 56, 1, k), (b, 56), dev).unwrap(),
        Tensor::from_vec(a, b, dev).unwrap(),
        Tensor::from_vec(r, b, dev).unwrap(),
        Tensor::from_vec(vals(b * 56, 5, k), (b, 56), dev).unwrap(),
        Tensor::from_vec(d, b, dev).unwrap(),
    ])
}

impl DqnData {
    fn batch(&self) -> DqnBatch<'_> {
        let t = &self.0;
        DqnBatch { obs: &t[0], actions: &t[1], rewards: &t[2], next_obs: &t[3], dones: &t[4] }
    }
}

fn dqn_cfg(graph: GraphMode) -> DqnConfig {
    dqn_cfg_p(graph, fx_precision::Precision::F32)
}

fn dqn_cfg_p(graph: GraphMode, precision: fx_precision::Precision) -> DqnConfig {
    DqnConfig {
        precision,
        batch_size: 64,
        replay_capacity: 8,
        learning_starts: 1,
        graph,
        seed: 5,
        optimizer: fx_precision::AdamWConfig { lr: 1e-3, ..DqnConfig::default().optimizer },
        ..Default::default()
    }
}

fn max_param_err(a: &DqnTrainer, b: &DqnTrainer) -> f64 {
    let pa = a.online().params().vars().iter().chain(a.target().params().vars());
    let pb = b.online().params().vars().iter().chain(b.target().params().vars());
    pa.zip(pb).map(|(x, y)| rel(x.as_tensor(), y.as_tensor())).fold(0.0, f64::max)
}

/// BF16: the candle update captured as a graph (the fused update is F32-only).
#[test]
fn dqn_bf16_graph_equals_eager() {
    let Some(dev) = gpu() else { return };
    let p = fx_precision::Precision::Bf16;
    let mut eager = DqnTrainer::new(dqn_cfg_p(GraphMode::Off, p), &dev).unwrap();
    let mut graph = DqnTrainer::new(dqn_cfg_p(GraphMode::On, p), &dev).unwrap();
    for k in 0..60u64 {
        let data = dqn_batch(&dev, 64, k, k == 20);
        let se = eager.update(data.batch()).unwrap();
        let sg = graph.update(data.batch()).unwrap();
        assert_eq!(se.skipped, sg.skipped, "update {k}");
    }
    let err = max_param_err(&eager, &graph);
    eprintln!("dqn bf16 graph vs eager after 60 updates: max relative weight error {err:.3e}");
    assert!(err <= 1e-4, "bf16 graph vs eager: {err}");
}

/// F32: the fused update (~30 launches) captured as a graph, against candle's eager update.
#[test]
fn dqn_graph_equals_eager_and_resumes() {
    let Some(dev) = gpu() else { return };
    let mut eager = DqnTrainer::new(dqn_cfg(GraphMode::Off), &dev).unwrap();
    let mut graph = DqnTrainer::new(dqn_cfg(GraphMode::On), &dev).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("mid.safetensors");
    let n = 200u64;
    for k in 0..n {
        let data = dqn_batch(&dev, 64, k, k == 50);
        let se = eager.update(data.batch()).unwrap();
        let sg = graph.update(data.batch()).unwrap();
        assert_eq!(se.skipped, sg.skipped, "update {k}");
        assert_eq!(se.skipped, k == 50, "update {k}");
        if !se.skipped {
            assert!(
                (se.loss - sg.loss).abs() <= 1e-4 * se.loss.abs().max(1e-3),
                "update {k}: loss {} vs {}",
                se.loss,
                sg.loss
            );
        }
        if k == n / 2 {
            graph.save_state(&ckpt).unwrap();
        }
    }
    assert_eq!((eager.updates(), eager.skipped_updates()), (graph.updates(), graph.skipped_updates()));
    assert_eq!(graph.skipped_updates(), 1);
    let err = max_param_err(&eager, &graph);
    eprintln!("dqn graph vs eager after {n} updates: max relative weight error {err:.3e}");
    assert!(err <= 1e-5, "graph vs eager: {err}");
    // Resume the mid-run checkpoint in both modes and replay the rest of the batches.
    for mode in [GraphMode::On, GraphMode::Off] {
        let mut r = DqnTrainer::load_state(&ckpt, &dev).unwrap();
        r.set_graph_mode(mode);
        for k in n / 2 + 1..n {
            r.update(dqn_batch(&dev, 64, k, false).batch()).unwrap();
        }
        let e = max_param_err(&r, &graph);
        eprintln!("dqn resumed from a graph checkpoint in graph mode {mode}: max relative error {e:.3e}");
        assert!(e <= 1e-5, "resume: {e}");
    }
}

fn ppo_batch(dev: &Device, b: usize, k: u64) -> Vec<Tensor> {
    let a: Vec<u32> = vals(b, 13, k).iter().map(|u| ((u + 1.0) * 1.5) as u32 % 3).collect();
    let lp: Vec<f32> = vals(b, 14, k).iter().map(|u| (1.0f32 / 3.0).ln() + 0.1 * u).collect();
    vec![
        Tensor::from_vec(vals(b * 56, 11, k), (b, 56), dev).unwrap(),
        Tensor::from_vec(a, b, dev).unwrap(),
        Tensor::from_vec(lp, b, dev).unwrap(),
        Tensor::from_vec(vals(b, 15, k), b, dev).unwrap(),
        Tensor::from_vec(vals(b, 16, k), b, dev).unwrap(),
    ]
}

#[test]
fn ppo_graph_equals_eager() {
    let Some(dev) = gpu() else { return };
    let cfg = |graph| PpoConfig { minibatch_size: 128, num_steps: 1, graph, seed: 3, ..Default::default() };
    let mut eager = PpoTrainer::new(cfg(GraphMode::Off), 1, &dev).unwrap();
    let mut graph = PpoTrainer::new(cfg(GraphMode::On), 1, &dev).unwrap();
    for k in 0..100u64 {
        // Every fifth minibatch is short, as an epoch's last chunk can be.
        let b = if k % 5 == 4 { 37 } else { 128 };
        let t = ppo_batch(&dev, b, k);
        let batch = PpoBatch { obs: &t[0], actions: &t[1], logp_old: &t[2], advantages: &t[3], returns: &t[4] };
        let se = eager.update_minibatch(batch).unwrap();
        let sg = graph.update_minibatch(batch).unwrap();
        assert_eq!(se.skipped, sg.skipped, "update {k}");
        for (x, y, what) in
            [(se.loss, sg.loss, "loss"), (se.approx_kl, sg.approx_kl, "approx_kl"), (se.entropy, sg.entropy, "entropy")]
        {
            assert!((x - y).abs() <= 1e-4 * x.abs().max(1e-3), "update {k}: {what} {x} vs {y}");
        }
    }
    let err = eager
        .model()
        .params()
        .vars()
        .iter()
        .zip(graph.model().params().vars())
        .map(|(a, b)| rel(a.as_tensor(), b.as_tensor()))
        .fold(0.0, f64::max);
    eprintln!("ppo graph vs eager after 100 updates: max relative weight error {err:.3e}");
    assert!(err <= 1e-5, "graph vs eager: {err}");
    assert_eq!(eager.updates(), graph.updates());
}
