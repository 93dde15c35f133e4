//! The RL runs (DQN, PPO) as a [`RunTask`] of the shared lifecycle: the training
//! environment over the training split and the agent; a chunk is one DQN env step (and its
//! updates) or one PPO iteration; metrics and checkpoints every `log_every` /
//! `checkpoint_every` env steps (checkpoints written by a thread of their own); the report
//! is the backtest of the test split. Also `fx-train eval` (a sequence run's goes on in
//! `seq_run::eval`).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use serde_json::{json, Map, Value};

use crate::agent::{Agent, Progress};
use crate::config::RunConfig;
use crate::dataset::Dataset;
use crate::lifecycle::{BarSpec, Chunk, ChunkCtx, RunTask, Timings};
use crate::report;
use crate::run_dir::{CheckpointWriter, RunDir, RunState};
use crate::run_start::{device_for, RunStart};
use crate::train_env::TrainEnv;

/// Wall-clock split of a run (seconds).
#[derive(Default, serde::Serialize)]
pub struct Profile {
    /// Loading/computing features, splitting, normalising (the RL data pipeline).
    pub data_prep: f64,
    /// Choosing actions (policy forward), stepping the environment, writing transitions.
    pub env_collect: f64,
    /// Optimiser steps: forward, loss, backward, clipping, optimiser, target update; the
    /// four fields below split it (host clock; on a GPU the device's work on forward and
    /// backward finishes inside `update_device_wait`, see `fx_precision::StepTimes`).
    pub update: f64,
    /// Building the loss (the networks' forward passes).
    pub update_forward: f64,
    /// Recording the backward pass (and running it, on the CPU).
    pub update_backward: f64,
    /// The one device-to-host read per step (the NaN/Inf guard), which waits for the device.
    pub update_device_wait: f64,
    /// Unscale, clip and the optimiser (and, for DQN, the soft target update is in `update`).
    pub update_optimizer: f64,
    /// PPO: `update`'s host phases (the critic's last values, GAE and permutations;
    /// queueing the epochs; waiting for the device; reading the rollout's statistics). On a
    /// GPU the device idles in whatever part of the first, second and last it has no work
    /// queued for. Null for DQN.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub update_phases: Option<fx_models::UpdatePhases>,
    /// Writing checkpoints and metrics.
    pub checkpoint_and_logging: f64,
    /// Of `checkpoint_and_logging`: waiting for the device's queued work before a
    /// checkpoint (the GPU is busy then, not idle).
    pub checkpoint_device_wait: f64,
    /// Of `checkpoint_and_logging`: copying the environment's and trainer's state to host
    /// memory once the device is idle (the GPU waits for the host meanwhile).
    pub checkpoint_snapshot: f64,
    /// Of `checkpoint_and_logging`: waiting for the writer thread to finish the previous
    /// checkpoint before handing it the next.
    pub checkpoint_wait: f64,
    /// The backtest of the test split.
    pub evaluation: f64,
    /// Everything else (setup, progress display).
    pub other: f64,
    pub total: f64,
    /// GPU runs: the share of the training loop's time in which a kernel ran on the GPU (the
    /// driver's utilisation samples, see `gpu_busy`); null on the CPU or without NVML.
    pub gpu_busy_fraction: Option<f64>,
    /// Why `gpu_busy_fraction` is null on a GPU run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_busy_unavailable: Option<String>,
}

/// A DQN or PPO run being trained.
pub(crate) struct RlTask {
    cfg: RunConfig,
    device: Device,
    data: Arc<Dataset>,
    env: TrainEnv,
    agent: Agent,
    /// This task's share of the profile (collection, updates, checkpoint snapshots).
    profile: Profile,
    /// Checkpoints during the loop are written by a thread of their own: the loop only
    /// takes the snapshot (device-to-host copies). The last one is on disk before the
    /// run ends.
    writer: CheckpointWriter,
    /// The latest chunk's progress, for its metrics line.
    last: Progress,
    /// Since the previous metrics line: optimiser samples, when it started (set at the
    /// first chunk), env steps at it.
    samples_since: u64,
    since: Option<Instant>,
    last_log_steps: u64,
    next_log: u64,
    next_ckpt: u64,
}

impl RunTask for RlTask {
    type Data = Dataset;
    const CHECKPOINT_FIRST: bool = false;
    const CHECKPOINT_LAST: bool = true;

    fn load_data(start: &RunStart) -> Result<Dataset> {
        Dataset::load(&start.cfg, start.saved_normalizers()?)
    }

    fn data_source(data: &Dataset) -> &str {
        &data.source
    }

    fn build(start: &mut RunStart, data: &Arc<Dataset>) -> Result<Self> {
        start.settle_batch(None)?;
        let (cfg, device) = (start.cfg.clone(), start.device.clone());
        let train_rows = data.env_data(data.splits.train.clone(), cfg.env.episode_len + 1)?;
        let mut env = TrainEnv::new(train_rows, cfg.env.clone(), &device)?;
        let agent = match &start.checkpoint {
            Some(c) => {
                let state =
                    c.run.env.as_ref().with_context(|| format!("{}: no environment state", c.trainer.display()))?;
                env.restore(state)
                    .with_context(|| format!("restoring the environment from {}", c.trainer.display()))?;
                Agent::load(cfg.model, &c.trainer, &device)?
            }
            None => {
                let mut agent = Agent::new(&cfg, env.num_envs(), &device)?;
                if let Some(from) = &cfg.init_from {
                    agent.warm_start(from)?;
                }
                agent
            }
        };
        let steps = agent.env_steps();
        Ok(Self {
            next_log: next_multiple(steps, cfg.log_every),
            next_ckpt: next_multiple(steps, cfg.checkpoint_every),
            last_log_steps: steps,
            cfg,
            device,
            data: data.clone(),
            env,
            agent,
            profile: Profile::default(),
            writer: CheckpointWriter::default(),
            last: Progress::default(),
            samples_since: 0,
            since: None,
        })
    }

    fn bar(&self) -> BarSpec {
        BarSpec { len: self.cfg.steps, pos: self.agent.env_steps(), unit: "env steps" }
    }

    fn is_done(&self) -> bool {
        self.agent.env_steps() >= self.cfg.steps
    }

    fn step_chunk(&mut self, ctx: &ChunkCtx) -> Result<Chunk> {
        self.since.get_or_insert_with(Instant::now);
        // Only the steps that are logged read statistics back (one DQN env step per call),
        // so the host is not made to wait for the GPU twice per step.
        let read = self.agent.env_steps() + 1 >= self.next_log.min(self.cfg.steps);
        let p = self.agent.advance_with(self.env.as_vec_env(), read)?;
        self.profile.env_collect += p.collect_seconds;
        self.profile.update += p.update_seconds;
        self.samples_since += p.update_samples;
        self.last = p;
        let steps = self.agent.env_steps();
        ctx.bar.set_position(steps.min(self.cfg.steps));
        let checkpoint = steps >= self.next_ckpt;
        if checkpoint {
            self.next_ckpt = next_multiple(steps, self.cfg.checkpoint_every);
        }
        Ok(Chunk::Trained { log: steps >= self.next_log, checkpoint })
    }

    fn metrics(&mut self, ctx: &ChunkCtx) -> Result<Map<String, Value>> {
        let steps = self.agent.env_steps();
        let dt = self.since.map_or(0.0, |t| t.elapsed().as_secs_f64()).max(1e-9);
        let p = &self.last;
        let mut rec = p.metrics.clone();
        rec.insert("env_steps".into(), json!(steps));
        let (updates, skipped) = self.agent.update_counts();
        rec.insert("updates".into(), json!(updates));
        rec.insert("skipped_steps".into(), json!(skipped));
        rec.insert("train_samples_per_s".into(), json!(self.samples_since as f64 / dt));
        let e = self.env.num_envs() as u64;
        rec.insert("env_samples_per_s".into(), json!(((steps - self.last_log_steps) * e) as f64 / dt));
        if let Some(loss) = p.loss {
            ctx.bar.set_message(format!("loss {loss:.4} | {:.0} samples/s", self.samples_since as f64 / dt));
        }
        self.last_log_steps = steps;
        self.samples_since = 0;
        self.since = Some(Instant::now());
        self.next_log = next_multiple(steps, self.cfg.log_every);
        Ok(rec)
    }

    fn checkpoint(&mut self, dir: &RunDir, train_seconds: f64, last: bool) -> Result<()> {
        // The queued work is waited for first, so the snapshot's time is the host's alone.
        let t = Instant::now();
        self.device.synchronize()?;
        self.profile.checkpoint_device_wait += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (cfg, data) = (&self.cfg, &self.data);
        let run = RunState::new(
            cfg.model,
            self.agent.env_steps(),
            self.env.state()?,
            &data.normalizers(),
            data.source.clone(),
            train_seconds,
        );
        let snapshot = self.agent.snapshot()?;
        self.profile.checkpoint_snapshot += t.elapsed().as_secs_f64();
        let waited = Instant::now();
        self.writer.wait()?;
        self.profile.checkpoint_wait += waited.elapsed().as_secs_f64();
        self.writer.submit(dir.checkpoint_files(), run, cfg.keep_checkpoints, snapshot)?;
        if last {
            self.writer.wait()?;
        }
        Ok(())
    }

    fn interrupted_line(&self, dir: &Path) -> String {
        format!(
            "interrupted at step {}: checkpoint written to {}; continue with `fx-train train --resume --out {}`",
            self.agent.env_steps(),
            dir.display(),
            dir.display()
        )
    }

    fn report(self, dir: &RunDir, times: Timings) -> Result<()> {
        let Self { cfg, device, data, agent, mut profile, .. } = self;
        let (fwd, update) = agent.update_times();
        profile.update_forward = fwd;
        profile.update_backward = update.backward;
        profile.update_device_wait = update.device_wait;
        profile.update_optimizer = update.optimizer;
        profile.update_phases = agent.update_phases();
        profile.data_prep = times.data_prep;
        profile.checkpoint_and_logging = times.checkpoint_and_logging;
        profile.gpu_busy_fraction = times.gpu_busy_fraction;
        profile.gpu_busy_unavailable = times.gpu_busy_unavailable;
        let t = Instant::now();
        let rep = report::evaluate(&cfg, &data, &agent, &device)?;
        profile.evaluation = t.elapsed().as_secs_f64();
        profile.total = times.t_start.elapsed().as_secs_f64();
        let accounted = profile.data_prep
            + profile.env_collect
            + profile.update
            + profile.checkpoint_and_logging
            + profile.evaluation;
        profile.other = (profile.total - accounted).max(0.0);
        report::write(dir, "report.json", &cfg, &data, &rep, Some(&profile), true)?;
        report::print(&rep, Some(&profile), dir);
        Ok(())
    }
}

fn next_multiple(steps: u64, every: u64) -> u64 {
    (steps / every + 1) * every
}

/// `fx-train eval`: the latest checkpoint of a run, backtested on its test split
/// (written to `eval.json` in the run folder).
pub fn eval(run: &std::path::Path) -> Result<()> {
    let dir = RunDir::existing(run)?;
    let cfg = RunConfig::from_toml_file(&dir.path("config.toml"))?.resolve()?;
    if cfg.model.is_sequence() {
        return crate::seq_run::eval(&dir, cfg);
    }
    let Some(c) = dir.latest_checkpoint()? else {
        // A population study's member: its final network, its fold's data as it trained on.
        let weights = dir.path(crate::study::MEMBER_WEIGHTS);
        if weights.exists() {
            let data = Dataset::load(&cfg, None)?;
            let greedy = crate::population::saved_member_greedy(&cfg, &weights)?;
            // The env steps its report counted (a PPO member's whole rollouts may pass `steps`).
            let report: Option<serde_json::Value> =
                fx_data::files::read_regular_to_string(&dir.path("report.json"), fx_data::files::MAX_TEXT_BYTES)
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok());
            let steps = report.and_then(|r| r["env_steps"].as_u64()).unwrap_or(cfg.steps);
            let rep = report::evaluate_policy(&cfg, &data, steps, |obs| greedy(obs))?;
            report::write(&dir, "eval.json", &cfg, &data, &rep, None, false)?;
            report::print(&rep, None, &dir);
            return Ok(());
        }
        bail!("{} holds no checkpoint yet", run.display());
    };
    c.check_model(cfg.model, "config.toml says")?;
    let device = device_for(&cfg)?;
    let data = Dataset::load(&cfg, Some(c.run.normalizers()?))?;
    c.check_source(&data.source, "config.toml now names")?;
    let agent = Agent::load(cfg.model, &c.trainer, &device)?;
    let rep = report::evaluate(&cfg, &data, &agent, &device)?;
    report::write(&dir, "eval.json", &cfg, &data, &rep, None, false)?;
    report::print(&rep, None, &dir);
    Ok(())
}
