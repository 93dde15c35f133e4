//! Device tests: the CUDA kernels against the CPU reference. Each test returns early with a
//! printed note when no CUDA device can be opened.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::gpu_env::synthetic_series;
use super::{bench_env_steps, gae_device, EnvBenchMode, GpuEnvOptions, GpuTradingEnv};
use crate::env::{CpuTradingEnv, EnvConfig, EnvData, N_ACTIONS, OBS_DIM};
use crate::gae::{gae, GaeConfig};
use crate::replay::ReplayBuffer;
use crate::rng;
use crate::rollout::Rollout;
use crate::vec_env::VecEnv;

pub(crate) use fx_hw::test_gpu as gpu;

fn host_f32(t: &Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|x| x.to_dtype(DType::F32)).and_then(|x| x.to_vec1::<f32>()).expect("to host")
}

fn host_u32(t: &Tensor) -> Vec<u32> {
    t.flatten_all().and_then(|x| x.to_vec1::<u32>()).expect("to host")
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} is not finite");
        assert!((g - w).abs() <= tol, "{what}[{i}]: gpu {g} vs cpu {w}");
    }
}

fn random_actions(e: usize, k: u64, salt: u64) -> Vec<u32> {
    (0..e as u64).map(|i| ((rng::draw(salt, 5, i, k) * 3.0) as u32).min(2)).collect()
}

fn pair(dev: &Device, data: &Arc<EnvData>, cfg: &EnvConfig) -> (CpuTradingEnv, GpuTradingEnv) {
    let cpu = CpuTradingEnv::new(data.clone(), cfg.clone()).expect("cpu env");
    let gpu = GpuTradingEnv::new(data.clone(), cfg.clone(), dev, GpuEnvOptions::default()).expect("gpu env");
    (cpu, gpu)
}

fn assert_same_state(cpu: &CpuTradingEnv, gpu: &GpuTradingEnv, what: &str) {
    let st = gpu.state_host().expect("state");
    let t: Vec<u32> = cpu.times().iter().map(|&t| t as u32).collect();
    let p: Vec<i32> = cpu.positions().iter().map(|&p| p as i32).collect();
    assert_eq!(st.t, t, "{what}: t");
    assert_eq!(st.pos, p, "{what}: positions");
    assert_eq!(st.counter, cpu.step_counters(), "{what}: counters");
}

#[test]
fn trajectories_match_cpu_reference() {
    let Some(dev) = gpu("trajectories_match_cpu_reference") else { return };
    let data = Arc::new(synthetic_series(3000, 99).expect("data"));
    let cases: [(usize, u64, u64, usize); 4] =
        [(1, 5, 0, 200), (7, (1 << 63) + 12345, 3, 150), (4096, 20240601, 0, 80), (65536, 42, 1 << 20, 40)];
    for (e, seed, offset, steps) in cases {
        let cfg = EnvConfig { num_envs: e, episode_len: 24, cost: 1e-4, seed, env_offset: offset };
        let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
        assert_close(&host_f32(&gpu.observe().expect("obs")), &cpu.observe_host(), 1e-6, "initial obs");
        let mut dones = 0usize;
        for k in 0..steps {
            let a = random_actions(e, k as u64, seed);
            let at = Tensor::from_vec(a.clone(), e, &dev).expect("actions");
            let g = gpu.step(&at).expect("gpu step");
            let c = cpu.step_host(&a).expect("cpu step");
            let what = format!("E={e} step {k}");
            assert_close(&host_f32(&g.next_obs), &c.next_obs, 1e-6, &format!("{what} next_obs"));
            assert_close(&host_f32(&g.obs), &c.obs, 1e-6, &format!("{what} obs"));
            assert_close(&host_f32(&g.reward), &c.reward, 1e-6, &format!("{what} reward"));
            assert_eq!(host_f32(&g.done), c.done, "{what} done");
            assert_same_state(&cpu, &gpu, &what);
            dones += c.done.iter().filter(|&&d| d == 1.0).count();
        }
        assert_eq!(dones, e * (steps / 24), "E={e}: auto-resets");
        gpu.check_errors().expect("no flagged actions");
    }
}

/// A panel's series: `lens` synthetic instruments one after another.
fn segmented_series(lens: &[usize], seed: u64) -> Arc<EnvData> {
    let parts: Vec<EnvData> =
        lens.iter().enumerate().map(|(k, &n)| synthetic_series(n, seed + k as u64).expect("data")).collect();
    let market = parts.iter().flat_map(|p| p.rows().market().to_vec()).collect();
    let close = parts.iter().flat_map(|p| p.close().to_vec()).collect();
    Arc::new(EnvData::from_segments(market, close, lens).expect("segments"))
}

#[test]
fn segmented_trajectories_match_cpu_reference() {
    let Some(dev) = gpu("segmented_trajectories_match_cpu_reference") else { return };
    // Segments of unequal lengths, one barely longer than an episode.
    let data = segmented_series(&[400, 25, 900, 131], 17);
    for (e, seed, steps) in [(5usize, 3u64, 120usize), (4099, 20240601, 60)] {
        let cfg = EnvConfig { num_envs: e, episode_len: 24, cost: 1e-4, seed, env_offset: 7 };
        let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
        assert_same_state(&cpu, &gpu, "initial");
        for k in 0..steps {
            let a = random_actions(e, k as u64, seed);
            let at = Tensor::from_vec(a.clone(), e, &dev).expect("actions");
            let g = gpu.step(&at).expect("gpu step");
            let c = cpu.step_host(&a).expect("cpu step");
            let what = format!("segmented E={e} step {k}");
            assert_close(&host_f32(&g.next_obs), &c.next_obs, 1e-6, &format!("{what} next_obs"));
            assert_close(&host_f32(&g.obs), &c.obs, 1e-6, &format!("{what} obs"));
            assert_close(&host_f32(&g.reward), &c.reward, 1e-6, &format!("{what} reward"));
            assert_eq!(host_f32(&g.done), c.done, "{what} done");
            assert_same_state(&cpu, &gpu, &what);
        }
        gpu.check_errors().expect("no flagged actions");
    }
    // The PPO experience kernel resets through the same code.
    let cfg = EnvConfig { num_envs: 65, episode_len: 5, cost: 1e-4, seed: 99, env_offset: 0 };
    let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
    let mut rc = Rollout::new(16, 65, &Device::Cpu).expect("rollout");
    let mut rg = Rollout::new(16, 65, &dev).expect("rollout");
    for k in 0..16u64 {
        let l: Vec<f32> = (0..65 * N_ACTIONS).map(|i| 4.0 * rng::draw(8, 1, i as u64, k) as f32 - 2.0).collect();
        let lc = Tensor::from_vec(l, (65, N_ACTIONS), &Device::Cpu).expect("l");
        let vc = Tensor::zeros(65, DType::F32, &Device::Cpu).expect("v");
        cpu.step_into_rollout(&lc, &vc, &mut rc).expect("cpu");
        gpu.step_into_rollout(&lc.to_device(&dev).expect("l"), &vc.to_device(&dev).expect("v"), &mut rg).expect("gpu");
        assert_same_state(&cpu, &gpu, &format!("segmented ppo step {k}"));
    }
    assert_close(&host_f32(rg.states()), &host_f32(rc.states()), 1e-6, "segmented ppo states");
}

/// Envs of one `Arc<EnvData>` on one device read one device copy of the series; each keeps
/// its own accounts, and each still steps as its CPU twin. A copy of the same bars in
/// another allocation, or another device handle, gets its own upload; the shared copy
/// outlives the env that uploaded it.
#[test]
fn envs_of_one_series_share_its_device_copy() {
    let Some(dev) = gpu("envs_of_one_series_share_its_device_copy") else { return };
    let data = segmented_series(&[700, 300], 5);
    let twin = Arc::new(
        EnvData::from_segments(data.rows().market().to_vec(), data.close().to_vec(), &[700, 300]).expect("twin"),
    );
    let cfg = |seed: u64| EnvConfig { num_envs: 33, episode_len: 24, cost: 1e-4, seed, env_offset: 0 };
    let (mut c1, mut g1) = pair(&dev, &data, &cfg(1));
    let (mut c2, mut g2) = pair(&dev, &data, &cfg(2));
    let (mut c3, mut g3) = pair(&dev, &twin, &cfg(3));
    assert_eq!(g1.series_address(), g2.series_address(), "one Arc, one device: one copy");
    assert_ne!(g1.series_address(), g3.series_address(), "another allocation of the same bars: its own copy");
    let other = gpu("envs_of_one_series_share_its_device_copy (second handle)").expect("second device handle");
    let g4 = GpuTradingEnv::new(data.clone(), cfg(4), &other, GpuEnvOptions::default()).expect("env");
    assert_ne!(g1.series_address(), g4.series_address(), "another device handle: its own copy");
    let step = |cpu: &mut CpuTradingEnv, gpu: &mut GpuTradingEnv, k: u64, what: &str| {
        let a = random_actions(33, k, 77);
        let g = gpu.step(&Tensor::from_vec(a.clone(), 33, &dev).expect("actions")).expect("gpu step");
        let c = cpu.step_host(&a).expect("cpu step");
        assert_close(&host_f32(&g.next_obs), &c.next_obs, 1e-6, &format!("{what} step {k} next_obs"));
        assert_close(&host_f32(&g.reward), &c.reward, 1e-6, &format!("{what} step {k} reward"));
        assert_same_state(cpu, gpu, &format!("{what} step {k}"));
    };
    for k in 0..60 {
        step(&mut c1, &mut g1, k, "env 1");
        step(&mut c2, &mut g2, k, "env 2");
        step(&mut c3, &mut g3, k, "env 3");
    }
    // The uploader goes; the copy stays for the env still holding it and for new ones.
    let shared = g1.series_address();
    drop(g1);
    let (mut c5, mut g5) = pair(&dev, &data, &cfg(5));
    assert_eq!(g5.series_address(), shared, "a new env of the same Arc joins the live copy");
    for k in 60..100 {
        step(&mut c2, &mut g2, k, "env 2 after env 1 dropped");
        step(&mut c5, &mut g5, k, "env 5");
    }
    for g in [&mut g2, &mut g3, &mut g5] {
        g.check_errors().expect("no flagged actions");
    }
}

/// Walk-forward folds as views of one raw series: each fold its own segments and
/// normalisers, all reading one device copy of the rows. Every kernel that writes
/// observations (observe, step, the DQN experience into a replay, PPO's experience into a
/// rollout, the population's observe and collection) normalises them as the CPU env does,
/// bit for bit, on fresh random rows.
#[test]
fn fold_views_share_one_copy_and_match_the_cpu() {
    let Some(dev) = gpu("fold_views_share_one_copy_and_match_the_cpu") else { return };
    let seed = fx_hw::test_seed("fold_views_share_one_copy_and_match_the_cpu");
    let (rows, segs, norms) = crate::env::tests::shared_rows(&[300, 420, 260, 90], seed);
    // Fold 0 as drawn; fold 1 a later, shorter span of three instruments with its own fits.
    let fold1: Vec<std::ops::Range<usize>> = segs[1..].iter().map(|s| s.start + 20..s.end).collect();
    let norms1: Vec<fx_data::Normalizer> = fold1
        .iter()
        .map(|s| fx_data::Normalizer::fit_rows(rows.market(), crate::N_MARKET, s.start..s.start + 30).expect("fit"))
        .collect();
    let views = [
        Arc::new(EnvData::view(rows.clone(), segs.clone(), &norms).expect("fold 0")),
        Arc::new(EnvData::view(rows.clone(), fold1, &norms1).expect("fold 1")),
    ];
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let e = 45;
    let cfg = |k: u64| EnvConfig { num_envs: e, episode_len: 12, cost: 1e-4, seed: seed ^ k, env_offset: k };
    let (mut c0, mut g0) = pair(&dev, &views[0], &cfg(0));
    let (mut c1, mut g1) = pair(&dev, &views[1], &cfg(1));
    assert_eq!(g0.series_address(), g1.series_address(), "two folds of one rows: one device copy");
    let (mut rc, mut rg) = (ReplayBuffer::new(200, &Device::Cpu).expect("r"), ReplayBuffer::new(200, &dev).expect("r"));
    for k in 0..30u64 {
        let what = format!("seed {seed} step {k}");
        assert_eq!(bits(host_f32(&g0.observe().expect("obs"))), bits(c0.observe_host()), "{what}: fold 0 observe");
        let a = random_actions(e, k, seed);
        let g = g0.step(&Tensor::from_vec(a.clone(), e, &dev).expect("a")).expect("gpu step");
        let c = c0.step_host(&a).expect("cpu step");
        assert_eq!(bits(host_f32(&g.next_obs)), bits(c.next_obs), "{what}: fold 0 next_obs");
        assert_eq!(bits(host_f32(&g.obs)), bits(c.obs), "{what}: fold 0 obs");
        assert_same_state(&c0, &g0, &what);
        let q: Vec<f32> = (0..e * N_ACTIONS).map(|i| rng::draw(seed, 7, i as u64, k) as f32).collect();
        let qc = Tensor::from_vec(q, (e, N_ACTIONS), &Device::Cpu).expect("q");
        let ac = c1.epsilon_greedy(&qc, 0.4).expect("eg");
        let c = c1.step_into_replay(&ac, &mut rc).expect("cpu");
        let (ag, obs) = g1.collect_dqn(&qc.to_device(&dev).expect("q"), 0.4, &mut rg).expect("gpu");
        assert_eq!(host_u32(&ag), host_u32(&ac), "{what}: fold 1 actions");
        assert_eq!(bits(host_f32(&obs)), bits(host_f32(&c.obs)), "{what}: fold 1 obs");
        assert_same_state(&c1, &g1, &what);
    }
    // A view of one segment inside the rows resets inside it (no instrument draw).
    let one = Arc::new(EnvData::view(rows.clone(), vec![segs[1].clone()], &norms[1..2]).expect("one segment"));
    let (mut c2, mut g2) = pair(&dev, &one, &cfg(3));
    for k in 0..40u64 {
        let what = format!("seed {seed} one-segment step {k}");
        let a = random_actions(e, k, seed ^ 3);
        let g = g2.step(&Tensor::from_vec(a.clone(), e, &dev).expect("a")).expect("gpu step");
        let c = c2.step_host(&a).expect("cpu step");
        assert_eq!(bits(host_f32(&g.obs)), bits(c.obs), "{what}: obs");
        assert_same_state(&c2, &g2, &what);
        assert!(c2.times().iter().all(|t| segs[1].contains(t)), "{what}: left the segment");
    }
    let (sc, sg) = (rc.stored().expect("stored"), rg.stored().expect("stored"));
    assert_eq!(bits(host_f32(&sg.states)), bits(host_f32(&sc.states)), "fold 1 replay s");
    assert_eq!(bits(host_f32(&sg.next_states)), bits(host_f32(&sc.next_states)), "fold 1 replay s2");
    // PPO's experience kernel.
    let (mut cp, mut gp) = pair(&dev, &views[1], &cfg(2));
    let mut roc = Rollout::new(16, e, &Device::Cpu).expect("rollout");
    let mut rog = Rollout::new(16, e, &dev).expect("rollout");
    for k in 0..16u64 {
        let l: Vec<f32> = (0..e * N_ACTIONS).map(|i| 4.0 * rng::draw(seed, 1, i as u64, k) as f32 - 2.0).collect();
        let lc = Tensor::from_vec(l, (e, N_ACTIONS), &Device::Cpu).expect("l");
        let vc = Tensor::zeros(e, DType::F32, &Device::Cpu).expect("v");
        cp.step_into_rollout(&lc, &vc, &mut roc).expect("cpu");
        gp.step_into_rollout(&lc.to_device(&dev).expect("l"), &vc.to_device(&dev).expect("v"), &mut rog).expect("gpu");
    }
    assert_eq!(bits(host_f32(rog.states())), bits(host_f32(roc.states())), "ppo rollout states");
    // The population's kernels: one member per fold.
    let pop: Vec<GpuTradingEnv> = (0..2)
        .map(|k| GpuTradingEnv::new(views[k].clone(), cfg(10 + k as u64), &dev, GpuEnvOptions::default()).expect("env"))
        .collect();
    let mut cpu: Vec<CpuTradingEnv> =
        (0..2).map(|k| CpuTradingEnv::new(views[k].clone(), cfg(10 + k as u64)).expect("env")).collect();
    let refs: Vec<&GpuTradingEnv> = pop.iter().collect();
    let mut rp: Vec<ReplayBuffer> = (0..2).map(|_| ReplayBuffer::new(100, &dev).expect("replay")).collect();
    let mut rcpu: Vec<ReplayBuffer> = (0..2).map(|_| ReplayBuffer::new(100, &Device::Cpu).expect("replay")).collect();
    let eps = vec![crate::LinearSchedule { start: 0.5, end: 0.5, steps: 1 }; 2];
    let col = super::PopDqnCollect::new(&refs, &rp, &eps, &[1, 2]).expect("collector");
    let obs = Tensor::zeros((2, e, OBS_DIM), DType::F32, &dev).expect("obs");
    col.observe(&refs, &rp, &obs).expect("observe");
    for step in 0..8u64 {
        for k in 0..2 {
            let what = format!("seed {seed} member {k} step {step}");
            assert_eq!(bits(host_f32(&obs.get(k).expect("row"))), bits(cpu[k].observe_host()), "{what}: pop obs");
        }
        let q: Vec<f32> = (0..2 * e * N_ACTIONS).map(|i| rng::draw(seed, 9, i as u64, step) as f32).collect();
        let q = Tensor::from_vec(q, (2, e, N_ACTIONS), &Device::Cpu).expect("q");
        col.collect(&refs, &mut rp, &q.to_device(&dev).expect("q"), step, &obs, None, None).expect("collect");
        for k in 0..2 {
            let a = cpu[k].epsilon_greedy(&q.get(k).expect("q"), 0.5).expect("eg");
            cpu[k].step_into_replay(&a, &mut rcpu[k]).expect("cpu");
        }
    }
    for k in 0..2 {
        let (want, got) = (rcpu[k].stored().expect("stored"), rp[k].stored().expect("stored"));
        assert_eq!(bits(host_f32(&got.states)), bits(host_f32(&want.states)), "member {k}: pop replay s");
        assert_eq!(bits(host_f32(&got.next_states)), bits(host_f32(&want.next_states)), "member {k}: pop replay s2");
        assert_eq!(host_u32(&got.actions), host_u32(&want.actions), "member {k}: pop replay a");
    }
    for g in [&mut g0, &mut g1, &mut gp, &mut g2] {
        g.check_errors().expect("no flagged actions");
    }
}

#[test]
fn selection_matches_cpu_reference() {
    let Some(dev) = gpu("selection_matches_cpu_reference") else { return };
    let data = Arc::new(synthetic_series(1000, 3).expect("data"));
    let e = 4096;
    let cfg = EnvConfig { num_envs: e, episode_len: 16, cost: 1e-4, seed: 77, env_offset: 5 };
    let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
    for k in 0..20 {
        let q: Vec<f32> = (0..e * N_ACTIONS).map(|i| (rng::draw(1, 7, i as u64, k) * 4.0).floor() as f32).collect();
        let qc = Tensor::from_vec(q.clone(), (e, N_ACTIONS), &Device::Cpu).expect("q");
        let qg = qc.to_device(&dev).expect("q");
        let ac = cpu.epsilon_greedy(&qc, 0.3).expect("cpu eg");
        let ag = gpu.epsilon_greedy(&qg, 0.3).expect("gpu eg");
        assert_eq!(host_u32(&ag), host_u32(&ac), "epsilon-greedy step {k} (ties included)");
        let logits = Tensor::from_vec(q, (e, N_ACTIONS), &Device::Cpu).expect("l");
        let probs =
            (logits.exp().expect("e").broadcast_div(&logits.exp().expect("e").sum_keepdim(1).expect("s"))).expect("p");
        let pc = cpu.sample_from_probs(&probs).expect("cpu sample");
        let pg = gpu.sample_from_probs(&probs.to_device(&dev).expect("p")).expect("gpu sample");
        assert_eq!(host_u32(&pg), host_u32(&pc), "sampling step {k}");
        let a = host_u32(&ac);
        cpu.step_host(&a).expect("cpu step");
        gpu.step(&Tensor::from_vec(a, e, &dev).expect("a")).expect("gpu step");
    }
}

#[test]
fn dqn_experience_matches_cpu_replay() {
    let Some(dev) = gpu("dqn_experience_matches_cpu_replay") else { return };
    let data = Arc::new(synthetic_series(800, 4).expect("data"));
    let e = 7;
    let cfg = EnvConfig { num_envs: e, episode_len: 5, cost: 1e-4, seed: 11, env_offset: 2 };
    let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
    let mut rc = ReplayBuffer::new(20, &Device::Cpu).expect("replay");
    let mut rg = ReplayBuffer::new(20, &dev).expect("replay");
    for k in 0..13 {
        if k % 2 == 0 {
            let a = random_actions(e, k, 3);
            let g = gpu.step_into_replay(&Tensor::from_vec(a.clone(), e, &dev).expect("a"), &mut rg).expect("gpu");
            let c = cpu.step_into_replay(&Tensor::from_vec(a, e, &Device::Cpu).expect("a"), &mut rc).expect("cpu");
            assert_close(&host_f32(&g.next_obs), &host_f32(&c.next_obs), 1e-6, "next_obs");
            assert_close(&host_f32(&g.obs), &host_f32(&c.obs), 1e-6, "obs");
        } else {
            // fused epsilon-greedy path against select + step on the CPU
            let q: Vec<f32> = (0..e * N_ACTIONS).map(|i| rng::draw(2, 7, i as u64, k) as f32).collect();
            let qc = Tensor::from_vec(q, (e, N_ACTIONS), &Device::Cpu).expect("q");
            let ac = cpu.epsilon_greedy(&qc, 0.5).expect("eg");
            let c = cpu.step_into_replay(&ac, &mut rc).expect("cpu");
            let (ag, obs) = gpu.collect_dqn(&qc.to_device(&dev).expect("q"), 0.5, &mut rg).expect("gpu");
            assert_eq!(host_u32(&ag), host_u32(&ac), "fused actions step {k}");
            assert_close(&host_f32(&obs), &host_f32(&c.obs), 1e-6, "fused obs");
        }
        assert_eq!((rg.len(), rg.position()), (rc.len(), rc.position()));
        assert_same_state(&cpu, &gpu, "dqn");
    }
    let idx = Tensor::arange(0u32, 20, &Device::Cpu).expect("idx");
    let bc = rc.gather(&idx).expect("cpu gather");
    let bg = rg.gather(&idx.to_device(&dev).expect("idx")).expect("gpu gather");
    assert_close(&host_f32(&bg.states), &host_f32(&bc.states), 1e-6, "replay s");
    assert_close(&host_f32(&bg.next_states), &host_f32(&bc.next_states), 1e-6, "replay s2");
    assert_close(&host_f32(&bg.rewards), &host_f32(&bc.rewards), 1e-6, "replay r");
    assert_eq!(host_u32(&bg.actions), host_u32(&bc.actions), "replay a");
    assert_eq!(host_f32(&bg.dones), host_f32(&bc.dones), "replay done");
    // device-side keyed sampling draws the CPU's rows
    for key in [0u64, 1, 977] {
        let (sg, sc) =
            (rg.sample_keyed(300, 21, key).expect("gpu sample"), rc.sample_keyed(300, 21, key).expect("cpu"));
        assert_eq!(host_f32(&sg.states), host_f32(&sc.states), "sampled s, key {key}");
        assert_eq!(host_f32(&sg.next_states), host_f32(&sc.next_states), "sampled s2, key {key}");
        assert_eq!(host_u32(&sg.actions), host_u32(&sc.actions), "sampled a, key {key}");
        assert_eq!(host_f32(&sg.rewards), host_f32(&sc.rewards), "sampled r, key {key}");
        assert_eq!(host_f32(&sg.dones), host_f32(&sc.dones), "sampled done, key {key}");
    }
    // ... also when written into one member's rows of a stacked minibatch (the population's
    // path), the other rows left alone
    let z = |shape: &[usize], dt| Tensor::zeros(shape, dt, &dev).expect("zeros");
    let stacked = [z(&[3, 300, OBS_DIM], DType::F32), z(&[3, 300, OBS_DIM], DType::F32)];
    let scalars = [z(&[3, 300], DType::U32), z(&[3, 300], DType::F32), z(&[3, 300], DType::F32)];
    let view = crate::ReplayBatch {
        states: stacked[0].get(1).expect("row"),
        actions: scalars[0].get(1).expect("row"),
        rewards: scalars[1].get(1).expect("row"),
        next_states: stacked[1].get(1).expect("row"),
        dones: scalars[2].get(1).expect("row"),
    };
    rg.sample_keyed_into(300, 21, 977, &view).expect("gpu sample into");
    let sc = rc.sample_keyed(300, 21, 977).expect("cpu");
    assert_eq!(host_f32(&view.states), host_f32(&sc.states), "sampled-into s");
    assert_eq!(host_f32(&view.next_states), host_f32(&sc.next_states), "sampled-into s2");
    assert_eq!(host_u32(&view.actions), host_u32(&sc.actions), "sampled-into a");
    assert_eq!(host_f32(&view.rewards), host_f32(&sc.rewards), "sampled-into r");
    assert_eq!(host_f32(&view.dones), host_f32(&sc.dones), "sampled-into done");
    for k in [0usize, 2] {
        assert!(host_f32(&stacked[0].get(k).expect("row")).iter().all(|&v| v == 0.0), "row {k} touched");
    }
    // E > capacity is refused before any launch
    let mut small = ReplayBuffer::new(3, &dev).expect("replay");
    assert!(gpu.step_into_replay(&Tensor::zeros(e, DType::U32, &dev).expect("a"), &mut small).is_err());
}

/// A captured DQN iteration's pieces, launched directly: the collection with ε and the ring
/// position read from the device loop (the ramp crossing its end mid-run, the ring
/// wrapping), the loop's advance and two keyed minibatches per step, against the CPU env,
/// the host schedule and the CPU's keyed sampling; the device counters end where the
/// host's do.
#[test]
fn looped_collection_and_sampling_match_cpu() {
    let Some(dev) = gpu("looped_collection_and_sampling_match_cpu") else { return };
    let data = Arc::new(synthetic_series(400, 9).expect("data"));
    let e = 37;
    let cfg = EnvConfig { num_envs: e, episode_len: 9, cost: 1e-4, seed: 77, env_offset: 5 };
    let (mut cpu, gpu) = pair(&dev, &data, &cfg);
    let (mut rc, mut rg) =
        (ReplayBuffer::new(100, &Device::Cpu).expect("rc"), ReplayBuffer::new(100, &dev).expect("rg"));
    let sched = crate::LinearSchedule { start: 0.9, end: 0.1, steps: 6 };
    let (mut steps, mut key, seed) = (3u64, 40u64, 21u64);
    let mut lp = super::DqnLoop::new(&dev).expect("loop");
    let start = super::DqnLoopCounters { env_steps: steps, replay_position: 0, replay_len: 0, sample_key: key };
    lp.write(start, &rg).expect("write");
    let bad = super::DqnLoopCounters { replay_position: 100, ..start };
    assert!(lp.write(bad, &rg).is_err(), "a ring position at the capacity is refused");
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).expect("zeros");
    let (obs, rew, done) = (z(&[e, OBS_DIM]), z(&[e]), z(&[e]));
    for k in 0..8u64 {
        let q: Vec<f32> = (0..e * N_ACTIONS).map(|i| rng::draw(3, 9, i as u64, k) as f32).collect();
        let qc = Tensor::from_vec(q, (e, N_ACTIONS), &Device::Cpu).expect("q");
        let ac = cpu.epsilon_greedy(&qc, sched.value(steps)).expect("eg");
        let c = cpu.step_into_replay(&ac, &mut rc).expect("cpu step");
        let qg = qc.to_device(&dev).expect("q");
        gpu.collect_dqn_looped(&qg, sched, &lp, &rg, &obs, &rew, &done).expect("collect");
        lp.launch_advance(e, &rg, 2).expect("advance");
        rg.advance(e);
        assert_close(&host_f32(&obs), &host_f32(&c.obs), 1e-6, "looped obs");
        assert_close(&host_f32(&rew), &host_f32(&c.reward), 1e-6, "looped reward");
        assert_eq!(host_f32(&done), host_f32(&c.done), "looped done, step {k}");
        for m in 0..2u32 {
            let bg = crate::replay::ReplayBatch::alloc(64, &dev, "test").expect("batch");
            lp.launch_sample(&rg, seed, m, &bg).expect("sample");
            let bc = rc.sample_keyed(64, seed, key + u64::from(m)).expect("cpu sample");
            assert_close(&host_f32(&bg.states), &host_f32(&bc.states), 1e-6, "looped sample s");
            assert_close(&host_f32(&bg.next_states), &host_f32(&bc.next_states), 1e-6, "looped sample s2");
            assert_close(&host_f32(&bg.rewards), &host_f32(&bc.rewards), 1e-6, "looped sample r");
            assert_eq!(host_u32(&bg.actions), host_u32(&bc.actions), "looped sample a, step {k}");
            assert_eq!(host_f32(&bg.dones), host_f32(&bc.dones), "looped sample done, step {k}");
        }
        (steps, key) = (steps + 1, key + 2);
    }
    let want = super::DqnLoopCounters {
        env_steps: steps,
        replay_position: rc.position() as u64,
        replay_len: rc.len() as u64,
        sample_key: key,
    };
    assert_eq!(lp.read().expect("read"), want);
    assert_eq!((rg.position(), rg.len()), (rc.position(), rc.len()));
    assert_same_state(&cpu, &gpu, "looped dqn");
}

#[test]
fn ppo_experience_matches_cpu_rollout() {
    let Some(dev) = gpu("ppo_experience_matches_cpu_rollout") else { return };
    let data = Arc::new(synthetic_series(600, 5).expect("data"));
    let (e, t_len) = (33, 12);
    let cfg = EnvConfig { num_envs: e, episode_len: 7, cost: 1e-4, seed: 1234, env_offset: 0 };
    let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
    let mut rc = Rollout::new(t_len, e, &Device::Cpu).expect("rollout");
    let mut rg = Rollout::new(t_len, e, &dev).expect("rollout");
    for k in 0..t_len as u64 {
        let l: Vec<f32> = (0..e * N_ACTIONS).map(|i| 4.0 * rng::draw(8, 1, i as u64, k) as f32 - 2.0).collect();
        let v: Vec<f32> = (0..e).map(|i| rng::draw(8, 2, i as u64, k) as f32).collect();
        let lc = Tensor::from_vec(l, (e, N_ACTIONS), &Device::Cpu).expect("l");
        let vc = Tensor::from_vec(v, e, &Device::Cpu).expect("v");
        let c = cpu.step_into_rollout(&lc, &vc, &mut rc).expect("cpu");
        let g = gpu
            .step_into_rollout(&lc.to_device(&dev).expect("l"), &vc.to_device(&dev).expect("v"), &mut rg)
            .expect("gpu");
        assert_close(&host_f32(&g.reward), &host_f32(&c.reward), 1e-6, "reward");
        assert_eq!(host_f32(&g.done), host_f32(&c.done), "done");
        assert_close(&host_f32(&g.obs), &host_f32(&c.obs), 1e-6, "obs");
        assert_same_state(&cpu, &gpu, "ppo");
    }
    assert!(rg.is_full());
    assert_eq!(host_u32(rg.actions()), host_u32(rc.actions()), "actions");
    assert_close(&host_f32(rg.states()), &host_f32(rc.states()), 1e-6, "states");
    assert_close(&host_f32(rg.log_probs()), &host_f32(rc.log_probs()), 1e-6, "log_probs");
    assert_eq!(host_f32(rg.values()), host_f32(rc.values()), "values");
    assert_close(&host_f32(rg.rewards()), &host_f32(rc.rewards()), 1e-6, "rewards");
    assert_eq!(host_f32(rg.dones()), host_f32(rc.dones()), "dones");
    let lv = Tensor::from_vec((0..e).map(|i| i as f32 * 0.01).collect::<Vec<_>>(), e, &Device::Cpu).expect("lv");
    let (ac, retc) = rc.advantages(&lv, GaeConfig::default()).expect("cpu gae");
    let (ag, retg) = rg.advantages(&lv.to_device(&dev).expect("lv"), GaeConfig::default()).expect("gpu gae");
    assert_close(&host_f32(&ag), &host_f32(&ac), 1e-6, "advantages");
    assert_close(&host_f32(&retg), &host_f32(&retc), 1e-6, "returns");
}

#[test]
fn gae_matches_cpu_on_random_inputs() {
    let Some(dev) = gpu("gae_matches_cpu_on_random_inputs") else { return };
    for (t_len, e) in [(1usize, 1usize), (16, 4), (64, 1000), (256, 4096)] {
        let n = t_len * e;
        let r: Vec<f32> = (0..n).map(|i| 0.2 * rng::draw(3, 1, i as u64, 0) as f32 - 0.1).collect();
        let v: Vec<f32> = (0..n).map(|i| 2.0 * rng::draw(3, 2, i as u64, 0) as f32 - 1.0).collect();
        let d: Vec<f32> = (0..n).map(|i| if rng::draw(3, 3, i as u64, 0) < 0.1 { 1.0 } else { 0.0 }).collect();
        let lv: Vec<f32> = (0..e).map(|i| rng::draw(3, 4, i as u64, 0) as f32).collect();
        let (ac, rc) = gae(&r, &v, &d, &lv, e, GaeConfig::default()).expect("cpu gae");
        let up = |x: &Vec<f32>, shape: &[usize]| Tensor::from_vec(x.clone(), shape, &dev).expect("upload");
        let (ag, rg) = gae_device(
            &up(&r, &[t_len, e]),
            &up(&v, &[t_len, e]),
            &up(&d, &[t_len, e]),
            &up(&lv, &[e]),
            GaeConfig::default(),
        )
        .expect("gpu gae");
        assert_close(&host_f32(&ag), &ac, 1e-6, "advantages");
        assert_close(&host_f32(&rg), &rc, 1e-6, "returns");
    }
}

#[test]
fn invalid_actions_are_flagged() {
    let Some(dev) = gpu("invalid_actions_are_flagged") else { return };
    let data = Arc::new(synthetic_series(300, 6).expect("data"));
    let cfg = EnvConfig { num_envs: 4, episode_len: 8, ..EnvConfig::default() };
    let mut env = GpuTradingEnv::new(data, cfg, &dev, GpuEnvOptions::default()).expect("env");
    env.step(&Tensor::from_vec(vec![0u32, 1, 2, 1], 4, &dev).expect("a")).expect("step");
    env.check_errors().expect("valid actions");
    env.step(&Tensor::from_vec(vec![0u32, 7, 2, 1], 4, &dev).expect("a")).expect("step");
    assert!(env.check_errors().is_err());
    env.check_errors().expect("flag cleared");
    // host-side checks: wrong length, wrong dtype, host tensor
    assert!(env.step(&Tensor::zeros(3, DType::U32, &dev).expect("a")).is_err());
    assert!(env.step(&Tensor::zeros(4, DType::F32, &dev).expect("a")).is_err());
    assert!(env.step(&Tensor::zeros(4, DType::U32, &Device::Cpu).expect("a")).is_err());
}

#[test]
fn benchmark_runs() {
    let Some(dev) = gpu("benchmark_runs") else { return };
    for mode in [EnvBenchMode::Step, EnvBenchMode::DqnCollect] {
        let r = bench_env_steps(&dev, 4096, 2000, 20, mode, GpuEnvOptions::default()).expect("bench");
        assert!(r.env_steps_per_s.is_finite() && r.env_steps_per_s > 0.0, "{r:?}");
        eprintln!("{r:?}");
    }
}

/// The numbers for docs/PERFORMANCE.md: `cargo test --release --features cuda -- --ignored
/// bench_report --nocapture` on the GPU.
#[test]
#[ignore = "benchmark; run explicitly on the GPU"]
fn bench_report() {
    let Some(dev) = gpu("bench_report") else { return };
    for e in [4096usize, 65536, 1 << 20] {
        for mode in [EnvBenchMode::Step, EnvBenchMode::DqnCollect] {
            for waves in [1u32, 4] {
                let steps = if e >= 1 << 20 { 100 } else { 500 };
                let opts = GpuEnvOptions { grid_waves: waves, ..GpuEnvOptions::default() };
                let r = bench_env_steps(&dev, e, 100_000, steps, mode, opts).expect("bench");
                println!(
                    "bench mode={:?} E={} waves={} steps={} env_steps_per_s={:.4e} us_per_step={:.2} host_us_per_step={:.2} bytes_per_env_step={} achieved_GB_per_s={:.1}",
                    r.mode,
                    r.num_envs,
                    waves,
                    r.steps,
                    r.env_steps_per_s,
                    1e6 * r.seconds / r.steps as f64,
                    1e6 * r.host_seconds / r.steps as f64,
                    r.bytes_per_env_step,
                    r.achieved_gb_per_s
                );
            }
        }
    }
}

#[test]
fn state_round_trips_between_backends() {
    let Some(dev) = gpu("state_round_trips_between_backends") else { return };
    let data = Arc::new(synthetic_series(500, 8).expect("data"));
    let e = 37;
    let cfg = EnvConfig { num_envs: e, episode_len: 9, cost: 1e-4, seed: 321, env_offset: 4 };
    let (mut cpu, mut gpu) = pair(&dev, &data, &cfg);
    for k in 0..13 {
        let a = random_actions(e, k, 1);
        cpu.step_host(&a).expect("cpu");
        gpu.step(&Tensor::from_vec(a, e, &dev).expect("a")).expect("gpu");
    }
    assert_eq!(gpu.state().expect("state"), cpu.state(), "GPU state equals CPU state");
    // a fresh GPU env restored from the CPU state, and a fresh CPU env from the GPU state
    let (mut cpu2, mut gpu2) = pair(&dev, &data, &cfg);
    gpu2.restore(&cpu.state()).expect("gpu restore");
    cpu2.restore(&gpu.state().expect("state")).expect("cpu restore");
    for k in 13..40 {
        let a = random_actions(e, k, 1);
        let c = cpu2.step_host(&a).expect("cpu");
        let g = gpu2.step(&Tensor::from_vec(a, e, &dev).expect("a")).expect("gpu");
        assert_close(&host_f32(&g.obs), &c.obs, 1e-6, "restored obs");
        assert_close(&host_f32(&g.reward), &c.reward, 1e-6, "restored reward");
        assert_same_state(&cpu2, &gpu2, "restored");
    }
    let mut bad = cpu.state();
    bad.t[3] = 499;
    assert!(gpu2.restore(&bad).is_err(), "a state past the series is refused before any upload");
}

/// The population collector against each member's solo kernels: three members with their
/// own series (one a panel of segments), seeds, offsets, costs and ε ramps (one crossing its
/// end mid-run), E = 37 accounts (not a multiple of a warp) into rings of 100 that wrap;
/// observations, rewards, done flags, env states, replay contents and keyed minibatches are
/// bit-identical, and a collector handed other envs refuses to launch. Member 1 starts over
/// at env step 5 (a trial in a freed slot: its clock): from then on its ε ramp, its window of
/// the ring and its draws are those of a solo run whose ring began there.
#[test]
fn pop_collection_equals_the_solo_kernels() {
    let Some(dev) = gpu("pop_collection_equals_the_solo_kernels") else { return };
    let (e, cap, n) = (37usize, 100usize, 3usize);
    let datas = [
        Arc::new(synthetic_series(400, 9).expect("data")),
        segmented_series(&[150, 220, 180], 4),
        Arc::new(synthetic_series(700, 2).expect("data")),
    ];
    let cfgs: Vec<EnvConfig> = (0..n)
        .map(|k| EnvConfig {
            num_envs: e,
            episode_len: 9 + k,
            cost: 1e-4 * (k + 1) as f64,
            seed: 77 + 1000 * k as u64,
            env_offset: 5 * k as u64,
        })
        .collect();
    let mut eps = vec![
        crate::LinearSchedule { start: 0.9, end: 0.1, steps: 6 },
        crate::LinearSchedule { start: 1.0, end: 0.05, steps: 1000 },
        crate::LinearSchedule { start: 0.3, end: 0.3, steps: 1 },
    ];
    let opts = GpuEnvOptions::default();
    let mk = |k: usize| GpuTradingEnv::new(datas[k].clone(), cfgs[k].clone(), &dev, opts.clone()).expect("env");
    let (mut solo, mut pop): (Vec<GpuTradingEnv>, Vec<GpuTradingEnv>) =
        ((0..n).map(mk).collect(), (0..n).map(mk).collect());
    let ring = || (0..n).map(|_| ReplayBuffer::new(cap, &dev).expect("replay")).collect::<Vec<_>>();
    let (mut rs, mut rp) = (ring(), ring());
    let pop_refs: Vec<&GpuTradingEnv> = pop.iter().collect();
    // Sampling seeds unlike the envs' (a trainer's seed need not be its env's).
    let sample_seeds: Vec<u64> = (0..n as u64).map(|k| 5_000 + 3 * k).collect();
    let mut col = super::PopDqnCollect::new(&pop_refs, &rp, &eps, &sample_seeds).expect("collector");
    assert_eq!(col.len(), n);
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).expect("zeros");
    let (obs, rew, done) = (z(&[n, e, OBS_DIM]), z(&[n, e]), z(&[n, e]));
    col.observe(&pop_refs, &rp, &obs).expect("observe");
    for k in 0..n {
        assert_eq!(host_f32(&obs.get(k).expect("row")), host_f32(&solo[k].observe().expect("obs")), "initial obs {k}");
    }
    let (restarted, restart) = (1usize, 5u64);
    let mut clocks = vec![crate::MemberClock::default(); n];
    let mut fresh = ReplayBuffer::new(cap, &dev).expect("member 1's own ring");
    for step in 0..12u64 {
        if step == 7 {
            // a PBT explore between steps
            eps[2] = crate::LinearSchedule { start: 0.8, end: 0.2, steps: 20 };
            col.set_members(&eps, &clocks, &sample_seeds).expect("set_members");
        }
        if step == restart {
            let ring_start = rp[restarted].position() as u64;
            clocks[restarted] = crate::MemberClock { env_step: restart, ring_start, key: 40 + restart };
            col.set_members(&eps, &clocks, &sample_seeds).expect("set_members");
        }
        let own = |k: usize| k == restarted && step >= restart;
        let q: Vec<f32> = (0..n * e * N_ACTIONS).map(|i| rng::draw(3, 9, i as u64, step) as f32).collect();
        let q = Tensor::from_vec(q, (n, e, N_ACTIONS), &dev).expect("q");
        col.collect(&pop_refs, &mut rp, &q, step, &obs, Some(&rew), Some(&done)).expect("collect");
        for k in 0..n {
            let what = format!("member {k} step {step}");
            let qk = q.get(k).expect("q");
            if own(k) {
                let (_, o) = solo[k].collect_dqn(&qk, eps[k].value(step - restart), &mut fresh).expect("solo");
                assert_eq!(host_f32(&obs.get(k).expect("row")), host_f32(&o), "{what}: obs");
                // Its window of the shared ring holds its own ring's rows.
                let start = clocks[k].ring_start as usize;
                let slots: Vec<u32> = (0..fresh.len()).map(|i| ((start + i) % cap) as u32).collect();
                let window = rp[k].gather(&Tensor::from_vec(slots, fresh.len(), &dev).expect("idx")).expect("gather");
                let mine = fresh.stored().expect("stored");
                assert_eq!(host_f32(&window.states), host_f32(&mine.states), "{what}: window s");
                assert_eq!(host_f32(&window.rewards), host_f32(&mine.rewards), "{what}: window r");
                assert_eq!(host_u32(&window.actions), host_u32(&mine.actions), "{what}: window a");
                continue;
            }
            let (_, o) = solo[k].collect_dqn(&qk, eps[k].value(step), &mut rs[k]).expect("solo");
            assert_eq!(host_f32(&obs.get(k).expect("row")), host_f32(&o), "{what}: obs");
            assert_eq!(solo[k].state().expect("state"), pop[k].state().expect("state"), "{what}: env state");
            let stored = rs[k].stored().expect("stored");
            let popped = rp[k].stored().expect("stored");
            assert_eq!(host_f32(&popped.rewards), host_f32(&stored.rewards), "{what}: replay r");
            assert_eq!(host_f32(&popped.dones), host_f32(&stored.dones), "{what}: replay done");
            assert_eq!(host_u32(&popped.actions), host_u32(&stored.actions), "{what}: replay a");
            assert_eq!(host_f32(&popped.states), host_f32(&stored.states), "{what}: replay s");
            assert_eq!(host_f32(&popped.next_states), host_f32(&stored.next_states), "{what}: replay s2");
            assert_eq!((rp[k].len(), rp[k].position()), (rs[k].len(), rs[k].position()), "{what}: ring");
        }
        // the rewards and done flags are those the replay got at this step's slots
        let slot = (step as usize * e) % cap;
        for k in (0..n).filter(|&k| !own(k)) {
            let idx = Tensor::from_vec((0..e).map(|i| ((slot + i) % cap) as u32).collect(), e, &dev).expect("idx");
            let b = rs[k].gather(&idx).expect("gather");
            assert_eq!(host_f32(&rew.get(k).expect("row")), host_f32(&b.rewards), "member {k} step {step}: reward");
            assert_eq!(host_f32(&done.get(k).expect("row")), host_f32(&b.dones), "member {k} step {step}: done");
        }
        let b = 64;
        let out = crate::ReplayBatch::alloc(n * b, &dev, "test").expect("batch");
        col.sample(&rp, step + 1, 40 + step, &out).expect("sample");
        for k in 0..n {
            let want = if own(k) {
                fresh.sample_keyed(b, sample_seeds[k], step - restart).expect("own sample")
            } else {
                rs[k].sample_keyed(b, sample_seeds[k], 40 + step).expect("solo sample")
            };
            let rows = |t: &Tensor| host_f32(&t.narrow(0, k * b, b).expect("rows"));
            let what = format!("member {k} step {step} sample");
            assert_eq!(rows(&out.states), host_f32(&want.states), "{what}: s");
            assert_eq!(rows(&out.next_states), host_f32(&want.next_states), "{what}: s2");
            assert_eq!(rows(&out.rewards), host_f32(&want.rewards), "{what}: r");
            assert_eq!(rows(&out.dones), host_f32(&want.dones), "{what}: done");
            assert_eq!(host_u32(&out.actions.narrow(0, k * b, b).expect("rows")), host_u32(&want.actions), "{what}: a");
        }
    }
    // handed other envs (the solo ones) or a shorter list, it refuses
    let solo_refs: Vec<&GpuTradingEnv> = solo.iter().collect();
    assert!(!col.fits(&solo_refs, &rp));
    assert!(col.observe(&solo_refs, &rp, &obs).is_err());
    assert!(col.observe(&pop_refs[..2], &rp[..2], &obs).is_err());
    // a missing sample seed, or members of different sizes, are refused at construction
    assert!(super::PopDqnCollect::new(&pop_refs, &rp, &eps, &sample_seeds[..2]).is_err());
    let small = ReplayBuffer::new(10, &dev).expect("replay");
    let mixed = [rp.remove(0), small];
    assert!(super::PopDqnCollect::new(&pop_refs[..2], &mixed, &eps[..2], &sample_seeds[..2]).is_err());
    for env in solo.iter_mut().chain(pop.iter_mut()) {
        env.check_errors().expect("no flagged actions");
    }
}
