//! `fx-train train` and the default command: data → environment → agent → checkpoints →
//! backtest report.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use serde_json::json;

use crate::agent::Agent;
use crate::config::RunConfig;
use crate::dataset::Dataset;
use crate::report;
use crate::run_dir::{RunDir, RunState};
use crate::train_env::TrainEnv;

/// Set by the Ctrl-C handler; the loop checkpoints and stops at the next step.
pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Exit status of a run stopped by Ctrl-C after its checkpoint was written.
pub const EXIT_INTERRUPTED: u8 = 130;

pub struct TrainOptions {
    pub resume: bool,
    pub quiet: bool,
    /// `--steps` when given on the command line: on `--resume` it replaces the saved run's
    /// step count (to extend a run); otherwise the saved config is used unchanged.
    pub steps: Option<u64>,
}

/// How a run ended.
pub enum Outcome {
    Finished,
    Interrupted,
}

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
    /// Writing checkpoints and metrics.
    pub checkpoint_and_logging: f64,
    /// Of `checkpoint_and_logging`: copying the trainer's state to host memory (waits for
    /// the device's queued work, then the transfers).
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

/// The candle device a config asks for (`FX_DEVICE` was folded into the config already).
/// `auto` falls back to the CPU; an explicit `cuda` / `cuda:N` that cannot be had is an
/// error naming why, never a silent CPU run.
pub fn device_for(cfg: &RunConfig) -> Result<Device> {
    let overrides = fx_hw::Overrides::default().try_with_device(&cfg.device)?;
    let budget = fx_hw::HardwareBudget::detect_with(&overrides);
    let wants_gpu = matches!(overrides.device.as_ref().map(|d| d.value), Some(fx_hw::DeviceRequest::Cuda(_)));
    if wants_gpu && budget.device.value == fx_hw::DeviceKind::Cpu {
        bail!(
            "device {} is not available: {}",
            cfg.device,
            budget.cpu_fallback_reason.as_deref().unwrap_or("no CUDA device")
        );
    }
    match budget.device.value {
        fx_hw::DeviceKind::Cpu => Ok(Device::Cpu),
        fx_hw::DeviceKind::Cuda(n) => Ok(Device::new_cuda(n)?),
    }
}

pub fn run(cfg: RunConfig, opts: TrainOptions) -> Result<Outcome> {
    if crate::seq_run::is_sequence_run(&cfg, &opts) {
        return crate::seq_run::run(cfg, opts);
    }
    let mut profile = Profile::default();
    let mut start = crate::run_start::RunStart::open(cfg, &opts)?;
    let mut batch_line = Some(start.settle_batch(None)?);

    let t = Instant::now();
    let data = Dataset::load(&start.cfg, start.saved_normalizer()?)?;
    start.check_source(&data.source)?;
    let train_rows = data.env_data(data.splits.train.clone())?;
    profile.data_prep = t.elapsed().as_secs_f64();

    let device = start.device.clone();
    let mut env = TrainEnv::new(train_rows, start.cfg.env.clone(), &device)?;
    let mut agent = match &start.checkpoint {
        Some(c) => {
            let state = c.run.env.as_ref().with_context(|| format!("{}: no environment state", c.trainer.display()))?;
            env.restore(state).with_context(|| format!("restoring the environment from {}", c.trainer.display()))?;
            Agent::load(start.cfg.model, &c.trainer, &device)?
        }
        None => Agent::new(&start.cfg, env.num_envs(), &device)?,
    };
    start.record_config(&opts)?;
    let crate::run_start::RunStart { t_start, dir, cfg, checkpoint, .. } = start;
    let mut metrics = dir.metrics(checkpoint.as_ref().map(|c| c.run.env_steps))?;
    let prior_seconds = checkpoint.as_ref().map_or(0.0, |c| c.run.train_seconds);

    let quiet = opts.quiet || !std::io::stdout().is_terminal();
    let prefix = format!("train {}", cfg.model.as_str());
    let bar = crate::progress::bar(prefix, cfg.steps, agent.env_steps(), "env steps", quiet);
    install_ctrlc();

    let e = env.num_envs() as u64;
    // Peak device memory since the loop started (null on the CPU).
    let mut mem = crate::device_memory::MemProbe::for_device(&device);
    mem.start(&device)?;
    let mut busy = crate::gpu_busy::GpuBusy::for_device(&device);
    let t_loop = Instant::now();
    let (mut samples_since, mut since) = (0u64, Instant::now());
    let mut last_log_steps = agent.env_steps();
    let mut next_log = next_multiple(agent.env_steps(), cfg.log_every);
    let mut next_ckpt = next_multiple(agent.env_steps(), cfg.checkpoint_every);
    let mut interrupted = false;
    // Checkpoints during the loop are written by a thread of their own: the loop only takes
    // the snapshot (device-to-host copies). The final one is written before the run ends.
    let mut writer = crate::run_dir::CheckpointWriter::default();
    let mut save = |agent: &Agent, env: &TrainEnv, profile: &mut Profile, secs: f64, last: bool| -> Result<()> {
        let t = Instant::now();
        let run =
            RunState::new(cfg.model, agent.env_steps(), env.state()?, &data.normalizer, data.source.clone(), secs);
        let snapshot = agent.snapshot()?;
        profile.checkpoint_snapshot += t.elapsed().as_secs_f64();
        let waited = Instant::now();
        writer.wait()?;
        profile.checkpoint_wait += waited.elapsed().as_secs_f64();
        writer.submit(dir.checkpoint_files(), run, cfg.keep_checkpoints, snapshot)?;
        if last {
            writer.wait()?;
        }
        profile.checkpoint_and_logging += t.elapsed().as_secs_f64();
        Ok(())
    };
    while agent.env_steps() < cfg.steps {
        if INTERRUPTED.load(Ordering::SeqCst) {
            interrupted = true;
            break;
        }
        // Only the steps that are logged read statistics back (one DQN env step per call),
        // so the host is not made to wait for the GPU twice per step.
        let read = agent.env_steps() + 1 >= next_log.min(cfg.steps);
        let p = agent.advance_with(env.as_vec_env(), read).map_err(|e| with_oom_hint(e, &cfg))?;
        profile.env_collect += p.collect_seconds;
        profile.update += p.update_seconds;
        samples_since += p.update_samples;
        let steps = agent.env_steps();
        bar.set_position(steps.min(cfg.steps));
        if steps >= next_log {
            let t = Instant::now();
            let dt = since.elapsed().as_secs_f64().max(1e-9);
            let mut rec = p.metrics.clone();
            rec.insert("env_steps".into(), json!(steps));
            let (updates, skipped) = agent.update_counts();
            rec.insert("updates".into(), json!(updates));
            rec.insert("skipped_steps".into(), json!(skipped));
            rec.insert("train_samples_per_s".into(), json!(samples_since as f64 / dt));
            rec.insert("env_samples_per_s".into(), json!(((steps - last_log_steps) * e) as f64 / dt));
            last_log_steps = steps;
            rec.insert("gpu_mem_peak_mib".into(), json!(mem.peak_mib(&device)?));
            rec.insert("gpu_busy_fraction".into(), json!(busy.interval()));
            rec.insert("elapsed_s".into(), json!(prior_seconds + t_loop.elapsed().as_secs_f64()));
            if let Some(b) = batch_line.take() {
                rec.insert("batch_size".into(), json!(b.value));
                rec.insert("batch_source".into(), json!(b.source.as_str()));
            }
            metrics.write(&serde_json::Value::Object(rec))?;
            if let Some(loss) = p.loss {
                bar.set_message(format!("loss {loss:.4} | {:.0} samples/s", samples_since as f64 / dt));
            }
            samples_since = 0;
            since = Instant::now();
            next_log = next_multiple(steps, cfg.log_every);
            profile.checkpoint_and_logging += t.elapsed().as_secs_f64();
        }
        if steps >= next_ckpt {
            save(&agent, &env, &mut profile, prior_seconds + t_loop.elapsed().as_secs_f64(), false)?;
            next_ckpt = next_multiple(steps, cfg.checkpoint_every);
        }
    }
    bar.finish_and_clear();
    profile.gpu_busy_fraction = busy.total();
    profile.gpu_busy_unavailable = busy.unavailable.take();
    // The final state is always on disk (end of run, or Ctrl-C).
    save(&agent, &env, &mut profile, prior_seconds + t_loop.elapsed().as_secs_f64(), true)?;
    if interrupted {
        eprintln!(
            "interrupted at step {}: checkpoint written to {}; continue with `fx-train train --resume --out {}`",
            agent.env_steps(),
            dir.root().display(),
            dir.root().display()
        );
        return Ok(Outcome::Interrupted);
    }

    let (fwd, times) = agent.update_times();
    profile.update_forward = fwd;
    profile.update_backward = times.backward;
    profile.update_device_wait = times.device_wait;
    profile.update_optimizer = times.optimizer;
    let t = Instant::now();
    let rep = report::evaluate(&cfg, &data, &agent, &device)?;
    profile.evaluation = t.elapsed().as_secs_f64();
    profile.total = t_start.elapsed().as_secs_f64();
    let accounted =
        profile.data_prep + profile.env_collect + profile.update + profile.checkpoint_and_logging + profile.evaluation;
    profile.other = (profile.total - accounted).max(0.0);
    report::write(&dir, "report.json", &cfg, &data, &rep, Some(&profile), true)?;
    report::print(&rep, Some(&profile), &dir);
    Ok(Outcome::Finished)
}

/// A device out-of-memory error, restated with the batch the hardware budget says fits.
pub(crate) fn with_oom_hint(e: anyhow::Error, cfg: &RunConfig) -> anyhow::Error {
    let text = format!("{e:#}");
    if !(text.contains("OUT_OF_MEMORY") || text.to_ascii_lowercase().contains("out of memory")) {
        return e;
    }
    let batch = cfg.batch_key_value();
    let overrides = fx_hw::Overrides::default().with_device(&cfg.device);
    let fits = fx_hw::HardwareBudget::detect_with(&overrides).batch_size(crate::batch::model_kind(cfg.model)).value;
    anyhow::anyhow!(
        "the device ran out of memory at batch {batch}; the hardware budget says batch {fits} fits \
         (`fx-train hw`): start the run again with --batch-size {fits} (or batch = {fits} in the config) \
         (driver said: {})",
        text.lines().next().unwrap_or_default()
    )
}

fn next_multiple(steps: u64, every: u64) -> u64 {
    (steps / every + 1) * every
}

pub(crate) fn install_ctrlc() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Ctrl-C (SIGINT), and SIGTERM / SIGHUP (what Kubernetes, Slurm and a closed
        // terminal send; ctrlc's `termination` feature): the first asks the loop to
        // checkpoint and stop; a second (e.g. during data preparation or the final
        // backtest, where nothing polls the flag) exits now. If a handler cannot be
        // installed the run still works; a signal then kills it and --resume continues
        // from the last periodic checkpoint.
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                std::process::exit(i32::from(EXIT_INTERRUPTED));
            }
        });
    });
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
        bail!("{} holds no checkpoint yet", run.display());
    };
    c.check_model(cfg.model, "config.toml says")?;
    let device = device_for(&cfg)?;
    let data = Dataset::load(&cfg, Some(c.run.normalizer()?))?;
    c.check_source(&data.source, "config.toml now names")?;
    let agent = Agent::load(cfg.model, &c.trainer, &device)?;
    let rep = report::evaluate(&cfg, &data, &agent, &device)?;
    report::write(&dir, "eval.json", &cfg, &data, &rep, None, false)?;
    report::print(&rep, None, &dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_errors_name_a_batch_that_fits() {
        let cfg = RunConfig { device: "cpu".into(), ..RunConfig::default() };
        let e = with_oom_hint(anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"), &cfg);
        let msg = e.to_string();
        assert!(msg.contains("batch 256") && msg.contains("--batch-size ") && msg.contains("batch = "), "{msg}");
        let other = with_oom_hint(anyhow::anyhow!("shape mismatch"), &cfg);
        assert_eq!(other.to_string(), "shape mismatch");
    }
}
