//! One type over the two RL trainers, so the run loop, checkpoints and evaluation treat
//! DQN and PPO alike.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use fx_kernels::VecEnv;
use fx_models::{DqnTrainer, PpoTrainer};
use serde_json::json;

use crate::config::{ModelChoice, RunConfig};

pub enum Agent {
    Dqn(Box<DqnTrainer>),
    Ppo(Box<PpoTrainer>),
}

/// What one call of [`Agent::advance`] did.
#[derive(Default)]
pub struct Progress {
    /// Metrics of the latest optimiser step(s), for metrics.jsonl and the progress bar.
    pub metrics: serde_json::Map<String, serde_json::Value>,
    /// Latest loss, when an update happened.
    pub loss: Option<f64>,
    /// Optimiser steps done in this call and samples they consumed.
    pub updates: u64,
    pub update_samples: u64,
    pub skipped: u64,
    pub collect_seconds: f64,
    pub update_seconds: f64,
}

impl Agent {
    pub fn new(cfg: &RunConfig, num_envs: usize, device: &Device) -> Result<Self> {
        Ok(match cfg.model {
            ModelChoice::Dqn => Agent::Dqn(Box::new(DqnTrainer::new(cfg.dqn.clone(), device)?)),
            ModelChoice::Ppo => Agent::Ppo(Box::new(PpoTrainer::new(cfg.ppo.clone(), num_envs, device)?)),
            ModelChoice::Tft | ModelChoice::Mamba2 => {
                anyhow::bail!("{} is a sequence model, not an RL agent", cfg.model.as_str())
            }
        })
    }

    /// Starts this fresh agent from the network weights of a trainer state file of the same
    /// model and network (a warm-started fold); optimiser, replay or rollout stay fresh.
    pub fn warm_start(&mut self, path: &Path) -> Result<()> {
        let what = || format!("warm start from {}", path.display());
        match self {
            Agent::Dqn(t) => t.warm_start(path).with_context(what),
            Agent::Ppo(t) => t.warm_start(path).with_context(what),
        }
    }

    /// Loads a trainer state file written by [`Agent::save`]; a file of the other model is
    /// a clear error naming it.
    pub fn load(model: ModelChoice, path: &Path, device: &Device) -> Result<Self> {
        let what = || format!("loading {} checkpoint {}", model.as_str(), path.display());
        Ok(match model {
            ModelChoice::Dqn => Agent::Dqn(Box::new(DqnTrainer::load_state(path, device).with_context(what)?)),
            ModelChoice::Ppo => Agent::Ppo(Box::new(PpoTrainer::load_state(path, device).with_context(what)?)),
            ModelChoice::Tft | ModelChoice::Mamba2 => {
                anyhow::bail!("{}: {} is a sequence model, not an RL agent", path.display(), model.as_str())
            }
        })
    }

    /// The trainer's state (its checkpoint file's contents) copied to host memory, for
    /// writing later with `StateSnapshot::write` (on the checkpoint writer's thread).
    pub fn snapshot(&self) -> Result<fx_models::StateSnapshot> {
        Ok(match self {
            Agent::Dqn(t) => t.snapshot()?,
            Agent::Ppo(t) => t.snapshot()?,
        })
    }

    /// Optimiser steps applied and skipped so far (over the whole run, resumes included).
    pub fn update_counts(&self) -> (u64, u64) {
        match self {
            Agent::Dqn(t) => (t.updates(), t.skipped_updates()),
            Agent::Ppo(t) => (t.updates(), t.skipped_updates()),
        }
    }

    /// Seconds of the updates since this agent was created or loaded: forward, and
    /// fx-precision's backward / device-wait / optimiser split.
    pub fn update_times(&self) -> (f64, fx_precision::StepTimes) {
        match self {
            Agent::Dqn(t) => t.update_times(),
            Agent::Ppo(t) => t.update_times(),
        }
    }

    /// PPO: host seconds of the updates' phases so far (None for DQN).
    pub fn update_phases(&self) -> Option<fx_models::UpdatePhases> {
        match self {
            Agent::Dqn(_) => None,
            Agent::Ppo(t) => Some(t.update_phases()),
        }
    }

    pub fn env_steps(&self) -> u64 {
        match self {
            Agent::Dqn(t) => t.env_steps(),
            Agent::Ppo(t) => t.env_steps(),
        }
    }

    /// One unit of training: a DQN env step (and its updates), or a PPO iteration
    /// (a full rollout, then the epochs of minibatch updates).
    ///
    /// Unless `read`, the DQN step reads nothing back from the device
    /// (`DqnTrainer::step_with`: its metrics are then absent, its updates only queued), so
    /// the host runs ahead of the GPU. A PPO iteration reads its statistics once, at its end.
    pub fn advance_with(&mut self, env: &mut dyn VecEnv, read: bool) -> Result<Progress> {
        let mut p = Progress::default();
        match self {
            Agent::Dqn(t) => {
                let batch = t.config().batch_size as u64;
                let s = t.step_with(env, read)?;
                p.collect_seconds = s.collect_seconds;
                p.update_seconds = s.update_seconds;
                p.metrics.insert("epsilon".into(), json!(s.epsilon));
                p.metrics.insert("mean_reward".into(), json!(s.mean_reward));
                p.metrics.insert("replay_len".into(), json!(s.replay_len));
                p.metrics.insert("lr".into(), json!(t.config().optimizer.lr));
                if let Some(u) = s.updates.last() {
                    p.loss = Some(u.loss);
                    p.metrics.insert("loss".into(), json!(u.loss));
                    p.metrics.insert("grad_norm".into(), json!(u.grad_norm));
                    p.metrics.insert("loss_scale".into(), json!(u.loss_scale));
                }
                p.updates = s.updates.iter().filter(|u| !u.skipped).count() as u64;
                p.skipped = s.updates.len() as u64 - p.updates;
                // Queued updates count as applied (their rare skips show in the counters).
                p.update_samples = (p.updates + u64::from(s.updates_queued)) * batch;
            }
            Agent::Ppo(t) => {
                let updates_before = t.updates();
                let started = Instant::now();
                t.collect_rollout(env)?;
                p.collect_seconds = started.elapsed().as_secs_f64();
                let started = Instant::now();
                let s = t.update(env)?;
                p.update_seconds = started.elapsed().as_secs_f64();
                let m = &s.mean;
                p.loss = Some(m.loss);
                for (k, v) in [
                    ("loss", m.loss),
                    ("l_clip", m.l_clip),
                    ("l_v", m.l_v),
                    ("entropy", m.entropy),
                    ("approx_kl", m.approx_kl),
                    ("clip_frac", m.clip_frac),
                    ("grad_norm", m.grad_norm),
                    ("explained_variance", s.explained_variance),
                    ("mean_reward", s.mean_reward),
                    ("lr", t.config().optimizer.lr),
                ] {
                    p.metrics.insert(k.into(), json!(v));
                }
                let n = (t.config().num_steps * env.num_envs()) as u64;
                p.skipped = u64::from(s.skipped);
                p.updates = t.updates() - updates_before;
                // Every epoch passes over all n samples once, in minibatches.
                p.update_samples = n * t.config().epochs as u64;
            }
        }
        Ok(p)
    }

    /// The greedy action for one observation (`[56]` f32), for backtests.
    pub fn greedy_action(&self, obs: &[f32], device: &Device) -> Result<u32> {
        let x = Tensor::from_slice(obs, (1, obs.len()), device)?;
        let a = match self {
            Agent::Dqn(t) => t.online().greedy_actions(&x)?,
            Agent::Ppo(t) => t.model().greedy_actions(&x)?,
        };
        Ok(a.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?[0])
    }

    /// The greedy network (DQN online net, PPO actor) on the host, for quantisation.
    pub fn float_net(&self) -> Result<fx_quant::FloatNet> {
        Ok(match self {
            Agent::Dqn(t) => fx_quant::FloatNet::from_dqn(t.online())?,
            Agent::Ppo(t) => fx_quant::FloatNet::from_ppo(t.model())?,
        })
    }

    /// The F32 greedy policy for decisions on the CPU (no pool, no allocation per call).
    pub fn cpu_policy(&self) -> Result<fx_models::mlp::cpu::CpuPolicy> {
        Ok(match self {
            Agent::Dqn(t) => t.online().cpu_policy()?,
            Agent::Ppo(t) => t.model().cpu_policy()?,
        })
    }
}
