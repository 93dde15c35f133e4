//! Command-line flags. Every flag maps one to one onto a config field.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::batch::BatchSize;

/// Train and evaluate trading models (DQN, PPO, TFT, MAMBA-2) on market features.
#[derive(Debug, Parser)]
#[command(name = "fx-train", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a DQN or PPO agent (then backtest it) or a TFT or MAMBA-2 forecaster (then score
    /// its forecasts); no --data: the embedded synthetic market.
    Train(TrainArgs),
    /// Evaluate the latest checkpoint of a run on its test split (backtest or forecast metrics).
    Eval(EvalArgs),
    /// Print the hardware budget: device, memory, precision, batch sizes (and their sources).
    Hw(HwArgs),
    /// Read OHLCV bars (CSV) and write the feature file (safetensors, schema fx-features/1).
    Features(FeaturesArgs),
    /// Measure training throughput, peak memory and batch-1 latency (bench.py's output shape).
    Bench(crate::bench::BenchArgs),
    /// Train many DQN trials as one population, rank them on the validation split and train the
    /// best again as ordinary runs (see the README's sweep section).
    Sweep(crate::sweep::SweepArgs),
    /// Quantise the latest DQN/PPO checkpoint of a run to INT8 (file beside it + quant_report.json).
    Quantize(QuantizeArgs),
}

#[derive(Debug, Args, Default)]
pub struct HwArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Device to plan for: auto, cpu, cuda or cuda:N (default: auto; env FX_DEVICE).
    #[arg(long)]
    pub device: Option<String>,
    /// Compute precision: f32, bf16 or f16 (default: from the hardware; env FX_PRECISION).
    #[arg(long)]
    pub precision: Option<fx_hw::Precision>,
    /// Batch size for every model (default: from the budget; env FX_BATCH_SIZE).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// On a GPU, measure bytes per sample with a small MLP training step (default: on with cuda).
    #[arg(long)]
    pub no_probe: bool,
}

#[derive(Debug, Args)]
pub struct FeaturesArgs {
    /// OHLCV CSV input (columns timestamp|date|time|datetime, open, high, low, close, volume).
    #[arg(long)]
    pub input: PathBuf,
    /// Feature file to write (safetensors); written to a temporary file, then renamed.
    #[arg(long)]
    pub output: PathBuf,
}

/// Flags of `fx-train train`; each sets the config field of the same name (they win over
/// `FX_DEVICE` / `FX_PRECISION` / `FX_BATCH_SIZE`, which win over `--config`). Defaults are `RunConfig::default()` (see `config.toml` in a run folder).
#[derive(Debug, Args, Default)]
pub struct TrainArgs {
    /// Model to train: dqn, ppo (RL agents), tft, mamba2 (return forecasters) [default: dqn].
    #[arg(long, value_enum)]
    pub model: Option<crate::config::ModelChoice>,
    /// Feature file (.safetensors) or OHLCV bars (.csv) [default: the synthetic market].
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// TOML file with any RunConfig fields.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run folder [default: runs/default].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Environment steps to train for (dqn, ppo) [default: 2000].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Epochs to train for (tft, mamba2; early stopping may end sooner) [default: 4].
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Seed of weights, environment draws and synthetic market [default: 7].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute precision: f32, bf16 or f16 [default: f32].
    #[arg(long)]
    pub precision: Option<fx_hw::Precision>,
    /// Device: auto, cpu, cuda, cuda:N [default: auto].
    #[arg(long)]
    pub device: Option<String>,
    /// CUDA graph of the training step: auto, on, off [default: auto; ignored on the CPU].
    #[arg(long)]
    pub graph: Option<fx_precision::GraphMode>,
    /// CPU threads for candle's CPU kernels [default: 1 for dqn/ppo, every usable CPU for
    /// tft/mamba2; env FX_THREADS].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Batch of the model: auto (the hardware budget's for the device, bounded by the data;
    /// on the CPU the config's) or a number [default: auto; env FX_BATCH_SIZE].
    #[arg(long)]
    pub batch_size: Option<crate::batch::BatchSize>,
    /// Accounts stepped together [default: 32].
    #[arg(long)]
    pub num_envs: Option<usize>,
    /// Environment steps between checkpoints [default: 500].
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Environment steps between metrics lines [default: 50].
    #[arg(long)]
    pub log_every: Option<u64>,
    /// Walk-forward folds: a study of K train -> validation -> test spans in time order, one
    /// run per fold and seed (dqn, ppo) [default: none, one run on the split].
    #[arg(long)]
    pub folds: Option<usize>,
    /// Walk-forward training span: expanding or rolling [default: expanding; needs --folds].
    #[arg(long)]
    pub window: Option<fx_data::Window>,
    /// Seeds per fold (seed, seed+1, ...; more than 1 makes a study) [default: 1].
    #[arg(long)]
    pub seeds: Option<usize>,
    /// Trials tried before this study (e.g. a sweep's count), counted in the deflated Sharpe
    /// ratio [default: 0].
    #[arg(long)]
    pub prior_trials: Option<usize>,
    /// Walk-forward: each fold after the first starts from the previous fold's final weights
    /// (same seed; optimiser, replay and exploration fresh) [needs --folds].
    #[arg(long)]
    pub warm_start: bool,
    /// A DQN / PPO study's runs (a member per fold and seed) train together as one
    /// population [needs --folds or --seeds].
    #[arg(long)]
    pub population: bool,
    /// Continue the run (or study) in --out from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// With --resume: where a run's checkpoints all fail to verify, start it over from step 0
    /// under its saved config (the damaged files moved into damaged/) instead of refusing;
    /// a run with a checkpoint that verifies continues from it as usual.
    #[arg(long, requires = "resume")]
    pub restart: bool,
    /// No progress bar (also when stdout is not a terminal).
    #[arg(long)]
    pub quiet: bool,
}

impl TrainArgs {
    /// Refuses flags that cannot apply: with `--resume` the run continues under its saved
    /// `config.toml`, so a flag may repeat a saved value but not change it (the error names
    /// both); `--steps` is for dqn/ppo and `--epochs` for tft/mamba2 (never silently
    /// ignored). Returns the run's model and `threads` setting (the saved ones on resume).
    pub fn check_flags(&self) -> anyhow::Result<(crate::config::ModelChoice, Option<usize>)> {
        use crate::config::RunConfig;
        let saved = match (&self.resume, self.out.clone().unwrap_or_else(|| RunConfig::default().out)) {
            (true, out) if out.join("config.toml").exists() => {
                Some(RunConfig::from_toml_file(&out.join("config.toml"))?)
            }
            // No run there: RunDir::open says so.
            _ => None,
        };
        let model = match &saved {
            Some(s) => s.model,
            None => match (self.model, &self.config) {
                (Some(m), _) => m,
                (None, Some(c)) => RunConfig::from_toml_file(c)?.model,
                (None, None) => RunConfig::default().model,
            },
        };
        if model.is_sequence() && self.steps.is_some() {
            anyhow::bail!(
                "--steps counts environment steps of dqn/ppo runs; a {} run trains for --epochs",
                model.as_str()
            );
        }
        if !model.is_sequence() && self.epochs.is_some() {
            anyhow::bail!(
                "--epochs is for tft/mamba2 runs; a {} run trains for --steps (environment steps)",
                model.as_str()
            );
        }
        let Some(saved) = saved else {
            return Ok((model, self.threads));
        };
        let path_str = |p: &Option<PathBuf>| p.as_ref().map_or("none".to_string(), |p| p.display().to_string());
        let folds = |c: &RunConfig| c.walk_forward.as_ref().map_or("none".to_string(), |w| w.folds.to_string());
        let window = |c: &RunConfig| {
            c.walk_forward.as_ref().map_or("none".to_string(), |w| format!("{:?}", w.window).to_lowercase())
        };
        let given: [(&str, Option<String>, String); 17] = [
            ("--warm-start", self.warm_start.then(|| "true".to_string()), saved.warm_start.to_string()),
            ("--population", self.population.then(|| "true".to_string()), saved.population.to_string()),
            ("--folds", self.folds.map(|n| n.to_string()), folds(&saved)),
            ("--window", self.window.map(|w| format!("{w:?}").to_lowercase()), window(&saved)),
            ("--seeds", self.seeds.map(|n| n.to_string()), saved.seeds.to_string()),
            ("--prior-trials", self.prior_trials.map(|n| n.to_string()), saved.prior_trials.to_string()),
            ("--model", self.model.map(|m| m.as_str().to_string()), saved.model.as_str().to_string()),
            ("--data", self.data.as_ref().map(|d| d.display().to_string()), path_str(&saved.data)),
            ("--epochs", self.epochs.map(|n| n.to_string()), saved.seq.epochs.to_string()),
            ("--seed", self.seed.map(|n| n.to_string()), saved.seed.to_string()),
            ("--precision", self.precision.map(|p| p.to_string()), saved.precision.to_string()),
            ("--device", self.device.clone(), saved.device.clone()),
            ("--graph", self.graph.map(|g| g.to_string()), saved.graph.to_string()),
            ("--num-envs", self.num_envs.map(|n| n.to_string()), saved.env.num_envs.to_string()),
            // The saved batch is the number the run used ("auto" settled at its start).
            (
                "--batch-size",
                self.batch_size.filter(|b| *b != BatchSize::Auto).map(|b| b.to_string()),
                saved.batch_key_value().to_string(),
            ),
            ("--checkpoint-every", self.checkpoint_every.map(|n| n.to_string()), saved.checkpoint_every.to_string()),
            ("--log-every", self.log_every.map(|n| n.to_string()), saved.log_every.to_string()),
        ];
        for (flag, given, saved) in given {
            if let Some(g) = given.filter(|g| *g != saved) {
                anyhow::bail!(
                    "{flag} {g} differs from the saved run's {saved}: --resume continues the run as it was started \
                     (only --steps can change; start a new run with another --out to change the rest)"
                );
            }
        }
        if let Some(c) = &self.config {
            let mut from_file = RunConfig::from_toml_file(c)?;
            from_file.out = saved.out.clone();
            from_file.steps = saved.steps;
            // A study's folds, window, seeds, warm start and prior trials came from flags
            // (checked against the saved run above): the file that started it holds none
            // of them, and resuming with it is resuming the same study.
            match (&mut from_file.walk_forward, &saved.walk_forward) {
                (None, w) => from_file.walk_forward.clone_from(w),
                (Some(f), Some(w)) => {
                    f.folds = w.folds;
                    f.window = w.window;
                }
                (Some(_), None) => {}
            }
            if from_file.seeds == 1 {
                from_file.seeds = saved.seeds;
            }
            if from_file.prior_trials == 0 {
                from_file.prior_trials = saved.prior_trials;
            }
            from_file.warm_start |= saved.warm_start;
            from_file.population |= saved.population;
            // The flags given now equal the saved run's (checked above) and, as at the
            // start, override the file's keys.
            if self.epochs.is_some() {
                from_file.seq.epochs = saved.seq.epochs;
            }
            if self.seed.is_some() {
                from_file.seed = saved.seed;
            }
            if self.precision.is_some() {
                from_file.precision = saved.precision;
            }
            if self.device.is_some() {
                from_file.device.clone_from(&saved.device);
            }
            if self.graph.is_some() {
                from_file.graph = saved.graph;
            }
            if self.num_envs.is_some() {
                from_file.env.num_envs = saved.env.num_envs;
            }
            if self.checkpoint_every.is_some() {
                from_file.checkpoint_every = saved.checkpoint_every;
            }
            if self.log_every.is_some() {
                from_file.log_every = saved.log_every;
            }
            if self.model.is_some() {
                from_file.model = saved.model;
            }
            if self.data.is_some() {
                from_file.data.clone_from(&saved.data);
            }
            // A study's config.toml is its config as given (each of its runs resolves its
            // own, seeds included), so the file compares unresolved.
            if crate::study::is_study(&saved) {
                from_file.threads = saved.threads;
                // As written: fields config.toml does not hold (where the batch came from)
                // do not count.
                if from_file.to_toml()? != saved.to_toml()? {
                    anyhow::bail!(
                        "--config {} differs from the saved study's config.toml: --resume continues the study as it was started (give the flags it started with, or leave --config out)",
                        c.display()
                    );
                }
                return Ok((model, self.threads.or(saved.threads)));
            }
            // The saved config holds the number "auto" settled to; the file's own model key,
            // when it sets one, must equal it (compared with everything else below).
            // A --batch-size given with the file overrode it (and equals the saved value,
            // checked above).
            let n = match (self.batch_size, from_file.batch) {
                (Some(BatchSize::Fixed(n)), _) => Some(n),
                // `--batch-size auto` overrode the file's keys at the start: the saved
                // number is what it settled to.
                (Some(BatchSize::Auto), _) => Some(saved.batch_key_value()),
                (None, BatchSize::Auto) if from_file.model_key_given() => Some(from_file.batch_key_value()),
                (None, BatchSize::Auto) => Some(saved.batch_key_value()),
                // The file's `batch = N` set the model key at the start (config.toml, which
                // records every key, holds both).
                (None, BatchSize::Fixed(n)) if !from_file.model_key_given() => Some(n),
                (None, BatchSize::Fixed(_)) => None,
            };
            if let Some(n) = n {
                from_file.batch = BatchSize::Fixed(n);
                from_file.set_batch_key(n);
            }
            let saved = saved.clone().pinned_batch();
            from_file.batch_source = saved.batch_source;
            from_file.batch_keys_given = saved.batch_keys_given;
            if from_file.resolve()? != saved {
                anyhow::bail!(
                    "--config {} differs from the saved run's config.toml: --resume continues the run as it was started (give the flags it started with, or leave --config out)",
                    c.display()
                );
            }
        }
        Ok((model, self.threads.or(saved.threads)))
    }

    /// The config: defaults, then `--config`, then the flags.
    pub fn to_config(&self) -> anyhow::Result<crate::config::RunConfig> {
        let mut cfg = match &self.config {
            Some(p) => crate::config::RunConfig::from_toml_file(p)?,
            None => crate::config::RunConfig::default(),
        };
        if let Some(m) = self.model {
            cfg.model = m;
        }
        // The environment overrides the config file; the flags below override both.
        cfg.apply_env_overrides(&fx_hw::Overrides::from_env()?);
        if let Some(d) = &self.data {
            cfg.data = Some(d.clone());
        }
        if let Some(o) = &self.out {
            cfg.out = o.clone();
        }
        if let Some(s) = self.steps {
            cfg.steps = s;
        }
        if let Some(n) = self.epochs {
            cfg.seq.epochs = n;
        }
        if let Some(s) = self.seed {
            cfg.seed = s;
        }
        if let Some(p) = self.precision {
            cfg.precision = p;
        }
        if let Some(d) = &self.device {
            cfg.device = d.clone();
        }
        if let Some(g) = self.graph {
            cfg.graph = g;
        }
        if let Some(n) = self.threads {
            cfg.threads = Some(n);
        }
        if let Some(b) = self.batch_size {
            cfg.batch = b;
            cfg.batch_source = crate::batch::BatchSource::Flag;
            // `--batch-size auto` asks for the budget even over a model key in the file.
            cfg.batch_keys_given = crate::config::BatchKeysGiven::default();
        }
        if let Some(n) = self.num_envs {
            cfg.env.num_envs = n;
        }
        if let Some(n) = self.checkpoint_every {
            cfg.checkpoint_every = n;
        }
        if let Some(n) = self.log_every {
            cfg.log_every = n;
        }
        if let Some(k) = self.folds {
            cfg.walk_forward.get_or_insert_with(Default::default).folds = k;
        }
        if let Some(w) = self.window {
            match cfg.walk_forward.as_mut() {
                Some(wf) => wf.window = w,
                None => anyhow::bail!("--window sets the walk-forward training span: give --folds too"),
            }
        }
        if let Some(n) = self.seeds {
            cfg.seeds = n;
        }
        if let Some(n) = self.prior_trials {
            cfg.prior_trials = n;
        }
        if self.warm_start {
            cfg.warm_start = true;
        }
        if self.population {
            cfg.population = true;
        }
        Ok(cfg)
    }
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Run folder whose latest checkpoint to evaluate.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Backtest the INT8 policy written by `fx-train quantize` beside the F32 one (eval_int8.json).
    #[arg(long)]
    pub int8: bool,
}

/// How `quantize` picks each layer's input scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantMethod {
    /// Each decision's own largest |input| per layer (nothing clips; min-max scales are
    /// still calibrated and recorded).
    Dynamic,
    /// The largest |input| seen on the calibration rows.
    Minmax,
    /// The --percentile-th percentile of |input| (outliers clip).
    Percentile,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Run folder whose latest checkpoint to quantise (a dqn, ppo, tft or mamba2 run).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Calibration rows, spread evenly over the training split: observations of a greedy
    /// replay (dqn, ppo; default 2048) or forecast windows (tft; default 256).
    #[arg(long)]
    pub calib_rows: Option<usize>,
    /// Input-scale calibration method.
    #[arg(long, value_enum, default_value_t = QuantMethod::Dynamic)]
    pub method: QuantMethod,
    /// Percentile of |input| for --method percentile.
    #[arg(long, default_value_t = 99.99)]
    pub percentile: f64,
    /// Layers to keep in F32 (spec names, comma-separated, e.g. value,advantage; dqn and ppo).
    #[arg(long, value_delimiter = ',')]
    pub f32_layers: Vec<String>,
}
