//! Batch-1 latency: the greedy action for one state, each call timed on the host clock
//! (p50/p99/mean over `lat_n` calls after `lat_warm` untimed ones). Modes:
//! - `eager_fp32`: the model's `greedy_actions` (forward without a tape + argmax, ~20 candle
//!   launches) on a state already on the device, up to a device synchronisation;
//! - `fused_fp32` (CUDA): the one-launch kernel of `fx_models::mlp::cuda` on the same
//!   device-resident state, into a preallocated action, up to a stream synchronisation,
//!   launched through `MlpPolicy::bind` (buffers checked once; `checked_call_p50_us` is
//!   `greedy_into`, which checks and looks the pointers up on every call);
//!   `kernel_us` in the record is the kernel's own device time (64 launches replayed as one
//!   CUDA graph, event-timed), so p50 − `kernel_us` is what launching and synchronising cost;
//!   `kernel` says which kernel ran (`cluster` on Hopper+, else `block_per_row`), and with
//!   the cluster one the `block_per_row_*` keys time the other the same way;
//! - `cpu_fp32` (CPU): `fx_models::mlp::cpu::CpuPolicy::act`, host slice in → action, on
//!   the calling thread (no pool, no allocation, no tensor);
//! - `fused_fp32_e2e` (CUDA): `MlpDecider::act`, host slice in → action on the host (the
//!   state written into mapped page-locked memory, the kernel reading it and writing the
//!   action over the bus, a stream sync: everything a caller with host data waits for).
//!
//! - `server_fp32_e2e` (CUDA): `MlpServer::act`, host slice in → action on the host from a
//!   resident kernel polling mapped page-locked memory (no launch, no sync per decision);
//!   `kernel` and `block_per_row_*` as for `fused_fp32`.
//!
//! - `int8` (CUDA): `fx_quant::QuantNet::cuda_policy`, the same quantised network as one
//!   INT8 kernel launch (`kernels/mlp/mlp_int8.cu`), timed like `fused_fp32` (bound launch + sync,
//!   `kernel_us`), with `e2e_p50_us` / `e2e_p99_us` through an `MlpDecider` (host in, action
//!   out) and `matches_int8_reference` (the action of fx-quant's scalar reference);
//! - `int8` (CPU): `fx_quant::Int8Policy::act`, the default network quantised by `fx-quant`
//!   (per-channel INT8 weights, dynamic input scales as `fx-train quantize` writes by
//!   default: each decision's own max |x| per layer), host slice in
//!   → action on the calling thread, INT8 products on the best ISA (`isa` in the record;
//!   `p50_us_by_isa` times every ISA the CPU has the same way, batch cases too);
//! - `int8_guarded` (CPU): `fx_quant::GuardedPolicy` over that `int8` policy and `cpu_fp32`
//!   (INT8, then F32 where the two best INT8 scores are within the decision margin
//!   `quantize` would record), its calls cycling through 256 states, since how often F32
//!   runs depends on them (`checked_share` and `decision_margin` in the record). The
//!   benchmark's network is random, so its share says little of a trained one's.
//!
//! The fused and CPU modes also record `matches_eager`: their action for the timed state
//! equals the eager one (for `int8` a near-tie may legitimately differ; `int8_guarded`, whose
//! calls cycle through states, records its `checked_share` over warm-up and timed calls
//! instead).
//!
//! Throughput (`*_infer_b256`, kind `infer`, bench.py's `run_infer_throughput_case`):
//! greedy actions for 256 states per call, modes `eager_fp32` (candle, one `[256, 56]`
//! forward), on CUDA `fused_fp32` (the one-launch kernel, a block per row) and `int8` (the
//! INT8 kernel, several rows per block; `kernel_us` its device time), `cpu_fp32` (`CpuPolicy::act_batch`), `int8` (`Int8Policy::act_batch`: AMX tiles on
//! 32 rows at a time where the CPU has them) and `int8_guarded` (`GuardedPolicy::act_batch`) on
//! the CPU; p50 of `max(50, lat_n / 10)` timed calls after 20, `samples_per_s` = batch / p50.

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
    Int8,
    /// `fx_quant::GuardedPolicy`: INT8, F32 (`CpuPolicy`) where the two best INT8 scores are
    /// within the decision margin.
    Int8Guarded,
    #[cfg(feature = "cuda")]
    Fused,
    #[cfg(feature = "cuda")]
    FusedE2e,
    #[cfg(feature = "cuda")]
    ServerE2e,
    /// The INT8 kernel on the GPU (`fx_quant::QuantNet::cuda_policy`); named `int8` too.
    #[cfg(feature = "cuda")]
    FusedInt8,
}

impl LatencyMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            LatencyMode::Eager => "eager_fp32",
            LatencyMode::Cpu => "cpu_fp32",
            LatencyMode::Int8 => "int8",
            LatencyMode::Int8Guarded => "int8_guarded",
            #[cfg(feature = "cuda")]
            LatencyMode::Fused => "fused_fp32",
            #[cfg(feature = "cuda")]
            LatencyMode::FusedE2e => "fused_fp32_e2e",
            #[cfg(feature = "cuda")]
            LatencyMode::ServerE2e => "server_fp32_e2e",
            #[cfg(feature = "cuda")]
            LatencyMode::FusedInt8 => "int8",
        }
    }

    /// The modes run on a CUDA device or on the CPU (the fused ones need CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn for_device(cuda: bool) -> Vec<LatencyMode> {
        #[cfg(feature = "cuda")]
        if cuda {
            return vec![
                LatencyMode::Eager,
                LatencyMode::Fused,
                LatencyMode::FusedE2e,
                LatencyMode::ServerE2e,
                LatencyMode::FusedInt8,
            ];
        }
        vec![LatencyMode::Eager, LatencyMode::Cpu, LatencyMode::Int8, LatencyMode::Int8Guarded]
    }

    /// The modes of the batch-256 throughput cases (CPU decisions only on the CPU).
    pub(crate) fn for_throughput(cuda: bool) -> Vec<LatencyMode> {
        if cuda {
            #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
            let mut modes = vec![LatencyMode::Eager];
            #[cfg(feature = "cuda")]
            modes.extend([LatencyMode::Fused, LatencyMode::FusedInt8]);
            modes
        } else {
            vec![LatencyMode::Eager, LatencyMode::Cpu, LatencyMode::Int8, LatencyMode::Int8Guarded]
        }
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
            Model::Tft | Model::Mamba2 => anyhow::bail!("no batch-1 policy latency for {}", model.name()),
        })
    }

    fn params(&self) -> usize {
        match self {
            Net::Dqn(n) => n.params().param_count(),
            Net::Ppo(n) => n.params().param_count(),
        }
    }

    fn greedy(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Net::Dqn(n) => n.greedy_actions(x)?,
            Net::Ppo(n) => n.greedy_actions(x)?,
        })
    }

    fn cpu(&self) -> Result<fx_models::mlp::cpu::CpuPolicy> {
        Ok(match self {
            Net::Dqn(n) => n.cpu_policy()?,
            Net::Ppo(n) => n.cpu_policy()?,
        })
    }

    /// The network quantised to INT8 as `fx-train quantize` does by default (dynamic input
    /// scales; the 512 random calibration states only fill the report's statistics).
    fn int8(&self) -> Result<fx_quant::Int8Policy> {
        Ok(fx_quant::Int8Policy::new(&self.quant()?)?)
    }

    /// The quantised network behind [`Net::int8`] (and the GPU's `int8` mode).
    fn quant(&self) -> Result<fx_quant::QuantNet> {
        Self::quant_of(&self.float()?, &Self::calib()?)
    }

    fn quant_of(float: &fx_quant::FloatNet, calib: &[f32]) -> Result<fx_quant::QuantNet> {
        Ok(fx_quant::quantize(float, calib, fx_quant::CalibMethod::Dynamic, &[])?)
    }

    fn float(&self) -> Result<fx_quant::FloatNet> {
        Ok(match self {
            Net::Dqn(n) => fx_quant::FloatNet::from_dqn(n)?,
            Net::Ppo(n) => fx_quant::FloatNet::from_ppo(n)?,
        })
    }

    fn calib() -> Result<Vec<f32>> {
        Ok(states(&Device::Cpu, 512, 9, 2)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// [`Net::int8`] guarded by the F32 CPU policy, at the margin `quantize` would record
    /// (`fx_quant::decision_margin` on the calibration states).
    fn guarded(&self) -> Result<fx_quant::GuardedPolicy<fx_models::mlp::cpu::CpuPolicy>> {
        let (float, calib) = (self.float()?, Self::calib()?);
        let quant = Self::quant_of(&float, &calib)?;
        let margin = fx_quant::decision_margin(&float, &quant, &calib)?;
        Ok(fx_quant::GuardedPolicy::with_margin(fx_quant::Int8Policy::new(&quant)?, self.cpu()?, margin)?)
    }

    #[cfg(feature = "cuda")]
    fn fused(&self) -> Result<fx_models::mlp::cuda::MlpPolicy> {
        Ok(match self {
            Net::Dqn(n) => n.fused_policy()?,
            Net::Ppo(n) => n.fused_policy()?,
        })
    }
}

/// Microseconds per call: `warm` untimed calls, then `n` timed ones, each up to a device
/// synchronisation when `sync` (the e2e call syncs itself). A call's output is dropped
/// after its timing.
pub(crate) fn time_calls<T>(
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

#[cfg(feature = "cuda")]
use fx_models::mlp::cuda::MlpKernel;

/// The record's name of a fused kernel.
#[cfg(feature = "cuda")]
fn kernel_name(k: MlpKernel) -> &'static str {
    match k {
        MlpKernel::Cluster => "cluster",
        MlpKernel::BlockPerRow | MlpKernel::Auto => "block_per_row",
    }
}

/// A batch-1 launch of `policy` bound to the state `x` on the device, timed: `matches_eager`
/// (its action against candle's), each call's time (launch + stream sync) and `kernel_us`,
/// the kernel's own device time (the rest of p50 is the host's launch and the sync). Returns
/// the times and the action buffer.
#[cfg(feature = "cuda")]
fn time_bound(
    dev: &Device,
    policy: &fx_models::mlp::cuda::MlpPolicy,
    x: &Tensor,
    eager: &[u32],
    warm: usize,
    n: usize,
    rec: &mut Record,
) -> Result<(Vec<f64>, Tensor)> {
    let out = Tensor::zeros(1, DType::U32, dev)?;
    let bound = policy.bind(x, &out, None)?;
    bound.launch()?;
    rec.insert("matches_eager".into(), json!(out.to_vec1::<u32>()? == eager));
    let ts = time_calls(dev, warm, n, true, || Ok(bound.launch()?))?;
    let kernel = super::timing::kernel_device_us(dev, || Ok(bound.launch()?))?;
    rec.insert("kernel_us".into(), json!(round(kernel, 2)));
    Ok((ts, out))
}

/// The `int8_guarded` cases: [`Net::guarded`] timed by `time`, its ISA, margin and checked
/// share (over the warm-up and the timed calls) into `rec`.
fn timed_guarded(
    net: &Net,
    rec: &mut Record,
    time: impl FnOnce(&mut fx_quant::GuardedPolicy<fx_models::mlp::cpu::CpuPolicy>) -> Result<Vec<f64>>,
) -> Result<Vec<f64>> {
    let mut policy = net.guarded()?;
    rec.insert("isa".into(), json!(policy.int8().isa().name()));
    rec.insert("decision_margin".into(), json!(policy.margin()));
    let ts = time(&mut policy)?;
    rec.insert("checked_share".into(), json!(round(policy.checked_share(), 4)));
    Ok(ts)
}

/// The `int8` case's median call (µs) on every INT8 ISA this CPU has (`Isa::available`,
/// the scalar reference included), timed like the case itself: what the chosen ISA gains is
/// recorded beside it rather than assumed.
fn int8_by_isa(
    net: &Net,
    mut time: impl FnMut(&mut fx_quant::Int8Policy) -> Result<Vec<f64>>,
) -> Result<serde_json::Value> {
    let quant = net.quant()?;
    let mut by_isa = serde_json::Map::new();
    for isa in fx_quant::Isa::available() {
        let mut policy = fx_quant::Int8Policy::with_isa(&quant, isa)?;
        by_isa.insert(isa.name().into(), json!(round(pct(&time(&mut policy)?, 50.0), 3)));
    }
    Ok(serde_json::Value::Object(by_isa))
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
        LatencyMode::Int8 => {
            let mut policy = net.int8()?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            rec.insert("matches_eager".into(), json!(policy.act(&host)? == eager[0] as usize));
            rec.insert("isa".into(), json!(policy.isa().name()));
            let by_isa = int8_by_isa(&net, |p| time_calls(&dev, warm, n, false, || Ok(p.act(&host)?)))?;
            rec.insert("p50_us_by_isa".into(), by_isa);
            time_calls(&dev, warm, n, false, || Ok(policy.act(&host)?))?
        }
        LatencyMode::Int8Guarded => {
            // How often the F32 check runs depends on the states, so the calls cycle through
            // 256 of them (the other modes repeat one); the share is reported.
            use fx_quant::Decide;
            let states = super::data::states(&Device::Cpu, 256, 9, 4)?.flatten_all()?.to_vec1::<f32>()?;
            let d = states.len() / 256;
            let mut i = 0;
            timed_guarded(&net, rec, |policy| {
                time_calls(&dev, warm, n, false, || {
                    i += 1;
                    Ok(policy.act(&states[(i % 256) * d..(i % 256 + 1) * d])?)
                })
            })?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::Fused => {
            let policy = net.fused()?;
            rec.insert("kernel".into(), json!(kernel_name(policy.kernel_for(1))));
            let (ts, out) = time_bound(&dev, &policy, &x, &eager, warm, n, rec)?;
            // The checked call (shapes, pointers looked up per call) for comparison.
            let tc = time_calls(&dev, warm, n, true, || Ok(policy.greedy_into(&x, &out, None)?))?;
            rec.insert("checked_call_p50_us".into(), json!(round(pct(&tc, 50.0), 2)));
            if policy.kernel_for(1) == MlpKernel::Cluster {
                // What the cluster bought: the block-per-row kernel timed the same way.
                let mut block = policy.clone();
                block.set_kernel(MlpKernel::BlockPerRow)?;
                let block = block.bind(&x, &out, None)?;
                let tb = time_calls(&dev, warm, n, true, || Ok(block.launch()?))?;
                let kb = super::timing::kernel_device_us(&dev, || Ok(block.launch()?))?;
                rec.insert("block_per_row_p50_us".into(), json!(round(pct(&tb, 50.0), 2)));
                rec.insert("block_per_row_p99_us".into(), json!(round(pct(&tb, 99.0), 2)));
                rec.insert("block_per_row_kernel_us".into(), json!(round(kb, 2)));
            }
            ts
        }
        #[cfg(feature = "cuda")]
        LatencyMode::FusedInt8 => {
            let q = net.quant()?;
            let policy = q.cuda_policy(&dev)?;
            rec.insert("kernel".into(), json!("int8_block"));
            let (ts, out) = time_bound(&dev, &policy, &x, &eager, warm, n, rec)?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            let (_, want) = fx_quant::reference::reference_scores(&q, &host)?;
            rec.insert("matches_int8_reference".into(), json!(out.to_vec1::<u32>()?[0] as usize == want));
            // Host slice in, action out (mapped memory, one launch, one sync).
            let mut decider = fx_models::mlp::cuda::MlpDecider::new(policy, 1)?;
            let te = time_calls(&dev, warm, n, false, || Ok(decider.act(&host)?))?;
            rec.insert("e2e_p50_us".into(), json!(round(pct(&te, 50.0), 2)));
            rec.insert("e2e_p99_us".into(), json!(round(pct(&te, 99.0), 2)));
            ts
        }
        #[cfg(feature = "cuda")]
        LatencyMode::FusedE2e => {
            let mut decider = fx_models::mlp::cuda::MlpDecider::new(net.fused()?, 1)?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            rec.insert("matches_eager".into(), json!(decider.act(&host)? == eager[0]));
            time_calls(&dev, warm, n, false, || Ok(decider.act(&host)?))?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::ServerE2e => {
            let policy = net.fused()?;
            let host = x.flatten_all()?.to_vec1::<f32>()?;
            let mut server = fx_models::mlp::cuda::MlpServer::new(&policy)?;
            rec.insert("matches_eager".into(), json!(server.act(&host)? == eager[0]));
            rec.insert("kernel".into(), json!(kernel_name(server.kernel())));
            let ts = time_calls(&dev, warm, n, false, || Ok(server.act(&host)?));
            // Stopped before anything else runs: one resident server at a time.
            server.stop()?;
            let ts = ts?;
            if server.kernel() == MlpKernel::Cluster {
                let mut block = policy.clone();
                block.set_kernel(MlpKernel::BlockPerRow)?;
                let mut server = fx_models::mlp::cuda::MlpServer::new(&block)?;
                let tb = time_calls(&dev, warm, n, false, || Ok(server.act(&host)?));
                server.stop()?;
                let tb = tb?;
                rec.insert("block_per_row_p50_us".into(), json!(round(pct(&tb, 50.0), 2)));
                rec.insert("block_per_row_p99_us".into(), json!(round(pct(&tb, 99.0), 2)));
            }
            ts
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

/// One batch-`batch` throughput case in `mode` (eager, cpu or int8); fills `rec`.
pub(crate) fn throughput_case(
    ctx: &mut Ctx,
    model: Model,
    mode: LatencyMode,
    batch: usize,
    rec: &mut Record,
) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let x = states(&dev, batch, 9, 3)?;
    let net = Net::new(model, &dev)?;
    rec.insert("params".into(), json!(net.params()));
    let host = x.flatten_all()?.to_vec1::<f32>()?;
    let (warm, n) = (20, (ctx.lat_n / 10).max(50));
    let ts = match mode {
        LatencyMode::Eager => time_calls(&dev, warm, n, true, || net.greedy(&x))?,
        LatencyMode::Cpu => {
            let mut policy = net.cpu()?;
            let mut out = vec![0u32; batch];
            time_calls(&dev, warm, n, false, || Ok(policy.act_batch(&host, &mut out)?))?
        }
        LatencyMode::Int8 => {
            let mut policy = net.int8()?;
            rec.insert("isa".into(), json!(policy.isa().name()));
            let mut out = vec![0usize; batch];
            let by_isa = int8_by_isa(&net, |p| time_calls(&dev, warm, n, false, || Ok(p.act_batch(&host, &mut out)?)))?;
            rec.insert("p50_us_by_isa".into(), by_isa);
            time_calls(&dev, warm, n, false, || Ok(policy.act_batch(&host, &mut out)?))?
        }
        LatencyMode::Int8Guarded => {
            let mut out = vec![0usize; batch];
            timed_guarded(&net, rec, |policy| {
                time_calls(&dev, warm, n, false, || Ok(policy.act_batch(&host, &mut out)?))
            })?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::Fused => {
            let policy = net.fused()?;
            let out = Tensor::zeros(batch, DType::U32, &dev)?;
            time_calls(&dev, warm, n, true, || Ok(policy.greedy_into(&x, &out, None)?))?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::FusedInt8 => {
            let policy = net.quant()?.cuda_policy(&dev)?;
            let out = Tensor::zeros(batch, DType::U32, &dev)?;
            let kernel = super::timing::kernel_device_us(&dev, || Ok(policy.greedy_into(&x, &out, None)?))?;
            rec.insert("kernel_us".into(), json!(round(kernel, 2)));
            time_calls(&dev, warm, n, true, || Ok(policy.greedy_into(&x, &out, None)?))?
        }
        #[cfg(feature = "cuda")]
        LatencyMode::FusedE2e | LatencyMode::ServerE2e => {
            anyhow::bail!("no batch-{batch} throughput case for {}", mode.name())
        }
    };
    let med = pct(&ts, 50.0);
    rec.insert("status".into(), json!("ok"));
    rec.insert("n".into(), json!(ts.len()));
    rec.insert("p50_us".into(), json!(round(med, 2)));
    rec.insert("samples_per_s".into(), json!(round(batch as f64 / (med / 1e6), 1)));
    rec.insert("peak_mem_mib".into(), json!(ctx.mem.peak_mib(&dev)?.map(|m| round(m, 1))));
    rec.insert("peak_reserved_mib".into(), json!(ctx.mem.peak_reserved_mib()?.map(|m| round(m, 1))));
    Ok(())
}
