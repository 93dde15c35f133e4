//! The opening every training run shares, RL agent or sequence model: the run folder
//! (locked), the config (a resumed run continues under its own; only `--steps` may extend
//! it), the device, the checkpoint to continue from (the newest that verifies, and of the
//! config's model), the data's identity against it, the batch settled for the device, and
//! the config recorded in the folder. `lifecycle` goes on from here.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Device;

use crate::batch::BatchChoice;
use crate::config::RunConfig;
use crate::lifecycle::TrainOptions;
use crate::run_dir::{write_atomic, Checkpoint, RunDir};

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
        fx_hw::DeviceKind::Cuda(n) => open_cuda(n),
    }
}

/// [`RunConfig::check_device_memory`] against the free memory of the run's GPU, as its
/// driver reports it now (nothing to check on the CPU). Once, when the device is open and
/// before anything of the run is on it (a check after the model is built would count its
/// parameters twice), with the config's batch: a budget batch settles later, and a DQN / PPO
/// minibatch's activations are small beside the replay or rollout.
fn check_device_memory(cfg: &RunConfig, device: &Device) -> Result<()> {
    let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() else { return Ok(()) };
    let overrides = fx_hw::Overrides::default().with_device(&format!("cuda:{gpu_id}"));
    match fx_hw::HardwareBudget::detect_with(&overrides).gpu {
        Some(g) => cfg.check_device_memory(g.free_memory_bytes, &format!("cuda:{gpu_id} ({})", g.name)),
        None => Ok(()),
    }
}

/// CUDA device `n` through `fx_hw::open_cuda` (its own stream, pooled); in a build without
/// the `cuda` feature, the error saying so.
#[cfg(feature = "cuda")]
pub(crate) fn open_cuda(n: usize) -> Result<Device> {
    Ok(fx_hw::open_cuda(n)?)
}

/// See the `cuda` build's version.
#[cfg(not(feature = "cuda"))]
pub(crate) fn open_cuda(n: usize) -> Result<Device> {
    bail!("CUDA device {n}: this fx-train was built without the `cuda` feature")
}

/// A run, opened (see the module docs).
pub(crate) struct RunStart {
    pub t_start: Instant,
    pub dir: RunDir,
    /// Resolved; its batch is settled by [`RunStart::settle_batch`].
    pub cfg: RunConfig,
    pub device: Device,
    /// What a resumed run continues from.
    pub checkpoint: Option<Checkpoint>,
    /// The batch once settled (what the first metrics line names).
    pub batch: Option<BatchChoice>,
}

impl RunStart {
    /// Locks the run folder, takes the config (the saved one on `--resume`, with `--steps`
    /// when given), resolves it, opens the device and, on resume, finds the checkpoint.
    pub fn open(cfg: RunConfig, opts: &TrainOptions) -> Result<Self> {
        let t_start = Instant::now();
        let dir = RunDir::open(&cfg.out, opts.resume)?;
        let cfg = if opts.resume {
            let saved = RunConfig::from_toml_file(&dir.path("config.toml"))?.pinned_batch();
            RunConfig { steps: opts.steps.unwrap_or(saved.steps), ..saved }
        } else {
            cfg
        };
        let cfg = cfg.resolve()?;
        let device = device_for(&cfg)?;
        check_device_memory(&cfg, &device)?;
        let checkpoint = match (opts.resume, opts.restart) {
            (true, false) => dir.resume_checkpoint().map_err(crate::run_dir::with_restart_hint)?,
            (true, true) => dir.restart_checkpoint()?,
            (false, _) => None,
        };
        if let Some(c) = &checkpoint {
            c.check_model(cfg.model, "the config asks for")?;
        }
        Ok(Self { t_start, dir, cfg, device, checkpoint, batch: None })
    }

    /// The normalisers a resumed run keeps, one per instrument.
    pub fn saved_normalizers(&self) -> Result<Option<Vec<fx_data::Normalizer>>> {
        self.checkpoint.as_ref().map(|c| c.run.normalizers()).transpose()
    }

    /// A resumed run's data must be the data it started on.
    pub fn check_source(&self, source: &str) -> Result<()> {
        match &self.checkpoint {
            Some(c) => c.check_source(source, "the config now names"),
            None => Ok(()),
        }
    }

    /// Settles the batch for the run's device (`crate::batch`; `train_windows`: the
    /// sequence models' data bound), checks the sizes again with it, and prints it. Once
    /// settled it stays: a task rebuilt after an out-of-memory retry
    /// ([`RunStart::retry_at_smaller_batch`]) gets the batch the retry chose, unprinted.
    pub fn settle_batch(&mut self, train_windows: Option<usize>) -> Result<BatchChoice> {
        if let Some(b) = &self.batch {
            return Ok(b.clone());
        }
        let mut cfg = self.cfg.clone();
        let device = &self.device;
        let batch = crate::batch::resolve(&mut cfg, |c| crate::batch::budget_batch(c, device), train_windows);
        self.cfg = cfg.resolve()?;
        println!("{}", batch.describe(self.cfg.model));
        self.batch = Some(batch.clone());
        Ok(batch)
    }

    /// After the device ran out of memory at start-up: moves a batch taken from the hardware
    /// budget to the next smaller budget tier (`crate::batch::smaller_tier`) and returns the
    /// line saying so; `None` (nothing changed) for a batch the user set or one already at
    /// the smallest tier.
    pub fn retry_at_smaller_batch(&mut self) -> Result<Option<String>> {
        let Some(old) = self.batch.clone() else { return Ok(None) };
        let Some(new) = crate::batch::smaller_tier(&old, self.cfg.model) else { return Ok(None) };
        let mut cfg = self.cfg.clone();
        cfg.set_batch_key(new.value);
        cfg.batch = crate::batch::BatchSize::Fixed(new.value);
        cfg.batch_source = new.source;
        self.cfg = cfg.resolve()?;
        let line = format!(
            "the device ran out of memory at batch {} ({}, source {}): retrying once at the next smaller budget tier, batch {}",
            old.value,
            crate::batch::model_key_name(self.cfg.model),
            old.source.as_str(),
            new.value
        );
        self.batch = Some(new);
        Ok(Some(line))
    }

    /// Writes config.toml for a new run, or for a resumed one whose length `--steps`
    /// changed (so a later resume continues to the same end), and marks the run started.
    pub fn record_config(&mut self, opts: &TrainOptions) -> Result<()> {
        if !opts.resume || opts.steps.is_some() {
            write_atomic(&self.dir.path("config.toml"), self.cfg.to_toml()?.as_bytes())?;
            self.dir.mark_started();
        }
        Ok(())
    }
}
