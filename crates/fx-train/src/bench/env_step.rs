//! Environment cases (bench.py's `env_step_E*` and `dqn_collect_E*`) and host-to-device
//! copy bandwidth (pinned vs pageable buffers from fx-data's `HostBufferPool`).
//!
//! The environment is fx-kernels' `GpuTradingEnv` on CUDA and `CpuTradingEnv` on the CPU,
//! driven through the `VecEnv` trait the trainers use. Differences from bench.py: the
//! env-step actions are 16 device tensors drawn before timing and cycled (bench.py draws
//! `torch.randint` inside each step, one extra kernel), and the DQN collection uses the
//! trait's ε-greedy and replay write (what `DqnTrainer::step` runs) rather than a fused
//! Python composition. On CUDA the collection also runs `fused`: `fx_models::DqnQForward` and
//! `GpuTradingEnv::collect_dqn` (ε-greedy, step and replay write in one kernel).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use fx_kernels::{CpuTradingEnv, EnvConfig, ReplayBuffer, VecEnv};
use fx_models::{DqnNetConfig, DuelingDqn};
use serde_json::json;

use super::data::{series, uniforms};
use super::timing::round;
use super::{Ctx, Record};

/// One call of a case's timed body, given the env and the call index.
type EnvBody = Box<dyn FnMut(&mut AnyEnv, usize) -> Result<()>>;

/// Which environment workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EnvWhat {
    /// `VecEnv::step` alone.
    Step,
    /// Q forward (F32, no tape) + ε-greedy (0.1) + step into a replay buffer.
    DqnCollect,
}

impl EnvWhat {
    pub(crate) fn case_prefix(self) -> &'static str {
        match self {
            EnvWhat::Step => "env_step",
            EnvWhat::DqnCollect => "dqn_collect",
        }
    }

    /// The modes of this workload on the device: `eager` (candle's Q forward, then the
    /// trait's ε-greedy and replay step), and for the DQN collection on CUDA also `fused`
    /// (`fx_models::DqnQForward`, 7 launches, then `GpuTradingEnv::collect_dqn`: ε-greedy,
    /// step and replay write in one kernel).
    /// On CUDA each also runs `*_view`: the same over a view of the series (four segments,
    /// each normalised as its rows are observed, as a walk-forward fold's series is), which
    /// prices the kernels' in-place normalisation.
    pub(crate) fn modes(self, cuda: bool) -> &'static [&'static str] {
        match (self, cuda) {
            (EnvWhat::DqnCollect, true) => &["eager", "fused", "fused_view"],
            (EnvWhat::Step, true) => &["eager", "eager_view"],
            _ => &["eager"],
        }
    }
}

/// The backend behind the trait (kept concrete so the GPU's error flags can be read).
#[allow(clippy::large_enum_variant)] // one per benchmark case, never moved in a loop
enum AnyEnv {
    Cpu(CpuTradingEnv),
    #[cfg(feature = "cuda")]
    Gpu(fx_kernels::GpuTradingEnv),
}

impl AnyEnv {
    fn new(device: &Device, data: Arc<fx_kernels::EnvData>, cfg: EnvConfig) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let opts = fx_kernels::GpuEnvOptions::default();
            return Ok(AnyEnv::Gpu(fx_kernels::GpuTradingEnv::new(data, cfg, device, opts)?));
        }
        let _ = device;
        Ok(AnyEnv::Cpu(CpuTradingEnv::new(data, cfg)?))
    }

    fn env(&mut self) -> &mut dyn VecEnv {
        match self {
            AnyEnv::Cpu(e) => e,
            #[cfg(feature = "cuda")]
            AnyEnv::Gpu(e) => e,
        }
    }

    fn backend(&self) -> &'static str {
        match self {
            AnyEnv::Cpu(_) => "CpuTradingEnv",
            #[cfg(feature = "cuda")]
            AnyEnv::Gpu(_) => "GpuTradingEnv",
        }
    }

    /// Device-side error flags (invalid actions and the like) after the timed loop.
    fn check(&mut self) -> Result<()> {
        match self {
            AnyEnv::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            AnyEnv::Gpu(e) => Ok(e.check_errors()?),
        }
    }
}

/// `data`'s rows as a view of four segments (a row's gap between them), each with a
/// normaliser fitted on its first half.
fn quarters_view(data: fx_kernels::EnvData) -> Result<fx_kernels::EnvData> {
    let rows = data.rows().clone();
    let q = rows.len() / 4;
    let segments: Vec<std::ops::Range<usize>> = (0..4).map(|k| k * q..(k + 1) * q - 1).collect();
    let norms = segments
        .iter()
        .map(|s| fx_data::Normalizer::fit_rows(rows.market(), fx_kernels::N_MARKET, s.start..s.start + q / 2))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(fx_kernels::EnvData::view(rows, segments, &norms)?)
}

/// One environment case with `e` accounts (episode_len 256, cost 1 bp, seed 7) in `mode`
/// (see [`EnvWhat::modes`]).
pub(crate) fn env_case(ctx: &mut Ctx, what: EnvWhat, mode: &str, e: usize, rec: &mut Record) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let data = series(ctx.env_series)?;
    let data = Arc::new(if mode.ends_with("_view") { quarters_view(data)? } else { data });
    let cfg = EnvConfig { num_envs: e, episode_len: 256, cost: 1e-4, seed: 7, env_offset: 0 };
    let mut env = AnyEnv::new(&dev, data, cfg)?;
    rec.insert("backend".into(), json!(env.backend()));
    rec.insert("series_len".into(), json!(ctx.env_series));
    let mut body: EnvBody = match what {
        EnvWhat::Step => {
            let actions = (0..16u64)
                .map(|k| {
                    let a: Vec<u32> = uniforms(7, 30 + k, e).iter().map(|u| ((u * 3.0) as u32).min(2)).collect();
                    Tensor::from_vec(a, e, &dev)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            rec.insert("actions".into(), json!("16 precomputed device tensors, cycled"));
            Box::new(move |env, i| {
                env.env().step(&actions[i % actions.len()])?;
                Ok(())
            })
        }
        #[cfg(feature = "cuda")]
        EnvWhat::DqnCollect if mode.starts_with("fused") => {
            let net = DuelingDqn::new(DqnNetConfig::default(), &dev, 0)?;
            let fwd = fx_models::DqnQForward::new(&net, e)?;
            let mut replay = ReplayBuffer::new(e * 4, &dev)?;
            let mut obs = env.env().observe()?;
            rec.insert("q_forward".into(), json!("DqnQForward (cuBLAS F32 + fused bias/ReLU and dueling head)"));
            Box::new(move |env, _| {
                let AnyEnv::Gpu(env) = env else { anyhow::bail!("the fused collection needs the GPU env") };
                let q = fwd.forward(&net, &obs)?;
                obs = env.collect_dqn(&q, 0.1, &mut replay)?.1;
                Ok(())
            })
        }
        EnvWhat::DqnCollect => {
            anyhow::ensure!(mode == "eager", "unknown dqn_collect mode {mode}");
            let net = DuelingDqn::new(DqnNetConfig::default(), &dev, 0)?;
            let mut replay = ReplayBuffer::new(e * 4, &dev)?;
            let mut obs = env.env().observe()?;
            Box::new(move |env, _| {
                let env = env.env();
                let q = net.forward_inference(&obs)?;
                let a = env.epsilon_greedy(&q, 0.1)?;
                obs = env.step_into_replay(&a, &mut replay)?.obs;
                Ok(())
            })
        }
    };
    for i in 0..ctx.warmup + 3 {
        body(&mut env, i)?;
    }
    dev.synchronize()?;
    let t0 = Instant::now();
    for i in 0..ctx.env_n {
        body(&mut env, i)?;
    }
    dev.synchronize()?;
    let wall = t0.elapsed().as_secs_f64();
    env.check()?;
    // Every account took every step (the counters are the draws' step index).
    let want = (ctx.warmup + 3 + ctx.env_n) as u64;
    let counters = env.env().counters()?;
    ensure!(
        counters.len() == e && counters.iter().all(|&c| c == want),
        "env step counters {:?}.. after {want} steps",
        &counters[..counters.len().min(4)]
    );
    let peak = ctx.mem.peak_mib(&dev)?;
    let calls = ctx.env_n as f64 / wall;
    rec.insert("status".into(), json!("ok"));
    rec.insert("calls".into(), json!(ctx.env_n));
    rec.insert("calls_per_s".into(), json!(round(calls, 1)));
    rec.insert("env_steps_per_s".into(), json!(round(calls * e as f64, 1)));
    rec.insert("us_per_call".into(), json!(round(1e6 / calls, 2)));
    rec.insert("peak_mem_mib".into(), json!(peak.map(|m| round(m, 1))));
    rec.insert("mem_baseline_mib".into(), json!(ctx.mem.baseline_mib().map(|m| round(m, 1))));
    rec.insert("peak_reserved_mib".into(), json!(ctx.mem.peak_reserved_mib()?.map(|m| round(m, 1))));
    Ok(())
}

/// Host-to-device bandwidth: `copies` uploads of `floats` f32 from one buffer of
/// fx-data's `HostBufferPool` (pinned or pageable) into one device allocation on candle's
/// stream, wall clock between two stream synchronisations.
#[cfg(feature = "cuda")]
pub(crate) fn h2d_case(ctx: &mut Ctx, pinned: bool, floats: usize, rec: &mut Record) -> Result<()> {
    use fx_data::HostBufferPool;
    let Device::Cuda(cd) = &ctx.device else { anyhow::bail!("h2d needs a CUDA device") };
    let stream = cd.cuda_stream();
    let pool =
        if pinned { HostBufferPool::pinned(stream.context().clone(), floats) } else { HostBufferPool::new(floats) };
    let mut buf = pool.get()?;
    for (i, x) in buf.as_mut_slice()?.iter_mut().enumerate() {
        *x = i as f32;
    }
    anyhow::ensure!(buf.buffer().is_pinned() == pinned, "pool handed out the wrong kind of buffer");
    // SAFETY: fully overwritten by the copies below before anything reads it.
    let mut dst = unsafe { stream.alloc::<f32>(floats) }?;
    let copies = if ctx.quick { 5 } else { 50 };
    let mut upload = || -> Result<()> {
        match buf.buffer().pinned() {
            Some(p) => stream.memcpy_htod(p, &mut dst)?,
            None => stream.memcpy_htod(buf.buffer().as_slice(), &mut dst)?,
        }
        Ok(())
    };
    for _ in 0..3 {
        upload()?;
    }
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..copies {
        upload()?;
    }
    stream.synchronize()?;
    let wall = t0.elapsed().as_secs_f64();
    let bytes = floats * 4;
    rec.insert("status".into(), json!("ok"));
    rec.insert("bytes".into(), json!(bytes));
    rec.insert("copies".into(), json!(copies));
    rec.insert("gb_per_s".into(), json!(round(bytes as f64 * copies as f64 / wall / 1e9, 2)));
    rec.insert("us_per_copy".into(), json!(round(wall / copies as f64 * 1e6, 2)));
    Ok(())
}
