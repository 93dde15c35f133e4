//! The opening every training run shares, RL agent or sequence model: the run folder
//! (locked), the config (a resumed run continues under its own; only `--steps` may extend
//! it), the device, the checkpoint to continue from (the newest that verifies, and of the
//! config's model), the data's identity against it, the batch settled for the device, and
//! the config recorded in the folder. `train.rs` and `seq_run.rs` go on from here with
//! their own loops.

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;

use crate::batch::BatchChoice;
use crate::config::RunConfig;
use crate::run_dir::{write_atomic, Checkpoint, RunDir};
use crate::train::{device_for, TrainOptions};

/// A run, opened (see the module docs).
pub(crate) struct RunStart {
    pub t_start: Instant,
    pub dir: RunDir,
    /// Resolved; its batch is settled by [`RunStart::settle_batch`].
    pub cfg: RunConfig,
    pub device: Device,
    /// What a resumed run continues from.
    pub checkpoint: Option<Checkpoint>,
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
        let checkpoint = if opts.resume { dir.latest_checkpoint()? } else { None };
        if let Some(c) = &checkpoint {
            c.check_model(cfg.model, "the config asks for")?;
        }
        Ok(Self { t_start, dir, cfg, device, checkpoint })
    }

    /// The normaliser a resumed run keeps (fitted when it started).
    pub fn saved_normalizer(&self) -> Result<Option<fx_data::Normalizer>> {
        self.checkpoint.as_ref().map(|c| c.run.normalizer()).transpose()
    }

    /// A resumed run's data must be the data it started on.
    pub fn check_source(&self, source: &str) -> Result<()> {
        match &self.checkpoint {
            Some(c) => c.check_source(source, "the config now names"),
            None => Ok(()),
        }
    }

    /// Settles the batch for the run's device (`crate::batch`; `train_windows`: the
    /// sequence models' data bound), checks the sizes again with it, and prints it.
    pub fn settle_batch(&mut self, train_windows: Option<usize>) -> Result<BatchChoice> {
        let mut cfg = self.cfg.clone();
        let device = &self.device;
        let batch = crate::batch::resolve(&mut cfg, |c| crate::batch::budget_batch(c, device), train_windows);
        self.cfg = cfg.resolve()?;
        println!("{}", batch.describe(self.cfg.model));
        Ok(batch)
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
