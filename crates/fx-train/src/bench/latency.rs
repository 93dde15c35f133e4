//! Batch-1 latency: the greedy action for one state, each call timed on the host clock
//! (p50/p99/mean over `lat_n` calls after `lat_warm` untimed ones). Modes:
//! - `eager_fp32`: the model's `greedy_actions` (forward without a tape + argmax, ~20 candle
//!   launches) on a state already on the device, up to a device synchronisation;
//! - `fused_fp32` (CUDA): the one-launch kernel of `fx_kernels::cuda::mlp` on the same
//!   device-resident state, into a preallocated action, up to a stream synchronisation;
//! - `cpu_fp32` (CPU): `fx_kernels::mlp_cpu::CpuPolicy::act`, host slice in → action, on
//!   the calling thread (no pool, no allocation, no tensor);
//! - `fused_fp32_e2e` (CUDA): `MlpDecider::act`, host slice in → action on the host (the
//!   state written into mapped page-locked memory, the kernel reading it and writing the
//!   action over the bus, a stream sync: everything a caller with host data waits for).
//!
//! The fused modes also record `matches_eager`: their action for the timed state equals the
//! eager one.

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use fx_models::{ActorCritic, DqnNetConfig, DuelingDqn, PpoNetConfig};
use serde_json::json;

use super::data::states;
use super::timing::{mean, pct, round};
use super::{Ctx, Model, Record};

/// How a latency case decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LatencyMode {
    Eager,
    Cpu,
    #[cfg(feature = "cuda")]
    Fused,
    #[cfg(feature = "cuda")]
    FusedE2e,
}

impl LatencyMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            LatencyMode::Eager => "eager_fp32",
            LatencyMode::Cpu => "cpu_fp32",
            #[cfg(feature = "cuda")]
            LatencyMode::Fused => "fused_fp32",
            #[cfg(feature = "cuda")]
            LatencyMode::FusedE2e => "fused_fp32_e2e",
        }
    }

    /// The modes run on a CUDA device or on the CPU (the fused ones need CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn for_device(cuda: bool) -> Vec<LatencyMode> {
        #[cfg(feature = "cuda")]
        if cuda {
            return vec![LatencyMode::Eager, LatencyMode::Fused, LatencyMode::FusedE2e];
        }
        vec![LatencyMode::Eager, LatencyMode::Cpu]
    }
}

/// The benchmarked network (default dimensions, seed 0).
enum Net {
    Dqn(DuelingDqn),
    Ppo(ActorCritic),
}

impl Net {
    fn new(model: Model, dev: &Device) -> Result<Self> {
        Ok(match model {
            Model::Dqn => Net::Dqn(DuelingDqn::new(DqnNetConfig::default(), dev, 0)?),
            Model::Ppo => Net::Ppo(ActorCritic::new(PpoNetConfig::default(), dev, 0)?),
        })
    }

    fn params(&self) -> usize {
        match self {
            Net::Dqn(n) => n.params().num_elements(),
            Net::Ppo(n) => n.params().num_elements(),
        }
    }

    fn greedy(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Net::Dqn(n) => n.greedy_actions(x)?,
            Net::Ppo(n) => n.greedy_actions(x)?,
        })
    }

    fn cpu(&self) -> Result<fx_kernels::mlp_cpu::CpuPolicy> {
        Ok(match self {
            Net::Dqn(n) => n.cpu_policy()?,
            Net::Ppo(n) => n.cpu_policy()?,
        })
    }

    #[cfg(feature = "cuda")]
    fn fused(&self) -> Result<fx_kernels::cuda::mlp::MlpPolicy> {
        Ok(match self {
            Net::Dqn(n) => n.fused_policy()?,
            Net::Ppo(n) => n.fused_policy()?,
        })
    }
}

/// Microseconds per call: `warm` untimed calls, then `n` timed ones, each up to a device
/// synchronisation when `sync` (the e2e call syncs itself). A call's output is dropped
/// after its timing.
fn time_calls<T>(
    dev: &Device,
    warm: usize,
    n: usize,
    sync: bool,
    mut call: impl FnMut() -> Result<T>,
) -> Result<Vec<f64>> {
    for _ in 0..warm {
        call()?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let out = call()?;
        if sync {
            dev.synchronize()?;
        }
        ts.push(t0.elapsed().as_secs_f64() * 1e6);
        drop(out);
    }
    Ok(ts)
}

/// One latency case in `mode`; fills `rec` (which already holds the case's identity).
pub(crate) fn latency_case(ctx: &mut Ctx, model: Model, mode: LatencyMode, rec: &mut Record) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let x = states(&dev, 1, 9, 1)?;
    let net = Net::new(model, &dev)?;
    rec.insert("params".into(), json!(net.params()));
    let eager = net.greedy(&x)?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    ensure!(eager.len() == 1 && eager[0] < 3, "greedy action out of range: {eager:?}");
    let (warm, n) = (ctx.lat_warm, ctx.lat_n);
    let ts = match mode {
        LatencyMode::Eager => time_calls(&dev, warm, n, true, || net.greedy(&x))?,
        LatencyMode::Cpu => {
            let mut policy = net.cpu()?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            rec.insert("matches_eager".into(), json!(policy.act(&host)? == eager[0]));
            time_calls(&dev, warm, n, false, || Ok(policy.act(&host)?))?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::Fused => {
            let policy = net.fused()?;
            let out = Tensor::zeros(1, DType::U32, &dev)?;
            policy.greedy_into(&x, &out, None)?;
            rec.insert("matches_eager".into(), json!(out.to_vec1::<u32>()? == eager));
            time_calls(&dev, warm, n, true, || Ok(policy.greedy_into(&x, &out, None)?))?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::FusedE2e => {
            let mut decider = fx_kernels::cuda::mlp::MlpDecider::new(net.fused()?, 1)?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            rec.insert("matches_eager".into(), json!(decider.act(&host)? == eager[0]));
            time_calls(&dev, warm, n, false, || Ok(decider.act(&host)?))?
        }
    };
    let peak = ctx.mem.peak_mib(&dev)?;
    rec.insert("status".into(), json!("ok"));
    rec.insert("n".into(), json!(ts.len()));
    rec.insert("p50_us".into(), json!(round(pct(&ts, 50.0), 2)));
    rec.insert("p99_us".into(), json!(round(pct(&ts, 99.0), 2)));
    rec.insert("mean_us".into(), json!(round(mean(&ts), 2)));
    rec.insert("peak_mem_mib".into(), json!(peak.map(|m| round(m, 1))));
    rec.insert("mem_baseline_mib".into(), json!(ctx.mem.baseline_mib().map(|m| round(m, 1))));
    rec.insert("peak_reserved_mib".into(), json!(ctx.mem.peak_reserved_mib()?.map(|m| round(m, 1))));
    Ok(())
}
