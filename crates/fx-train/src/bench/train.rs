//! Training-step and batch-1 latency cases, through the library's own trainers:
//! [`DqnTrainer::update`] (online forward on s and s', target forward, double-DQN Huber
//! loss, backward, clip 10, AdamW, soft target update) and
//! [`PpoTrainer::update_minibatch`] (forward, PPO loss, backward, clip 0.5, Adam). Both
//! go through fx-precision's `TrainStep`, which reads the loss and gradient norm back to
//! the host once per step (the NaN/Inf guard), so a step contains one device→host
//! transfer that bench.py's steps do not have; PPO reads its diagnostics once more.

use std::time::Instant;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use fx_models::{
    ActorCritic, DqnBatch, DqnConfig, DqnNetConfig, DqnTrainer, DuelingDqn, PpoBatch, PpoConfig, PpoNetConfig,
    PpoTrainer,
};
use fx_precision::Precision;
use serde_json::json;

use super::data::{normals, states, uniforms};
use super::timing::{mean, pct, round};
use super::{Ctx, Model, Record};

/// The mode name of a precision (bench.py's names, so rows line up).
pub(crate) fn mode_name(p: Precision) -> &'static str {
    match p {
        Precision::F32 => "eager_fp32",
        Precision::Bf16 => "eager_bf16",
        Precision::F16 => "eager_fp16",
    }
}

/// What one training step left behind.
struct StepOut {
    loss: f64,
    skipped: bool,
}

/// A model's update on fixed device-resident data.
trait Stepper {
    fn params(&self) -> usize;
    fn step(&mut self) -> Result<StepOut>;
}

struct DqnStepper {
    trainer: DqnTrainer,
    s: Tensor,
    a: Tensor,
    r: Tensor,
    s2: Tensor,
    d: Tensor,
}

impl DqnStepper {
    fn new(device: &Device, batch: usize, precision: Precision) -> Result<Self> {
        // The replay buffer is not used by `update`; keep it tiny so it does not count
        // towards the case's memory.
        let cfg =
            DqnConfig { precision, batch_size: batch, replay_capacity: 1, learning_starts: 1, ..Default::default() };
        let trainer = DqnTrainer::new(cfg, device)?;
        let b = batch;
        let actions: Vec<u32> = uniforms(0, 3, b).iter().map(|u| ((u * 3.0) as u32).min(2)).collect();
        let dones: Vec<f32> = uniforms(0, 4, b).iter().map(|&u| if u < 0.05 { 1.0 } else { 0.0 }).collect();
        Ok(Self {
            s: states(device, b, 0, 1)?,
            s2: states(device, b, 0, 2)?,
            a: Tensor::from_vec(actions, b, device)?,
            r: Tensor::from_vec(normals(0, 5, b), b, device)?,
            d: Tensor::from_vec(dones, b, device)?,
            trainer,
        })
    }
}

impl Stepper for DqnStepper {
    fn params(&self) -> usize {
        self.trainer.online().params().num_elements()
    }

    fn step(&mut self) -> Result<StepOut> {
        let st = self.trainer.update(DqnBatch {
            obs: &self.s,
            actions: &self.a,
            rewards: &self.r,
            next_obs: &self.s2,
            dones: &self.d,
        })?;
        Ok(StepOut { loss: st.loss, skipped: st.skipped })
    }
}

struct PpoStepper {
    trainer: PpoTrainer,
    s: Tensor,
    a: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    ret: Tensor,
}

impl PpoStepper {
    fn new(device: &Device, batch: usize, precision: Precision) -> Result<Self> {
        // One environment, one rollout step: the rollout storage is not used by
        // `update_minibatch` and stays negligible.
        let cfg = PpoConfig { precision, minibatch_size: batch, num_steps: 1, ..Default::default() };
        let trainer = PpoTrainer::new(cfg, 1, device)?;
        let b = batch;
        let actions: Vec<u32> = uniforms(1, 3, b).iter().map(|u| ((u * 3.0) as u32).min(2)).collect();
        let logp: Vec<f32> = normals(1, 6, b).iter().map(|z| (1.0f32 / 3.0).ln() + 0.1 * z).collect();
        Ok(Self {
            s: states(device, b, 1, 1)?,
            a: Tensor::from_vec(actions, b, device)?,
            logp_old: Tensor::from_vec(logp, b, device)?,
            adv: Tensor::from_vec(normals(1, 7, b), b, device)?,
            ret: Tensor::from_vec(normals(1, 8, b), b, device)?,
            trainer,
        })
    }
}

impl Stepper for PpoStepper {
    fn params(&self) -> usize {
        self.trainer.model().params().num_elements()
    }

    fn step(&mut self) -> Result<StepOut> {
        let st = self.trainer.update_minibatch(PpoBatch {
            obs: &self.s,
            actions: &self.a,
            logp_old: &self.logp_old,
            advantages: &self.adv,
            returns: &self.ret,
        })?;
        Ok(StepOut { loss: st.loss, skipped: st.skipped })
    }
}

/// One training case: build (inside the memory window, like bench.py), a first step,
/// `warmup` steps, then `steps` timed steps. Fills `rec` (which already holds the case's
/// identity fields).
pub(crate) fn train_case(
    ctx: &mut Ctx,
    model: Model,
    batch: usize,
    precision: Precision,
    rec: &mut Record,
) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let mut stepper: Box<dyn Stepper> = match model {
        Model::Dqn => Box::new(DqnStepper::new(&dev, batch, precision).context("building the DQN case")?),
        Model::Ppo => Box::new(PpoStepper::new(&dev, batch, precision).context("building the PPO case")?),
    };
    rec.insert("params".into(), json!(stepper.params()));
    rec.insert("precision".into(), json!(precision.to_string()));

    dev.synchronize()?;
    let t0 = Instant::now();
    let first = stepper.step()?;
    dev.synchronize()?;
    let first_s = t0.elapsed().as_secs_f64();
    for _ in 0..ctx.warmup {
        stepper.step()?;
    }
    let mut last = StepOut { loss: first.loss, skipped: first.skipped };
    let mut skipped = 0usize;
    let (ts, wall) = ctx.timer.time_steps(&dev, ctx.steps, || {
        last = stepper.step()?;
        skipped += last.skipped as usize;
        Ok(())
    })?;
    let peak = ctx.mem.peak_mib(&dev)?;
    ensure!(
        first.loss.is_finite() && last.loss.is_finite(),
        "non-finite loss (first {}, last {})",
        first.loss,
        last.loss
    );
    ensure!(skipped < ts.len(), "every timed step was skipped by the NaN/Inf guard");
    let med = pct(&ts, 50.0);
    let b = batch as f64;
    rec.insert("status".into(), json!("ok"));
    rec.insert("steps_timed".into(), json!(ts.len()));
    rec.insert("step_ms_median".into(), json!(round(med, 4)));
    rec.insert("step_ms_p10".into(), json!(round(pct(&ts, 10.0), 4)));
    rec.insert("step_ms_p90".into(), json!(round(pct(&ts, 90.0), 4)));
    rec.insert("samples_per_s".into(), json!(round(b / (med / 1e3), 1)));
    rec.insert("samples_per_s_wall".into(), json!(round(b * ts.len() as f64 / wall, 1)));
    rec.insert("first_step_s".into(), json!(round(first_s, 3)));
    rec.insert("peak_mem_mib".into(), json!(peak.map(|m| round(m, 1))));
    rec.insert("mem_baseline_mib".into(), json!(ctx.mem.baseline_mib().map(|m| round(m, 1))));
    rec.insert("peak_reserved_mib".into(), json!(ctx.mem.peak_reserved_mib()?.map(|m| round(m, 1))));
    rec.insert("loss_first".into(), json!(first.loss));
    rec.insert("loss_last".into(), json!(last.loss));
    rec.insert("skipped_steps".into(), json!(skipped));
    Ok(())
}

/// Batch-1 latency: greedy action (forward without a tape + argmax) on a state already
/// on the device, each call timed on the host up to a device synchronisation.
pub(crate) fn latency_case(ctx: &mut Ctx, model: Model, rec: &mut Record) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let x = states(&dev, 1, 9, 1)?;
    let call: Box<dyn Fn() -> Result<Tensor>> = match model {
        Model::Dqn => {
            let net = DuelingDqn::new(DqnNetConfig::default(), &dev, 0)?;
            rec.insert("params".into(), json!(net.params().num_elements()));
            Box::new(move || Ok(net.greedy_actions(&x)?))
        }
        Model::Ppo => {
            let net = ActorCritic::new(PpoNetConfig::default(), &dev, 0)?;
            rec.insert("params".into(), json!(net.params().num_elements()));
            Box::new(move || Ok(net.greedy_actions(&x)?))
        }
    };
    let a = call()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    ensure!(a.len() == 1 && a[0] < 3, "greedy action out of range: {a:?}");
    for _ in 0..ctx.lat_warm {
        call()?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(ctx.lat_n);
    for _ in 0..ctx.lat_n {
        let t0 = Instant::now();
        let out = call()?;
        dev.synchronize()?;
        ts.push(t0.elapsed().as_secs_f64() * 1e6);
        drop(out);
    }
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
