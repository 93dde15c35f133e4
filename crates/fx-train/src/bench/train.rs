//! Training-step cases, through the library's own trainers:
//! [`DqnTrainer::update`] (online forward on s and s', target forward, double-DQN Huber
//! loss, backward, clip 10, AdamW, soft target update) and
//! [`PpoTrainer::update_minibatch`] (forward, PPO loss, backward, clip 0.5, Adam). Eager
//! modes go through fx-precision's `TrainStep`, which reads the loss and gradient norm back
//! to the host once per step (the NaN/Inf guard), a transfer bench.py's steps do not have.
//! Graph modes (CUDA) replay the trainers' captured update (`update_queued`: the fused
//! update for DQN F32/BF16 and PPO F32, candle's ops otherwise, with the device-side
//! `FusedStep`) and read nothing until the case ends.

use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use fx_models::seq::{Mamba2Task, SeqBatch, SeqTask, SeqTrainConfig, SeqTrainer};
use fx_models::{
    DqnBatch, DqnConfig, DqnPopulation, DqnTrainer, Mamba2, Mamba2Config, PopBatch, PpoBatch, PpoConfig, PpoPopBatch,
    PpoPopulation, PpoTrainer, Tft, TftConfig,
};
use fx_precision::{GraphMode, Precision};
use serde_json::json;

use super::data::{normals, states, uniforms};
use super::timing::{pct, round};
use super::{Ctx, Model, Record};

/// The mode name of a precision, eager or captured (bench.py's names, so rows line up).
pub(crate) fn mode_name(p: Precision, graph: bool) -> &'static str {
    match (p, graph) {
        (Precision::F32, false) => "eager_fp32",
        (Precision::Bf16, false) => "eager_bf16",
        (Precision::F16, false) => "eager_fp16",
        (Precision::F32, true) => "graph_fp32",
        (Precision::Bf16, true) => "graph_bf16",
        (Precision::F16, true) => "graph_fp16",
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
    /// One update; `None` when it was only queued (a captured graph reads nothing back).
    fn step(&mut self) -> Result<Option<StepOut>>;
    /// For queued updates: the device-side statistics (last loss, steps skipped so far).
    fn summary(&mut self) -> Result<Option<(f64, usize)>>;
    /// Launches per captured update (graph nodes), if captured.
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(None)
    }
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
    fn new(device: &Device, batch: usize, precision: Precision, graph: bool) -> Result<Self> {
        // The replay buffer is not used by `update`; keep it tiny so it does not count
        // towards the case's memory.
        let cfg = DqnConfig {
            precision,
            batch_size: batch,
            replay_capacity: 1,
            learning_starts: 1,
            graph: if graph { GraphMode::On } else { GraphMode::Off },
            ..Default::default()
        };
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
    #[cfg(feature = "cuda")]
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(self.trainer.graph_nodes()?)
    }

    fn params(&self) -> usize {
        self.trainer.online().params().param_count()
    }

    fn step(&mut self) -> Result<Option<StepOut>> {
        let batch = DqnBatch { obs: &self.s, actions: &self.a, rewards: &self.r, next_obs: &self.s2, dones: &self.d };
        #[cfg(feature = "cuda")]
        if self.trainer.config().graph == GraphMode::On {
            ensure!(self.trainer.graph_ready(batch)?, "the DQN update was not captured");
            self.trainer.update_queued(batch)?;
            return Ok(None);
        }
        let st = self.trainer.update(batch)?;
        Ok(Some(StepOut { loss: st.loss, skipped: st.skipped }))
    }

    fn summary(&mut self) -> Result<Option<(f64, usize)>> {
        #[cfg(feature = "cuda")]
        if let Some(st) = self.trainer.graph_stats()? {
            return Ok(Some((st.last_loss, st.guard.skipped() as usize)));
        }
        Ok(None)
    }
}

/// N DQN runs as one population on fixed per-member data (bench.py's `build_pop`: γ spread
/// over [0.981, 0.999], every member its own seed and data).
struct PopStepper {
    pop: DqnPopulation,
    batch: PopBatch,
}

impl PopStepper {
    fn new(device: &Device, n: usize, b: usize, precision: Precision, graph: bool) -> Result<Self> {
        let members: Vec<DqnConfig> = (0..n)
            .map(|k| {
                let spread = if n > 1 { -1.0 + 2.0 * k as f64 / (n - 1) as f64 } else { 0.0 };
                DqnConfig {
                    precision,
                    batch_size: b,
                    replay_capacity: 1,
                    learning_starts: 1,
                    seed: k as u64,
                    gamma: 0.99 + 0.009 * spread,
                    ..Default::default()
                }
            })
            .collect();
        let mut pop = DqnPopulation::new(members, device)?;
        let rows = n * b;
        let actions: Vec<u32> = uniforms(0, 3, rows).iter().map(|u| ((u * 3.0) as u32).min(2)).collect();
        let dones: Vec<f32> = uniforms(0, 4, rows).iter().map(|&u| if u < 0.05 { 1.0 } else { 0.0 }).collect();
        let batch = PopBatch {
            obs: states(device, rows, 0, 1)?.reshape((n, b, fx_kernels::OBS_DIM))?,
            next_obs: states(device, rows, 0, 2)?.reshape((n, b, fx_kernels::OBS_DIM))?,
            actions: Tensor::from_vec(actions, (n, b), device)?,
            rewards: Tensor::from_vec(normals(0, 5, rows), (n, b), device)?,
            dones: Tensor::from_vec(dones, (n, b), device)?,
        };
        #[cfg(feature = "cuda")]
        if graph {
            pop.capture_update(&batch)?;
        }
        ensure!(!graph || device.is_cuda(), "graph modes need CUDA");
        let _ = &mut pop;
        Ok(Self { pop, batch })
    }
}

impl Stepper for PopStepper {
    #[cfg(feature = "cuda")]
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(self.pop.graph_nodes()?)
    }

    fn params(&self) -> usize {
        self.pop.online().param_count()
    }

    fn step(&mut self) -> Result<Option<StepOut>> {
        self.pop.update(&self.batch)?;
        Ok(None)
    }

    fn summary(&mut self) -> Result<Option<(f64, usize)>> {
        let last = self.pop.last_update()?;
        let (_, skipped) = self.pop.counters()?;
        let loss = last.loss.iter().sum::<f64>() / last.loss.len() as f64;
        Ok(Some((loss, skipped.iter().sum::<u64>() as usize)))
    }
}

/// N PPO learners as one population on fixed per-member minibatches (bench.py's
/// `build_pop`: the entropy weight spread over [0.005, 0.015], every member its own seed and
/// data).
struct PpoPopStepper {
    pop: PpoPopulation,
    batch: PpoPopBatch,
}

impl PpoPopStepper {
    fn new(device: &Device, n: usize, b: usize, precision: Precision, graph: bool) -> Result<Self> {
        let members: Vec<PpoConfig> = (0..n)
            .map(|k| {
                let spread = if n > 1 { -1.0 + 2.0 * k as f64 / (n - 1) as f64 } else { 0.0 };
                let mut c =
                    PpoConfig { precision, minibatch_size: b, num_steps: 1, seed: k as u64, ..Default::default() };
                c.loss.ent_coef *= 1.0 + 0.5 * spread;
                c
            })
            .collect();
        let mut pop = PpoPopulation::new(members, 1, device).context("building the PPO population")?;
        let rows = n * b;
        let actions: Vec<u32> = uniforms(2, 3, rows).iter().map(|u| ((u * 3.0) as u32).min(2)).collect();
        let logp: Vec<f32> = normals(2, 6, rows).iter().map(|z| (1.0f32 / 3.0).ln() + 0.1 * z).collect();
        let batch = PpoPopBatch {
            obs: states(device, rows, 2, 1)?.reshape((n, b, fx_kernels::OBS_DIM))?,
            actions: Tensor::from_vec(actions, (n, b), device)?,
            logp_old: Tensor::from_vec(logp, (n, b), device)?,
            advantages: Tensor::from_vec(normals(2, 7, rows), (n, b), device)?,
            returns: Tensor::from_vec(normals(2, 8, rows), (n, b), device)?,
        };
        #[cfg(feature = "cuda")]
        if graph {
            pop.capture_update(&batch)?;
        }
        ensure!(!graph || device.is_cuda(), "graph modes need CUDA");
        let _ = &mut pop;
        Ok(Self { pop, batch })
    }
}

impl Stepper for PpoPopStepper {
    #[cfg(feature = "cuda")]
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(self.pop.graph_nodes()?)
    }

    fn params(&self) -> usize {
        self.pop.params().param_count()
    }

    fn step(&mut self) -> Result<Option<StepOut>> {
        self.pop.update_minibatch(&self.batch)?;
        Ok(None)
    }

    fn summary(&mut self) -> Result<Option<(f64, usize)>> {
        let last = self.pop.last_minibatch()?;
        let (_, skipped) = self.pop.counters()?;
        let loss = last.iter().map(|s| s.loss).sum::<f64>() / last.len() as f64;
        Ok(Some((loss, skipped.iter().sum::<u64>() as usize)))
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
    fn new(device: &Device, batch: usize, precision: Precision, graph: bool) -> Result<Self> {
        // One environment, one rollout step: the rollout storage is not used by
        // `update_minibatch` and stays negligible.
        let graph = if graph { GraphMode::On } else { GraphMode::Off };
        let cfg = PpoConfig { precision, minibatch_size: batch, num_steps: 1, graph, ..Default::default() };
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
    #[cfg(feature = "cuda")]
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(self.trainer.graph_nodes()?)
    }

    fn params(&self) -> usize {
        self.trainer.model().params().param_count()
    }

    fn step(&mut self) -> Result<Option<StepOut>> {
        let batch = PpoBatch {
            obs: &self.s,
            actions: &self.a,
            logp_old: &self.logp_old,
            advantages: &self.adv,
            returns: &self.ret,
        };
        #[cfg(feature = "cuda")]
        if self.trainer.config().graph == GraphMode::On {
            ensure!(self.trainer.graph_ready(batch)?, "the PPO update was not captured");
            self.trainer.update_queued(batch)?;
            return Ok(None);
        }
        let st = self.trainer.update_minibatch(batch)?;
        Ok(Some(StepOut { loss: st.loss, skipped: st.skipped }))
    }

    fn summary(&mut self) -> Result<Option<(f64, usize)>> {
        #[cfg(feature = "cuda")]
        if let Some(st) = self.trainer.graph_stats()? {
            return Ok(Some((st.last_loss, st.guard.skipped() as usize)));
        }
        Ok(None)
    }
}

/// The sequence models under test (the trainer does not own its model). One lives per
/// bench case, so the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum SeqNet {
    Tft(Tft),
    Mamba2(Mamba2, usize),
}

/// `SeqTrainer::train_step` on one fixed batch, as bench.py steps its TFT and MAMBA-2
/// (fixed random inputs: forward with dropout, loss, backward, clip at norm 1, AdamW).
struct SeqStepper {
    net: SeqNet,
    trainer: SeqTrainer,
    batch: SeqBatch,
    graph: bool,
}

/// MAMBA-2's sequence length in the training case (bench.py's `seq`).
pub(crate) const MAMBA2_SEQ_LEN: usize = 256;

impl SeqStepper {
    fn new(device: &Device, model: Model, batch: usize, precision: Precision, graph: bool) -> Result<Self> {
        let cfg = SeqTrainConfig {
            batch_size: batch,
            precision,
            graph: if graph { GraphMode::On } else { GraphMode::Off },
            ..Default::default()
        };
        let b = batch;
        let tensor = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, device);
        let (net, inputs, target) = match model {
            Model::Tft => {
                let tc = TftConfig::default();
                let (l, h) = (tc.l_enc, tc.h);
                let obs = tensor(normals(2, 1, b * l * tc.n_observed), &[b, l, tc.n_observed])?;
                let known: Vec<f32> =
                    normals(2, 2, b * (l + h) * tc.n_known).iter().map(|v| v.clamp(-1.0, 1.0)).collect();
                let known = tensor(known, &[b, l + h, tc.n_known])?;
                let y: Vec<f32> = normals(2, 3, b * h).iter().map(|v| 0.01 * v).collect();
                (SeqNet::Tft(Tft::new(tc, device, 0)?), vec![obs, known], tensor(y, &[b, h])?)
            }
            Model::Mamba2 => {
                let mc = Mamba2Config::default();
                let l = MAMBA2_SEQ_LEN;
                let x = tensor(normals(3, 1, b * l * mc.n_in), &[b, l, mc.n_in])?;
                let y: Vec<f32> = normals(3, 2, b * l).iter().map(|v| 0.01 * v).collect();
                (SeqNet::Mamba2(Mamba2::new(mc, device, 0)?, l), vec![x], tensor(y, &[b, l])?)
            }
            Model::Dqn | Model::Ppo => anyhow::bail!("not a sequence model"),
        };
        let batch = SeqBatch { inputs, last_value: target.clone(), target };
        let trainer = match &net {
            SeqNet::Tft(m) => SeqTrainer::new(m, 0..m.window_len() * 4 + b, &cfg)?,
            SeqNet::Mamba2(m, l) => SeqTrainer::new(&Mamba2Task { model: m, seq_len: *l }, 0..l * 4 + b, &cfg)?,
        };
        Ok(Self { net, trainer, batch, graph })
    }

    fn params(&self) -> &fx_models::params::ParamStore {
        match &self.net {
            SeqNet::Tft(m) => m.params(),
            SeqNet::Mamba2(m, _) => m.params(),
        }
    }
}

impl Stepper for SeqStepper {
    #[cfg(feature = "cuda")]
    fn graph_nodes(&self) -> Result<Option<usize>> {
        Ok(self.trainer.graph_nodes()?)
    }

    fn params(&self) -> usize {
        self.params().param_count()
    }

    fn step(&mut self) -> Result<Option<StepOut>> {
        // Graph modes read nothing back per step; eager steps read their loss anyway.
        let loss = match &self.net {
            SeqNet::Tft(m) => self.trainer.train_step(m, &self.batch, false)?,
            SeqNet::Mamba2(m, l) => {
                self.trainer.train_step(&Mamba2Task { model: m, seq_len: *l }, &self.batch, false)?
            }
        };
        #[cfg(feature = "cuda")]
        if self.graph {
            ensure!(self.trainer.graph_nodes()?.is_some(), "the sequence-model step was not captured");
        }
        Ok(loss.map(|loss| StepOut { loss, skipped: false }))
    }

    fn summary(&mut self) -> Result<Option<(f64, usize)>> {
        #[cfg(feature = "cuda")]
        if let Some(st) = self.trainer.graph_stats()? {
            return Ok(Some((st.last_loss, st.guard.skipped() as usize)));
        }
        let _ = self.graph;
        Ok(None)
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
    graph: bool,
    rec: &mut Record,
) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let stepper: Box<dyn Stepper> = match model {
        Model::Dqn => Box::new(DqnStepper::new(&dev, batch, precision, graph).context("building the DQN case")?),
        Model::Ppo => Box::new(PpoStepper::new(&dev, batch, precision, graph).context("building the PPO case")?),
        Model::Tft | Model::Mamba2 => Box::new(
            SeqStepper::new(&dev, model, batch, precision, graph)
                .with_context(|| format!("building the {} case", model.name()))?,
        ),
    };
    time_stepper(ctx, stepper, batch, precision, rec)?;
    if model == Model::Mamba2 {
        let med = rec.get("step_ms_median").and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        rec.insert("seq_len".into(), json!(MAMBA2_SEQ_LEN));
        rec.insert("tokens_per_s".into(), json!(round(batch as f64 / (med / 1e3) * MAMBA2_SEQ_LEN as f64, 1)));
    }
    Ok(())
}

/// A population case: `members` DQN runs or PPO learners at `batch` each (see the module docs).
pub(crate) fn pop_case(
    ctx: &mut Ctx,
    model: Model,
    members: usize,
    batch: usize,
    precision: Precision,
    graph: bool,
    rec: &mut Record,
) -> Result<()> {
    ctx.mem.start(&ctx.device)?;
    let dev = ctx.device.clone();
    let stepper: Box<dyn Stepper> = match model {
        Model::Dqn => Box::new(PopStepper::new(&dev, members, batch, precision, graph)?),
        Model::Ppo => Box::new(PpoPopStepper::new(&dev, members, batch, precision, graph)?),
        other => bail!("no population case for {}", other.name()),
    };
    time_stepper(ctx, stepper, members * batch, precision, rec)
}

/// Times `stepper` (a first step, `warmup` steps, then `steps` timed ones) and fills `rec`;
/// `samples` is what one step trains on.
fn time_stepper(
    ctx: &mut Ctx,
    mut stepper: Box<dyn Stepper>,
    samples: usize,
    precision: Precision,
    rec: &mut Record,
) -> Result<()> {
    let dev = ctx.device.clone();
    rec.insert("params".into(), json!(stepper.params()));
    rec.insert("precision".into(), json!(precision.to_string()));

    dev.synchronize()?;
    let t0 = Instant::now();
    // The first step of a graph case includes its capture.
    let first = stepper.step()?;
    dev.synchronize()?;
    let first_s = t0.elapsed().as_secs_f64();
    let first_loss = match first {
        Some(out) => out.loss,
        None => stepper.summary()?.map_or(f64::NAN, |s| s.0),
    };
    for _ in 0..ctx.warmup {
        stepper.step()?;
    }
    let mut last = StepOut { loss: first_loss, skipped: false };
    let mut skipped = 0usize;
    let (ts, wall) = ctx.timer.time_steps(&dev, ctx.steps, || {
        if let Some(out) = stepper.step()? {
            skipped += out.skipped as usize;
            last = out;
        }
        Ok(())
    })?;
    if let Some((loss, skips)) = stepper.summary()? {
        last.loss = loss;
        skipped = skips;
    }
    let peak = ctx.mem.peak_mib(&dev)?;
    ensure!(
        first_loss.is_finite() && last.loss.is_finite(),
        "non-finite loss (first {}, last {})",
        first_loss,
        last.loss
    );
    ensure!(skipped < ts.len(), "every timed step was skipped by the NaN/Inf guard");
    let med = pct(&ts, 50.0);
    let b = samples as f64;
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
    rec.insert("loss_first".into(), json!(first_loss));
    rec.insert("loss_last".into(), json!(last.loss));
    rec.insert("skipped_steps".into(), json!(skipped));
    if let Some(n) = stepper.graph_nodes()? {
        rec.insert("graph_nodes".into(), json!(n));
    }
    Ok(())
}
