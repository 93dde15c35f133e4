//! Captured-graph updates on a CUDA device (feature `cuda`; each test returns early without
//! a GPU): the replayed DQN graph equals the same update run without the graph over 200
//! updates with a non-finite batch (skipped by both), and a checkpoint written mid-run
//! resumes to the same result (and loads eagerly); the fused F32 and BF16 updates track
//! candle's eager ones; the PPO minibatch update likewise, its short last minibatch
//! included (run eagerly through the same fused step); the captured TFT and MAMBA-2 steps
//! track their eager ones; DQN steps that read nothing back train as reading ones.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use fx_models::{DqnBatch, DqnConfig, DqnTrainer, PpoBatch, PpoConfig, PpoTrainer};
use fx_precision::GraphMode;

fn gpu() -> Option<Device> {
    fx_hw::test_gpu("graph_gpu")
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
        ..Default::default()
    }
}

fn max_param_err(a: &DqnTrainer, b: &DqnTrainer) -> f64 {
    let pa = a.online().params().vars().into_iter().chain(a.target().params().vars());
    let pb = b.online().params().vars().into_iter().chain(b.target().params().vars());
    pa.zip(pb).map(|(x, y)| rel(x.as_tensor(), y.as_tensor())).fold(0.0, f64::max)
}

/// BF16: the fused update with BF16 GEMMs against candle's eager BF16 update. They round
/// at different places (candle also rounds each layer's output to BF16), so this bounds the
/// drift; the gradients are checked against the F32 reference in `dqn::fused`'s unit test.
#[test]
fn dqn_bf16_graph_tracks_eager() {
    let Some(dev) = gpu() else { return };
    let p = fx_precision::Precision::Bf16;
    let mut eager = DqnTrainer::new(dqn_cfg_p(GraphMode::Off, p), &dev).unwrap();
    let mut graph = DqnTrainer::new(dqn_cfg_p(GraphMode::On, p), &dev).unwrap();
    let mut worst = 0.0f64;
    for k in 0..60u64 {
        let data = dqn_batch(&dev, 64, k, k == 20);
        let se = eager.update(data.batch()).unwrap();
        let sg = graph.update(data.batch()).unwrap();
        assert_eq!(se.skipped, sg.skipped, "update {k}");
        if !se.skipped {
            worst = worst.max((se.loss - sg.loss).abs() / se.loss.abs().max(1e-3));
        }
    }
    let err = max_param_err(&eager, &graph);
    eprintln!("dqn bf16 graph vs eager after 60 updates: worst loss rel diff {worst:.3e}, max relative weight error {err:.3e}");
    assert!(worst <= 5e-2 && err <= 5e-2, "bf16 graph vs eager: loss {worst}, weights {err}");
}

/// The captured graph against the same update run without the graph, 200 updates from one
/// seed with a non-finite batch at update 50: same skips, weights, target and optimiser
/// state within 1e-6. A checkpoint written mid-run resumes in graph mode to the same
/// result, and loads into an eager trainer with the same state.
#[test]
fn dqn_graph_replay_equals_uncaptured_and_resumes() {
    let Some(dev) = gpu() else { return };
    let mut replayed = DqnTrainer::new(dqn_cfg(GraphMode::On), &dev).unwrap();
    let mut direct = DqnTrainer::new(dqn_cfg(GraphMode::On), &dev).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("mid.safetensors");
    let n = 200u64;
    let mut at_ckpt = Vec::new();
    for k in 0..n {
        let data = dqn_batch(&dev, 64, k, k == 50);
        let a = replayed.update(data.batch()).unwrap();
        assert!(direct.graph_ready(data.batch()).unwrap());
        let b = direct.update_uncaptured(data.batch()).unwrap();
        assert_eq!((a.skipped, k == 50), (b.skipped, k == 50), "update {k}");
        assert!(
            a.skipped || (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs().max(1e-3),
            "update {k}: {} vs {}",
            a.loss,
            b.loss
        );
        if k == n / 2 {
            replayed.save_state(&ckpt).unwrap();
            at_ckpt = replayed.online().params().vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect();
        }
    }
    assert_eq!((replayed.updates(), replayed.skipped_updates()), (direct.updates(), direct.skipped_updates()));
    assert_eq!(replayed.skipped_updates(), 1);
    let err = max_param_err(&replayed, &direct);
    eprintln!("dqn graph replay vs uncaptured after {n} updates: max relative weight error {err:.3e}");
    assert!(err <= 1e-6, "replay vs uncaptured: {err}");
    let mut resumed = DqnTrainer::load_state(&ckpt, &dev).unwrap();
    for k in n / 2 + 1..n {
        resumed.update(dqn_batch(&dev, 64, k, false).batch()).unwrap();
    }
    let e = max_param_err(&resumed, &replayed);
    eprintln!("dqn resumed (graph) from a mid-run graph checkpoint: max relative error {e:.3e}");
    assert!(e <= 1e-6, "resume: {e}");
    let mut eager = DqnTrainer::load_state(&ckpt, &dev).unwrap();
    eager.set_graph_mode(GraphMode::Off);
    for (v, w) in eager.online().params().vars().iter().zip(&at_ckpt) {
        assert_eq!(rel(v.as_tensor(), w), 0.0, "the checkpoint's weights load exactly");
    }
    // Updates 0..=100 with one skipped: 100 applied when the checkpoint was written.
    assert_eq!((eager.updates(), eager.skipped_updates()), (100, 1), "the graph run's counters carry over");
    let st = eager.update(dqn_batch(&dev, 64, n / 2 + 1, false).batch()).unwrap();
    assert!(!st.skipped && st.loss.is_finite());
    assert_eq!(eager.updates(), 101);
}

/// The fused F32 update (graph) against candle's eager update from one seed. They run their
/// GEMMs in other orders, and double DQN's argmax and the ReLU gates turn last-bit
/// differences into discrete ones after enough steps, so this bounds the first 100 updates;
/// the gradients agree to ~1e-7 (`dqn::fused`'s unit test).
#[test]
fn dqn_fused_graph_tracks_candle_eager() {
    let Some(dev) = gpu() else { return };
    let mut eager = DqnTrainer::new(dqn_cfg(GraphMode::Off), &dev).unwrap();
    let mut graph = DqnTrainer::new(dqn_cfg(GraphMode::On), &dev).unwrap();
    let mut worst = 0.0f64;
    for k in 0..100u64 {
        let data = dqn_batch(&dev, 64, k, k == 50);
        let se = eager.update(data.batch()).unwrap();
        let sg = graph.update(data.batch()).unwrap();
        assert_eq!(se.skipped, sg.skipped, "update {k}");
        if !se.skipped {
            worst = worst.max((se.loss - sg.loss).abs() / se.loss.abs().max(1e-3));
        }
    }
    let err = max_param_err(&eager, &graph);
    eprintln!("dqn fused graph vs candle eager after 100 updates: worst loss rel diff {worst:.3e}, max relative weight error {err:.3e}");
    assert!(worst <= 1e-4 && err <= 1e-4, "loss {worst}, weights {err}");
    assert_eq!((eager.updates(), eager.skipped_updates()), (graph.updates(), graph.skipped_updates()));
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

/// Small TFT (dropout 0.1) and MAMBA-2 configs and a series to train them on.
mod seq {
    use super::*;
    use fx_models::seq::{Mamba2Task, SeqSeries, SeqTask, SeqTrainConfig, SeqTrainer};
    use fx_models::{Mamba2, Mamba2Config, Tft, TftConfig};

    pub fn series(rows: usize, n_obs: usize) -> SeqSeries {
        let obs = vals(rows * n_obs, 11, 0);
        let known = vals(rows * 4, 12, 0);
        let target: Vec<f32> = vals(rows, 13, 0).iter().map(|v| 0.05 * v).collect();
        SeqSeries::new(obs, n_obs, known, 4, target).unwrap()
    }

    pub fn tft_cfg() -> TftConfig {
        TftConfig { n_observed: 5, d: 16, n_head: 2, l_enc: 12, h: 3, dropout: 0.1, ..TftConfig::default() }
    }

    pub fn mamba_cfg() -> Mamba2Config {
        Mamba2Config {
            n_in: 5,
            d_model: 16,
            n_layer: 2,
            expand: 2,
            d_state: 8,
            headdim: 8,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 8,
            norm_eps: 1e-5,
        }
    }

    /// Trains two epochs with `graph` and returns the weights (spec names) and the log.
    pub fn run(
        task: &impl SeqTask,
        series: &SeqSeries,
        graph: GraphMode,
        precision: fx_precision::Precision,
    ) -> (std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>) {
        let cfg = SeqTrainConfig { epochs: 2, batch_size: 16, lr: 3e-3, graph, precision, ..Default::default() };
        let mut t = SeqTrainer::new(task, 0..300, &cfg).unwrap();
        let mut losses = Vec::new();
        while !t.is_done() {
            losses.push(t.train_epoch(task, series, 300..380).unwrap().train_loss);
        }
        let nodes = t.graph_nodes().unwrap();
        (task.params().to_map().unwrap(), losses, nodes)
    }

    /// The largest weight difference of `b` from `a` relative to `a` (per tensor), skipping
    /// the attention keys' biases (see `compare`), and its tensor.
    pub fn worst(
        a: &(std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>),
        b: &(std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>),
    ) -> (f64, String) {
        let mut worst = (0.0f64, String::new());
        for (k, x) in &a.0 {
            if k.starts_with("attn.k.") && k.ends_with(".bias") {
                continue;
            }
            let e = rel(&b.0[k], x);
            if e > worst.0 {
                worst = (e, k.clone());
            }
        }
        worst
    }

    pub fn compare(
        name: &str,
        eager: &(std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>),
        graph: &(std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>),
        tol: f64,
    ) {
        assert!(eager.2.is_none() && graph.2.is_some(), "{name}: graph mode must capture, eager must not");
        // The TFT attention keys' biases get an analytically zero gradient (a softmax
        // ignores a constant added to all its scores): Adam turns each side's rounding noise
        // into lr-sized steps, so `worst` leaves them out.
        let worst = worst(eager, graph);
        eprintln!(
            "{name}: {} graph nodes, train losses eager {:?} graph {:?}, worst weight rel err {:.2e} ({})",
            graph.2.unwrap(),
            eager.1,
            graph.1,
            worst.0,
            worst.1
        );
        assert!(worst.0 <= tol, "{name}: {} differs by {:.2e}", worst.1, worst.0);
        for (a, b) in eager.1.iter().zip(&graph.1) {
            assert!((a - b).abs() <= tol * a.abs().max(1e-3), "{name}: train loss {a} vs {b}");
        }
    }

    pub fn tft(dev: &Device) -> Tft {
        Tft::new(tft_cfg(), dev, 4).unwrap()
    }

    pub fn mamba(dev: &Device) -> Mamba2 {
        Mamba2::new(mamba_cfg(), dev, 4).unwrap()
    }

    pub fn mamba_task(m: &Mamba2) -> Mamba2Task<'_> {
        Mamba2Task { model: m, seq_len: 16 }
    }
}

/// The captured TFT / MAMBA-2 step (the models' fused forward + backward with
/// counter-based dropout, fused clip + AdamW) trains as the eager candle step does over two
/// epochs: same dropout masks on every replay's step (a frozen mask would diverge within a
/// few steps), weights within F32 rounding of candle's autograd and AdamW.
#[test]
fn seq_graph_step_tracks_eager() {
    let Some(dev) = gpu() else { return };
    let series = seq::series(400, 5);
    let f32p = fx_precision::Precision::F32;
    let (a, b) = (seq::tft(&dev), seq::tft(&dev));
    let eager = seq::run(&a, &series, GraphMode::Off, f32p);
    let graph = seq::run(&b, &series, GraphMode::On, f32p);
    seq::compare("tft f32", &eager, &graph, 1e-4);
    let (a, b) = (seq::mamba(&dev), seq::mamba(&dev));
    let eager = seq::run(&seq::mamba_task(&a), &series, GraphMode::Off, f32p);
    let graph = seq::run(&seq::mamba_task(&b), &series, GraphMode::On, f32p);
    seq::compare("mamba2 f32", &eager, &graph, 1e-4);
    // BF16: the fused step rounds elsewhere than candle's autocast (F32 GEMM outputs, where
    // candle rounds its backward products to BF16), so the two BF16 runs are compared with
    // the F32 run instead: the fused one must stay as close to it as candle's does.
    let bf16 = fx_precision::Precision::Bf16;
    let (a, b, c) = (seq::tft(&dev), seq::tft(&dev), seq::tft(&dev));
    let reference = seq::run(&c, &series, GraphMode::Off, f32p);
    let eager = seq::run(&a, &series, GraphMode::Off, bf16);
    let graph = seq::run(&b, &series, GraphMode::On, bf16);
    assert!(eager.2.is_none() && graph.2.is_some(), "tft bf16: graph mode must capture, eager must not");
    let (e_candle, e_fused) = (seq::worst(&reference, &eager), seq::worst(&reference, &graph));
    eprintln!("tft bf16 against the F32 run: candle's step {e_candle:?}, the fused step {e_fused:?}");
    assert!(e_fused.0 <= 2.0 * e_candle.0 + 1e-3, "tft bf16: fused {e_fused:?} vs candle {e_candle:?}");
    for (a, b) in reference.1.iter().zip(&graph.1) {
        assert!((a - b).abs() <= 2e-2 * a.abs().max(1e-3), "tft bf16: train loss {b} vs F32 {a}");
    }
}

/// Panel models on the GPU: a TFT built for 2 instruments (its static context trains
/// through candle's captured step: the fused kernels refuse it) and a MAMBA-2 with the
/// instrument embedding in its input (its fused step, `n_in` = features + instruments)
/// train in the captured graph as eagerly, windows drawn per instrument.
#[test]
fn panel_seq_graph_step_tracks_eager() {
    use fx_models::seq::{Mamba2Task, SeqTrainConfig, SeqTrainer, Spans};
    let Some(dev) = gpu() else { return };
    let ids: Vec<u32> = (0..400).map(|r| u32::from(r >= 200)).collect();
    let series = seq::series(400, 5).with_instruments(ids, 2).unwrap();
    fn train(
        task: &impl fx_models::seq::SeqTask,
        series: &fx_models::seq::SeqSeries,
        graph: GraphMode,
    ) -> (std::collections::BTreeMap<String, Tensor>, Vec<f64>, Option<usize>) {
        let f32p = fx_precision::Precision::F32;
        let cfg = SeqTrainConfig { epochs: 2, batch_size: 16, lr: 3e-3, graph, precision: f32p, ..Default::default() };
        let mut t = SeqTrainer::new(task, Spans::new(vec![0..150, 200..350]), &cfg).unwrap();
        let mut losses = Vec::new();
        while !t.is_done() {
            let val = Spans::new(vec![150..200, 350..400]);
            losses.push(t.train_epoch(task, series, val).unwrap().train_loss);
        }
        (task.params().to_map().unwrap(), losses, t.graph_nodes().unwrap())
    }
    let tft = || fx_models::Tft::new(fx_models::TftConfig { n_instruments: 2, ..seq::tft_cfg() }, &dev, 4).unwrap();
    let (a, b) = (tft(), tft());
    assert!(a.params().get("static_embed.weight").is_some());
    seq::compare("panel tft f32", &train(&a, &series, GraphMode::Off), &train(&b, &series, GraphMode::On), 1e-4);
    let mamba =
        || fx_models::Mamba2::new(fx_models::Mamba2Config { n_in: 5 + 2, ..seq::mamba_cfg() }, &dev, 4).unwrap();
    let (a, b) = (mamba(), mamba());
    let (ta, tb) = (Mamba2Task { model: &a, seq_len: 16 }, Mamba2Task { model: &b, seq_len: 16 });
    seq::compare("panel mamba2 f32", &train(&ta, &series, GraphMode::Off), &train(&tb, &series, GraphMode::On), 1e-4);
}

/// DQN steps on the GPU environment that read nothing back (`step_with(.., false)`: the
/// captured updates only queued) train exactly as steps that read everything, over 120 env
/// steps with a read every 40: same weights and, once synced, the same counters. Run one
/// after the other (each samples with the same keyed draws).
#[test]
fn dqn_quiet_steps_equal_reading_steps() {
    use std::sync::Arc;
    let Some(dev) = gpu() else { return };
    let t_len = 2000;
    let market: Vec<f32> = vals(t_len * fx_kernels::N_MARKET, 9, 1);
    let close: Vec<f64> = (0..t_len).map(|i| 1.0 + 0.1 * (i as f64 * 0.01).sin()).collect();
    let data = Arc::new(fx_kernels::EnvData::new(market, close).unwrap());
    let env_cfg = fx_kernels::EnvConfig { num_envs: 64, episode_len: 128, ..Default::default() };
    let run = |every: u64| -> (Vec<Vec<f32>>, (u64, u64)) {
        let mut env =
            fx_kernels::GpuTradingEnv::new(data.clone(), env_cfg.clone(), &dev, fx_kernels::GpuEnvOptions::default())
                .unwrap();
        let cfg = DqnConfig {
            batch_size: 128,
            replay_capacity: 4096,
            learning_starts: 256,
            graph: GraphMode::On,
            seed: 3,
            ..Default::default()
        };
        let mut tr = DqnTrainer::new(cfg, &dev).unwrap();
        for i in 1..=120u64 {
            let s = tr.step_with(&mut env, i % every == 0).unwrap();
            assert_eq!(s.mean_reward.is_some(), i % every == 0);
        }
        tr.sync_counters().unwrap();
        let w = tr
            .online()
            .params()
            .vars()
            .iter()
            .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (w, (tr.updates(), tr.skipped_updates()))
    };
    let (w_loud, c_loud) = run(1);
    let (w_quiet, c_quiet) = run(40);
    assert!(c_loud.0 > 100, "the test must run updates: {c_loud:?}");
    assert_eq!(c_loud, c_quiet);
    assert_eq!(w_loud, w_quiet, "quiet steps changed the training");
}

/// Whole DQN iterations as one graph each (`dqn::iteration`) train exactly as the same
/// steps launched kernel by kernel: 120 GPU-env steps with update rounds of two minibatches
/// every second step (so both the collection-only and the training iteration run), the
/// replay ring wrapping and ε ramping, reading every 40th step: same weights, counters,
/// replay and env state. A checkpoint written after 60 iteration-graph steps resumes (the
/// env restored from its state) to the same weights as the uninterrupted run.
#[test]
fn dqn_iteration_graph_equals_stepwise() {
    use std::sync::Arc;
    let Some(dev) = gpu() else { return };
    let t_len = 2000;
    let market: Vec<f32> = vals(t_len * fx_kernels::N_MARKET, 9, 2);
    let close: Vec<f64> = (0..t_len).map(|i| 1.0 + 0.1 * (i as f64 * 0.013).sin()).collect();
    let data = Arc::new(fx_kernels::EnvData::new(market, close).unwrap());
    let env_cfg = fx_kernels::EnvConfig { num_envs: 64, episode_len: 100, ..Default::default() };
    let new_env = || {
        fx_kernels::GpuTradingEnv::new(data.clone(), env_cfg.clone(), &dev, fx_kernels::GpuEnvOptions::default())
            .unwrap()
    };
    let cfg = DqnConfig {
        batch_size: 96,
        replay_capacity: 1000,
        learning_starts: 256,
        train_every: 2,
        gradient_steps: 2,
        epsilon: fx_models::LinearSchedule { start: 1.0, end: 0.1, steps: 80 },
        graph: GraphMode::On,
        seed: 11,
        ..Default::default()
    };
    let weights = |tr: &DqnTrainer| -> Vec<Vec<f32>> {
        tr.online().params().vars().iter().map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect()
    };
    let steps = |tr: &mut DqnTrainer, env: &mut fx_kernels::GpuTradingEnv, range: std::ops::RangeInclusive<u64>| {
        for i in range {
            tr.step_with(env, i % 40 == 0).unwrap();
        }
        tr.sync_counters().unwrap();
    };
    let run = |iterations: bool| {
        let mut env = new_env();
        let mut tr = DqnTrainer::new(cfg.clone(), &dev).unwrap();
        tr.set_iteration_graphs(iterations);
        steps(&mut tr, &mut env, 1..=120);
        assert_eq!(tr.iteration_graph_active(), iterations);
        let counters = (tr.env_steps(), tr.updates(), tr.skipped_updates(), tr.replay().len(), tr.replay().position());
        (weights(&tr), counters, fx_kernels::VecEnv::counters(&env).unwrap(), env.state().unwrap())
    };
    let graph = run(true);
    let stepwise = run(false);
    assert!(graph.1 .1 > 60, "the test must run updates: {:?}", graph.1);
    assert_eq!(graph.1, stepwise.1, "counters");
    assert_eq!(graph.2, stepwise.2, "env counters");
    assert_eq!(graph.3, stepwise.3, "env state");
    assert_eq!(graph.0, stepwise.0, "iteration graphs changed the training");

    let dir = std::env::temp_dir().join(format!("fx-dqn-iteration-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.safetensors");
    let mut env = new_env();
    let mut tr = DqnTrainer::new(cfg.clone(), &dev).unwrap();
    steps(&mut tr, &mut env, 1..=60);
    assert!(tr.iteration_graph_active());
    tr.save_state(&path).unwrap();
    let env_state = env.state().unwrap();
    drop((tr, env));
    let mut env = new_env();
    env.restore(&env_state).unwrap();
    let mut tr = DqnTrainer::load_state(&path, &dev).unwrap();
    steps(&mut tr, &mut env, 61..=120);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(weights(&tr), graph.0, "resumed run differs from the uninterrupted one");
}

/// Whole PPO rollouts as one graph each (`ppo::rollout`) collect exactly what the stepwise
/// rollout collects, and the queued minibatch updates (statistics summed on the device,
/// read once per iteration) train identically in both: three iterations, same weights,
/// env state and iteration statistics. Against candle's eager updates (graph off, the
/// statistics read after every minibatch) the first iteration's statistics agree to the
/// fused kernels' rounding.
#[test]
fn ppo_rollout_graph_equals_stepwise() {
    use std::sync::Arc;
    let Some(dev) = gpu() else { return };
    let t_len = 2000;
    let market: Vec<f32> = vals(t_len * fx_kernels::N_MARKET, 9, 3);
    let close: Vec<f64> = (0..t_len).map(|i| 1.0 + 0.1 * (i as f64 * 0.017).sin()).collect();
    let data = Arc::new(fx_kernels::EnvData::new(market, close).unwrap());
    let e = 32;
    let env_cfg = fx_kernels::EnvConfig { num_envs: e, episode_len: 60, ..Default::default() };
    let cfg = |graph| PpoConfig { num_steps: 24, epochs: 3, minibatch_size: 100, graph, seed: 4, ..Default::default() };
    let run = |graph: GraphMode, rollout_graphs: bool, iterations: usize| {
        let mut env =
            fx_kernels::GpuTradingEnv::new(data.clone(), env_cfg.clone(), &dev, fx_kernels::GpuEnvOptions::default())
                .unwrap();
        let mut tr = PpoTrainer::new(cfg(graph), e, &dev).unwrap();
        tr.set_rollout_graphs(rollout_graphs);
        let stats: Vec<_> = (0..iterations).map(|_| tr.iterate(&mut env).unwrap()).collect();
        assert_eq!(tr.rollout_graph_active(), rollout_graphs && graph != GraphMode::Off);
        let w: Vec<Vec<f32>> = tr
            .model()
            .params()
            .vars()
            .iter()
            .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (w, stats, env.state().unwrap(), (tr.updates(), tr.skipped_updates(), tr.env_steps()))
    };
    let graph = run(GraphMode::On, true, 3);
    let stepwise = run(GraphMode::On, false, 3);
    assert_eq!(graph.3, stepwise.3, "counters");
    assert_eq!(graph.3 .0, 3 * 3 * 8, "3 iterations x 3 epochs x 8 minibatches (768 rows / 100)");
    assert_eq!(graph.2, stepwise.2, "env state");
    assert_eq!(graph.0, stepwise.0, "rollout graphs changed the training");
    for (a, b) in graph.1.iter().zip(&stepwise.1) {
        assert_eq!(format!("{a:?}"), format!("{b:?}"), "iteration statistics");
        for v in [a.mean.loss, a.mean.approx_kl, a.mean.entropy, a.mean.grad_norm, a.explained_variance, a.mean_reward]
        {
            assert!(v.is_finite(), "{a:?}");
        }
    }
    let eager = run(GraphMode::Off, true, 1);
    let (q, r) = (&graph.1[0], &eager.1[0]);
    let close = |x: f64, y: f64, tol: f64| (x - y).abs() <= tol * y.abs().max(1e-3);
    assert_eq!((q.mean_reward, q.episodes_done), (r.mean_reward, r.episodes_done), "same rollout");
    assert!(close(q.explained_variance, r.explained_variance, 1e-6), "{q:?} vs {r:?}");
    assert!(close(q.mean.loss, r.mean.loss, 1e-3), "loss: {q:?} vs {r:?}");
    assert!(close(q.mean.entropy, r.mean.entropy, 1e-4), "entropy: {q:?} vs {r:?}");
    assert!(close(q.mean.grad_norm, r.mean.grad_norm, 1e-3), "grad norm: {q:?} vs {r:?}");
    assert!((q.mean.approx_kl - r.mean.approx_kl).abs() <= 1e-5 + 1e-2 * r.mean.approx_kl.abs(), "{q:?} vs {r:?}");
    assert!((q.mean.clip_frac - r.mean.clip_frac).abs() <= 0.01, "{q:?} vs {r:?}");
}

/// A PPO iteration's epochs × minibatch updates as one graph against the same updates
/// replayed minibatch by minibatch: the same kernels in the same order on the same
/// permutations, so the weights, counters and statistics are bit-identical (with a short
/// last chunk, which runs candle's update inside the graph, and without one).
#[test]
fn ppo_epochs_graph_equals_per_minibatch_replays() {
    use std::sync::Arc;
    let Some(dev) = gpu() else { return };
    let t_len = 2000;
    let market: Vec<f32> = vals(t_len * fx_kernels::N_MARKET, 11, 3);
    let close: Vec<f64> = (0..t_len).map(|i| 1.0 + 0.1 * (i as f64 * 0.013).cos()).collect();
    let data = Arc::new(fx_kernels::EnvData::new(market, close).unwrap());
    let e = 32;
    let env_cfg = fx_kernels::EnvConfig { num_envs: e, episode_len: 60, ..Default::default() };
    for mb in [100, 128] {
        let cfg = PpoConfig {
            num_steps: 24,
            epochs: 3,
            minibatch_size: mb,
            graph: GraphMode::On,
            seed: 5,
            ..Default::default()
        };
        let run = |epochs_graph: bool| {
            let mut env = fx_kernels::GpuTradingEnv::new(
                data.clone(),
                env_cfg.clone(),
                &dev,
                fx_kernels::GpuEnvOptions::default(),
            )
            .unwrap();
            let mut tr = PpoTrainer::new(cfg.clone(), e, &dev).unwrap();
            tr.set_epoch_graphs(epochs_graph);
            let stats: Vec<_> = (0..3).map(|_| tr.iterate(&mut env).unwrap()).collect();
            assert_eq!(tr.epochs_graph_active(), epochs_graph, "minibatch {mb}");
            let w: Vec<Vec<f32>> = tr
                .model()
                .params()
                .vars()
                .iter()
                .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
                .collect();
            (w, stats, (tr.updates(), tr.skipped_updates(), tr.env_steps()))
        };
        let whole = run(true);
        let replays = run(false);
        assert_eq!(whole.2, replays.2, "counters (minibatch {mb})");
        assert_eq!(whole.0, replays.0, "weights (minibatch {mb})");
        for (a, b) in whole.1.iter().zip(&replays.1) {
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "iteration statistics (minibatch {mb})");
            assert!(a.mean.loss.is_finite() && a.mean.grad_norm.is_finite(), "{a:?}");
        }
    }
}
